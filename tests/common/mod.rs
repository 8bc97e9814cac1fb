//! Test support: a real `redis-server` started by the tests themselves.
#![allow(dead_code)]

pub mod cluster;
pub mod process;
pub mod proxy;
pub mod sentinel;
pub mod tls;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tower_ratelimit::{ManualClock, RedisStore};

/// A `redis-server` child bound to 127.0.0.1 on a free port. It runs under a
/// `sh` wrapper that kills it when our end of its stdin closes, so a crashed or
/// finished test process never leaves a server behind.
pub struct TestRedis {
    pub url: String,
    pub port: u16,
    child: Option<Child>,
}

impl TestRedis {
    /// A server of our own (for tests that stop it).
    pub fn spawn() -> TestRedis {
        Self::spawn_with("")
    }

    /// A server of our own with extra command-line options (shell words).
    pub fn spawn_with(options: &str) -> TestRedis {
        let port = process::free_port();
        let url = format!("redis://127.0.0.1:{port}/");
        let mut server = TestRedis {
            url,
            port,
            child: Some(Self::start(port, options)),
        };
        server.wait_ready();
        server
    }

    /// Starts the server binary (see [`process::server_binary`]) on `port`
    /// under its `sh` wrapper.
    fn start(port: u16, options: &str) -> Child {
        let server = process::server_binary();
        let script = format!(
            "'{server}' --port {port} --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
             --loglevel warning {options} & pid=$!; read _; kill $pid; wait $pid"
        );
        Command::new("sh")
            .arg("-c")
            .arg(&script)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("could not run sh to start redis-server")
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(client) = redis::Client::open(self.url.as_str()) {
                if let Ok(mut conn) = client.get_connection() {
                    if redis::cmd("PING").query::<String>(&mut conn).is_ok() {
                        return;
                    }
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "redis-server did not start on port {}: is it installed? Install it with \
                     `apt-get install -y redis-server`, or set REDIS_URL to a Redis you own.",
                    self.port
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server (its port then refuses connections).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            drop(child.stdin.take());
            let _ = child.wait();
        }
    }

    /// Starts a stopped server again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        self.child = Some(Self::start(self.port, ""));
        self.wait_ready();
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The URL of the Redis shared by this test binary: `REDIS_URL` when set, else
/// a server started for it.
pub fn redis_url() -> String {
    static SHARED: OnceLock<String> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            if let Ok(url) = std::env::var("REDIS_URL") {
                let client =
                    redis::Client::open(url.as_str()).expect("REDIS_URL is not a valid Redis URL");
                let mut conn = client
                    .get_connection()
                    .unwrap_or_else(|e| panic!("REDIS_URL={url} is set but unreachable: {e}"));
                let _: String = redis::cmd("PING")
                    .query(&mut conn)
                    .expect("PING the REDIS_URL server");
                return url;
            }
            let server = TestRedis::spawn();
            let url = server.url.clone();
            // Kept for the life of the process; the wrapper stops the server at exit.
            std::mem::forget(server);
            url
        })
        .clone()
}

/// A key prefix no other test (or earlier run) uses.
pub fn unique_prefix(test: &str) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("t-{test}-{}-{n}-{nanos}", std::process::id())
}

pub fn redis_store(prefix: &str) -> RedisStore {
    RedisStore::builder(redis_url())
        .prefix(prefix)
        .build()
        .expect("build the Redis store")
}

/// How much longer than their state keys live in stores on a test clock:
/// Redis expires keys in real time while the test clock stands still, so an
/// exact expiry would race the test (a state 500 us from fresh on the test
/// clock would vanish 1 ms of real time later).
pub const TEST_CLOCK_SLACK: Duration = Duration::from_secs(30);

pub fn redis_store_with_clock(prefix: &str, clock: &ManualClock) -> RedisStore {
    RedisStore::builder(redis_url())
        .prefix(prefix)
        .expiry_slack(TEST_CLOCK_SLACK)
        .clock(clock.clone())
        .build()
        .expect("build the Redis store")
}

/// A store on the shared test cluster (`cluster::shared`), on a test clock.
#[cfg(feature = "cluster")]
pub fn cluster_store_with_clock(prefix: &str, clock: &ManualClock) -> RedisStore {
    RedisStore::cluster_builder(cluster::shared().seed_urls())
        .prefix(prefix)
        .expiry_slack(TEST_CLOCK_SLACK)
        .clock(clock.clone())
        .build()
        .expect("a cluster store")
}

/// One limiter of `limit` per store a table runs on, all on `clock`: the
/// memory store, a Redis, and (with the `cluster` feature) the shared test
/// cluster, each under the key prefix `prefix`.
pub fn limiters_on_clock(
    prefix: &str,
    limit: &tower_ratelimit::Limit,
    clock: &ManualClock,
) -> Vec<(&'static str, tower_ratelimit::Limiter)> {
    #[allow(unused_mut)]
    let mut limiters = vec![
        (
            "memory",
            patient_limiter(
                tower_ratelimit::MemoryStore::with_clock(clock.clone()),
                limit.clone(),
            ),
        ),
        (
            "redis",
            patient_limiter(redis_store_with_clock(prefix, clock), limit.clone()),
        ),
    ];
    // the same table on a Redis Cluster of three primaries and three replicas
    #[cfg(feature = "cluster")]
    limiters.push((
        "cluster",
        patient_limiter(cluster_store_with_clock(prefix, clock), limit.clone()),
    ));
    limiters
}

