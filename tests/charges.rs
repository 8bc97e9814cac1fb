//! Costs charged after the fact (`Limiter::charge`), run unchanged against
//! the memory store, a real Redis and (with the `cluster` feature) a Redis
//! Cluster, driven by one explicit clock: charged
//! whatever is left, capped at the capacity, a key in debt refused until it
//! is paid back. Every expected figure was worked out by hand (see the
//! comments); a store that fails gets its charge tried again while the
//! timeout lasts.

mod common;

use std::time::Duration;

use common::{patient_limiter, unique_prefix, PATIENT, T0};
use tower_ratelimit::{Limit, Limiter, ManualClock, MemoryStore, Quota, Verdict};

const S: i64 = 1_000_000;

#[derive(Debug, Clone, Copy)]
enum Op {
    /// Decide a cost of 1: whether allowed, and the retry-after (us) if not.
    Check(bool, i64),
    /// Charge this cost after the fact.
    Charge(u64),
    /// Look at a cost of 1: whether it would be allowed, and when if not.
    Look(bool, i64),
}
use Op::*;

/// (time since T0 in us, operation, remaining after it)
type Row = (i64, Op, u64);

async fn run(limit: &Limit, table: &[Row]) {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("charges");
    let stores = common::limiters_on_clock(&prefix, limit, &clock);
    for (store, limiter) in &stores {
        for (i, &(at, op, remaining)) in table.iter().enumerate() {
            clock.set(T0 + at);
            let ctx = format!("{} on {store}, row {i} (t={at}us, {op:?})", limit.name());
            match op {
                Check(allowed, retry) => {
                    let d = limiter.check("k", 1).await.expect("check");
                    assert_eq!(verdict(&d), (allowed, retry), "{ctx}");
                }
                Look(allowed, retry) => {
                    let d = limiter.peek("k", 1).await.expect("peek");
                    assert_eq!(verdict(&d), (allowed, retry), "{ctx}");
                }
                Charge(cost) => limiter.charge("k", cost).await.expect("charge"),
            }
            let look = limiter.peek("k", 1).await.expect("peek");
            assert_eq!(look.remaining(), remaining, "{ctx}: remaining");
        }
    }
}

fn verdict(d: &tower_ratelimit::Decision) -> (bool, i64) {
    match d.verdict() {
        Verdict::Allowed => (true, 0),
        Verdict::Denied { retry_after } => (false, retry_after.as_micros() as i64),
        other => panic!("unexpected verdict {other:?}"),
    }
}

/// GCRA, 10 per 10 s in bursts of 10: one per second. A check takes 1 (9
/// left); a charge of 5 takes 5 more (4 left); a charge of 20 is capped at
/// the capacity, 10: 16 taken of 10, so the next one fits once 7 have come
/// back, 7 s later.
#[tokio::test]
async fn a_gcra_limit_in_debt_refuses_until_it_is_paid_back() {
    let limit = Limit::new(
        "gcra",
        Quota::rate(10, Duration::from_secs(10))
            .allow_burst(10)
            .gcra(),
    )
    .expect("limit");
    run(
        &limit,
        &[
            (0, Check(true, 0), 9),
            (0, Charge(5), 4),
            (0, Charge(20), 0),
            (0, Look(false, 7 * S), 0),
            (6 * S, Check(false, S), 0),
            (7 * S, Check(true, 0), 0),
            // paid back in full 10 s after the last grant's time
            (17 * S, Look(true, 0), 10),
        ],
    )
    .await;
}

/// A token bucket of 10, one back per second: the same figures as GCRA.
#[tokio::test]
async fn a_token_bucket_in_debt_refuses_until_it_is_paid_back() {
    let limit = Limit::new(
        "tb",
        Quota::rate(10, Duration::from_secs(10))
            .allow_burst(10)
            .token_bucket(),
    )
    .expect("limit");
    run(
        &limit,
        &[
            (0, Check(true, 0), 9),
            (0, Charge(5), 4),
            (0, Charge(20), 0),
            (0, Look(false, 7 * S), 0),
            (7 * S, Check(true, 0), 0),
            (17 * S, Look(true, 0), 10),
        ],
    )
    .await;
}

/// A fixed window of 10 per 10 s (T0 starts one): 1 + 5 + 10 counted, the
/// window refuses until it ends; the next window starts afresh (a window
/// forgets its debt: the bound is one charge per window).
#[tokio::test]
async fn a_fixed_window_in_debt_refuses_until_the_window_ends() {
    let limit = Limit::new(
        "fw",
        Quota::rate(10, Duration::from_secs(10)).fixed_window(),
    )
    .expect("limit");
    run(
        &limit,
        &[
            (0, Check(true, 0), 9),
            (0, Charge(5), 4),
            (0, Charge(20), 0),
            (3 * S, Check(false, 7 * S), 0),
            (10 * S, Check(true, 0), 9),
        ],
    )
    .await;
}

