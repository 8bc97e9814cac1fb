//! A decision of one limit on a key at rest costs Redis one command: while
//! most keys are found absent, the decision's state is written by the call
//! that reads the key (`SET ... NX GET`), and a key found present is decided
//! again on its value, exactly as when read first. Where most keys are
//! present, decisions read first (`GET`) again. On a Redis of the test's own,
//! so that its command counts are this test's.

mod common;

use std::time::Duration;

use common::{command_calls, single_key_corruptions, unique_prefix, TestRedis, PATIENT};
use tower_ratelimit::{Limit, Limiter, ManualClock, MemoryStore, Quota, RedisStore};

const HOUR: Duration = Duration::from_secs(3600);

fn limiter(server: &TestRedis, quota: Quota) -> Limiter {
    let store = RedisStore::builder(server.url.clone())
        .prefix(unique_prefix("absent"))
        .coalesce_decisions(false)
        .build()
        .expect("store");
    Limiter::builder(store)
        .limit(Limit::new("five", quota).expect("limit"))
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter")
}

/// The `GET` and `SET` commands the server has run.
fn gets_and_sets(server: &TestRedis) -> (u64, u64) {
    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connect");
    (
        command_calls(&mut conn, "get"),
        command_calls(&mut conn, "set"),
    )
}

/// Checks `n` keys never used before (`tag` names them); all are granted.
async fn fresh_keys(limiter: &Limiter, tag: &str, n: usize) {
    for i in 0..n {
        let decision = limiter
            .check(&format!("{tag}-{i}"), 1)
            .await
            .expect("decided");
        assert!(decision.is_allowed(), "a fresh key is granted");
    }
}

/// Every algorithm kept as one STRING, 5 per hour: keys at rest cost one
/// `SET` each and no `GET`; a present key is decided exactly (5 granted,
/// then refusals) whichever way it is read; many present keys turn reading
/// first back on, and keys at rest turn it off again.
#[tokio::test]
async fn keys_at_rest_cost_one_command_and_present_keys_decide_exactly() {
    let quotas = [
        ("gcra", Quota::rate(5, HOUR).allow_burst(5).gcra()),
        (
            "token bucket",
            Quota::rate(5, HOUR).allow_burst(5).token_bucket(),
        ),
        ("fixed window", Quota::rate(5, HOUR).fixed_window()),
        ("sliding window", Quota::rate(5, HOUR).sliding_window()),
    ];
    for (name, quota) in quotas {
        // a server each: the share of absent keys is the server's
        let server = TestRedis::spawn();
        let limiter = limiter(&server, quota);
        limiter
            .peek("warm", 1)
            .await
            .expect("the library is loaded");

        let before = gets_and_sets(&server);
        fresh_keys(&limiter, "rest", 40).await;
        let after = gets_and_sets(&server);
        assert_eq!(
            after.0 - before.0,
            0,
            "{name}: keys at rest were read first"
        );
        assert_eq!(after.1 - before.1, 40, "{name}: one SET per key at rest");

        // one key, present from its second check on: exactly 5 granted,
        // first taken as absent and decided again, then read first
        let mut granted = 0;
        for _ in 0..40 {
            let decision = limiter.check("busy", 1).await.expect("decided");
            if decision.is_allowed() {
                granted += 1;
            } else {
                let wait = decision.retry_after().expect("a refusal says when");
                assert!(wait > Duration::ZERO, "{name}: a refusal waits");
            }
        }
        assert_eq!(granted, 5, "{name}: exact on a present key");
        let read = gets_and_sets(&server);
        assert!(
            read.0 - after.0 >= 20,
            "{name}: a present key kept being taken as absent ({} GETs in 40 checks)",
            read.0 - after.0
        );

        // keys at rest again: reading first stops within some tens of them
        fresh_keys(&limiter, "again", 40).await;
        let before = gets_and_sets(&server);
        fresh_keys(&limiter, "more", 20).await;
        let after = gets_and_sets(&server);
        assert_eq!(after.0 - before.0, 0, "{name}: keys at rest read first");
        assert_eq!(after.1 - before.1, 20, "{name}: one SET per key at rest");
    }
}

/// A key taken as absent that holds something else (each of
/// `common::single_key_corruptions`: another type, which `SET ... GET`
/// answers with an error; garbage; a state of another format or tag;
/// numbers beyond 2^53): decided as an absent key is, as the in-memory
/// store decides it, and written back as a valid state, never an error. The
/// first decision on each such key is made while the server's estimate says
/// keys are absent (fresh keys between the cases keep it so), which the
/// count of `GET`s shows.
#[tokio::test]
async fn a_key_taken_as_absent_that_holds_anything_else_is_decided_as_absent() {
    const MS: i64 = 1_000;
    let quotas = [
        Quota::rate(5, HOUR).allow_burst(5).gcra(),
        Quota::rate(5, HOUR).allow_burst(5).token_bucket(),
        Quota::rate(5, HOUR).fixed_window(),
        Quota::rate(5, HOUR).sliding_window(),
    ];
    let server = TestRedis::spawn();
    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connect");
    for quota in quotas {
        let name = format!("{:?}", quota.algorithm());
        let clock = ManualClock::new(common::T0);
        let prefix = unique_prefix("absent-foreign");
        let store = RedisStore::builder(server.url.clone())
            .prefix(prefix.clone())
            .coalesce_decisions(false)
            .expiry_slack(common::TEST_CLOCK_SLACK)
            .clock(clock.clone())
            .build()
            .expect("store");
        let limit = Limit::new("five", quota).expect("limit");
        let redis = common::patient_limiter(store, limit.clone());
        // (what each leaves of a history: none; the untouched key has one)
        let corruptions = single_key_corruptions()
            .into_iter()
            .filter(|&(_, _, history)| !history);
        for (i, (what, corruption, _)) in corruptions.enumerate() {
            let ctx = format!("{name} key {what}");
            let user = format!("k{i}");
            let key = common::single_key_of(&prefix, "five", &quota, &user);
            for command in corruption(&key) {
                let _: redis::Value = command.query(&mut conn).expect("write the key");
            }
            // keys at rest keep the estimate at "absent"
            fresh_keys(&redis, &format!("rest-{i}"), 40).await;
            let twin =
                common::patient_limiter(MemoryStore::with_clock(clock.clone()), limit.clone());
            let gets = command_calls(&mut conn, "get");
            for (at, cost) in [(MS, 2u64), (2 * MS, 9), (3 * MS, 3), (4 * MS, 1)] {
                clock.set(common::T0 + at);
                let r = redis.check(&user, cost).await;
                let r = r.unwrap_or_else(|e| panic!("{ctx}: the store failed: {e}"));
                let m = twin.check(&user, cost).await.expect("memory");
                assert_eq!(r, m, "{ctx}: at {at} us, cost {cost}");
                if at == MS {
                    assert_eq!(
                        command_calls(&mut conn, "get"),
                        gets,
                        "{ctx}: the first decision read the key first"
                    );
                }
            }
            let kind: String = redis::cmd("TYPE").arg(&key).query(&mut conn).expect("TYPE");
            assert_eq!(kind, "string", "{ctx}: written back as a state");
        }
    }
}
