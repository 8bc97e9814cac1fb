//! Many pools and tasks on one key: no algorithm ever grants more than its bound.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{assert_keys_expire, redis_store, state_lifetime, unique_prefix};
use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};

const POOLS: usize = 8;
const TASKS: usize = 64;
const ATTEMPTS: usize = 6;

/// Hammers `key` from POOLS limiters (each its own store) x TASKS tasks and
/// returns how much was granted.
async fn hammer(limiters: Vec<Limiter>, cost: u64) -> u64 {
    let granted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for limiter in limiters {
        for _ in 0..TASKS {
            let (limiter, granted) = (limiter.clone(), granted.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..ATTEMPTS {
                    let d = limiter.check("hot", cost).await.expect("decision");
                    if d.is_allowed() {
                        granted.fetch_add(cost, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("task");
    }
    granted.load(Ordering::Relaxed)
}

/// Eight independent stores (eight pools, as on eight machines) over one prefix.
fn redis_limiters(prefix: &str, limit: &Limit) -> Vec<Limiter> {
    let limiter = |_| {
        Limiter::builder(redis_store(prefix))
            .limit(limit.clone())
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap()
    };
    (0..POOLS).map(limiter).collect()
}

/// Quotas that cannot refill during the test (periods of hours), so the bound
/// is exactly the capacity: any over-grant is a race.
fn quotas() -> Vec<(Quota, u64)> {
    let hour = Duration::from_secs(3600);
    vec![
        (Quota::rate(100, hour).sliding_log(), 100),
        (Quota::rate(1, hour).allow_burst(100).token_bucket(), 100),
        (Quota::rate(1, hour).allow_burst(100).gcra(), 100),
        (
            Quota::rate(100, Duration::from_secs(10 * 366 * 86_400)).fixed_window(),
            100,
        ),
        (Quota::rate(100, hour).sliding_window(), 100),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_never_grants_more_than_the_bound() {
    for (quota, bound) in quotas() {
        for cost in [1, 3] {
            let prefix = unique_prefix("concurrency");
            let limit = Limit::new("hot", quota).unwrap();
            let limiters = redis_limiters(&prefix, &limit);
            let granted = hammer(limiters, cost).await;
            let expected = bound - bound % cost;
            assert_eq!(
                granted,
                expected,
                "{:?} cost {cost}: {granted} granted",
                quota.algorithm()
            );
            assert_keys_expire(&prefix, state_lifetime([&limit], Duration::ZERO));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_never_grants_more_than_the_bound() {
    for (quota, bound) in quotas() {
        let store = MemoryStore::new();
        let limit = Limit::new("hot", quota).unwrap();
        let limiters = (0..POOLS)
            .map(|_| Limiter::new(store.clone(), limit.clone()))
            .collect();
        assert_eq!(hammer(limiters, 1).await, bound, "{:?}", quota.algorithm());
    }
}

/// The sliding log in real time: N per short window W, checked over the
/// server's own timeline: every window of length W holds at most N grants.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sliding_log_holds_in_every_window_in_real_time() {
    let prefix = unique_prefix("slog-rt");
    let (n, window) = (20u64, Duration::from_millis(200));
    let limit = Limit::new("hot", Quota::rate(n, window).sliding_log()).unwrap();
    let limiters = redis_limiters(&prefix, &limit);
    let granted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for limiter in limiters {
        for _ in 0..TASKS {
            let (limiter, granted) = (limiter.clone(), granted.clone());
            tasks.push(tokio::spawn(async move {
                // several windows long, however fast denials are answered
                // (the local cache of denials answers most without Redis)
                let until = tokio::time::Instant::now() + 4 * window;
                while tokio::time::Instant::now() < until {
                    let d = limiter.check("hot", 1).await.expect("decision");
                    if d.is_allowed() {
                        granted.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }));
        }
    }
    // meanwhile, sample the log: its scores are the grants' server times
    let mut conn = common::connection();
    let key = format!("{prefix}:{{hot}}:hot:log");
    let mut max_seen = 0usize;
    let mut all_scores: Vec<i64> = Vec::new();
    while !tasks.iter().all(|t| t.is_finished()) {
        let scores: Vec<(Vec<u8>, i64)> = redis::cmd("ZRANGE")
            .arg(&key)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(&mut conn)
            .unwrap();
        max_seen = max_seen.max(scores.len());
        all_scores.extend(scores.into_iter().map(|(_, s)| s));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    all_scores.sort_unstable();
    all_scores.dedup();
    let w = window.as_micros() as i64;
    for (i, &start) in all_scores.iter().enumerate() {
        let inside = all_scores[i..]
            .iter()
            .take_while(|&&t| t < start + w)
            .count();
        assert!(
            inside as u64 <= n,
            "{inside} grants within {window:?} starting at {start}"
        );
    }
    assert!(max_seen as u64 <= n);
    let granted = granted.load(Ordering::Relaxed);
    assert!(
        granted > n,
        "the test ran long enough to span several windows ({granted} grants)"
    );
    assert_keys_expire(&prefix, state_lifetime([&limit], Duration::ZERO));
}
