//! The layer's policies, each on the memory store and a real Redis: counting
//! only some outcomes (refunds), exemptions, per-limit missing-key
//! policies, tiers, shadow limits and delay-mode cancellation.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use common::{command_calls, redis_store, unique_prefix, TestRedis};
use http::{HeaderName, Request, StatusCode};
use tower::ServiceExt;
use tower_ratelimit::key::{Global, Header};
use tower_ratelimit::layer::{MissingKey, RateLimitLayer, Rule};
use tower_ratelimit::{ConfigError, Limit, MemoryStore, Quota, RedisStore, Store};

const USER: HeaderName = HeaderName::from_static("x-user");
const PLAN: HeaderName = HeaderName::from_static("x-plan");

fn limit(name: &str, quota: Quota) -> Limit {
    Limit::new(name, quota).expect("valid limit")
}

fn get_as(user: Option<&str>, extra: &[(&str, &str)]) -> Request<Body> {
    let mut req = Request::get("/");
    if let Some(user) = user {
        req = req.header(USER, user);
    }
    for (name, value) in extra {
        req = req.header(*name, *value);
    }
    req.body(Body::empty()).expect("request")
}

async fn status(app: &Router, req: Request<Body>) -> StatusCode {
    app.clone().oneshot(req).await.expect("infallible").status()
}

/// Both stores, each with a fresh key space.
fn both(test: &str) -> (MemoryStore, RedisStore) {
    (MemoryStore::new(), redis_store(&unique_prefix(test)))
}

/// A login route: the password is `correct horse`; 401 otherwise. At most
/// 5 failures per user in 15 minutes; successes are given back.
fn login_app(store: impl Into<Store>) -> Router {
    let failures = limit(
        "login",
        Quota::rate(5, Duration::from_secs(15 * 60)).sliding_log(),
    );
    let layer = RateLimitLayer::builder()
        .store(store)
        .timeout(common::PATIENT)
        .rule(
            Rule::new(failures, Header::new(USER))
                .refund_if(|response| response.status != StatusCode::UNAUTHORIZED),
        )
        .build()
        .expect("layer");
    Router::new()
        .route(
            "/",
            get(|headers: http::HeaderMap| async move {
                match headers.get("x-password") {
                    Some(p) if p == "correct horse" => StatusCode::OK,
                    _ => StatusCode::UNAUTHORIZED,
                }
            }),
        )
        .layer(layer)
}

async fn login(app: &Router, user: &str, password: &str) -> StatusCode {
    status(app, get_as(Some(user), &[("x-password", password)])).await
}

