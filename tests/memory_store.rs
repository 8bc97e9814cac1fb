//! The in-process store's own guarantees: a hard bound on stored keys at
//! which a flood of made-up keys takes the place of its own states (no
//! outage for new clients, an over-count bounded by what a state given up
//! had used), bans kept in a full store, and idle keys reclaimed in the
//! background without traffic, by a task that ends with the store.

use std::time::Duration;

/// 2027-01-15T08:00:00Z in microseconds (as in the other tests).
const T0: i64 = 1_800_000_000_000_000;
use tower_ratelimit::{
    ConfigError, Error, Limit, Limiter, ManualClock, MemoryStore, Penalty, Quota, Verdict,
};

fn two_per_minute() -> Limit {
    Limit::new("l", Quota::per_minute(2).fixed_window()).expect("valid limit")
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
        Quota::rate(2, minute).sliding_log(),
        Quota::rate(2, minute).allow_burst(2).token_bucket(),
        Quota::rate(2, minute).allow_burst(2).gcra(),
        Quota::rate(2, minute).fixed_window(),
        Quota::rate(2, minute).sliding_window(),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, quota)| Limit::new(format!("l{i}"), quota).expect("valid limit"))
    .collect()
}

/// A flood of made-up keys fills the store; from then on no key passes
/// more than its quota plus what a state given up for it had used, a key
/// that spent more than the flood's keys keeps its exact state, and memory
/// stays within the bound. Once the flood's grants have aged out (one
/// period of the limit), new keys get their whole quota, and no more.
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
        // (the stated bound: its quota left, 1, plus what its state given
        // up had used, 1)
        for i in (0..1_000).step_by(97) {
            let again = passes(format!("flood-{i}")).await;
            assert!(again <= 2, "{name}: flood-{i} passed {again} more");
        }
        // New keys while the store is full never pass more than their quota.
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

/// A stored key that spent more than the others is not given up to make
/// room, one given up passes at most what its state had used more, and
/// once stored states expire, new keys are stored again.
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
    // k0 spent 1 of 2: 1 more, or 2 if its state was given up (the bound:
    // plus what that state had used)
    let mut k0 = 0;
    for _ in 0..4 {
        k0 += u32::from(limiter.check("k0", 1).await.unwrap().is_allowed());
    }
    assert!((1..=2).contains(&k0), "k0 passed {k0} more");
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
    let limit = Limit::new("l", Quota::rate(5, Duration::from_secs(10)).sliding_log()).unwrap();
    let gcra = Limit::new("g", Quota::per_second(10).allow_burst(10).gcra()).unwrap();
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

/// Ten per minute in every algorithm, and a concurrency limit of 10.
fn ten_per_minute_in_each_algorithm() -> Vec<Limit> {
    let minute = Duration::from_secs(60);
    let mut limits: Vec<Limit> = [
        Quota::rate(10, minute).sliding_log(),
        Quota::rate(10, minute).allow_burst(10).token_bucket(),
        Quota::rate(10, minute).allow_burst(10).gcra(),
        Quota::rate(10, minute).fixed_window(),
        Quota::rate(10, minute).sliding_window(),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, quota)| Limit::new(format!("l{i}"), quota).expect("valid limit"))
    .collect();
    limits.push(Limit::concurrency("leases", 10, minute).expect("valid limit"));
    limits
}

/// How many of `n` checks of `key` pass.
async fn passes(limiter: &Limiter, key: &str, n: u32) -> u32 {
    let mut passed = 0;
    for _ in 0..n {
        passed += u32::from(limiter.check(key, 1).await.unwrap().is_allowed());
    }
    passed
}

