//! A limit keyed by a field of a JSON body (`key::JsonField` read by
//! `key::ReadBody` around the layer), over real HTTP on both stores: the
//! handler reads the whole body; a body over the bound, too slow, not JSON,
//! without the field or with it twice has no key.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use common::{redis_store, unique_prefix, PATIENT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;
use tower_ratelimit::key::{JsonField, ReadBody};
use tower_ratelimit::layer::{MissingKey, RateLimitLayer, Rule};
use tower_ratelimit::{Limit, MemoryStore, Quota, Store};

fn login() -> Limit {
    Limit::new("login", Quota::per_minute(2).sliding_log()).expect("valid")
}

fn username() -> JsonField {
    JsonField::new("username").normalize(|name| Some(name.trim().to_lowercase()))
}

/// `POST /login` (no key: 400) and `POST /skip` (no key: not limited), each
/// answering the body it read, behind the `login` limit keyed by the
/// username, read at most `max_bytes` within `timeout`.
fn app(store: impl Into<Store> + Clone, max_bytes: usize, timeout: Duration) -> Router {
    let read = ReadBody::new().max_bytes(max_bytes).timeout(timeout);
    let strict = RateLimitLayer::builder()
        .store(store.clone())
        .timeout(PATIENT)
        .limit(login(), username())
        .build()
        .expect("a layer");
    let lenient = Limit::new("lenient", Quota::per_minute(2).sliding_log()).expect("valid");
    let lenient = RateLimitLayer::builder()
        .store(store)
        .timeout(PATIENT)
        .rule(Rule::new(lenient, username()).on_missing_key(MissingKey::Skip))
        .build()
        .expect("a layer");
    let echo = || post(|body: Bytes| async move { body });
    Router::new()
        .route("/login", echo().route_layer(read.around(strict)))
        .route("/skip", echo().route_layer(read.around(lenient)))
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    addr
}

/// A response: status, head (lowercase), body.
struct Answer {
    status: u16,
    head: String,
    body: Vec<u8>,
}

/// POSTs `body` to `path` over a real connection, with `Content-Length`,
/// or chunked (no length known ahead) in pieces of 1000 bytes.
async fn send(addr: SocketAddr, path: &str, body: &[u8], chunked: bool) -> Answer {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let framing = if chunked {
        "Transfer-Encoding: chunked".to_owned()
    } else {
        format!("Content-Length: {}", body.len())
    };
    let head =
        format!("POST {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n{framing}\r\n\r\n");
    let mut request = head.into_bytes();
    if chunked {
        for piece in body.chunks(1000) {
            request.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
            request.extend_from_slice(piece);
            request.extend_from_slice(b"\r\n");
        }
        request.extend_from_slice(b"0\r\n\r\n");
    } else {
        request.extend_from_slice(body);
    }
    stream.write_all(&request).await.expect("send");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.expect("read");
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let head = String::from_utf8_lossy(&response[..split]).to_lowercase();
    let status = head[9..12].parse().expect("a status");
    Answer {
        status,
        head,
        body: response[split + 4..].to_vec(),
    }
}

