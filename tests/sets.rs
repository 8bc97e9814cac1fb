//! Sets (`Limiter::decide_set`): several limits, each with its own key and
//! cost, decided in one store call in each `SetMode`, run unchanged on the
//! memory store, a real Redis and (with the `cluster` feature) a Redis
//! Cluster, on one explicit clock. Every expected figure is worked out by
//! hand in the comments.

mod common;

use std::time::Duration;

use common::{unique_prefix, T0};
use tower_ratelimit::{Decision, Limit, ManualClock, Quota, SetItem, SetMode, Verdict};

const S: i64 = 1_000_000;

/// (allowed, per item: (over, remaining))
fn seen(d: &Decision) -> (bool, Vec<(bool, u64)>) {
    let items = d
        .statuses()
        .iter()
        .map(|s| (s.is_violated(), s.remaining()))
        .collect();
    (d.is_allowed(), items)
}

fn fixed(name: &str, per_minute: u64) -> Limit {
    Limit::new(name, Quota::per_minute(per_minute).fixed_window()).expect("a limit")
}

/// Each item counted always: past its limit too, whatever the others say
/// (envoyproxy/ratelimit's counting). A: 3/min, B: 10/min.
#[tokio::test]
async fn each_counted_counts_past_the_limit_and_each_on_its_own() {
    let (a, b) = (fixed("a", 3), fixed("b", 10));
    let clock = ManualClock::new(T0);
    for (store, limiter) in common::limiters_on_clock(&unique_prefix("sets"), &a, &clock) {
        clock.set(T0 + 10 * S);
        let set = [SetItem::new(&a, b"k", 1), SetItem::new(&b, b"k", 1)];
        let mut seen_all = Vec::new();
        for _ in 0..5 {
            let d = limiter
                .decide_set(&set, SetMode::EachCounted)
                .await
                .expect("set");
            seen_all.push(seen(&d));
        }
        // A: 1, 2, 3 within; 4 and 5 over (counted: 4 > 3, 5 > 3);
        // B counted every time: 9, 8, 7, 6, 5 left
        let expected = vec![
            (true, vec![(false, 2), (false, 9)]),
            (true, vec![(false, 1), (false, 8)]),
            (true, vec![(false, 0), (false, 7)]),
            (false, vec![(true, 0), (false, 6)]),
            (false, vec![(true, 0), (false, 5)]),
        ];
        assert_eq!(seen_all, expected, "{store}");
        // A's count is 5: a check of 0 is over (5 > 3), and a refund of 2
        // leaves 3, which a check of 0 finds within (3 <= 3), nothing left
        let check = [SetItem::new(&a, b"k", 0)];
        let d = limiter
            .decide_set(&check, SetMode::EachCounted)
            .await
            .expect("check");
        assert_eq!(seen(&d), (false, vec![(true, 0)]), "{store}: check of 0");
        let refund = [SetItem::refund(&a, b"k", 2)];
        let d = limiter
            .decide_set(&refund, SetMode::EachCounted)
            .await
            .expect("refund");
        assert_eq!(seen(&d), (true, vec![(false, 0)]), "{store}: refund");
        // one more refund of 1: 2 counted, 1 left
        let refund = [SetItem::refund(&a, b"k", 1)];
        let d = limiter
            .decide_set(&refund, SetMode::EachCounted)
            .await
            .expect("refund");
        assert_eq!(seen(&d), (true, vec![(false, 1)]), "{store}: second refund");
        // the denial's wait and each reset: the window ends at T0 + 60 s,
        // 50 s from now
        let d = limiter
            .decide_set(&set, SetMode::EachCounted)
            .await
            .expect("set");
        assert!(d.is_allowed(), "{store}: 3 of 3");
        let d = limiter
            .decide_set(&set, SetMode::EachCounted)
            .await
            .expect("set");
        assert_eq!(
            d.verdict(),
            Verdict::Denied {
                retry_after: Duration::from_secs(50)
            },
            "{store}"
        );
        for status in d.statuses() {
            assert_eq!(status.reset_after(), Duration::from_secs(50), "{store}");
        }
        // the next window starts afresh
        clock.set(T0 + 60 * S);
        let d = limiter
            .decide_set(&set, SetMode::EachCounted)
            .await
            .expect("set");
        assert_eq!(
            seen(&d),
            (true, vec![(false, 2), (false, 9)]),
            "{store}: next window"
        );
    }
}

