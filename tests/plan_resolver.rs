//! Rules whose key and tier come from an async lookup (`PlanResolver`):
//! through the layer on an axum router, over the memory store and a real
//! Redis. The lookup is the test's own directory of API keys, counting its
//! calls; failures and slow lookups are made by the directory itself.

mod common;
mod events;

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use common::{redis_store, unique_prefix};
use events::Events;
use http::{HeaderName, Request, StatusCode};
use tower::ServiceExt;
use tower_ratelimit::key::Header;
use tower_ratelimit::layer::{
    MissingKey, OnLookupError, Plan, PlanResolver, PlanResolverBuilder, RateLimitLayer, Rejection,
    Rule,
};
use tower_ratelimit::{ConfigError, Limit, Quota};

/// `n` requests per minute, all at once.
fn per_minute(n: u64) -> Quota {
    Quota::per_minute(n).allow_burst(n).gcra()
}

fn limit(name: &str, quota: Quota) -> Limit {
    Limit::new(name, quota).expect("valid limit")
}

fn api_key() -> Header {
    Header::new(HeaderName::from_static("x-api-key"))
}

/// The test's directory: API key -> plan. `a1` and `a2` belong to acme
/// (default tier), `b` to globex (pro), `g` to initech (a tier no rule
/// has), `slow` answers after 5 s, `broken` fails, `nameless` answers a
/// plan whose key is empty; anything else is unknown.
async fn directory(api_key: Vec<u8>) -> Result<Option<Plan>, io::Error> {
    match api_key.as_slice() {
        b"a1" | b"a2" => Ok(Some(Plan::new("acme"))),
        b"b" => Ok(Some(Plan::new("globex").with_tier("pro"))),
        b"g" => Ok(Some(Plan::new("initech").with_tier("gold"))),
        b"slow" => {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok(Some(Plan::new("slowpoke")))
        }
        b"broken" => Err(io::Error::other("directory unavailable")),
        b"nameless" => Ok(Some(Plan::new(""))),
        _ => Ok(None),
    }
}

/// A resolver over [`directory`] that counts its lookups in `calls`.
fn counted(calls: &Arc<AtomicUsize>) -> PlanResolverBuilder {
    let calls = calls.clone();
    PlanResolver::builder(api_key(), move |key: Vec<u8>| {
        calls.fetch_add(1, Ordering::SeqCst);
        directory(key)
    })
}

fn app(rules: impl IntoIterator<Item = Rule>) -> Router {
    let layer = rules
        .into_iter()
        .fold(RateLimitLayer::builder(), |layer, rule| layer.rule(rule))
        .build()
        .expect("layer");
    Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(layer)
}

/// The status of a request with `x-api-key: key` (none for `None`), and
/// whether it was rate-limited (has a `RateLimit` header).
async fn send(app: &Router, key: Option<&str>) -> (StatusCode, bool) {
    let mut request = Request::get("/");
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    let request = request.body(Body::empty()).expect("request");
    // (a bound on a hung request, not a measurement)
    let response = tokio::time::timeout(Duration::from_secs(30), app.clone().oneshot(request))
        .await
        .expect("the request is answered")
        .expect("infallible");
    (
        response.status(),
        response.headers().contains_key("ratelimit"),
    )
}

fn calls_of(calls: &Arc<AtomicUsize>) -> usize {
    calls.load(Ordering::SeqCst)
}

