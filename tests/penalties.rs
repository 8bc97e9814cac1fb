//! Penalties and bans (`Limit::with_penalty`): one table of refusals, blocks,
//! escalation, forgetting and the admin operations, run unchanged on the
//! memory store, a real Redis and (with the `cluster` feature) a Redis
//! Cluster, on one manual clock; exact counting under 100 concurrent tasks
//! of two instances; penalty keys deleted or garbled behind the library's
//! back.

mod common;

use std::time::Duration;

use common::{redis_store_with_clock, unique_prefix, PATIENT, T0};
use tower_ratelimit::{Limit, Limiter, ManualClock, MemoryStore, Penalty, Quota, Store, Verdict};

const S: u64 = 1_000_000;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// 2 per minute (a sliding log); 3 refusals within a minute block for
/// 10 s, then 100 s (and 100 s again); offences forgotten 1000 s after a
/// block ends.
fn login() -> Limit {
    Limit::new("login", Quota::rate(2, secs(60)).sliding_log())
        .expect("limit")
        .with_penalty(
            Penalty::new(3, secs(60), [secs(10), secs(100)])
                .expect("penalty")
                .forget_after(secs(1000)),
        )
}

fn limiter(store: impl Into<Store>, limits: &[Limit]) -> Limiter {
    limits
        .iter()
        .cloned()
        .fold(Limiter::builder(store), |b, l| b.limit(l))
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter")
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    /// A check of cost 1: granted with this remaining, or refused with
    /// this retry-after (s) and whether blocked.
    Check(Expect),
    /// A peek: the same, taking nothing and counting no refusal.
    Peek(Expect),
    /// A take of up to 5: the amount taken, or 0 and the retry-after (s).
    Take(u64, Option<u64>),
    /// `inspect`: blocked for (s), offences, refusals.
    Inspect(Option<u64>, u32, u32),
    /// `block` for this many seconds.
    Block(u64),
    /// `unblock`: whether it was blocked.
    Unblock(bool),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    Granted(u64),
    Refused(u64, bool),
}
use Expect::*;
use Step::*;

/// (seconds since T0, step)
const TABLE: &[(u64, Step)] = &[
    (0, Check(Granted(1))),
    (0, Check(Granted(0))),
    (1, Check(Refused(59, false))), // refusal 1
    (2, Check(Refused(58, false))), // refusal 2
    (3, Peek(Refused(57, false))),  // a look counts nothing
    (3, Take(0, Some(57))),         // nor does a take that finds nothing
    (3, Inspect(None, 0, 2)),
    (3, Check(Refused(10, true))), // refusal 3: the first offence, 10 s
    (5, Check(Refused(8, true))),  // refused by the block, not counted
    (5, Peek(Refused(8, true))),
    (5, Take(0, Some(8))),
    (5, Inspect(Some(8), 1, 0)),
    (13, Check(Refused(47, false))), // the block is over, the quota is not
    (14, Check(Refused(46, false))),
    (15, Check(Refused(100, true))), // the second offence: 100 s
    (115, Check(Granted(1))),
    (115, Check(Granted(0))),
    (116, Check(Refused(59, false))),
    (117, Check(Refused(58, false))),
    (118, Check(Refused(100, true))), // the third: the last block again
    (118, Inspect(Some(100), 3, 0)),
    // the block ended at 218 s: offences forgotten at 1218 s
    (1217, Inspect(None, 3, 0)),
    (1218, Inspect(None, 0, 0)),
    (1218, Check(Granted(1))),
    (1218, Check(Granted(0))),
    (1219, Check(Refused(59, false))),
    // refusals more than a minute apart from the first start again
    (1280, Check(Granted(1))),
    (1280, Check(Granted(0))),
    (1281, Check(Refused(59, false))),
    (1282, Check(Refused(58, false))),
    (1283, Check(Refused(10, true))), // a first offence again: 10 s
    // by hand: no offence, and shortens or lengthens the block in force
    (1284, Block(50)),
    (1284, Check(Refused(50, true))),
    (1284, Inspect(Some(50), 1, 0)),
    (1300, Unblock(true)),
    (1300, Unblock(false)),
    (1300, Inspect(None, 0, 0)),
    (1345, Check(Granted(1))),
    (1345, Block(30)),
    (1345, Take(0, Some(30))),
    (1375, Take(1, None)),
];

