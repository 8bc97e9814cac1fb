//! gRPC answers (feature `grpc`): tonic's health service behind the layer,
//! served by tonic's transport and called by its real client. A refusal is
//! `RESOURCE_EXHAUSTED` with `google.rpc.RetryInfo`, a store failure
//! (fail-closed) `UNAVAILABLE`, a missing key `INVALID_ARGUMENT`; plain HTTP
//! requests to the same server still get the HTTP answers.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tonic::transport::server::TcpIncoming;
use tonic::Code;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_types::StatusExt;
use tower::ServiceExt;
use tower_ratelimit::key::{Global, Header};
use tower_ratelimit::layer::{OnStoreError, RateLimitLayer, Rejection, Rule};
use tower_ratelimit::{Limit, Quota, RedisStore};

const WINDOW: Duration = Duration::from_secs(60);

fn per_window(n: u64) -> Limit {
    Limit::new("grpc-api", Quota::rate(n, WINDOW).allow_burst(n).gcra()).expect("valid limit")
}

/// Serves tonic's health service behind `layer` (HTTP/1 accepted too, for
/// the plain requests) on a free local port.
async fn serve(layer: RateLimitLayer) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        tonic::transport::Server::builder()
            .accept_http1(true)
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    addr
}

async fn client(addr: SocketAddr) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    HealthClient::new(channel)
}

async fn check(client: &mut HealthClient<tonic::transport::Channel>) -> Result<(), tonic::Status> {
    client
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(|_| ())
}

/// A refusal carries `cache-control: no-store`, as every HTTP refusal.
fn assert_no_store(status: &tonic::Status) {
    let value = status.metadata().get("cache-control");
    assert_eq!(
        value.and_then(|v| v.to_str().ok()),
        Some("no-store"),
        "{status:?}"
    );
}

/// A plain HTTP/1 GET to `addr`.
async fn http_get(addr: SocketAddr) -> (StatusCode, http::HeaderMap, String) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let response = client
        .get(format!("http://{addr}/").parse().expect("uri"))
        .await
        .expect("HTTP request");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

#[tokio::test]
async fn a_refused_call_is_resource_exhausted_with_its_retry_delay() {
    let addr = serve(RateLimitLayer::new(per_window(2), Global)).await;
    let mut client = client(addr).await;
    for i in 0..2 {
        assert!(check(&mut client).await.is_ok(), "call {i} is granted");
    }
    let status = check(&mut client)
        .await
        .expect_err("the third call is refused");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("grpc-api"), "{status:?}");
    let retry = status.get_details_retry_info().expect("RetryInfo");
    let delay = retry.retry_delay.expect("a retry delay");
    assert!(delay > Duration::ZERO && delay <= WINDOW, "{delay:?}");
    // the rate-limit fields travel as metadata
    let metadata = status.metadata();
    assert!(metadata.get("ratelimit").is_some(), "{metadata:?}");
    assert!(metadata.get("ratelimit-policy").is_some(), "{metadata:?}");
    assert!(metadata.get("retry-after").is_some(), "{metadata:?}");
    // never stored by a cache, as the HTTP 429
    assert_no_store(&status);

    // A plain HTTP request to the same server and limit: the HTTP 429.
    let (code, headers, body) = http_get(addr).await;
    assert_eq!(code, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(headers["cache-control"], "no-store");
    assert!(headers.contains_key("retry-after"));
    assert!(!headers.contains_key("grpc-status"));
    assert!(body.contains("grpc-api"), "{body}");
}

#[tokio::test]
async fn a_cost_that_can_never_fit_is_resource_exhausted_without_retry_info() {
    let layer = RateLimitLayer::builder()
        .rule(Rule::new(per_window(2), Global).cost_from_request(|_| Some(3)))
        .build()
        .expect("layer");
    let mut client = client(serve(layer).await).await;
    let status = check(&mut client).await.expect_err("refused");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.get_details_retry_info().is_none(), "{status:?}");
    assert!(status.metadata().get("retry-after").is_none());
    assert_no_store(&status);
}

