//! Estimates settled after the response (`settle_estimates`): a request
//! pays its estimate (here a request header, as an LLM call's
//! `max_tokens`) when it arrives, and its actual cost (a response header)
//! once known: the surplus given back, the shortfall charged, at most a
//! share of the budget more. On the memory store and on Redis.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::HeaderMap;
use axum::routing::get;
use axum::Router;
use common::{patient_limiter, settles_to, unique_prefix, PATIENT};
use http::{HeaderName, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_ratelimit::key::Global;
use tower_ratelimit::layer::{RateLimitLayer, Rule};
use tower_ratelimit::{ConfigError, Limit, Limiter, MemoryStore, Quota, Store};

const ESTIMATE: &str = "x-max-tokens";
const USED: &str = "x-tokens-used";

fn tokens() -> Limit {
    Limit::new("tokens", Quota::per_hour(1000).fixed_window()).expect("limit")
}

/// A layer over `store` whose requests pay their `x-max-tokens` and settle
/// to their `x-tokens-used`, at most `share` of the budget more.
fn layer(store: impl Into<Store>, share: f64) -> RateLimitLayer {
    RateLimitLayer::builder()
        .store(store)
        .timeout(PATIENT)
        .rule(
            Rule::new(tokens(), Global)
                .cost_from_request_header(HeaderName::from_static(ESTIMATE))
                .cost_from_response_header(HeaderName::from_static(USED))
                .settle_estimates(share),
        )
        .build()
        .expect("layer")
}

/// An app answering `x-tokens-used` with what the request's `x-used` says
/// (none when it says nothing).
fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route(
            "/complete",
            get(|headers: HeaderMap| async move {
                let mut response = axum::response::Response::new(Body::from("done"));
                if let Some(used) = headers.get("x-used") {
                    response.headers_mut().insert(USED, used.clone());
                }
                response
            }),
        )
        .layer(layer)
}

fn call(estimate: u64, used: Option<u64>) -> Request<Body> {
    let mut request = Request::get("/complete").header(ESTIMATE, estimate.to_string());
    if let Some(used) = used {
        request = request.header("x-used", used.to_string());
    }
    request.body(Body::empty()).expect("request")
}

/// Makes a layer (a new handle on one test's store) settling estimates
/// with a share.
type MakeLayer = Arc<dyn Fn() -> Box<dyn FnOnce(f64) -> RateLimitLayer> + Send + Sync>;