#[tokio::test]
async fn the_plan_decides_the_key_and_the_tier() {
    let events = Events::capture();
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls).build().expect("resolver");
    let app =
        app([Rule::resolved(limit("reports", per_minute(2)), plans).tier("pro", per_minute(5))]);
    // a1 and a2 are acme's: one limit of 2
    assert_eq!(send(&app, Some("a1")).await, (StatusCode::OK, true));
    assert_eq!(send(&app, Some("a2")).await, (StatusCode::OK, true));
    assert_eq!(
        send(&app, Some("a1")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&app, Some("a2")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // globex is on pro: 5
    for _ in 0..5 {
        assert_eq!(send(&app, Some("b")).await.0, StatusCode::OK);
    }
    assert_eq!(send(&app, Some("b")).await.0, StatusCode::TOO_MANY_REQUESTS);
    // initech's tier "gold" is not one of the rule's: the default (2)
    assert_eq!(send(&app, Some("g")).await.0, StatusCode::OK);
    assert_eq!(send(&app, Some("g")).await.0, StatusCode::OK);
    assert_eq!(send(&app, Some("g")).await.0, StatusCode::TOO_MANY_REQUESTS);
    // each API key looked up once
    assert_eq!(calls_of(&calls), 4);
    // the unknown tier is logged, once
    let unknown_tier: Vec<String> = events
        .warnings()
        .into_iter()
        .filter(|line| line.contains("gold"))
        .collect();
    assert_eq!(unknown_tier.len(), 1, "{unknown_tier:?}");
}

#[tokio::test]
async fn a_cached_plan_is_looked_up_again_only_after_its_ttl() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls)
        .ttl(Duration::from_millis(500))
        .build()
        .expect("resolver");
    let app = app([Rule::resolved(limit("api", per_minute(100)), plans.clone())]);
    assert_eq!(send(&app, Some("a1")).await.0, StatusCode::OK);
    assert_eq!(send(&app, Some("a1")).await.0, StatusCode::OK);
    assert_eq!(
        calls_of(&calls),
        1,
        "the second request is answered from the cache"
    );
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(send(&app, Some("a1")).await.0, StatusCode::OK);
    assert_eq!(
        calls_of(&calls),
        2,
        "after the TTL the key is looked up again"
    );
    // invalidated: looked up again at once
    plans.invalidate(b"a1").await;
    assert_eq!(send(&app, Some("a1")).await.0, StatusCode::OK);
    assert_eq!(calls_of(&calls), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_for_an_uncached_key_make_one_lookup() {
    let calls = Arc::new(AtomicUsize::new(0));
    let slow_calls = calls.clone();
    // a lookup that takes a while, so that every request arrives during it
    let plans = PlanResolver::builder(api_key(), move |key: Vec<u8>| {
        slow_calls.fetch_add(1, Ordering::SeqCst);
        async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            directory(key).await
        }
    })
    .timeout(Duration::from_secs(20))
    .build()
    .expect("resolver");
    let app = app([Rule::resolved(limit("api", per_minute(100)), plans)]);
    let requests: Vec<_> = (0..32)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, Some("a1")).await })
        })
        .collect();
    for request in requests {
        assert_eq!(request.await.expect("task").0, StatusCode::OK);
    }
    assert_eq!(calls_of(&calls), 1);
}

#[tokio::test]
async fn an_unknown_key_is_cached_as_unknown_and_has_no_key() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls)
        .unknown_ttl(Duration::from_millis(500))
        .build()
        .expect("resolver");
    let rejecting = app([Rule::resolved(limit("api", per_minute(100)), plans.clone())]);
    for _ in 0..5 {
        assert_eq!(
            send(&rejecting, Some("made-up")).await,
            (StatusCode::BAD_REQUEST, false)
        );
    }
    assert_eq!(
        calls_of(&calls),
        1,
        "a flood of one unknown key costs one lookup"
    );
    // the rule's own policy applies, as to a request without a key
    let skipping =
        app(
            [
                Rule::resolved(limit("api", per_minute(100)), plans)
                    .on_missing_key(MissingKey::Skip),
            ],
        );
    assert_eq!(
        send(&skipping, Some("made-up")).await,
        (StatusCode::OK, false)
    );
    assert_eq!(send(&skipping, None).await, (StatusCode::OK, false));
    assert_eq!(calls_of(&calls), 1);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(send(&skipping, Some("made-up")).await.0, StatusCode::OK);
    assert_eq!(calls_of(&calls), 2, "unknown keys expire too");
}

/// The response to a request with `x-api-key: key`.
async fn respond(app: &Router, key: &str) -> http::Response<Body> {
    let request = Request::get("/")
        .header("x-api-key", key)
        .body(Body::empty())
        .expect("request");
    // (a bound on a hung request, not a measurement)
    tokio::time::timeout(Duration::from_secs(30), app.clone().oneshot(request))
        .await
        .expect("the request is answered")
        .expect("infallible")
}

