//! Conformance of the service (`Service::should_rate_limit`) with
//! envoyproxy/ratelimit, on the memory store and on a real `redis-server`
//! started by each test. Their cases, re-expressed (facts from their
//! tests, written here anew):
//!
//! From `test/integration/integration_test.go` (`testBasicBaseConfig`, with
//! `test/integration/runtime/current/ratelimit/config/{basic,another}.yaml`):
//! - an unknown domain: `OK`, no limit; `basic` `key1`: 50/s, 49 left, one
//!   hit counted; `another` `key2` 25 times: 20/min, `OVER_LIMIT` from the
//!   21st, `total_hits` and `over_limit` counted; `key2` and `key3` in one
//!   request 15 times: `key3` (10/h) over from the 11th, `key2` counted on
//!   its own (or, with `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`, not
//!   counted while `key3` is over); each with and without the local cache
//!   (`over_limit_with_local_cache`) and the stop setting: `integration_*`.
//! - `CACHE_KEY_PREFIX`: `a_cache_key_prefix_keeps_counters_apart`.
//!
//! From `test/service/ratelimit_test.go`:
//! - `TestServiceGlobalShadowMode`, `TestRuleShadowMode`,
//!   `TestMixedRuleShadowMode`: `shadow_*`;
//! - `TestServiceWithCustomRatelimitHeaders`,
//!   `TestServiceWithDefaultRatelimitHeaders`: `response_headers_*`;
//! - `TestEmptyDomain`, `TestEmptyDescriptors`: `malformed_requests_*`;
//! - `TestCacheError`: `a_failed_store_answers_unavailable`;
//! - `TestUnlimited`: `unlimited_*`;
//! - `TestServiceGlobalQuotaMode`, `TestServicePerDescriptorQuotaMode`,
//!   `TestServiceMixedPerDescriptorModes(UnderLimit)`,
//!   `TestServiceQuotaModeOnlyAllOverTheLimit`,
//!   `TestServiceQuotaModeOnlySomeOverTheLimit`,
//!   `TestServiceQuotaModeWithShadowMode`, `TestServiceMixedModeWithShadowMode`:
//!   `quota_mode_*`;
//! - `TestMetadataReturnedForPassedDescriptors` and its siblings:
//!   `dynamic_metadata_*`;
//! - `replaces` (config and service): `a_replaced_limit_is_not_applied`.
//!
//! Beyond their cases (the protocol's fields they do not test, and this
//! server's opt-in mode): `hits_addend_*`, `an_override_*`,
//! `negative_hits_*`, `near_limit_*`, `crate_mode_*`, and the service
//! behind tonic's transport (`the_service_answers_over_grpc`).
//!
//! Left out, and why: `TestServiceTracer` (tracing spans), health checks
//! and `TestInitialLoadError` (the server and config loader's, not the
//! decision's), per-second Redis (`REDIS_PERSECOND_*`: one store here),
//! memcache, TLS, auth, sentinel and cluster variants (the store's
//! transport, tested by the crate), the xDS config provider (not built),
//! the local cache's hit/miss gauges (freecache's own statistics), and
//! `over_limit`/`near_limit` splits of a request of several hits crossing
//! the limit (this service counts all of an over-limit request's hits as
//! over: it does not read the count back).

mod common;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tower_ratelimit::{MemoryStore, RedisStore, Store};
use tower_ratelimit_server::config::RateLimitConfig;
use tower_ratelimit_server::proto::rate_limit_descriptor::{Entry, RateLimitOverride};
use tower_ratelimit_server::proto::rate_limit_response::{Code, DescriptorStatus};
use tower_ratelimit_server::proto::{RateLimitDescriptor, RateLimitRequest, RateLimitResponse};
use tower_ratelimit_server::service::{
    Options, ResponseHeaders, Service, ServiceError, EMPTY_DOMAIN, NO_DESCRIPTORS,
};
use tower_ratelimit_server::stats::{Counter, Counts, Event};

use common::RedisServer;

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;
const SECOND: i32 = 1;
const MINUTE: i32 = 2;
const HOUR: i32 = 3;

const BASIC: &str = "
domain: basic
descriptors:
  - key: key1
    rate_limit:
      unit: second
      requests_per_unit: 50
  - key: one_per_minute
    rate_limit:
      unit: minute
      requests_per_unit: 1
";

const ANOTHER: &str = "
domain: another
descriptors:
  - key: key2
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: key3
    rate_limit:
      unit: hour
      requests_per_unit: 10
";

/// One service under test, with what it records.
struct Under {
    store: &'static str,
    service: Service,
    stats: Arc<Counts>,
    _redis: Option<RedisServer>,
}

