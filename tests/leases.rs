//! Concurrency limits (`Limit::concurrency`): leases held while work runs,
//! given back when it ends, renewed while held, and lost within the lease
//! time when their holder dies. On both stores, the Redis one as two
//! instances on one Redis, and on a Redis Cluster.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{unique_prefix, PATIENT};
use tower_ratelimit::{Error, Limit, Limiter, MemoryStore, Quota};

fn exports(max: u64, lease: Duration) -> Limit {
    Limit::concurrency("exports", max, lease).expect("valid limit")
}

use common::{limiter_of as limiter, two_instances as instances};

/// [`instances`], and (with the `cluster` feature) two instances on a Redis
/// Cluster of three primaries and three replicas.
fn everywhere(test: &str, limits: &[Limit]) -> Vec<(&'static str, Limiter, Limiter)> {
    #[allow(unused_mut)]
    let mut all = instances(test, limits);
    #[cfg(feature = "cluster")]
    {
        let prefix = unique_prefix(test);
        let store = || {
            tower_ratelimit::RedisStore::cluster_builder(common::cluster::shared().seed_urls())
                .prefix(&prefix)
                .build()
                .expect("a cluster store")
        };
        all.push((
            "cluster",
            limiter(store(), limits),
            limiter(store(), limits),
        ));
    }
    all
}

#[tokio::test]
async fn at_most_max_leases_are_held_and_each_comes_back_when_released_or_dropped() {
    let minute = Duration::from_secs(60);
    for (store, a, b) in everywhere("lease-table", &[exports(2, minute)]) {
        let first = a.acquire_lease("acme").await.expect("acquire");
        let second = b.acquire_lease("acme").await.expect("acquire");
        assert!(first.is_held() && second.is_held(), "{store}");
        assert_eq!(second.decision().remaining(), 0, "{store}");
        let third = a.acquire_lease("acme").await.expect("acquire");
        assert!(!third.is_held(), "{store}: a third while two run");
        let retry = third.decision().retry_after().expect("a denial says when");
        assert!(
            retry > Duration::ZERO && retry <= minute,
            "{store}: {retry:?}"
        );
        // another key has its own permits
        assert!(a.acquire_lease("other").await.expect("acquire").is_held());
        drop(third); // held nothing: gives nothing back
        assert!(
            !b.acquire_lease("acme").await.expect("acquire").is_held(),
            "{store}"
        );

        assert!(first.release().await.expect("release"), "{store}");
        let fourth = b.acquire_lease("acme").await.expect("acquire");
        assert!(fourth.is_held(), "{store}: released, a permit is free");
        drop(second);
        // a dropped lease goes back on a task: wait for it
        let fifth = common::wait_until_held(&a, "acme").await;
        assert!(fifth.is_held(), "{store}");
        assert!(
            !a.acquire_lease("acme").await.expect("acquire").is_held(),
            "{store}"
        );
    }
}

#[tokio::test]
async fn a_lease_is_decided_with_the_limiters_rate_limits_and_keeps_their_grants() {
    let running = exports(1, Duration::from_secs(60));
    let started = Limit::new("started", Quota::per_hour(3).fixed_window()).expect("limit");
    for (store, a, b) in instances("lease-rates", &[running.clone(), started.clone()]) {
        for i in 0..3 {
            let lease = a.acquire_lease("acme").await.expect("acquire");
            assert!(lease.is_held(), "{store}: export {i}");
            assert!(
                !b.acquire_lease("acme").await.expect("acquire").is_held(),
                "{store}"
            );
            assert!(lease.release().await.expect("release"), "{store}");
        }
        // three started this hour: the rate limit refuses, and no permit of
        // the concurrency limit was taken (all or nothing)
        let refused = b.acquire_lease("acme").await.expect("acquire");
        assert!(!refused.is_held(), "{store}");
        assert_eq!(refused.decision().statuses()[0].remaining(), 1, "{store}");
        assert_eq!(refused.decision().statuses()[1].remaining(), 0, "{store}");
    }
}

#[tokio::test]
async fn a_limiter_without_a_concurrency_limit_cannot_lease() {
    let rate = Limit::new("rate", Quota::per_hour(3).fixed_window()).expect("limit");
    let limiter = limiter(MemoryStore::new(), &[rate]);
    assert!(matches!(
        limiter.acquire_lease("k").await,
        Err(Error::Config(
            tower_ratelimit::ConfigError::NoConcurrencyLimit
        ))
    ));
}