/// A lookup that fails or times out is an outage of the directory, not an
/// unknown key: 503 with `Retry-After` (the layer's store-failure answer),
/// never the 400 of an unknown key, never cached. An unknown key stays a
/// missing key.
#[tokio::test]
async fn a_failed_or_slow_lookup_is_503_not_an_unknown_key() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls)
        .timeout(Duration::from_millis(100))
        .build()
        .expect("resolver");
    let failing = &app([Rule::resolved(limit("api", per_minute(100)), plans)]);
    for key in ["broken", "slow", "broken"] {
        let response = respond(failing, key).await;
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "{key}");
        assert_eq!(response.headers()["retry-after"], "1", "{key}");
        assert!(!response.headers().contains_key("ratelimit"), "{key}");
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .expect("body");
        let body = String::from_utf8_lossy(&body);
        assert!(!body.contains("directory unavailable"), "{body}");
    }
    assert_eq!(calls_of(&calls), 3, "failures are not cached");
    // an unknown key is still no key (400), and a known one is served
    assert_eq!(
        send(failing, Some("made-up")).await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(send(failing, Some("a1")).await, (StatusCode::OK, true));
    // the wait is the policy's, rounded up to whole seconds
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls)
        .on_lookup_error(OnLookupError::FailClosed {
            retry_after: Duration::from_millis(4_500),
        })
        .build()
        .expect("resolver");
    let waiting = app([Rule::resolved(limit("api", per_minute(100)), plans)]);
    let response = respond(&waiting, "broken").await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["retry-after"], "5");
}

/// A custom rejection handler is told the lookup failed, and which limit.
#[tokio::test]
async fn a_rejection_handler_sees_the_failed_lookup() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls).build().expect("resolver");
    let layer = RateLimitLayer::builder()
        .rule(Rule::resolved(limit("api", per_minute(100)), plans))
        .on_rejection(|why: &Rejection<'_>| {
            let text = match why {
                Rejection::LookupFailed { limit } => format!("lookup failed for {limit}"),
                _ => "other".to_owned(),
            };
            let mut response = http::Response::new(http_body_util::Full::from(text));
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            response
        })
        .build()
        .expect("layer");
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(layer);
    let response = respond(&app, "broken").await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = axum::body::to_bytes(response.into_body(), 4096)
        .await
        .expect("body");
    assert_eq!(body, "lookup failed for api");
}

/// A shadow limit never refuses: a failed lookup for it is no key; a limit
/// keyed by the same lookup that is not shadow answers 503.
#[tokio::test]
async fn a_failed_lookup_for_a_shadow_limit_refuses_nothing() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls).build().expect("resolver");
    let watched = app([Rule::resolved(limit("api", per_minute(1)).shadow(), plans)
        .on_missing_key(MissingKey::Skip)]);
    for _ in 0..3 {
        assert_eq!(send(&watched, Some("broken")).await.0, StatusCode::OK);
    }
    assert_eq!(calls_of(&calls), 3);
    // a limit that is not shadow, keyed by the same lookup, still refuses:
    // in the same layer, and in an inner layer (which asks no second time)
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls).build().expect("resolver");
    let shadow = || {
        Rule::resolved(limit("watched", per_minute(1)).shadow(), plans.clone())
            .on_missing_key(MissingKey::Skip)
    };
    let one_layer = app([
        shadow(),
        Rule::resolved(limit("enforced", per_minute(100)), plans.clone()),
    ]);
    let (status, _) = send(&one_layer, Some("broken")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(calls_of(&calls), 1);
    let layer = |rule: Rule| RateLimitLayer::builder().rule(rule).build().expect("layer");
    let nested = Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(layer(Rule::resolved(
            limit("enforced", per_minute(100)),
            plans.clone(),
        )))
        .layer(layer(shadow()));
    let (status, _) = send(&nested, Some("broken")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(calls_of(&calls), 2, "one lookup for both layers");
}

/// With `OnLookupError::MissingKey`, a failed lookup has no key: the
/// rule's missing-key policy applies (400, or shared, or skipped).
#[tokio::test]
async fn a_failed_lookup_is_not_cached_and_has_no_key_when_chosen() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls)
        .on_lookup_error(OnLookupError::MissingKey)
        .build()
        .expect("resolver");
    let rejecting = app([Rule::resolved(limit("api", per_minute(100)), plans.clone())]);
    assert_eq!(
        send(&rejecting, Some("broken")).await,
        (StatusCode::BAD_REQUEST, false)
    );
    assert_eq!(
        send(&rejecting, Some("broken")).await,
        (StatusCode::BAD_REQUEST, false)
    );
    assert_eq!(calls_of(&calls), 2, "a failure is not cached");
    // a shared keyless limit counts them together
    let shared = app([Rule::resolved(limit("api", per_minute(1)), plans)
        .on_missing_key(MissingKey::Shared("anonymous".into()))]);
    assert_eq!(send(&shared, Some("broken")).await, (StatusCode::OK, true));
    assert_eq!(
        send(&shared, Some("broken")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // a known client is not in the keyless limit
    assert_eq!(send(&shared, Some("a1")).await.0, StatusCode::OK);
}

#[tokio::test]
async fn a_lookup_slower_than_the_timeout_has_no_key_when_chosen() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls)
        .timeout(Duration::from_millis(100))
        .on_lookup_error(OnLookupError::MissingKey)
        .build()
        .expect("resolver");
    let rejecting = app([Rule::resolved(limit("api", per_minute(100)), plans.clone())]);
    assert_eq!(
        send(&rejecting, Some("slow")).await,
        (StatusCode::BAD_REQUEST, false)
    );
    let skipping =
        app(
            [
                Rule::resolved(limit("api", per_minute(100)), plans)
                    .on_missing_key(MissingKey::Skip),
            ],
        );
    assert_eq!(send(&skipping, Some("slow")).await, (StatusCode::OK, false));
    assert_eq!(calls_of(&calls), 2, "a timed-out lookup is not cached");
}