async fn run_table(store: &str, limiter: &Limiter, clock: &ManualClock) {
    clock.set(T0);
    for (i, &(at, step)) in TABLE.iter().enumerate() {
        clock.set(T0 + (at * S) as i64);
        let ctx = format!("{store}, row {i} (t={at}s) {step:?}");
        let expect_decision = |d: &tower_ratelimit::Decision, e: Expect| {
            let got = match d.verdict() {
                Verdict::Allowed => Granted(d.remaining()),
                Verdict::Denied { retry_after } => Refused(
                    retry_after.as_secs(),
                    d.statuses().iter().any(|s| s.is_blocked()),
                ),
                other => panic!("{ctx}: {other:?}"),
            };
            assert_eq!(got, e, "{ctx}: {d:?}");
            if let Refused(retry, true) = e {
                assert_eq!(d.retry_after(), Some(secs(retry)), "{ctx}: whole seconds");
                assert_eq!(d.remaining(), 0, "{ctx}");
            }
        };
        match step {
            Check(e) => expect_decision(&limiter.check("mallory", 1).await.expect("check"), e),
            Peek(e) => expect_decision(&limiter.peek("mallory", 1).await.expect("peek"), e),
            Take(n, retry) => {
                let taken = limiter.take_up_to("mallory", 5).await.expect("take");
                assert_eq!(taken.granted_amount(), n, "{ctx}");
                assert_eq!(
                    taken.decision().retry_after(),
                    retry.map(secs),
                    "{ctx}: {taken:?}"
                );
            }
            Inspect(blocked, offences, refusals) => {
                let seen = limiter
                    .admin()
                    .inspect("login", "mallory")
                    .await
                    .expect("inspect");
                assert_eq!(seen.blocked_for, blocked.map(secs), "{ctx}: {seen:?}");
                assert_eq!(
                    (seen.offences, seen.refusals),
                    (offences, refusals),
                    "{ctx}"
                );
                assert_eq!(
                    seen.decision.statuses()[0].is_blocked(),
                    blocked.is_some(),
                    "{ctx}"
                );
            }
            Block(n) => limiter
                .admin()
                .block("login", "mallory", secs(n))
                .await
                .expect("block"),
            Unblock(was) => {
                assert_eq!(
                    limiter
                        .admin()
                        .unblock("login", "mallory")
                        .await
                        .expect("unblock"),
                    was,
                    "{ctx}"
                )
            }
        }
    }
}

#[tokio::test]
async fn refusals_block_escalate_and_are_forgotten_on_memory_and_redis() {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("penalties");
    let limits = [login()];
    let memory = limiter(MemoryStore::with_clock(clock.clone()), &limits);
    run_table("memory", &memory, &clock).await;
    let redis = limiter(redis_store_with_clock(&prefix, &clock), &limits);
    run_table("redis", &redis, &clock).await;
}

#[cfg(feature = "cluster")]
#[tokio::test]
async fn refusals_block_escalate_and_are_forgotten_on_a_cluster() {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("penalties-cluster");
    let store = tower_ratelimit::RedisStore::cluster_builder(common::cluster::shared().seed_urls())
        .prefix(&prefix)
        .expiry_slack(common::TEST_CLOCK_SLACK)
        .clock(clock.clone())
        .build()
        .expect("a cluster store");
    run_table("cluster", &limiter(store, &[login()]), &clock).await;
}

