//! Hot keys (`Limit::with_hot_key`): batches of permits taken from Redis and granted
//! in the instance, few decisions reaching Redis, unused permits given back,
//! and the fleet within the bound `HotKey` states.

mod common;

use std::time::{Duration, Instant};

use common::{command_calls, redis_url, unique_prefix, TestRedis, PATIENT};
use tower_ratelimit::{
    Clock, ConfigError, Error, HotKey, Limit, Limiter, ManualClock, MemoryStore, Penalty, Quota,
    RedisStore,
};

/// One instance of a service: its own Redis store (own connections) under
/// `prefix`, each decision its own call (so Redis counts decisions), with
/// the cache of denials as deployed.
fn instance(url: &str, prefix: &str, limits: &[Limit], timeout: Duration) -> Limiter {
    let store = RedisStore::builder(url)
        .prefix(prefix)
        .coalesce_decisions(false)
        .build()
        .expect("a Redis store");
    limits
        .iter()
        .cloned()
        .fold(Limiter::builder(store), |b, l| b.limit(l))
        .timeout(timeout)
        .build()
        .expect("a limiter")
}

fn fleet(url: &str, prefix: &str, limit: &Limit, n: usize) -> Vec<Limiter> {
    (0..n)
        .map(|_| instance(url, prefix, std::slice::from_ref(limit), PATIENT))
        .collect()
}

/// A hot limit "global" of `per_hour` in fixed windows, in batches of
/// `permits` held `hold`.
fn hourly_hot(per_hour: u64, permits: u64, hold: Duration) -> Limit {
    Limit::new("global", Quota::per_hour(per_hour).fixed_window())
        .and_then(|limit| limit.with_hot_key(HotKey::new(permits, hold)?))
        .expect("a hot limit")
}