/// A flood of made-up keys, ten times the bound, no longer refuses the new
/// clients that come during and after it (before, they all shared one
/// drained state per shard and were refused far under their quota): each
/// gets exactly its quota, in every algorithm and a concurrency limit; a
/// key that spent its quota before the flood stays refused; memory stays
/// within the bound.
#[tokio::test]
async fn after_a_flood_of_made_up_keys_new_clients_get_their_quota() {
    for limit in ten_per_minute_in_each_algorithm() {
        let name = limit.name().to_owned();
        let store = MemoryStore::builder()
            .clock(ManualClock::new(T0))
            .max_keys(1_000)
            .build()
            .expect("store");
        let limiter = Limiter::new(store.clone(), limit);
        assert_eq!(passes(&limiter, "spent", 12).await, 10, "{name}");
        // clients come while the flood runs, each sending half its quota
        for i in 0..10_000 {
            limiter.check(format!("flood-{i}"), 1).await.unwrap();
            if i % 500 == 0 {
                let key = format!("client-{i}");
                assert_eq!(passes(&limiter, &key, 5).await, 5, "{name}: {key}");
            }
        }
        assert!(store.len() <= 1_000, "{name}: {} states", store.len());
        for i in (0..10_000).step_by(500) {
            let key = format!("client-{i}");
            assert_eq!(
                passes(&limiter, &key, 8).await,
                5,
                "{name}: {key}, the rest"
            );
        }
        for i in 0..20 {
            let key = format!("late-{i}");
            assert_eq!(passes(&limiter, &key, 12).await, 10, "{name}: {key}");
        }
        assert_eq!(passes(&limiter, "spent", 3).await, 0, "{name}: spent");
        assert!(store.len() <= 1_000, "{name}: {} states", store.len());
    }
}

/// The stated bound when the flood spends its whole quota, so that no state
/// is closer to fresh than a spent one: a key whose state was given up
/// passes at most its quota more (what that state had used), never more;
/// new clients still get their quota.
#[tokio::test]
async fn the_over_count_is_at_most_what_the_state_given_up_had_used() {
    for limit in ten_per_minute_in_each_algorithm() {
        let name = limit.name().to_owned();
        let store = MemoryStore::builder()
            .clock(ManualClock::new(T0))
            .max_keys(200)
            .build()
            .expect("store");
        let limiter = Limiter::new(store.clone(), limit);
        assert_eq!(passes(&limiter, "victim", 10).await, 10, "{name}");
        for i in 0..2_000 {
            let key = format!("flood-{i}");
            assert_eq!(passes(&limiter, &key, 10).await, 10, "{name}: {key}");
        }
        assert!(store.len() <= 200, "{name}: {} states", store.len());
        let again = passes(&limiter, "victim", 30).await;
        assert!(again <= 10, "{name}: the victim passed {again} more");
        for i in (0..2_000).step_by(101) {
            let key = format!("flood-{i}");
            let again = passes(&limiter, &key, 30).await;
            assert!(again <= 10, "{name}: {key} passed {again} more");
        }
        for i in 0..10 {
            let key = format!("new-{i}");
            assert_eq!(passes(&limiter, &key, 12).await, 10, "{name}: {key}");
        }
    }
}

fn penalized() -> Limit {
    let minute = Duration::from_secs(60);
    Limit::new("p", Quota::rate(10, minute).allow_burst(10).gcra())
        .expect("valid limit")
        .with_penalty(Penalty::new(100, minute, [minute]).expect("valid penalty"))
}

/// A block made when the store is full takes the place of a rate state, and
/// lasts through a flood of made-up keys ten times the bound (before, it
/// was dropped and `block` still returned `Ok`).
#[tokio::test]
async fn a_ban_survives_a_full_store() {
    let store = MemoryStore::builder()
        .clock(ManualClock::new(T0))
        .max_keys(100)
        .build()
        .expect("store");
    let limiter = Limiter::new(store.clone(), penalized());
    for i in 0..100 {
        assert!(limiter
            .check(format!("k{i}"), 1)
            .await
            .unwrap()
            .is_allowed());
    }
    assert_eq!(store.len(), 100);
    let hour = Duration::from_secs(3600);
    limiter.admin().block("p", "banned", hour).await.unwrap();
    assert_eq!(store.len(), 100, "the bound holds");
    for i in 0..1_000 {
        limiter.check(format!("flood-{i}"), 1).await.unwrap();
    }
    assert!(!limiter.check("banned", 1).await.unwrap().is_allowed());
    let seen = limiter.admin().inspect("p", "banned").await.unwrap();
    assert!(seen.blocked_for.is_some(), "{seen:?}");
    assert!(store.len() <= 100);
}

