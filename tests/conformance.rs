//! One table per algorithm, run unchanged against the memory store, a real
//! Redis and (with the `cluster` feature) a real Redis Cluster, all driven by
//! an explicit clock. Every expected figure below was
//! worked out by hand from the algorithm's definition; see the comments.

// Tables read better with every figure in the same form (1 * MS beside 500 * MS).
#![allow(clippy::identity_op)]

mod common;

use std::time::Duration;

use common::{assert_keys_expire, state_lifetime, unique_prefix, T0, TEST_CLOCK_SLACK};
use tower_ratelimit::{Limit, ManualClock, Quota, Verdict};

const MS: i64 = 1_000;
const S: i64 = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    /// Granted, after a reservation wait of this many us (0 = at once).
    Allowed(i64),
    /// Denied with this retry_after (us).
    Denied(i64),
    /// Cost over capacity.
    Never,
}
use Expect::*;

/// (time since T0 in us, cost, max_wait us, expected verdict, remaining, reset_after us)
type Row = (i64, u64, i64, Expect, u64, i64);

async fn run(limit: &Limit, table: &[Row]) {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("conformance");
    let stores = common::limiters_on_clock(&prefix, limit, &clock);
    for (store, limiter) in &stores {
        clock.set(T0);
        for (i, &(at, cost, max_wait, expect, remaining, reset)) in table.iter().enumerate() {
            clock.set(T0 + at);
            let max_wait = Duration::from_micros(max_wait as u64);
            let d = limiter
                .decide(&["k"], cost, max_wait)
                .await
                .expect("decision");
            let ctx = format!(
                "{} on {store}, row {i} (t={at}us cost={cost}): {d:?}",
                limit.name()
            );
            let got = match d.verdict() {
                Verdict::Allowed => Allowed(d.delay().as_micros() as i64),
                Verdict::Denied { retry_after } => Denied(retry_after.as_micros() as i64),
                Verdict::CostExceedsCapacity => Never,
                other => panic!("unknown verdict {other:?}"),
            };
            assert_eq!(got, expect, "verdict, {ctx}");
            assert_eq!(d.remaining(), remaining, "remaining, {ctx}");
            assert_eq!(
                d.reset_after().as_micros() as i64,
                reset,
                "reset_after, {ctx}"
            );
            assert_eq!(d.capacity(), limit.capacity(), "limit, {ctx}");
        }
    }
    let longest_wait = table.iter().map(|row| row.2).max().unwrap_or(0);
    assert_keys_expire(
        &prefix,
        state_lifetime([limit], Duration::from_micros(longest_wait as u64)) + TEST_CLOCK_SLACK,
    );
}

#[tokio::test]
async fn sliding_log_3_per_minute() {
    let limit = Limit::new("sms", Quota::per_minute(3).sliding_log()).unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        (0,       1, 0, Allowed(0), 2, 60 * S),
        (10 * S,  1, 0, Allowed(0), 1, 60 * S),
        (20 * S,  1, 0, Allowed(0), 0, 60 * S),
        // full: the grant at 0 leaves the window at 60 s
        (30 * S,  1, 0, Denied(30 * S), 0, 50 * S),
        (30 * S,  4, 0, Never, 0, 50 * S),
        // at 60 s the grant at 0 is out: (0, 60] holds 10 s and 20 s
        (60 * S,  1, 0, Allowed(0), 0, 60 * S),
        (60 * S,  0, 0, Allowed(0), 0, 60 * S),
        // at 75 s: 20 s and 60 s remain; cost 2 needs 20 s gone, at 80 s
        (75 * S,  2, 0, Denied(5 * S), 1, 45 * S),
        // a reservation: granted for 80 s, queued after the last grant
        (75 * S,  2, 10 * S, Allowed(5 * S), 0, 65 * S),
        // FIFO: nothing passes before the reservation; cost 1 fits when 60 s leaves
        (76 * S,  1, 0, Denied(44 * S), 0, 64 * S),
        (140 * S, 0, 0, Allowed(0), 3, 0),
    ];
    run(&limit, table).await;
}

#[tokio::test]
async fn token_bucket_10_refill_1_per_100ms() {
    let limit = Limit::new(
        "tb",
        Quota::rate(1, Duration::from_millis(100))
            .allow_burst(10)
            .token_bucket(),
    )
    .unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        (0,        1, 0, Allowed(0), 9, 100 * MS),
        (0,        9, 0, Allowed(0), 0, 1000 * MS),
        (0,        1, 0, Denied(100 * MS), 0, 1000 * MS),
        (50 * MS,  1, 0, Denied(50 * MS), 0, 950 * MS),
        (100 * MS, 1, 0, Allowed(0), 0, 1000 * MS),
        // 2.5 tokens at 350 ms: 2 taken, 0.5 left
        (350 * MS, 2, 0, Allowed(0), 0, 950 * MS),
        (350 * MS, 11, 0, Never, 0, 950 * MS),
        // reserve 1 token: 0.5 left, full token at 400 ms
        (350 * MS, 1, 100 * MS, Allowed(50 * MS), 0, 1050 * MS),
        // queued behind the reservation (no refill before 400 ms): next token at 500 ms
        (360 * MS, 1, 0, Denied(140 * MS), 0, 1040 * MS),
        // a wait over max_wait consumes nothing
        (360 * MS, 3, 100 * MS, Denied(340 * MS), 0, 1040 * MS),
        (10 * S,   0, 0, Allowed(0), 10, 0),
    ];
    run(&limit, table).await;
}

