//! Every rule its own account: each rule of a layer pays its own cost on
//! arrival, is settled, refunded and held by its own limit, and an
//! estimate no client can make cheaper. The defects these tests pin down
//! were each found where two features met (a layer-wide cost, two lists
//! matched by position). On the memory store and on Redis.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::HeaderMap;
use axum::routing::get;
use axum::Router;
use common::{command_calls, patient_limiter, settles_to, unique_prefix, TestRedis, PATIENT};
use http::{HeaderName, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_ratelimit::key::Global;
use tower_ratelimit::layer::{RateLimitLayer, RateLimitLayerBuilder, Rule};
use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota, RedisStore};

const ESTIMATE: &str = "x-max-tokens";
const USED: &str = "x-tokens-used";
const HOUR: Duration = Duration::from_secs(3600);

fn tokens() -> Limit {
    Limit::new("tokens", Quota::rate(1000, HOUR).fixed_window()).expect("limit")
}

fn requests() -> Limit {
    Limit::new("requests", Quota::rate(5, HOUR).sliding_log()).expect("limit")
}

/// The token budget: pays the request's `x-max-tokens` (an estimate, at
/// most 5 % of 1000 = 50), settled to the response's `x-tokens-used`.
fn budget(limit: Limit) -> Rule {
    Rule::new(limit, Global)
        .cost_from_request_header(HeaderName::from_static(ESTIMATE))
        .cost_from_response_header(HeaderName::from_static(USED))
        .settle_estimates(0.05)
}

/// A store of each kind: a fresh memory store, and a Redis store under a
/// prefix of its own; each with a looker on `limit` over the same state.
fn stores(test: &str, limit: fn() -> Limit) -> Vec<(&'static str, RateLimitLayerBuilder, Limiter)> {
    let memory = MemoryStore::new();
    let redis = common::redis_store(&unique_prefix(test));
    vec![
        (
            "memory",
            RateLimitLayer::builder().store(memory.clone()),
            patient_limiter(memory, limit()),
        ),
        (
            "redis",
            RateLimitLayer::builder().store(redis.clone()),
            patient_limiter(redis, limit()),
        ),
    ]
}

/// An app answering `x-tokens-used` with the request's `x-used` (none when
/// it has none), and the status its `x-status` names (200 without one).
fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route(
            "/",
            get(|headers: HeaderMap| async move {
                let mut response = axum::response::Response::new(Body::from("done"));
                if let Some(used) = headers.get("x-used") {
                    response.headers_mut().insert(USED, used.clone());
                }
                let status = headers.get("x-status").and_then(|s| s.to_str().ok());
                if let Some(status) = status.and_then(|s| s.parse().ok()) {
                    *response.status_mut() = StatusCode::from_u16(status).expect("status");
                }
                response
            }),
        )
        .layer(layer)
}

fn call(estimate: Option<&str>, used: Option<u64>) -> Request<Body> {
    let mut request = Request::get("/");
    if let Some(estimate) = estimate {
        request = request.header(ESTIMATE, estimate);
    }
    if let Some(used) = used {
        request = request.header("x-used", used.to_string());
    }
    request.body(Body::empty()).expect("request")
}

async fn send(app: &Router, request: Request<Body>) -> StatusCode {
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    // the body read to its end: what settles after it has run
    response.into_body().collect().await.expect("body");
    status
}