pub fn connection() -> redis::Connection {
    redis::Client::open(redis_url())
        .expect("client")
        .get_connection()
        .expect("connect to the test Redis")
}

/// Store calls in behaviour tests may wait this long: a loaded machine must
/// not turn a slow answer into a failure of something else. (Timeouts have
/// tests of their own.)
pub const PATIENT: Duration = Duration::from_secs(10);

/// One limit over `store`, patient with the store, asking it every time.
pub fn patient_limiter(
    store: impl Into<tower_ratelimit::Store>,
    limit: impl Into<tower_ratelimit::LimitSource>,
) -> tower_ratelimit::Limiter {
    tower_ratelimit::Limiter::builder(store)
        .limit(limit)
        .timeout(PATIENT)
        // exact figures from the store on every call: the local cache of
        // denials repeats aged answers (it has tests of its own)
        .cache_denials(false)
        .build()
        .expect("a limiter of one limit")
}

/// Every key under `prefix` expires, and none lives longer than `longest`.
///
/// PTTL -1 (a key without expiry) fails. A key whose state is about to become
/// fresh legitimately has a TTL that reads 0, or expires between `KEYS` and
/// `PTTL` (-2): both are fine. Returns the number of keys found.
pub fn assert_keys_expire(prefix: &str, longest: Duration) -> usize {
    let mut conn = connection();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query(&mut conn)
        .expect("KEYS");
    // PEXPIRE rounds up to whole milliseconds.
    let bound = longest.as_millis() as i64 + 1;
    for key in &keys {
        let ttl: i64 = redis::cmd("PTTL").arg(key).query(&mut conn).expect("PTTL");
        assert!(ttl != -1, "key {key} never expires");
        assert!(
            ttl <= bound,
            "key {key} lives {ttl} ms, longer than its state needs ({bound} ms)"
        );
    }
    keys.len()
}

/// The longest any key of these limits needs to live: two windows (the
/// sliding window counter keeps the previous one) after the furthest grant,
/// which a reservation may place `max_wait` ahead.
pub fn state_lifetime<'a>(
    limits: impl IntoIterator<Item = &'a tower_ratelimit::Limit>,
    max_wait: Duration,
) -> Duration {
    let window = limits
        .into_iter()
        .map(|l| l.policy_window().max(l.quota().window()))
        .max()
        .unwrap_or_default();
    2 * window + max_wait
}

/// A numeric field of an `INFO` section (0 when absent).
pub fn info_field(conn: &mut redis::Connection, section: &str, field: &str) -> u64 {
    let info: String = redis::cmd("INFO").arg(section).query(conn).expect("INFO");
    info.lines()
        .find_map(|line| line.strip_prefix(&format!("{field}:"))?.trim().parse().ok())
        .unwrap_or(0)
}

/// Reads a line count from `INFO commandstats` for one command.
pub fn command_calls(conn: &mut redis::Connection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(conn)
        .expect("INFO");
    BufReader::new(info.as_bytes())
        .lines()
        .map_while(Result::ok)
        .find_map(|line| {
            let rest = line.strip_prefix(&format!("cmdstat_{command}:calls="))?;
            rest.split(',').next()?.parse().ok()
        })
        .unwrap_or(0)
}

/// Commands that overwrite the key they are given.
pub type Corruption = fn(&str) -> Vec<redis::Cmd>;

/// A Redis command from its words.
pub fn cmd(args: &[&str]) -> redis::Cmd {
    let mut c = redis::cmd(args[0]);
    for arg in &args[1..] {
        c.arg(*arg);
    }
    c
}

