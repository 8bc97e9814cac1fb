//! What the layer settles once a response is known: a concurrency limit's
//! permit held from the request until its response body ends (streamed, or
//! dropped by a client gone), and costs read from the response (a header,
//! the body's bytes) charged after it. On the memory store and on Redis.

mod common;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use common::{patient_limiter, settles_to, unique_prefix, PATIENT};
use futures::channel::mpsc;
use http::{HeaderName, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_ratelimit::key::Global;
use tower_ratelimit::layer::{RateLimitLayer, RateLimitLayerBuilder, Rule};
use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota, RedisStore, Store};

type Chunks = mpsc::UnboundedSender<Result<Bytes, Infallible>>;

/// Makes a handle on one test's store.
type MakeStore = Arc<dyn Fn() -> StoreKind + Send + Sync>;

/// The stores each test runs on, with a name for messages.
fn stores(test: &str) -> Vec<(&'static str, MakeStore)> {
    let memory = MemoryStore::new();
    let prefix = unique_prefix(test);
    vec![
        (
            "memory",
            Arc::new(move || StoreKind::Memory(memory.clone())),
        ),
        (
            "redis",
            Arc::new(move || StoreKind::Redis(common::redis_store(&prefix))),
        ),
    ]
}

#[derive(Clone)]
enum StoreKind {
    Memory(MemoryStore),
    Redis(RedisStore),
}

fn layer(store: StoreKind, rule: Rule) -> RateLimitLayer {
    layer_with(store, RateLimitLayer::builder().rule(rule))
}

fn layer_with(store: StoreKind, builder: RateLimitLayerBuilder) -> RateLimitLayer {
    let builder = builder.timeout(PATIENT);
    match store {
        StoreKind::Memory(store) => builder.store(store),
        StoreKind::Redis(store) => builder.store(store),
    }
    .build()
    .expect("layer")
}

/// An app whose `GET /stream` streams what the test sends through the
/// sender it pushes on the returned list, one per request, behind `layer`.
fn streaming_app(layer: RateLimitLayer) -> (Router, Arc<Mutex<Vec<Chunks>>>) {
    let senders: Arc<Mutex<Vec<Chunks>>> = Arc::default();
    let handler_senders = senders.clone();
    let app = Router::new()
        .route(
            "/stream",
            get(move || {
                let senders = handler_senders.clone();
                async move {
                    let (tx, rx) = mpsc::unbounded();
                    senders.lock().expect("lock").push(tx);
                    Body::from_stream(rx)
                }
            }),
        )
        .layer(layer);
    (app, senders)
}

fn limiter(store: StoreKind, limit: Limit) -> Limiter {
    match store {
        StoreKind::Memory(store) => looker(store, limit),
        StoreKind::Redis(store) => looker(store, limit),
    }
}

fn looker(store: impl Into<Store>, limit: Limit) -> Limiter {
    patient_limiter(store, limit)
}

fn get_request(uri: &str) -> Request<Body> {
    Request::get(uri).body(Body::empty()).expect("request")
}

/// One stream at a time: a second request is refused while the first's
/// body streams; the permit comes back when that body ends, and when a
/// client drops a body it stopped reading.
#[tokio::test]
async fn a_concurrency_limit_holds_its_permit_until_the_response_body_ends() {
    let streams = Limit::concurrency("streams", 1, Duration::from_secs(60)).expect("limit");
    for (store, make) in stores("after-lease") {
        let (app, senders) = streaming_app(layer(make(), Rule::new(streams.clone(), Global)));
        let looker = limiter(make(), streams.clone());

        let first = app
            .clone()
            .oneshot(get_request("/stream"))
            .await
            .expect("infallible");
        assert_eq!(first.status(), StatusCode::OK, "{store}");
        let second = app
            .clone()
            .oneshot(get_request("/stream"))
            .await
            .expect("infallible");
        assert_eq!(
            second.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{store}: the first body still streams"
        );
        let tx = senders
            .lock()
            .expect("lock")
            .pop()
            .expect("the first's body");
        tx.unbounded_send(Ok(Bytes::from_static(b"part")))
            .expect("send");
        drop(tx); // the stream ends
        let body = first.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(&body[..], b"part");
        settles_to(&looker, 1, store).await;

        // a client that stops reading and goes away gives the permit back
        let third = app
            .clone()
            .oneshot(get_request("/stream"))
            .await
            .expect("infallible");
        assert_eq!(third.status(), StatusCode::OK, "{store}");
        assert_eq!(
            looker.peek("global", 1).await.expect("peek").remaining(),
            0,
            "{store}"
        );
        drop(third);
        settles_to(&looker, 1, store).await;
        let fourth = app
            .clone()
            .oneshot(get_request("/stream"))
            .await
            .expect("infallible");
        assert_eq!(fourth.status(), StatusCode::OK, "{store}");
    }
}

