//! What operations do to live state: quota changes during a rolling deploy,
//! keys evicted, deleted or overwritten in Redis, clocks that step backwards,
//! and looks that must not consume.

mod common;

use std::time::Duration;

use common::{
    cmd, patient_limiter, redis_store_with_clock, single_key_corruptions, unique_prefix,
    Corruption, TestRedis, T0,
};
use tower_ratelimit::{Limit, Limiter, ManualClock, MemoryStore, Quota, RedisStore, Verdict};

const MS: i64 = 1_000;
const S: i64 = 1_000_000;

fn limit(quota: Quota) -> Limit {
    Limit::new("op", quota).expect("valid limit")
}

/// The two stores, on one test clock.
struct Stores {
    clock: ManualClock,
    memory: MemoryStore,
    redis: RedisStore,
    prefix: String,
}

impl Stores {
    fn new(test: &str) -> Stores {
        let clock = ManualClock::new(T0);
        let prefix = unique_prefix(test);
        Stores {
            memory: MemoryStore::with_clock(clock.clone()),
            redis: redis_store_with_clock(&prefix, &clock),
            clock,
            prefix,
        }
    }

    /// A limiter of `quota` on each store: (store name, limiter).
    fn limiters(&self, quota: Quota) -> [(&'static str, Limiter); 2] {
        [
            ("memory", patient_limiter(self.memory.clone(), limit(quota))),
            ("redis", patient_limiter(self.redis.clone(), limit(quota))),
        ]
    }

    fn at(&self, micros: i64) {
        self.clock.set(T0 + micros);
    }
}

/// The issue's two examples and one change of each parameter of every
/// algorithm, at one instant: buckets keep what is left (clamped to the new
/// capacity), windows keep what was used (their state is the grants).
#[tokio::test]
async fn a_quota_change_keeps_what_is_left() {
    let sec = Duration::from_secs(1);
    // (old quota, spent under it, new quota, remaining under the new one)
    let cases = [
        (
            Quota::rate(1, sec).allow_burst(10).token_bucket(),
            8,
            Quota::rate(5, sec).allow_burst(10).token_bucket(),
            2,
        ),
        (
            Quota::rate(10, sec).allow_burst(100).token_bucket(),
            98,
            Quota::rate(20, sec).allow_burst(100).token_bucket(),
            2,
        ),
        (
            Quota::rate(1, sec).allow_burst(10).token_bucket(),
            8,
            Quota::rate(1, sec).allow_burst(20).token_bucket(),
            2,
        ),
        (
            Quota::rate(1, sec).allow_burst(10).token_bucket(),
            4,
            Quota::rate(1, sec).allow_burst(5).token_bucket(),
            5,
        ),
        (
            Quota::rate(3, sec).allow_burst(10).token_bucket(),
            8,
            Quota::rate(3, 7 * sec).allow_burst(10).token_bucket(),
            2,
        ),
        (
            Quota::rate(10, sec).allow_burst(10).gcra(),
            8,
            Quota::rate(5, sec).allow_burst(10).gcra(),
            2,
        ),
        (
            Quota::rate(10, sec).allow_burst(10).gcra(),
            8,
            Quota::rate(40, sec).allow_burst(10).gcra(),
            2,
        ),
        (
            Quota::rate(10, sec).allow_burst(10).gcra(),
            8,
            Quota::rate(10, sec).allow_burst(30).gcra(),
            2,
        ),
        (
            Quota::rate(10, sec).allow_burst(10).gcra(),
            3,
            Quota::rate(10, sec).allow_burst(4).gcra(),
            4,
        ),
        (
            Quota::rate(3, sec).allow_burst(6).gcra(),
            5,
            Quota::rate(7, 3 * sec).allow_burst(6).gcra(),
            1,
        ),
        (
            Quota::rate(10, sec).sliding_log(),
            8,
            Quota::rate(20, sec).sliding_log(),
            12,
        ),
        (
            Quota::rate(10, sec).sliding_log(),
            8,
            Quota::rate(5, sec).sliding_log(),
            0,
        ),
        (
            Quota::rate(10, sec).sliding_log(),
            8,
            Quota::rate(10, 5 * sec).sliding_log(),
            2,
        ),
        (
            Quota::rate(10, sec).fixed_window(),
            8,
            Quota::rate(20, sec).fixed_window(),
            12,
        ),
        (
            Quota::rate(10, sec).fixed_window(),
            8,
            Quota::rate(10, sec / 4).fixed_window(),
            2,
        ),
        (
            Quota::rate(10, sec).fixed_window(),
            8,
            Quota::rate(10, 3 * sec).fixed_window(),
            2,
        ),
        (
            Quota::rate(10, sec).sliding_window(),
            8,
            Quota::rate(4, sec).sliding_window(),
            0,
        ),
        (
            Quota::rate(10, sec).sliding_window(),
            8,
            Quota::rate(10, 2 * sec).sliding_window(),
            2,
        ),
        (
            Quota::rate(10, sec).sliding_window(),
            8,
            Quota::rate(10, sec / 2).sliding_window(),
            2,
        ),
    ];
    for (old, spent, new, expected) in cases {
        let stores = Stores::new("quota-change");
        for ((name, before), (_, after)) in
            stores.limiters(old).into_iter().zip(stores.limiters(new))
        {
            stores.at(0);
            let key = format!("k-{name}");
            assert!(before
                .check(&key, spent)
                .await
                .expect("decision")
                .is_allowed());
            let look = after.peek(&key, 1).await.expect("decision");
            assert_eq!(
                look.remaining(),
                expected,
                "{old:?} with {spent} spent, then {new:?} on {name}: {look:?}"
            );
            // and back: the old quota reads the new one's writes in its own units
            let taken = after.check(&key, 1).await.expect("decision");
            assert_eq!(taken.is_allowed(), expected > 0, "{name}: {taken:?}");
            let taken = u64::from(taken.is_allowed());
            let left_for_old = before.peek(&key, 1).await.expect("decision").remaining();
            assert!(
                left_for_old <= old.capacity() - spent - taken,
                "{old:?} reads {left_for_old} left after {new:?} took {taken}, on {name}"
            );
        }
    }
}

/// A capacity cut (6 to 2) while the larger bucket only reads: the smaller
/// bucket refills to its own capacity long before the larger one would,
/// and the state must not lapse then, or the larger bucket reads a full 6
/// where its own history allows 5 (a case the rolling-deploy property test
/// found).
#[tokio::test]
async fn a_capacity_cut_never_hands_the_larger_bucket_a_full_one() {
    let p = Duration::from_micros(602_382);
    let (old, new) = (
        Quota::rate(1, p).allow_burst(6).token_bucket(),
        Quota::rate(1, p).allow_burst(2).token_bucket(),
    );
    let stores = Stores::new("capacity-cut");
    for ((name, old), (_, new)) in stores.limiters(old).into_iter().zip(stores.limiters(new)) {
        let key = format!("k-{name}");
        let mut at = 0;
        // (step us, the new limiter acts, cost)
        for (step, newer, cost) in [
            (0, false, 3),
            (0, false, 2),
            (915_920, true, 0),
            (893_967, true, 2),
            (1_001_653, false, 0),
            (802_752, true, 2),
            (385_860, false, 0),
            (818_904, false, 0),
        ] {
            at += step;
            stores.at(at);
            let limiter = if newer { &new } else { &old };
            limiter.check(&key, cost).await.expect("decision");
        }
        // the last grant emptied the bucket 2 refill periods ago
        let look = old.peek(&key, 1).await.expect("peek");
        assert_eq!(look.remaining(), 2, "{name}: {look:?}");
    }
}

/// `peek` says whether a request would pass, without consuming.
#[tokio::test]
async fn peek_tells_whether_a_request_would_pass_and_consumes_nothing() {
    let stores = Stores::new("peek");
    for (name, limiter) in stores.limiters(Quota::per_minute(3).sliding_log()) {
        stores.at(0);
        let fresh = limiter.peek("p", 1).await.expect("peek");
        assert!(
            fresh.is_allowed() && fresh.remaining() == 3,
            "{name}: {fresh:?}"
        );
        assert!(limiter.check("p", 2).await.expect("check").is_allowed());
        stores.at(10 * S);
        assert!(limiter.peek("p", 1).await.expect("peek").is_allowed());
        let two = limiter.peek("p", 2).await.expect("peek");
        assert_eq!(
            two.retry_after(),
            Some(Duration::from_secs(50)),
            "{name}: {two:?}"
        );
        assert!(limiter.check("p", 1).await.expect("check").is_allowed());
        for _ in 0..3 {
            let look = limiter.peek("p", 1).await.expect("peek");
            assert_eq!(
                look.verdict(),
                Verdict::Denied {
                    retry_after: Duration::from_secs(50)
                },
                "{name}"
            );
            assert_eq!(look.remaining(), 0);
        }
        let never = limiter.peek("p", 4).await.expect("peek");
        assert_eq!(never.verdict(), Verdict::CostExceedsCapacity, "{name}");
        // the looks consumed nothing: the grant at 0 frees 2 at 60 s
        stores.at(60 * S);
        let d = limiter.check("p", 2).await.expect("check");
        assert!(d.is_allowed() && d.remaining() == 0, "{name}: {d:?}");
    }
}

/// A clock that steps back (failover to a replica whose clock is behind, an
/// NTP step) must not turn recorded grants into a reservation queue.
#[tokio::test]
async fn a_backward_clock_step_refuses_nothing_the_recorded_grants_allow() {
    let sec = Duration::from_secs(1);
    let quotas = [
        Quota::rate(10, sec).allow_burst(10).token_bucket(),
        Quota::rate(10, sec).allow_burst(10).gcra(),
        Quota::rate(10, 10 * sec).sliding_log(),
        Quota::rate(10, 10 * sec).fixed_window(),
        Quota::rate(10, 10 * sec).sliding_window(),
    ];
    for quota in quotas {
        let stores = Stores::new("clock-step");
        for (name, limiter) in stores.limiters(quota) {
            stores.at(100 * S);
            assert!(limiter.check("c", 1).await.expect("check").is_allowed());
            // the clock steps back 2 s: 9 are left, as recorded
            stores.at(98 * S);
            let d = limiter.check("c", 1).await.expect("check");
            assert!(
                d.is_allowed() && d.delay().is_zero(),
                "{quota:?} on {name}: {d:?}"
            );
            assert_eq!(d.remaining(), 8, "{quota:?} on {name}: {d:?}");
            let d = limiter.check("c", 8).await.expect("check");
            assert!(
                d.is_allowed() && d.delay().is_zero(),
                "{quota:?} on {name}: {d:?}"
            );
            let full = limiter.check("c", 1).await.expect("check");
            assert!(!full.is_allowed(), "{quota:?} on {name}: {full:?}");
        }
    }
}

/// Reservations made before a backward step stay reservations: nobody gets
/// the reserved slot a second time, and later grants still queue behind it.
#[tokio::test]
async fn reservations_survive_a_backward_clock_step() {
    let stores = Stores::new("clock-step-reserve");
    for (name, limiter) in stores.limiters(Quota::per_second(1).allow_burst(1).gcra()) {
        stores.at(100 * S);
        assert!(limiter.check("r", 1).await.expect("check").is_allowed());
        let reserved = limiter
            .decide(&["r"], 1, Duration::from_secs(5))
            .await
            .expect("reserve");
        assert_eq!(
            reserved.delay(),
            Duration::from_secs(1),
            "{name}: {reserved:?}"
        );
        stores.at(98 * S);
        let d = limiter.check("r", 1).await.expect("check");
        assert_eq!(
            d.retry_after(),
            Some(Duration::from_secs(2)),
            "{name}: {d:?}"
        );
        let next = limiter
            .decide(&["r"], 1, Duration::from_secs(5))
            .await
            .expect("reserve");
        assert_eq!(
            next.delay(),
            Duration::from_secs(2),
            "{name}: queued behind: {next:?}"
        );
    }
}

fn quotas() -> [Quota; 5] {
    let sec = Duration::from_secs(1);
    [
        Quota::rate(5, sec).sliding_log(),
        Quota::rate(5, sec).allow_burst(5).token_bucket(),
        Quota::rate(5, sec).allow_burst(5).gcra(),
        Quota::rate(5, sec).fixed_window(),
        Quota::rate(5, sec).sliding_window(),
    ]
}

/// The Redis key a single-key quota keeps for the user key `k`.
fn key_of(prefix: &str, quota: &Quota) -> String {
    common::single_key_of(prefix, "op", quota, "k")
}

/// Replays a few decisions on Redis and on a twin in memory that holds the
/// state the corrupted keys should read as; they must agree.
async fn agree_after(stores: &Stores, redis: &Limiter, twin: &Limiter, what: &str) {
    for (at, cost) in [
        (MS, 1u64),
        (2 * MS, 9),
        (3 * MS, 2),
        (400 * MS, 1),
        (1500 * MS, 5),
    ] {
        stores.at(at);
        let r = redis.check("k", cost).await;
        let r = r.unwrap_or_else(|e| panic!("{what}: the store failed: {e}"));
        let m = twin.check("k", cost).await.expect("memory");
        assert_eq!(r, m, "{what}, at {at} us cost {cost}");
    }
}

/// Every algorithm's key evicted, deleted, overwritten with another type or
/// with garbage: a decision every time, never an error, the same decision as
/// for an absent key (or, untouched, as for the real history), and a valid
/// state again after the next write.
#[tokio::test]
async fn foreign_or_missing_state_is_read_as_absent_and_heals() {
    for quota in quotas().into_iter().skip(1) {
        let part = format!("{:?}", quota.algorithm());
        for (what, corruptions, history) in single_key_corruptions() {
            let stores = Stores::new("foreign");
            let redis = patient_limiter(stores.redis.clone(), limit(quota));
            let twin = patient_limiter(MemoryStore::with_clock(stores.clock.clone()), limit(quota));
            stores.at(0);
            assert!(redis.check("k", 2).await.expect("setup").is_allowed());
            if history {
                assert!(twin.check("k", 2).await.expect("setup").is_allowed());
            }
            let mut conn = common::connection();
            let key = key_of(&stores.prefix, &quota);
            for command in corruptions(&key) {
                let _: redis::Value = command.query(&mut conn).expect("corrupt the key");
            }
            let ctx = format!("{part} key {what}");
            agree_after(&stores, &redis, &twin, &ctx).await;
            let kind: String = redis::cmd("TYPE").arg(&key).query(&mut conn).expect("TYPE");
            assert_eq!(kind, "string", "{ctx}: healed by the next write");
        }
    }
}

/// The sliding log keeps two keys: every combination of a log and a meta
/// that are untouched, evicted, of another type or foreign. The log is the
/// truth: the decisions are those of its grants, whatever meta says.
#[tokio::test]
async fn a_sliding_log_trusts_its_log_whatever_happened_to_meta() {
    let quota = quotas()[0];
    // (what, corruption of the log, the grants at 0 it still holds)
    let logs: [(&str, Corruption, u64); 4] = [
        ("untouched", |_| vec![], 2),
        ("deleted (evicted)", |k| vec![cmd(&["DEL", k])], 0),
        ("a string", |k| vec![cmd(&["SET", k, "x"])], 0),
        (
            "a foreign member",
            |k| vec![cmd(&["DEL", k]), cmd(&["ZADD", k, &T0.to_string(), "junk"])],
            1,
        ),
    ];
    let metas: [(&str, Corruption); 6] = [
        ("untouched", |_| vec![]),
        ("deleted (evicted)", |k| vec![cmd(&["DEL", k])]),
        ("a hash", |k| {
            vec![cmd(&["DEL", k]), cmd(&["HSET", k, "sum", "0"])]
        }),
        ("garbage", |k| vec![cmd(&["SET", k, "x"])]),
        ("fields that are no integers", |k| {
            vec![set_meta(k, [0.5, f64::NAN, 1e300, 0.0, 0.0, 0.0, 1.0])]
        }),
        ("disagreeing with the log", |k| {
            vec![set_meta(k, [0.0, 7.0, 0.0, 0.0, 0.0, 0.0, 1.0])]
        }),
    ];
    for (log_what, log_corruption, held) in logs {
        for (meta_what, meta_corruption) in metas {
            let stores = Stores::new("foreign-log");
            let redis = patient_limiter(stores.redis.clone(), limit(quota));
            let twin = patient_limiter(MemoryStore::with_clock(stores.clock.clone()), limit(quota));
            stores.at(0);
            assert!(redis.check("k", 2).await.expect("setup").is_allowed());
            if held > 0 {
                assert!(twin.check("k", held).await.expect("setup").is_allowed());
            }
            let mut conn = common::connection();
            let (log, meta) = (
                format!("{}:{{k}}:op:log", stores.prefix),
                format!("{}:{{k}}:op:meta", stores.prefix),
            );
            for command in log_corruption(&log)
                .into_iter()
                .chain(meta_corruption(&meta))
            {
                let _: redis::Value = command.query(&mut conn).expect("corrupt a key");
            }
            let ctx = format!("log {log_what}, meta {meta_what}");
            agree_after(&stores, &redis, &twin, &ctx).await;
            healed(&stores, &redis, &mut conn, (&log, &meta), &ctx).await;
        }
    }
}

/// After a corrupted sliding log: at 3 s a decision is granted, and meta is
/// a cache that counts the log again ('M', then sum and cnt as little-endian
/// doubles, see `lua/sliding_log.lua`).
async fn healed(
    stores: &Stores,
    redis: &Limiter,
    conn: &mut redis::Connection,
    (log, meta): (&str, &str),
    ctx: &str,
) {
    stores.at(3000 * MS);
    assert!(
        redis.check("k", 1).await.expect("decision").is_allowed(),
        "{ctx}"
    );
    let count: f64 = redis::cmd("ZCARD").arg(log).query(conn).expect("ZCARD");
    let cached: Vec<u8> = redis::cmd("GET").arg(meta).query(conn).expect("GET");
    assert_eq!(cached.first(), Some(&b'M'), "{ctx}");
    let cnt = cached
        .get(9..17)
        .and_then(|b| b.try_into().ok())
        .map(f64::from_le_bytes);
    assert_eq!(cnt, Some(count), "{ctx}");
}

/// A sliding log's meta value with these fields (sum, cnt, seq, hw, wmax,
/// wexp, uni; see `lua/sliding_log.lua`) and no last member.
fn set_meta(key: &str, fields: [f64; 7]) -> redis::Cmd {
    let mut value = vec![b'M'];
    for field in fields {
        value.extend(field.to_le_bytes());
    }
    let mut c = redis::cmd("SET");
    c.arg(key).arg(value);
    c
}

/// Redis under `maxmemory` with `allkeys-lru` evicts single keys of every
/// algorithm (half of a sliding log's pair, too) in the middle of a stream of
/// distinct keys: every decision is made, none is an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_under_maxmemory_never_fails_a_decision() {
    let server = TestRedis::spawn();
    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connect");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query(&mut conn)
        .expect("policy");
    let store = RedisStore::builder(server.url.clone())
        .prefix("evict")
        .build()
        .expect("store");
    let minute = Duration::from_secs(60);
    let mut builder = Limiter::builder(store).timeout(common::PATIENT);
    for (i, quota) in [
        Quota::rate(50, minute).sliding_log(),
        Quota::rate(1, minute).allow_burst(50).token_bucket(),
        Quota::rate(50, minute).allow_burst(50).gcra(),
        Quota::rate(50, minute).fixed_window(),
        Quota::rate(50, minute).sliding_window(),
    ]
    .into_iter()
    .enumerate()
    {
        builder = builder.limit(Limit::new(format!("l{i}"), quota).expect("valid"));
    }
    let limiter = builder.build().expect("limiter");
    // the first decision loads the library, as in any deployment; then
    // memory runs out: 1 MB above what the server uses with no keys (its
    // own memory, clients and buffers, about 1 MB, count too: a bound below
    // them cannot be reached by evicting, and Redis refuses every write)
    limiter.check("first", 1).await.expect("decision");
    let used = common::info_field(&mut conn, "memory", "used_memory");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(used + 1024 * 1024)
        .query(&mut conn)
        .expect("maxmemory");
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let limiter = limiter.clone();
            tokio::spawn(async move {
                let (mut decided, mut errors) = (0u32, Vec::new());
                for i in 0..1500u32 {
                    // mostly new keys, and a few hot ones whose parts get evicted
                    let key = if i % 4 == 0 {
                        format!("hot-{}", i % 40)
                    } else {
                        format!("k-{task}-{i}")
                    };
                    match limiter.check(&key, 1).await {
                        Ok(_) => decided += 1,
                        Err(e) => errors.push(e.to_string()),
                    }
                }
                (decided, errors)
            })
        })
        .collect();
    let mut decided = 0;
    for task in tasks {
        let (n, errors) = task.await.expect("task");
        assert!(
            errors.is_empty(),
            "{} errors, e.g. {:?}",
            errors.len(),
            errors.first()
        );
        decided += n;
    }
    assert_eq!(decided, 8 * 1500);
    let evicted = common::info_field(&mut conn, "stats", "evicted_keys");
    assert!(evicted > 1000, "the test evicted {evicted} keys only");
}