/// 100 tasks on two instances run jobs under a limit of 5: never more than
/// 5 at once, 5 at once reached, and every permit back at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_exact_under_100_concurrent_tasks_across_two_instances() {
    let lease = Duration::from_secs(60);
    for (store, a, b) in everywhere("lease-load", &[exports(5, lease)]) {
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let jobs = Arc::new(AtomicUsize::new(0));
        let until = tokio::time::Instant::now() + Duration::from_millis(1500);
        let tasks: Vec<_> = (0..100)
            .map(|i| {
                let limiter = if i % 2 == 0 { a.clone() } else { b.clone() };
                let (running, most, jobs) = (running.clone(), most.clone(), jobs.clone());
                tokio::spawn(async move {
                    while tokio::time::Instant::now() < until {
                        let lease = limiter.acquire_lease("tenant").await.expect("acquire");
                        if !lease.is_held() {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            continue;
                        }
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(3)).await;
                        running.fetch_sub(1, Ordering::SeqCst);
                        jobs.fetch_add(1, Ordering::SeqCst);
                        assert!(lease.release().await.expect("release"));
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task");
        }
        assert_eq!(
            most.load(Ordering::SeqCst),
            5,
            "{store}: at most 5 at once, and 5 reached"
        );
        assert!(jobs.load(Ordering::SeqCst) >= 10, "{store}: work was done");
        // every permit is back: 5 can be held again, not 6
        let held: Vec<_> = futures::future::join_all((0..6).map(|_| a.acquire_lease("tenant")))
            .await
            .into_iter()
            .map(|l| l.expect("acquire"))
            .collect();
        assert_eq!(held.iter().filter(|l| l.is_held()).count(), 5, "{store}");
    }
}

/// A holder that renews outlives its lease time; a holder that dies (its
/// runtime gone: no release, no renewal) loses its permit within the lease
/// time, when the denial said it would.
#[tokio::test]
async fn a_held_lease_renews_itself_and_a_dead_holders_permit_comes_back_within_the_lease_time() {
    let lease = Duration::from_millis(600);
    for (store, a, b) in instances("lease-renew", &[exports(1, lease)]) {
        let held = a.acquire_lease("job").await.expect("acquire");
        for _ in 0..5 {
            tokio::time::sleep(lease / 2).await; // 1.5 lease times in all
            assert!(
                !b.acquire_lease("job").await.expect("acquire").is_held(),
                "{store}"
            );
        }
        assert!(
            held.is_held() && !held.is_lost(),
            "{store}: renewed while held"
        );
        drop(held);
        let _ = common::wait_until_held(&b, "job").await;

        // the holder dies: its runtime is shut down with the lease taken
        let dying = a.clone();
        // (on a thread of its own, while this runtime drives the store's
        // connections)
        tokio::task::spawn_blocking(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                let lease = dying.acquire_lease("crash").await.expect("acquire");
                assert!(lease.is_held());
                std::mem::forget(lease); // no release: the process is gone
            });
            runtime.shutdown_background();
        })
        .await
        .expect("the dying instance");
        let refused = b.acquire_lease("crash").await.expect("acquire");
        assert!(
            !refused.is_held(),
            "{store}: the dead holder's permit is still counted"
        );
        let retry = refused.decision().retry_after().expect("retry after");
        assert!(
            retry <= lease,
            "{store}: back within the lease time, {retry:?}"
        );
        tokio::time::sleep(retry).await;
        assert!(
            b.acquire_lease("crash").await.expect("acquire").is_held(),
            "{store}: the dead holder's permit came back when its lease ended"
        );
    }
}

/// A lease whose permit is gone from the store (a reset, an eviction) is
/// lost at its next renewal, and says so.
#[tokio::test]
async fn a_lease_whose_permit_is_gone_from_the_store_is_lost() {
    let lease = Duration::from_millis(300);
    for (store, a, _b) in instances("lease-lost", &[exports(1, lease)]) {
        let held = a.acquire_lease("job").await.expect("acquire");
        a.reset("job").await.expect("reset");
        tokio::time::timeout(PATIENT, held.lost())
            .await
            .unwrap_or_else(|_| panic!("{store}: the lease was not reported lost"));
        assert!(held.is_lost() && !held.is_held(), "{store}");
        // releasing a lost lease gives nothing back that another holds
        let other = a.acquire_lease("job").await.expect("acquire");
        assert!(other.is_held(), "{store}");
        drop(held);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !a.acquire_lease("job").await.expect("acquire").is_held(),
            "{store}"
        );
    }
}

/// A store that stops answering: renewals fail, and the lease is lost
/// once a lease time passed without one.
#[tokio::test]
async fn a_lease_that_cannot_be_renewed_for_a_lease_time_is_lost() {
    let mut server = common::TestRedis::spawn();
    let store = tower_ratelimit::RedisStore::builder(server.url.clone())
        .prefix(unique_prefix("lease-down"))
        .build()
        .expect("store");
    let limiter = Limiter::builder(store)
        .limit(exports(1, Duration::from_millis(400)))
        .timeout(Duration::from_millis(100))
        .build()
        .expect("limiter");
    let held = limiter.acquire_lease("job").await.expect("acquire");
    assert!(held.is_held());
    server.stop();
    tokio::time::timeout(PATIENT, held.lost())
        .await
        .expect("the lease was not reported lost while the store was down");
    assert!(held.is_lost());
}

/// A lease of a limit with a maximum hold is given back then, renewals or
/// not: it is lost (`lost()` resolves) and its permit is free again. A
/// limit without one keeps its lease past that time.
#[tokio::test]
async fn a_lease_is_given_back_at_its_maximum_hold() {
    let bounded = Limit::concurrency("bounded", 1, Duration::from_millis(300))
        .expect("limit")
        .hold_at_most(Duration::from_millis(500))
        .expect("a maximum hold");
    for (store, a, b) in instances("lease-max-hold", &[bounded]) {
        let lease = a.acquire_lease("acme").await.expect("acquire");
        assert!(lease.is_held(), "{store}");
        tokio::time::timeout(PATIENT, lease.lost())
            .await
            .expect("lost within the test's patience");
        assert!(lease.is_lost() && !lease.is_held(), "{store}");
        let next = common::wait_until_held(&b, "acme").await;
        assert!(next.is_held(), "{store}: the permit is free again");
    }
    let unbounded = exports(1, Duration::from_millis(300));
    for (store, a, b) in instances("lease-no-max-hold", &[unbounded]) {
        let lease = a.acquire_lease("acme").await.expect("acquire");
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(lease.is_held(), "{store}: renewed, never bounded");
        assert!(
            !b.acquire_lease("acme").await.expect("acquire").is_held(),
            "{store}"
        );
    }
}