/// "x-tokens-used: 4" on every response, 10 per hour: each request pays 1
/// on arrival and 3 more after; the third finds 2 left, is let in, and
/// leaves the key in debt (12 of 10), so the fourth is refused.
#[tokio::test]
async fn a_cost_read_from_a_response_header_is_charged_after_the_response() {
    let tokens = Limit::new("tokens", Quota::per_hour(10).fixed_window()).expect("limit");
    let used = HeaderName::from_static("x-tokens-used");
    for (store, make) in stores("after-header") {
        let app = Router::new()
            .route(
                "/complete",
                get(|| async { ([("x-tokens-used", "4")], "done") }),
            )
            .layer(layer(
                make(),
                Rule::new(tokens.clone(), Global).cost_from_response_header(used.clone()),
            ));
        let looker = limiter(make(), tokens.clone());
        for (i, left) in [(1, 6), (2, 2), (3, 0)] {
            let response = app
                .clone()
                .oneshot(get_request("/complete"))
                .await
                .expect("infallible");
            assert_eq!(response.status(), StatusCode::OK, "{store}: request {i}");
            response.into_body().collect().await.expect("body");
            settles_to(&looker, left, store).await;
        }
        let refused = app
            .clone()
            .oneshot(get_request("/complete"))
            .await
            .expect("infallible");
        assert_eq!(
            refused.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{store}: in debt"
        );
    }
}

/// The bytes a body streams, charged when it ends: 3 chunks of 100 bytes
/// cost 300 of 1000.
#[tokio::test]
async fn a_cost_counted_in_the_body_is_charged_when_it_ends() {
    let bytes = Limit::new("bytes", Quota::per_hour(1000).fixed_window()).expect("limit");
    for (store, make) in stores("after-body") {
        let app = Router::new()
            .route(
                "/download",
                get(|| async {
                    let chunks = (0..3).map(|_| Ok::<_, Infallible>(Bytes::from(vec![b'x'; 100])));
                    Body::from_stream(futures::stream::iter(chunks))
                }),
            )
            .layer(layer(
                make(),
                Rule::new(bytes.clone(), Global)
                    .cost_from_response_chunks(|chunk| chunk.len() as u64),
            ));
        let looker = limiter(make(), bytes.clone());
        let response = app
            .clone()
            .oneshot(get_request("/download"))
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::OK, "{store}");
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        assert_eq!(body.len(), 300, "{store}");
        settles_to(&looker, 700, store).await;
    }
}

/// A cost that is not a number, or smaller than what the request paid,
/// charges nothing more.
#[tokio::test]
async fn an_unreadable_or_small_cost_charges_nothing_more() {
    let tokens = Limit::new("tokens", Quota::per_hour(10).fixed_window()).expect("limit");
    let used = HeaderName::from_static("x-tokens-used");
    let store = MemoryStore::new();
    for value in ["lots", "-3", "0", "1", "99999999999999999999999"] {
        let app = Router::new()
            .route(
                "/complete",
                get(move || async move { ([("x-tokens-used", value)], "done") }),
            )
            .layer(layer(
                StoreKind::Memory(store.clone()),
                Rule::new(tokens.clone(), Global).cost_from_response_header(used.clone()),
            ));
        let looker = limiter(StoreKind::Memory(store.clone()), tokens.clone());
        let before = looker.peek("global", 1).await.expect("peek").remaining();
        let response = app
            .oneshot(get_request("/complete"))
            .await
            .expect("infallible");
        response.into_body().collect().await.expect("body");
        let after = looker.peek("global", 1).await.expect("peek").remaining();
        assert_eq!(after, before - 1, "{value:?}: only the request's own cost");
    }
}