/// Both stores, each made anew per test: the memory store and a Redis one.
fn stores(test: &str) -> Vec<(&'static str, MakeLayer, Limiter)> {
    let memory = MemoryStore::new();
    let prefix = unique_prefix(test);
    let memory_looker = patient_limiter(memory.clone(), tokens());
    let redis_looker = patient_limiter(common::redis_store(&prefix), tokens());
    vec![
        (
            "memory",
            Arc::new(move || {
                let memory = memory.clone();
                Box::new(move |share| layer(memory, share))
            }),
            memory_looker,
        ),
        (
            "redis",
            Arc::new(move || {
                let prefix = prefix.clone();
                Box::new(move |share| layer(common::redis_store(&prefix), share))
            }),
            redis_looker,
        ),
    ]
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, String) {
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// An estimate over the cost gives the rest back; one under it charges the
/// rest; a response that tells no cost keeps the estimate.
#[tokio::test]
async fn an_estimate_is_settled_to_the_cost_the_response_tells() {
    for (store, make, looker) in stores("estimates-settle") {
        let app = app(make()(0.5));
        // 100 estimated, 30 used: 70 back
        assert_eq!(send(&app, call(100, Some(30))).await.0, StatusCode::OK);
        settles_to(&looker, 970, store).await;
        // 100 estimated, 150 used: 50 more
        assert_eq!(send(&app, call(100, Some(150))).await.0, StatusCode::OK);
        settles_to(&looker, 820, store).await;
        // 100 estimated, nothing told: the estimate stays
        assert_eq!(send(&app, call(100, None)).await.0, StatusCode::OK);
        settles_to(&looker, 720, store).await;
    }
}

/// An estimate over the share one request may take is answered 400 (the
/// client must ask for less) with a problem body saying so, taking nothing;
/// a cost over the estimate is charged in full (the share caps only what a
/// request may ask for).
#[tokio::test]
async fn one_request_takes_at_most_its_share_of_the_budget() {
    for (store, make, looker) in stores("estimates-share") {
        let app = app(make()(0.1));
        let (status, body) = send(&app, call(101, Some(1))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{store}");
        let problem: serde_json::Value = serde_json::from_str(&body).expect("a problem body");
        assert_eq!(problem["status"], 400, "{store}: {body}");
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("101") && detail.contains("at most 100") && detail.contains("tokens"),
            "{store}: {body}"
        );
        settles_to(&looker, 1000, store).await;
        // 10 estimated, 900 used: charged 10, then the 890 more
        assert_eq!(send(&app, call(10, Some(900))).await.0, StatusCode::OK);
        settles_to(&looker, 100, store).await;
    }
}

/// A request dropped before its response (the client went away) keeps its
/// estimate.
#[tokio::test]
async fn a_request_dropped_before_its_response_keeps_its_estimate() {
    for (store, make, looker) in stores("estimates-dropped") {
        let entered = Arc::new(tokio::sync::Notify::new());
        let handler_entered = entered.clone();
        let slow = Router::new()
            .route(
                "/complete",
                get(move || async move {
                    handler_entered.notify_one();
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    ([(USED, "1")], "done")
                }),
            )
            .layer(make()(0.5));
        let request = slow.oneshot(call(100, None));
        tokio::select! {
            _ = request => panic!("{store}: the handler answered"),
            () = entered.notified() => {}
        }
        // the request, granted and in its handler, is dropped
        settles_to(&looker, 900, store).await;
    }
}

/// 100 requests at once on two instances over one budget of 1000, each
/// estimating 50: exactly 20 are granted (the budget over the estimate),
/// the others refused; once their responses tell their costs (10 of 20,
/// 10 of 70), the budget holds exactly what they used. The overshoot while
/// they ran was at most the sum of cost less estimate over those in flight
/// (10 × 20), each at most half the budget (the share).
#[tokio::test]
async fn a_hundred_requests_at_once_on_two_instances_settle_exactly() {
    for (store, make, looker) in stores("estimates-fleet") {
        let entered = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let instance = || {
            let (entered, release) = (entered.clone(), release.clone());
            Router::new()
                .route(
                    "/complete",
                    get(move || {
                        let (entered, release) = (entered.clone(), release.clone());
                        async move {
                            let n = entered.fetch_add(1, Ordering::SeqCst);
                            let permit = release.acquire().await.expect("open");
                            permit.forget();
                            let used = if n < 10 { "20" } else { "70" };
                            ([(USED, used)], "done")
                        }
                    }),
                )
                .layer(make()(0.5))
        };
        let apps = [instance(), instance()];
        let refused = Arc::new(AtomicUsize::new(0));
        let calls: Vec<_> = (0..100)
            .map(|i| {
                let (app, refused) = (apps[i % 2].clone(), refused.clone());
                tokio::spawn(async move {
                    let (status, _) = send(&app, call(50, None)).await;
                    if status == StatusCode::TOO_MANY_REQUESTS {
                        refused.fetch_add(1, Ordering::SeqCst);
                    }
                    status
                })
            })
            .collect();
        // every request decided: the granted wait in their handlers
        let until = tokio::time::Instant::now() + PATIENT;
        while entered.load(Ordering::SeqCst) + refused.load(Ordering::SeqCst) < 100 {
            assert!(
                tokio::time::Instant::now() < until,
                "{store}: not all decided"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(entered.load(Ordering::SeqCst), 20, "{store}: granted");
        release.add_permits(100);
        let mut granted = 0;
        for call in calls {
            if call.await.expect("task") == StatusCode::OK {
                granted += 1;
            }
        }
        assert_eq!(granted, 20, "{store}");
        settles_to(&looker, 1000 - (10 * 20 + 10 * 70), store).await;
    }
}

/// A share outside (0, 1], or estimates without a rule that reads the cost
/// after the response, is a build error.
#[test]
fn estimates_need_a_share_and_a_cost_after_the_response() {
    for share in [0.0, -0.5, 1.5, f64::NAN] {
        let built = RateLimitLayer::builder()
            .rule(
                Rule::new(tokens(), Global)
                    .cost_from_response_header(HeaderName::from_static(USED))
                    .settle_estimates(share),
            )
            .build();
        assert!(matches!(built, Err(ConfigError::Layer(_))), "{share}");
    }
    let built = RateLimitLayer::builder()
        .rule(Rule::new(tokens(), Global).settle_estimates(0.5))
        .build();
    assert!(matches!(built, Err(ConfigError::Layer(_))));
}