async fn usernames_are_counted_and_bodies_reach_the_handler_whole(store: impl Into<Store> + Clone) {
    let addr = serve(app(store, 1024, Duration::from_secs(5))).await;
    for (i, body) in [
        r#"{"username": "Ann", "password": "a"}"#,
        r#"{"password": "b", "username": "ann"}"#,
    ]
    .iter()
    .enumerate()
    {
        let answer = send(addr, "/login", body.as_bytes(), i == 1).await;
        assert_eq!(answer.status, 200, "{body}");
        assert_eq!(answer.body, body.as_bytes(), "the handler reads it whole");
        assert!(answer.head.contains("ratelimit: \"login\""));
    }
    let third = send(addr, "/login", br#"{"username": " ANN "}"#, false).await;
    assert_eq!(third.status, 429, "one username, however written");
    assert!(third.head.contains("retry-after:"));
    assert_eq!(
        send(addr, "/login", br#"{"username": "bob"}"#, false)
            .await
            .status,
        200
    );

    // no key: 400 from the layer, the handler never runs
    for body in [
        r#"{"password": "a"}"#,
        r#"{"username": 42}"#,
        r#"{"username": "mallory", "username": "ann"}"#,
        r#"{"username": "ann"} trailing"#,
        r#"["ann"]"#,
        "username=ann",
        "",
    ] {
        let answer = send(addr, "/login", body.as_bytes(), false).await;
        assert_eq!(answer.status, 400, "{body:?}");
        assert_ne!(answer.body, body.as_bytes(), "{body:?}");
    }
}

#[tokio::test]
async fn usernames_are_counted_in_memory() {
    usernames_are_counted_and_bodies_reach_the_handler_whole(MemoryStore::new()).await;
}

#[tokio::test]
async fn usernames_are_counted_in_redis() {
    let store = redis_store(&unique_prefix("body-key"));
    usernames_are_counted_and_bodies_reach_the_handler_whole(store).await;
}

async fn a_body_over_the_bound_has_no_key(store: impl Into<Store> + Clone) {
    let addr = serve(app(store, 64, Duration::from_secs(5))).await;
    let big = format!(
        r#"{{"username": "ann", "padding": "{}"}}"#,
        "x".repeat(10_000)
    );
    for chunked in [false, true] {
        // refused without a key, or forwarded whole without a decision
        let strict = send(addr, "/login", big.as_bytes(), chunked).await;
        assert_eq!(strict.status, 400, "chunked: {chunked}");
        let lenient = send(addr, "/skip", big.as_bytes(), chunked).await;
        assert_eq!(lenient.status, 200, "chunked: {chunked}");
        assert_eq!(lenient.body, big.as_bytes(), "chunked: {chunked}");
        assert!(!lenient.head.contains("ratelimit:"), "not limited");
    }
    // under the bound, the same route counts it
    let small = send(addr, "/skip", br#"{"username": "ann"}"#, true).await;
    assert_eq!(small.status, 200);
    assert!(
        small.head.contains("ratelimit: \"lenient\";r=1"),
        "{}",
        small.head
    );
}

#[tokio::test]
async fn a_body_over_the_bound_has_no_key_in_memory() {
    a_body_over_the_bound_has_no_key(MemoryStore::new()).await;
}

#[tokio::test]
async fn a_body_over_the_bound_has_no_key_in_redis() {
    a_body_over_the_bound_has_no_key(redis_store(&unique_prefix("body-bound"))).await;
}

/// A body that sends its start, then nothing for 30 s (on the paused test
/// clock), then the rest.
fn slow_body() -> Body {
    let pieces = futures::stream::unfold(0, |step| async move {
        match step {
            0 => Some((
                Ok::<_, std::io::Error>(Bytes::from(r#"{"username": "ann", "#)),
                1,
            )),
            1 => {
                tokio::time::sleep(Duration::from_secs(30)).await;
                Some((Ok(Bytes::from(r#""password": "a"}"#)), 2))
            }
            _ => None,
        }
    });
    Body::from_stream(pieces)
}

#[tokio::test(start_paused = true)]
async fn a_body_slower_than_the_timeout_has_no_key_and_reaches_the_handler_whole() {
    let app = app(MemoryStore::new(), 1024, Duration::from_secs(1));
    let request = |path: &str| Request::post(path).body(slow_body()).expect("a request");
    let strict = app
        .clone()
        .oneshot(request("/login"))
        .await
        .expect("infallible");
    assert_eq!(strict.status(), StatusCode::BAD_REQUEST);
    let lenient = app.oneshot(request("/skip")).await.expect("infallible");
    assert_eq!(lenient.status(), StatusCode::OK);
    assert!(lenient.headers().get("ratelimit").is_none(), "not limited");
    let body = axum::body::to_bytes(lenient.into_body(), 1024)
        .await
        .expect("body");
    assert_eq!(body, r#"{"username": "ann", "password": "a"}"#);
}

#[tokio::test]
async fn without_read_body_no_request_has_the_key() {
    let layer = RateLimitLayer::new(login(), username());
    let app = Router::new().route("/login", post(|| async { "ok" }).route_layer(layer));
    let request = Request::post("/login")
        .body(Body::from(r#"{"username": "ann"}"#))
        .expect("a request");
    let response = app.oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
}
