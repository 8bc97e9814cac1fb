//! The Tower layer through `oneshot`, a real TCP server and HTTP client, and
//! real Redis (two app instances; Redis stopped for the failure policies).

mod common;
mod events;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use common::{redis_store, unique_prefix, TestRedis};
use events::Events;
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use sfv::{List, ListEntry, Parser};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_ratelimit::key::{
    ClientIp, ClientIpResolver, Global, Header, MatchedRoute, PathParam, RequestExtension as Ext,
};
use tower_ratelimit::layer::{
    MissingKey, OnStoreError, RateLimitInfo, RateLimitLayer, Rejection, Rule,
};
use tower_ratelimit::{ConfigError, Limit, MemoryStore, Quota, RedisStore};

fn limit(name: &str, quota: Quota) -> Limit {
    Limit::new(name, quota).expect("valid limit")
}

fn per_minute(n: u64) -> Quota {
    Quota::per_minute(n).allow_burst(n).gcra()
}

fn hello_app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(layer)
}

fn request(uri: &str) -> Request<Body> {
    Request::get(uri).body(Body::empty()).expect("request")
}

fn from_peer(uri: &str, peer: &str, xff: Option<&str>) -> Request<Body> {
    let mut req = Request::get(uri);
    if let Some(xff) = xff {
        req = req.header("x-forwarded-for", xff);
    }
    let mut req = req.body(Body::empty()).expect("request");
    let addr: SocketAddr = format!("{peer}:40000")
        .parse()
        .unwrap_or_else(|_| format!("[{peer}]:40000").parse().expect("peer"));
    req.extensions_mut().insert(ConnectInfo(addr));
    req
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, HeaderMap, String) {
    let response = app.clone().oneshot(req).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// Parses a structured List header into (name, [(param, integer)]) items;
/// panics when the value is not a valid RFC 9651 List.
fn sf_list(headers: &HeaderMap, name: &str) -> Vec<(String, Vec<(String, i64)>)> {
    let lines: Vec<&str> = headers
        .get_all(name)
        .iter()
        .map(|v| v.to_str().expect("ascii"))
        .collect();
    assert!(!lines.is_empty(), "no {name} header");
    let list: List = Parser::new(&lines.join(", "))
        .parse()
        .unwrap_or_else(|e| panic!("{name} is not a structured List: {e:?}"));
    list.into_iter()
        .map(|entry| match entry {
            ListEntry::Item(item) => {
                let name = item
                    .bare_item
                    .as_string()
                    .expect("policy name is a String")
                    .as_str()
                    .to_owned();
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.as_str().to_owned(),
                            i64::from(v.as_integer().expect("integer parameter")),
                        )
                    })
                    .collect();
                (name, params)
            }
            ListEntry::InnerList(_) => panic!("unexpected inner list in {name}"),
        })
        .collect()
}

fn param(item: &(String, Vec<(String, i64)>), key: &str) -> i64 {
    item.1
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key} in {item:?}"))
        .1
}

#[tokio::test]
async fn a_denied_request_gets_a_standard_429() {
    let app = hello_app(RateLimitLayer::new(limit("api", per_minute(2)), Global));
    for remaining in [1, 0] {
        let (status, headers, body) = send(&app, request("/")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "hi"));
        let policy = sf_list(&headers, "ratelimit-policy");
        assert_eq!(policy.len(), 1);
        assert_eq!(policy[0].0, "api");
        assert_eq!((param(&policy[0], "q"), param(&policy[0], "w")), (2, 60));
        let state = sf_list(&headers, "ratelimit");
        assert_eq!(param(&state[0], "r"), remaining);
        assert!(!headers.contains_key("retry-after"));
    }
    let (status, headers, body) = send(&app, request("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // 2 per minute: the next one is 30 s away, as whole delay-seconds
    assert_eq!(headers["retry-after"], "30");
    assert_eq!(headers["cache-control"], "no-store");
    assert_eq!(headers["content-type"], "application/problem+json");
    let state = sf_list(&headers, "ratelimit");
    assert_eq!(param(&state[0], "r"), 0);
    assert!(
        param(&state[0], "t") >= 30,
        "t must not point before Retry-After"
    );
    let problem: serde_json::Value = serde_json::from_str(&body).expect("json body");
    assert_eq!(
        problem["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(problem["status"], 429);
    assert_eq!(problem["violated-policies"], serde_json::json!(["api"]));
    assert!(problem["title"].is_string() && problem["detail"].is_string());
}

/// The deny-list answers 403 with a problem body and asks no store; a key
/// blocked by a limit's penalty (here by hand, through a limiter on the
/// same store) gets 429 with `Retry-After` the time left of the block and
/// `RateLimit` remaining 0; unblocked, it passes again. In memory and on
/// Redis (decided in the response future).
#[tokio::test]
async fn deny_listed_requests_get_403_and_blocked_keys_429_until_unblocked() {
    let prefix = unique_prefix("layer-bans");
    let hour = Duration::from_secs(3600);
    let banned = limit("api", per_minute(100))
        .with_penalty(tower_ratelimit::Penalty::new(10, hour, [hour]).expect("penalty"));
    let memory = MemoryStore::new();
    let redis = redis_store(&prefix);
    let (m, r) = (memory.clone(), redis.clone());
    let (lm, lr) = (banned.clone(), banned.clone());
    let memory_layer: LayerMaker = Box::new(move || layer_over(m.clone(), lm.clone()));
    let redis_layer: LayerMaker = Box::new(move || layer_over(r.clone(), lr.clone()));
    let stores = [
        (
            "memory",
            memory_layer,
            tower_ratelimit::Limiter::new(memory, banned.clone()),
        ),
        (
            "redis",
            redis_layer,
            tower_ratelimit::Limiter::new(redis, banned.clone()),
        ),
    ];
    for (store, layer, admin) in stores {
        let app = hello_app(layer());
        let as_client = |client: &str, agent: &str| {
            Request::get("/")
                .header("x-client", client)
                .header("user-agent", agent)
                .body(Body::empty())
                .expect("request")
        };
        let (status, headers, body) = send(&app, as_client("bot", "BadBot")).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{store}");
        assert_eq!(headers["content-type"], "application/problem+json");
        assert!(!headers.contains_key("retry-after"), "{store}");
        let problem: serde_json::Value = serde_json::from_str(&body).expect("json body");
        assert_eq!(problem["status"], 403);
        assert_eq!(problem["detail"], "The request is not allowed.");
        // nothing was asked of the store
        let seen = admin.admin().inspect("api", "bot").await.expect("inspect");
        assert_eq!(seen.decision.remaining(), 100, "{store}");

        assert_eq!(send(&app, as_client("eve", "curl")).await.0, StatusCode::OK);
        admin
            .admin()
            .block("api", "eve", Duration::from_secs(90))
            .await
            .expect("block");
        for _ in 0..2 {
            let (status, headers, _) = send(&app, as_client("eve", "curl")).await;
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{store}");
            let retry: u64 = headers["retry-after"]
                .to_str()
                .expect("ascii")
                .parse()
                .expect("secs");
            assert!((89..=90).contains(&retry), "{store}: {retry}");
            let state = sf_list(&headers, "ratelimit");
            assert_eq!(param(&state[0], "r"), 0, "{store}");
        }
        // another client is not blocked
        assert_eq!(send(&app, as_client("ann", "curl")).await.0, StatusCode::OK);
        assert!(admin.admin().unblock("api", "eve").await.expect("unblock"));
        // (a layer over a remote store answers the block from its cache
        // of denials until it ends: a fresh layer asks the store)
        let app = hello_app(layer());
        assert_eq!(
            send(&app, as_client("eve", "curl")).await.0,
            StatusCode::OK,
            "{store}"
        );
    }
}

/// Builds a layer anew (a fresh cache of denials).
type LayerMaker = Box<dyn Fn() -> RateLimitLayer>;

fn layer_over(store: impl Into<tower_ratelimit::Store>, limit: Limit) -> RateLimitLayer {
    RateLimitLayer::builder()
        .store(store)
        .limit(limit, Header::new(HeaderName::from_static("x-client")))
        .deny_if(|request| {
            request
                .headers
                .get("user-agent")
                .is_some_and(|ua| ua == "BadBot")
        })
        .build()
        .expect("layer")
}

#[tokio::test]
async fn sub_second_waits_are_never_retry_after_zero() {
    let app = hello_app(RateLimitLayer::new(
        limit("fast", Quota::per_second(10).allow_burst(1).gcra()),
        Global,
    ));
    assert_eq!(send(&app, request("/")).await.0, StatusCode::OK);
    let (status, headers, _) = send(&app, request("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        headers["retry-after"], "1",
        "a 100 ms wait rounds up to 1 s"
    );
}

#[tokio::test]
async fn composes_with_route_layer_method_router_and_service_builder() {
    let layer = || RateLimitLayer::new(limit("one", per_minute(1)), Global);
    let routes = Router::new()
        .route("/a", get(|| async { "a" }).route_layer(layer()))
        .route("/b", get(|| async { "b" }).layer(layer()))
        .route("/free", get(|| async { "free" }));
    for path in ["/a", "/b"] {
        assert_eq!(send(&routes, request(path)).await.0, StatusCode::OK);
        assert_eq!(
            send(&routes, request(path)).await.0,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    assert_eq!(send(&routes, request("/free")).await.0, StatusCode::OK);
    // route_layer leaves unmatched paths alone: 404, not limited
    assert_eq!(
        send(&routes, request("/missing")).await.0,
        StatusCode::NOT_FOUND
    );

    // A plain Tower service with its own body type, through ServiceBuilder.
    let svc = ServiceBuilder::new()
        .layer(layer())
        .service(tower::service_fn(|_req: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"plain"))))
        }));
    let call = |svc: &_| {
        let svc: tower_ratelimit::layer::RateLimit<_> = Clone::clone(svc);
        async move {
            svc.oneshot(Request::new(Full::new(Bytes::new())))
                .await
                .expect("infallible")
        }
    };
    let ok = call(&svc).await;
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(
        ok.into_body().collect().await.expect("body").to_bytes(),
        "plain"
    );
    let limited = call(&svc).await;
    assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = limited
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("quota-exceeded"));
}

