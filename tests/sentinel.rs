//! The store on the master Redis Sentinel names: a master, a replica and
//! three sentinels started by the test; the master is killed under load.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::sentinel::TestSentinel;
use common::{decides, unique_prefix};
use tower_ratelimit::{Limit, Limiter, Quota, RedisStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_the_master_through_a_failover() {
    let sentinel = Arc::new(TestSentinel::start());
    let store = RedisStore::sentinel_builder(sentinel.sentinel_urls(), sentinel.master_name())
        .prefix(unique_prefix("sentinel"))
        .build()
        .expect("a Sentinel store");
    let limiter = Limiter::builder(store)
        .limit(
            Limit::new(
                "l",
                Quota::per_minute(1_000_000).allow_burst(1_000_000).gcra(),
            )
            .unwrap(),
        )
        .timeout(Duration::from_millis(100))
        .cache_denials(false)
        .build()
        .expect("limiter");
    decides(&limiter, "warm", Duration::from_secs(10)).await;
    // load from a few tasks, each call bounded by the limiter's timeout
    let stop = Arc::new(AtomicBool::new(false));
    let slowest = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..4)
        .map(|t| {
            let (limiter, stop, slowest, errors) = (
                limiter.clone(),
                stop.clone(),
                slowest.clone(),
                errors.clone(),
            );
            tokio::spawn(async move {
                let started = Instant::now();
                while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(60) {
                    let at = Instant::now();
                    if limiter.check(format!("k{t}"), 1).await.is_err() {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    slowest.fetch_max(at.elapsed().as_micros() as u64, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let old = sentinel.kill_master();
    let killed = Instant::now();
    let watching = sentinel.clone();
    let new = tokio::task::spawn_blocking(move || watching.wait_for_new_master(old))
        .await
        .expect("failover");
    let promoted = killed.elapsed();
    // decisions resume within 5 s of the sentinels naming the new master
    let resumed = decides(&limiter, "after", Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("load task");
    }
    let slowest = Duration::from_micros(slowest.load(Ordering::Relaxed));
    eprintln!(
        "master {old} killed; {new} promoted after {promoted:?}; decisions {resumed:?} later; \
         {} errors; slowest call {slowest:?}",
        errors.load(Ordering::Relaxed)
    );
    assert!(
        slowest < Duration::from_millis(1100),
        "a call hung: {slowest:?}"
    );
    // the new master holds the state written after the failover
    let mut conn = sentinel.connection(new);
    let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut conn).expect("ROLE");
    assert!(matches!(&role[0], redis::Value::BulkString(r) if r == b"master"));
}