fn config(files: &[&str]) -> Arc<RateLimitConfig> {
    let files: Vec<(String, String)> = files
        .iter()
        .enumerate()
        .map(|(i, text)| (format!("file{i}.yaml"), (*text).to_owned()))
        .collect();
    Arc::new(RateLimitConfig::from_files(&files, false).expect("a valid configuration"))
}

/// Store calls in these tests may take this long: a loaded machine must not
/// turn a slow answer (the first call loads the Lua library) into an
/// `UNAVAILABLE`. (The store's timeout has tests in the crate.)
const PATIENT: Duration = Duration::from_secs(10);

/// The service over the memory store, and over a Redis of its own.
fn services(files: &[&str], options: Options) -> Vec<Under> {
    let options = Options {
        store_timeout: PATIENT,
        ..options
    };
    let config = config(files);
    let mut all = Vec::new();
    for store in ["memory", "redis"] {
        let (redis, built): (Option<RedisServer>, Store) = match store {
            "memory" => (None, MemoryStore::new().into()),
            _ => {
                let server = RedisServer::start();
                let built = RedisStore::builder(server.url.clone())
                    .build()
                    .expect("a Redis store");
                (Some(server), built.into())
            }
        };
        let stats = Arc::new(Counts::default());
        let (_tx, rx) = watch::channel(Arc::clone(&config));
        let service = Service::new(built, rx, options.clone(), stats.clone()).expect("a service");
        all.push(Under {
            store,
            service,
            stats,
            _redis: redis,
        });
    }
    all
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: hits,
    }
}

async fn ask(under: &Under, request: RateLimitRequest) -> RateLimitResponse {
    under
        .service
        .should_rate_limit(request)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", under.store))
}

/// (code, requests per unit, unit, remaining) of a status; `None` limit
/// as (code, 0, 0, remaining).
fn brief(status: &DescriptorStatus) -> (i32, u32, i32, u32) {
    let (n, unit) = status
        .current_limit
        .as_ref()
        .map_or((0, 0), |l| (l.requests_per_unit, l.unit));
    (status.code, n, unit, status.limit_remaining)
}

/// Waits, if the current window of `secs` ends within 3 s, until the next
/// one begins: a loop of requests then stays in one window (the
/// assertions are about counts, never about time).
async fn clear_of_window_end(secs: u64) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let into = now.as_secs_f64() % secs as f64;
    let left = secs as f64 - into;
    if left < 3.0 {
        tokio::time::sleep(Duration::from_secs_f64(left + 0.05)).await;
    }
}

fn unique() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{nanos}")
}