#[derive(Clone)]
struct UserId(&'static str);

impl std::fmt::Display for UserId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

fn as_user(mut req: Request<Body>, user: &'static str) -> Request<Body> {
    req.extensions_mut().insert(UserId(user));
    req
}

#[tokio::test]
async fn several_limits_are_all_or_nothing_and_the_refusing_one_is_named() {
    let layer = RateLimitLayer::builder()
        .limit(limit("per-ip", per_minute(10)), ClientIp::peer())
        .limit(limit("per-user", per_minute(2)), Ext::<UserId>::new())
        .build()
        .expect("layer");
    let app = hello_app(layer);
    for _ in 0..2 {
        assert_eq!(
            send(&app, as_user(from_peer("/", "203.0.113.1", None), "ann"))
                .await
                .0,
            StatusCode::OK
        );
    }
    let (status, headers, body) =
        send(&app, as_user(from_peer("/", "203.0.113.1", None), "ann")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        body.contains(r#""violated-policies":["per-user"]"#),
        "{body}"
    );
    let state = sf_list(&headers, "ratelimit");
    assert_eq!(
        state
            .iter()
            .map(|s| (s.0.as_str(), param(s, "r")))
            .collect::<Vec<_>>(),
        [("per-ip", 8), ("per-user", 0)]
    );
    // the refused request took nothing from per-ip: another user from the same IP sees 8 left before its grant
    let (status, headers, _) =
        send(&app, as_user(from_peer("/", "203.0.113.1", None), "bob")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(param(&sf_list(&headers, "ratelimit")[0], "r"), 7);
}

#[tokio::test]
async fn costs_are_fixed_or_computed_and_checked_against_capacity() {
    let err = RateLimitLayer::builder()
        .rule(Rule::new(limit("small", per_minute(5)), Global).cost(6))
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::FixedCostExceedsCapacity {
                cost: 6,
                capacity: 5,
                ..
            }
        ),
        "{err}"
    );

    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new(limit("credits", per_minute(10)), Global)
                .cost_from_request(|parts| Some(if parts.uri.path() == "/export" { 4 } else { 1 })),
        )
        .build()
        .expect("layer");
    let app = Router::new()
        .route("/export", get(|| async { "csv" }))
        .route("/page", get(|| async { "page" }))
        .layer(layer);
    let (_, headers, _) = send(&app, request("/export")).await;
    assert_eq!(param(&sf_list(&headers, "ratelimit")[0], "r"), 6);
    let (_, headers, _) = send(&app, request("/page")).await;
    assert_eq!(param(&sf_list(&headers, "ratelimit")[0], "r"), 5);
    // a computed cost over the capacity can never pass: 429 without Retry-After
    let huge = RateLimitLayer::builder()
        .rule(Rule::new(limit("credits", per_minute(10)), Global).cost_from_request(|_| Some(11)))
        .build()
        .expect("layer");
    let (status, headers, body) = send(&hello_app(huge), request("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(!headers.contains_key("retry-after"));
    assert!(body.contains("can ever grant"), "{body}");
}

#[tokio::test(start_paused = true)]
async fn delay_mode_forwards_after_the_wait_and_refuses_beyond_max_delay() {
    let store = MemoryStore::with_clock(common::TokioClock::start());
    let layer = RateLimitLayer::builder()
        .store(store)
        .limit(
            limit("shaped", Quota::per_second(10).allow_burst(1).gcra()),
            Global,
        )
        .delay(Duration::from_millis(250))
        .build()
        .expect("layer");
    let app = hello_app(layer);
    let started = tokio::time::Instant::now();
    let responses = futures::future::join_all((0..4).map(|_| {
        let app = app.clone();
        async move {
            let (status, _, _) = send(&app, request("/")).await;
            (status, started.elapsed())
        }
    }))
    .await;
    let mut statuses: Vec<_> = responses.iter().map(|r| r.0).collect();
    statuses.sort();
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let mut waits: Vec<_> = responses
        .iter()
        .filter(|r| r.0 == StatusCode::OK)
        .map(|r| r.1)
        .collect();
    waits.sort();
    // 10 per second, spaced 100 ms apart (virtual time)
    assert_eq!(
        waits,
        [
            Duration::ZERO,
            Duration::from_millis(100),
            Duration::from_millis(200)
        ]
    );
    let refused = responses
        .iter()
        .find(|r| r.0 == StatusCode::TOO_MANY_REQUESTS)
        .expect("one refused");
    assert_eq!(
        refused.1,
        Duration::ZERO,
        "refused at once, not after waiting"
    );
}

/// At most `max_waiting` requests wait at once; beyond, a request that
/// would have to wait is answered 429 with its wait, consuming nothing.
#[tokio::test(start_paused = true)]
async fn delay_mode_lets_at_most_max_waiting_requests_wait() {
    let store = MemoryStore::with_clock(common::TokioClock::start());
    let layer = RateLimitLayer::builder()
        .store(store)
        .limit(
            limit(
                "shaped",
                Quota::rate(1, Duration::from_secs(10))
                    .allow_burst(1)
                    .gcra(),
            ),
            Global,
        )
        .delay(Duration::from_secs(60))
        .max_waiting(2)
        .build()
        .expect("layer");
    let app = hello_app(layer);
    assert_eq!(send(&app, request("/")).await.0, StatusCode::OK);
    // two wait (10 s and 20 s)
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, request("/")).await.0 })
        })
        .collect();
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // the third would wait 30 s: refused at once, with that wait
    let started = tokio::time::Instant::now();
    let (status, headers, _) = send(&app, request("/")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(started.elapsed(), Duration::ZERO, "refused without waiting");
    assert_eq!(headers["retry-after"], "30");
    for request in waiting {
        assert_eq!(request.await.expect("task"), StatusCode::OK);
    }
    // the places are free again: the next request waits its turn
    assert_eq!(send(&app, request("/")).await.0, StatusCode::OK);
}

