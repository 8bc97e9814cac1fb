//! The in-process store's own guarantees: a hard bound on stored keys that
//! never costs a stored key its state, and idle keys reclaimed in the
//! background without traffic, by a task that ends with the store.

use std::time::Duration;

/// 2027-01-15T08:00:00Z in microseconds (as in the other tests).
const T0: i64 = 1_800_000_000_000_000;
use tower_ratelimit::{ConfigError, Limit, Limiter, ManualClock, MemoryStore, Quota, Verdict};

fn two_per_minute() -> Limit {
    Limit::new("l", Quota::fixed_window(2, Duration::from_secs(60))).expect("valid limit")
}

#[test]
fn invalid_bounds_and_intervals_are_config_errors() {
    for bad in [
        MemoryStore::builder().max_keys(0).build(),
        MemoryStore::builder()
            .max_keys(u32::MAX as usize + 1)
            .build(),
        MemoryStore::builder()
            .sweep_interval(Duration::ZERO)
            .build(),
    ] {
        assert!(matches!(bad, Err(ConfigError::Memory(_))), "{bad:?}");
    }
    let store = MemoryStore::builder()
        .max_keys(5)
        .build()
        .expect("a valid bound");
    assert_eq!(store.max_keys(), 5);
}

/// Two per minute in every algorithm.
fn two_per_minute_in_each_algorithm() -> Vec<Limit> {
    let minute = Duration::from_secs(60);
    [
        Quota::sliding_log(2, minute),
        Quota::token_bucket(2, 2, minute),
        Quota::gcra(2, minute, 2),
        Quota::fixed_window(2, minute),
        Quota::sliding_window(2, minute),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, quota)| Limit::new(format!("l{i}"), quota).expect("valid limit"))
    .collect()
}

/// A flood of made-up keys fills the store; from then on no key, made-up
/// or new, ever passes more than its quota, stored keys keep their exact
/// state, and memory stays within the bound. Once the flood's grants have
/// aged out (one period of the limit), new keys get their whole quota again.
#[tokio::test]
async fn at_the_bound_no_key_passes_more_than_its_quota() {
    for limit in two_per_minute_in_each_algorithm() {
        let name = limit.name().to_owned();
        let clock = ManualClock::new(T0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(100)
            .build()
            .expect("store");
        let limiter = Limiter::new(store.clone(), limit.clone());
        let passes = |key: String| {
            let limiter = limiter.clone();
            async move {
                let mut passed = 0;
                for _ in 0..6 {
                    passed += u32::from(limiter.check(&key, 1).await.unwrap().is_allowed());
                }
                passed
            }
        };

        // The victim is stored first and spends its limit.
        assert_eq!(passes("victim".into()).await, 2, "{name}");
        // A flood of made-up keys, each checked once, then again.
        for i in 0..1_000 {
            limiter.check(format!("flood-{i}"), 1).await.unwrap();
        }
        assert!(store.len() <= 100, "{name}: the bound holds");
        for i in (0..1_000).step_by(97) {
            let again = passes(format!("flood-{i}")).await;
            assert!(again <= 1, "{name}: flood-{i} passed {again} more");
        }
        // New keys while the store is full never pass more than their quota
        // (they share the flood's state: here, nothing is left).
        for i in 0..20 {
            let passed = passes(format!("new-{i}")).await;
            assert!(passed <= 2, "{name}: new-{i} passed {passed} of 2");
        }
        assert_eq!(passes("victim".into()).await, 0, "{name}");
        assert!(store.len() <= 100, "{name}: the bound holds");

        // A period later the flood's grants have aged out: a new key has
        // its whole quota, and no more.
        clock.advance(Duration::from_secs(121));
        assert_eq!(passes("late".into()).await, 2, "{name}");
    }
}

/// Stored keys are never evicted to make room, and once stored states
/// expire, new keys are stored again.
#[tokio::test]
async fn at_the_bound_stored_keys_keep_their_limits() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(8)
        .build()
        .expect("store");
    let limiter = Limiter::new(store.clone(), two_per_minute());
    for _ in 0..2 {
        assert!(limiter.check("victim", 1).await.unwrap().is_allowed());
    }
    for i in 0..7 {
        assert!(limiter
            .check(format!("k{i}"), 1)
            .await
            .unwrap()
            .is_allowed());
    }
    assert_eq!(store.len(), 8);
    // A cost above the capacity never passes, stored or not.
    for i in 0..100 {
        let key = format!("flood-{i}");
        assert_eq!(
            limiter.check(&key, 3).await.unwrap().verdict(),
            Verdict::CostExceedsCapacity
        );
        limiter.check(&key, 1).await.unwrap();
    }
    assert_eq!(store.len(), 8, "the bound holds");
    assert!(!limiter.check("victim", 1).await.unwrap().is_allowed());
    assert!(limiter.check("k0", 1).await.unwrap().is_allowed());
    assert!(!limiter.check("k0", 1).await.unwrap().is_allowed());
    assert_eq!(store.len(), 8);

    // Once stored states expire and are reclaimed, new keys are stored again.
    clock.advance(Duration::from_secs(121));
    limiter.reset("victim").await.unwrap();
    assert_eq!(store.len(), 7);
    for _ in 0..2 {
        assert!(limiter.check("late", 1).await.unwrap().is_allowed());
    }
    assert!(!limiter.check("late", 1).await.unwrap().is_allowed());
}

