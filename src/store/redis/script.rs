//! The decision library as Redis runs it: a Function library loaded once
//! per server (`FCALL`, Redis 7 and later), or the same code as a script
//! (`EVALSHA`), and the one call that runs it, loading it where missing.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use redis::Script;

use super::conn::Lanes;
use super::connector::Conn;
use super::encode::Encoded;
use crate::store::{lock, Deadline};
use crate::Error;

/// The decision code: the helpers, the algorithms, the wire (their ids and
/// key counts, written from `algorithm::wire`), then the driver, which
/// defines `decide(keys, args)`; assembled from `lua/` by `build.rs`, which
/// writes each algorithm's one-limit decision from its steps.
const CODE: &str = include_str!(concat!(env!("OUT_DIR"), "/library.lua"));

/// How the decision code reaches Redis: as a Function library loaded once
/// per server (`FCALL`, Redis 7 and later), or as a script (`EVALSHA`).
///
/// The function has no flags: Redis refuses it as a whole (an `OOM` error,
/// which the store's policy answers: `OnStoreError`) while it is over
/// `maxmemory` and eviction cannot bring it under (`noeviction`, or the
/// library's own memory, clients and buffers), as it refuses any write, and
/// as it refuses the script's first write. Flagged `allow-oom`, as it was,
/// it wrote past `maxmemory` with nothing to bound it: each new key a
/// decision writes (about 320 bytes for a sliding log; 2000 new keys grew a
/// full 2 MB Redis by 633 KB in `tests/operations.rs`), until the host
/// runs out. Under an eviction policy Redis evicts before it runs the
/// function, and decisions go on.
pub(super) struct Delivery {
    /// `FUNCTION LOAD` source. Library and function are named after the
    /// code's SHA1, so instances running different versions of this crate
    /// on one Redis (a rolling deploy) each call their own.
    pub(super) library: String,
    pub(super) function: String,
    /// The same code as a script, for servers without Functions.
    pub(super) script: Script,
}

pub(super) static DELIVERY: LazyLock<Delivery> = LazyLock::new(|| {
    let script = Script::new(&format!("{CODE}\nreturn decide(KEYS, ARGV)\n"));
    // named by the code and the registration (its flags): an older
    // version's library, registered `allow-oom`, is not called in its place
    let code = Script::new(&format!("{CODE}\n-- registered without flags\n"));
    let function = format!("tower_ratelimit_{}", &code.get_hash()[..16]);
    Delivery {
        library: format!(
            "#!lua name={function}\n{CODE}\n\
             redis.register_function{{function_name = '{function}', callback = decide}}\n"
        ),
        function,
        script,
    }
});

/// How long decisions run as scripts after a failed `FUNCTION LOAD`.
const LOAD_RETRY: Duration = Duration::from_secs(10);

/// [`Library::mode`]: Functions in use, or missing on this server (0:
/// untried, a new library's mode).
const FUNCTIONS: u8 = 1;
const SCRIPTS: u8 = 2;

/// The library on the store's servers: how it is called (`FCALL`, or
/// `EVALSHA` where Functions are missing or failed to load), and its
/// loading.
#[derive(Default)]
pub(super) struct Library {
    /// 0 (untried), `FUNCTIONS` or `SCRIPTS`.
    mode: AtomicU8,
    /// Held while the library is loaded: one `FUNCTION LOAD` at a time, the
    /// other decisions wait for it rather than each compiling the library.
    loading: tokio::sync::Mutex<()>,
    /// After a failed `FUNCTION LOAD` (say, Redis over `maxmemory` refuses
    /// it), decisions run as scripts until then, and the load is tried again.
    scripts_until: Mutex<Option<tokio::time::Instant>>,
    /// Whether `scripts_until` may hold a time: read by every decision, so
    /// that the common one takes no lock.
    load_failed: AtomicBool,
}