#[test]
fn a_delay_beyond_max_wait_or_no_waiting_place_is_a_config_error() {
    let build = |delay: Duration, waiting: usize| {
        RateLimitLayer::builder()
            .limit(limit("l", per_minute(1)), Global)
            .delay(delay)
            .max_waiting(waiting)
            .build()
    };
    assert!(build(tower_ratelimit::MAX_WAIT, 1).is_ok());
    for (delay, waiting) in [
        (tower_ratelimit::MAX_WAIT + Duration::from_secs(1), 1),
        (Duration::MAX, 1),
        (Duration::from_secs(1), 0),
    ] {
        assert!(
            matches!(build(delay, waiting), Err(ConfigError::Layer(_))),
            "{delay:?}, {waiting}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_waiting_in_delay_mode_holds_no_inner_capacity() {
    let layer = RateLimitLayer::builder()
        .store(MemoryStore::with_clock(common::TokioClock::start()))
        .limit(
            limit(
                "per-key",
                Quota::rate(1, Duration::from_secs(10))
                    .allow_burst(1)
                    .gcra(),
            ),
            Header::new(HeaderName::from_static("x-key")),
        )
        .delay(Duration::from_secs(60))
        .build()
        .expect("layer");
    // The inner service serves one request at a time.
    let svc = ServiceBuilder::new()
        .layer(layer)
        .layer(tower::limit::ConcurrencyLimitLayer::new(1))
        .service(tower::service_fn(|_req: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }));
    let req = |key: &str| {
        Request::get("/")
            .header("x-key", key)
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    let first = svc.clone().oneshot(req("a")).await.expect("infallible");
    assert_eq!(first.status(), StatusCode::OK);
    // a's second request is granted 10 s from now and waits for it
    let mut waiting = std::pin::pin!(svc.clone().oneshot(req("a")));
    assert!(futures::poll!(waiting.as_mut()).is_pending());
    // b is granted at once: it is served while a waits, not after
    let served_first = tokio::select! {
        biased;
        response = svc.clone().oneshot(req("b")) => {
            assert_eq!(response.expect("infallible").status(), StatusCode::OK);
            "b"
        }
        _ = waiting.as_mut() => "a",
    };
    assert_eq!(
        served_first, "b",
        "b waited for the inner capacity held across a's delay"
    );
    let second = waiting.await.expect("infallible");
    assert_eq!(second.status(), StatusCode::OK);
}

/// In memory the layer decides within `call` and calls the inner service
/// directly when it is ready; when it is not, the granted request waits for
/// it (on a clone), keeping its decision and its fields.
#[tokio::test]
async fn decided_at_once_a_request_still_waits_for_inner_capacity() {
    let layer = RateLimitLayer::builder()
        .limit(limit("api", per_minute(5)), Global)
        .build()
        .expect("layer");
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let handler_gate = gate.clone();
    // The inner service serves one request at a time, each until the gate opens.
    let svc = ServiceBuilder::new()
        .layer(layer)
        .layer(tower::limit::ConcurrencyLimitLayer::new(1))
        .service(tower::service_fn(move |_req: Request<Full<Bytes>>| {
            let gate = handler_gate.clone();
            async move {
                gate.acquire().await.expect("open").forget();
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        }));
    let req = || {
        Request::get("/")
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    let mut first = std::pin::pin!(svc.clone().oneshot(req()));
    assert!(futures::poll!(first.as_mut()).is_pending());
    // the inner service is busy: the second request is decided, then waits
    let mut second = std::pin::pin!(svc.clone().oneshot(req()));
    assert!(futures::poll!(second.as_mut()).is_pending());
    gate.add_permits(2);
    let first = first.await.expect("infallible");
    let second = second.await.expect("infallible");
    assert_eq!(
        (first.status(), second.status()),
        (StatusCode::OK, StatusCode::OK)
    );
    assert_eq!(first.headers()["ratelimit"], "\"api\";r=4;t=12");
    assert_eq!(second.headers()["ratelimit"], "\"api\";r=3;t=24");
    // both were counted once: three left, then two
    let third = svc.clone().oneshot(req());
    gate.add_permits(1);
    let third = third.await.expect("infallible");
    assert_eq!(third.headers()["ratelimit"], "\"api\";r=2;t=36");
}

/// As a server does with one connection's service, requests go through one
/// service value in turn: a request that found the inner service busy takes
/// the next free permit, whichever request freed it.
#[tokio::test]
async fn one_service_value_hands_a_freed_permit_to_the_waiting_request() {
    let layer = RateLimitLayer::builder()
        .limit(limit("api", per_minute(5)), Global)
        .build()
        .expect("layer");
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let handler_gate = gate.clone();
    let mut svc = ServiceBuilder::new()
        .layer(layer)
        .layer(tower::limit::ConcurrencyLimitLayer::new(1))
        .service(tower::service_fn(move |_req: Request<Full<Bytes>>| {
            let gate = handler_gate.clone();
            async move {
                gate.acquire().await.expect("open").forget();
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        }));
    let req = || {
        Request::get("/")
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    // boxed: awaited by value, it is dropped when done and frees its permit
    let mut first = Box::pin(svc.ready().await.expect("ready").call(req()));
    assert!(futures::poll!(first.as_mut()).is_pending());
    let second = svc.ready().await.expect("ready").call(req());
    let mut second = std::pin::pin!(second);
    assert!(futures::poll!(second.as_mut()).is_pending());
    gate.add_permits(2);
    assert_eq!(first.await.expect("infallible").status(), StatusCode::OK);
    // the permit the first request freed reaches the second
    let second = tokio::time::timeout(Duration::from_secs(10), second).await;
    let second = second.expect("the waiting request got the freed permit");
    assert_eq!(second.expect("infallible").status(), StatusCode::OK);
}

/// A readiness error of the inner service is the response future's error,
/// over a store that answers at once as over any other.
#[tokio::test]
async fn an_inner_readiness_error_is_returned() {
    #[derive(Clone)]
    struct Broken;
    impl tower::Service<Request<Full<Bytes>>> for Broken {
        type Response = Response<Full<Bytes>>;
        type Error = &'static str;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Err("broken"))
        }
        fn call(&mut self, _: Request<Full<Bytes>>) -> Self::Future {
            std::future::ready(Err("called without readiness"))
        }
    }
    let svc = ServiceBuilder::new()
        .layer(
            RateLimitLayer::builder()
                .limit(limit("api", per_minute(5)), Global)
                .build()
                .expect("layer"),
        )
        .service(Broken);
    let request = Request::get("/")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let result = svc.oneshot(request).await;
    assert_eq!(result.err(), Some("broken"));
}

#[tokio::test]
async fn missing_keys_follow_the_configured_policy() {
    let api_key = || Header::new(HeaderName::from_static("x-api-key"));
    let keyed = |policy: MissingKey| {
        RateLimitLayer::builder()
            .rule(Rule::new(limit("per-key", per_minute(1)), api_key()).on_missing_key(policy))
            .build()
            .expect("layer")
    };
    // default: 400 with a problem body, nothing consumed
    let (status, headers, body) =
        send(&hello_app(keyed(MissingKey::default())), request("/")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(body.contains("per-key"), "{body}");
    // skip: unlimited, no rate-limit headers
    let app = hello_app(keyed(MissingKey::Skip));
    for _ in 0..3 {
        let (status, headers, _) = send(&app, request("/")).await;
        assert_eq!(status, StatusCode::OK);
        assert!(!headers.contains_key("ratelimit"));
    }
    // shared: all keyless requests share one bucket, keyed ones have their own
    let app = hello_app(keyed(MissingKey::Shared("anonymous".into())));
    assert_eq!(send(&app, request("/")).await.0, StatusCode::OK);
    assert_eq!(
        send(&app, request("/")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let with_key = Request::get("/")
        .header("x-api-key", "k-1")
        .body(Body::empty())
        .expect("request");
    assert_eq!(send(&app, with_key).await.0, StatusCode::OK);
    let err = RateLimitLayer::builder()
        .rule(
            Rule::new(limit("x", per_minute(1)), api_key())
                .on_missing_key(MissingKey::Reject(StatusCode::OK)),
        )
        .build();
    assert!(matches!(err, Err(ConfigError::Layer(_))));
}

#[tokio::test]
async fn handlers_see_the_decision_and_headers_are_configurable() {
    let layer = RateLimitLayer::builder()
        .limit(limit("api", per_minute(5)), Global)
        .ietf_headers(false)
        .legacy_headers(true)
        .build()
        .expect("layer");
    let app = Router::new()
        .route(
            "/",
            get(|info: RateLimitInfo| async move {
                match info.decision() {
                    Some(d) => format!("{} left", d.remaining()),
                    None => "no decision".to_owned(),
                }
            }),
        )
        .layer(layer);
    let (status, headers, body) = send(&app, request("/")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "4 left"));
    assert!(!headers.contains_key("ratelimit") && !headers.contains_key("ratelimit-policy"));
    assert_eq!(headers["x-ratelimit-limit"], "5");
    assert_eq!(headers["x-ratelimit-remaining"], "4");
    let reset: u64 = headers["x-ratelimit-reset"]
        .to_str()
        .unwrap()
        .parse()
        .expect("epoch seconds");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(
        reset > now && reset <= now + 13,
        "reset {reset} is UTC epoch seconds (now {now})"
    );
}

#[tokio::test]
async fn a_custom_rejection_replaces_the_body_but_keeps_retry_after() {
    let layer = RateLimitLayer::builder()
        .limit(limit("api", per_minute(1)), Global)
        .on_rejection(|why| match why {
            Rejection::Limited(d) => (
                StatusCode::TOO_MANY_REQUESTS,
                format!("slow down, {} left", d.remaining()),
            )
                .into_response(),
            _ => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        })
        .build()
        .expect("layer");
    let app = hello_app(layer);
    send(&app, request("/")).await;
    let (status, headers, body) = send(&app, request("/")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::TOO_MANY_REQUESTS, "slow down, 0 left")
    );
    assert_eq!(headers["retry-after"], "60");
    assert!(headers.contains_key("ratelimit"));
}

#[tokio::test]
async fn route_and_path_parameter_keys() {
    let per_route = RateLimitLayer::new(limit("per-route", per_minute(1)), MatchedRoute);
    let per_phone = RateLimitLayer::new(
        limit("sms", Quota::per_minute(3).sliding_log()),
        PathParam::new("phone"),
    );
    let app = Router::new()
        .route("/users/{id}", get(|| async { "user" }))
        .route("/teams/{id}", get(|| async { "team" }))
        .layer(per_route)
        .merge(Router::new().route(
            "/sms/{phone}",
            post(|| async { StatusCode::ACCEPTED }).route_layer(per_phone),
        ));
    assert_eq!(send(&app, request("/users/1")).await.0, StatusCode::OK);
    assert_eq!(
        send(&app, request("/users/2")).await.0,
        StatusCode::TOO_MANY_REQUESTS,
        "one key per route, whatever the id"
    );
    assert_eq!(send(&app, request("/teams/1")).await.0, StatusCode::OK);
    let sms = |phone: &str| {
        Request::post(format!("/sms/{phone}"))
            .body(Body::empty())
            .expect("request")
    };
    for _ in 0..3 {
        assert_eq!(send(&app, sms("%2B15550100")).await.0, StatusCode::ACCEPTED);
    }
    // the same number, written unescaped: same key after percent-decoding
    assert_eq!(
        send(&app, sms("+15550100")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(send(&app, sms("+15550199")).await.0, StatusCode::ACCEPTED);
}

fn post_to(uri: &str) -> Request<Body> {
    Request::post(uri).body(Body::empty()).expect("request")
}

/// A route `/users/{id}/sms/{phone}` limited to 1 per minute per `param`.
fn sms_route(param: &str) -> Router {
    Router::new().route(
        "/users/{id}/sms/{phone}",
        post(|| async { StatusCode::ACCEPTED }).route_layer(RateLimitLayer::new(
            limit("per-param", per_minute(1)),
            PathParam::new(param),
        )),
    )
}

/// `first` is accepted, then refused; `other` (another value of the
/// parameter) still has its own limit.
async fn assert_one_limit_per_value(app: &Router, first: &str, other: &str) {
    let (status, _, body) = send(app, post_to(first)).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{first}: {body}");
    assert_eq!(
        send(app, post_to(first)).await.0,
        StatusCode::TOO_MANY_REQUESTS,
        "{first} again"
    );
    let (status, _, body) = send(app, post_to(other)).await;
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "{other} has its own limit: {body}"
    );
}

#[tokio::test]
async fn path_params_under_nest_key_per_value() {
    let by_user = Router::new().nest("/v1", sms_route("id"));
    assert_one_limit_per_value(
        &by_user,
        "/v1/users/7/sms/%2B15550100",
        "/v1/users/8/sms/%2B15550100",
    )
    .await;
    let by_phone = Router::new().nest("/v1", sms_route("phone"));
    assert_one_limit_per_value(
        &by_phone,
        "/v1/users/7/sms/%2B15550100",
        "/v1/users/7/sms/%2B15550199",
    )
    .await;
    // axum decodes: the escaped and the plain spelling are one number
    assert_eq!(
        send(&by_phone, post_to("/v1/users/9/sms/+15550100"))
            .await
            .0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn path_params_under_nest_service_key_per_value() {
    let by_user = Router::new().nest_service("/v1", sms_route("id"));
    assert_one_limit_per_value(&by_user, "/v1/users/7/sms/1", "/v1/users/8/sms/1").await;
    let by_phone = Router::new().nest_service("/v1", sms_route("phone"));
    assert_one_limit_per_value(&by_phone, "/v1/users/7/sms/1", "/v1/users/7/sms/2").await;
}

#[tokio::test]
async fn path_params_nested_twice_and_from_the_nest_prefix() {
    let by_user = Router::new().nest("/api", Router::new().nest("/v1", sms_route("id")));
    assert_one_limit_per_value(&by_user, "/api/v1/users/7/sms/1", "/api/v1/users/8/sms/1").await;
    let mixed = Router::new().nest(
        "/api",
        Router::new().nest_service("/v1", Router::new().nest("/beta", sms_route("phone"))),
    );
    assert_one_limit_per_value(
        &mixed,
        "/api/v1/beta/users/7/sms/1",
        "/api/v1/beta/users/7/sms/2",
    )
    .await;
    // a parameter captured by the nest itself
    let by_org = Router::new().nest(
        "/orgs/{org}",
        Router::new().route(
            "/send",
            post(|| async { StatusCode::ACCEPTED }).route_layer(RateLimitLayer::new(
                limit("per-org", per_minute(1)),
                PathParam::new("org"),
            )),
        ),
    );
    assert_one_limit_per_value(&by_org, "/orgs/acme/send", "/orgs/globex/send").await;
}

#[tokio::test]
async fn a_wildcard_parameter_is_a_key() {
    let files = Router::new().route(
        "/files/{*rest}",
        post(|| async { StatusCode::ACCEPTED }).route_layer(RateLimitLayer::new(
            limit("per-file", per_minute(1)),
            PathParam::new("rest"),
        )),
    );
    assert_one_limit_per_value(&files, "/files/a/b.txt", "/files/a/c.txt").await;
    let nested = Router::new().nest("/v1", files);
    assert_one_limit_per_value(&nested, "/v1/files/x/y", "/v1/files/x/z").await;
}

#[tokio::test]
async fn a_parameter_that_is_not_utf8_has_no_key() {
    let app = Router::new().nest("/v1", sms_route("id"));
    let (status, _, body) = send(&app, post_to("/v1/users/%FF%FE/sms/1")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("per-param"), "{body}");
    // a parameter of another name, or outside any router: no key either
    let unknown = Router::new().nest("/v1", sms_route("nope"));
    assert_eq!(
        send(&unknown, post_to("/v1/users/7/sms/1")).await.0,
        StatusCode::BAD_REQUEST
    );
}

#[tokio::test]
async fn spoofed_forwarded_for_from_an_untrusted_peer_does_not_escape() {
    let resolver = ClientIpResolver::new()
        .trust_proxies(["10.0.0.0/8"])
        .expect("cidrs");
    let app = hello_app(RateLimitLayer::new(
        limit("per-ip", per_minute(3)),
        ClientIp::with_resolver(resolver),
    ));
    let mut statuses = Vec::new();
    for i in 0..10 {
        // the attacker talks directly and rotates X-Forwarded-For
        let xff = format!("198.18.{}.{}, 10.0.0.{}", i, i, i);
        statuses.push(send(&app, from_peer("/", "192.0.2.66", Some(&xff))).await.0);
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == StatusCode::OK).count(),
        3,
        "{statuses:?}"
    );
}

#[tokio::test]
async fn a_trusted_chain_yields_the_rightmost_untrusted_address() {
    let resolver = ClientIpResolver::new()
        .trust_proxies(["10.0.0.0/8"])
        .expect("cidrs");
    let app = hello_app(RateLimitLayer::new(
        limit("per-ip", per_minute(1)),
        ClientIp::with_resolver(resolver),
    ));
    // via two trusted proxies; the leftmost entry is the client's own claim
    let via_lb = |xff: &str| from_peer("/", "10.0.0.5", Some(xff));
    assert_eq!(
        send(&app, via_lb("6.6.6.6, 203.0.113.9, 10.0.0.2")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&app, via_lb("7.7.7.7, 203.0.113.9, 10.0.0.2")).await.0,
        StatusCode::TOO_MANY_REQUESTS,
        "same client whatever it claims"
    );
    assert_eq!(
        send(&app, via_lb("6.6.6.6, 203.0.113.10, 10.0.0.2"))
            .await
            .0,
        StatusCode::OK,
        "another client"
    );
    // garbage right of the client stops the walk at the last trusted hop
    assert_eq!(
        send(&app, via_lb("203.0.113.11, nonsense")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&app, via_lb("203.0.113.12, nonsense")).await.0,
        StatusCode::TOO_MANY_REQUESTS,
        "both count as the proxy 10.0.0.5"
    );
}

/// A trusted proxy that sends no `X-Forwarded-For` (or names only trusted
/// hops) gives, with `require_forwarded_client`, no key: the rule's
/// `MissingKey` policy applies instead of one limit for every client behind
/// the proxy. Without it, such requests count under the proxy.
#[tokio::test]
async fn a_trusted_proxy_naming_no_client_gives_no_key_when_required() {
    let resolver = || {
        ClientIpResolver::new()
            .trust_proxies(["10.0.0.0/8"])
            .expect("cidrs")
    };
    let app = |resolver: ClientIpResolver, policy: MissingKey| {
        hello_app(
            RateLimitLayer::builder()
                .rule(
                    Rule::new(
                        limit("per-ip", per_minute(1)),
                        ClientIp::with_resolver(resolver),
                    )
                    .on_missing_key(policy),
                )
                .build()
                .expect("layer"),
        )
    };
    let strict = app(resolver().require_forwarded_client(), MissingKey::default());
    // from the proxy without the header: no key, 400, nothing counted
    for _ in 0..3 {
        let (status, headers, body) = send(&strict, from_peer("/", "10.0.0.5", None)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(!headers.contains_key("ratelimit"));
        assert!(body.contains("per-ip"), "{body}");
    }
    // only trusted hops named: no key either
    assert_eq!(
        send(&strict, from_peer("/", "10.0.0.5", Some("10.0.0.9")))
            .await
            .0,
        StatusCode::BAD_REQUEST
    );
    // with the header: the client's own key, one limit each
    for client in ["203.0.113.1", "203.0.113.2"] {
        let via_proxy = || from_peer("/", "10.0.0.5", Some(client));
        assert_eq!(send(&strict, via_proxy()).await.0, StatusCode::OK);
        assert_eq!(
            send(&strict, via_proxy()).await.0,
            StatusCode::TOO_MANY_REQUESTS,
            "{client} has its own limit"
        );
    }
    // an untrusted peer is keyed by itself, header or not
    assert_eq!(
        send(&strict, from_peer("/", "198.51.100.9", None)).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&strict, from_peer("/", "198.51.100.9", Some("203.0.113.3")))
            .await
            .0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // the rule's policy decides: skipped
    let skipping = app(resolver().require_forwarded_client(), MissingKey::Skip);
    for _ in 0..3 {
        let (status, headers, _) = send(&skipping, from_peer("/", "10.0.0.5", None)).await;
        assert_eq!(status, StatusCode::OK);
        assert!(!headers.contains_key("ratelimit"));
    }
    // without the requirement (the default), the proxy is the key: its
    // clients share its one limit
    let lenient = app(resolver(), MissingKey::default());
    assert_eq!(
        send(&lenient, from_peer("/", "10.0.0.5", None)).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&lenient, from_peer("/", "10.0.0.5", None)).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn rotating_ipv6_addresses_inside_a_64_does_not_escape() {
    let app = hello_app(RateLimitLayer::new(
        limit("per-ip", per_minute(2)),
        ClientIp::peer(),
    ));
    let mut ok = 0;
    for i in 0..8 {
        let peer = format!("2001:db8:7:9:{i:x}:{i:x}::1");
        if send(&app, from_peer("/", &peer, None)).await.0 == StatusCode::OK {
            ok += 1;
        }
    }
    assert_eq!(ok, 2);
    assert_eq!(
        send(&app, from_peer("/", "2001:db8:7:a::1", None)).await.0,
        StatusCode::OK,
        "the next /64 is another client"
    );
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .expect("serve");
    });
    addr
}

async fn http_get(addr: SocketAddr, path: &str) -> (StatusCode, HeaderMap) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let response = client
        .get(format!("http://{addr}{path}").parse().expect("uri"))
        .await
        .expect("HTTP request");
    let (parts, body) = response.into_parts();
    body.collect().await.expect("body");
    (parts.status, parts.headers)
}

#[tokio::test]
async fn over_tcp_with_a_real_client() {
    let app = hello_app(RateLimitLayer::new(
        limit("per-ip", per_minute(2)),
        ClientIp::peer(),
    ));
    let addr = serve(app).await;
    assert_eq!(http_get(addr, "/").await.0, StatusCode::OK);
    assert_eq!(http_get(addr, "/").await.0, StatusCode::OK);
    let (status, headers) = http_get(addr, "/").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "30");
    assert_eq!(sf_list(&headers, "ratelimit-policy")[0].0, "per-ip");
}

fn redis_app(store: RedisStore, policy: OnStoreError) -> Router {
    let layer = RateLimitLayer::builder()
        .store(store)
        .limit(limit("per-ip", per_minute(3)), ClientIp::peer())
        .on_store_error(policy)
        .timeout(Duration::from_millis(200))
        .build()
        .expect("layer");
    hello_app(layer)
}

#[tokio::test]
async fn two_instances_on_one_redis_share_the_limit() {
    let prefix = unique_prefix("two-apps");
    let a = serve(redis_app(redis_store(&prefix), OnStoreError::default())).await;
    let b = serve(redis_app(redis_store(&prefix), OnStoreError::default())).await;
    let mut statuses = Vec::new();
    for addr in [a, b, a, b, a] {
        statuses.push(http_get(addr, "/").await.0);
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    common::assert_keys_expire(
        &prefix,
        common::state_lifetime([&limit("per-ip", per_minute(3))], Duration::ZERO),
    );
}

#[tokio::test]
async fn store_failure_policies_with_redis_stopped() {
    let mut server = TestRedis::spawn();
    let store = || {
        RedisStore::builder(&server.url)
            .prefix("fail")
            .build()
            .expect("store")
    };
    let fail_open = redis_app(store(), OnStoreError::FailOpen);
    let fail_closed = redis_app(
        store(),
        OnStoreError::FailClosed {
            retry_after: Duration::from_millis(1500),
        },
    );
    let fallback = redis_app(store(), OnStoreError::FallbackToMemory);
    // warm: all work while Redis is up
    for app in [&fail_open, &fail_closed, &fallback] {
        assert_eq!(
            send(app, from_peer("/", "192.0.2.1", None)).await.0,
            StatusCode::OK
        );
    }
    server.stop();
    for _ in 0..5 {
        assert_eq!(
            send(&fail_open, from_peer("/", "192.0.2.9", None)).await.0,
            StatusCode::OK,
            "fail-open lets requests through"
        );
    }
    let (status, headers, body) = send(&fail_closed, from_peer("/", "192.0.2.9", None)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "2", "1.5 s rounds up");
    assert!(body.contains("unavailable"), "{body}");
    // fallback: the same limit, enforced in this process
    let statuses: Vec<StatusCode> = futures::future::join_all(
        (0..4).map(|_| send(&fallback, from_peer("/", "192.0.2.9", None))),
    )
    .await
    .into_iter()
    .map(|r| r.0)
    .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == StatusCode::OK).count(),
        3,
        "{statuses:?}"
    );
}

#[tokio::test]
async fn layers_over_one_store_share_its_fallback() {
    let mut server = TestRedis::spawn();
    let store = RedisStore::builder(&server.url)
        .prefix("shared-fallback")
        .build()
        .expect("store");
    let per_ip = || {
        RateLimitLayer::builder()
            .store(store.clone())
            .limit(limit("per-ip", per_minute(2)), ClientIp::peer())
            .on_store_error(OnStoreError::FallbackToMemory)
            .timeout(Duration::from_millis(200))
            .build()
            .expect("layer")
    };
    let app = Router::new()
        .route("/a", get(|| async { "a" }).route_layer(per_ip()))
        .route("/b", get(|| async { "b" }).route_layer(per_ip()));
    server.stop();
    let mut statuses = Vec::new();
    for path in ["/a", "/a", "/b"] {
        let (status, headers, _) = send(&app, from_peer(path, "192.0.2.5", None)).await;
        assert!(headers.contains_key("ratelimit"), "decided in memory");
        statuses.push(status);
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ],
        "one per-ip limit across both routes, as with Redis up"
    );
}

async fn describe(info: RateLimitInfo) -> String {
    match info.decision() {
        Some(d) => format!(
            "{} left, store failed: {}",
            d.remaining(),
            info.store_failed()
        ),
        None => format!("no decision, store failed: {}", info.store_failed()),
    }
}

#[tokio::test]
async fn handlers_read_the_decision_under_every_policy() {
    let mut server = TestRedis::spawn();
    let app = |policy: OnStoreError| {
        let layer = RateLimitLayer::builder()
            .store(
                RedisStore::builder(&server.url)
                    .prefix("info")
                    .build()
                    .expect("store"),
            )
            .rule(
                Rule::new(limit("per-ip", per_minute(3)), ClientIp::peer())
                    .on_missing_key(MissingKey::Skip),
            )
            .on_store_error(policy)
            .timeout(Duration::from_millis(200))
            .build()
            .expect("layer");
        Router::new().route("/", get(describe)).layer(layer)
    };
    let fail_open = app(OnStoreError::FailOpen);
    let fallback = app(OnStoreError::FallbackToMemory);
    let peer = || from_peer("/", "192.0.2.7", None);
    let (status, _, body) = send(&fail_open, peer()).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "2 left, store failed: false")
    );
    // every limit skipped (no peer address): forwarded without a decision
    let (status, _, body) = send(&fail_open, request("/")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "no decision, store failed: false")
    );
    server.stop();
    let (status, _, body) = send(&fail_open, peer()).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "no decision, store failed: true")
    );
    let (status, _, body) = send(&fallback, peer()).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "2 left, store failed: true")
    );
    // outside any layer: no decision, still no rejection
    let bare = Router::new().route("/", get(describe));
    let (status, _, body) = send(&bare, request("/")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "no decision, store failed: false")
    );
}