/// A window's key outlives its window whichever limiter writes it: more
/// grants in the window that set its expiry keep that expiry (`KEEPTTL`),
/// and a limiter whose window of the same start is longer (a rolling
/// deploy) sets an expiry after its own window's end, so the grants it
/// counts are not lost with a key that expires with the shorter window.
#[tokio::test]
async fn a_window_key_outlives_the_window_of_whoever_wrote_it() {
    let (short, long) = (Duration::from_secs(1), Duration::from_secs(10));
    for (quota, longer) in [
        (
            Quota::rate(5, short).fixed_window(),
            Quota::rate(5, long).fixed_window(),
        ),
        (
            Quota::rate(5, short).sliding_window(),
            Quota::rate(5, long).sliding_window(),
        ),
    ] {
        // windows start at T0 (a multiple of 10 s); the decisions come 1 ms in
        let clock = ManualClock::new(T0 + MS);
        let prefix = unique_prefix("window-expiry");
        let store = RedisStore::builder(common::redis_url())
            .prefix(&prefix)
            .expiry_slack(Duration::ZERO)
            .clock(clock.clone())
            .build()
            .expect("store");
        let key = key_of(&prefix, &quota);
        let mut conn = common::connection();
        let pttl = |conn: &mut redis::Connection| -> i64 {
            redis::cmd("PTTL").arg(&key).query(conn).expect("PTTL")
        };
        // the key lives as long as the window it holds: one window for a
        // fixed window, two (the previous one is weighed) for a sliding one
        let lives = |window: Duration| -> i64 {
            let windows = if quota.algorithm() == tower_ratelimit::Algorithm::FixedWindow {
                1
            } else {
                2
            };
            windows * window.as_millis() as i64 - 1
        };
        let short_limiter = patient_limiter(store.clone(), limit(quota));
        for _ in 0..3 {
            let d = short_limiter.check("k", 1).await.expect("decision");
            assert!(d.is_allowed(), "{quota:?}");
        }
        let ttl = pttl(&mut conn);
        assert!(
            ttl > lives(short) - 500 && ttl <= lives(short) + 1,
            "{quota:?}: {ttl} ms after grants in one window"
        );
        let long_limiter = patient_limiter(store.clone(), limit(longer));
        for _ in 0..2 {
            let d = long_limiter.check("k", 1).await.expect("decision");
            // the three grants of the shorter window count in the longer one
            assert!(d.is_allowed(), "{longer:?}");
        }
        assert!(!long_limiter
            .check("k", 1)
            .await
            .expect("decision")
            .is_allowed());
        let ttl = pttl(&mut conn);
        assert!(
            ttl > lives(long) - 500 && ttl <= lives(long) + 1,
            "{longer:?}: {ttl} ms, not the longer window's expiry"
        );
    }
}

