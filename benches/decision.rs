//! Cost of one rate-limit decision.
//!
//! Group `memory`: the in-process store. Group `versus_governor`: one GCRA
//! check of `Limiter` over `MemoryStore` next to `governor`'s keyed check
//! (`DefaultKeyedRateLimiter::check_key`) for the same quota, on a hot key
//! and over 10k rotating keys: the ratio of the two is the figure to watch.
//! At 1000 per microsecond a key's state equals a fresh one a microsecond
//! after its grant, so in `10k_keys` every key has expired when its turn
//! comes again: ours drops such states (sweeping as keys come) and stores
//! them anew, governor keeps them. `10k_live_keys` compares the same lookup
//! and update on both sides: 1 per second with a burst of 10^9, so every
//! check adds a second of debt, a state lives for as long as the bench runs
//! and no check is refused.
//! Group `redis`: the crate's Redis store
//! next to three baselines that run the same decision function (or a bare `PING`) without
//! it, each with 1 and with 50 decisions in flight:
//!
//! - `store_lanes`: `Limiter` over `RedisStore` (default lanes), one `FCALL` per
//!   decision over a connection the store keeps checked out of its pool.
//! - `pool_get_per_call`: `pool.get()` from a deadpool-redis pool for every
//!   decision, which pays deadpool's recycle check (`UNWATCH` + `PING`) on
//!   every reuse of an idle connection, then the same `FCALL`.
//! - `raw_fcall_one_conn`: the same `FCALL` through one multiplexed
//!   connection (the floor for the decision).
//! - `ping_one_conn`: a `PING` through that connection (the floor for a round
//!   trip).
//!
//! Redis: `REDIS_URL` if set, else a private `redis-server` on a free port,
//! stopped when the bench ends. Without either, only the memory group runs.
//!
//! `cargo bench --bench decision`

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::num::NonZeroU32;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use criterion::{BenchmarkGroup, Criterion, Throughput};
use futures::future::join_all;
use redis::aio::MultiplexedConnection;
use tokio::runtime::Runtime;
use tower_ratelimit::{Decision, Error, Limit, Limiter, MemoryStore, Quota, RedisStore};

/// Decisions in flight per iteration in the concurrent variants.
const IN_FLIGHT: usize = 50;
/// Keys cycled through by `check/gcra_10k_keys`.
const KEYS: usize = 10_000;
/// The limit name: store keys are `<prefix>:{k}:g:gcra`.
const NAME: &str = "g";
/// The user key of every Redis decision.
const USER_KEY: &str = "k";
/// The key the baselines use; the store's key is `bench:{k}:g:gcra`.
const RAW_KEY: &str = "bench-raw:{k}:g:gcra";
const POOL_KEY: &str = "bench-pool:{k}:g:gcra";
/// The argument of one GCRA decision, cost 1, for 1_000_000 per second with
/// a burst of 1_000_000: algorithm 3 (GCRA), burst, rate and period reduced
/// by their gcd (1 per 1 us), an unused parameter, cost (see `lua/driver.lua`).
const GCRA_ARG: &str = "3:1000000:1:1:0:1";

/// The Redis quota: 1 per microsecond, far more than one Redis serves.
fn redis_quota() -> Quota {
    Quota::per_second(1_000_000).allow_burst(1_000_000).gcra()
}

/// A GCRA quota as (per second, burst): one value gives both sides of
/// `versus_governor` ([`gcra_quota`], [`governor_limiter`]) the same quota.
type Gcra = (u32, u32);

/// The memory quota: 1000 per microsecond. The in-process store decides a hot
/// key several times per microsecond, which would exhaust the Redis quota
/// within a fraction of a second and turn the bench into one of denials.
const MEMORY_GCRA: Gcra = (1_000_000_000, 1_000_000_000);

/// 1 per second with a burst of 10^9: each check adds a second of debt, so
/// a key revisited every 10k checks (milliseconds) never gets back to a
/// fresh state and stays stored for the whole bench, and no check is
/// refused. (At 1000 per second a check's 1 ms of debt is paid back before
/// the key's turn comes again: every key expires, as in `10k_keys`.)
const LIVE_GCRA: Gcra = (1, 1_000_000_000);

fn gcra_quota((per_second, burst): Gcra) -> Quota {
    Quota::per_second(per_second.into())
        .allow_burst(burst.into())
        .gcra()
}

fn memory_gcra_quota() -> Quota {
    gcra_quota(MEMORY_GCRA)
}

/// A sliding log whose 1 ms window keeps the log short and never fills.
fn memory_sliding_log_quota() -> Quota {
    Quota::rate(1_000_000, Duration::from_millis(1)).sliding_log()
}

fn limit(quota: Quota) -> Limit {
    Limit::new(NAME, quota).expect("valid bench quota")
}

/// Every decision in a bench must be a grant, or the bench measures something else.
fn granted(result: Result<Decision, Error>) -> Decision {
    let decision = result.expect("decision failed");
    assert!(decision.is_allowed(), "not granted: {decision:?}");
    decision
}

