//! Refunds, run unchanged against the memory store and a real Redis (driven
//! by an explicit clock): exact for every algorithm, at most once, and a
//! cancelled reservation goes back. Every expected figure was worked out by
//! hand from the algorithm's definition; see the comments.

#![allow(clippy::identity_op)]

mod common;

use std::time::Duration;

use common::{patient_limiter, redis_store_with_clock, unique_prefix, T0};
use tower_ratelimit::{Grant, Limit, Limiter, ManualClock, MemoryStore, Quota, Verdict};

const MS: i64 = 1_000;
const S: i64 = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    /// Granted, after a reservation wait of this many us (0 = at once).
    Allowed(i64),
    /// Denied with this retry_after (us).
    Denied(i64),
}
use Expect::*;

#[derive(Debug, Clone, Copy)]
enum Op {
    /// Take `cost`, reserving up to `max_wait` us ahead; the grant is kept
    /// for `Refund` (numbered in the order taken).
    Take(u64, i64),
    /// Give back grant number `n`; whether this call did.
    Refund(usize, bool),
    /// Look at a request of `cost` (consumes nothing).
    Look(u64),
}
use Op::*;

/// (time since T0 in us, operation, expected verdict, remaining)
type Row = (i64, Op, Option<Expect>, u64);

fn verdict(d: &tower_ratelimit::Decision) -> Expect {
    match d.verdict() {
        Verdict::Allowed => Allowed(d.delay().as_micros() as i64),
        Verdict::Denied { retry_after } => Denied(retry_after.as_micros() as i64),
        other => panic!("unexpected verdict {other:?}"),
    }
}

async fn run(limit: &Limit, table: &[Row]) {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("refunds");
    let memory = patient_limiter(MemoryStore::with_clock(clock.clone()), limit.clone());
    let redis = patient_limiter(redis_store_with_clock(&prefix, &clock), limit.clone());
    for (store, limiter) in [("memory", &memory), ("redis", &redis)] {
        let mut grants: Vec<Grant> = Vec::new();
        for (i, &(at, op, expect, remaining)) in table.iter().enumerate() {
            clock.set(T0 + at);
            let ctx = format!("{} on {store}, row {i} (t={at}us, {op:?})", limit.name());
            match op {
                Take(cost, max_wait) => {
                    let max_wait = Duration::from_micros(max_wait as u64);
                    let grant = limiter
                        .refundable()
                        .decide(&["k"], cost, max_wait)
                        .await
                        .expect("decision");
                    let d = grant.decision();
                    assert_eq!(Some(verdict(d)), expect, "verdict, {ctx}: {d:?}");
                    assert_eq!(d.remaining(), remaining, "remaining, {ctx}: {d:?}");
                    grants.push(grant);
                }
                Refund(n, did) => {
                    let done = grants[n].refund().await.expect("refund");
                    assert_eq!(done, did, "refund, {ctx}");
                    // a denial has nothing to give back
                    let granted = grants[n].is_allowed();
                    assert_eq!(grants[n].is_refunded(), granted, "{ctx}");
                }
                Look(cost) => {
                    let d = limiter.peek("k", cost).await.expect("peek");
                    assert_eq!(Some(verdict(&d)), expect, "verdict, {ctx}: {d:?}");
                    assert_eq!(d.remaining(), remaining, "remaining, {ctx}: {d:?}");
                }
            }
        }
    }
}