/// `testBasicBaseConfig` in one setting.
async fn integration(options: Options) {
    let local = options.local_cache_size_in_bytes > 0;
    let stop = options.stop_increment_when_over_limit;
    for under in services(&[BASIC, ANOTHER], options.clone()) {
        let ctx = format!("{} (local cache {local}, stop {stop})", under.store);
        // an unknown domain: OK, no limit
        let r = ask(
            &under,
            request("foo", vec![descriptor(&[("hello", "world")])], 1),
        )
        .await;
        assert_eq!(r.overall_code, OK, "{ctx}");
        assert_eq!(
            r.statuses.iter().map(brief).collect::<Vec<_>>(),
            [(OK, 0, 0, 0)]
        );
        assert_eq!(r.statuses[0].duration_until_reset, None, "{ctx}");
        assert_eq!(under.stats.events(Event::DomainNotFound("foo")), 1, "{ctx}");

        // basic key1: 50 per second, 49 left, within the second
        let r = ask(
            &under,
            request("basic", vec![descriptor(&[("key1", "foo")])], 1),
        )
        .await;
        assert_eq!(r.overall_code, OK, "{ctx}");
        assert_eq!(brief(&r.statuses[0]), (OK, 50, SECOND, 49), "{ctx}");
        let reset = r.statuses[0]
            .duration_until_reset
            .as_ref()
            .map(|d| d.seconds);
        assert_eq!(reset, Some(1), "{ctx}: the second's end, rounded up");
        assert_eq!(
            under.stats.get("basic.key1", Counter::TotalHits),
            1,
            "{ctx}"
        );

        // key2 with a fresh value, 25 times: 20 per minute
        clear_of_window_end(60).await;
        let value = unique();
        for i in 0..25u32 {
            let r = ask(
                &under,
                request("another", vec![descriptor(&[("key2", &value)])], 1),
            )
            .await;
            let (code, left) = if i >= 20 {
                (OVER, 0)
            } else {
                (OK, 20 - (i + 1))
            };
            assert_eq!(r.overall_code, code, "{ctx}: request {i}");
            assert_eq!(
                brief(&r.statuses[0]),
                (code, 20, MINUTE, left),
                "{ctx}: {i}"
            );
            let reset = r.statuses[0]
                .duration_until_reset
                .as_ref()
                .map(|d| d.seconds);
            assert!(
                reset.is_some_and(|s| (1..=60).contains(&s)),
                "{ctx}: {reset:?}"
            );
            let i = u64::from(i);
            let stats = &under.stats;
            assert_eq!(
                stats.get("another.key2", Counter::TotalHits),
                i + 1,
                "{ctx}"
            );
            let over = if i >= 20 { i - 19 } else { 0 };
            assert_eq!(
                stats.get("another.key2", Counter::OverLimit),
                over,
                "{ctx}: {i}"
            );
            let cached = if local && i >= 20 { i - 20 } else { 0 };
            let with_cache = stats.get("another.key2", Counter::OverLimitWithLocalCache);
            assert_eq!(with_cache, cached, "{ctx}: {i}");
        }

        // key2 and key3 (10 per hour) in one request, 15 times
        clear_of_window_end(60).await;
        clear_of_window_end(3600).await;
        let value = unique();
        for i in 0..15u32 {
            let r = ask(
                &under,
                request(
                    "another",
                    vec![
                        descriptor(&[("key2", &value)]),
                        descriptor(&[("key3", &value)]),
                    ],
                    1,
                ),
            )
            .await;
            let mut left2 = 20 - (i + 1);
            let (code, left3) = if i >= 10 {
                (OVER, 0)
            } else {
                (OK, 10 - (i + 1))
            };
            if i >= 10 && stop {
                left2 = 10; // key2 no longer counted while key3 is over
            }
            assert_eq!(r.overall_code, code, "{ctx}: request {i}");
            let got: Vec<_> = r.statuses.iter().map(brief).collect();
            assert_eq!(
                got,
                [(OK, 20, MINUTE, left2), (code, 10, HOUR, left3)],
                "{ctx}: request {i}"
            );
            let i = u64::from(i);
            let stats = &under.stats;
            assert_eq!(
                stats.get("another.key2", Counter::TotalHits),
                i + 26,
                "{ctx}"
            );
            assert_eq!(stats.get("another.key2", Counter::OverLimit), 5, "{ctx}");
            let cached2 = if local { 4 } else { 0 };
            let with_cache = stats.get("another.key2", Counter::OverLimitWithLocalCache);
            assert_eq!(with_cache, cached2, "{ctx}");
            assert_eq!(
                stats.get("another.key3", Counter::TotalHits),
                i + 1,
                "{ctx}"
            );
            let over3 = if i >= 10 { i - 9 } else { 0 };
            assert_eq!(
                stats.get("another.key3", Counter::OverLimit),
                over3,
                "{ctx}"
            );
            let cached3 = if local && i >= 10 { i - 10 } else { 0 };
            let with_cache = stats.get("another.key3", Counter::OverLimitWithLocalCache);
            assert_eq!(with_cache, cached3, "{ctx}: {i}");
        }
    }
}

#[tokio::test]
async fn integration_basic_config() {
    integration(Options::default()).await;
}

#[tokio::test]
async fn integration_with_local_cache() {
    integration(Options {
        local_cache_size_in_bytes: 1000,
        ..Options::default()
    })
    .await;
}

#[tokio::test]
async fn integration_with_stop_cache_key_increment_when_over_limit() {
    integration(Options {
        stop_increment_when_over_limit: true,
        ..Options::default()
    })
    .await;
}

#[tokio::test]
async fn integration_with_local_cache_and_stop_increment() {
    integration(Options {
        local_cache_size_in_bytes: 1000,
        stop_increment_when_over_limit: true,
        ..Options::default()
    })
    .await;
}

#[tokio::test]
async fn a_cache_key_prefix_keeps_counters_apart() {
    // two services over one Redis, with other prefixes: each counts alone
    let server = RedisServer::start();
    let config = config(&[BASIC]);
    let mut services = Vec::new();
    for prefix in ["a_", "b_"] {
        let store = RedisStore::builder(server.url.clone())
            .build()
            .expect("a store");
        let (_tx, rx) = watch::channel(Arc::clone(&config));
        let options = Options {
            cache_key_prefix: prefix.into(),
            store_timeout: PATIENT,
            ..Options::default()
        };
        services
            .push(Service::new(store, rx, options, Arc::new(Counts::default())).expect("service"));
    }
    clear_of_window_end(60).await;
    let value = unique();
    for service in &services {
        let req = request("basic", vec![descriptor(&[("one_per_minute", &value)])], 1);
        let r = service.should_rate_limit(req).await.expect("answer");
        assert_eq!(r.overall_code, OK, "each prefix has its own counter");
    }
    let req = request("basic", vec![descriptor(&[("one_per_minute", &value)])], 1);
    let r = services[0].should_rate_limit(req).await.expect("answer");
    assert_eq!(r.overall_code, OVER);
}

