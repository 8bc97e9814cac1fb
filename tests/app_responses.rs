//! A handler that calls the limiter itself answers as the layer does:
//! `Decision::insert_headers` writes the fields the layer writes on a
//! forwarded response, `layer::Unavailable::of` is the layer's fail-closed 503.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{HeaderMap, Request, Response, StatusCode};
use tower::{service_fn, Layer, ServiceExt};
use tower_ratelimit::key::Global;
use tower_ratelimit::layer::{OnStoreError, RateLimitInfo, RateLimitLayer, Unavailable};
use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota, RedisStore, Store};

const FIELDS: [&str; 5] = [
    "ratelimit-policy",
    "ratelimit",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];

fn limits() -> Vec<Limit> {
    vec![
        Limit::new("sms-burst", Quota::per_minute(3).sliding_log()).expect("limit"),
        Limit::new("sms-daily", Quota::per_calendar_day(20).fixed_window()).expect("limit"),
        // left out of the fields, by the layer and by the decision
        Limit::new("sms-trial", Quota::per_hour(1).fixed_window())
            .expect("limit")
            .shadow(),
    ]
}

/// The rate-limit fields among `headers`, each with all its lines.
fn fields(headers: &HeaderMap) -> Vec<(&'static str, Vec<String>)> {
    FIELDS
        .iter()
        .map(|name| {
            let lines = headers
                .get_all(*name)
                .iter()
                .map(|v| v.to_str().expect("text").to_owned())
                .collect();
            (*name, lines)
        })
        .collect()
}

/// A granted decision's fields, written by the handler, equal those the
/// layer writes on the response it forwards with that decision; and a
/// limiter called directly on another store gives the same fields.
#[tokio::test]
async fn a_granted_decision_gives_the_fields_the_layer_sends() {
    let layer = limits()
        .into_iter()
        .fold(
            RateLimitLayer::builder().store(MemoryStore::new()),
            |builder, limit| builder.limit(limit, Global),
        )
        .build()
        .expect("layer");
    let direct = limits()
        .into_iter()
        .fold(Limiter::builder(MemoryStore::new()), |builder, limit| {
            builder.limit(limit)
        })
        .build()
        .expect("limiter");
    let written = Arc::new(Mutex::new(HeaderMap::new()));
    let handler_written = written.clone();
    let service = layer.layer(service_fn(move |request: Request<String>| {
        let written = handler_written.clone();
        async move {
            let info = request.extensions().get::<RateLimitInfo>().cloned();
            let decision = info.and_then(RateLimitInfo::into_decision);
            let mut headers = HeaderMap::new();
            decision.expect("a decision").insert_headers(&mut headers);
            *written.lock().expect("lock") = headers;
            let mut response = Response::new(String::from("queued"));
            *response.status_mut() = StatusCode::ACCEPTED;
            Ok::<_, Infallible>(response)
        }
    }));
    for _ in 0..3 {
        let request = Request::new(String::new());
        let response = service.clone().oneshot(request).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::ACCEPTED);
        let sent = fields(response.headers());
        let handler = written.lock().expect("lock").clone();
        assert_eq!(fields(&handler), sent);
        assert!(sent[0].1[0].contains("sms-daily"), "{sent:?}");
        assert!(!sent[0].1[0].contains("sms-trial"), "{sent:?}");
        assert!(sent[2].1.is_empty(), "no legacy fields by default");
        let decision = direct.check("global", 1).await.expect("a decision");
        assert!(decision.is_allowed());
        let mut own = HeaderMap::new();
        decision.insert_headers(&mut own);
        assert_eq!(fields(&own), sent);
    }
}

/// The layer's fail-closed answer, sent for a request.
async fn layer_answer(store: impl Into<Store>, on_error: OnStoreError) -> Response<String> {
    let limit = Limit::new("sms", Quota::per_hour(3).fixed_window()).expect("limit");
    let layer = RateLimitLayer::builder()
        .store(store)
        .limit(limit, Global)
        .on_store_error(on_error)
        .build()
        .expect("layer");
    let service = layer.layer(service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let response = service
        .oneshot(Request::new(String::new()))
        .await
        .expect("infallible");
    let (parts, body) = response.into_parts();
    let body = http_body_util::BodyExt::collect(body)
        .await
        .expect("body")
        .to_bytes();
    Response::from_parts(parts, String::from_utf8(body.to_vec()).expect("text"))
}

/// `layer::Unavailable::of` is the 503 the layer sends when its store fails and
/// it fails closed: status, headers and body, `Retry-After` as configured,
/// nothing of the error.
#[tokio::test]
async fn a_store_error_gives_the_layers_503() {
    // nothing listens on port 1
    let down = || RedisStore::new("redis://127.0.0.1:1/").expect("store");
    let limit = Limit::new("sms", Quota::per_hour(3).fixed_window()).expect("limit");
    let error = Limiter::new(down(), limit)
        .check("+15550100", 1)
        .await
        .expect_err("the store is down");
    let five = Duration::from_secs(5);
    for (on_error, own) in [
        (OnStoreError::default(), Unavailable::of(&error)),
        (
            OnStoreError::FailClosed { retry_after: five },
            Unavailable::of(&error).retry_after(five),
        ),
    ] {
        let sent = layer_answer(down(), on_error).await;
        let own: Response<String> = own.into();
        assert_eq!(own.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(own.status(), sent.status());
        assert_eq!(own.headers(), sent.headers());
        assert_eq!(own.body(), sent.body());
        let body = own.body();
        for internal in ["127.0.0.1", "Redis", "refused", &error.to_string()] {
            assert!(!body.contains(internal), "{internal:?} in {body}");
        }
    }
}
