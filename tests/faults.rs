//! One Redis failing in every way the store must survive, under load: killed,
//! asleep (`DEBUG SLEEP`), connections killed (`CLIENT KILL`) or closed while
//! idle (the server's `timeout`), and connections that go silent.
//!
//! Deadlines here detect hangs; they are generous on purpose (a loaded
//! machine is slow, never wrong). The figures the design aims for (answers
//! within the timeout plus a few milliseconds, recovery within a few hundred
//! milliseconds) are printed by each test and reported with the benchmarks.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{decides, TestRedis};
use tower_ratelimit::{Error, Limit, Limiter, Quota, RedisStore};

/// The limiter's timeout in these tests: the production default.
const TIMEOUT: Duration = Duration::from_millis(100);
/// What "answered within the timeout" tolerates here before calling it a
/// hang: scheduling delays on a loaded machine, never a second timeout.
const HANG: Duration = Duration::from_millis(1000);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Decided,
    Timeout,
    Unavailable,
    Other,
}

#[derive(Debug, Clone, Copy)]
struct Call {
    at: Instant,
    took: Duration,
    kind: Kind,
}

/// Held by each test of this file while it runs: each measures calls
/// against a 100 ms timeout under load of its own, on a machine of two
/// cores, and two at once made each other's calls late (a flood beside
/// another test's load timed out 2 of 1,805 ordinary calls once).
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn kind(result: &Result<tower_ratelimit::Decision, Error>) -> Kind {
    match result {
        Ok(_) => Kind::Decided,
        Err(Error::Timeout(_)) => Kind::Timeout,
        Err(Error::Unavailable) => Kind::Unavailable,
        Err(e) => {
            eprintln!("unexpected error: {e} / {e:?}");
            Kind::Other
        }
    }
}

/// Requests from `tasks` tasks, each one after the other with a short pause,
/// until stopped (or 60 s at most): what every call took and how it ended.
struct Load {
    stop: Arc<AtomicBool>,
    calls: Arc<Mutex<Vec<Call>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(limiter: &Limiter, tasks: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let calls = Arc::new(Mutex::new(Vec::new()));
        let started = Instant::now();
        let tasks = (0..tasks)
            .map(|task| {
                let (limiter, stop, calls) = (limiter.clone(), stop.clone(), calls.clone());
                tokio::spawn(async move {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed)
                        && started.elapsed() < Duration::from_secs(60)
                    {
                        n += 1;
                        let at = Instant::now();
                        let result = limiter.check(format!("k{task}-{}", n % 50), 1).await;
                        let call = Call {
                            at,
                            took: at.elapsed(),
                            kind: kind(&result),
                        };
                        calls.lock().unwrap().push(call);
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                })
            })
            .collect();
        Load { stop, calls, tasks }
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    async fn finish(self) -> Vec<Call> {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("a load task panicked");
        }
        let calls = self.calls.lock().unwrap().clone();
        calls
    }
}

fn limiter(url: &str, prefix: &str) -> Limiter {
    limiter_within(url, prefix, TIMEOUT)
}

/// A limiter whose decisions give up after `timeout`.
fn limiter_within(url: &str, prefix: &str, timeout: Duration) -> Limiter {
    let store = RedisStore::builder(url)
        .prefix(prefix)
        .lanes(2)
        .build()
        .expect("store");
    let limit = Limit::new("l", Quota::per_minute(1_000_000).fixed_window()).expect("limit");
    Limiter::builder(store)
        .limit(limit)
        .timeout(timeout)
        .build()
        .expect("limiter")
}

fn conn(url: &str) -> redis::Connection {
    redis::Client::open(url)
        .expect("client")
        .get_connection()
        .expect("connect to the test Redis")
}