const SHADOW: &str = "
domain: shadow
descriptors:
  - key: enforced
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: shadowed
    shadow_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
";

#[tokio::test]
async fn shadow_mode_globally_answers_ok_and_counts() {
    let options = Options {
        shadow_mode: true,
        ..Options::default()
    };
    clear_of_window_end(60).await;
    for under in services(&[SHADOW], options) {
        let req = || request("shadow", vec![descriptor(&[("enforced", "x")])], 1);
        assert_eq!(ask(&under, req()).await.overall_code, OK, "{}", under.store);
        let r = ask(&under, req()).await;
        // the overall code is OK; the descriptor still says OVER_LIMIT
        assert_eq!(r.overall_code, OK, "{}", under.store);
        assert_eq!(
            brief(&r.statuses[0]),
            (OVER, 1, MINUTE, 0),
            "{}",
            under.store
        );
        assert_eq!(under.stats.events(Event::GlobalShadowMode), 1);
        assert_eq!(under.stats.get("shadow.enforced", Counter::OverLimit), 1);
    }
}

#[tokio::test]
async fn shadow_mode_of_a_rule_lets_it_through() {
    clear_of_window_end(60).await;
    for under in services(&[SHADOW], Options::default()) {
        let req = || request("shadow", vec![descriptor(&[("shadowed", "x")])], 1);
        ask(&under, req()).await;
        let r = ask(&under, req()).await;
        assert_eq!(r.overall_code, OK, "{}", under.store);
        assert_eq!(brief(&r.statuses[0]), (OK, 1, MINUTE, 0), "{}", under.store);
        assert_eq!(under.stats.get("shadow.shadowed", Counter::ShadowMode), 1);
        assert_eq!(under.stats.get("shadow.shadowed", Counter::OverLimit), 1);
    }
}

#[tokio::test]
async fn shadow_mode_of_one_rule_does_not_lift_another() {
    clear_of_window_end(60).await;
    for under in services(&[SHADOW], Options::default()) {
        let req = || {
            request(
                "shadow",
                vec![
                    descriptor(&[("shadowed", "y")]),
                    descriptor(&[("enforced", "y")]),
                ],
                1,
            )
        };
        ask(&under, req()).await;
        let r = ask(&under, req()).await;
        assert_eq!(r.overall_code, OVER, "{}", under.store);
        let codes: Vec<i32> = r.statuses.iter().map(|s| s.code).collect();
        assert_eq!(codes, [OK, OVER], "{}", under.store);
    }
}

#[tokio::test]
async fn response_headers_name_the_closest_descriptor() {
    let custom = ResponseHeaders {
        limit: "A-Limit".into(),
        remaining: "A-Remaining".into(),
        reset: "A-Reset".into(),
    };
    for names in [ResponseHeaders::default(), custom] {
        let options = Options {
            response_headers: Some(names.clone()),
            ..Options::default()
        };
        clear_of_window_end(60).await;
        for under in services(&[ANOTHER], options) {
            let value = unique();
            // key2 (20/min) has 19 left, key3 (10/h) 9: key3 is the closest
            let req = request(
                "another",
                vec![
                    descriptor(&[("key2", &value)]),
                    descriptor(&[("key3", &value)]),
                ],
                1,
            );
            let r = ask(&under, req).await;
            let headers: Vec<(String, String)> = r
                .response_headers_to_add
                .iter()
                .map(|h| (h.key.clone(), h.value.clone()))
                .collect();
            let reset = r.statuses[1]
                .duration_until_reset
                .as_ref()
                .map_or(0, |d| d.seconds);
            assert!((1..=3600).contains(&reset), "{}", under.store);
            assert_eq!(
                headers,
                [
                    (names.limit.clone(), "10".to_owned()),
                    (names.remaining.clone(), "9".to_owned()),
                    (names.reset.clone(), reset.to_string()),
                ],
                "{}",
                under.store
            );
        }
    }
    // disabled: no headers
    for under in services(&[ANOTHER], Options::default()) {
        let r = ask(
            &under,
            request("another", vec![descriptor(&[("key2", "z")])], 1),
        )
        .await;
        assert!(r.response_headers_to_add.is_empty());
    }
}

