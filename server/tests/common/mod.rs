//! A real `redis-server` for the service's tests: started on a free port,
//! with no persistence, stopped when dropped. A test that needs one and
//! cannot start it fails (never skips).

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` process of this test.
pub struct RedisServer {
    child: Child,
    /// `redis://127.0.0.1:<port>`.
    pub url: String,
    /// Its port.
    pub port: u16,
}

impl RedisServer {
    /// Starts one on a free port and waits until it answers.
    pub fn start() -> RedisServer {
        for _ in 0..5 {
            let port = free_port();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be on PATH for these tests");
            let mut server = RedisServer {
                child,
                url: format!("redis://127.0.0.1:{port}"),
                port,
            };
            if server.answers(Duration::from_secs(5)) {
                return server;
            }
            server.stop();
        }
        panic!("could not start redis-server on a free port");
    }

    fn answers(&mut self, within: Duration) -> bool {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false; // exited: the port was taken meanwhile
            }
            let pong = Command::new("redis-cli")
                .args(["-p", &self.port.to_string(), "PING"])
                .output()
                .map(|o| o.stdout.starts_with(b"PONG"))
                .unwrap_or(false);
            if pong {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Stops it (the store then fails).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A port nothing listens on now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}
