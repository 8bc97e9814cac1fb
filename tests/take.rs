//! Taking what is available (`Limiter::take_up_to`), on the memory store
//! and a real Redis driven by an explicit clock: min(available, N), at once,
//! in every limit of the limiter.

mod common;

use std::time::Duration;

use common::{patient_limiter, redis_store_with_clock, unique_prefix, T0};
use tower_ratelimit::{Limit, Limiter, ManualClock, MemoryStore, Quota, Store};

const MS: i64 = 1_000;

/// (time since T0 in us, most, expected granted, expected retry_after in us if denied)
type Row = (i64, u64, u64, Option<i64>);

async fn run(limit: &Limit, table: &[Row]) {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("take");
    let memory = patient_limiter(MemoryStore::with_clock(clock.clone()), limit.clone());
    let redis = patient_limiter(redis_store_with_clock(&prefix, &clock), limit.clone());
    for (store, limiter) in [("memory", &memory), ("redis", &redis)] {
        for (i, &(at, most, granted, retry)) in table.iter().enumerate() {
            clock.set(T0 + at);
            let grant = limiter.take_up_to("k", most).await.expect("take");
            let d = grant.decision();
            let ctx = format!("{} on {store}, row {i}: {d:?}", limit.name());
            assert_eq!(d.granted_amount(), granted, "granted, {ctx}");
            assert_eq!(d.is_allowed(), granted > 0 || most == 0, "{ctx}");
            assert_eq!(
                d.retry_after().map(|r| r.as_micros() as i64),
                retry,
                "retry_after, {ctx}"
            );
            assert_eq!(d.delay(), Duration::ZERO, "taken at once, {ctx}");
        }
    }
}

#[tokio::test]
async fn take_up_to_grants_what_a_sliding_log_has_left() {
    let limit = Limit::new("slog", Quota::per_minute(10).sliding_log()).unwrap();
    #[rustfmt::skip]
    run(&limit, &[
        (0,          4,   4, None),
        (1000 * MS,  100, 6, None),
        (2000 * MS,  100, 0, Some(58_000 * MS)),
        // the 4 taken at 0 s have left; the 6 of 1 s have not
        (60_000 * MS, 100, 4, None),
        (60_000 * MS, 0,  0, None),
    ]).await;
}

#[tokio::test]
async fn take_up_to_grants_what_a_bucket_has_left() {
    let tb = Limit::new(
        "tb",
        Quota::rate(1, Duration::from_millis(100))
            .allow_burst(10)
            .token_bucket(),
    )
    .unwrap();
    let gcra = Limit::new("gcra", Quota::per_second(10).allow_burst(10).gcra()).unwrap();
    for limit in [tb, gcra] {
        #[rustfmt::skip]
        run(&limit, &[
            (0,        7, 7, None),
            (0,        5, 3, None),
            (0,        5, 0, Some(100 * MS)),
            // 2.5 back by 250 ms
            (250 * MS, 5, 2, None),
            (250 * MS, 5, 0, Some(50 * MS)),
        ]).await;
    }
}

#[tokio::test]
async fn take_up_to_grants_what_a_window_has_left() {
    let fw = Limit::new("fw", Quota::per_second(5).fixed_window()).unwrap();
    #[rustfmt::skip]
    run(&fw, &[
        (200 * MS,  3, 3, None),
        (300 * MS,  3, 2, None),
        (400 * MS,  3, 0, Some(600 * MS)),
        (1000 * MS, 9, 5, None),
    ]).await;
    let sw = Limit::new("sw", Quota::per_second(10).sliding_window()).unwrap();
    #[rustfmt::skip]
    run(&sw, &[
        (0,         6,  6, None),
        (0,         10, 4, None),
        // 6 + 4 in the previous window, weight 0.75: 7.5 rounded up is 8
        (1250 * MS, 10, 2, None),
    ]).await;
}

fn two_limits(store: impl Into<Store>) -> Limiter {
    Limiter::builder(store)
        .limit(Limit::new("burst", Quota::per_second(10).allow_burst(5).gcra()).unwrap())
        .limit(Limit::new("minute", Quota::per_minute(8).sliding_log()).unwrap())
        .timeout(common::PATIENT)
        .cache_denials(false)
        .build()
        .unwrap()
}

#[tokio::test]
async fn take_up_to_takes_the_least_any_limit_has_and_can_give_it_back() {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("take-two");
    let memory = two_limits(MemoryStore::with_clock(clock.clone()));
    let redis = two_limits(redis_store_with_clock(&prefix, &clock));
    for (store, limiter) in [("memory", memory), ("redis", redis)] {
        clock.set(T0);
        assert_eq!(
            limiter.take_up_to("k", 10).await.unwrap().granted_amount(),
            5,
            "{store}"
        );
        // 500 ms later the burst has 5 again, the minute 3
        clock.set(T0 + 500 * MS);
        let grant = limiter.take_up_to("k", 10).await.unwrap();
        assert_eq!(grant.granted_amount(), 3, "{store}");
        assert!(grant.refund().await.unwrap(), "{store}");
        let look = limiter.peek("k", 0).await.unwrap();
        assert_eq!(look.statuses()[0].remaining(), 5, "{store}: {look:?}");
        assert_eq!(look.statuses()[1].remaining(), 3, "{store}: {look:?}");
    }
}