/// Sparing: while every item fits, all are counted; when one is over, only
/// the items over are counted (envoyproxy/ratelimit with
/// STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT). A: 2/min, B: 10/min.
#[tokio::test]
async fn each_sparing_counts_only_the_items_over_when_one_is() {
    let (a, b) = (fixed("a", 2), fixed("b", 10));
    let clock = ManualClock::new(T0);
    for (store, limiter) in common::limiters_on_clock(&unique_prefix("sets"), &a, &clock) {
        let set = [SetItem::new(&a, b"k", 1), SetItem::new(&b, b"k", 1)];
        let mut seen_all = Vec::new();
        for _ in 0..4 {
            let d = limiter
                .decide_set(&set, SetMode::EachSparing)
                .await
                .expect("set");
            seen_all.push(seen(&d));
        }
        // A: 1, 2 within; the third is over: A counted (3), B spared (8
        // left still); the fourth the same (A 4)
        let expected = vec![
            (true, vec![(false, 1), (false, 9)]),
            (true, vec![(false, 0), (false, 8)]),
            (false, vec![(true, 0), (false, 8)]),
            (false, vec![(true, 0), (false, 8)]),
        ];
        assert_eq!(seen_all, expected, "{store}");
        // A's count is 4: two refunds of 1 leave 2, so A alone is still
        // not over for a check of 0 (2 <= 2), and B alone is counted
        let refund = [SetItem::refund(&a, b"k", 2)];
        limiter
            .decide_set(&refund, SetMode::EachSparing)
            .await
            .expect("refund");
        let d = limiter
            .decide_set(&[SetItem::new(&b, b"k", 1)], SetMode::EachSparing)
            .await;
        assert_eq!(seen(&d.expect("b")), (true, vec![(false, 7)]), "{store}");
    }
}

/// All or nothing: a denial takes nothing from any item; a refund and a
/// check of 0 go in the same call. A: 2/min, B: 10/min.
#[tokio::test]
async fn all_or_nothing_takes_nothing_on_a_denial() {
    let (a, b) = (fixed("a", 2), fixed("b", 10));
    let clock = ManualClock::new(T0);
    for (store, limiter) in common::limiters_on_clock(&unique_prefix("sets"), &a, &clock) {
        let set = [SetItem::new(&a, b"k", 1), SetItem::new(&b, b"k", 1)];
        let mut seen_all = Vec::new();
        for _ in 0..3 {
            let d = limiter
                .decide_set(&set, SetMode::AllOrNothing)
                .await
                .expect("set");
            seen_all.push(seen(&d));
        }
        // the third: A over (2 + 1 > 2), nothing taken: B keeps 8
        let expected = vec![
            (true, vec![(false, 1), (false, 9)]),
            (true, vec![(false, 0), (false, 8)]),
            (false, vec![(true, 0), (false, 8)]),
        ];
        assert_eq!(seen_all, expected, "{store}");
        // a refund of 1 to A with B's 1 in the same call: A checked at 0
        // after the refund (1 <= 2), B takes 1: 7 left, A 1
        let mixed = [SetItem::refund(&a, b"k", 1), SetItem::new(&b, b"k", 1)];
        let d = limiter
            .decide_set(&mixed, SetMode::AllOrNothing)
            .await
            .expect("mixed");
        assert_eq!(seen(&d), (true, vec![(false, 1), (false, 7)]), "{store}");
        // a cost over a capacity: never, nothing taken
        let big = [SetItem::new(&a, b"k", 3), SetItem::new(&b, b"k", 1)];
        let d = limiter
            .decide_set(&big, SetMode::AllOrNothing)
            .await
            .expect("big");
        assert_eq!(d.verdict(), Verdict::CostExceedsCapacity, "{store}");
        assert_eq!(d.statuses()[1].remaining(), 7, "{store}: B untouched");
    }
}