/// Every reply must be a grant: outcome 0, then wait, now and 3 per limit,
/// as little-endian doubles.
fn script_granted(result: redis::RedisResult<Vec<u8>>) -> Vec<i64> {
    let bytes = result.expect("the decision failed");
    let reply: Vec<i64> = bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as i64)
        .collect();
    assert!(reply.len() == 6 && reply[0] == 0, "not granted: {reply:?}");
    reply
}

/// The store's decision function called directly on `key`.
fn fcall(key: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(RedisStore::function_name())
        .arg(1)
        .arg(key)
        .arg(GCRA_ARG);
    cmd
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// `governor`'s keyed limiter with the quota of [`gcra_quota`]`(gcra)`.
fn governor_limiter((per_second, burst): Gcra) -> governor::DefaultKeyedRateLimiter<String> {
    let non_zero = |n| NonZeroU32::new(n).expect("non-zero");
    let quota = governor::Quota::per_second(non_zero(per_second)).allow_burst(non_zero(burst));
    governor::RateLimiter::keyed(quota)
}

fn bench_versus_governor(c: &mut Criterion, rt: &Runtime) {
    let mut group = c.benchmark_group("versus_governor");
    group.throughput(Throughput::Elements(1));
    let keys: Vec<String> = (0..KEYS).map(|i| format!("user-{i}")).collect();

    let governor = governor_limiter(MEMORY_GCRA);
    let hot = USER_KEY.to_owned();
    group.bench_function("governor/hot_key", |b| {
        b.iter(|| assert!(governor.check_key(&hot).is_ok(), "governor denied"));
    });
    let ours = Limiter::new(MemoryStore::new(), limit(memory_gcra_quota()));
    group.bench_function("ours/hot_key", |b| {
        b.to_async(rt)
            .iter(|| async { granted(ours.check(USER_KEY, 1).await) });
    });

    rotating_keys(&mut group, rt, "10k_keys", &keys, MEMORY_GCRA);
    rotating_keys(&mut group, rt, "10k_live_keys", &keys, LIVE_GCRA);
    group.finish();
}

/// `governor/{case}` and `ours/{case}`: one check per iteration, on each of
/// `keys` in turn, by governor and by a `Limiter` over `MemoryStore`, both
/// with the quota `gcra`.
fn rotating_keys(
    group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    rt: &Runtime,
    case: &str,
    keys: &[String],
    gcra: Gcra,
) {
    let governor = governor_limiter(gcra);
    group.bench_function(format!("governor/{case}"), |b| {
        let mut next = 0;
        b.iter(|| {
            let key = &keys[next];
            next = (next + 1) % keys.len();
            assert!(governor.check_key(key).is_ok(), "governor denied");
        });
    });
    let ours = Limiter::new(MemoryStore::new(), limit(gcra_quota(gcra)));
    let ours = &ours;
    group.bench_function(format!("ours/{case}"), |b| {
        let mut next = 0;
        b.to_async(rt).iter(move || {
            let key = &keys[next];
            next = (next + 1) % keys.len();
            async move { granted(ours.check(key, 1).await) }
        });
    });
}

fn bench_memory(c: &mut Criterion, rt: &Runtime) {
    let mut group = c.benchmark_group("memory");
    group.throughput(Throughput::Elements(1));

    let limiter = Limiter::new(MemoryStore::new(), limit(memory_gcra_quota()));
    group.bench_function("check/gcra_hot_key", |b| {
        b.to_async(rt)
            .iter(|| async { granted(limiter.check(USER_KEY, 1).await) });
    });

    let limiter = Limiter::new(MemoryStore::new(), limit(memory_gcra_quota()));
    let keys: Vec<String> = (0..KEYS).map(|i| format!("user-{i}")).collect();
    let (limiter_ref, keys_ref) = (&limiter, &keys);
    group.bench_function("check/gcra_10k_keys", |b| {
        let mut next = 0;
        b.to_async(rt).iter(move || {
            let key = &keys_ref[next];
            next = (next + 1) % KEYS;
            async move { granted(limiter_ref.check(key, 1).await) }
        });
    });

    let limiter = Limiter::new(MemoryStore::new(), limit(memory_sliding_log_quota()));
    group.bench_function("check/sliding_log_hot_key", |b| {
        b.to_async(rt)
            .iter(|| async { granted(limiter.check(USER_KEY, 1).await) });
    });

    group.finish();
}

/// A `redis-server` of our own, killed when dropped (also while unwinding).
struct RedisServer {
    child: Child,
    port: u16,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn answers_ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut reply = [0u8; 16];
    stream.write_all(b"PING\r\n").is_ok()
        && matches!(stream.read(&mut reply), Ok(n) if reply[..n].starts_with(b"+PONG"))
}

fn spawn_redis() -> Result<RedisServer, String> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let dir = std::env::temp_dir();
    let child = Command::new("redis-server")
        .arg("--port")
        .arg(port.to_string())
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start redis-server: {e}"))?;
    let mut server = RedisServer { child, port };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(Some(status)) = server.child.try_wait() {
            return Err(format!(
                "redis-server on port {port} exited at once ({status})"
            ));
        }
        if answers_ping(port) {
            return Ok(server);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "redis-server on port {port} did not answer PING in 5 s"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct RedisBench {
    limiter: Limiter,
    pool: deadpool_redis::Pool,
    conn: MultiplexedConnection,
}

impl RedisBench {
    async fn connect(url: &str) -> Result<Self, String> {
        let client = redis::Client::open(url).map_err(|e| format!("bad URL {url}: {e}"))?;
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| format!("cannot connect to {url}: {e}"))?;
        let mut config = deadpool_redis::Config::from_url(url);
        config.pool = Some(deadpool_redis::PoolConfig::new(16));
        let pool = config
            .create_pool(Some(deadpool_redis::Runtime::Tokio1))
            .map_err(|e| format!("cannot build the pool: {e}"))?;
        let store = RedisStore::builder(url)
            .prefix("bench")
            .build()
            .map_err(|e| format!("cannot build the store: {e}"))?;
        let limiter = Limiter::new(store, limit(redis_quota()));

        // Start from fresh keys, then check that the store and the raw script
        // decide alike (same params, same fresh state).
        redis::cmd("DEL")
            .arg(format!("bench:{{{USER_KEY}}}:{NAME}:gcra"))
            .arg(RAW_KEY)
            .arg(POOL_KEY)
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| format!("DEL failed: {e}"))?;
        let decision = granted(limiter.check(USER_KEY, 1).await);
        // (the store's first decision loaded the library)
        let raw = script_granted(fcall(RAW_KEY).query_async(&mut conn).await);
        let mut pooled = pool.get().await.map_err(|e| format!("pool: {e}"))?;
        let via_pool = script_granted(fcall(POOL_KEY).query_async(&mut pooled).await);
        assert_eq!(raw[4], i64::try_from(decision.remaining()).unwrap());
        assert_eq!(raw[4], via_pool[4]);
        assert_eq!(raw[4], 999_999, "a fresh key keeps burst - 1");
        Ok(Self {
            limiter,
            pool,
            conn,
        })
    }

    async fn store_lanes(&self) -> Decision {
        granted(self.limiter.check(USER_KEY, 1).await)
    }

    async fn pool_get_per_call(&self) -> Vec<i64> {
        let mut conn = self.pool.get().await.expect("pool.get()");
        script_granted(fcall(POOL_KEY).query_async(&mut conn).await)
    }

    async fn raw_fcall_one_conn(&self) -> Vec<i64> {
        let mut conn = self.conn.clone();
        script_granted(fcall(RAW_KEY).query_async(&mut conn).await)
    }

    async fn ping_one_conn(&self) -> String {
        let mut conn = self.conn.clone();
        let pong: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .expect("PING");
        assert_eq!(pong, "PONG");
        pong
    }
}