#[tokio::test]
async fn malformed_requests_are_invalid_arguments() {
    for under in services(&[BASIC], Options::default()) {
        let empty_domain = request("", vec![descriptor(&[("key1", "a")])], 1);
        let e = under.service.should_rate_limit(empty_domain).await.err();
        assert_eq!(e, Some(ServiceError::InvalidArgument(EMPTY_DOMAIN)));
        let no_descriptors = request("basic", vec![], 1);
        let e = under.service.should_rate_limit(no_descriptors).await.err();
        assert_eq!(e, Some(ServiceError::InvalidArgument(NO_DESCRIPTORS)));
        let status = tonic::Status::from(ServiceError::InvalidArgument(EMPTY_DOMAIN));
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(status.message(), "rate limit domain must not be empty");
        assert_eq!(under.stats.events(Event::ServiceError), 2);
    }
}

#[tokio::test]
async fn a_failed_store_answers_unavailable() {
    let mut server = RedisServer::start();
    let store = RedisStore::builder(server.url.clone())
        .build()
        .expect("a store");
    let stats = Arc::new(Counts::default());
    let (_tx, rx) = watch::channel(config(&[BASIC]));
    let options = Options {
        store_timeout: Duration::from_secs(2),
        ..Options::default()
    };
    let service = Service::new(store, rx, options, stats.clone()).expect("service");
    let req = || request("basic", vec![descriptor(&[("key1", "a")])], 1);
    assert!(service.should_rate_limit(req()).await.is_ok());
    server.stop();
    let e = service.should_rate_limit(req()).await.err();
    assert_eq!(e, Some(ServiceError::Unavailable));
    let status = tonic::Status::from(ServiceError::Unavailable);
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert_eq!(stats.events(Event::StoreError), 1);
    // nothing to decide (no limit): no store call, no error
    let free = request("basic", vec![descriptor(&[("nothing", "a")])], 1);
    assert!(service.should_rate_limit(free).await.is_ok());
}

const UNLIMITED: &str = "
domain: some_domain
descriptors:
  - key: foo
    rate_limit:
      unlimited: true
  - key: baz
    rate_limit:
      unit: minute
      requests_per_unit: 1
";

#[tokio::test]
async fn unlimited_is_ok_with_everything_left() {
    for under in services(&[UNLIMITED], Options::default()) {
        for _ in 0..3 {
            let req = request(
                "some_domain",
                vec![descriptor(&[("foo", "x")]), descriptor(&[("bar", "x")])],
                1,
            );
            let r = ask(&under, req).await;
            assert_eq!(r.overall_code, OK);
            let got: Vec<_> = r.statuses.iter().map(brief).collect();
            assert_eq!(
                got,
                [(OK, 0, 0, u32::MAX), (OK, 0, 0, 0)],
                "{}",
                under.store
            );
        }
        assert_eq!(under.stats.get("some_domain.foo", Counter::TotalHits), 0);
    }
}

const QUOTA: &str = "
domain: quota
descriptors:
  - key: q1
    quota_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: q2
    quota_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: q_shadow
    quota_mode: true
    shadow_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: rate
    rate_limit:
      unit: minute
      requests_per_unit: 1
";

/// Spends the key's one request of the minute.
async fn spend(under: &Under, key: &str, value: &str) {
    ask(
        under,
        request("quota", vec![descriptor(&[(key, value)])], 1),
    )
    .await;
}

#[tokio::test]
async fn quota_mode_refuses_only_when_every_quota_is_over() {
    clear_of_window_end(60).await;
    for under in services(&[QUOTA], Options::default()) {
        let v = unique();
        let both = || {
            request(
                "quota",
                vec![descriptor(&[("q1", &v)]), descriptor(&[("q2", &v)])],
                1,
            )
        };
        // q1 spent, q2 not: one quota over of two is OK
        spend(&under, "q1", &v).await;
        let r = ask(&under, both()).await;
        assert_eq!(r.overall_code, OK, "{}: some over", under.store);
        let codes: Vec<i32> = r.statuses.iter().map(|s| s.code).collect();
        assert_eq!(codes, [OVER, OK]);
        // both over: OVER_LIMIT
        let r = ask(&under, both()).await;
        assert_eq!(r.overall_code, OVER, "{}: all over", under.store);
        // a quota over, another within, a rate limit within: OK; the next
        // time the rate limit is over: OVER (whatever the quotas say)
        let w = unique();
        let mixed = || {
            request(
                "quota",
                vec![
                    descriptor(&[("q1", &v)]),
                    descriptor(&[("q2", &w)]),
                    descriptor(&[("rate", &w)]),
                ],
                1,
            )
        };
        let r = ask(&under, mixed()).await;
        assert_eq!(r.overall_code, OK, "{}: mixed, rate within", under.store);
        let r = ask(&under, mixed()).await;
        assert_eq!(r.overall_code, OVER, "{}: mixed, rate over", under.store);
        // the only quota over beside a rate limit within: every quota is
        // over, OVER_LIMIT
        let x = unique();
        spend(&under, "q1", &x).await;
        let alone = request(
            "quota",
            vec![descriptor(&[("q1", &x)]), descriptor(&[("rate", &x)])],
            1,
        );
        assert_eq!(
            ask(&under, alone).await.overall_code,
            OVER,
            "{}",
            under.store
        );
        // a quota in shadow mode over is never over
        spend(&under, "q_shadow", &v).await;
        let shadow = request("quota", vec![descriptor(&[("q_shadow", &v)])], 1);
        assert_eq!(ask(&under, shadow).await.overall_code, OK);
    }
}