/// Penalty states take at most half the bound, bans kept as records 4 to
/// a state: with a bound of 6, 3 states hold 12 bans; a block beyond is an
/// error, `Error::PenaltyNotStored` (before: `Ok`, the ban dropped), the
/// bans kept stay, and new clients still have room for their quota.
/// (Issue 53: before records, 3 bans.)
#[tokio::test]
async fn a_block_beyond_half_the_bound_is_an_error() {
    let store = MemoryStore::builder()
        .clock(ManualClock::new(T0))
        .max_keys(6)
        .build()
        .expect("store");
    let limiter = Limiter::new(store.clone(), penalized());
    let hour = Duration::from_secs(3600);
    for i in 0..12 {
        limiter
            .admin()
            .block("p", format!("b{i}"), hour)
            .await
            .unwrap();
    }
    let refused = limiter.admin().block("p", "b12", hour).await;
    assert!(
        matches!(refused, Err(Error::PenaltyNotStored)),
        "{refused:?}"
    );
    for i in 0..20 {
        let key = format!("new-{i}");
        assert_eq!(passes(&limiter, &key, 12).await, 10, "{key}");
    }
    for i in 0..12 {
        let key = format!("b{i}");
        assert!(!limiter.check(&key, 1).await.unwrap().is_allowed(), "{key}");
        let seen = limiter.admin().inspect("p", &key).await.unwrap();
        assert!(seen.blocked_for.is_some(), "{key}: {seen:?}");
    }
    assert_eq!(store.len(), 6);
}

/// A flood of made-up keys that each get refused, and so each leave a
/// penalty state, cannot fill the store with penalty states: new clients
/// still get their quota. When each is a count of refusals, in the flooded
/// limit too (the counts are given up first). When each is a block (at
/// the first refusal), in the flooded limit too but for the keys that
/// share a bucket of the key hash with a ban not kept on its own (1/8192
/// at most: here at most 1 of 20; before issue 53, the limit failed closed
/// per shard once active blocks took half the bound), and in another
/// limit.
#[tokio::test]
async fn a_flood_of_penalty_states_refuses_no_new_client() {
    let minute = Duration::from_secs(60);
    for refusals in [2, 1] {
        let store = MemoryStore::builder()
            .clock(ManualClock::new(T0))
            .max_keys(200)
            .build()
            .expect("store");
        let limit = Limit::new("p", Quota::rate(10, minute).allow_burst(10).gcra())
            .expect("valid limit")
            .with_penalty(Penalty::new(refusals, minute, [minute]).expect("valid penalty"));
        let limiter = Limiter::new(store.clone(), limit);
        let other = Limiter::new(
            store.clone(),
            Limit::new("q", Quota::rate(10, minute).allow_burst(10).gcra()).expect("valid limit"),
        );
        for i in 0..2_000 {
            let key = format!("flood-{i}");
            let passed = passes(&limiter, &key, 11).await;
            assert!(passed <= 10, "{key}: {passed}");
            if refusals == 2 || i < 100 {
                assert_eq!(passed, 10, "{key}");
            }
        }
        assert!(store.len() <= 200, "{} states", store.len());
        let mut refused = 0;
        for i in 0..20 {
            let key = format!("new-{i}");
            let passed = passes(&limiter, &key, 10).await;
            if refusals == 2 {
                assert_eq!(passed, 10, "{key}");
            }
            refused += u32::from(passed < 10);
            assert_eq!(passes(&other, &key, 10).await, 10, "{key}: another limit");
        }
        assert!(refused <= 1, "{refused} of 20 new clients refused");
    }
}

/// A penalty state the store does not keep is counted.
#[cfg(feature = "metrics")]
#[test]
fn a_penalty_state_not_stored_is_counted() {
    use metrics_exporter_prometheus::PrometheusBuilder;
    use tower_ratelimit::metrics::PENALTIES_NOT_STORED;

    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let store = MemoryStore::builder()
        .clock(ManualClock::new(T0))
        .max_keys(2)
        .build()
        .expect("store");
    let limiter = Limiter::new(store, penalized());
    let hour = Duration::from_secs(3600);
    metrics::with_local_recorder(&recorder, || {
        futures::executor::block_on(async {
            // one state: one full, then 4 bans as records
            for i in 0..4 {
                limiter
                    .admin()
                    .block("p", format!("b{i}"), hour)
                    .await
                    .unwrap();
            }
            assert!(limiter.admin().block("p", "b4", hour).await.is_err());
        })
    });
    let text = handle.render();
    let line = text
        .lines()
        .find(|l| l.starts_with(PENALTIES_NOT_STORED))
        .unwrap_or_else(|| panic!("no {PENALTIES_NOT_STORED} in {text}"));
    assert!(line.contains("limit=\"p\""), "{line}");
    assert!(line.ends_with(" 1"), "{line}");
}