/// In delay mode a request waits for a permit instead of being refused:
/// it is let in once the stream holding the only one ends.
#[tokio::test]
async fn in_delay_mode_a_request_waits_for_a_free_permit() {
    let streams = Limit::concurrency("waited", 1, Duration::from_secs(60)).expect("limit");
    for (store, make) in stores("after-delay") {
        let builder = RateLimitLayer::builder()
            .rule(Rule::new(streams.clone(), Global))
            .delay(Duration::from_secs(5));
        let (app, senders) = streaming_app(layer_with(make(), builder));
        let first = app
            .clone()
            .oneshot(get_request("/stream"))
            .await
            .expect("infallible");
        assert_eq!(first.status(), StatusCode::OK, "{store}");
        let waiting = tokio::spawn(app.clone().oneshot(get_request("/stream")));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !waiting.is_finished(),
            "{store}: the second waits for the permit"
        );
        let tx = senders
            .lock()
            .expect("lock")
            .pop()
            .expect("the first's body");
        drop(tx);
        first.into_body().collect().await.expect("body");
        let second = waiting.await.expect("task").expect("infallible");
        assert_eq!(
            second.status(),
            StatusCode::OK,
            "{store}: let in once the first ended"
        );
    }
}

/// A cost after the response cannot be charged to a concurrency limit: a
/// build error, not a permit that never comes back.
#[test]
fn a_concurrency_limit_charges_no_cost_after_the_response() {
    let streams = Limit::concurrency("streams", 1, Duration::from_secs(60)).expect("limit");
    let built = RateLimitLayer::builder()
        .rule(
            Rule::new(streams, Global).cost_from_response_header(HeaderName::from_static("x-cost")),
        )
        .build();
    assert!(matches!(built, Err(tower_ratelimit::ConfigError::Layer(_))));
}

/// A limit of 1 with a 300 ms lease, and a handler that takes a second:
/// the permit is held (renewed) through the handler, so a second request
/// 400 ms in is refused, and it comes back when the first's body ends.
#[tokio::test]
async fn a_permit_is_held_through_a_handler_slower_than_its_lease() {
    let slow = Limit::concurrency("slow", 1, Duration::from_millis(300)).expect("limit");
    for (store, make) in stores("after-slow") {
        let app = Router::new()
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    "done"
                }),
            )
            .layer(layer(make(), Rule::new(slow.clone(), Global)));
        let looker = limiter(make(), slow.clone());
        let first = tokio::spawn(app.clone().oneshot(get_request("/slow")));
        tokio::time::sleep(Duration::from_millis(400)).await;
        let second = app
            .clone()
            .oneshot(get_request("/slow"))
            .await
            .expect("infallible");
        assert_eq!(
            second.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{store}: the first is still in its handler"
        );
        let first = first.await.expect("task").expect("infallible");
        assert_eq!(first.status(), StatusCode::OK, "{store}");
        first.into_body().collect().await.expect("body");
        settles_to(&looker, 1, store).await;
    }
}