#[tokio::test]
async fn quota_mode_globally_makes_every_rule_a_quota() {
    let options = Options {
        quota_mode: true,
        ..Options::default()
    };
    clear_of_window_end(60).await;
    for under in services(&[QUOTA], options) {
        let v = unique();
        spend(&under, "rate", &v).await;
        let mixed = request(
            "quota",
            vec![descriptor(&[("rate", &v)]), descriptor(&[("q1", &v)])],
            1,
        );
        // `rate` over is a quota over; q1 within: OK
        assert_eq!(ask(&under, mixed).await.overall_code, OK, "{}", under.store);
    }
}

const METADATA: &str = "
domain: meta
descriptors:
  - key: a
    metadata:
      team: alpha
      nested:
        x: 1
    rate_limit:
      unit: minute
      requests_per_unit: 5
  - key: b
    metadata:
      team: beta
      nested:
        y: 2
    rate_limit:
      unit: minute
      requests_per_unit: 1
";

#[tokio::test]
async fn dynamic_metadata_describes_the_request_and_passed_rules() {
    use prost_types::value::Kind;
    let options = Options {
        dynamic_metadata: true,
        ..Options::default()
    };
    clear_of_window_end(60).await;
    for under in services(&[METADATA], options) {
        let v = unique();
        let mut second = descriptor(&[("b", &v)]);
        second.hits_addend = Some(1);
        let req = request("meta", vec![descriptor(&[("a", &v)]), second], 3);
        let r = ask(&under, req).await;
        let meta = r.dynamic_metadata.expect("dynamic metadata");
        let field = |name: &str| meta.fields.get(name).and_then(|v| v.kind.clone());
        assert_eq!(field("domain"), Some(Kind::StringValue("meta".into())));
        assert_eq!(field("hitsAddend"), Some(Kind::NumberValue(3.0)));
        let Some(Kind::ListValue(descriptors)) = field("descriptors") else {
            panic!("descriptors")
        };
        assert_eq!(descriptors.values.len(), 2);
        // a (3 of 5) and b (1 of 1) passed: both rules' metadata, the first
        // value kept for `team`, the nested objects merged
        let Some(Kind::StructValue(found)) = field("metadata") else {
            panic!("{}: metadata of the passed rules", under.store)
        };
        let team = found.fields.get("team").and_then(|v| v.kind.clone());
        assert_eq!(team, Some(Kind::StringValue("alpha".into())));
        let Some(Kind::StructValue(nested)) =
            found.fields.get("nested").and_then(|v| v.kind.clone())
        else {
            panic!("nested")
        };
        assert_eq!(nested.fields.len(), 2, "{}", under.store);
    }
    for under in services(&[METADATA], Options::default()) {
        let r = ask(&under, request("meta", vec![descriptor(&[("a", "q")])], 1)).await;
        assert_eq!(r.dynamic_metadata, None);
    }
}

const REPLACES: &str = "
domain: replaces
descriptors:
  - key: general
    rate_limit:
      name: general
      unit: minute
      requests_per_unit: 1
  - key: special
    rate_limit:
      unit: minute
      requests_per_unit: 100
      replaces:
        - name: general
";

#[tokio::test]
async fn a_replaced_limit_is_not_applied() {
    clear_of_window_end(60).await;
    for under in services(&[REPLACES], Options::default()) {
        let v = unique();
        let req = || {
            request(
                "replaces",
                vec![
                    descriptor(&[("general", &v)]),
                    descriptor(&[("special", &v)]),
                ],
                1,
            )
        };
        for _ in 0..3 {
            let r = ask(&under, req()).await;
            assert_eq!(r.overall_code, OK, "{}", under.store);
            assert_eq!(r.statuses[0].current_limit, None, "general replaced");
        }
        // alone, `general` applies
        let alone = request("replaces", vec![descriptor(&[("general", &v)])], 1);
        assert_eq!(ask(&under, alone.clone()).await.overall_code, OK);
        assert_eq!(ask(&under, alone).await.overall_code, OVER);
    }
}