/// A state written by a clock far ahead (a replica promoted with its clock a
/// year ahead, a misconfigured store clock), then decisions on the right
/// clock. The grants it records count as made just now: the first request
/// after them is refused (nothing is over-admitted), but only for as long as
/// the limit itself could make it wait, and its Retry-After is true (the
/// request is granted once it has passed), on both stores. Then requests as
/// fast as they are allowed: no window of the limit's length holds more
/// grants than the limit lets through in one (the writer's counted at the
/// step back), and no refusal asks for longer than the limit could.
#[tokio::test]
async fn a_state_from_a_clock_far_ahead_counts_as_now_and_never_freezes_its_key() {
    const YEAR: i64 = 365 * 86_400 * S;
    let sec = Duration::from_secs(1);
    // (quota, the longest it makes a request wait by itself, the most it
    // grants in any 1 s: a bucket's fill and refill, two fixed windows'
    // quotas either side of a boundary, a weighted estimate's)
    let quotas = [
        (Quota::rate(5, sec).sliding_log(), S, 5),
        (Quota::rate(5, sec).allow_burst(5).token_bucket(), S, 10),
        (Quota::rate(5, sec).allow_burst(5).gcra(), S, 10),
        (Quota::rate(5, sec).fixed_window(), S, 10),
        (Quota::rate(5, sec).sliding_window(), 2 * S, 10),
    ];
    for (quota, longest, most) in quotas {
        let stores = Stores::new("clock-ahead");
        for (name, limiter) in stores.limiters(quota) {
            let ctx = format!("{quota:?} on {name}");
            stores.at(YEAR);
            let spent = limiter.check("f", 5).await.expect("check");
            assert!(spent.is_allowed(), "{ctx}: {spent:?}");
            // the clock is right again, a year behind the state
            let mut grants = vec![0i64; 5];
            let mut t = 0;
            let mut refusals = 0;
            while t <= 3 * S {
                stores.at(t);
                let d = limiter.check("f", 1).await.expect("check");
                if let Some(retry) = d.retry_after() {
                    refusals += 1;
                    let retry = retry.as_micros() as i64;
                    assert!(retry > 0 && retry <= longest, "{ctx} at {t} us: {d:?}");
                    t += retry;
                    stores.at(t);
                    let again = limiter.check("f", 1).await.expect("check");
                    assert!(
                        again.is_allowed() && again.delay().is_zero(),
                        "{ctx}: refused at {} us until {t} us, then {again:?}",
                        t - retry
                    );
                } else {
                    assert!(
                        d.is_allowed() && d.delay().is_zero(),
                        "{ctx} at {t} us: {d:?}"
                    );
                    assert!(t > 0, "{ctx}: the writer's grants were forgotten: {d:?}");
                }
                grants.push(t);
                t += 10 * MS;
            }
            assert!(refusals > 0, "{ctx}: never refused");
            for &from in &grants {
                let within = grants
                    .iter()
                    .filter(|&&g| g >= from && g < from + S)
                    .count();
                assert!(
                    within <= most,
                    "{ctx}: {within} grants in the second from {from} us: {grants:?}"
                );
            }
        }
    }
}