/// A client that tells no estimate pays what the rule says an estimate
/// not told costs (here the most one request may ask for, 50), settled to
/// what it used; and the layer's request-count rule still counts each
/// request as 1 (it was the layer's one cost, 0, for every rule: 20 of 20
/// served, the budget untouched). An estimate of 0 (some upstreams read it
/// as no maximum) is refused (400), taking nothing of either rule.
#[tokio::test]
async fn an_estimate_of_zero_is_not_free_and_frees_no_other_rule() {
    for (store, builder, looker) in stores("accounts-zero", tokens) {
        let layer = builder
            .timeout(PATIENT)
            .rule(Rule::new(requests(), Global))
            .rule(budget(tokens()))
            .build()
            .expect("layer");
        let app = app(layer);
        for _ in 0..20 {
            let status = send(&app, call(Some("0"), Some(50))).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{store}: 0 is refused");
        }
        let mut served = 0;
        for _ in 0..20 {
            if send(&app, call(None, Some(50))).await == StatusCode::OK {
                served += 1;
            }
        }
        assert_eq!(served, 5, "{store}: the request-count rule counts 1 each");
        settles_to(&looker, 1000 - 5 * 50, store).await;
    }
}

/// An absent estimate counts as the fallback (unreadable, negative and 0
/// ones are refused: `tests/estimates.rs`); and what a request used beyond
/// its estimate is charged in full (into debt, at most the capacity), not
/// a share: a client that lies takes at most one request's cost beyond
/// its budget, then waits out its debt.
#[tokio::test]
async fn a_lie_about_the_estimate_takes_at_most_one_request_beyond_the_budget() {
    // (a store each: a denial cached by the layer outlives a reset made
    // through another limiter)
    for estimate in [None, Some("1")] {
        for (store, builder, looker) in stores("accounts-lie", tokens) {
            let layer = builder
                .timeout(PATIENT)
                .rule(budget(tokens()))
                .build()
                .expect("layer");
            let app = app(layer);
            let mut served = 0;
            for _ in 0..20 {
                if send(&app, call(estimate, Some(100_000))).await == StatusCode::OK {
                    served += 1;
                }
                // in debt once its cost is charged: nothing left
                settles_to(&looker, 0, store).await;
            }
            assert_eq!(served, 1, "{store}: estimate {estimate:?}");
        }
    }
    // the fallback is what the rule says, when it says one
    let memory = MemoryStore::new();
    let looker = patient_limiter(memory.clone(), tokens());
    let layer = RateLimitLayer::builder()
        .store(memory)
        .rule(budget(tokens()).estimate_fallback(20))
        .build()
        .expect("layer");
    // (no cost told after the response: the estimate stays)
    assert_eq!(send(&app(layer), call(None, None)).await, StatusCode::OK);
    settles_to(&looker, 980, "memory").await;
}

/// A grant of cost 0 (a rule that charges only after the response) is
/// still settled: its cost told after the response is charged.
#[tokio::test]
async fn a_grant_of_cost_zero_is_settled_after_the_response() {
    for (store, builder, looker) in stores("accounts-cost-zero", tokens) {
        let rule = Rule::new(tokens(), Global)
            .cost(0)
            .cost_from_response_header(HeaderName::from_static(USED));
        let app = app(builder.timeout(PATIENT).rule(rule).build().expect("layer"));
        assert_eq!(send(&app, call(None, Some(30))).await, StatusCode::OK);
        settles_to(&looker, 970, store).await;
    }
}