#[tokio::test]
async fn a_refunded_sliding_log_grant_leaves_the_log() {
    let limit = Limit::new("slog", Quota::per_minute(3).sliding_log()).unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        (0,       Take(1, 0),  Some(Allowed(0)), 2),       // grant 0
        (10 * S,  Take(1, 0),  Some(Allowed(0)), 1),       // grant 1
        (20 * S,  Take(1, 0),  Some(Allowed(0)), 0),       // grant 2
        (30 * S,  Look(1),     Some(Denied(30 * S)), 0),
        // the entry at 10 s leaves: 0 s and 20 s remain
        (30 * S,  Refund(1, true),  None, 0),
        (30 * S,  Look(1),     Some(Allowed(0)), 1),
        // at most once
        (30 * S,  Refund(1, false), None, 0),
        (30 * S,  Look(1),     Some(Allowed(0)), 1),
        (30 * S,  Take(1, 0),  Some(Allowed(0)), 0),       // grant 3
        // 0, 20, 30 s: the next fits when 0 s leaves, at 60 s
        (30 * S,  Look(1),     Some(Denied(30 * S)), 0),
        // at 65 s the entry at 0 s has left on its own: nothing to give back
        (65 * S,  Refund(0, true),  None, 0),
        (65 * S,  Look(1),     Some(Allowed(0)), 1),
        // reserve 2: fits when 20 s leaves, at 80 s
        (65 * S,  Take(2, 30 * S), Some(Allowed(15 * S)), 0), // grant 4
        // queued after 80 s; 20 s and 30 s leave by 90 s
        (66 * S,  Look(1),     Some(Denied(24 * S)), 0),
        // the reservation is given back: its slot is free again
        (66 * S,  Refund(4, true),  None, 0),
        (66 * S,  Look(1),     Some(Allowed(0)), 1),
        (66 * S,  Look(2),     Some(Denied(14 * S)), 1),
        // a denial took nothing: its refund gives nothing back
        (66 * S,  Take(2, 0),  Some(Denied(14 * S)), 1),   // grant 5 (denied)
        (66 * S,  Refund(5, false), None, 0),
        (66 * S,  Look(1),     Some(Allowed(0)), 1),
    ];
    run(&limit, table).await;
}

#[tokio::test]
async fn a_refunded_token_bucket_grant_comes_back_never_above_capacity() {
    let limit = Limit::new(
        "tb",
        Quota::rate(1, Duration::from_millis(100))
            .allow_burst(10)
            .token_bucket(),
    )
    .unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        (0,        Take(4, 0),  Some(Allowed(0)), 6),      // grant 0
        (0,        Take(6, 0),  Some(Allowed(0)), 0),      // grant 1
        (0,        Look(1),     Some(Denied(100 * MS)), 0),
        (0,        Refund(0, true),  None, 0),
        (0,        Look(1),     Some(Allowed(0)), 4),
        (0,        Refund(0, false), None, 0),
        (0,        Look(1),     Some(Allowed(0)), 4),
        (0,        Refund(1, true),  None, 0),
        (0,        Look(1),     Some(Allowed(0)), 10),
        (0,        Take(3, 0),  Some(Allowed(0)), 7),      // grant 2
        // refilled to 10 by 300 ms: the 3 given back do not overfill it
        (500 * MS, Refund(2, true),  None, 0),
        (500 * MS, Look(1),     Some(Allowed(0)), 10),
        (500 * MS, Take(10, 0), Some(Allowed(0)), 0),      // grant 3
        (500 * MS, Look(1),     Some(Denied(100 * MS)), 0),
        // reserve 2: the bucket holds them at 700 ms
        (500 * MS, Take(2, 1000 * MS), Some(Allowed(200 * MS)), 0), // grant 4
        (500 * MS, Look(1),     Some(Denied(300 * MS)), 0),
        // given back: the next request has the reservation's slot, 700 ms
        (500 * MS, Refund(4, true),  None, 0),
        (500 * MS, Look(1),     Some(Denied(200 * MS)), 0),
    ];
    run(&limit, table).await;
}