/// Only a limit that refuses by itself counts: a decision refused by
/// another limit of the same call counts nothing in the penalized one;
/// while the penalized limit blocks, the others are not charged.
#[tokio::test]
async fn only_the_limit_that_refused_counts_and_a_block_charges_no_other() {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("penalties-two");
    let strict = Limit::new("strict", Quota::rate(1, secs(60)).sliding_log()).expect("limit");
    let penalized = Limit::new("loose", Quota::rate(3, secs(60)).sliding_log())
        .expect("limit")
        .with_penalty(Penalty::new(1, secs(60), [secs(30)]).expect("penalty"));
    let limits = [penalized, strict];
    for (store, limiter) in [
        (
            "memory",
            limiter(MemoryStore::with_clock(clock.clone()), &limits),
        ),
        (
            "redis",
            limiter(redis_store_with_clock(&prefix, &clock), &limits),
        ),
    ] {
        clock.set(T0);
        assert!(limiter.check("k", 1).await.expect("check").is_allowed());
        // refused by `strict` alone: `loose` counts nothing
        let d = limiter.check("k", 1).await.expect("check");
        assert_eq!(d.retry_after(), Some(secs(60)), "{store}");
        let seen = limiter
            .admin()
            .inspect("loose", "k")
            .await
            .expect("inspect");
        assert_eq!((seen.refusals, seen.offences), (0, 0), "{store}");
        // a block: both statuses read, the decision refused for the longer
        clock.set(T0 + (10 * S) as i64);
        limiter
            .admin()
            .block("loose", "k", secs(90))
            .await
            .expect("block");
        let d = limiter.check("k", 1).await.expect("check");
        assert_eq!(d.retry_after(), Some(secs(90)), "{store}: {d:?}");
        assert!(d.statuses()[0].is_blocked() && !d.statuses()[1].is_blocked());
        assert_eq!(d.statuses()[1].available_in(), Some(secs(50)), "{store}");
        // after the block and the window: one grant each, nothing was charged
        clock.set(T0 + (100 * S) as i64);
        let d = limiter.check("k", 1).await.expect("check");
        assert!(d.is_allowed(), "{store}: {d:?}");
        assert_eq!(d.statuses()[0].remaining(), 2, "{store}: 1 of 3 used");
    }
}

/// Issue 53, item 3: the same traffic bans the same keys on Redis, where
/// every key has its own state, and on a memory store of 4 keys made full
/// by two offenders, where a limit without rate states decides its new keys
/// on a shared overflow state: 40 new keys of it, once each (on memory the
/// later ones of a shard refused there, on Redis all granted), are banned
/// on neither; an offender refused by its own state is banned on both.
#[tokio::test]
async fn a_full_memory_store_bans_the_keys_redis_bans() {
    let clock = ManualClock::new(T0);
    let tiny = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(4)
        .build()
        .expect("store");
    let redis = redis_store_with_clock(&unique_prefix("penalties-full"), &clock);
    let mut traffic = vec![(0, "x".to_owned(), 2), (1, "y".to_owned(), 2)];
    traffic.extend((0..40).map(|i| (2, format!("new-{i}"), 1)));
    traffic.push((0, "x2".to_owned(), 2));
    let mut banned = Vec::new();
    for store in [Store::from(tiny), Store::from(redis)] {
        // 1 a minute, banned an hour at the first refusal
        let limiters: Vec<Limiter> = ["a", "b", "c"]
            .iter()
            .map(|name| {
                let limit = Limit::new(*name, Quota::rate(1, secs(60)).fixed_window())
                    .expect("limit")
                    .with_penalty(Penalty::new(1, secs(3_600), [secs(3_600)]).expect("penalty"));
                limiter(store.clone(), &[limit])
            })
            .collect();
        let mut here = Vec::new();
        for (i, key, tries) in &traffic {
            let (limiter, name) = (&limiters[*i], ["a", "b", "c"][*i]);
            for _ in 0..*tries {
                limiter.check(key, 1).await.expect("check");
            }
            let seen = limiter.admin().inspect(name, key).await.expect("inspect");
            if seen.blocked_for.is_some() {
                here.push(format!("{name} {key}"));
            }
        }
        banned.push(here);
    }
    assert_eq!(banned[0], ["a x", "b y", "a x2"], "memory");
    assert_eq!(banned[1], banned[0], "redis");
}

/// A limit without a penalty has none of its operations.
#[tokio::test]
async fn penalty_operations_need_a_penalty() {
    let plain = Limit::new("plain", Quota::per_minute(1).gcra()).expect("limit");
    let limiter = limiter(MemoryStore::new(), &[plain]);
    for result in [
        limiter.admin().block("plain", "k", secs(1)).await.err(),
        limiter.admin().unblock("plain", "k").await.err(),
        limiter.admin().inspect("plain", "k").await.err(),
    ] {
        assert!(
            matches!(result, Some(tower_ratelimit::Error::Config(_))),
            "{result:?}"
        );
    }
}

