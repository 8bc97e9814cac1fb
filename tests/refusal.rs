//! `layer::Refusal::of`: a handler that calls the limiter itself answers a
//! refusal exactly as the layer does (status, `Retry-After`, rate-limit
//! fields, problem body), on both stores.

mod common;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use common::{patient_limiter, redis_store_with_clock, unique_prefix, PATIENT};
use tower::ServiceExt;
use tower_ratelimit::key::Header;
use tower_ratelimit::layer::{RateLimitLayer, Refusal};
use tower_ratelimit::{Limit, Limiter, ManualClock, MemoryStore, Quota, Store};

const T0: i64 = 1_700_000_000_000_000;

fn login() -> Limit {
    Limit::new("login", Quota::per_minute(2).sliding_log()).expect("valid")
}

/// A store on `clock`, by name; `test` keeps Redis keys apart.
fn store(kind: &str, clock: &ManualClock, test: &str) -> Box<dyn Fn() -> Box<dyn StoreBox>> {
    let (kind, clock, test) = (kind.to_owned(), clock.clone(), test.to_owned());
    Box::new(move || -> Box<dyn StoreBox> {
        if kind == "memory" {
            let store = MemoryStore::builder().clock(clock.clone()).build();
            Box::new(store.expect("memory store"))
        } else {
            Box::new(redis_store_with_clock(&unique_prefix(&test), &clock))
        }
    })
}

/// A store that builds a layer and a limiter (each store type has its own
/// builder calls).
trait StoreBox {
    fn layer(&self, limit: Limit) -> RateLimitLayer;
    fn limiter(&self, limit: Limit) -> Limiter;
}

impl<S: Into<Store> + Clone> StoreBox for S {
    fn layer(&self, limit: Limit) -> RateLimitLayer {
        let key = Header::new(HeaderName::from_static("x-user"));
        let builder = RateLimitLayer::builder()
            .store(self.clone())
            .timeout(PATIENT);
        builder.limit(limit, key).build().expect("a layer")
    }

    fn limiter(&self, limit: Limit) -> Limiter {
        patient_limiter(self.clone(), limit)
    }
}

/// The handler of the direct route: checks the limiter with the cost in
/// `x-cost`, answers its refusal, or 200.
async fn direct(State(limiter): State<Limiter>, headers: HeaderMap) -> Response {
    let header = |name: &str| headers.get(name)?.to_str().ok();
    let cost = header("x-cost").and_then(|c| c.parse().ok()).unwrap_or(1);
    let user = header("x-user").unwrap_or_default().to_owned();
    let decision = limiter.check(user, cost).await.expect("decided");
    match Refusal::of(&decision) {
        Some(refusal) => refusal.into_response(),
        None => StatusCode::OK.into_response(),
    }
}

async fn send(app: &Router, path: &str, cost: u64) -> (StatusCode, Vec<(String, String)>, String) {
    let request = Request::get(path)
        .header("x-user", "ann")
        .header("x-cost", cost.to_string())
        .body(Body::empty())
        .expect("request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let mut headers: Vec<(String, String)> = response
        .headers()
        .iter()
        .filter(|(name, _)| *name != "content-length")
        .map(|(name, value)| {
            let value = value.to_str().expect("text").to_owned();
            (name.as_str().to_owned(), value)
        })
        .collect();
    headers.sort();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    (
        status,
        headers,
        String::from_utf8(body.to_vec()).expect("utf-8"),
    )
}

async fn the_handlers_refusal_is_the_layers(kind: &str) {
    let clock = ManualClock::new(T0);
    let stores = store(kind, &clock, "refusal");
    let (for_layer, for_limiter) = (stores(), stores());
    let app = Router::new()
        .route(
            "/layer",
            get(|| async { "ok" }).route_layer(for_layer.layer(login())),
        )
        .route("/direct", get(direct))
        .with_state(for_limiter.limiter(login()));
    for path in ["/layer", "/direct"] {
        for _ in 0..2 {
            assert_eq!(send(&app, path, 1).await.0, StatusCode::OK, "{kind} {path}");
        }
    }
    clock.advance(std::time::Duration::from_millis(1500));
    let by_layer = send(&app, "/layer", 1).await;
    let by_handler = send(&app, "/direct", 1).await;
    assert_eq!(by_layer.0, StatusCode::TOO_MANY_REQUESTS, "{kind}");
    assert_eq!(by_handler, by_layer, "{kind}");
    let header = |name: &str| {
        let found = by_handler.1.iter().find(|(n, _)| n == name);
        found.map(|(_, v)| v.as_str())
    };
    assert_eq!(header("retry-after"), Some("59"), "{kind}");
    assert_eq!(header("ratelimit"), Some("\"login\";r=0;t=59"), "{kind}");
    assert_eq!(
        header("ratelimit-policy"),
        Some("\"login\";q=2;w=60"),
        "{kind}"
    );
    assert_eq!(
        header("content-type"),
        Some("application/problem+json"),
        "{kind}"
    );
    let problem: serde_json::Value = serde_json::from_str(&by_handler.2).expect("JSON");
    assert_eq!(problem["violated-policies"], serde_json::json!(["login"]));

    // a cost that can never fit: 429 without Retry-After
    let never = send(&app, "/direct", 3).await;
    assert_eq!(never.0, StatusCode::TOO_MANY_REQUESTS, "{kind}");
    assert!(never.1.iter().all(|(n, _)| n != "retry-after"), "{kind}");
    assert!(never.2.contains("can ever grant"), "{kind}: {}", never.2);
}

#[tokio::test]
async fn the_handlers_refusal_is_the_layers_in_memory() {
    the_handlers_refusal_is_the_layers("memory").await;
}

#[tokio::test]
async fn the_handlers_refusal_is_the_layers_in_redis() {
    the_handlers_refusal_is_the_layers("redis").await;
}

#[tokio::test]
async fn an_allowed_decision_has_no_refusal_and_shadow_limits_are_not_shown() {
    let shadow = Limit::new("trial", Quota::per_minute(1).sliding_log())
        .expect("valid")
        .shadow();
    let limiter = Limiter::builder(MemoryStore::new())
        .limit(login())
        .limit(shadow)
        .build()
        .expect("a limiter");
    assert!(Refusal::of(&limiter.check("ann", 1).await.expect("decided")).is_none());
    // refused by the shadow limit only: allowed, no refusal
    assert!(Refusal::of(&limiter.check("ann", 1).await.expect("decided")).is_none());
    let refusal = Refusal::of(&limiter.check("ann", 1).await.expect("decided"));
    let response: axum::http::Response<String> = refusal.expect("refused by login").into();
    let ratelimit = response.headers()["ratelimit"].to_str().expect("text");
    assert!(
        ratelimit.starts_with("\"login\"") && !ratelimit.contains("trial"),
        "{ratelimit}"
    );
}