/// A flood through a limiter of two limits fills the store; new clients get
/// their quota in both, and in another limit of the same store that the
/// flood never used (a login route while the API is flooded): its new keys
/// take the place of the flood's states.
#[tokio::test]
async fn a_flood_on_one_route_refuses_no_new_client_of_another() {
    let minute = Duration::from_secs(60);
    let store = MemoryStore::builder()
        .clock(ManualClock::new(T0))
        .max_keys(1_000)
        .build()
        .expect("store");
    let api = Limiter::builder(store.clone())
        .limit(Limit::new("burst", Quota::rate(10, minute).allow_burst(10).gcra()).expect("limit"))
        .limit(Limit::new("minute", Quota::rate(10, minute).sliding_window()).expect("limit"))
        .build()
        .expect("limiter");
    let login = Limiter::new(
        store.clone(),
        Limit::new("login", Quota::rate(5, minute).fixed_window()).expect("limit"),
    );
    for i in 0..10_000 {
        api.check(format!("flood-{i}"), 1).await.unwrap();
        if i % 500 == 0 {
            let key = format!("user-{i}");
            assert_eq!(passes(&login, &key, 2).await, 2, "{key}");
            assert_eq!(passes(&api, &key, 5).await, 5, "{key}");
        }
    }
    assert!(store.len() <= 1_000, "{} states", store.len());
    for i in (0..10_000).step_by(500) {
        let key = format!("user-{i}");
        assert_eq!(passes(&login, &key, 5).await, 3, "{key}: login, the rest");
        assert_eq!(passes(&api, &key, 8).await, 5, "{key}: api, the rest");
    }
}

/// Threads that flood a full store at once, through a limiter of two
/// limits (one with a penalty that blocks at the first refusal) and through
/// blocks by hand, all giving up states across shards: each finishes, the
/// bound holds, and new clients get their quota after.
#[test]
fn concurrent_floods_at_the_bound_keep_it() {
    let minute = Duration::from_secs(60);
    let store = MemoryStore::builder()
        .clock(ManualClock::new(T0))
        .max_keys(64)
        .build()
        .expect("store");
    let penalized = Limit::new("p", Quota::rate(2, minute).allow_burst(2).gcra())
        .expect("valid limit")
        .with_penalty(Penalty::new(1, minute, [minute]).expect("valid penalty"));
    let limiter = Limiter::builder(store.clone())
        .limit(penalized)
        .limit(Limit::new("w", Quota::rate(5, minute).fixed_window()).expect("limit"))
        .build()
        .expect("limiter");
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let limiter = limiter.clone();
            std::thread::spawn(move || {
                futures::executor::block_on(async {
                    for i in 0..2_000 {
                        let key = format!("t{t}-{i}");
                        if t == 3 {
                            // blocks beyond half the bound are errors
                            let _ = limiter.admin().block("p", &key, minute).await;
                        } else {
                            for _ in 0..3 {
                                limiter.check(&key, 1).await.unwrap();
                            }
                        }
                    }
                })
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("a flood thread");
    }
    assert!(store.len() <= 64, "{} states", store.len());
    // and new clients still get their quota in the limit without a
    // penalty (in the one with a penalty, full of active blocks, a client
    // may be refused by a block its bucket shares: no more than its quota)
    let w = Limiter::new(
        store.clone(),
        Limit::new("w", Quota::rate(5, minute).fixed_window()).expect("limit"),
    );
    futures::executor::block_on(async {
        for i in 0..10 {
            let key = format!("new-{i}");
            assert!(passes(&limiter, &key, 3).await <= 2, "{key}");
            assert_eq!(passes(&w, &format!("w-{i}"), 6).await, 5, "{key}");
        }
    });
}

/// How many of `n` checks of `key`, one every `step`, pass.
async fn passes_over(
    limiter: &Limiter,
    clock: &ManualClock,
    key: &str,
    n: u32,
    step: Duration,
) -> u32 {
    let mut passed = 0;
    for _ in 0..n {
        passed += u32::from(limiter.check(key, 1).await.unwrap().is_allowed());
        clock.advance(step);
    }
    passed
}

/// Issue 47, item 1: a flood of made-up usernames on a login limit (each
/// one attempt, a fifth of its quota) takes no state of a tenant's monthly
/// quota, spent a tenth at a time between the flood's cycles (before, each
/// cycle forgot the tenant's state, below a fifth of its quota: 1,500 of
/// 1,000 granted within one second).
#[tokio::test]
async fn a_flood_on_one_limit_resets_no_state_of_another() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(1_000)
        .build()
        .expect("store");
    let tenant = Limiter::new(
        store.clone(),
        Limit::new("tenant", Quota::per_month(1_000).fixed_window()).expect("limit"),
    );
    let login = Limiter::new(
        store.clone(),
        Limit::new(
            "login",
            Quota::rate(5, Duration::from_secs(15 * 60)).fixed_window(),
        )
        .expect("limit"),
    );
    let mut granted = 0;
    for cycle in 0..15 {
        granted += u32::from(tenant.check("acme", 100).await.unwrap().is_allowed());
        for i in 0..3_000 {
            login.check(format!("user-{cycle}-{i}"), 1).await.unwrap();
        }
        clock.advance(Duration::from_millis(50));
    }
    assert_eq!(
        granted * 100,
        1_000,
        "the tenant was granted {}",
        granted * 100
    );
    assert!(store.len() <= 1_000, "{} states", store.len());
    // and the flood's new keys were still stored: the login limit works
    assert_eq!(passes(&login, "real-user", 6).await, 5);
}