/// 100 tasks over two instances (two limiters on one memory store; two
/// Redis stores on one Redis) refused at once on one key: each round
/// counts exactly N refusals into one offence, and refuses the rest by the
/// block, uncounted; no refusal is lost, no block doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_refusals_make_exactly_one_offence_per_n() {
    const N: u32 = 7;
    const TASKS: usize = 100;
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("penalties-concurrent");
    let limit = Limit::new("burst", Quota::rate(1, secs(3600)).sliding_log())
        .expect("limit")
        .with_penalty(
            Penalty::new(N, secs(3600), [secs(10), secs(20), secs(30)]).expect("penalty"),
        );
    let memory = MemoryStore::with_clock(clock.clone());
    let build = |store: MemoryStore| {
        Limiter::builder(store)
            .limit(limit.clone())
            .timeout(PATIENT)
            .build()
            .expect("limiter")
    };
    let build_redis = || {
        Limiter::builder(redis_store_with_clock(&prefix, &clock))
            .limit(limit.clone())
            .timeout(PATIENT)
            .build()
            .expect("limiter")
    };
    let pairs = [
        ("memory", build(memory.clone()), build(memory)),
        ("redis", build_redis(), build_redis()),
    ];
    for (store, a, b) in pairs {
        clock.set(T0);
        for round in 1..=3u32 {
            let tasks: Vec<_> = (0..TASKS)
                .map(|i| {
                    let limiter = if i % 2 == 0 { a.clone() } else { b.clone() };
                    tokio::spawn(async move { limiter.check("hot", 1).await })
                })
                .collect();
            let (mut granted, mut counted, mut blocked) = (0, 0, 0);
            for task in tasks {
                let d = task.await.expect("task").expect("decision");
                if d.is_allowed() {
                    granted += 1;
                } else if d.statuses()[0].is_blocked() {
                    blocked += 1;
                } else {
                    counted += 1;
                }
            }
            let expected_granted = usize::from(round == 1);
            assert_eq!(granted, expected_granted, "{store}, round {round}");
            // N - 1 refusals counted, the N-th blocks with the rest
            assert_eq!(counted, N as usize - 1, "{store}, round {round}");
            assert_eq!(blocked, TASKS - expected_granted - counted);
            let seen = a.admin().inspect("burst", "hot").await.expect("inspect");
            assert_eq!((seen.offences, seen.refusals), (round, 0), "{store}");
            assert_eq!(
                seen.blocked_for,
                Some(secs(10 * u64::from(round))),
                "{store}, round {round}: escalated once"
            );
            clock.advance(secs(31));
        }
    }
}

/// A penalty key deleted, evicted or overwritten behind the library's back
/// reads as a fresh state: no script error, and the next refusal writes a
/// good one.
#[tokio::test]
async fn a_penalty_key_deleted_or_garbled_reads_as_fresh() {
    use redis::Commands;
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("penalties-faults");
    let limiter = limiter(redis_store_with_clock(&prefix, &clock), &[login()]);
    let key = format!("{prefix}:{{mallory}}:login:pen");
    let mut conn = common::connection();
    assert!(limiter
        .check("mallory", 2)
        .await
        .expect("check")
        .is_allowed());
    for _ in 0..3 {
        limiter.check("mallory", 1).await.expect("check");
    }
    assert!(limiter
        .admin()
        .inspect("login", "mallory")
        .await
        .expect("inspect")
        .blocked_for
        .is_some());
    let garbage: [&dyn Fn(&mut redis::Connection); 5] = [
        &|c| {
            let _: () = c.del(&key).expect("del");
        },
        &|c| {
            let _: () = c.set(&key, "not a penalty").expect("set");
        },
        // the right length and tag, fields that are no integers
        &|c| {
            let mut v = vec![b'P'];
            for x in [0.5f64, f64::NAN, -1.0, 1e300] {
                v.extend_from_slice(&x.to_le_bytes());
            }
            let _: () = c.set(&key, v).expect("set");
        },
        &|c| {
            let _: () = c.del(&key).expect("del");
            let _: () = c.hset(&key, "f", "v").expect("hset");
        },
        &|c| {
            let _: () = c.del(&key).expect("del");
            let _: () = c.rpush(&key, "x").expect("rpush");
        },
    ];
    for (i, spoil) in garbage.iter().enumerate() {
        spoil(&mut conn);
        let seen = limiter
            .admin()
            .inspect("login", "mallory")
            .await
            .expect("no script error");
        assert_eq!(
            (seen.blocked_for, seen.offences, seen.refusals),
            (None, 0, 0),
            "case {i}"
        );
        let d = limiter.check("mallory", 1).await.expect("no script error");
        assert!(!d.is_allowed() && !d.statuses()[0].is_blocked(), "case {i}");
        let seen = limiter
            .admin()
            .inspect("login", "mallory")
            .await
            .expect("inspect");
        assert_eq!(seen.refusals, 1, "case {i}: a good state written over it");
    }
    let _: () = conn.del(&key).expect("del");
}