#[tokio::test]
async fn invented_keys_cannot_grow_the_cache_beyond_its_bound() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls).max_entries(100).build().expect("resolver");
    let app = app([Rule::resolved(limit("api", per_minute(100)), plans.clone())]);
    for i in 0..3_000 {
        let key = format!("invented-{i}");
        assert_eq!(send(&app, Some(&key)).await.0, StatusCode::BAD_REQUEST);
    }
    assert_eq!(calls_of(&calls), 3_000);
    let cached = plans.cached().await;
    assert!(cached <= 100, "{cached} entries cached");
    // a real client still gets its plan
    assert_eq!(send(&app, Some("a1")).await.0, StatusCode::OK);
}

#[tokio::test]
async fn an_oversized_lookup_key_is_not_looked_up() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls).build().expect("resolver");
    let app = app([Rule::resolved(limit("api", per_minute(100)), plans.clone())]);
    let longest = "k".repeat(256);
    assert_eq!(send(&app, Some(&longest)).await.0, StatusCode::BAD_REQUEST);
    assert_eq!(calls_of(&calls), 1, "256 bytes are looked up");
    let oversized = "k".repeat(257);
    for _ in 0..3 {
        assert_eq!(
            send(&app, Some(&oversized)).await.0,
            StatusCode::BAD_REQUEST
        );
    }
    assert_eq!(calls_of(&calls), 1, "257 bytes are not");
    assert_eq!(plans.cached().await, 1, "nor cached");
    // an empty key is no key either
    assert_eq!(send(&app, Some("")).await.0, StatusCode::BAD_REQUEST);
    assert_eq!(calls_of(&calls), 1);
}

#[tokio::test]
async fn failed_lookups_are_logged_once_per_interval_without_their_keys() {
    let events = Events::capture();
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls)
        .error_log_interval(Duration::from_secs(3600))
        .build()
        .expect("resolver");
    let app = app([Rule::resolved(limit("api", per_minute(100)), plans)]);
    for _ in 0..20 {
        assert_eq!(
            send(&app, Some("broken")).await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    assert_eq!(calls_of(&calls), 20);
    let warnings: Vec<String> = events
        .warnings()
        .into_iter()
        .filter(|line| line.contains("plan lookup"))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("directory unavailable") && warnings[0].contains("503"),
        "{warnings:?}"
    );
    assert!(
        !warnings[0].contains("broken"),
        "the key is not logged: {warnings:?}"
    );
}