#[tokio::test]
async fn a_503_does_not_reveal_the_store_error() {
    let mut server = TestRedis::spawn();
    let app = redis_app(
        RedisStore::builder(&server.url)
            .prefix("leak")
            .build()
            .expect("store"),
        OnStoreError::default(),
    );
    assert_eq!(
        send(&app, from_peer("/", "192.0.2.1", None)).await.0,
        StatusCode::OK
    );
    server.stop();
    let (status, headers, body) = send(&app, from_peer("/", "192.0.2.1", None)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["content-type"], "application/problem+json");
    let problem: serde_json::Value = serde_json::from_str(&body).expect("json body");
    assert_eq!(
        problem["detail"],
        "The rate limiter is temporarily unavailable; retry later."
    );
    let lower = body.to_lowercase();
    for leak in [
        "redis",
        "refused",
        "os error",
        "connection",
        "127.0.0.1",
        &server.port.to_string(),
    ] {
        assert!(!lower.contains(leak), "{leak:?} in {body}");
    }
}

#[tokio::test]
async fn a_paused_redis_costs_at_most_the_timeout() {
    let server = TestRedis::spawn();
    let app = redis_app(
        RedisStore::builder(&server.url)
            .prefix("slow")
            .build()
            .expect("store"),
        OnStoreError::default(),
    );
    assert_eq!(
        send(&app, from_peer("/", "192.0.2.1", None)).await.0,
        StatusCode::OK
    );
    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connect");
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(3000)
        .arg("ALL")
        .query(&mut conn)
        .expect("pause");
    // The request is answered by the fail-closed policy once the 200 ms
    // store timeout fires, while Redis stays paused for 3 s (without the
    // timeout it would be granted once Redis answers).
    let (status, _, body) = send(&app, from_peer("/", "192.0.2.1", None)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("temporarily unavailable"), "{body}");
    assert!(!body.contains("200ms"), "no internal error text: {body}");
    let _: () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query(&mut conn)
        .expect("unpause");
}