/// One case, sequential (1 decision per iteration) and with [`IN_FLIGHT`].
fn bench_case<F, Fut, O>(
    group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    rt: &Runtime,
    name: &str,
    call: F,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = O>,
{
    group.throughput(Throughput::Elements(1));
    group.bench_function(format!("{name}/seq"), |b| {
        b.to_async(rt).iter(&call);
    });
    group.throughput(Throughput::Elements(IN_FLIGHT as u64));
    group.bench_function(format!("{name}/inflight{IN_FLIGHT}"), |b| {
        b.to_async(rt)
            .iter(|| join_all((0..IN_FLIGHT).map(|_| call())));
    });
}

fn bench_redis(c: &mut Criterion, rt: &Runtime, bench: &RedisBench) {
    let mut group = c.benchmark_group("redis");
    bench_case(&mut group, rt, "store_lanes", || bench.store_lanes());
    bench_case(&mut group, rt, "pool_get_per_call", || {
        bench.pool_get_per_call()
    });
    bench_case(&mut group, rt, "raw_fcall_one_conn", || {
        bench.raw_fcall_one_conn()
    });
    bench_case(&mut group, rt, "ping_one_conn", || bench.ping_one_conn());
    group.finish();
}

/// Redis at `REDIS_URL`, or a private server (returned so it lives until the end).
fn redis_url() -> Result<(String, Option<RedisServer>), String> {
    if let Ok(url) = std::env::var("REDIS_URL") {
        return Ok((url, None));
    }
    let server = spawn_redis()?;
    Ok((format!("redis://127.0.0.1:{}/", server.port), Some(server)))
}

fn main() {
    let rt = runtime();
    let mut c = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();

    bench_versus_governor(&mut c, &rt);
    bench_memory(&mut c, &rt);

    let redis = redis_url().and_then(|(url, server)| {
        let bench = rt.block_on(RedisBench::connect(&url))?;
        Ok((url, server, bench))
    });
    match redis {
        Ok((url, _server, bench)) => {
            println!("Redis benches against {url}");
            bench_redis(&mut c, &rt, &bench);
            // `_server` is dropped (killed) here, after the benches.
        }
        Err(reason) => {
            println!("Redis benches NOT run: {reason}");
            eprintln!("Redis benches NOT run: {reason}");
        }
    }

    c.final_summary();
}