#[tokio::test]
async fn hits_addend_of_the_request_and_of_a_descriptor() {
    clear_of_window_end(60).await;
    for under in services(&[ANOTHER], Options::default()) {
        let v = unique();
        // the request's 5 for every descriptor
        let r = ask(
            &under,
            request("another", vec![descriptor(&[("key2", &v)])], 5),
        )
        .await;
        assert_eq!(
            brief(&r.statuses[0]),
            (OK, 20, MINUTE, 15),
            "{}",
            under.store
        );
        // a descriptor's own 0: a check that takes nothing
        let mut check = descriptor(&[("key2", &v)]);
        check.hits_addend = Some(0);
        let r = ask(&under, request("another", vec![check.clone()], 5)).await;
        assert_eq!(
            brief(&r.statuses[0]),
            (OK, 20, MINUTE, 15),
            "{}",
            under.store
        );
        // a descriptor's own 16: 21 > 20, over, and counted
        let mut big = descriptor(&[("key2", &v)]);
        big.hits_addend = Some(16);
        let r = ask(&under, request("another", vec![big], 1)).await;
        assert_eq!(
            brief(&r.statuses[0]),
            (OVER, 20, MINUTE, 0),
            "{}",
            under.store
        );
        // the check now finds it over (21 > 20)
        let r = ask(&under, request("another", vec![check], 1)).await;
        assert_eq!(r.overall_code, OVER, "{}", under.store);
        assert_eq!(under.stats.get("another.key2", Counter::TotalHits), 5 + 16);
    }
}

#[tokio::test]
async fn an_override_limit_from_the_request() {
    clear_of_window_end(60).await;
    for under in services(&[ANOTHER], Options::default()) {
        let v = unique();
        let mut d = descriptor(&[("anything", &v), ("sub", "x")]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 2,
            unit: MINUTE,
        });
        let mut seen = Vec::new();
        for _ in 0..3 {
            let r = ask(&under, request("another", vec![d.clone()], 1)).await;
            seen.push(brief(&r.statuses[0]));
        }
        assert_eq!(
            seen,
            [(OK, 2, MINUTE, 1), (OK, 2, MINUTE, 0), (OVER, 2, MINUTE, 0)],
            "{}",
            under.store
        );
        let key = format!("another.anything_{v}.sub_x");
        assert_eq!(
            under.stats.get(&key, Counter::OverLimit),
            1,
            "{}",
            under.store
        );
        // an unknown unit is refused
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 2,
            unit: 0,
        });
        let e = under
            .service
            .should_rate_limit(request("another", vec![d], 1))
            .await;
        assert!(matches!(e, Err(ServiceError::InvalidArgument(_))));
        // distinct overrides: any number, each decided
        for n in 1..50 {
            let mut d = descriptor(&[("n", &n.to_string())]);
            d.limit = Some(RateLimitOverride {
                requests_per_unit: n,
                unit: HOUR,
            });
            let r = ask(&under, request("another", vec![d], 1)).await;
            assert_eq!(brief(&r.statuses[0]), (OK, n, HOUR, n - 1));
        }
    }
}

#[tokio::test]
async fn negative_hits_give_back() {
    clear_of_window_end(60).await;
    for under in services(&[ANOTHER], Options::default()) {
        let v = unique();
        ask(
            &under,
            request("another", vec![descriptor(&[("key2", &v)])], 20),
        )
        .await;
        let r = ask(
            &under,
            request("another", vec![descriptor(&[("key2", &v)])], 1),
        )
        .await;
        assert_eq!(r.overall_code, OVER, "{}", under.store);
        // 21 counted; give back 6: 15, 5 left
        let mut refund = descriptor(&[("key2", &v)]);
        refund.hits_addend = Some(6);
        refund.is_negative_hits = true;
        let r = ask(&under, request("another", vec![refund], 1)).await;
        assert_eq!(
            brief(&r.statuses[0]),
            (OK, 20, MINUTE, 5),
            "{}",
            under.store
        );
    }
}

#[tokio::test]
async fn near_limit_is_counted_past_the_ratio() {
    clear_of_window_end(60).await;
    for under in services(&[ANOTHER], Options::default()) {
        let v = unique();
        // 20 per minute, ratio 0.8: near past 16; 18 hits one by one:
        // the 17th and 18th are near
        for _ in 0..18 {
            ask(
                &under,
                request("another", vec![descriptor(&[("key2", &v)])], 1),
            )
            .await;
        }
        let stats = &under.stats;
        assert_eq!(
            stats.get("another.key2", Counter::NearLimit),
            2,
            "{}",
            under.store
        );
        assert_eq!(stats.get("another.key2", Counter::WithinLimit), 18);
        // one request of 2 more (19, 20): both near
        ask(
            &under,
            request("another", vec![descriptor(&[("key2", &v)])], 2),
        )
        .await;
        assert_eq!(
            stats.get("another.key2", Counter::NearLimit),
            4,
            "{}",
            under.store
        );
    }
}