/// Every call ended within the timeout (up to scheduling delays).
fn assert_all_answered(calls: &[Call], what: &str) {
    let slowest = calls.iter().map(|c| c.took).max().unwrap_or_default();
    let mut took: Vec<Duration> = calls.iter().map(|c| c.took).collect();
    took.sort();
    let p99 = took
        .get(took.len().saturating_sub(1) * 99 / 100)
        .copied()
        .unwrap_or_default();
    eprintln!(
        "{what}: {} calls, p99 {p99:?}, slowest {slowest:?} (timeout {TIMEOUT:?})",
        calls.len()
    );
    assert!(
        slowest < TIMEOUT + HANG,
        "{what}: a call took {slowest:?}, beyond its {TIMEOUT:?} timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_every_request_is_answered_and_decisions_resume() {
    let _alone = ALONE.lock().await;
    let mut server = TestRedis::spawn();
    let limiter = limiter(&server.url, "killed");
    decides(&limiter, "probe", Duration::from_secs(5)).await;
    let load = Load::start(&limiter, 8);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let killed_at = Instant::now();
    server.stop();
    tokio::time::sleep(Duration::from_millis(700)).await;
    // the circuit is open: the outage's requests fail at once, none waits
    // out the timeout, and none reaches Redis
    let during: Vec<Call> = load
        .calls()
        .into_iter()
        .filter(|c| c.at > killed_at + Duration::from_millis(300))
        .collect();
    assert!(!during.is_empty());
    assert!(
        during.iter().all(|c| c.kind == Kind::Unavailable),
        "once the circuit is open every request fails at once: {:?}",
        during.iter().find(|c| c.kind != Kind::Unavailable)
    );
    server.restart();
    let back = Instant::now();
    let recovered = decides(&limiter, "probe", Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let calls = load.finish().await;
    let first = calls
        .iter()
        .filter(|c| c.at > back && c.kind == Kind::Decided)
        .map(|c| c.at + c.took - back)
        .min();
    eprintln!("first decision after Redis returned: {first:?} (probe: {recovered:?})");
    assert_all_answered(&calls, "killed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_redis_costs_at_most_one_timeout_per_request_and_none_after() {
    let _alone = ALONE.lock().await;
    let server = TestRedis::spawn_with("--enable-debug-command yes");
    let limiter = limiter(&server.url, "asleep");
    decides(&limiter, "probe", Duration::from_secs(5)).await;
    let load = Load::start(&limiter, 8);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let url = server.url.clone();
    let woke = tokio::task::spawn_blocking(move || {
        let _: () = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(3)
            .query(&mut conn(&url))
            .expect("DEBUG SLEEP");
        Instant::now()
    })
    .await
    .expect("the sleeper");
    // the first decision after the wake, then errors no more
    let recovered = decides(&limiter, "probe", Duration::from_secs(2)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let calls = load.finish().await;
    let first = calls
        .iter()
        .filter(|c| c.at + c.took > woke && c.kind == Kind::Decided)
        .map(|c| c.at + c.took)
        .min()
        .expect("decisions after the wake");
    eprintln!(
        "first decision {:?} after the wake (probe: {recovered:?})",
        first - woke
    );
    let late_errors: Vec<&Call> = calls
        .iter()
        .filter(|c| c.at > first && c.kind != Kind::Decided)
        .collect();
    assert!(
        late_errors.is_empty(),
        "after the first decision nothing fails: {late_errors:?}"
    );
    let unavailable = calls.iter().filter(|c| c.kind == Kind::Unavailable).count();
    assert!(
        unavailable > 0,
        "a 3 s outage opens the circuit: requests stop waiting out the timeout"
    );
    assert_all_answered(&calls, "asleep");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_the_server_kills_or_closes_when_idle_cost_no_request() {
    let _alone = ALONE.lock().await;
    let server = TestRedis::spawn();
    // what is checked is that a killed connection's decisions are sent
    // again on a new one, not how fast: a new connection on a loaded
    // two-core machine can take longer than the 100 ms of the other tests
    // (CI saw all four in flight time out at once), so a second here; a
    // decision that fails on its closed connection still fails the test
    let limiter = limiter_within(&server.url, "killed-conns", Duration::from_secs(1));
    decides(&limiter, "probe", Duration::from_secs(5)).await;
    let mut admin = conn(&server.url);
    // killed under load
    let load = Load::start(&limiter, 4);
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..3 {
        let _: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .arg("SKIPME")
            .arg("yes")
            .query(&mut admin)
            .expect("CLIENT KILL");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let calls = load.finish().await;
    let failed: Vec<&Call> = calls.iter().filter(|c| c.kind != Kind::Decided).collect();
    assert!(
        failed.is_empty(),
        "killed connections are replaced without failing requests: {failed:?}"
    );
    // closed while idle: the server's idle timeout (seconds) closes the lanes
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("timeout")
        .arg(1)
        .query(&mut admin)
        .expect("CONFIG SET timeout");
    for round in 0..2 {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        for i in 0..8 {
            let result = limiter.check(format!("idle-{round}-{i}"), 1).await;
            assert!(result.is_ok(), "after idling, request {i}: {result:?}");
        }
    }
    let _: () = redis::cmd("PING")
        .query(&mut conn(&server.url))
        .expect("PING");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_go_silent_are_replaced_through_new_ones() {
    let _alone = ALONE.lock().await;
    let server = TestRedis::spawn();
    let proxy = common::proxy::FaultProxy::to_port(server.port);
    let limiter = limiter(&proxy.url(), "silent");
    decides(&limiter, "probe", Duration::from_secs(5)).await;
    let load = Load::start(&limiter, 8);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let accepted = proxy.accepted();
    // the store's connections stay open and forward nothing, Redis is fine
    proxy.go_silent();
    let silenced = Instant::now();
    let recovered = decides(&limiter, "probe", Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let calls = load.finish().await;
    eprintln!("decisions again {recovered:?} after the connections went silent");
    assert!(
        proxy.accepted() > accepted,
        "the store opened new connections"
    );
    // from the probe's first decision on, the new connections serve: the
    // requests abandoned on the silent ones meanwhile must not open the
    // circuit again
    let late: Vec<&Call> = calls
        .iter()
        .filter(|c| c.at > silenced + recovered && c.kind != Kind::Decided)
        .collect();
    assert!(late.is_empty(), "once replaced, nothing fails: {late:?}");
    assert_all_answered(&calls, "silent");
}

/// Callers that go away (an HTTP client closing its socket makes hyper drop
/// the request's future) tell nothing about Redis: a flood of decisions
/// abandoned right after they were sent, beside ordinary traffic on a
/// healthy Redis, fails no request and replaces no connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_go_away_neither_open_the_circuit_nor_replace_connections() {
    let _alone = ALONE.lock().await;
    let server = TestRedis::spawn();
    // (1 s, not 100 ms: what is checked is that abandoned calls fail no one
    // else, not the speed of a machine loaded by the other tests)
    let limiter = limiter_within(&server.url, "abandoned", Duration::from_secs(1));
    decides(&limiter, "probe", Duration::from_secs(5)).await;
    let mut admin = conn(&server.url);
    let connections = common::info_field(&mut admin, "stats", "total_connections_received");
    let load = Load::start(&limiter, 4);
    let abandoned = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let flood: Vec<_> = (0..2)
        .map(|task| {
            let (limiter, abandoned) = (limiter.clone(), abandoned.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                let mut n = 0u64;
                while started.elapsed() < Duration::from_millis(1500) {
                    n += 1;
                    // sent (the first poll writes the command), then dropped
                    let mut call = Box::pin(limiter.check(format!("flood-{task}-{n}"), 1));
                    if futures::poll!(call.as_mut()).is_pending() {
                        abandoned.fetch_add(1, Ordering::Relaxed);
                    }
                    drop(call);
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    for task in flood {
        task.await.expect("a flood task panicked");
    }
    let calls = load.finish().await;
    let abandoned = abandoned.load(Ordering::Relaxed);
    eprintln!(
        "{abandoned} decisions abandoned beside {} ordinary ones",
        calls.len()
    );
    assert!(abandoned > 100, "the flood abandoned decisions in flight");
    let failed: Vec<&Call> = calls.iter().filter(|c| c.kind != Kind::Decided).collect();
    assert!(
        failed.is_empty(),
        "callers going away fail nobody else: {} of {} failed, first {:?}",
        failed.len(),
        calls.len(),
        failed.first()
    );
    let now = common::info_field(&mut admin, "stats", "total_connections_received");
    assert_eq!(
        now,
        connections,
        "no connection was replaced: {} new ones",
        now - connections
    );
    assert_all_answered(&calls, "abandoned");
}