/// Sliding-log scores no grant time can have (infinite, beyond 2^53 either
/// way, fractional) planted in the log beside two real grants, and meta
/// fields that are no integers: every decision is made, never an error, as
/// if the foreign entries were absent (the two grants still count), and the
/// next write leaves a log and a meta that agree. A member that is not this
/// code's (here a huge one) counts as one grant at its score, as always.
#[tokio::test]
async fn a_sliding_log_reads_foreign_scores_as_absent() {
    let quota = quotas()[0];
    let huge = "m".repeat(100_000);
    // (what, commands on (log, meta), the grants at 0 the log then holds)
    let plants: Vec<(&str, Vec<Vec<String>>, u64)> = vec![
        (
            "a score of +inf",
            vec![vec!["ZADD".into(), "L".into(), "+inf".into(), "a".into()]],
            2,
        ),
        (
            "a score of -inf",
            vec![vec!["ZADD".into(), "L".into(), "-inf".into(), "a".into()]],
            2,
        ),
        (
            "a score of 1e300",
            vec![vec!["ZADD".into(), "L".into(), "1e300".into(), "a".into()]],
            2,
        ),
        (
            "a score of -1e300",
            vec![vec!["ZADD".into(), "L".into(), "-1e300".into(), "a".into()]],
            2,
        ),
        (
            "a score of 2^53",
            vec![vec![
                "ZADD".into(),
                "L".into(),
                "9007199254740992".into(),
                "a".into(),
            ]],
            2,
        ),
        (
            "a fractional score",
            vec![vec![
                "ZADD".into(),
                "L".into(),
                format!("{T0}.5"),
                "a".into(),
            ]],
            2,
        ),
        (
            "every kind at once",
            vec![vec![
                "ZADD".into(),
                "L".into(),
                "+inf".into(),
                "a".into(),
                "-inf".into(),
                "b".into(),
                "1e300".into(),
                "c".into(),
                format!("{T0}.25"),
                "d".into(),
                "-9007199254740992".into(),
                "e".into(),
            ]],
            2,
        ),
        (
            "a huge member",
            vec![vec!["ZADD".into(), "L".into(), T0.to_string(), huge]],
            3,
        ),
    ];
    let metas: [(&str, Option<[f64; 7]>); 3] = [
        ("untouched", None),
        (
            "an infinite clock",
            Some([2.0, 2.0, 2.0, f64::INFINITY, 1e6, f64::INFINITY, 1.0]),
        ),
        (
            "a NaN clock",
            Some([2.0, 2.0, 2.0, f64::NAN, f64::NAN, 1e300, 1.0]),
        ),
    ];
    for (what, commands, held) in &plants {
        for (meta_what, meta_fields) in metas {
            let stores = Stores::new("foreign-score");
            let redis = patient_limiter(stores.redis.clone(), limit(quota));
            let twin = patient_limiter(MemoryStore::with_clock(stores.clock.clone()), limit(quota));
            stores.at(0);
            assert!(redis.check("k", 1).await.expect("setup").is_allowed());
            assert!(redis.check("k", 1).await.expect("setup").is_allowed());
            assert!(twin.check("k", *held).await.expect("setup").is_allowed());
            let mut conn = common::connection();
            let (log, meta) = (
                format!("{}:{{k}}:op:log", stores.prefix),
                format!("{}:{{k}}:op:meta", stores.prefix),
            );
            for words in commands {
                let mut c = redis::cmd(&words[0]);
                for word in &words[1..] {
                    c.arg(if word == "L" {
                        log.as_str()
                    } else {
                        word.as_str()
                    });
                }
                let _: redis::Value = c.query(&mut conn).expect("plant");
            }
            if let Some(fields) = meta_fields {
                let _: redis::Value = set_meta(&meta, fields).query(&mut conn).expect("meta");
            }
            let ctx = format!("log with {what}, meta {meta_what}");
            agree_after(&stores, &redis, &twin, &ctx).await;
            healed(&stores, &redis, &mut conn, (&log, &meta), &ctx).await;
        }
    }
}