#[tokio::test]
async fn rules_sharing_a_resolver_look_each_key_up_once() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls).build().expect("resolver");
    let shared = app([
        Rule::resolved(limit("larger", per_minute(3)), plans.clone()),
        Rule::resolved(limit("smaller", per_minute(2)), plans.clone()),
    ]);
    assert_eq!(send(&shared, Some("a1")).await.0, StatusCode::OK);
    assert_eq!(send(&shared, Some("a2")).await.0, StatusCode::OK);
    assert_eq!(
        send(&shared, Some("a1")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(calls_of(&calls), 2);
    // a rule a request is exempt from does not look its key up
    let exempt_calls = Arc::new(AtomicUsize::new(0));
    let exempt = app([Rule::resolved(
        limit("api", per_minute(3)),
        counted(&exempt_calls).build().expect("resolver"),
    )
    .skip_if(|request| request.uri.query() == Some("free"))]);
    let request = Request::get("/?free")
        .header("x-api-key", "a1")
        .body(Body::empty())
        .expect("request");
    let response = exempt.oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(calls_of(&exempt_calls), 0);
}

#[test]
fn misconfigurations_are_build_errors() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = || counted(&calls).build().expect("resolver");
    // the tier comes from the plan: choose_tier cannot choose it too
    let err = RateLimitLayer::builder()
        .rule(
            Rule::resolved(limit("api", per_minute(2)), plans())
                .tier("pro", per_minute(5))
                .choose_tier(|_| Some("pro")),
        )
        .build()
        .expect_err("two ways to choose a tier");
    assert!(matches!(err, ConfigError::Tiers(_)), "{err}");
    // tiers without choose_tier are the plans' to choose; no tiers are fine
    for rule in [
        Rule::resolved(limit("api", per_minute(2)), plans()).tier("pro", per_minute(5)),
        Rule::resolved(limit("api", per_minute(2)), plans()),
    ] {
        RateLimitLayer::builder().rule(rule).build().expect("valid");
    }
    // a tier of another algorithm is still refused
    let err = RateLimitLayer::builder()
        .rule(
            Rule::resolved(limit("api", per_minute(2)), plans())
                .tier("pro", Quota::per_minute(5).fixed_window()),
        )
        .build()
        .expect_err("another algorithm");
    assert!(matches!(err, ConfigError::Tiers(_)), "{err}");
    for builder in [
        counted(&calls).timeout(Duration::ZERO),
        counted(&calls).timeout(Duration::from_secs(2 * 3600)),
        counted(&calls).max_entries(0),
        counted(&calls).max_key_len(0),
    ] {
        let err = builder.build().expect_err("invalid resolver");
        assert!(matches!(err, ConfigError::Layer(_)), "{err}");
    }
}

