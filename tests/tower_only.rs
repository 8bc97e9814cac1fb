//! The layer over a plain Tower service of `http` types, no web framework:
//! what a user of `--no-default-features` (no axum, no Redis) gets.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, ServiceExt};
use tower_ratelimit::key::{ClientIp, Global};
use tower_ratelimit::layer::{RateLimitLayer, Rejection};
use tower_ratelimit::{Limit, Quota};

async fn hello(_: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::from("hello")))
}

fn from(peer: [u8; 4]) -> Request<Full<Bytes>> {
    let mut request = Request::new(Full::default());
    request
        .extensions_mut()
        .insert(SocketAddr::from((peer, 40_000)));
    request
}

async fn call(
    layer: &RateLimitLayer,
    request: Request<Full<Bytes>>,
) -> (StatusCode, http::HeaderMap, String) {
    let response = layer
        .layer(service_fn(hello))
        .oneshot(request)
        .await
        .expect("infallible");
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.expect("body").to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8(bytes.to_vec()).expect("utf-8"),
    )
}

#[tokio::test]
async fn a_plain_http_service_is_limited_with_a_problem_body() {
    let limit = Limit::new("api", Quota::per_minute(2).sliding_log()).expect("limit");
    let layer = RateLimitLayer::new(limit, ClientIp::peer());
    for _ in 0..2 {
        let (status, headers, body) = call(&layer, from([192, 0, 2, 1])).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "hello"));
        assert!(headers.contains_key("ratelimit-policy"), "{headers:?}");
    }
    let (status, headers, body) = call(&layer, from([192, 0, 2, 1])).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(headers.contains_key("retry-after"));
    let problem: serde_json::Value = serde_json::from_str(&body).expect("json body");
    assert_eq!(problem["violated-policies"], serde_json::json!(["api"]));
    // the peer comes from a plain SocketAddr extension: another peer has its own limit
    let (status, _, _) = call(&layer, from([192, 0, 2, 2])).await;
    assert_eq!(status, StatusCode::OK);
    // no peer address: the default MissingKey policy answers 400
    let (status, _, _) = call(&layer, Request::new(Full::default())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_custom_rejection_can_use_any_body_type() {
    let limit = Limit::new("api", Quota::per_minute(1).allow_burst(1).gcra()).expect("limit");
    let layer = RateLimitLayer::builder()
        .limit(limit, Global)
        .on_rejection(|why: &Rejection<'_>| {
            let mut response = Response::new(Full::from(match why {
                Rejection::Limited(_) => "slow down",
                _ => "unavailable",
            }));
            *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            response
        })
        .build()
        .expect("layer");
    assert_eq!(call(&layer, from([192, 0, 2, 1])).await.0, StatusCode::OK);
    let (status, headers, body) = call(&layer, from([192, 0, 2, 1])).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::TOO_MANY_REQUESTS, "slow down")
    );
    assert!(headers.contains_key("retry-after"), "{headers:?}");
}