/// A log longer than the fast path takes, whose oldest entry's score is
/// changed in place to a fraction: meta still agrees with the log, so the
/// entry counts, from the next microsecond. A decision, never an error.
#[tokio::test]
async fn a_sliding_log_score_changed_in_place_to_a_fraction_still_decides() {
    let quota = Quota::per_second(10).sliding_log();
    let stores = Stores::new("fraction-in-place");
    let redis = patient_limiter(stores.redis.clone(), limit(quota));
    for i in 0..10 {
        stores.at(i * MS);
        assert!(redis.check("k", 1).await.expect("setup").is_allowed());
    }
    let mut conn = common::connection();
    let log = format!("{}:{{k}}:op:log", stores.prefix);
    let oldest: Vec<Vec<u8>> = redis::cmd("ZRANGE")
        .arg(&log)
        .arg(0)
        .arg(0)
        .query(&mut conn)
        .expect("ZRANGE");
    let _: redis::Value = redis::cmd("ZADD")
        .arg(&log)
        .arg("XX")
        .arg(format!("{T0}.5"))
        .arg(oldest[0].as_slice())
        .query(&mut conn)
        .expect("ZADD");
    stores.at(10 * MS);
    let d = redis.check("k", 1).await.expect("a decision");
    assert_eq!(
        d.retry_after(),
        Some(Duration::from_micros(990_001)),
        "{d:?}"
    );
}