/// What a single-key state can be turned into: (what, the commands on the
/// key, whether the grants before it still count).
pub fn single_key_corruptions() -> Vec<(&'static str, Corruption, bool)> {
    vec![
        ("untouched", |_| vec![], true),
        ("deleted (evicted)", |k| vec![cmd(&["DEL", k])], false),
        (
            "a list",
            |k| vec![cmd(&["DEL", k]), cmd(&["RPUSH", k, "x"])],
            false,
        ),
        (
            "a hash",
            |k| vec![cmd(&["DEL", k]), cmd(&["HSET", k, "level", "1"])],
            false,
        ),
        ("garbage", |k| vec![cmd(&["SET", k, "garbage"])], false),
        (
            "an older format",
            |k| vec![cmd(&["SET", k, "5:1800000000000000"])],
            false,
        ),
        (
            "numbers beyond 2^53",
            |k| {
                vec![cmd(&[
                    "SET",
                    k,
                    "99999999999999999999:9:9:9:99999999999999999999:9:9",
                ])]
            },
            false,
        ),
        (
            "zero units",
            |k| vec![cmd(&["SET", k, "0:0:0:0:0:0:0"])],
            false,
        ),
        (
            "empty fields",
            |k| vec![cmd(&["SET", k, "-5::-1:2:3:4:5"])],
            false,
        ),
        (
            "a sorted set",
            |k| vec![cmd(&["DEL", k]), cmd(&["ZADD", k, "1", "x"])],
            false,
        ),
        (
            "41 bytes of another tag",
            |k| {
                vec![cmd(&[
                    "SET",
                    k,
                    "Zaaaaaaaabbbbbbbbccccccccddddddddeeeeeeee",
                ])]
            },
            false,
        ),
        (
            "an expiring string",
            |k| vec![cmd(&["SET", k, "x", "PX", "600000"])],
            false,
        ),
    ]
}

/// The Redis key of a limit kept in one key (every algorithm but the
/// sliding log): limit `name`, user key `user`, under `prefix`.
pub fn single_key_of(
    prefix: &str,
    name: &str,
    quota: &tower_ratelimit::Quota,
    user: &str,
) -> String {
    let part = match quota.algorithm() {
        tower_ratelimit::Algorithm::TokenBucket => "tb",
        tower_ratelimit::Algorithm::Gcra => "gcra",
        tower_ratelimit::Algorithm::FixedWindow => "fw",
        tower_ratelimit::Algorithm::SlidingWindow => "sw",
        other => unreachable!("{other:?} keeps two keys"),
    };
    format!("{prefix}:{{{user}}}:{name}:{part}")
}

/// 2027-01-15T08:00:00Z in microseconds: a whole hour, so windows of 1 s,
/// 1 min and 1 h all start exactly here.
pub const T0: i64 = 1_800_000_000_000_000;

/// A clock that follows tokio's (possibly paused) time from `T0`, so a store's
/// decisions and tokio's sleeps see the same timeline.
#[derive(Clone)]
pub struct TokioClock(tokio::time::Instant);

impl TokioClock {
    pub fn start() -> TokioClock {
        TokioClock(tokio::time::Instant::now())
    }
}

impl tower_ratelimit::Clock for TokioClock {
    fn now_micros(&self) -> i64 {
        T0 + self.0.elapsed().as_micros() as i64
    }
}

/// Waits until `limiter` decides for `key` again (a grant or a refusal, not
/// an error), at most `within`; how long that took.
pub async fn decides(limiter: &tower_ratelimit::Limiter, key: &str, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if limiter.check(key, 1).await.is_ok() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "no decision for {key:?} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (at most `PATIENT`) until `limiter` has `remaining` left for the
/// key "global": a charge, a refund or a release over Redis lands on a task
/// of its own. `store` names the store in the failure.
pub async fn settles_to(limiter: &tower_ratelimit::Limiter, remaining: u64, store: &str) {
    let until = Instant::now() + PATIENT;
    loop {
        let now = limiter.peek("global", 1).await.expect("peek").remaining();
        if now == remaining {
            return;
        }
        assert!(
            Instant::now() < until,
            "{store}: {now} left, not {remaining}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A lease of `key` once one is free: a dropped lease goes back on a task
/// of its own, so a test waits for it (at most `PATIENT`).
pub async fn wait_until_held(
    limiter: &tower_ratelimit::Limiter,
    key: &str,
) -> tower_ratelimit::Lease {
    let until = Instant::now() + PATIENT;
    loop {
        let lease = limiter.acquire_lease(key).await.expect("acquire a lease");
        if lease.is_held() || Instant::now() > until {
            assert!(lease.is_held(), "no permit of {key:?} came back");
            return lease;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A limiter of `limits` over `store`, patient with it.
pub fn limiter_of(
    store: impl Into<tower_ratelimit::Store>,
    limits: &[tower_ratelimit::Limit],
) -> tower_ratelimit::Limiter {
    limits
        .iter()
        .cloned()
        .fold(tower_ratelimit::Limiter::builder(store), |b, l| b.limit(l))
        .timeout(PATIENT)
        .build()
        .expect("limiter")
}

/// Two instances of one service per store, with the store's name: two
/// limiters over one memory store (one process), and two Redis stores on
/// one Redis and prefix (two processes).
pub fn two_instances(
    test: &str,
    limits: &[tower_ratelimit::Limit],
) -> Vec<(
    &'static str,
    tower_ratelimit::Limiter,
    tower_ratelimit::Limiter,
)> {
    let memory = tower_ratelimit::MemoryStore::new();
    let prefix = unique_prefix(test);
    vec![
        (
            "memory",
            limiter_of(memory.clone(), limits),
            limiter_of(memory, limits),
        ),
        (
            "redis",
            limiter_of(redis_store(&prefix), limits),
            limiter_of(redis_store(&prefix), limits),
        ),
    ]
}