const TOWER: &str = "
domain: tower
tower_ratelimit: {}
descriptors:
  - key: user
    rate_limit:
      unit: minute
      requests_per_unit: 2
  - key: path
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: bucket
    rate_limit:
      unit: second
      requests_per_unit: 1
      tower_ratelimit:
        algorithm: token_bucket
        burst: 3
  - key: watched
    shadow_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
";

#[tokio::test]
async fn crate_mode_decides_all_or_nothing() {
    clear_of_window_end(60).await;
    for under in services(&[TOWER], Options::default()) {
        let v = unique();
        let req = || {
            request(
                "tower",
                vec![descriptor(&[("user", &v)]), descriptor(&[("path", &v)])],
                1,
            )
        };
        let mut seen = Vec::new();
        for _ in 0..4 {
            let r = ask(&under, req()).await;
            seen.push((
                r.overall_code,
                r.statuses.iter().map(brief).collect::<Vec<_>>(),
            ));
        }
        // user 2/min refuses the third; the denial takes nothing from path
        assert_eq!(
            seen,
            [
                (OK, vec![(OK, 2, MINUTE, 1), (OK, 10, MINUTE, 9)]),
                (OK, vec![(OK, 2, MINUTE, 0), (OK, 10, MINUTE, 8)]),
                (OVER, vec![(OVER, 2, MINUTE, 0), (OK, 10, MINUTE, 8)]),
                (OVER, vec![(OVER, 2, MINUTE, 0), (OK, 10, MINUTE, 8)]),
            ],
            "{}",
            under.store
        );
        // a token bucket of burst 3: three at once, the fourth refused
        let bucket = || request("tower", vec![descriptor(&[("bucket", &v)])], 1);
        let mut codes = Vec::new();
        for _ in 0..4 {
            codes.push(ask(&under, bucket()).await.overall_code);
        }
        assert_eq!(codes, [OK, OK, OK, OVER], "{}", under.store);
        // a rule in shadow mode over refuses nothing, and takes its hits
        // whatever the others say
        let w = unique();
        let watched = || {
            request(
                "tower",
                vec![descriptor(&[("watched", &w)]), descriptor(&[("path", &w)])],
                1,
            )
        };
        let mut seen = Vec::new();
        for _ in 0..2 {
            let r = ask(&under, watched()).await;
            seen.push((
                r.overall_code,
                r.statuses.iter().map(brief).collect::<Vec<_>>(),
            ));
        }
        assert_eq!(
            seen,
            [
                (OK, vec![(OK, 1, MINUTE, 0), (OK, 10, MINUTE, 9)]),
                (OK, vec![(OK, 1, MINUTE, 0), (OK, 10, MINUTE, 8)]),
            ],
            "{}",
            under.store
        );
        assert_eq!(under.stats.get("tower.watched", Counter::ShadowMode), 1);
    }
}

/// The service behind tonic's transport, called by the crate's client: its
/// answers and its errors as gRPC statuses.
#[tokio::test]
async fn the_service_answers_over_grpc() {
    use tower_ratelimit_server::proto::{RateLimitServiceClient, RateLimitServiceServer};
    let (_tx, rx) = watch::channel(config(&[BASIC]));
    let service = Service::new(
        MemoryStore::new(),
        rx,
        Options::default(),
        Arc::new(Counts::default()),
    )
    .expect("service");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RateLimitServiceServer::new(service))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let mut client = RateLimitServiceClient::connect(format!("http://{address}"))
        .await
        .expect("connect");
    clear_of_window_end(60).await;
    let v = unique();
    let req = || request("basic", vec![descriptor(&[("one_per_minute", &v)])], 0);
    let first = client.should_rate_limit(req()).await.expect("answer");
    assert_eq!(first.get_ref().overall_code, OK);
    let second = client.should_rate_limit(req()).await.expect("answer");
    assert_eq!(second.get_ref().overall_code, OVER);
    assert_eq!(brief(&second.get_ref().statuses[0]), (OVER, 1, MINUTE, 0));
    let refused = client
        .should_rate_limit(request("", vec![], 0))
        .await
        .expect_err("an empty domain");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert_eq!(refused.message(), EMPTY_DOMAIN);
    server.abort();
}