#[tokio::test]
async fn two_instances_over_redis_share_a_tenant_limit() {
    let prefix = unique_prefix("plan-resolver");
    let calls = Arc::new(AtomicUsize::new(0));
    // two instances, each with its own resolver (and cache), one Redis
    let instance = || {
        let layer = RateLimitLayer::builder()
            .store(redis_store(&prefix))
            .rule(
                Rule::resolved(
                    limit("reports", per_minute(2)),
                    counted(&calls).build().expect("resolver"),
                )
                .tier("pro", per_minute(4)),
            )
            .build()
            .expect("layer");
        Router::new()
            .route("/", get(|| async { "hi" }))
            .layer(layer)
    };
    let (one, two) = (instance(), instance());
    assert_eq!(send(&one, Some("a1")).await, (StatusCode::OK, true));
    assert_eq!(send(&two, Some("a2")).await, (StatusCode::OK, true));
    assert_eq!(
        send(&one, Some("a2")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&two, Some("a1")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    for app in [&one, &two, &one, &two] {
        assert_eq!(send(app, Some("b")).await.0, StatusCode::OK);
    }
    assert_eq!(send(&one, Some("b")).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(send(&two, Some("unknown")).await.0, StatusCode::BAD_REQUEST);
    // per instance: a1, a2, b (and the unknown key on the second)
    assert_eq!(calls_of(&calls), 7);
}

/// A plan whose key is empty gives the request no key: the rule's
/// missing-key policy applies (400 by default; skipped with
/// `MissingKey::Skip`), and no empty key is decided. Before, every such
/// request was counted under one empty key.
#[tokio::test]
async fn a_plan_with_an_empty_key_gets_the_missing_key_policy() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls).build().expect("resolver");
    let rejecting = app([Rule::resolved(limit("api", per_minute(1)), plans.clone())]);
    for _ in 0..3 {
        assert_eq!(
            send(&rejecting, Some("nameless")).await,
            (StatusCode::BAD_REQUEST, false)
        );
    }
    let skipping =
        app([Rule::resolved(limit("api", per_minute(1)), plans).on_missing_key(MissingKey::Skip)]);
    for _ in 0..3 {
        assert_eq!(
            send(&skipping, Some("nameless")).await,
            (StatusCode::OK, false)
        );
    }
}

/// The handler is handed what was resolved, as an extension: the app never
/// looks the key up again. With several resolvers, `found_in` asks each.
#[tokio::test]
async fn the_handler_is_handed_the_plan_it_was_limited_by() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls).build().expect("resolver");
    // a second resolver, by another header: the user's own plan
    let users = PlanResolver::builder(
        Header::new(HeaderName::from_static("x-user")),
        |user: Vec<u8>| async move { Ok::<_, io::Error>(Some(Plan::new(user).with_tier("seat"))) },
    )
    .build()
    .expect("resolver");
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::resolved(limit("tenant", per_minute(100)), plans.clone())
                .tier("pro", per_minute(100)),
        )
        .rule(
            Rule::resolved(limit("user", per_minute(100)), users.clone())
                .on_missing_key(MissingKey::Skip),
        )
        .build()
        .expect("layer");
    let (for_tenant, for_user) = (plans.clone(), users.clone());
    let app = Router::new()
        .route(
            "/",
            get(
                move |axum::Extension(plan): axum::Extension<Plan>,
                      request: Request<Body>| async move {
                    let tenant = for_tenant.found_in(request.extensions()).cloned();
                    let user = for_user.found_in(request.extensions()).cloned();
                    // the extension is the first resolved rule's plan
                    assert_eq!(Some(&plan), tenant.as_ref());
                    format!(
                        "{} {} {}",
                        String::from_utf8_lossy(plan.key()),
                        plan.tier().unwrap_or("-"),
                        user.map_or("-".to_owned(), |user| String::from_utf8_lossy(user.key())
                            .into_owned()),
                    )
                },
            ),
        )
        .layer(layer);
    let body_of = |key: &'static str, user: Option<&'static str>| {
        let app = app.clone();
        async move {
            let mut request = Request::get("/").header("x-api-key", key);
            if let Some(user) = user {
                request = request.header("x-user", user);
            }
            let response = app
                .oneshot(request.body(Body::empty()).expect("request"))
                .await
                .expect("infallible");
            assert_eq!(response.status(), StatusCode::OK);
            let body = axum::body::to_bytes(response.into_body(), 4096)
                .await
                .expect("body");
            String::from_utf8_lossy(&body).into_owned()
        }
    };
    assert_eq!(body_of("b", Some("ann")).await, "globex pro ann");
    assert_eq!(body_of("a1", None).await, "acme - -");
    assert_eq!(body_of("a2", Some("bob")).await, "acme - bob");
    // one lookup per API key, none by the handler
    assert_eq!(calls_of(&calls), 3);
    // a request with no plan: the handler takes `Option<Extension<Plan>>`
    let skipping = RateLimitLayer::builder()
        .rule(Rule::resolved(limit("api", per_minute(100)), plans).on_missing_key(MissingKey::Skip))
        .build()
        .expect("layer");
    let app = Router::new()
        .route(
            "/",
            get(|plan: Option<axum::Extension<Plan>>| async move {
                match plan {
                    Some(axum::Extension(plan)) => String::from_utf8_lossy(plan.key()).into_owned(),
                    None => "no plan".to_owned(),
                }
            }),
        )
        .layer(skipping);
    for (key, expected) in [("made-up", "no plan"), ("a1", "acme")] {
        let response = respond(&app, key).await;
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .expect("body");
        assert_eq!(body, expected);
    }
}