/// Decisions that reached the Redis at `url` so far: every call of the
/// library. (Tests that count run on a server of their own: the shared one
/// serves every test of this binary at once under `cargo test`.)
fn redis_calls(url: &str) -> u64 {
    let client = redis::Client::open(url).expect("a Redis URL");
    command_calls(&mut client.get_connection().expect("a connection"), "fcall")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_reaches_redis_once_per_batch_and_every_unused_permit_comes_back() {
    let limit = hourly_hot(100_000, 100, Duration::from_millis(300));
    let server = TestRedis::spawn();
    let prefix = unique_prefix("hot-batches");
    let instances = fleet(&server.url, &prefix, &limit, 4);
    let before = redis_calls(&server.url);
    let mut tasks = Vec::new();
    for limiter in &instances {
        for _ in 0..4 {
            let limiter = limiter.clone();
            tasks.push(tokio::spawn(async move {
                let mut granted = 0;
                for _ in 0..500 {
                    let d = limiter.check("all", 1).await.expect("a decision");
                    granted += u64::from(d.is_allowed());
                    assert!(d.remaining() > 0, "remaining counts what is left");
                }
                granted
            }));
        }
    }
    let mut granted = 0;
    for task in tasks {
        granted += task.await.expect("a task");
    }
    let calls = redis_calls(&server.url) - before;
    assert_eq!(granted, 8000, "the limit has room for every one");
    assert!(
        calls * 50 <= granted,
        "{calls} calls of Redis for {granted} decisions: more than 1 in 50"
    );
    // the batches' holds end and their unused permits go back: Redis counts
    // exactly what was granted
    let observer = instance(&server.url, &prefix, &[limit], PATIENT);
    let deadline = Instant::now() + PATIENT;
    loop {
        let remaining = observer.peek("all", 1).await.expect("a look").remaining();
        if remaining == 100_000 - 8000 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Redis still counts {} taken for 8000 granted",
            100_000 - remaining
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Grants of a fleet of `n` instances on `limit`, every 5 ms of a test
/// clock (which the stores decide on) for 2.5 s, each instance asking
/// `per_tick` at once in busy half-seconds and one every 50 ms in quiet
/// ones (so batches are taken, partly spent, and left to end): the clock
/// times of the grants.
async fn fleet_on_a_clock(limit: &Limit, n: usize, per_tick: usize) -> Vec<i64> {
    let clock = ManualClock::new(common::T0);
    let prefix = unique_prefix("hot-bound");
    let instances: Vec<Limiter> = (0..n)
        .map(|_| {
            let store = RedisStore::builder(redis_url())
                .prefix(&prefix)
                .expiry_slack(common::TEST_CLOCK_SLACK)
                .clock(clock.clone())
                .build()
                .expect("a Redis store");
            Limiter::builder(store)
                .limit(limit.clone())
                .timeout(PATIENT)
                .build()
                .expect("a limiter")
        })
        .collect();
    let mut grants = Vec::new();
    for tick in 0..500 {
        let busy = (tick / 100) % 2 == 1;
        let asking = if busy {
            per_tick
        } else {
            usize::from(tick % 10 == 0)
        };
        let asks = instances
            .iter()
            .flat_map(|l| (0..asking).map(move |_| l.check("all", 1)));
        for d in futures::future::join_all(asks).await {
            if d.expect("a decision").is_allowed() {
                grants.push(clock.now_micros());
            }
        }
        clock.advance(Duration::from_millis(5));
    }
    grants
}

/// The most of `grants` (sorted times, us) within any `window`.
fn most_within(grants: &[i64], window: Duration) -> usize {
    let w = window.as_micros() as i64;
    (0..grants.len())
        .map(|i| {
            grants[i..]
                .iter()
                .take_while(|&&t| t - grants[i] < w)
                .count()
        })
        .max()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_four_stays_within_the_stated_bound() {
    // a sliding log: exactly 100 in any second without batches
    let (limit_n, permits, n) = (100usize, 10usize, 4usize);
    let log = Limit::new("global", Quota::per_second(limit_n as u64).sliding_log()).unwrap();
    let hot = log
        .clone()
        .with_hot_key(HotKey::new(permits as u64, Duration::from_millis(200)).unwrap())
        .unwrap();
    let exact = fleet_on_a_clock(&log, n, 4).await;
    assert!(most_within(&exact, Duration::from_secs(1)) <= limit_n);
    let grants = fleet_on_a_clock(&hot, n, 4).await;
    let most = most_within(&grants, Duration::from_secs(1));
    eprintln!(
        "{} granted in all ({} without batches), at most {most} within one second",
        grants.len(),
        exact.len()
    );
    // the stated bound: what the limit grants in a window, plus one batch
    // per instance
    let bound = limit_n + n * permits;
    assert!(
        most <= bound,
        "{most} granted within one second, over the bound of {bound}"
    );
    // and the limit is used, not starved: at least 2 of 2.5 s worth
    assert!(
        grants.len() >= limit_n * 2,
        "only {} granted in 2.5 s of a limit of {limit_n}/s",
        grants.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_hot_key_stays_off_redis() {
    let limit = hourly_hot(50, 10, Duration::from_secs(1));
    let server = TestRedis::spawn();
    let instances = fleet(&server.url, &unique_prefix("hot-exhausted"), &limit, 2);
    let mut granted = 0;
    for _ in 0..40 {
        for limiter in &instances {
            granted += u64::from(limiter.check("all", 1).await.unwrap().is_allowed());
        }
    }
    assert_eq!(granted, 50);
    let before = redis_calls(&server.url);
    for _ in 0..1000 {
        for limiter in &instances {
            let d = limiter.check("all", 1).await.unwrap();
            assert!(!d.is_allowed());
            assert!(d.retry_after().is_some());
        }
    }
    let calls = redis_calls(&server.url) - before;
    // each instance asks about once per hold (a refusal is held no longer:
    // another instance may give permits back meanwhile)
    assert!(calls <= 8, "{calls} calls of Redis for 2000 refusals");
}

/// Several limiters (several layers) of one process over one store share
/// its batches: one batch per hot limit and key in the process, so the
/// bound counts processes, not layers. Both grant from the batch the
/// first one took, and Redis is asked once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limiters_over_one_store_share_one_batch() {
    let limit = hourly_hot(10, 10, Duration::from_secs(60));
    let server = TestRedis::spawn();
    let store = RedisStore::builder(&server.url)
        .prefix(unique_prefix("hot-shared"))
        .coalesce_decisions(false)
        .build()
        .expect("a Redis store");
    let layer = |store: RedisStore| {
        Limiter::builder(store)
            .limit(limit.clone())
            .timeout(PATIENT)
            .build()
            .expect("a limiter")
    };
    let (a, b) = (layer(store.clone()), layer(store));
    // (the library loaded on another key first)
    assert!(a.check("warm-up", 1).await.unwrap().is_allowed());
    let before = redis_calls(&server.url);
    let mut granted = 0;
    for _ in 0..5 {
        for limiter in [&a, &b] {
            granted += u64::from(limiter.check("all", 1).await.unwrap().is_allowed());
        }
    }
    // one batch of 10 for the process, granted by both: b took none of its
    // own (which would have found nothing left)
    assert_eq!(granted, 10);
    assert_eq!(redis_calls(&server.url) - before, 1, "one batch taken");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_another_instance_holds_come_back_when_its_hold_ends() {
    let limit = hourly_hot(10, 10, Duration::from_millis(300));
    let fleet = fleet(&redis_url(), &unique_prefix("hot-give-back"), &limit, 2);
    let (a, b) = (&fleet[0], &fleet[1]);
    assert!(a.check("all", 1).await.unwrap().is_allowed()); // a holds 9 more
    let refused = b.check("all", 1).await.unwrap();
    assert!(!refused.is_allowed(), "a holds every permit");
    let deadline = Instant::now() + PATIENT;
    let waited = Instant::now();
    let mut granted = 0;
    while granted < 9 {
        granted += u64::from(b.check("all", 1).await.unwrap().is_allowed());
        assert!(
            Instant::now() < deadline,
            "a's unused permits never came back"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(waited.elapsed() >= Duration::from_millis(200));
    // 1 + 9: nothing beyond the limit
    assert!(!b.check("all", 1).await.unwrap().is_allowed());
    assert!(!a.check("all", 1).await.unwrap().is_allowed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_goes_back_to_its_batch_when_another_limit_refuses() {
    let global = hourly_hot(1000, 10, Duration::from_millis(200));
    let per_user = Limit::new("per-user", Quota::per_hour(2).fixed_window()).unwrap();
    let prefix = unique_prefix("hot-mixed");
    let limits = [global.clone(), per_user];
    let limiter = instance(&redis_url(), &prefix, &limits, PATIENT);
    for i in 0..5 {
        let d = limiter
            .decide(&["all", "alice"], 1, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(d.is_allowed(), i < 2, "decision {i}");
        assert_eq!(d.statuses().len(), 2);
        assert_eq!(d.statuses()[0].name(), "global");
        assert_eq!(d.statuses()[1].name(), "per-user");
        if i >= 2 {
            assert!(d.statuses()[1].is_violated() && !d.statuses()[0].is_violated());
        }
    }
    // once the batch's hold ends, Redis counts the two granted, not five
    let observer = instance(&redis_url(), &prefix, &[global], PATIENT);
    let deadline = Instant::now() + PATIENT;
    while observer.peek("all", 1).await.unwrap().remaining() != 998 {
        assert!(
            Instant::now() < deadline,
            "the refused requests kept permits"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_outlives_an_outage_for_its_hold_and_refills_after_it() {
    let mut server = TestRedis::spawn();
    let limit = hourly_hot(1000, 100, Duration::from_millis(300));
    let limiter = instance(
        &server.url,
        &unique_prefix("hot-outage"),
        &[limit],
        Duration::from_millis(200),
    );
    assert!(limiter.check("all", 1).await.unwrap().is_allowed());
    server.stop();
    // the batch was taken: it grants while its hold lasts
    assert!(limiter.check("all", 1).await.unwrap().is_allowed());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let failed = limiter.check("all", 1).await;
    assert!(
        matches!(
            failed,
            Err(Error::Timeout(_) | Error::Redis(_) | Error::Pool(_) | Error::Unavailable)
        ),
        "after the hold, a decision needs Redis: {failed:?}"
    );
    server.restart();
    common::decides(&limiter, "all", PATIENT).await;
    assert!(limiter.check("all", 1).await.unwrap().is_allowed());
}

#[tokio::test]
async fn an_in_process_store_decides_every_request_itself() {
    let limit = hourly_hot(5, 5, Duration::from_secs(1));
    let store = MemoryStore::new();
    let (a, b) = (
        Limiter::new(store.clone(), limit.clone()),
        Limiter::new(store, limit),
    );
    for i in 0..5 {
        let limiter = if i % 2 == 0 { &a } else { &b };
        let d = limiter.check("all", 1).await.unwrap();
        assert!(d.is_allowed());
        assert_eq!(d.remaining(), 4 - i, "exact, no batch");
    }
    assert!(!a.check("all", 1).await.unwrap().is_allowed());
}

#[test]
fn invalid_hot_keys_are_refused_when_built() {
    let second = Duration::from_secs(1);
    for (permits, hold) in [
        (0, second),
        (1, Duration::ZERO),
        (1, Duration::from_micros(999)),
        (1, Duration::from_secs(61)),
    ] {
        assert!(
            matches!(HotKey::new(permits, hold), Err(ConfigError::HotKey(_))),
            "{permits} per {hold:?}"
        );
    }
    let hot = HotKey::new(11, second).unwrap();
    let ten = Limit::new("ten", Quota::per_minute(10).gcra()).unwrap();
    assert!(matches!(
        ten.clone().with_hot_key(hot),
        Err(ConfigError::HotKey(_))
    ));
    let fits = HotKey::new(10, second).unwrap();
    assert!(ten.clone().with_hot_key(fits).is_ok());
    let running = Limit::concurrency("running", 10, second).unwrap();
    assert!(matches!(
        running.with_hot_key(fits),
        Err(ConfigError::HotKey(_))
    ));
    let penalty = Penalty::new(3, second, [second]).unwrap();
    let penalized = ten.clone().with_penalty(penalty.clone());
    assert!(matches!(
        penalized.with_hot_key(fits),
        Err(ConfigError::HotKey(_))
    ));
    // a penalty added later turns the batches off
    let later = ten.with_hot_key(fits).unwrap().with_penalty(penalty);
    assert!(later.hot_key().is_none());
}

/// Clients that invent keys of a hot per-key limit get pools up to the
/// limiter's bound, then are decided by Redis one request at a time: each
/// key is held to its quota either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_beyond_the_pool_bound_are_decided_by_redis_and_stay_exact() {
    let per_key = hourly_hot(3, 3, Duration::from_secs(30));
    let limiter = instance(
        &redis_url(),
        &unique_prefix("hot-many-keys"),
        &[per_key],
        PATIENT,
    );
    let keys: Vec<String> = (0..1100).map(|i| format!("client-{i}")).collect();
    for round in 0..4 {
        let asks = keys.iter().map(|k| limiter.check(k, 1));
        for (key, d) in keys.iter().zip(futures::future::join_all(asks).await) {
            assert_eq!(
                d.expect("a decision").is_allowed(),
                round < 3,
                "{key}, round {round}"
            );
        }
    }
}

/// A decision of a hot limit and an ordinary one answers within the
/// limiter's timeout, however its time is split between the hot limit's
/// refill and the store's decision of the other: both share one deadline.
/// The server is held busy (`DEBUG SLEEP`) past most of the timeout while
/// the refill waits, and again while the decision of the ordinary limit
/// waits (the second sleep is read after the refill, which arrived first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_refill_and_the_stores_decision_share_one_timeout() {
    let timeout = Duration::from_millis(1000);
    let server = TestRedis::spawn_with("--enable-debug-command yes");
    let prefix = unique_prefix("hot-one-timeout");
    // batches of one permit: every check refills
    let global = Limit::new("global", Quota::per_hour(1_000_000).fixed_window())
        .and_then(|limit| limit.with_hot_key(HotKey::new(1, Duration::from_secs(60))?))
        .expect("a hot limit");
    let per_user = Limit::new("user", Quota::per_hour(1_000).fixed_window()).expect("a limit");
    let limiter = instance(&server.url, &prefix, &[global, per_user], timeout);
    // the library loaded and the batch's one permit spent
    assert!(limiter
        .check("u", 1)
        .await
        .expect("a decision")
        .is_allowed());

    // holds the server 0.8 s, `after` from now, over a connection of its
    // own made then; says when the command is sent
    let port = server.port;
    let sleeper = move |after: Duration| {
        let (sent, on_sent) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            use std::io::{Read, Write};
            std::thread::sleep(after);
            let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
            conn.write_all(b"*3\r\n$5\r\nDEBUG\r\n$5\r\nSLEEP\r\n$3\r\n0.8\r\n")
                .expect("DEBUG SLEEP sent");
            let _ = sent.send(());
            let mut ok = [0u8; 5];
            conn.read_exact(&mut ok).expect("DEBUG SLEEP answered");
            assert_eq!(&ok, b"+OK\r\n", "DEBUG SLEEP refused");
        });
        (thread, on_sent)
    };
    let (first, first_sent) = sleeper(Duration::ZERO);
    first_sent.recv().expect("the first sleep sent");
    tokio::time::sleep(Duration::from_millis(20)).await;
    // (its connection is accepted, and its command read, only once the
    // first sleep is over: after the refill, which the check below sends at
    // once)
    let (second, _) = sleeper(Duration::from_millis(250));
    let started = Instant::now();
    let result = limiter.check("u", 1).await;
    let took = started.elapsed();
    first.join().expect("the first sleep");
    second.join().expect("the second sleep");
    // the refill is answered after the first sleep (0.8 s), the ordinary
    // limit's decision only after the second (1.6 s): by then the timeout
    // has passed, and the request was answered at it
    assert!(
        matches!(result, Err(Error::Timeout(_))),
        "the store's decision waited past the timeout: {result:?}"
    );
    assert!(
        took < timeout + Duration::from_millis(300),
        "answered {took:?} after the start, over the timeout of {timeout:?}"
    );
}