/// Any algorithm: each counted always puts a GCRA in debt, which refuses
/// until paid back by time. GCRA 2/s, burst 2: one per 500 ms.
#[tokio::test]
async fn each_counted_puts_a_bucket_in_debt() {
    let g = Limit::new("g", Quota::per_second(2).allow_burst(2).gcra()).expect("a limit");
    let clock = ManualClock::new(T0);
    for (store, limiter) in common::limiters_on_clock(&unique_prefix("sets"), &g, &clock) {
        clock.set(T0);
        let one = [SetItem::new(&g, b"k", 1)];
        let mut allowed = Vec::new();
        for _ in 0..4 {
            let d = limiter
                .decide_set(&one, SetMode::EachCounted)
                .await
                .expect("set");
            allowed.push(d.is_allowed());
        }
        assert_eq!(allowed, [true, true, false, false], "{store}");
        // four granted at T0: the burst of 2 is back after 2 s; after 1 s
        // the debt is paid and the burst is still spent
        clock.set(T0 + S);
        let d = limiter
            .decide_set(&one, SetMode::AllOrNothing)
            .await
            .expect("set");
        assert!(!d.is_allowed(), "{store}: still spent at 1 s");
        clock.set(T0 + 2 * S);
        let d = limiter
            .decide_set(&one, SetMode::AllOrNothing)
            .await
            .expect("set");
        assert!(d.is_allowed(), "{store}: paid back at 2 s");
    }
}

/// An empty key is refused; an empty set is allowed at once.
#[tokio::test]
async fn an_empty_key_is_refused_and_an_empty_set_allowed() {
    let a = fixed("a", 2);
    let clock = ManualClock::new(T0);
    for (store, limiter) in common::limiters_on_clock(&unique_prefix("sets"), &a, &clock) {
        for mode in [
            SetMode::AllOrNothing,
            SetMode::EachCounted,
            SetMode::EachSparing,
        ] {
            let bad = [SetItem::new(&a, b"", 1)];
            let refused = limiter.decide_set(&bad, mode).await;
            assert!(
                matches!(refused, Err(tower_ratelimit::Error::EmptyKey)),
                "{store} {mode:?}: {refused:?}"
            );
            let none = limiter.decide_set(&[], mode).await.expect("empty set");
            assert!(none.is_allowed() && none.statuses().is_empty(), "{store}");
        }
    }
}

/// On Redis a set of five limits and keys is one FCALL, in every mode.
#[tokio::test]
async fn a_set_is_one_store_call_on_redis() {
    let limits: Vec<Limit> = (0..5).map(|i| fixed(&format!("l{i}"), 10)).collect();
    let keys: Vec<Vec<u8>> = (0..5).map(|i| format!("key-{i}").into_bytes()).collect();
    // a server of its own: the other tests' calls are not counted
    let server = common::TestRedis::spawn();
    let store = tower_ratelimit::RedisStore::builder(server.url.clone())
        .build()
        .expect("a store");
    let limiter = common::patient_limiter(store, limits[0].clone());
    let set: Vec<SetItem<'_>> = limits
        .iter()
        .zip(&keys)
        .map(|(l, k)| SetItem::new(l, k, 1))
        .collect();
    let mut conn = redis::Client::open(server.url.clone())
        .and_then(|c| c.get_connection())
        .expect("connect");
    // (the first call may load the library)
    limiter
        .decide_set(&set, SetMode::EachCounted)
        .await
        .expect("set");
    for mode in [
        SetMode::EachCounted,
        SetMode::EachSparing,
        SetMode::AllOrNothing,
    ] {
        let before = common::command_calls(&mut conn, "fcall");
        let d = limiter.decide_set(&set, mode).await.expect("set");
        let after = common::command_calls(&mut conn, "fcall");
        assert_eq!(d.statuses().len(), 5);
        assert_eq!(after - before, 1, "{mode:?}: one FCALL");
    }
}