impl Library {
    /// Runs the decision code for `encoded` over a connection of `lanes`
    /// (see [`Lanes::run`]), by `deadline`: `FCALL`, loading the library
    /// when the server lacks it (a new server, a flushed one, a promoted
    /// replica), or `EVALSHA` on a server without Functions (before Redis
    /// 7). The one way every operation but a reset reaches Redis.
    ///
    /// Only the common path, one `FCALL` that finds the library, lives in
    /// this future; loading the library and `EVALSHA` are boxed in
    /// [`call_slowly`](Self::call_slowly), so that every decision's future
    /// (which holds this one) stays small: it is moved and allocated per
    /// decision.
    pub(super) async fn call(
        &self,
        lanes: &Arc<Lanes>,
        encoded: &Encoded,
        deadline: Deadline,
    ) -> Result<Vec<u8>, Error> {
        lanes
            .run(deadline, |mut conn| async move {
                let conn = &mut conn;
                let mode = self.mode.load(Ordering::Relaxed);
                if mode == SCRIPTS || self.load_failed_lately() {
                    return Box::pin(self.call_slowly(conn, encoded, None)).await;
                }
                let delivery = &*DELIVERY;
                // sized up front, so that the command's buffers are allocated once
                let count = encoded.key_count() + encoded.arg_count();
                let data = encoded.byte_len() + delivery.function.len() + 32;
                let mut fcall = redis::Cmd::with_capacity(count + 3, data);
                fcall
                    .arg("FCALL")
                    .arg(&delivery.function)
                    .arg(encoded.key_count());
                for arg in encoded.keys().chain(encoded.args()) {
                    fcall.arg(arg);
                }
                match conn.query::<Vec<u8>>(&fcall).await {
                    Ok(values) => {
                        // written once, not by every decision: a store to the line
                        // that every thread reads
                        if mode != FUNCTIONS {
                            self.mode.store(FUNCTIONS, Ordering::Relaxed);
                        }
                        Ok(values)
                    }
                    Err(e) if is_missing_function(&e) || is_unknown_command(&e) => {
                        Box::pin(self.call_slowly(conn, encoded, Some((fcall, e)))).await
                    }
                    Err(e) => Err(e),
                }
            })
            .await
    }

    /// [`call`](Self::call) after its `FCALL` failed (`failed`: the command
    /// and its error) for want of the library or of Functions, or at once
    /// while the store decides with `EVALSHA`.
    async fn call_slowly(
        &self,
        conn: &mut Conn,
        encoded: &Encoded,
        failed: Option<(redis::Cmd, redis::RedisError)>,
    ) -> redis::RedisResult<Vec<u8>> {
        let delivery = &*DELIVERY;
        match failed {
            Some((fcall, e)) if is_missing_function(&e) => {
                let _loading = self.loading.lock().await;
                // another decision may have loaded it while this one waited
                match fcall.query_async::<Vec<u8>>(conn).await {
                    Err(e) if is_missing_function(&e) => {}
                    done => return done,
                }
                tracing::debug!(target: "tower_ratelimit", library = %delivery.function, "loading the decision library");
                let loaded = redis::cmd("FUNCTION")
                    .arg("LOAD")
                    .arg(&delivery.library)
                    .query_async::<String>(conn)
                    .await;
                match loaded {
                    // loaded, or another process loaded it first
                    Ok(_) => return fcall.query_async(conn).await,
                    Err(e) if e.to_string().contains("already exists") => {
                        return fcall.query_async(conn).await
                    }
                    Err(e) => {
                        tracing::warn!(target: "tower_ratelimit", error = %e, "cannot load the decision library; deciding with EVALSHA for {LOAD_RETRY:?}");
                        *lock(&self.scripts_until) = Some(tokio::time::Instant::now() + LOAD_RETRY);
                        self.load_failed.store(true, Ordering::Relaxed);
                    }
                }
            }
            Some(_) => {
                tracing::info!(target: "tower_ratelimit", "Redis has no Functions (before 7.0): deciding with EVALSHA");
                self.mode.store(SCRIPTS, Ordering::Relaxed);
            }
            None => {}
        }
        let mut invocation = delivery.script.prepare_invoke();
        for key in encoded.keys() {
            invocation.key(key);
        }
        for arg in encoded.args() {
            invocation.arg(arg);
        }
        invocation.invoke_async(conn).await
    }

    /// Whether a recent `FUNCTION LOAD` failed, so decisions run as scripts.
    fn load_failed_lately(&self) -> bool {
        if !self.load_failed.load(Ordering::Relaxed) {
            return false;
        }
        let mut until = lock(&self.scripts_until);
        match *until {
            Some(at) if tokio::time::Instant::now() < at => true,
            Some(_) => {
                *until = None;
                self.load_failed.store(false, Ordering::Relaxed);
                false
            }
            None => false,
        }
    }
}

fn is_missing_function(e: &redis::RedisError) -> bool {
    e.to_string().contains("Function not found")
}

fn is_unknown_command(e: &redis::RedisError) -> bool {
    let text = e.to_string();
    text.contains("unknown command") && (text.contains("FCALL") || text.contains("fcall"))
}