#[tokio::test]
async fn a_store_failure_closed_is_unavailable_with_the_configured_delay() {
    // A port that accepts connections and never answers: every decision
    // times out (200 ms), and the layer fails closed.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("redis://{}/", silent.local_addr().expect("address"));
    let layer = RateLimitLayer::builder()
        .store(RedisStore::builder(&url).build().expect("store"))
        .limit(per_window(2), Global)
        .on_store_error(OnStoreError::FailClosed {
            retry_after: Duration::from_millis(1500),
        })
        .timeout(Duration::from_millis(200))
        .build()
        .expect("layer");
    let addr = serve(layer).await;
    let mut client = client(addr).await;
    let status = check(&mut client).await.expect_err("refused");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let retry = status.get_details_retry_info().expect("RetryInfo");
    assert_eq!(retry.retry_delay, Some(Duration::from_millis(1500)));
    assert_eq!(
        status.metadata().get("retry-after").expect("Retry-After"),
        "2"
    );
    assert_no_store(&status);

    let (code, headers, _) = http_get(addr).await;
    assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "2");
    drop(silent);
}

#[tokio::test]
async fn a_call_without_its_key_is_invalid_argument() {
    let layer = RateLimitLayer::new(
        per_window(2),
        Header::new(HeaderName::from_static("x-api-key")),
    );
    let addr = serve(layer).await;
    let mut client = client(addr).await;
    let status = check(&mut client).await.expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("grpc-api"), "{status:?}");
    assert_no_store(&status);

    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    request
        .metadata_mut()
        .insert("x-api-key", "k-1".parse().expect("metadata"));
    assert!(client.check(request).await.is_ok(), "with a key: granted");

    assert_eq!(http_get(addr).await.0, StatusCode::BAD_REQUEST);
}

/// A deny-listed call is `PERMISSION_DENIED`, without a retry delay; the
/// same request over plain HTTP is a 403.
#[tokio::test]
async fn a_deny_listed_call_is_permission_denied() {
    let layer = RateLimitLayer::builder()
        .limit(per_window(2), Global)
        .deny_if(|request| request.headers.contains_key("x-banned"))
        .build()
        .expect("layer");
    let addr = serve(layer).await;
    let mut client = client(addr).await;
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    request
        .metadata_mut()
        .insert("x-banned", "1".parse().expect("metadata"));
    let status = client.check(request).await.expect_err("refused");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.get_details_retry_info().is_none(), "{status:?}");
    assert_no_store(&status);
    assert!(check(&mut client).await.is_ok(), "not listed: granted");
}

#[tokio::test]
async fn a_custom_rejection_handler_still_answers_grpc_calls() {
    let layer = RateLimitLayer::builder()
        .limit(per_window(1), Global)
        .on_rejection(|_: &Rejection<'_>| {
            let mut response = Response::new(Full::from("custom"));
            *response.status_mut() = StatusCode::IM_A_TEAPOT;
            response
        })
        .build()
        .expect("layer");
    let service =
        tower::ServiceBuilder::new()
            .layer(layer)
            .service_fn(|_: Request<Full<Bytes>>| async {
                Ok::<_, std::convert::Infallible>(Response::new(Full::<Bytes>::from("ok")))
            });
    let grpc_call = || {
        Request::post("/grpc.health.v1.Health/Check")
            .header("content-type", "application/grpc")
            .body(Full::<Bytes>::default())
            .expect("request")
    };
    let granted = service
        .clone()
        .oneshot(grpc_call())
        .await
        .expect("response");
    assert_eq!(granted.status(), StatusCode::OK);
    let refused = service.oneshot(grpc_call()).await.expect("response");
    assert_eq!(refused.status(), StatusCode::IM_A_TEAPOT);
    assert!(!refused.headers().contains_key("grpc-status"));
    let body = refused
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(&body[..], b"custom");
}