/// Issue 47, item 1: a live limit lowered from 1,000 to 10 an hour
/// measures its keys against the quota now in force: a key that spent the
/// 10 keeps its state through a flood on another limit and one on the same
/// limit (before, measured against the table's first 1,000, it was 1% used
/// and given up first: 10 more granted).
#[tokio::test]
async fn a_lowered_live_limit_keeps_its_spent_keys() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(1_000)
        .build()
        .expect("store");
    let hour = Duration::from_secs(3_600);
    let live = tower_ratelimit::LiveLimit::new(
        Limit::new("api", Quota::rate(1_000, hour).fixed_window()).expect("limit"),
    );
    let api = Limiter::new(store.clone(), live.clone());
    let login = Limiter::new(
        store.clone(),
        Limit::new(
            "login",
            Quota::rate(5, 15 * 60 * Duration::from_secs(1)).fixed_window(),
        )
        .expect("limit"),
    );
    // the api's tables are made while it allows 1,000
    for i in 0..200 {
        assert!(api
            .check(format!("early-{i}"), 1)
            .await
            .unwrap()
            .is_allowed());
    }
    live.set(Limit::new("api", Quota::rate(10, hour).fixed_window()).expect("limit"))
        .expect("same name");
    assert_eq!(passes(&api, "victim", 12).await, 10);
    for i in 0..3_000 {
        login.check(format!("user-{i}"), 1).await.unwrap();
    }
    assert_eq!(passes(&api, "victim", 10).await, 0, "after a login flood");
    for i in 0..3_000 {
        api.check(format!("flood-{i}"), 1).await.unwrap();
    }
    assert_eq!(passes(&api, "victim", 10).await, 0, "after an api flood");
    assert!(store.len() <= 1_000, "{} states", store.len());
}

/// Issue 47, item 1: the tiers of a limit share its name and table; each
/// key's state is measured against its own tier's quota. A free key that
/// spent its 10 is not given up for pro keys that spent 20 of 1,000 (before,
/// measured against the pro quota that made the table, it was 1% used).
#[tokio::test]
async fn tiers_sharing_a_name_are_measured_against_their_own_quota() {
    let minute = Duration::from_secs(60);
    for (free_quota, pro_quota) in [
        (
            Quota::rate(10, minute).fixed_window(),
            Quota::rate(1_000, minute).fixed_window(),
        ),
        (
            Quota::rate(10, minute).allow_burst(10).gcra(),
            Quota::rate(1_000, minute).allow_burst(1_000).gcra(),
        ),
    ] {
        let store = MemoryStore::builder()
            .clock(ManualClock::new(T0))
            .max_keys(200)
            .build()
            .expect("store");
        let pro = Limiter::new(store.clone(), Limit::new("api", pro_quota).expect("limit"));
        let free = Limiter::new(store.clone(), Limit::new("api", free_quota).expect("limit"));
        for i in 0..300 {
            assert!(pro
                .check(format!("pro-{i}"), 20)
                .await
                .unwrap()
                .is_allowed());
        }
        assert_eq!(passes(&free, "free-user", 12).await, 10, "{free_quota:?}");
        for i in 0..2_000 {
            pro.check(format!("flood-{i}"), 20).await.unwrap();
        }
        assert_eq!(passes(&free, "free-user", 10).await, 0, "{free_quota:?}");
        assert!(store.len() <= 200, "{} states", store.len());
    }
}