/// One lookup keys every rule of its resolver: with nothing cached (a TTL
/// of zero), each request costs exactly one lookup, however many rules,
/// and however many layers, share the resolver.
#[tokio::test]
async fn one_lookup_per_request_keys_every_rule_of_its_resolver() {
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls)
        .ttl(Duration::ZERO)
        .build()
        .expect("resolver");
    let three = app([
        Rule::resolved(limit("per-minute", per_minute(3)), plans.clone()),
        Rule::resolved(
            limit("per-hour", Quota::per_hour(2).fixed_window()),
            plans.clone(),
        ),
        Rule::resolved(
            limit("per-day", Quota::per_day(100).fixed_window()),
            plans.clone(),
        ),
    ]);
    assert_eq!(send(&three, Some("a1")).await.0, StatusCode::OK);
    assert_eq!(calls_of(&calls), 1);
    assert_eq!(send(&three, Some("a2")).await.0, StatusCode::OK);
    assert_eq!(calls_of(&calls), 2, "nothing is cached");
    // acme's per-hour limit of 2 is spent: the third counts, refused
    assert_eq!(
        send(&three, Some("a1")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(calls_of(&calls), 3);
    // an outer and an inner layer sharing the resolver: one lookup
    let calls = Arc::new(AtomicUsize::new(0));
    let plans = counted(&calls)
        .ttl(Duration::ZERO)
        .build()
        .expect("resolver");
    let layer = |name: &str| {
        RateLimitLayer::builder()
            .rule(Rule::resolved(limit(name, per_minute(100)), plans.clone()))
            .build()
            .expect("layer")
    };
    let nested = Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(layer("inner"))
        .layer(layer("outer"));
    for i in 1..=4 {
        assert_eq!(send(&nested, Some("b")).await, (StatusCode::OK, true));
        assert_eq!(calls_of(&calls), i);
    }
}

/// One lookup keys rules by different keys: the organisation's budget per
/// the plan's key, each user's limit per its key named "user"; a plan
/// without that key has no key for the per-user rule.
#[tokio::test]
async fn one_lookup_keys_rules_by_the_plans_different_keys() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counting = calls.clone();
    let plans = PlanResolver::builder(api_key(), move |api_key: Vec<u8>| {
        counting.fetch_add(1, Ordering::SeqCst);
        async move {
            Ok::<_, io::Error>(match api_key.as_slice() {
                b"ann" | b"bob" => Some(Plan::new("acme").with_key("user", api_key)),
                b"service" => Some(Plan::new("acme")),
                _ => None,
            })
        }
    })
    .ttl(Duration::ZERO)
    .build()
    .expect("resolver");
    let both = &app([
        Rule::resolved(limit("org", per_minute(4)), plans.clone()),
        Rule::resolved_per(limit("user", per_minute(2)), plans.clone(), "user"),
    ]);
    assert_eq!(send(both, Some("ann")).await.0, StatusCode::OK);
    assert_eq!(send(both, Some("ann")).await.0, StatusCode::OK);
    assert_eq!(
        send(both, Some("ann")).await.0,
        StatusCode::TOO_MANY_REQUESTS,
        "ann's own 2"
    );
    assert_eq!(send(both, Some("bob")).await.0, StatusCode::OK);
    assert_eq!(send(both, Some("bob")).await.0, StatusCode::OK);
    assert_eq!(
        send(both, Some("bob")).await.0,
        StatusCode::TOO_MANY_REQUESTS,
        "acme's 4 (and bob's 2)"
    );
    // one lookup per request for both rules (nothing cached)
    assert_eq!(calls_of(&calls), 6);
    // a plan without a user key: no key for the per-user rule (400)
    assert_eq!(
        send(both, Some("service")).await,
        (StatusCode::BAD_REQUEST, false)
    );
    // ...or skipped, counted by the organisation only
    let skipping = app([
        Rule::resolved(limit("org2", per_minute(1)), plans.clone()),
        Rule::resolved_per(limit("user2", per_minute(5)), plans, "user")
            .on_missing_key(MissingKey::Skip),
    ]);
    assert_eq!(send(&skipping, Some("service")).await.0, StatusCode::OK);
    assert_eq!(
        send(&skipping, Some("service")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[test]
fn a_plans_named_keys() {
    let plan = Plan::new("acme")
        .with_key("user", "ann")
        .with_key("team", "red")
        .with_key("user", "bob");
    assert_eq!(plan.key(), b"acme");
    assert_eq!(plan.key_named("user"), Some(&b"bob"[..]), "the last wins");
    assert_eq!(plan.key_named("team"), Some(&b"red"[..]));
    assert_eq!(plan.key_named("org"), None);
}
