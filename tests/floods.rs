//! The local cache of denials: a flood on one key stays off Redis, and no
//! cached denial refuses what Redis would grant.

mod common;

use std::time::Duration;

use common::{command_calls, unique_prefix, TestRedis, T0, TEST_CLOCK_SLACK};
use tower_ratelimit::{Limit, Limiter, ManualClock, Quota, RedisStore};

fn store(server: &TestRedis, prefix: &str, clock: &ManualClock) -> RedisStore {
    RedisStore::builder(&server.url)
        .prefix(prefix)
        .clock(clock.clone())
        .expiry_slack(TEST_CLOCK_SLACK)
        .build()
        .expect("store")
}

fn connection(server: &TestRedis) -> redis::Connection {
    redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connect")
}

/// 10 per second, flooded at 100 per second for 3 seconds: the limiter asks
/// Redis for the grants and for the first denial after each, and answers
/// the other denials itself.
#[tokio::test]
async fn a_flood_on_one_key_reaches_redis_once_per_retry() {
    let server = TestRedis::spawn();
    let clock = ManualClock::new(T0);
    let limit = Limit::new("flood", Quota::per_second(10).allow_burst(10).gcra()).expect("limit");
    let limiter = Limiter::builder(store(&server, "flood", &clock))
        .limit(limit)
        .timeout(common::PATIENT)
        .build()
        .expect("limiter");
    limiter.check("warm-up", 1).await.expect("decision"); // loads the library
    let mut conn = connection(&server);
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut conn)
        .expect("RESETSTAT");
    let (mut granted, mut denied, mut cached) = (0u64, 0u64, 0u64);
    for i in 0..300 {
        clock.set(T0 + i * 10_000);
        let d = limiter.check("victim", 1).await.expect("decision");
        if d.is_allowed() {
            granted += 1;
        } else {
            denied += 1;
            cached += u64::from(d.from_local_cache());
        }
    }
    // burst 10, then one per 100 ms over 3 s
    assert_eq!(granted, 10 + 29, "{granted} granted");
    let calls = command_calls(&mut conn, "fcall");
    assert_eq!(calls, 300 - cached, "every other decision asked Redis");
    // per 100 ms: one grant, one denial from Redis, eight from the cache
    assert!(
        cached * 9 >= denied * 8,
        "{cached} of {denied} denials answered locally"
    );
}

/// Two processes on one key: A caches its denials, B consumes meanwhile,
/// and time moves in small random steps. Whenever A answers from its cache,
/// Redis (asked at the same instant, without a cache) denies too.
#[tokio::test]
async fn a_cached_denial_never_refuses_what_redis_would_grant() {
    let server = TestRedis::spawn();
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("exact");
    let quotas = [
        Quota::rate(5, Duration::from_millis(500)).sliding_log(),
        Quota::rate(3, Duration::from_millis(300))
            .allow_burst(5)
            .token_bucket(),
        Quota::rate(7, Duration::from_millis(700))
            .allow_burst(3)
            .gcra(),
        Quota::rate(4, Duration::from_millis(250)).fixed_window(),
        Quota::rate(6, Duration::from_millis(400)).sliding_window(),
    ];
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut random = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut cached_answers = 0;
    for (i, quota) in quotas.into_iter().enumerate() {
        let limit = Limit::new(format!("q{i}"), quota).expect("limit");
        let on_redis = |cache: bool| {
            Limiter::builder(store(&server, &prefix, &clock))
                .limit(limit.clone())
                .timeout(common::PATIENT)
                .cache_denials(cache)
                .build()
                .expect("limiter")
        };
        let (a, b, truth) = (on_redis(true), on_redis(true), on_redis(false));
        let mut now = T0;
        for _ in 0..400 {
            now += random(40_000) as i64;
            clock.set(now);
            let cost = 1 + random(3);
            if random(3) == 0 {
                b.check("shared", 1 + random(2)).await.expect("b");
            }
            let d = a.check("shared", cost).await.expect("a");
            if d.from_local_cache() {
                cached_answers += 1;
                let redis = truth.peek("shared", cost).await.expect("truth");
                assert!(
                    !redis.is_allowed(),
                    "{quota:?}: A refused cost {cost} from its cache at +{} us, Redis grants it",
                    now - T0
                );
                let retry = d.retry_after().expect("a denial");
                assert!(retry <= redis.retry_after().unwrap_or(Duration::MAX));
            }
        }
        // a reset through A clears A's entries for the key
        a.reset("shared").await.expect("reset");
        assert!(a.check("shared", 1).await.expect("a").is_allowed());
    }
    assert!(
        cached_answers > 100,
        "only {cached_answers} answers came from the cache"
    );
}