#[tokio::test]
async fn a_refunded_gcra_grant_comes_back_never_above_the_burst() {
    let limit = Limit::new("gcra", Quota::per_second(10).allow_burst(10).gcra()).unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        (0,        Take(4, 0),  Some(Allowed(0)), 6),      // grant 0
        (0,        Take(6, 0),  Some(Allowed(0)), 0),      // grant 1: TAT 1 s
        (0,        Look(1),     Some(Denied(100 * MS)), 0),
        // TAT back 400 ms, to 600 ms
        (0,        Refund(0, true),  None, 0),
        (0,        Look(1),     Some(Allowed(0)), 4),
        (0,        Refund(0, false), None, 0),
        (0,        Look(1),     Some(Allowed(0)), 4),
        (0,        Refund(1, true),  None, 0),
        (0,        Look(1),     Some(Allowed(0)), 10),
        (0,        Take(3, 0),  Some(Allowed(0)), 7),      // grant 2: TAT 300 ms
        // full again at 500 ms: the TAT stays at now
        (500 * MS, Refund(2, true),  None, 0),
        (500 * MS, Look(1),     Some(Allowed(0)), 10),
        (500 * MS, Take(10, 0), Some(Allowed(0)), 0),      // grant 3: TAT 1.5 s
        (500 * MS, Look(1),     Some(Denied(100 * MS)), 0),
        // reserve 2: fits at 700 ms, TAT 1.7 s
        (500 * MS, Take(2, 1000 * MS), Some(Allowed(200 * MS)), 0), // grant 4
        (500 * MS, Look(1),     Some(Denied(300 * MS)), 0),
        // given back: TAT 1.5 s again
        (500 * MS, Refund(4, true),  None, 0),
        (500 * MS, Look(1),     Some(Denied(100 * MS)), 0),
    ];
    run(&limit, table).await;
}

#[tokio::test]
async fn a_refunded_fixed_window_grant_is_uncounted_in_its_window_only() {
    let limit = Limit::new("fw", Quota::per_second(5).fixed_window()).unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        (200 * MS,  Take(3, 0), Some(Allowed(0)), 2),      // grant 0
        (200 * MS,  Take(2, 0), Some(Allowed(0)), 0),      // grant 1
        (200 * MS,  Look(1),    Some(Denied(800 * MS)), 0),
        (300 * MS,  Refund(0, true),  None, 0),
        (300 * MS,  Look(1),    Some(Allowed(0)), 3),
        (300 * MS,  Refund(0, false), None, 0),
        (300 * MS,  Look(1),    Some(Allowed(0)), 3),
        (1200 * MS, Take(5, 0), Some(Allowed(0)), 0),      // grant 2
        // grant 1 was in the last window: nothing comes off this one
        (1200 * MS, Refund(1, true),  None, 0),
        (1200 * MS, Look(1),    Some(Denied(800 * MS)), 0),
        (1500 * MS, Refund(2, true),  None, 0),
        (1500 * MS, Look(5),    Some(Allowed(0)), 5),
    ];
    run(&limit, table).await;
}

#[tokio::test]
async fn a_refunded_sliding_window_grant_comes_off_the_window_it_fell_in() {
    let limit = Limit::new("sw", Quota::per_second(10).sliding_window()).unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        (0,         Take(6, 0), Some(Allowed(0)), 4),      // grant 0
        (0,         Take(4, 0), Some(Allowed(0)), 0),      // grant 1
        (0,         Refund(0, true),  None, 0),
        (0,         Look(1),    Some(Allowed(0)), 6),
        (0,         Refund(0, false), None, 0),
        (0,         Look(1),    Some(Allowed(0)), 6),
        // previous window 4, weight 0.75: 3 used
        (1250 * MS, Look(1),    Some(Allowed(0)), 7),
        // grant 1 comes off the previous window
        (1250 * MS, Refund(1, true),  None, 0),
        (1250 * MS, Look(1),    Some(Allowed(0)), 10),
        (1250 * MS, Take(5, 0), Some(Allowed(0)), 5),      // grant 2
        // 2.1 s: 5 in the previous window, weight 0.9: 5 used (4.5 rounded up)
        (2100 * MS, Look(1),    Some(Allowed(0)), 5),
        (2100 * MS, Take(2, 0), Some(Allowed(0)), 3),      // grant 3
        // 4 s: both windows of grant 3 are over, nothing to give back
        (4000 * MS, Take(3, 0), Some(Allowed(0)), 7),      // grant 4
        (4000 * MS, Refund(3, true),  None, 0),
        (4000 * MS, Look(1),    Some(Allowed(0)), 7),
        (4000 * MS, Refund(4, true),  None, 0),
        (4000 * MS, Look(1),    Some(Allowed(0)), 10),
    ];
    run(&limit, table).await;
}