async fn login_counts_failures_only(store: impl Into<Store>) {
    let app = login_app(store);
    // successes are not counted, however many
    for _ in 0..8 {
        assert_eq!(login(&app, "ann", "correct horse").await, StatusCode::OK);
    }
    // 50 concurrent wrong guesses: exactly 5 are tried, 45 refused
    let guesses: Vec<_> = (0..50)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move { login(&app, "ann", &format!("guess {i}")).await })
        })
        .collect();
    let mut statuses = Vec::new();
    for guess in guesses {
        statuses.push(guess.await.expect("task"));
    }
    let count = |s: StatusCode| statuses.iter().filter(|x| **x == s).count();
    assert_eq!(count(StatusCode::UNAUTHORIZED), 5, "{statuses:?}");
    assert_eq!(count(StatusCode::TOO_MANY_REQUESTS), 45, "{statuses:?}");
    // now even the right password waits for the window
    let refused = app
        .clone()
        .oneshot(get_as(Some("ann"), &[("x-password", "correct horse")]))
        .await
        .expect("infallible");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().contains_key(http::header::RETRY_AFTER));
    // another user is unaffected
    assert_eq!(login(&app, "bob", "wrong").await, StatusCode::UNAUTHORIZED);
    assert_eq!(login(&app, "bob", "correct horse").await, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_failed_logins_count_and_concurrent_guesses_cannot_slip_through() {
    let (memory, redis) = both("login");
    login_counts_failures_only(memory).await;
    login_counts_failures_only(redis).await;
}

async fn exemptions(store: impl Into<Store> + Clone) {
    // an internal token is exempt from the layer's limit: the request is
    // forwarded without a decision
    let app = Router::new().route("/", get(|| async { "hi" })).layer(
        RateLimitLayer::builder()
            .store(store.clone())
            .timeout(common::PATIENT)
            .rule(
                Rule::new(limit("api", Quota::per_minute(2).sliding_log()), Global).skip_if(
                    |req| {
                        req.headers
                            .get("x-internal-token")
                            .is_some_and(|t| t == "s3cret")
                    },
                ),
            )
            .build()
            .expect("layer"),
    );
    let internal = || get_as(None, &[("x-internal-token", "s3cret")]);
    for _ in 0..5 {
        assert_eq!(status(&app, internal()).await, StatusCode::OK);
    }
    // never counted: the quota is whole
    assert_eq!(status(&app, get_as(None, &[])).await, StatusCode::OK);
    assert_eq!(status(&app, get_as(None, &[])).await, StatusCode::OK);
    assert_eq!(
        status(&app, get_as(None, &[])).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // a wrong token is no exemption; never refused with the right one
    let wrong = get_as(None, &[("x-internal-token", "guess")]);
    assert_eq!(status(&app, wrong).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status(&app, internal()).await, StatusCode::OK);

    // per limit: allow-listed users skip "per-user", not "global"
    let app = Router::new().route("/", get(|| async { "hi" })).layer(
        RateLimitLayer::builder()
            .store(store)
            .timeout(common::PATIENT)
            .rule(
                Rule::new(
                    limit("per-user", Quota::per_minute(1).sliding_log()),
                    Header::new(USER),
                )
                .skip_if(|req| req.headers.get(USER).is_some_and(|u| u == "monitor")),
            )
            .limit(limit("global", Quota::per_minute(4).sliding_log()), Global)
            .build()
            .expect("layer"),
    );
    for _ in 0..3 {
        assert_eq!(
            status(&app, get_as(Some("monitor"), &[])).await,
            StatusCode::OK
        );
    }
    assert_eq!(status(&app, get_as(Some("ann"), &[])).await, StatusCode::OK);
    assert_eq!(
        status(&app, get_as(Some("bob"), &[])).await,
        StatusCode::TOO_MANY_REQUESTS,
        "the global limit still counts the monitor"
    );
}

#[tokio::test]
async fn exempt_requests_are_never_counted_and_never_refused() {
    let (memory, redis) = both("exempt");
    exemptions(memory).await;
    exemptions(redis).await;
}

async fn missing_keys_per_limit(store: impl Into<Store> + Clone) {
    let tenant = HeaderName::from_static("x-tenant");
    let app = Router::new().route("/", get(|| async { "hi" })).layer(
        RateLimitLayer::builder()
            .store(store)
            .timeout(common::PATIENT)
            // the layer's default: reject
            .limit(
                limit("per-user", Quota::per_minute(5).sliding_log()),
                Header::new(USER),
            )
            .rule(
                Rule::new(
                    limit("per-tenant", Quota::per_minute(5).sliding_log()),
                    Header::new(tenant.clone()),
                )
                .on_missing_key(MissingKey::Skip),
            )
            .rule(
                Rule::new(
                    limit("per-key", Quota::per_minute(2).sliding_log()),
                    Header::new(HeaderName::from_static("x-api-key")),
                )
                .on_missing_key(MissingKey::Shared("anonymous".into())),
            )
            .build()
            .expect("layer"),
    );
    // no user: the per-user limit rejects (400)
    assert_eq!(
        status(&app, get_as(None, &[])).await,
        StatusCode::BAD_REQUEST
    );
    // no tenant: that limit is skipped; no API key: the shared key counts
    let keyless = |user| get_as(Some(user), &[]);
    assert_eq!(status(&app, keyless("u1")).await, StatusCode::OK);
    let response = app
        .clone()
        .oneshot(keyless("u2"))
        .await
        .expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let shown = response.headers()["ratelimit"].to_str().unwrap().to_owned();
    assert!(!shown.contains("per-tenant"), "skipped: {shown}");
    assert_eq!(
        status(&app, keyless("u3")).await,
        StatusCode::TOO_MANY_REQUESTS,
        "keyless requests share one key"
    );
    // a client naming the shared key is not counted with the keyless ones
    let named = |user| get_as(Some(user), &[("x-api-key", "anonymous")]);
    assert_eq!(status(&app, named("u4")).await, StatusCode::OK);
    assert_eq!(status(&app, named("u5")).await, StatusCode::OK);
    assert_eq!(
        status(&app, named("u6")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // a tenant present is counted
    let with_tenant = |user| get_as(Some(user), &[("x-tenant", "t"), ("x-api-key", "k")]);
    let response = app
        .clone()
        .oneshot(with_tenant("u7"))
        .await
        .expect("infallible");
    let shown = response.headers()["ratelimit"].to_str().unwrap().to_owned();
    assert!(shown.contains("\"per-tenant\";r=4"), "{shown}");
}

#[tokio::test]
async fn each_limit_has_its_own_missing_key_policy() {
    let (memory, redis) = both("missing");
    missing_keys_per_limit(memory).await;
    missing_keys_per_limit(redis).await;
}

fn tiered_app(store: impl Into<Store>) -> Router {
    let reports = Rule::new(
        limit("reports", Quota::per_minute(2).sliding_log()),
        Header::new(USER),
    )
    .tier("pro", Quota::per_minute(5).sliding_log())
    .choose_tier(|req| match req.headers.get(PLAN) {
        Some(plan) if plan == "pro" => Some("pro"),
        _ => None,
    });
    Router::new().route("/", get(|| async { "report" })).layer(
        RateLimitLayer::builder()
            .store(store)
            .timeout(common::PATIENT)
            .rule(reports)
            .build()
            .expect("layer"),
    )
}

async fn tiers(store: impl Into<Store>) {
    let app = tiered_app(store);
    let free = |user| get_as(Some(user), &[]);
    let pro = |user| get_as(Some(user), &[("x-plan", "pro")]);
    assert_eq!(status(&app, free("ann")).await, StatusCode::OK);
    let response = app.clone().oneshot(free("ann")).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let policy = response.headers()["ratelimit-policy"].to_str().unwrap();
    assert!(policy.contains("q=2"), "the free quota: {policy}");
    assert_eq!(
        status(&app, free("ann")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // the same limit and key under the pro quota: 3 more
    for _ in 0..3 {
        let response = app.clone().oneshot(pro("ann")).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::OK);
        let policy = response.headers()["ratelimit-policy"].to_str().unwrap();
        assert!(policy.contains("q=5"), "the pro quota: {policy}");
    }
    assert_eq!(
        status(&app, pro("ann")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // an unknown plan is the default tier
    let odd = get_as(Some("bob"), &[("x-plan", "platinum")]);
    assert_eq!(status(&app, odd).await, StatusCode::OK);
    assert_eq!(status(&app, free("bob")).await, StatusCode::OK);
    assert_eq!(status(&app, pro("bob")).await, StatusCode::OK);
    assert_eq!(
        status(&app, free("bob")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn tiers_choose_the_quota_per_request_in_one_limit() {
    let (memory, redis) = both("tiers");
    tiers(memory).await;
    tiers(redis).await;
}

#[tokio::test]
async fn a_tiered_request_is_one_round_trip() {
    let server = TestRedis::spawn();
    let store = RedisStore::builder(server.url.clone())
        .build()
        .expect("store");
    let app = tiered_app(store);
    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connection");
    // the first call loads the library
    assert_eq!(
        status(&app, get_as(Some("warm-up"), &[])).await,
        StatusCode::OK
    );
    let before = command_calls(&mut conn, "fcall");
    for user in ["a", "b", "c"] {
        assert_eq!(status(&app, get_as(Some(user), &[])).await, StatusCode::OK);
        let pro = get_as(Some(user), &[("x-plan", "pro")]);
        assert_eq!(status(&app, pro).await, StatusCode::OK);
    }
    assert_eq!(command_calls(&mut conn, "fcall") - before, 6);
}

#[test]
fn inconsistent_tiers_are_a_config_error() {
    let base = || limit("reports", Quota::per_minute(2).sliding_log());
    let build = |rule: Rule| RateLimitLayer::builder().rule(rule).build();
    let other_algorithm = Rule::new(base(), Global)
        .tier("pro", Quota::per_minute(5).fixed_window())
        .choose_tier(|_| Some("pro"));
    assert!(matches!(build(other_algorithm), Err(ConfigError::Tiers(_))));
    let unchosen = Rule::new(base(), Global).tier("pro", Quota::per_minute(5).sliding_log());
    assert!(matches!(build(unchosen), Err(ConfigError::Tiers(_))));
    let no_tiers = Rule::new(base(), Global).choose_tier(|_| None);
    assert!(matches!(build(no_tiers), Err(ConfigError::Tiers(_))));
    let twice = Rule::new(base(), Global)
        .tier("pro", Quota::per_minute(5).sliding_log())
        .tier("pro", Quota::per_minute(6).sliding_log())
        .choose_tier(|_| None);
    assert!(matches!(build(twice), Err(ConfigError::Tiers(_))));
    let too_small = RateLimitLayer::builder()
        .rule(
            Rule::new(limit("r", Quota::per_minute(5).sliding_log()), Global)
                .cost(3)
                .tier("tiny", Quota::per_minute(2).sliding_log())
                .choose_tier(|_| None),
        )
        .build();
    assert!(matches!(
        too_small,
        Err(ConfigError::FixedCostExceedsCapacity { .. })
    ));
    let bad_quota = Rule::new(base(), Global)
        .tier("zero", Quota::per_minute(0).sliding_log())
        .choose_tier(|_| None);
    assert!(matches!(
        build(bad_quota),
        Err(ConfigError::ZeroAmount { .. })
    ));
}

async fn shadow_in_the_layer(store: impl Into<Store>) {
    let app = Router::new().route("/", get(|| async { "hi" })).layer(
        RateLimitLayer::builder()
            .store(store)
            .timeout(common::PATIENT)
            .limit(
                limit("enforced", Quota::per_minute(3).sliding_log()),
                Global,
            )
            .limit(
                limit("trial", Quota::per_minute(1).sliding_log()).shadow(),
                Global,
            )
            .build()
            .expect("layer"),
    );
    for _ in 0..3 {
        let response = app.clone().oneshot(get_as(None, &[])).await.expect("ok");
        assert_eq!(response.status(), StatusCode::OK);
        let shown = response.headers()["ratelimit"].to_str().unwrap();
        let policy = response.headers()["ratelimit-policy"].to_str().unwrap();
        assert!(
            !shown.contains("trial") && !policy.contains("trial"),
            "{shown} {policy}"
        );
    }
    assert_eq!(
        status(&app, get_as(None, &[])).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn a_shadow_limit_in_a_layer_never_refuses_and_is_not_advertised() {
    let (memory, redis) = both("layer-shadow");
    shadow_in_the_layer(memory).await;
    shadow_in_the_layer(redis).await;
}

async fn cancelled_delay(store: impl Into<Store> + Clone) {
    let jobs = limit("jobs", Quota::per_minute(1).allow_burst(1).gcra());
    let app = Router::new().route("/", get(|| async { "hi" })).layer(
        RateLimitLayer::builder()
            .store(store.clone())
            .timeout(common::PATIENT)
            .limit(jobs.clone(), Global)
            .delay(Duration::from_secs(90))
            .build()
            .expect("layer"),
    );
    assert_eq!(status(&app, get_as(None, &[])).await, StatusCode::OK);
    // waits for the next slot, a minute away; the client gives up
    let waiting = app.clone().oneshot(get_as(None, &[]));
    assert!(tokio::time::timeout(Duration::from_millis(50), waiting)
        .await
        .is_err());
    // the reservation goes back (on a task, for Redis): the next slot is
    // again the one a minute away, not two minutes
    let look = common::patient_limiter(store, jobs);
    let mut retry = None;
    for _ in 0..100 {
        retry = look.peek(b"global", 1).await.expect("peek").retry_after();
        if retry <= Some(Duration::from_secs(60)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(retry <= Some(Duration::from_secs(60)), "{retry:?}");
}

#[tokio::test]
async fn a_request_dropped_while_it_waits_in_delay_mode_gives_its_slot_back() {
    let (memory, redis) = both("delay-cancel");
    cancelled_delay(memory).await;
    cancelled_delay(redis).await;
}

/// The `RateLimit` field of a response whose permit was given back shows
/// what remains after the refund: a success leaves all 5, a failure 4.
#[tokio::test]
async fn the_fields_of_a_refunded_response_show_what_remains_after_the_refund() {
    let (memory, redis) = both("refund-fields");
    for (store, app) in [("memory", login_app(memory)), ("redis", login_app(redis))] {
        let field = |response: &http::Response<Body>| {
            response.headers()["ratelimit"]
                .to_str()
                .expect("ascii")
                .to_owned()
        };
        let success = app
            .clone()
            .oneshot(get_as(Some("ann"), &[("x-password", "correct horse")]))
            .await
            .expect("infallible");
        assert_eq!(success.status(), StatusCode::OK, "{store}");
        assert!(
            field(&success).starts_with("\"login\";r=5;"),
            "{store}: {}",
            field(&success)
        );
        let failure = app
            .clone()
            .oneshot(get_as(Some("ann"), &[("x-password", "wrong")]))
            .await
            .expect("infallible");
        assert_eq!(failure.status(), StatusCode::UNAUTHORIZED, "{store}");
        assert!(
            field(&failure).starts_with("\"login\";r=4;"),
            "{store}: {}",
            field(&failure)
        );
    }
}