#[tokio::test(start_paused = true)]
async fn expired_keys_are_reclaimed_without_traffic() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .sweep_interval(Duration::from_secs(1))
        .build()
        .expect("store");
    let limit = Limit::new("l", Quota::sliding_log(5, Duration::from_secs(10))).unwrap();
    let gcra = Limit::new("g", Quota::gcra(10, Duration::from_secs(1), 10)).unwrap();
    let limiter = Limiter::builder(store.clone())
        .limit(limit)
        .limit(gcra)
        .build()
        .unwrap();
    for i in 0..5_000 {
        assert!(limiter
            .check(format!("client-{i}"), 1)
            .await
            .unwrap()
            .is_allowed());
    }
    assert_eq!(store.len(), 10_000);

    // Sweeps run, but the states are alive on the store's clock: all stay.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(store.len(), 10_000);

    // The GCRA states are full again after 1 s; the logs stay 10 s.
    clock.advance(Duration::from_secs(2));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(store.len(), 5_000);
    clock.advance(Duration::from_secs(9));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        store.len(),
        0,
        "idle keys are reclaimed with no decision made"
    );
}

#[tokio::test(start_paused = true)]
async fn the_reclaimer_ends_when_the_store_is_dropped() {
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let store = MemoryStore::builder()
        .sweep_interval(Duration::from_secs(1))
        .build()
        .expect("store");
    let limiter = Limiter::new(store.clone(), two_per_minute());
    assert!(limiter.check("k", 1).await.unwrap().is_allowed());
    let clone = store.clone();
    assert_eq!(
        metrics.num_alive_tasks(),
        before + 1,
        "one reclaimer per store"
    );
    drop((store, clone, limiter));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(metrics.num_alive_tasks(), before, "the reclaimer ended");
}

#[test]
fn without_a_runtime_decisions_still_sweep_as_they_go() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::with_clock(clock.clone());
    let limiter = Limiter::new(store.clone(), two_per_minute());
    // No Tokio runtime at all: no background reclaimer.
    futures::executor::block_on(async {
        for i in 0..2_000 {
            assert!(limiter
                .check(format!("a-{i}"), 1)
                .await
                .unwrap()
                .is_allowed());
        }
    });
    assert_eq!(store.len(), 2_000);
    clock.advance(Duration::from_secs(61));
    futures::executor::block_on(async {
        for i in 0..2_000 {
            assert!(limiter
                .check(format!("b-{i}"), 1)
                .await
                .unwrap()
                .is_allowed());
        }
    });
    assert!(store.len() < 2_500, "{} states left", store.len());
}
