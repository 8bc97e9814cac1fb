//! The programmatic API against both stores: multi-limit atomicity, reset,
//! acquire, timeouts, Redis failures, one round trip per decision, eviction.

mod common;

use std::time::Duration;

use common::{
    assert_keys_expire, command_calls, redis_store, redis_store_with_clock, state_lifetime,
    unique_prefix, TestRedis, T0,
};
use tower_ratelimit::{
    ConfigError, Error, Limit, Limiter, ManualClock, MemoryStore, Quota, RedisStore, Verdict,
    MAX_WAIT,
};

fn burst_and_daily() -> (Limit, Limit) {
    (
        Limit::new("burst", Quota::per_second(10).allow_burst(3).gcra()).unwrap(),
        Limit::new("daily", Quota::per_day(4).fixed_window()).unwrap(),
    )
}

async fn all_or_nothing(limiter: Limiter, clock: ManualClock) {
    // burst 3 at once, 4 per day
    for _ in 0..3 {
        assert!(limiter.check("u", 1).await.unwrap().is_allowed());
    }
    let d = limiter.check("u", 1).await.unwrap();
    assert!(!d.is_allowed());
    assert_eq!(
        d.violated_limits().map(|s| s.name()).collect::<Vec<_>>(),
        ["burst"]
    );
    clock.advance(Duration::from_secs(1));
    // daily has 1 left: a cost of 2 passes burst but not daily, and consumes neither
    let d = limiter.check("u", 2).await.unwrap();
    assert_eq!(
        d.violated_limits().map(|s| s.name()).collect::<Vec<_>>(),
        ["daily"]
    );
    assert_eq!(d.binding().unwrap().name(), "daily");
    let peek = limiter.peek("u", 1).await.unwrap();
    assert_eq!(
        peek.statuses()[0].remaining(),
        3,
        "burst untouched by the denied request"
    );
    assert_eq!(
        peek.statuses()[1].remaining(),
        1,
        "daily untouched by the denied request"
    );
    assert!(limiter.check("u", 1).await.unwrap().is_allowed());
    // a cost over a capacity names the limit and is never a retry time
    let d = limiter.check("other", 4).await.unwrap();
    assert_eq!(d.verdict(), Verdict::CostExceedsCapacity);
    assert_eq!(d.retry_after(), None);
    assert_eq!(
        d.violated_limits().map(|s| s.name()).collect::<Vec<_>>(),
        ["burst"]
    );
    // reset forgets every limit of the key
    limiter.reset("u").await.unwrap();
    let fresh = limiter.peek("u", 1).await.unwrap();
    assert_eq!(
        (
            fresh.statuses()[0].remaining(),
            fresh.statuses()[1].remaining()
        ),
        (3, 4)
    );
}

#[tokio::test]
async fn several_limits_are_all_or_nothing_memory() {
    let clock = ManualClock::new(T0);
    let (a, b) = burst_and_daily();
    let limiter = Limiter::builder(MemoryStore::with_clock(clock.clone()))
        .limit(a)
        .limit(b)
        .build()
        .unwrap();
    all_or_nothing(limiter, clock).await;
}

#[tokio::test]
async fn several_limits_are_all_or_nothing_redis() {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("multi");
    let (a, b) = burst_and_daily();
    let lifetime = state_lifetime([&a, &b], Duration::ZERO) + common::TEST_CLOCK_SLACK;
    let limiter = Limiter::builder(redis_store_with_clock(&prefix, &clock))
        .limit(a)
        .limit(b)
        .build()
        .unwrap();
    all_or_nothing(limiter, clock).await;
    assert_keys_expire(&prefix, lifetime);
}

#[tokio::test]
async fn keys_per_limit_and_key_count_errors() {
    let (a, b) = burst_and_daily();
    let limiter = Limiter::builder(MemoryStore::new())
        .limit(a)
        .limit(b)
        .build()
        .unwrap();
    let d = limiter
        .decide(&["ip-1", "user-9"], 1, Duration::ZERO)
        .await
        .unwrap();
    assert!(d.is_allowed());
    // the per-user daily limit is shared by another IP of the same user
    let d = limiter
        .decide(&["ip-2", "user-9"], 1, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(
        (d.statuses()[0].remaining(), d.statuses()[1].remaining()),
        (2, 2)
    );
    let err = limiter
        .decide(&["a", "b", "c"], 1, Duration::ZERO)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::KeyCount {
                expected: 2,
                got: 3
            }
        ),
        "{err}"
    );
}