/// The same through the driver's other paths: every algorithm as one limit
/// of a limiter on one key, all spent by a clock a year ahead, then on the
/// right clock a refund of one of those grants (the buckets take it back;
/// the windows, moved, no longer hold its time), peeks, takes and checks.
/// Both stores agree at every step, and the key is granted again within the
/// longest of the limits' own waits (a sliding window's two windows).
#[tokio::test]
async fn far_ahead_states_under_several_limits_agree_on_both_stores() {
    const YEAR: i64 = 365 * 86_400 * S;
    let stores = Stores::new("clock-ahead-multi");
    let limiter = |store: tower_ratelimit::LimiterBuilder| {
        quotas()
            .into_iter()
            .enumerate()
            .fold(store, |b, (i, q)| {
                b.limit(Limit::new(format!("l{i}"), q).expect("valid"))
            })
            .timeout(common::PATIENT)
            .cache_denials(false)
            .build()
            .expect("limiter")
    };
    let memory = limiter(Limiter::builder(stores.memory.clone()));
    let redis = limiter(Limiter::builder(stores.redis.clone()));
    stores.at(YEAR);
    let (m, r) = (
        memory.check("k", 4).await.expect("memory"),
        redis.check("k", 4).await.expect("redis"),
    );
    assert!(m.is_allowed() && m == r, "{m:?} {r:?}");
    let m = memory.refundable().check("k", 1).await.expect("memory");
    let r = redis.refundable().check("k", 1).await.expect("redis");
    assert!(
        m.is_allowed() && m.decision() == r.decision(),
        "{m:?} {r:?}"
    );
    stores.at(0);
    let (mr, rr) = (
        m.refund().await.expect("memory"),
        r.refund().await.expect("redis"),
    );
    assert_eq!(mr, rr, "refund");
    let mut first_grant = None;
    for step in 0..60 {
        let t = step * 50 * MS;
        stores.at(t);
        let (m, r) = (
            memory.peek("k", 1).await.expect("memory"),
            redis.peek("k", 1).await.expect("redis"),
        );
        assert_eq!(m, r, "peek at {t} us");
        let (m, r) = if step % 3 == 0 {
            (
                memory
                    .take_up_to("k", 2)
                    .await
                    .expect("memory")
                    .into_decision(),
                redis
                    .take_up_to("k", 2)
                    .await
                    .expect("redis")
                    .into_decision(),
            )
        } else {
            (
                memory.check("k", 1).await.expect("memory"),
                redis.check("k", 1).await.expect("redis"),
            )
        };
        assert_eq!(m, r, "at {t} us");
        if let Some(retry) = m.retry_after() {
            assert!(retry <= Duration::from_secs(2), "at {t} us: {m:?}");
        } else if first_grant.is_none() {
            first_grant = Some(t);
        }
    }
    let first = first_grant.expect("never granted again");
    assert!(first > 0 && first <= 2 * S, "first granted at {first} us");
}