fn two_limits(store: impl Into<tower_ratelimit::Store>) -> Limiter {
    Limiter::builder(store)
        .limit(Limit::new("burst", Quota::per_second(2).allow_burst(2).gcra()).unwrap())
        .limit(Limit::new("minute", Quota::per_minute(3).sliding_log()).unwrap())
        .timeout(common::PATIENT)
        .cache_denials(false)
        .build()
        .unwrap()
}

/// Two limits of one limiter: a refund gives back in both.
#[tokio::test]
async fn a_refund_gives_back_in_every_limit_of_the_grant() {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("refunds-multi");
    let memory = two_limits(MemoryStore::with_clock(clock.clone()));
    let redis = two_limits(redis_store_with_clock(&prefix, &clock));
    for (store, limiter) in [("memory", memory), ("redis", redis)] {
        let first = limiter.refundable().check("k", 2).await.unwrap();
        assert!(first.is_allowed(), "{store}");
        let look = limiter.peek("k", 0).await.unwrap();
        assert_eq!(look.statuses()[0].remaining(), 0, "{store}: {look:?}");
        assert_eq!(look.statuses()[1].remaining(), 1, "{store}: {look:?}");
        assert!(first.refund().await.unwrap(), "{store}");
        let look = limiter.peek("k", 0).await.unwrap();
        assert_eq!(look.statuses()[0].remaining(), 2, "{store}: {look:?}");
        assert_eq!(look.statuses()[1].remaining(), 3, "{store}: {look:?}");
    }
}

/// A reservation whose `acquire` is dropped while it sleeps goes back: the
/// next request is granted the same slot, not the one after it.
#[tokio::test]
async fn a_cancelled_acquire_returns_its_slot() {
    let prefix = unique_prefix("refunds-cancel");
    let limit = || Limit::new("jobs", Quota::per_minute(1).allow_burst(1).gcra()).unwrap();
    let memory = patient_limiter(MemoryStore::new(), limit());
    let redis = patient_limiter(common::redis_store(&prefix), limit());
    for (store, limiter) in [("memory", memory), ("redis", redis)] {
        assert!(limiter.check("q", 1).await.unwrap().is_allowed());
        // the next slot is a minute away; wait for it, then give up
        let waiting = limiter.acquire("q", 1, Duration::from_secs(120));
        let cancelled = tokio::time::timeout(Duration::from_millis(50), waiting).await;
        assert!(cancelled.is_err(), "{store}: the acquire was still waiting");
        // the refund of a store that must be awaited runs on a task
        let mut look = limiter.peek("q", 1).await.unwrap();
        for _ in 0..100 {
            if look.retry_after() <= Some(Duration::from_secs(60)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            look = limiter.peek("q", 1).await.unwrap();
        }
        // without the refund the next slot would be two minutes away
        let wait = look.retry_after().expect("still one minute away");
        assert!(wait <= Duration::from_secs(60), "{store}: {look:?}");

        let grant = limiter
            .refundable()
            .decide(&["r"], 1, Duration::ZERO)
            .await
            .unwrap();
        assert!(grant.is_allowed());
        let waiting = limiter
            .refundable()
            .acquire("r", 1, Duration::from_secs(120));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), waiting)
                .await
                .is_err(),
            "{store}"
        );
        let mut look = limiter.peek("r", 1).await.unwrap();
        for _ in 0..100 {
            if look.retry_after() <= Some(Duration::from_secs(60)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            look = limiter.peek("r", 1).await.unwrap();
        }
        assert!(
            look.retry_after() <= Some(Duration::from_secs(60)),
            "{store}: {look:?}"
        );
    }
}