/// A login limit whose offenders are banned: 5 a minute, 5 refusals within
/// an hour block for an hour; `name` for a limit of its own.
fn login_with_ban(name: &str, refusals: u32) -> Limit {
    let (minute, hour) = (Duration::from_secs(60), Duration::from_secs(3_600));
    Limit::new(name, Quota::rate(5, minute).fixed_window())
        .expect("valid limit")
        .with_penalty(Penalty::new(refusals, hour, [hour]).expect("valid penalty"))
}

/// What a victim that tries 120 times, once every 10 s, is granted through
/// `limiter`.
async fn victim_granted(limiter: &Limiter, clock: &ManualClock) -> u32 {
    passes_over(limiter, clock, "victim", 120, Duration::from_secs(10)).await
}

/// Issue 47, item 2: made-up offenders (each refused once: a count of one
/// refusal kept) fill the penalty states' half of the store, 500 of them
/// and 5,000; a victim that keeps trying is still banned, granted what it
/// is in an empty store (before, its refusals were not counted once the
/// half was full: 100 of 120 granted, against 25).
#[tokio::test]
async fn a_ban_holds_after_a_flood_of_offenders() {
    let fresh_clock = ManualClock::new(T0);
    let fresh = MemoryStore::builder()
        .clock(fresh_clock.clone())
        .max_keys(1_000)
        .build()
        .expect("store");
    let expected = victim_granted(
        &Limiter::new(fresh, login_with_ban("login", 5)),
        &fresh_clock,
    )
    .await;
    assert_eq!(expected, 25, "5 a minute, banned at the 5th refusal");
    for offenders in [500, 5_000] {
        let clock = ManualClock::new(T0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(1_000)
            .build()
            .expect("store");
        let limiter = Limiter::new(store.clone(), login_with_ban("login", 5));
        for i in 0..offenders {
            assert_eq!(passes(&limiter, &format!("made-up-{i}"), 6).await, 5);
        }
        let granted = victim_granted(&limiter, &clock).await;
        assert_eq!(granted, expected, "after {offenders} offenders");
        assert!(store.len() <= 1_000, "{} states", store.len());
        // and a new client still gets its quota
        assert_eq!(passes(&limiter, "new-client", 6).await, 5);
    }
}

/// Issue 47, item 2, and issue 53, item 3: offenders that are each banned
/// at once fill the penalty half with active blocks, then the ban records
/// (4 to a state: about 2,000 bans with a bound of 1,000), then their
/// buckets' states (8 per shard). No ban stored is dropped: every offender
/// told "blocked" stays blocked. With 500 offenders, the victim is banned
/// as in an empty store. With 5,000, the bans beyond are not stored: the
/// victim, once they are, is held to the limit's quota alone (before: the
/// limit failed closed per shard, refusing every new client of the shard).
/// Another limit's victim is banned as in an empty store, and its new
/// clients get their quota.
#[tokio::test]
async fn bans_hold_when_the_penalty_half_is_full_of_active_blocks() {
    let fresh_clock = ManualClock::new(T0);
    let fresh = MemoryStore::builder()
        .clock(fresh_clock.clone())
        .max_keys(1_000)
        .build()
        .expect("store");
    let expected = victim_granted(
        &Limiter::new(fresh, login_with_ban("other", 5)),
        &fresh_clock,
    )
    .await;
    for offenders in [500, 5_000] {
        let clock = ManualClock::new(T0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(1_000)
            .build()
            .expect("store");
        let flooded = Limiter::new(store.clone(), login_with_ban("login", 1));
        let other = Limiter::new(store.clone(), login_with_ban("other", 5));
        let banned = ban_flood(&flooded, "login", offenders).await;
        if offenders == 500 {
            assert_eq!(banned.len(), 500);
        } else {
            // 4 records a state in the half (500 states), less the rest
            // of a state, and the buckets' blocks
            assert!(banned.len() >= 1_990, "{} banned", banned.len());
        }
        // the victim: banned at its first refusal when its ban is stored
        let granted = passes_over(&flooded, &clock, "victim", 120, Duration::from_secs(10)).await;
        eprintln!(
            "{offenders} offenders: {} bans stored, the victim granted {granted}",
            banned.len()
        );
        if offenders == 500 {
            assert!(granted <= 5, "after {offenders} offenders: {granted}");
        } else {
            assert!(granted <= 5 * 20, "after {offenders} offenders: {granted}");
        }
        // 20 minutes later: no ban stored was dropped
        for key in &banned {
            let seen = flooded.admin().inspect("login", key).await.unwrap();
            assert!(seen.blocked_for.is_some(), "{key}: {seen:?}");
        }
        // the other limit: banned as in an empty store, new clients served
        assert_eq!(
            victim_granted(&other, &clock).await,
            expected,
            "{offenders}"
        );
        for i in 0..10 {
            assert_eq!(
                passes(&other, &format!("new-{i}"), 6).await,
                5,
                "{offenders}"
            );
        }
        assert!(store.len() <= 1_000, "{} states", store.len());
    }
}

/// `offenders` made-up keys of `limit` (through `limiter`, banned at the
/// first refusal) each try 6 times; the keys whose ban was stored (told
/// "blocked" right after), none granted more than the quota of 5.
async fn ban_flood(limiter: &Limiter, limit: &str, offenders: usize) -> Vec<String> {
    let mut banned = Vec::new();
    for i in 0..offenders {
        let key = format!("made-up-{i}");
        assert!(passes(limiter, &key, 6).await <= 5, "{key}");
        let seen = limiter.admin().inspect(limit, &key).await.unwrap();
        if seen.blocked_for.is_some() {
            banned.push(key);
        }
    }
    banned
}

/// Issue 53, item 3: 5,000 offenders banned at once on a store of 1,000
/// keys (the attack: before, 256 offenders beyond the penalty half
/// refused 320 of 320 new clients). Bans stored: about 2,000 as records,
/// and up to 256 bans on buckets of the key hash; beyond, not stored. Of
/// 8,192 new clients and 200 that came before the flood, at most 1/8192
/// share a bucket with a ban (0.5 of the new ones on average; asserted at
/// most 6); every ban stored holds until it ends, then the store forgets
/// it (the bound's room back).
#[tokio::test]
async fn a_flood_of_banned_keys_refuses_almost_no_other_client() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(1_000)
        .build()
        .expect("store");
    let limiter = Limiter::new(store.clone(), login_with_ban("login", 1));
    for i in 0..200 {
        assert!(limiter
            .check(format!("before-{i}"), 1)
            .await
            .unwrap()
            .is_allowed());
    }
    let banned = ban_flood(&limiter, "login", 5_000).await;
    assert!(
        (1_990..=2_256 + 10).contains(&banned.len()),
        "{} banned",
        banned.len()
    );
    let mut refused = 0;
    for i in 0..200 {
        refused += u32::from(
            !limiter
                .check(format!("before-{i}"), 1)
                .await
                .unwrap()
                .is_allowed(),
        );
    }
    for i in 0..8_192 {
        refused += u32::from(
            !limiter
                .check(format!("new-{i}"), 1)
                .await
                .unwrap()
                .is_allowed(),
        );
    }
    eprintln!(
        "{} bans stored; {refused} of 8,392 other clients refused",
        banned.len()
    );
    assert!(refused <= 6, "{refused} of 8,392 other clients refused");
    clock.advance(Duration::from_secs(3_599));
    for key in &banned {
        assert!(!limiter.check(key, 1).await.unwrap().is_allowed(), "{key}");
    }
    assert!(store.len() <= 1_000, "{} states", store.len());
    // an hour after: every ban ended
    clock.advance(Duration::from_secs(3_600 + 2));
    for key in banned.iter().take(100) {
        assert!(limiter.check(key, 1).await.unwrap().is_allowed(), "{key}");
    }
}

/// Issue 53, item 3: in a store of 2 keys, one penalty state holds 4 bans
/// as records; an offender beyond is banned on its bucket of the key hash
/// (told "blocked", refused), and an unblock by hand lifts that block.
#[tokio::test]
async fn an_unblock_lifts_a_ban_kept_on_a_bucket() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(2)
        .build()
        .expect("store");
    let limiter = Limiter::new(store.clone(), login_with_ban("login", 1));
    let hour = Duration::from_secs(3_600);
    for i in 0..4 {
        let key = format!("b{i}");
        limiter.admin().block("login", &key, hour).await.unwrap();
    }
    assert!(matches!(
        limiter.admin().block("login", "b4", hour).await,
        Err(Error::PenaltyNotStored)
    ));
    assert_eq!(passes(&limiter, "offender", 6).await, 5);
    let seen = limiter.admin().inspect("login", "offender").await.unwrap();
    assert!(seen.blocked_for.is_some(), "{seen:?}");
    clock.advance(Duration::from_secs(60));
    assert!(!limiter.check("offender", 1).await.unwrap().is_allowed());
    assert!(limiter.admin().unblock("login", "offender").await.unwrap());
    let seen = limiter.admin().inspect("login", "offender").await.unwrap();
    assert_eq!(seen.blocked_for, None, "{seen:?}");
    assert!(limiter.check("offender", 1).await.unwrap().is_allowed());
    for i in 0..4 {
        let key = format!("b{i}");
        assert!(!limiter.check(&key, 1).await.unwrap().is_allowed(), "{key}");
    }
    assert!(store.len() <= 2, "{} states", store.len());
}