/// A sliding log written by a clock a year ahead whose meta is then lost
/// (evicted alone): its entries' times are the only clock left. The oldest
/// stands for the writer's, so the grants count as made just now, and the
/// key is refused for one window, with a true Retry-After, not for a year.
#[tokio::test]
async fn a_sliding_log_far_ahead_without_its_meta_counts_as_now() {
    const YEAR: i64 = 365 * 86_400 * S;
    let stores = Stores::new("clock-ahead-meta-lost");
    let redis = patient_limiter(stores.redis.clone(), limit(quotas()[0]));
    stores.at(YEAR);
    for _ in 0..5 {
        assert!(redis.check("k", 1).await.expect("check").is_allowed());
    }
    let meta = format!("{}:{{k}}:op:meta", stores.prefix);
    let _: redis::Value = cmd(&["DEL", &meta])
        .query(&mut common::connection())
        .expect("DEL");
    stores.at(0);
    let d = redis.check("k", 1).await.expect("check");
    assert_eq!(d.retry_after(), Some(Duration::from_secs(1)), "{d:?}");
    stores.at(S);
    let d = redis.check("k", 1).await.expect("check");
    assert!(d.is_allowed() && d.remaining() == 4, "{d:?}");
}

/// Redis full under `maxmemory` with `noeviction` (what calendar quotas
/// need): a decision is refused as a whole, an error the store's policy
/// answers (`OnStoreError`), never a write past `maxmemory`. Flagged
/// `allow-oom`, the decision function kept writing new keys past it, as
/// many as there were new keys, with nothing to bound them.
#[tokio::test]
async fn under_maxmemory_with_noeviction_a_decision_is_an_error_not_a_write_past_it() {
    let server = TestRedis::spawn_with("--maxmemory-policy noeviction");
    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connect");
    let store = RedisStore::builder(server.url.clone())
        .prefix("oom")
        .build()
        .expect("store");
    let limit =
        Limit::new("l", Quota::rate(50, Duration::from_secs(600)).sliding_log()).expect("valid");
    let limiter = Limiter::builder(store)
        .timeout(common::PATIENT)
        .limit(limit)
        .build()
        .expect("limiter");
    // the first decision loads the library, as in any deployment; then
    // memory runs out: 2 MB, filled
    limiter.check("first", 1).await.expect("decision");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("2mb")
        .query(&mut conn)
        .expect("maxmemory");
    let filler = vec![b'x'; 1024];
    let mut full = false;
    for i in 0..100_000 {
        let set: redis::RedisResult<()> = redis::cmd("SET")
            .arg(format!("filler-{i}"))
            .arg(&filler)
            .query(&mut conn);
        if set.is_err_and(|e| e.to_string().contains("OOM")) {
            full = true;
            break;
        }
    }
    assert!(full, "Redis never refused a write");
    let before = common::info_field(&mut conn, "memory", "used_memory");
    let (mut decided, mut errors) = (0u32, 0u32);
    for i in 0..2000 {
        match limiter.check(&format!("new-{i}"), 1).await {
            Ok(_) => decided += 1,
            Err(_) => errors += 1,
        }
    }
    let after = common::info_field(&mut conn, "memory", "used_memory");
    let keys: u64 = redis::cmd("DBSIZE").query(&mut conn).expect("DBSIZE");
    eprintln!(
        "full at maxmemory 2 MB: {decided} decided, {errors} errors; used_memory \
         {before} -> {after} bytes, {keys} keys"
    );
    assert!(errors > 0, "every decision was made");
    // a decision let in while memory dipped under the bound (a client's
    // buffer freed) writes its key, and the next one is refused; the
    // clients' buffers (replies, connections made again) vary by tens of KB
    assert!(
        after <= 2 * 1024 * 1024 + 64 * 1024,
        "{decided} decisions wrote past maxmemory: used_memory grew by {} bytes, to {after}",
        after.saturating_sub(before)
    );
}