/// A penalty on a limit whose quota is kept in the store: the kept quota
/// decides, the penalty counts its refusals; alone and beside another
/// limit (the driver's loop), on both stores.
#[tokio::test]
async fn a_penalty_works_with_a_quota_kept_in_the_store() {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("penalties-kept");
    let kept = Limit::new("kept", Quota::rate(5, secs(60)).sliding_log())
        .expect("limit")
        .use_stored_quota()
        .with_penalty(Penalty::new(2, secs(60), [secs(40)]).expect("penalty"));
    let other = Limit::new("other", Quota::rate(100, secs(60)).sliding_log()).expect("limit");
    for limits in [vec![kept.clone()], vec![other, kept]] {
        for (store, limiter) in [
            (
                "memory",
                limiter(MemoryStore::with_clock(clock.clone()), &limits),
            ),
            (
                "redis",
                limiter(redis_store_with_clock(&prefix, &clock), &limits),
            ),
        ] {
            clock.set(T0);
            let n = limits.len();
            let ctx = format!("{store}, {n} limits");
            limiter
                .admin()
                .set_stored_quota("kept", Quota::rate(1, secs(60)).sliding_log())
                .await
                .expect("set");
            let key = format!("k{n}");
            let d = limiter.check(&key, 1).await.expect("check");
            assert!(d.is_allowed(), "{ctx}: {d:?}");
            assert_eq!(d.statuses()[n - 1].capacity(), 1, "{ctx}: the kept quota");
            let d = limiter.check(&key, 1).await.expect("check");
            assert_eq!(d.retry_after(), Some(secs(60)), "{ctx}: refusal 1");
            let d = limiter.check(&key, 1).await.expect("check");
            assert_eq!(d.retry_after(), Some(secs(40)), "{ctx}: refusal 2 blocks");
            assert!(d.statuses()[n - 1].is_blocked(), "{ctx}");
            let seen = limiter
                .admin()
                .inspect("kept", &key)
                .await
                .expect("inspect");
            assert_eq!(
                (seen.offences, seen.blocked_for),
                (1, Some(secs(40))),
                "{ctx}"
            );
            limiter
                .admin()
                .remove_stored_quota("kept")
                .await
                .expect("remove");
        }
    }
}

/// The cache of denials of a limiter over Redis: a block's refusal is
/// answered locally until the block ends, an `unblock` through the same
/// limiter drops it; a penalized limit's other refusals always reach the
/// store (each must be counted).
#[tokio::test]
async fn blocks_are_cached_until_an_unblock_and_counted_refusals_never_are() {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("penalties-cache");
    let limiter = Limiter::builder(redis_store_with_clock(&prefix, &clock))
        .limit(login())
        .timeout(PATIENT)
        .build()
        .expect("limiter");
    assert!(limiter.check("eve", 2).await.expect("check").is_allowed());
    for i in 0..2 {
        let d = limiter.check("eve", 1).await.expect("check");
        assert!(!d.from_local_cache(), "refusal {i} is counted by the store");
    }
    let d = limiter.check("eve", 1).await.expect("check");
    assert!(d.statuses()[0].is_blocked() && !d.from_local_cache());
    let d = limiter.check("eve", 1).await.expect("check");
    assert!(
        d.from_local_cache() && d.statuses()[0].is_blocked(),
        "{d:?}"
    );
    assert_eq!(d.retry_after(), Some(secs(10)));
    assert!(limiter
        .admin()
        .unblock("login", "eve")
        .await
        .expect("unblock"));
    let d = limiter.check("eve", 1).await.expect("check");
    assert!(
        !d.from_local_cache() && !d.statuses()[0].is_blocked(),
        "{d:?}"
    );
}