/// 1 a minute; the first refusal bans for an hour.
fn banned_at_first_refusal(name: &str) -> Limit {
    let (minute, hour) = (Duration::from_secs(60), Duration::from_secs(3_600));
    Limit::new(name, Quota::rate(1, minute).fixed_window())
        .expect("valid limit")
        .with_penalty(Penalty::new(1, hour, [hour]).expect("valid penalty"))
}

/// Issue 53, item 3 (found by the model-based test): a store of 4 keys is
/// filled by an offender of limit `a` and one of `b` (their rate states and
/// bans); limit `c`, which holds no rate state, decides its new keys on its
/// tables' shared overflow states (see `MemoryStoreBuilder::max_keys`),
/// which hold the first grant of each shard: the keys after are refused
/// there, and that is no offence of theirs (before, each was banned for an
/// hour at once: 7 of 17 keys in the case found). Nor when `c` decides with
/// `a` in one call. A key refused by its own state in the full store is
/// still banned, and the offenders' bans hold.
#[tokio::test]
async fn fresh_keys_refused_on_the_shared_overflow_state_are_not_banned() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(4)
        .build()
        .expect("store");
    let [a, b, c] =
        ["a", "b", "c"].map(|n| Limiter::new(store.clone(), banned_at_first_refusal(n)));
    let banned = |limiter: &Limiter, limit: &'static str, key: String| {
        let limiter = limiter.clone();
        async move {
            let seen = limiter.admin().inspect(limit, &key).await.unwrap();
            (seen.blocked_for.is_some(), seen.offences, seen.refusals)
        }
    };
    assert_eq!(passes(&a, "x", 2).await, 1);
    assert_eq!(passes(&b, "y", 2).await, 1);
    assert_eq!(store.len(), 4, "full: two rate states, two bans");

    let mut refused = Vec::new();
    for i in 0..100 {
        let key = format!("fresh-{i}");
        let d = c.check(&key, 1).await.unwrap();
        assert!(!d.statuses()[0].is_blocked(), "{key}: {d:?}");
        if !d.is_allowed() {
            refused.push(key.clone());
        }
        assert_eq!(banned(&c, "c", key.clone()).await, (false, 0, 0), "{key}");
    }
    // at most one grant per shard (32) in its overflow state, the rest
    // refused on it
    assert!(refused.len() >= 100 - 32, "{} refused", refused.len());

    // with `a` in one call: `a` allows on the key's own (fresh) state, `c`
    // refuses on the shared one
    let both = Limiter::builder(store.clone())
        .limit(banned_at_first_refusal("a"))
        .limit(banned_at_first_refusal("c"))
        .build()
        .expect("limiter");
    for key in refused.iter().take(10) {
        let d = both.check(key, 1).await.unwrap();
        assert!(!d.is_allowed(), "{key}: {d:?}");
        assert!(d.statuses().iter().all(|s| !s.is_blocked()), "{key}: {d:?}");
        for limit in ["a", "c"] {
            assert_eq!(
                banned(&both, limit, key.clone()).await,
                (false, 0, 0),
                "{limit} {key}"
            );
        }
    }

    // a key refused by its own state (room made among `a`'s): banned
    assert_eq!(passes(&a, "x2", 2).await, 1);
    for (limiter, limit, key) in [(&a, "a", "x2"), (&a, "a", "x"), (&b, "b", "y")] {
        let (blocked, offences, _) = banned(limiter, limit, key.to_owned()).await;
        assert!(blocked && offences == 1, "{limit} {key}");
    }
    assert!(store.len() <= 4, "{} states", store.len());
}