#[tokio::test]
async fn nested_layers_each_report_their_limits() {
    let app = Router::new()
        .route(
            "/inner",
            get(|| async { "in" })
                .route_layer(RateLimitLayer::new(limit("route", per_minute(1)), Global)),
        )
        .layer(RateLimitLayer::new(limit("global", per_minute(10)), Global));
    let (status, headers, _) = send(&app, request("/inner")).await;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<String> = sf_list(&headers, "ratelimit-policy")
        .into_iter()
        .map(|p| p.0)
        .collect();
    assert_eq!(names, ["route", "global"]);
    let (status, headers, _) = send(&app, request("/inner")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let state = sf_list(&headers, "ratelimit");
    assert_eq!(
        state
            .iter()
            .map(|s| (s.0.as_str(), param(s, "r")))
            .collect::<Vec<_>>(),
        [("route", 0), ("global", 8)]
    );
}

#[test]
fn denials_and_store_failures_are_traced() {
    let events = Events::capture();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let app = hello_app(RateLimitLayer::new(limit("api", per_minute(1)), Global));
        send(&app, request("/")).await;
        assert!(events.ours().is_empty(), "a grant is not an event");
        send(&app, request("/")).await;
        // a store that cannot be reached: port 1 refuses connections
        let down = RedisStore::builder("redis://127.0.0.1:1/")
            .build()
            .expect("store");
        let app = redis_app(down, OnStoreError::FailOpen);
        assert_eq!(
            send(&app, from_peer("/", "192.0.2.1", None)).await.0,
            StatusCode::OK
        );
    });
    let ours = events.ours();
    let levels: Vec<_> = ours.iter().map(|(level, _)| *level).collect();
    assert_eq!(
        levels,
        [tracing::Level::DEBUG, tracing::Level::WARN],
        "{ours:?}"
    );
}