/// A request whose client goes away while the handler runs (its future
/// dropped at 50 ms), and one whose inner service fails: each gives its
/// permit back at once, long before its 60 s lease would end.
#[tokio::test]
async fn a_permit_comes_back_when_the_request_is_dropped_or_the_service_fails() {
    let running = Limit::concurrency("running", 1, Duration::from_secs(60)).expect("limit");
    for (store, make) in stores("after-dropped") {
        let app = Router::new()
            .route("/hang", get(std::future::pending::<&'static str>))
            .route("/quick", get(|| async { "done" }))
            .layer(layer(make(), Rule::new(running.clone(), Global)));
        let looker = limiter(make(), running.clone());
        let dropped = tokio::time::timeout(
            Duration::from_millis(50),
            app.clone().oneshot(get_request("/hang")),
        )
        .await;
        assert!(dropped.is_err(), "{store}: the handler never answers");
        settles_to(&looker, 1, store).await;
        let next = app
            .clone()
            .oneshot(get_request("/quick"))
            .await
            .expect("infallible");
        assert_eq!(
            next.status(),
            StatusCode::OK,
            "{store}: the permit came back"
        );
        next.into_body().collect().await.expect("body");
        settles_to(&looker, 1, store).await;

        // an inner service that fails
        let failing = tower::ServiceBuilder::new()
            .layer(layer(make(), Rule::new(running.clone(), Global)))
            .service(tower::service_fn(|_: Request<Body>| async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Err::<http::Response<Body>, _>(std::io::Error::other("the service failed"))
            }));
        let failed = failing.oneshot(get_request("/fails")).await;
        assert!(failed.is_err(), "{store}: the inner service's error");
        settles_to(&looker, 1, store).await;
    }
}

/// A client that stops reading a streamed body holds its permit only for
/// the limit's maximum hold: then the permit comes back and the body ends
/// with an error (a body that waits for data is woken for it).
#[tokio::test]
async fn a_body_no_one_reads_gives_its_permit_back_at_the_maximum_hold() {
    let streams = Limit::concurrency("held", 1, Duration::from_secs(60))
        .expect("limit")
        .hold_at_most(Duration::from_millis(500))
        .expect("a maximum hold");
    for (store, make) in stores("after-max-hold") {
        let (app, _senders) = streaming_app(layer(make(), Rule::new(streams.clone(), Global)));
        let looker = limiter(make(), streams.clone());
        let unread = app
            .clone()
            .oneshot(get_request("/stream"))
            .await
            .expect("infallible");
        assert_eq!(unread.status(), StatusCode::OK, "{store}");
        assert_eq!(
            looker.peek("global", 1).await.expect("peek").remaining(),
            0,
            "{store}: held while the body is unread"
        );
        settles_to(&looker, 1, store).await;
        let ended = unread.into_body().collect().await;
        assert!(ended.is_err(), "{store}: the body ends with an error");

        // a body being read, that waits for data, ends at the maximum hold
        let waiting = app
            .clone()
            .oneshot(get_request("/stream"))
            .await
            .expect("infallible");
        assert_eq!(waiting.status(), StatusCode::OK, "{store}");
        let ended = tokio::time::timeout(PATIENT, waiting.into_body().collect())
            .await
            .expect("ended within the test's patience");
        assert!(ended.is_err(), "{store}: the body ends with an error");
        settles_to(&looker, 1, store).await;
    }
}

/// A body of `chunks` chunks, each ready `every` after the one before.
fn ticking(every: Duration, chunks: u32) -> Body {
    Body::from_stream(futures::stream::unfold(0, move |sent| async move {
        if sent == chunks {
            return None;
        }
        tokio::time::sleep(every).await;
        Some((Ok::<_, Infallible>(Bytes::from("tick\n")), sent + 1))
    }))
}

/// Without a maximum hold, a response body keeps its permit for as long as
/// its client reads it, however long: a chunk a minute for 15 minutes is
/// not cut (the body waits for its own data meanwhile). A client that
/// stops reading holds it a lease time: then the permit comes back and the
/// body ends with an error. (Paused time, memory store.)
#[tokio::test(start_paused = true)]
async fn a_body_read_steadily_keeps_its_permit_and_a_stalled_one_loses_it() {
    let lease = Duration::from_secs(30);
    let streams = Limit::concurrency("steady", 1, lease).expect("limit");
    let limited = layer(
        StoreKind::Memory(MemoryStore::new()),
        Rule::new(streams, Global),
    );
    let app = tower::Layer::layer(
        &limited,
        tower::service_fn(|request: Request<Body>| async move {
            let body = match request.uri().path() {
                "/steady" => ticking(Duration::from_secs(60), 15),
                _ => ticking(Duration::ZERO, u32::MAX),
            };
            Ok::<_, Infallible>(http::Response::new(body))
        }),
    );

    let steady = app
        .clone()
        .oneshot(get_request("/steady"))
        .await
        .expect("infallible");
    assert_eq!(steady.status(), StatusCode::OK);
    let started = tokio::time::Instant::now();
    let mut body = steady.into_body();
    let mut chunks = 0;
    while let Some(frame) = body.frame().await {
        if let Err(error) = frame {
            panic!(
                "the body read steadily was cut after {chunks} chunks, {:?}: {error}",
                started.elapsed()
            );
        }
        chunks += 1;
    }
    assert_eq!(chunks, 15);
    assert!(started.elapsed() >= Duration::from_secs(15 * 60));

    let stalled = app
        .clone()
        .oneshot(get_request("/stalled"))
        .await
        .expect("infallible");
    assert_eq!(stalled.status(), StatusCode::OK);
    let mut stalled = stalled.into_body();
    assert!(
        matches!(stalled.frame().await, Some(Ok(_))),
        "one chunk read"
    );
    let refused = app
        .clone()
        .oneshot(get_request("/steady"))
        .await
        .expect("infallible");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS, "held");
    // the client reads no more: within a lease time and a renewal's
    // period, the permit comes back
    tokio::time::sleep(lease + lease / 3 + Duration::from_secs(1)).await;
    let next = app
        .clone()
        .oneshot(get_request("/steady"))
        .await
        .expect("infallible");
    assert_eq!(
        next.status(),
        StatusCode::OK,
        "the stalled body's permit came back"
    );
    assert!(
        matches!(stalled.frame().await, Some(Err(_))),
        "the stalled body ends with an error"
    );
}

