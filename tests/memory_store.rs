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

#[tokio::test]
async fn at_the_bound_new_keys_are_decided_fresh_and_stored_keys_keep_their_limits() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(8)
        .build()
        .expect("store");
    let limiter = Limiter::new(store.clone(), two_per_minute());

    // The victim is stored first and spends its limit.
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

    // A flood of made-up keys: each is decided against a fresh state (so a
    // request above the capacity still never passes) and none is stored.
    for i in 0..1_000 {
        let key = format!("flood-{i}");
        assert!(limiter.check(&key, 2).await.unwrap().is_allowed());
        assert_eq!(
            limiter.check(&key, 3).await.unwrap().verdict(),
            Verdict::CostExceedsCapacity
        );
    }
    assert_eq!(store.len(), 8, "the bound holds");
    // A new key beyond the bound is limited per request only: not remembered.
    for _ in 0..3 {
        assert!(limiter.check("unremembered", 2).await.unwrap().is_allowed());
    }

    // Stored keys were not evicted and keep their exact limits.
    let victim = limiter.check("victim", 1).await.unwrap();
    assert!(
        !victim.is_allowed(),
        "the victim's state survived the flood"
    );
    assert!(limiter.check("k0", 1).await.unwrap().is_allowed());
    assert!(!limiter.check("k0", 1).await.unwrap().is_allowed());
    assert_eq!(store.len(), 8);

    // Once stored states expire and are reclaimed, new keys are stored again.
    clock.advance(Duration::from_secs(61));
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
