//! `FaultProxy`: a TCP proxy on 127.0.0.1 in front of a Redis, with
//! switches that make connections go silent, refuse or reset: the network
//! failures a client must survive, without touching the server.
//!
//! The proxy runs on an OS thread of its own with its own tokio runtime, so
//! it keeps forwarding while the test's runtime is paused or busy.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Notify};

/// A TCP proxy from `127.0.0.1:PORT` to one upstream address. Stops (and
/// closes every connection) on drop.
pub struct FaultProxy {
    port: u16,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    accepted: AtomicU64,
    silent_all: AtomicBool,
    refuse: AtomicBool,
}

/// The switches of one proxied connection.
#[derive(Default)]
struct Conn {
    silent: AtomicBool,
    kill: Notify,
}

impl FaultProxy {
    /// A proxy to `upstream` (e.g. `(Ipv4Addr::LOCALHOST, port)`), listening
    /// on a free port of 127.0.0.1 once this returns.
    pub fn start(upstream: impl Into<SocketAddr>) -> FaultProxy {
        let upstream = upstream.into();
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .expect("bind the proxy's port on 127.0.0.1");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let port = listener.local_addr().expect("the proxy's address").port();
        let shared = Arc::new(Shared::default());
        let (shutdown, stop) = oneshot::channel();
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("fault-proxy-{port}"))
                .spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("the proxy's runtime");
                    runtime.block_on(async move {
                        let listener =
                            TcpListener::from_std(listener).expect("the proxy's listener");
                        tokio::select! {
                            _ = stop => {}
                            _ = accept_loop(listener, upstream, shared) => {}
                        }
                    });
                    // Dropping the runtime drops every connection task and
                    // so closes their sockets.
                })
                .expect("start the proxy thread")
        };
        FaultProxy {
            port,
            upstream,
            shared,
            shutdown: Some(shutdown),
            thread: Some(thread),
        }
    }

    /// A proxy to the Redis at `127.0.0.1:port`.
    pub fn to_port(port: u16) -> FaultProxy {
        FaultProxy::start((Ipv4Addr::LOCALHOST, port))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// `redis://127.0.0.1:PORT/`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Every connection open now stops forwarding, in both directions, but
    /// stays open: what it receives is read and dropped. Connections
    /// accepted afterwards forward normally (unless `set_silent_all`).
    /// A silenced connection never speaks again (a stream with requests
    /// dropped out of it could not be trusted).
    pub fn go_silent(&self) {
        for conn in self.shared.conns.lock().unwrap().values() {
            conn.silent.store(true, Ordering::SeqCst);
        }
    }

    /// `true`: every open connection goes silent, and so does every one
    /// accepted from now on. `false`: new connections forward again (the
    /// silenced ones stay silent).
    pub fn set_silent_all(&self, silent: bool) {
        self.shared.silent_all.store(silent, Ordering::SeqCst);
        if silent {
            self.go_silent();
        }
    }

    /// `true`: new connections are accepted and closed at once.
    pub fn refuse(&self, refuse: bool) {
        self.shared.refuse.store(refuse, Ordering::SeqCst);
    }

    /// Resets every open connection (both sides, with RST).
    pub fn kill_all(&self) {
        for conn in self.shared.conns.lock().unwrap().values() {
            conn.kill.notify_one();
        }
    }

    /// Proxied connections open now.
    pub fn connections(&self) -> usize {
        self.shared.conns.lock().unwrap().len()
    }

    /// Connections accepted since the start (refused ones included).
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, shared: Arc<Shared>) {
    let mut next_id = 0u64;
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // EMFILE and the like: try again shortly.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        if shared.refuse.load(Ordering::SeqCst) {
            drop(client);
            continue;
        }
        next_id += 1;
        let id = next_id;
        let conn = Arc::new(Conn::default());
        conn.silent
            .store(shared.silent_all.load(Ordering::SeqCst), Ordering::SeqCst);
        shared.conns.lock().unwrap().insert(id, conn.clone());
        let shared = shared.clone();
        tokio::spawn(async move {
            serve(client, upstream, &conn).await;
            shared.conns.lock().unwrap().remove(&id);
        });
    }
}

async fn serve(mut client: TcpStream, upstream: SocketAddr, conn: &Conn) {
    let _ = client.set_nodelay(true);
    let mut server =
        match tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(upstream)).await {
            Ok(Ok(server)) => server,
            _ => return,
        };
    let _ = server.set_nodelay(true);
    let killed = {
        let (mut client_read, mut client_write) = client.split();
        let (mut server_read, mut server_write) = server.split();
        tokio::select! {
            _ = conn.kill.notified() => true,
            // The client hangs up: close both sides, silent or not.
            _ = pump(&mut client_read, &mut server_write, conn, false) => false,
            // The server hangs up: close both, unless the connection is
            // silent (then the client must see nothing, not even that).
            _ = pump(&mut server_read, &mut client_write, conn, true) => false,
        }
    };
    if killed {
        let _ = client.set_zero_linger();
        let _ = server.set_zero_linger();
    }
}

/// Forwards `from` to `to` until `from` ends or a write fails; while the
/// connection is silent, drops what it reads. With `hold_when_silent`, an
/// end of `from` during silence is not passed on: the future never ends.
async fn pump(
    from: &mut (impl AsyncRead + Unpin),
    to: &mut (impl AsyncWrite + Unpin),
    conn: &Conn,
    hold_when_silent: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                if hold_when_silent && conn.silent.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                return;
            }
            Ok(n) => n,
        };
        if conn.silent.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