/// A sliding log of 10 per 10 s: entries of 1, 5 and 10 at 0; a cost of 1
/// fits once the excess, 16 + 1 - 10 = 7, has left: all three leave at
/// 10 s. A charge on a log in debt goes where a cost of 1 would: at 10 s.
#[tokio::test]
async fn a_sliding_log_in_debt_refuses_until_its_entries_leave() {
    let limit = Limit::new(
        "log",
        Quota::rate(10, Duration::from_secs(10)).sliding_log(),
    )
    .expect("limit");
    run(
        &limit,
        &[
            (0, Check(true, 0), 9),
            (0, Charge(5), 4),
            (0, Charge(20), 0),
            (2 * S, Look(false, 8 * S), 0),
            (2 * S, Charge(3), 0),
            // the charge of 3 sits at 10 s: the window (10 s, 20 s] holds 3
            (10 * S, Look(true, 0), 7),
            (20 * S, Look(true, 0), 10),
        ],
    )
    .await;
}

/// A sliding window counter of 10 per 10 s: 16 counted in the window of T0;
/// one window later they weigh (10 s - elapsed) / 10 s, so a cost of 1 fits
/// once 16 * (1 - x) + 1 <= 10, x >= 7/16: 4.375 s into the next window.
#[tokio::test]
async fn a_sliding_window_in_debt_refuses_until_the_estimate_allows() {
    let limit = Limit::new(
        "sw",
        Quota::rate(10, Duration::from_secs(10)).sliding_window(),
    )
    .expect("limit");
    run(
        &limit,
        &[
            (0, Check(true, 0), 9),
            (0, Charge(5), 4),
            (0, Charge(20), 0),
            (10 * S, Look(false, 4_375_000), 0),
            (14_375_000, Check(true, 0), 0),
            (30 * S, Look(true, 0), 10),
        ],
    )
    .await;
}

/// A charge on a key never decided creates its state; a charge of 0
/// changes nothing.
#[tokio::test]
async fn a_charge_of_a_fresh_key_counts_and_a_charge_of_nothing_is_nothing() {
    let limit = Limit::new(
        "fresh",
        Quota::rate(10, Duration::from_secs(10)).fixed_window(),
    )
    .expect("limit");
    run(
        &limit,
        &[
            (0, Charge(0), 10),
            (0, Charge(4), 6),
            (S, Check(true, 0), 5),
        ],
    )
    .await;
}

/// 100 tasks on two instances each charge 3: exactly 300 counted, on both
/// stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_are_exact_under_100_concurrent_tasks_across_two_instances() {
    let limit = Limit::new("bulk", Quota::per_hour(1000).fixed_window()).expect("limit");
    let memory = MemoryStore::new();
    let prefix = unique_prefix("charges-load");
    let pairs = [
        (
            "memory",
            patient_limiter(memory.clone(), limit.clone()),
            patient_limiter(memory, limit.clone()),
        ),
        (
            "redis",
            patient_limiter(common::redis_store(&prefix), limit.clone()),
            patient_limiter(common::redis_store(&prefix), limit.clone()),
        ),
    ];
    for (store, a, b) in pairs {
        let tasks: Vec<_> = (0..100)
            .map(|i| {
                let limiter = if i % 2 == 0 { a.clone() } else { b.clone() };
                tokio::spawn(async move { limiter.charge("tenant", 3).await })
            })
            .collect();
        for task in tasks {
            task.await.expect("task").expect("charge");
        }
        assert_eq!(
            a.peek("tenant", 1).await.expect("peek").remaining(),
            700,
            "{store}"
        );
    }
}

/// A charge while Redis is down is tried again: with the server back
/// within the timeout it lands once; with the server gone for longer it
/// fails with the store's error, after trying until the timeout.
#[tokio::test]
async fn a_charge_while_redis_is_down_is_retried_within_the_timeout_then_fails() {
    let mut server = common::TestRedis::spawn();
    let limit = Limit::new("down", Quota::per_hour(100).fixed_window()).expect("limit");
    let store = tower_ratelimit::RedisStore::builder(server.url.clone())
        .prefix(unique_prefix("charge-down"))
        .build()
        .expect("store");
    let limiter = Limiter::builder(store)
        .limit(limit)
        .timeout(Duration::from_secs(5))
        .build()
        .expect("limiter");
    limiter.check("k", 1).await.expect("the store answers");
    server.stop();
    let charging = {
        let limiter = limiter.clone();
        tokio::spawn(async move { limiter.charge("k", 10).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!charging.is_finished(), "the charge is still being tried");
    server.restart();
    charging
        .await
        .expect("task")
        .expect("the charge landed once the server was back");
    // the restarted server lost its data (no persistence): the charge of 10
    // is all it holds, once
    assert_eq!(limiter.peek("k", 1).await.expect("peek").remaining(), 90);

    server.stop();
    let short = Limiter::builder(
        tower_ratelimit::RedisStore::builder(server.url.clone())
            .prefix(unique_prefix("charge-gone"))
            .build()
            .expect("store"),
    )
    .limit(Limit::new("gone", Quota::per_hour(100).fixed_window()).expect("limit"))
    .timeout(Duration::from_millis(200))
    .build()
    .expect("limiter");
    let failed = tokio::time::timeout(PATIENT, short.charge("k", 10))
        .await
        .expect("a failing charge answers by its timeout");
    assert!(failed.is_err(), "a charge that never landed is an error");
}
