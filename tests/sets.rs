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

/// Items of one limit and key are one counter: summed, each answered with
/// its status (two identical descriptors in one request count twice).
#[tokio::test]
async fn items_of_one_counter_are_summed() {
    let a = fixed("a", 3);
    let clock = ManualClock::new(T0);
    for (store, limiter) in common::limiters_on_clock(&unique_prefix("sets"), &a, &clock) {
        let twice = [SetItem::new(&a, b"k", 1), SetItem::new(&a, b"k", 1)];
        for mode in [SetMode::EachCounted, SetMode::AllOrNothing] {
            limiter.reset("k").await.expect("reset");
            let d = limiter.decide_set(&twice, mode).await.expect("set");
            assert_eq!(seen(&d), (true, vec![(false, 1), (false, 1)]), "{store}");
            // 2 + 2 > 3: over for both; counted (4) only when counted always
            let d = limiter.decide_set(&twice, mode).await.expect("set");
            let left = if mode == SetMode::EachCounted { 0 } else { 1 };
            let expected = (false, vec![(true, left), (true, left)]);
            assert_eq!(seen(&d), expected, "{store} {mode:?}");
            let check = [SetItem::new(&a, b"k", 0)];
            let d = limiter.decide_set(&check, SetMode::EachCounted).await;
            let over = mode == SetMode::EachCounted; // 4 > 3
            assert_eq!(seen(&d.expect("check")).0, !over, "{store} {mode:?}");
        }
        // a take and a refund of one counter: their sum (2 - 2 = a check)
        let net = [SetItem::new(&a, b"n", 2), SetItem::refund(&a, b"n", 2)];
        let d = limiter
            .decide_set(&net, SetMode::EachCounted)
            .await
            .expect("net");
        assert_eq!(seen(&d), (true, vec![(false, 3), (false, 3)]), "{store}");
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

/// The memory store and Redis give the same set decisions (the Lua op and
/// its Rust mirror): every algorithm, every mode, refunds and checks of 0,
/// on two keys, along one drawn sequence (a fixed seed: the same draws on
/// every run).
#[tokio::test]
async fn memory_and_redis_decide_sets_alike() {
    let limits = [
        Limit::new("fw", Quota::per_second(5).fixed_window()),
        Limit::new("sw", Quota::per_second(5).sliding_window()),
        Limit::new("sl", Quota::per_second(5).sliding_log()),
        Limit::new("tb", Quota::per_second(5).allow_burst(5).token_bucket()),
        Limit::new("gc", Quota::per_second(5).allow_burst(5).gcra()),
    ]
    .map(|l| l.expect("a limit"));
    let modes = [
        SetMode::AllOrNothing,
        SetMode::EachCounted,
        SetMode::EachSparing,
    ];
    let clock = ManualClock::new(T0);
    let stores = common::limiters_on_clock(&unique_prefix("sets"), &limits[0], &clock);
    // a small linear congruential generator: reproducible draws
    let mut seed: u64 = 0x5eed;
    let mut draw = |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let keys: [&[u8]; 2] = [b"k1", b"k2"];
    let mut at = T0;
    for step in 0..300 {
        at += i64::try_from(draw(400_000)).unwrap_or(0);
        let mode = modes[draw(3) as usize];
        let items: Vec<SetItem<'_>> = (0..1 + draw(3))
            .map(|_| {
                let limit = &limits[draw(5) as usize];
                let key = keys[draw(2) as usize];
                let cost = draw(4);
                if draw(5) == 0 {
                    SetItem::refund(limit, key, cost)
                } else {
                    SetItem::new(limit, key, cost)
                }
            })
            .collect();
        clock.set(at);
        let mut seen = Vec::new();
        for (store, limiter) in &stores {
            let d = limiter.decide_set(&items, mode).await.expect("set");
            let statuses: Vec<_> = d
                .statuses()
                .iter()
                .map(|s| (s.is_violated(), s.remaining(), s.reset_after()))
                .collect();
            seen.push((*store, d.verdict(), statuses));
        }
        for other in &seen[1..] {
            // (a cluster's slots that give back what they counted report
            // the reset of before: verdicts and what is left compared)
            let brief = |s: &Vec<(bool, u64, Duration)>| -> Vec<(bool, u64)> {
                s.iter().map(|&(v, r, _)| (v, r)).collect()
            };
            if other.0 == "cluster" {
                assert_eq!(
                    (&seen[0].1, brief(&seen[0].2)),
                    (&other.1, brief(&other.2)),
                    "step {step}, {mode:?}, {items:?}: {} and {}",
                    seen[0].0,
                    other.0
                );
                continue;
            }
            assert_eq!(
                (&seen[0].1, &seen[0].2),
                (&other.1, &other.2),
                "step {step}, {mode:?}, {items:?}: {} and {}",
                seen[0].0,
                other.0
            );
        }
    }
}