/// A block leaves refunds alone: a grant made before it is given back in
/// full, and the block stays; a reset leaves the penalty too.
#[tokio::test]
async fn a_refund_is_unaffected_by_a_block() {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("penalties-refund");
    let limits = [login()];
    for (store, limiter) in [
        (
            "memory",
            limiter(MemoryStore::with_clock(clock.clone()), &limits),
        ),
        (
            "redis",
            limiter(redis_store_with_clock(&prefix, &clock), &limits),
        ),
    ] {
        clock.set(T0);
        let grant = limiter.refundable().check("zoe", 2).await.expect("check");
        assert!(grant.is_allowed(), "{store}");
        limiter
            .admin()
            .block("login", "zoe", secs(30))
            .await
            .expect("block");
        assert!(grant.refund().await.expect("refund"), "{store}");
        let seen = limiter
            .admin()
            .inspect("login", "zoe")
            .await
            .expect("inspect");
        assert_eq!(seen.blocked_for, Some(secs(30)), "{store}: the block stays");
        assert!(seen.decision.statuses()[0].is_blocked(), "{store}");
        // a reset forgets the quota's state, not the penalty
        limiter.reset("zoe").await.expect("reset");
        let d = limiter.check("zoe", 1).await.expect("check");
        assert!(d.statuses()[0].is_blocked(), "{store}: still blocked");
        assert!(limiter
            .admin()
            .unblock("login", "zoe")
            .await
            .expect("unblock"));
        let d = limiter.peek("zoe", 1).await.expect("peek");
        assert_eq!(d.remaining(), 2, "{store}: the grant came back whole");
    }
}

/// A block written by an instance whose clock is a year ahead (its
/// offence's, and one by hand) ends at most its own length from the store's
/// clock: the refusal's retry is at most the longest configured ban, and
/// another instance's cache of denials holds it no longer than that retry.
#[tokio::test]
async fn a_block_written_by_a_clock_a_year_ahead_ends_within_its_length() {
    const YEAR: i64 = 366 * 86_400 * S as i64;
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("penalties-skew");
    let memory = MemoryStore::with_clock(clock.clone());
    let instance = |store: &str, cache: bool| {
        let builder = if store == "memory" {
            Limiter::builder(memory.clone())
        } else {
            Limiter::builder(redis_store_with_clock(&prefix, &clock))
        };
        builder
            .limit(login())
            .timeout(PATIENT)
            .cache_denials(cache)
            .build()
            .expect("limiter")
    };
    for store in ["memory", "redis"] {
        // an instance whose clock is a year ahead: an offence (blocked
        // 10 s) and a block by hand of 100 s (the longest configured ban)
        let ahead = instance(store, false);
        clock.set(T0 + YEAR);
        for _ in 0..2 {
            assert!(ahead.check("ahead", 1).await.expect("check").is_allowed());
        }
        for _ in 0..3 {
            ahead.check("ahead", 1).await.expect("check");
        }
        ahead
            .admin()
            .block("login", "by-hand", secs(100))
            .await
            .expect("block");
        // another instance, on the store's clock, caching denials
        let limiter = instance(store, true);
        clock.set(T0);
        for (key, ban) in [("ahead", secs(10)), ("by-hand", secs(100))] {
            let ctx = format!("{store}, {key}");
            let d = limiter.check(key, 1).await.expect("check");
            assert!(d.statuses()[0].is_blocked(), "{ctx}: {d:?}");
            let retry = d.retry_after().expect("refused");
            assert!(retry <= secs(100), "{ctx}: {retry:?}");
            assert_eq!(retry, ban, "{ctx}: the block's own length from now");
            // (the memory store has no cache of denials: nothing to cache)
            let cached = limiter.check(key, 1).await.expect("check");
            assert_eq!(cached.from_local_cache(), store == "redis", "{ctx}");
            assert_eq!(cached.retry_after(), Some(ban), "{ctx}: {cached:?}");
            let seen = limiter
                .admin()
                .inspect("login", key)
                .await
                .expect("inspect");
            assert_eq!(seen.blocked_for, Some(ban), "{ctx}: {seen:?}");
        }
        // the cache holds each for its retry only: then the store is asked
        // again, and the block is over
        clock.set(T0 + (10 * S) as i64);
        let d = limiter.check("ahead", 1).await.expect("check");
        assert!(!d.from_local_cache(), "{store}: {d:?}");
        assert!(!d.statuses()[0].is_blocked(), "{store}: {d:?}");
        clock.set(T0 + (100 * S) as i64);
        let d = limiter.check("by-hand", 1).await.expect("check");
        assert!(d.is_allowed() && !d.from_local_cache(), "{store}: {d:?}");
    }
}