#[tokio::test]
async fn gcra_10_per_second_burst_10() {
    let limit = Limit::new("gcra", Quota::per_second(10).allow_burst(10).gcra()).unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        // one hit on a fresh limit leaves exactly 9 (redis_rate reports 8 since 2025)
        (0,        1, 0, Allowed(0), 9, 100 * MS),
        (0,        9, 0, Allowed(0), 0, 1000 * MS),
        (0,        1, 0, Denied(100 * MS), 0, 1000 * MS),
        (100 * MS, 1, 0, Allowed(0), 0, 1000 * MS),
        // TAT 1.1 s; cost 3 fits from 0.4 s; TAT becomes 1.4 s
        (600 * MS, 3, 0, Allowed(0), 2, 800 * MS),
        (600 * MS, 11, 0, Never, 2, 800 * MS),
        (600 * MS, 3, 0, Denied(100 * MS), 2, 800 * MS),
        // reservation: fits at 0.7 s, TAT becomes 1.7 s
        (600 * MS, 3, 100 * MS, Allowed(100 * MS), 0, 1100 * MS),
        (5 * S,    0, 0, Allowed(0), 10, 0),
    ];
    run(&limit, table).await;
}

#[tokio::test]
async fn gcra_fractional_rate_never_drifts() {
    // 3 per second: 333333.33.. us apart. Kept exactly as tat + frac/3.
    let limit = Limit::new("third", Quota::per_second(3).allow_burst(1).gcra()).unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        (0,       1, 0, Allowed(0), 0, 333_334),
        // TAT is 333333 + 1/3 us: the next whole microsecond is 333334
        (0,       1, 0, Denied(333_334), 0, 333_334),
        (333_333, 1, 0, Denied(1), 0, 1),
        // on time in the tick holding the TAT: the third is kept, TAT 666666 2/3
        (333_334, 1, 0, Allowed(0), 0, 333_333),
        (333_334, 3, 1_000_000, Never, 0, 333_333),
        // reservations back to back land on ceil(k/3 s): 666667, 1000000, 1333334
        (333_334, 1, 1_000_000, Allowed(333_333), 0, 666_666),
        (333_334, 1, 1_000_000, Allowed(666_666), 0, 1_000_000),
        (333_334, 1, 1_000_000, Allowed(1_000_000), 0, 1_333_333),
        (333_334, 1, 1_000_000, Denied(1_333_333), 0, 1_333_333),
    ];
    run(&limit, table).await;
}

#[tokio::test]
async fn fixed_window_5_per_second() {
    let limit = Limit::new("fw", Quota::per_second(5).fixed_window()).unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        (200 * MS,  3, 0, Allowed(0), 2, 800 * MS),
        (500 * MS,  3, 0, Denied(500 * MS), 2, 500 * MS),
        (500 * MS,  2, 0, Allowed(0), 0, 500 * MS),
        (500 * MS,  6, 0, Never, 0, 500 * MS),
        // reserve in the next window (starts at 1 s)
        // (as of the grant, 1 of the next window's 5 remains)
        (500 * MS,  4, 600 * MS, Allowed(500 * MS), 1, 1500 * MS),
        // FIFO: queued behind the next window, where 1 remains
        (900 * MS,  1, 0, Denied(100 * MS), 0, 1100 * MS),
        (1000 * MS, 1, 0, Allowed(0), 0, 1000 * MS),
        (1999 * MS, 0, 0, Allowed(0), 0, 1 * MS),
        (2000 * MS, 5, 0, Allowed(0), 0, 1000 * MS),
        (3000 * MS, 0, 0, Allowed(0), 5, 0),
    ];
    run(&limit, table).await;
}

#[tokio::test]
async fn sliding_window_counter_10_per_second() {
    let limit = Limit::new("sw", Quota::per_second(10).sliding_window()).unwrap();
    #[rustfmt::skip]
    let table: &[Row] = &[
        (0,           6, 0, Allowed(0), 4, 2 * S),
        // 250 ms into the next window: 6 * 0.75 = 4.5 weighted, rounded up to 5
        (1250 * MS,   0, 0, Allowed(0), 5, 750 * MS),
        (1250 * MS,   5, 0, Allowed(0), 0, 1750 * MS),
        // cost 1 needs 6 * rem <= 4 s: rem <= 666666 us, at 1 s + 333334 us
        (1250 * MS,   1, 0, Denied(83_334), 0, 1750 * MS),
        (1_333_334,   1, 0, Allowed(0), 0, 1_666_666),
        (1_333_334,  11, 0, Never, 0, 1_666_666),
        // next window: previous = 6, weight 0.5
        (2500 * MS,   0, 0, Allowed(0), 7, 500 * MS),
        (4 * S,       0, 0, Allowed(0), 10, 0),
    ];
    run(&limit, table).await;
}

/// The suites run on the server binary they were asked for: with
/// `TEST_REDIS_SERVER` naming a `valkey-server` (as CI's Valkey run does),
/// the servers the tests start say they are Valkey, so a run "on Valkey"
/// cannot test Redis without failing here; without it, they are Redis.
#[test]
fn the_servers_started_are_the_binary_asked_for() {
    let server = common::TestRedis::spawn();
    let client = redis::Client::open(server.url.as_str()).expect("url");
    let mut conn = client.get_connection().expect("connect");
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query(&mut conn)
        .expect("INFO");
    let asked_valkey = common::process::server_binary().contains("valkey");
    let is_valkey = info.contains("server_name:valkey");
    assert_eq!(is_valkey, asked_valkey, "{info}");
}