/// A concurrency limit of 1 in a layer beside a budget whose estimate is
/// not told: one request at a time (each rule pays its own cost; the layer's one
/// cost of 0 let 10 run at once).
#[tokio::test]
async fn a_concurrency_limit_beside_a_budget_holds_one_permit_per_request() {
    for (store, builder, _) in stores("accounts-concurrency", tokens) {
        let one = Limit::concurrency("one", 1, Duration::from_secs(30)).expect("limit");
        let layer = builder
            .timeout(PATIENT)
            .rule(Rule::new(one, Global))
            .rule(budget(tokens()))
            .build()
            .expect("layer");
        let inside = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let (handler_inside, handler_release) = (inside.clone(), release.clone());
        let app = Router::new()
            .route(
                "/",
                get(move || {
                    let (inside, release) = (handler_inside.clone(), handler_release.clone());
                    async move {
                        inside.fetch_add(1, Ordering::SeqCst);
                        release.acquire().await.expect("open").forget();
                        ([(USED, "1")], "done")
                    }
                }),
            )
            .layer(layer);
        let refused = Arc::new(AtomicUsize::new(0));
        let calls: Vec<_> = (0..10)
            .map(|_| {
                let (app, refused) = (app.clone(), refused.clone());
                tokio::spawn(async move {
                    let status = send(&app, call(None, None)).await;
                    if status == StatusCode::TOO_MANY_REQUESTS {
                        refused.fetch_add(1, Ordering::SeqCst);
                    }
                    status
                })
            })
            .collect();
        let until = tokio::time::Instant::now() + PATIENT;
        while refused.load(Ordering::SeqCst) + inside.load(Ordering::SeqCst) < 10 {
            assert!(
                tokio::time::Instant::now() < until,
                "{store}: not all decided"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(inside.load(Ordering::SeqCst), 1, "{store}: one inside");
        release.add_permits(10);
        let mut served = 0;
        for call in calls {
            if call.await.expect("task") == StatusCode::OK {
                served += 1;
            }
        }
        assert_eq!(served, 1, "{store}");
    }
}

/// Delay mode with a shadow rule ahead of the others: each rule's refund
/// and charge go to its own limit. (The rule of each charge was found by
/// its place among the charges, which leave the shadow rule out in delay
/// mode: the budget was never charged, and a success was asked of the
/// shadow rule, so successful logins locked the user out after 5.)
#[tokio::test]
async fn in_delay_mode_a_shadow_rule_ahead_moves_no_charge_or_refund() {
    let watch = || {
        Limit::new("watch", Quota::rate(1000, HOUR).sliding_log())
            .expect("limit")
            .shadow()
    };
    let logins = || Limit::new("logins", Quota::rate(5, HOUR).sliding_log()).expect("limit");
    for (store, builder, looker) in stores("accounts-shadow-delay", logins) {
        let layer = builder
            .timeout(PATIENT)
            .delay(Duration::from_secs(1))
            .rule(Rule::new(watch(), Global))
            .rule(Rule::new(logins(), Global).refund_if(|r| r.status.is_success()))
            .build()
            .expect("layer");
        let app = app(layer);
        for i in 0..10 {
            assert_eq!(
                send(&app, call(None, None)).await,
                StatusCode::OK,
                "{store}: login {i}"
            );
        }
        settles_to(&looker, 5, store).await;
    }
    for (store, builder, looker) in stores("accounts-shadow-delay-budget", tokens) {
        let layer = builder
            .timeout(PATIENT)
            .delay(Duration::from_secs(1))
            .rule(Rule::new(watch(), Global))
            .rule(budget(tokens()))
            .build()
            .expect("layer");
        let app = app(layer);
        assert_eq!(send(&app, call(Some("10"), Some(50))).await, StatusCode::OK);
        settles_to(&looker, 950, store).await;
    }
}

/// A shadow budget never refuses, an estimate over its share included: it
/// counts a would-refuse, takes nothing (as for any request it would
/// refuse), and the request is served.
#[tokio::test]
async fn a_shadow_budget_never_refuses_an_estimate_over_its_share() {
    for (store, builder, looker) in stores("accounts-shadow-share", tokens) {
        let layer = builder
            .timeout(PATIENT)
            .rule(budget(tokens().shadow()))
            .build()
            .expect("layer");
        let app = app(layer);
        assert_eq!(
            send(&app, call(Some("400"), Some(100))).await,
            StatusCode::OK,
            "{store}"
        );
        settles_to(&looker, 1000, store).await;
    }
}

/// One layer holds "1 request" and "N tokens": both are decided in one
/// store call, and a settled request costs 2 store calls in all (its
/// decision, and its settlement: the surplus given back, or the shortfall
/// charged).
#[tokio::test]
async fn a_request_count_and_a_token_budget_cost_two_store_calls_in_all() {
    let server = TestRedis::spawn();
    let store = RedisStore::builder(server.url.as_str())
        .build()
        .expect("store");
    let looker = patient_limiter(store.clone(), tokens());
    let layer = RateLimitLayer::builder()
        .store(store)
        .timeout(PATIENT)
        .rule(Rule::new(requests(), Global))
        .rule(budget(tokens()))
        .build()
        .expect("layer");
    let app = app(layer);
    // the library loaded, the connections made
    assert_eq!(send(&app, call(Some("10"), Some(10))).await, StatusCode::OK);
    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connection");
    let calls = |conn: &mut redis::Connection| {
        ["fcall", "fcall_ro", "evalsha", "eval"]
            .iter()
            .map(|command| command_calls(conn, command))
            .sum::<u64>()
    };
    for (estimate, used, left) in [(40, 10, 980), (20, 50, 930)] {
        let before = calls(&mut conn);
        let estimate = estimate.to_string();
        let served = send(&app, call(Some(&estimate), Some(used))).await;
        assert_eq!(served, StatusCode::OK);
        // the settlement runs on a task of its own: wait for it, then for
        // anything more
        let until = std::time::Instant::now() + PATIENT;
        while calls(&mut conn) - before < 2 {
            assert!(std::time::Instant::now() < until, "not settled");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(calls(&mut conn) - before, 2, "decision and settlement");
        settles_to(&looker, left, "redis").await;
    }
}

/// A handler whose response body is `chunks`, sent one by one, with the
/// content type `content_type`.
fn streaming(
    layer: RateLimitLayer,
    content_type: &'static str,
    chunks: Vec<&'static str>,
) -> Router {
    Router::new()
        .route(
            "/",
            get(move || {
                let chunks = chunks.clone();
                async move {
                    let stream =
                        futures::stream::iter(chunks.into_iter().map(|chunk| {
                            Ok::<_, std::convert::Infallible>(bytes::Bytes::from(chunk))
                        }));
                    ([("content-type", content_type)], Body::from_stream(stream))
                }
            }),
        )
        .layer(layer)
}

/// The usage of a JSON response body, found across chunk boundaries, of a
/// streamed response (server-sent events: the last event that carries
/// one), and a function of the whole body, each settles the estimate; the
/// client gets the body unchanged.
#[tokio::test]
async fn costs_read_from_the_response_body_settle_the_estimate() {
    let json = vec![
        r#"{"id":"x","usage":{"prompt"#,
        r#"_tokens":7,"total_to"#,
        r#"kens":57}}"#,
    ];
    let events = vec![
        "data: {\"choices\":[{\"delta\":\"Hel\"}],\"usage\":null}\n\n",
        "data: {\"choices\":[]}\r\n\r\n: keep-alive\n\ndata: {\"usage\":{\"total_",
        "tokens\":31}}\n\ndata: [DONE]\n\n",
    ];
    let words = vec!["word ", "word ", "word"];
    let by_path: fn(Rule) -> Rule = |rule| rule.cost_from_response_json("usage.total_tokens");
    let by_words: fn(Rule) -> Rule = |rule| {
        rule.cost_from_response_body(64, |body| Some(body.split(|&b| b == b' ').count() as u64))
    };
    let bodies = [
        ("application/json", json, by_path, 57),
        ("text/event-stream", events, by_path, 31),
        ("text/plain", words, by_words, 3),
    ];
    for (content_type, chunks, reads, used) in bodies {
        let whole: String = chunks.concat();
        for (store, builder, looker) in stores("accounts-body", tokens) {
            let rule = Rule::new(tokens(), Global)
                .cost_from_request_header(HeaderName::from_static(ESTIMATE))
                .settle_estimates(0.1);
            let layer = builder
                .timeout(PATIENT)
                .rule(reads(rule))
                .build()
                .expect("layer");
            let app = streaming(layer, content_type, chunks.clone());
            let response = app
                .oneshot(call(Some("100"), None))
                .await
                .expect("infallible");
            assert_eq!(response.status(), StatusCode::OK);
            let body = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            assert_eq!(body, whole.as_bytes(), "{store}: the body unchanged");
            settles_to(&looker, 1000 - used, store).await;
        }
    }
}

/// A streamed response dropped by its client after the event that tells
/// its usage is settled to that usage; one dropped before any keeps the
/// estimate.
#[tokio::test]
async fn a_stream_dropped_mid_way_settles_to_the_usage_it_sent() {
    for (told, chunks, left) in [
        (
            true,
            vec![
                "data: {\"usage\":{\"total_tokens\":12}}\n\n",
                "data: {\"cho",
            ],
            988,
        ),
        (false, vec!["data: {\"cho"], 900),
    ] {
        for (store, builder, looker) in stores("accounts-dropped", tokens) {
            let rule = Rule::new(tokens(), Global)
                .cost_from_request_header(HeaderName::from_static(ESTIMATE))
                .cost_from_response_json("usage.total_tokens")
                .settle_estimates(0.1);
            let layer = builder.timeout(PATIENT).rule(rule).build().expect("layer");
            // the stream never ends: the client reads what was sent, then goes
            let chunks = chunks.clone();
            let app = Router::new()
                .route(
                    "/",
                    get(move || {
                        let chunks = chunks.clone();
                        async move {
                            let sent = futures::stream::iter(chunks.into_iter().map(|chunk| {
                                Ok::<_, std::convert::Infallible>(bytes::Bytes::from(chunk))
                            }));
                            let stream =
                                futures::StreamExt::chain(sent, futures::stream::pending());
                            (
                                [("content-type", "text/event-stream")],
                                Body::from_stream(stream),
                            )
                        }
                    }),
                )
                .layer(layer);
            let response = app
                .oneshot(call(Some("100"), None))
                .await
                .expect("infallible");
            let mut body = response.into_body();
            for _ in 0..chunks_len(told) {
                body.frame().await.expect("a frame").expect("data");
            }
            drop(body);
            settles_to(&looker, left, store).await;
        }
    }
}

fn chunks_len(told: bool) -> usize {
    if told {
        2
    } else {
        1
    }
}

/// Delay mode with a shadow rule that bans (a penalty): every request is
/// answered, and only the enforced limit refuses. (A block no longer than
/// the delay was not marked as refusing, so a shadow round could be
/// decided again for ever; tests/model found it, and its random layers,
/// which draw this combination, are what catch it: this case alone does
/// not reach it.)
#[tokio::test]
async fn in_delay_mode_a_shadow_ban_is_answered_not_decided_for_ever() {
    use tower_ratelimit::Penalty;
    let penalty = Penalty::new(
        1,
        Duration::from_secs(2),
        [Duration::from_secs(1), Duration::from_secs(3)],
    )
    .expect("penalty");
    let watch = Limit::new("watch", Quota::rate(1, HOUR).fixed_window())
        .expect("limit")
        .with_penalty(penalty)
        .shadow();
    let layer = RateLimitLayer::builder()
        .store(MemoryStore::new())
        .delay(Duration::from_secs(2))
        .rule(
            Rule::new(watch, Global)
                .tier("pro", Quota::rate(3, HOUR).fixed_window())
                .choose_tier(|r| r.headers.get("x-pro").map(|_| "pro")),
        )
        .limit(
            Limit::new("logins", Quota::rate(3, HOUR).sliding_log()).expect("limit"),
            Global,
        )
        .build()
        .expect("layer");
    let app = app(layer);
    let mut statuses = Vec::new();
    for i in 0..4 {
        let mut request = call(None, None);
        if i == 0 {
            request
                .headers_mut()
                .insert("x-pro", "1".parse().expect("value"));
        }
        let answered = tokio::time::timeout(PATIENT, send(&app, request)).await;
        statuses.push(answered.expect("answered within the timeout"));
    }
    // the shadow rule never refuses: the enforced limit's 3 pass
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
}