#[test]
fn invalid_limiters_are_config_errors() {
    let (a, _) = burst_and_daily();
    assert_eq!(
        Limiter::builder(MemoryStore::new()).build().unwrap_err(),
        ConfigError::NoLimits
    );
    let err = Limiter::builder(MemoryStore::new())
        .limit(a.clone())
        .limit(a)
        .build()
        .unwrap_err();
    assert_eq!(err, ConfigError::DuplicateName("burst".into()));
    assert!(matches!(
        RedisStore::builder("redis://h").prefix("a{b").build(),
        Err(ConfigError::InvalidPrefix(_))
    ));
    assert!(matches!(
        RedisStore::builder("not a url").build(),
        Err(ConfigError::Redis(_))
    ));
    assert!(matches!(
        RedisStore::builder("redis://h").lanes(0).build(),
        Err(ConfigError::Redis(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn acquire_reserves_then_sleeps_and_gives_up_without_consuming() {
    let clock = common::TokioClock::start();
    let limit = Limit::new("jobs", Quota::per_second(10).allow_burst(1).gcra()).unwrap();
    let limiter = Limiter::new(MemoryStore::with_clock(clock.clone()), limit);
    assert!(limiter.check("q", 1).await.unwrap().is_allowed());
    let started = tokio::time::Instant::now();
    let d = limiter
        .acquire("q", 1, Duration::from_secs(1))
        .await
        .unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.delay(), Duration::from_millis(100));
    assert_eq!(
        started.elapsed(),
        Duration::from_millis(100),
        "slept exactly until the reserved slot"
    );
    // a second reservation queues behind the first
    let d = limiter
        .acquire("q", 1, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(d.delay(), Duration::from_millis(100));
    // too far: denied at once, nothing consumed
    let before = tokio::time::Instant::now();
    let d = limiter
        .acquire("q", 5, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(d.verdict(), Verdict::CostExceedsCapacity);
    let d = limiter
        .acquire("q", 1, Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!(d.retry_after(), Some(Duration::from_millis(100)));
    assert_eq!(before.elapsed(), Duration::ZERO);
    assert_eq!(
        limiter.peek("q", 1).await.unwrap().reset_after(),
        Duration::from_millis(100)
    );
}

#[tokio::test]
async fn acquire_on_redis_waits_for_its_reservation() {
    let prefix = unique_prefix("acquire");
    let limit = Limit::new("jobs", Quota::per_second(20).allow_burst(1).gcra()).unwrap();
    let limiter = Limiter::new(redis_store(&prefix), limit);
    assert!(limiter.check("q", 1).await.unwrap().is_allowed());
    let d = limiter
        .acquire("q", 1, Duration::from_secs(2))
        .await
        .unwrap();
    assert!(d.is_allowed());
    assert!(
        d.delay() > Duration::ZERO && d.delay() <= Duration::from_millis(50),
        "{d:?}"
    );
    assert_keys_expire(
        &prefix,
        state_lifetime(&limiter.limits(), Duration::from_secs(2)),
    );
}

#[tokio::test]
async fn exactly_one_fcall_per_decision_and_a_flushed_library_reloads() {
    let server = TestRedis::spawn();
    let (limiter, mut conn) = warmed_up(&server).await;
    for i in 0..200 {
        limiter.check(format!("k{}", i % 7), 1).await.unwrap();
    }
    assert_eq!(command_calls(&mut conn, "fcall"), 200);
    assert_eq!(
        command_calls(&mut conn, "ping"),
        0,
        "no recycle PING per decision"
    );
    assert_eq!(command_calls(&mut conn, "unwatch"), 0);
    assert_eq!(command_calls(&mut conn, "evalsha"), 0);
    assert_eq!(command_calls(&mut conn, "function|load"), 0);
    // a flushed library (a restart, a promoted replica) is loaded once again
    let _: () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query(&mut conn)
        .unwrap();
    for _ in 0..3 {
        assert!(limiter.check("k", 1).await.unwrap().is_allowed());
    }
    assert_eq!(command_calls(&mut conn, "function|load"), 1);
    let libraries: Vec<redis::Value> = redis::cmd("FUNCTION").arg("LIST").query(&mut conn).unwrap();
    assert_eq!(libraries.len(), 1, "one library: {libraries:?}");
    drop(server);
}

/// A Redis without Functions (before 7.0; here FCALL renamed away): the
/// same decisions through EVALSHA, the script reloaded after a flush.
#[tokio::test]
async fn without_functions_decisions_run_as_evalsha() {
    let server = TestRedis::spawn_with("--rename-command FCALL ''");
    let (limiter, mut conn) = warmed_up(&server).await;
    for i in 0..50 {
        limiter.check(format!("k{}", i % 7), 1).await.unwrap();
    }
    assert_eq!(command_calls(&mut conn, "evalsha"), 50);
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut conn).unwrap();
    assert!(limiter.check("k", 1).await.unwrap().is_allowed());
    assert!(limiter.check("k", 1).await.unwrap().is_allowed());
    assert_eq!(
        command_calls(&mut conn, "evalsha"),
        53,
        "one NOSCRIPT, then EVALSHA again"
    );
    let d = limiter.peek("k", 1).await.unwrap();
    assert_eq!(d.statuses()[0].remaining(), 1_000_000 - 10, "{d:?}");
    drop(server);
}

/// A server that refuses `FUNCTION LOAD` (here FUNCTION renamed away; in
/// production, say, Redis over `maxmemory`): the decision that found no
/// library runs as EVALSHA, and so do the next ones, without trying FCALL
/// again until the load is retried.
#[tokio::test]
async fn after_a_refused_library_load_decisions_run_as_evalsha() {
    let server = TestRedis::spawn_with("--rename-command FUNCTION ''");
    let (limiter, mut conn) = warmed_up(&server).await;
    for i in 0..50 {
        limiter.check(format!("k{}", i % 7), 1).await.unwrap();
    }
    assert_eq!(command_calls(&mut conn, "evalsha"), 50);
    assert_eq!(command_calls(&mut conn, "fcall"), 0, "FCALL tried again");
    let d = limiter.peek("k", 1).await.unwrap();
    assert_eq!(d.statuses()[0].remaining(), 1_000_000 - 8, "{d:?}");
    drop(server);
}

/// A limiter on `server` with a quota no test here exhausts, its lanes
/// warmed up (their first use checks a connection out of the pool) and its
/// code loaded; and a connection to `server` whose command stats start now.
async fn warmed_up(server: &TestRedis) -> (Limiter, redis::Connection) {
    let store = RedisStore::builder(&server.url)
        .prefix("rt")
        .clock(ManualClock::new(common::T0))
        .expiry_slack(common::TEST_CLOCK_SLACK)
        .build()
        .unwrap();
    let limit = Limit::new(
        "l",
        Quota::per_hour(1_000_000).allow_burst(1_000_000).gcra(),
    )
    .unwrap();
    // patient: a slow answer on a loaded machine must not discard the
    // connection these tests count on
    let limiter = common::limiter_of(store, &[limit]);
    for _ in 0..8 {
        limiter.check("k", 1).await.unwrap();
    }
    let mut conn = redis::Client::open(server.url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut conn)
        .unwrap();
    (limiter, conn)
}

#[tokio::test]
async fn a_paused_redis_times_out_and_a_stopped_one_errors_then_recovers() {
    let mut server = TestRedis::spawn();
    let store = RedisStore::builder(&server.url)
        .prefix("fail")
        .lanes(2)
        .build()
        .unwrap();
    let limit = Limit::new("l", Quota::per_minute(100).fixed_window()).unwrap();
    // the library loaded first, patiently: on a loaded machine, loading it
    // can take longer than the 50 ms this test's limiter waits
    let warm = RedisStore::builder(&server.url)
        .prefix("fail")
        .build()
        .unwrap();
    let warm = common::patient_limiter(warm, limit.clone());
    assert!(warm.check("warm-up", 1).await.unwrap().is_allowed());
    let limiter = Limiter::builder(store)
        .limit(limit)
        .timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    assert!(limiter.check("k", 1).await.unwrap().is_allowed());
    let mut conn = redis::Client::open(server.url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(400)
        .arg("ALL")
        .query(&mut conn)
        .unwrap();
    let err = limiter.check("k", 1).await.unwrap_err();
    assert!(
        matches!(err, Error::Timeout(t) if t == Duration::from_millis(50)),
        "{err}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(limiter.check("k", 1).await.unwrap().is_allowed());

    server.stop();
    for _ in 0..3 {
        let err = limiter.check("k", 1).await.unwrap_err();
        assert!(
            matches!(
                err,
                Error::Redis(_) | Error::Pool(_) | Error::Timeout(_) | Error::Unavailable
            ),
            "{err}"
        );
    }
    server.restart();
    let mut recovered = false;
    for _ in 0..200 {
        // the store reconnects in the background, backing off at most 250 ms
        if limiter.check("k", 1).await.is_ok() {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(recovered, "the store reconnects after Redis comes back");
}

#[tokio::test]
async fn huge_and_crafted_keys_stay_bounded_and_apart() {
    let prefix = unique_prefix("keys");
    let limit = Limit::new("l", Quota::per_minute(1).fixed_window()).unwrap();
    // Digesting a 1 MiB key in a debug build on a busy machine can take longer
    // than the default 100 ms timeout: this test is about keys, not latency.
    let limiter = Limiter::builder(redis_store(&prefix))
        .limit(limit)
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let huge = vec![b'x'; 1 << 20];
    assert!(limiter.check(&huge, 1).await.unwrap().is_allowed());
    assert!(!limiter.check(&huge, 1).await.unwrap().is_allowed());
    for crafted in ["a}:{b", "a", "a%7D:%7Bb", "}{", "#abc", "\u{0}\n"] {
        assert!(
            limiter.check(crafted, 1).await.unwrap().is_allowed(),
            "{crafted:?} has its own state"
        );
    }
    // (an empty key has none: see an_empty_key_is_an_error_on_both_stores)
    assert!(matches!(limiter.check("", 1).await, Err(Error::EmptyKey)));
    let mut conn = common::connection();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query(&mut conn)
        .unwrap();
    assert_eq!(keys.len(), 7);
    assert!(keys.iter().all(|k| k.len() < 200), "{keys:?}");
    assert!(
        keys.iter()
            .all(|k| k.matches('{').count() == 1 && k.matches('}').count() == 1),
        "{keys:?}"
    );
    assert_keys_expire(&prefix, state_lifetime(&limiter.limits(), Duration::ZERO));
}

#[tokio::test]
async fn memory_store_evicts_idle_keys_by_itself() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::with_clock(clock.clone());
    let limit = Limit::new("l", Quota::per_second(5).sliding_log()).unwrap();
    let limiter = Limiter::new(store.clone(), limit);
    for i in 0..20_000 {
        limiter.check(format!("client-{i}"), 1).await.unwrap();
    }
    assert_eq!(store.len(), 20_000);
    // all idle for longer than the window: later traffic sweeps them away
    clock.advance(Duration::from_secs(11));
    for i in 0..2_000 {
        limiter.check(format!("other-{i}"), 1).await.unwrap();
    }
    assert!(
        store.len() <= 2_000,
        "idle keys were not evicted: {}",
        store.len()
    );
    // peeks of unknown keys store nothing
    for i in 0..1_000 {
        limiter.peek(format!("ghost-{i}"), 1).await.unwrap();
    }
    assert!(store.len() <= 2_000);
}

/// The decision connections among `admin`'s view of the server's clients:
/// (id, last command) of each, the admin connection left out.
fn store_clients(admin: &mut redis::Connection) -> Vec<(u64, String)> {
    let own: u64 = redis::cmd("CLIENT").arg("ID").query(admin).unwrap();
    let list: String = redis::cmd("CLIENT").arg("LIST").query(admin).unwrap();
    list.lines()
        .filter_map(|line| {
            let field = |name: &str| {
                line.split(' ')
                    .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
                    .map(str::to_owned)
            };
            let id: u64 = field("id")?.parse().ok()?;
            (id != own).then_some((id, field("cmd")?))
        })
        .collect()
}

/// Concurrent decisions share one connection (its writes and reads carry
/// many at once); the second lane stands by, connected, and carries the
/// next decision as soon as the first connection is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_share_one_connection_and_the_standby_takes_over() {
    let server = TestRedis::spawn();
    let (limiter, mut admin) = warmed_up(&server).await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64 {
        let limiter = limiter.clone();
        tasks.spawn(async move { limiter.check(format!("k{}", i % 8), 1).await });
    }
    while let Some(result) = tasks.join_next().await {
        assert!(result.unwrap().unwrap().is_allowed());
    }
    // the standby is connected in the background: wait for it (at most
    // `PATIENT`, for a loaded machine)
    let until = std::time::Instant::now() + common::PATIENT;
    let mut clients = store_clients(&mut admin);
    while clients.len() < 2 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
        clients = store_clients(&mut admin);
    }
    let mut commands: Vec<&str> = clients.iter().map(|(_, cmd)| cmd.as_str()).collect();
    commands.sort_unstable();
    assert_eq!(commands, ["fcall", "ping"], "{clients:?}");
    let active = clients.iter().find(|(_, cmd)| cmd == "fcall").unwrap().0;
    let standby = clients.iter().find(|(_, cmd)| cmd == "ping").unwrap().0;
    let _: () = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(active)
        .query(&mut admin)
        .unwrap();
    // sent on the killed connection, then again on the standby
    assert!(limiter.check("after", 1).await.unwrap().is_allowed());
    let clients = store_clients(&mut admin);
    assert!(
        clients.contains(&(standby, "fcall".to_owned())),
        "the standby carried the decision: {clients:?}"
    );
    drop(server);
}

/// A reservation further ahead than `MAX_WAIT` is refused before anything
/// is decided; `MAX_WAIT` itself is taken.
#[tokio::test]
async fn a_max_wait_beyond_max_wait_is_refused_and_takes_nothing() {
    let limit = Limit::new("jobs", Quota::per_minute(1).allow_burst(1).gcra()).expect("limit");
    let limiter = Limiter::new(MemoryStore::new(), limit);
    for max_wait in [MAX_WAIT + Duration::from_micros(1), Duration::MAX] {
        let result = limiter.decide(&["k"], 1, max_wait).await;
        assert!(
            matches!(result, Err(Error::WaitTooLong(w)) if w == max_wait),
            "{result:?}"
        );
        let result = limiter.refundable().acquire("k", 1, max_wait).await;
        assert!(matches!(result, Err(Error::WaitTooLong(_))), "{result:?}");
    }
    let first = limiter.decide(&["k"], 1, MAX_WAIT).await.expect("decided");
    assert!(first.is_allowed() && first.delay().is_zero());
}

/// An empty key is `Error::EmptyKey` for every operation that names a key,
/// on both stores, and nothing is decided or written: before, it was one
/// bucket shared by every caller whose key came out empty (and on a
/// cluster, a `CROSSSLOT` error).
#[tokio::test]
async fn an_empty_key_is_an_error_on_both_stores() {
    let prefix = unique_prefix("empty-key");
    let limit = || {
        Limit::new("l", Quota::per_minute(5).sliding_log())
            .unwrap()
            .use_stored_quota()
            .with_penalty(
                tower_ratelimit::Penalty::new(
                    3,
                    Duration::from_secs(60),
                    [Duration::from_secs(60)],
                )
                .unwrap(),
            )
    };
    let limiters = [
        ("memory", Limiter::new(MemoryStore::new(), limit())),
        ("redis", Limiter::new(redis_store(&prefix), limit())),
    ];
    let empty = |what: &str, store: &str, result: Result<(), Error>| {
        assert!(
            matches!(result, Err(Error::EmptyKey)),
            "{store}: {what} of an empty key: {result:?}"
        );
    };
    let quota = Quota::per_minute(9).sliding_log();
    for (store, limiter) in &limiters {
        empty("check", store, limiter.check("", 1).await.map(drop));
        empty("check of 0", store, limiter.check("", 0).await.map(drop));
        empty("peek", store, limiter.peek("", 1).await.map(drop));
        let keys: [&[u8]; 1] = [b""];
        empty(
            "decide",
            store,
            limiter.decide(&keys, 1, Duration::ZERO).await.map(drop),
        );
        empty(
            "refundable().check",
            store,
            limiter.refundable().check("", 1).await.map(drop),
        );
        empty(
            "take_up_to",
            store,
            limiter.take_up_to("", 3).await.map(drop),
        );
        empty(
            "acquire",
            store,
            limiter.acquire("", 1, Duration::ZERO).await.map(drop),
        );
        empty("charge", store, limiter.charge("", 1).await);
        empty("reset", store, limiter.reset("").await);
        empty(
            "block",
            store,
            limiter
                .admin()
                .block("l", "", Duration::from_secs(1))
                .await
                .map(drop),
        );
        empty(
            "unblock",
            store,
            limiter.admin().unblock("l", "").await.map(drop),
        );
        empty(
            "inspect",
            store,
            limiter.admin().inspect("l", "").await.map(drop),
        );
        empty(
            "set_override",
            store,
            limiter
                .admin()
                .set_override("l", "", quota, None)
                .await
                .map(drop),
        );
        empty(
            "stored_override",
            store,
            limiter.admin().stored_override("l", "").await.map(drop),
        );
        // the limiter works on
        assert!(limiter.check("k", 1).await.unwrap().is_allowed(), "{store}");
    }
    // nothing written in Redis but the one key's state
    let mut conn = common::connection();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query(&mut conn)
        .unwrap();
    assert!(keys.iter().all(|k| k.contains("{k}")), "{keys:?}");
}