#[test]
fn a_maximum_hold_is_for_concurrency_limits_and_not_zero() {
    let rate = Limit::new("rate", Quota::per_second(1).gcra()).expect("limit");
    assert!(matches!(
        rate.hold_at_most(Duration::from_secs(1)),
        Err(tower_ratelimit::ConfigError::MaxHold(_))
    ));
    let running = Limit::concurrency("running", 1, Duration::from_secs(1)).expect("limit");
    assert!(matches!(
        running.hold_at_most(Duration::ZERO),
        Err(tower_ratelimit::ConfigError::MaxHold(_))
    ));
}

/// A lease and a refund in one layer: a response that does not count gives
/// its rate-limit grant back at once (its `RateLimit` field says so), while
/// the concurrency permit stays held until the body ends.
#[tokio::test]
async fn a_refund_gives_the_rate_back_and_the_lease_stays_until_the_body_ends() {
    let streams = Limit::concurrency("streams", 1, Duration::from_secs(60)).expect("limit");
    let tries = Limit::new("tries", Quota::per_hour(5).fixed_window()).expect("limit");
    for (store, make) in stores("after-lease-refund") {
        let builder = RateLimitLayer::builder()
            .rule(Rule::new(streams.clone(), Global))
            .rule(Rule::new(tries.clone(), Global).refund_if(|r| r.status.is_success()));
        let (app, senders) = streaming_app(layer_with(make(), builder));
        let leases = limiter(make(), streams.clone());
        let rates = limiter(make(), tries.clone());
        let first = app
            .clone()
            .oneshot(get_request("/stream"))
            .await
            .expect("infallible");
        assert_eq!(first.status(), StatusCode::OK, "{store}");
        let field = first.headers()["ratelimit"]
            .to_str()
            .expect("ascii")
            .to_owned();
        assert!(field.contains("\"tries\";r=5;"), "{store}: {field}");
        assert_eq!(
            rates.peek("global", 1).await.expect("peek").remaining(),
            5,
            "{store}"
        );
        assert_eq!(
            leases.peek("global", 1).await.expect("peek").remaining(),
            0,
            "{store}"
        );
        let second = app
            .clone()
            .oneshot(get_request("/stream"))
            .await
            .expect("infallible");
        assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS, "{store}");
        assert_eq!(
            rates.peek("global", 1).await.expect("peek").remaining(),
            5,
            "{store}: a refusal takes nothing"
        );
        drop(
            senders
                .lock()
                .expect("lock")
                .pop()
                .expect("the first's body"),
        );
        first.into_body().collect().await.expect("body");
        settles_to(&leases, 1, store).await;
    }
}