#[test]
fn a_store_outage_is_logged_when_it_begins_and_ends_not_per_request() {
    let events = Events::capture();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut server = TestRedis::spawn();
    let failed = runtime.block_on(async {
        let layer = RateLimitLayer::builder()
            .store(
                RedisStore::builder(&server.url)
                    .prefix("outage")
                    .build()
                    .expect("store"),
            )
            .limit(limit("per-ip", per_minute(1000)), ClientIp::peer())
            .on_store_error(OnStoreError::FailOpen)
            .timeout(Duration::from_millis(500))
            // no periodic line in this test, however slow the machine
            .store_error_log_interval(Duration::from_secs(3600))
            .build()
            .expect("layer");
        let app = hello_app(layer);
        // decided requests carry RateLimit fields; failed-open ones do not
        let decided = |headers: &HeaderMap| headers.contains_key("ratelimit");
        let (status, headers, _) = send(&app, from_peer("/", "192.0.2.1", None)).await;
        assert!(status == StatusCode::OK && decided(&headers));
        // what the outage logs: the events from here on
        let before = events.ours().len();
        server.stop();
        for _ in 0..50 {
            let (status, headers, _) = send(&app, from_peer("/", "192.0.2.1", None)).await;
            assert!(status == StatusCode::OK && !decided(&headers));
        }
        let levels: Vec<_> = events.ours()[before..]
            .iter()
            .map(|(level, _)| *level)
            .collect();
        assert_eq!(levels, [tracing::Level::WARN], "50 failures, one line");
        server.restart();
        // until the store has replaced its dead connections, requests still fail
        for failed in 50..150 {
            let (_, headers, _) = send(&app, from_peer("/", "192.0.2.1", None)).await;
            if decided(&headers) {
                return failed;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the store did not recover after Redis restarted");
    });
    // info and above: the outage's lines (debug has the library loads)
    let ours: Vec<_> = events
        .ours()
        .into_iter()
        .filter(|(level, _)| *level <= tracing::Level::INFO)
        .collect();
    let levels: Vec<_> = ours.iter().map(|(level, _)| *level).collect();
    assert_eq!(
        levels,
        [tracing::Level::WARN, tracing::Level::INFO],
        "{ours:?}"
    );
    assert!(ours[0].1.contains("letting requests through"), "{ours:?}");
    assert!(
        ours[1].1.contains(&format!("failed_requests={failed}")),
        "{failed} failed requests: {ours:?}"
    );
}

/// A hot global rule (`Limit::with_hot_key`) on two instances of a service: requests
/// are answered from batches, few reach Redis, every response carries the
/// RateLimit fields, and the fleet refuses once the limit is spent.
#[tokio::test]
async fn a_hot_global_rule_answers_from_batches() {
    let global = limit("global", per_minute(300))
        .with_hot_key(tower_ratelimit::HotKey::new(25, Duration::from_secs(1)).unwrap())
        .unwrap();
    // a server of its own: it counts the calls
    let server = TestRedis::spawn();
    let prefix = unique_prefix("layer-hot");
    let instance = || {
        let store = RedisStore::builder(server.url.clone())
            .prefix(&prefix)
            .coalesce_decisions(false)
            .build()
            .expect("store");
        hello_app(
            RateLimitLayer::builder()
                .store(store)
                .limit(global.clone(), Global)
                // (patient: a refill timed out on a loaded machine would
                // let its request through, failing open)
                .timeout(common::PATIENT)
                .build()
                .expect("layer"),
        )
    };
    let apps = [instance(), instance()];
    let calls_so_far = || {
        let client = redis::Client::open(server.url.as_str()).expect("a Redis URL");
        common::command_calls(&mut client.get_connection().expect("a connection"), "fcall")
    };
    let before = calls_so_far();
    let mut ok = 0;
    for i in 0..400 {
        let (status, headers, _) = send(&apps[i % 2], request("/")).await;
        if status == StatusCode::OK {
            ok += 1;
            assert!(param(&sf_list(&headers, "ratelimit")[0], "r") < 300);
        } else {
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
            assert!(headers.contains_key("retry-after"));
        }
    }
    let calls = calls_so_far() - before;
    assert_eq!(ok, 300, "the fleet grants the limit, no more");
    assert!(calls <= 40, "{calls} calls of Redis for 400 requests");
}

/// A key that comes out empty (a request extension whose text is empty)
/// is no key: the rule's missing-key policy applies (400 by default, or
/// skipped, or the shared key), and no empty key is ever decided. Before,
/// every such request shared one bucket under the empty key. A shared key
/// that is empty is a configuration error.
#[tokio::test]
async fn an_empty_key_gets_the_missing_key_policy() {
    let store = MemoryStore::new();
    let layer = |policy: MissingKey| {
        RateLimitLayer::builder()
            .store(store.clone())
            .rule(
                Rule::new(limit("per-user", per_minute(1)), Ext::<UserId>::new())
                    .on_missing_key(policy),
            )
            .build()
    };
    let reject = hello_app(layer(MissingKey::default()).expect("layer"));
    for _ in 0..3 {
        let (status, _, body) = send(&reject, as_user(request("/"), "")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    }
    let skip = hello_app(layer(MissingKey::Skip).expect("layer"));
    for _ in 0..3 {
        assert_eq!(
            send(&skip, as_user(request("/"), "")).await.0,
            StatusCode::OK
        );
    }
    let shared = hello_app(layer(MissingKey::Shared("anonymous".into())).expect("layer"));
    assert_eq!(
        send(&shared, as_user(request("/"), "")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&shared, as_user(request("/"), "")).await.0,
        StatusCode::TOO_MANY_REQUESTS,
        "the keyless requests share one limit"
    );
    // a real key is decided apart from them
    assert_eq!(
        send(&shared, as_user(request("/"), "ann")).await.0,
        StatusCode::OK
    );
    assert!(matches!(
        layer(MissingKey::Shared(String::new())),
        Err(ConfigError::Layer(_))
    ));
}
