//! The number charged is the number the upstream sees (issue 53, item 1):
//! each form of an estimate a client can send, and each response that
//! tells no usage, against an upstream that reads requests as leniently as
//! real ones do (the last of a duplicate name, `"100000"`, the last header
//! line, its own default when no maximum is given) and honours the maximum
//! it reads. The budget is 1,000 tokens, one request may ask for 5 % (50).
//! Every form on the memory store and on Redis; the attacker's loops one
//! request at a time and with many in flight. The bound these check
//! (`BOUNDS.md`, "Settled costs"): what the upstream serves never exceeds
//! the budget when it honours what it is told and reports at most what it
//! served.

mod common;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use common::{patient_limiter, settles_to, unique_prefix, PATIENT};
use futures::StreamExt as _;
use http::{header, HeaderName, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_ratelimit::key::{Global, ReadBody};
use tower_ratelimit::layer::{RateLimitLayer, Rule};
use tower_ratelimit::{ConfigError, Limit, Limiter, MemoryStore, Quota, Store};

const BUDGET: u64 = 1000;
/// The most one request may ask for: 5 % of the budget.
const MOST: u64 = 50;
/// What the upstream serves when it is told no maximum.
const UPSTREAM_DEFAULT: u64 = 4096;
const MAX_TOKENS: &str = "x-max-tokens";
/// The bound of `ReadBody` in these tests.
const READ_BOUND: usize = 4096;

fn tokens() -> Limit {
    Limit::new("tokens", Quota::per_day(BUDGET).fixed_window()).expect("limit")
}

/// Where a rule reads the estimate from.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Side {
    /// `cost_from_request_json("max_tokens")`.
    Field,
    /// `cost_from_request_header("x-max-tokens")`.
    Header,
}

/// What the test upstream saw and served.
#[derive(Default)]
struct Upstream {
    /// Tokens served, summed over every request.
    served: AtomicU64,
    /// Requests that reached it.
    calls: AtomicUsize,
    /// The `Accept-Encoding` of the last request.
    accept_encoding: Mutex<Option<String>>,
    /// Requests whose body length differed from their `Content-Length`.
    bad_lengths: AtomicUsize,
    /// The maximum the last request told it (None: its own default).
    told: Mutex<Option<u64>>,
    /// Held by a `hang` answer after its first event.
    hang: tokio::sync::Notify,
    /// The body of the last request.
    body: Mutex<Bytes>,
}

/// The most a request tells the upstream, read as an upstream can: the
/// last header line, the last of a duplicate name, a string or a float.
fn lenient(value: &Value) -> Option<f64> {
    match value {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

async fn upstream(State(up): State<Arc<Upstream>>, headers: HeaderMap, body: Bytes) -> Response {
    up.calls.fetch_add(1, Ordering::SeqCst);
    *up.body.lock().unwrap() = body.clone();
    let length = headers.get(header::CONTENT_LENGTH);
    if length.is_some_and(|l| l.to_str().ok() != Some(&body.len().to_string())) {
        up.bad_lengths.fetch_add(1, Ordering::SeqCst);
    }
    let accept = headers.get(header::ACCEPT_ENCODING);
    *up.accept_encoding.lock().unwrap() = accept.and_then(|a| a.to_str().ok()).map(str::to_owned);
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let from_header = headers
        .get_all(MAX_TOKENS)
        .iter()
        .next_back()
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok());
    let told = from_header.or_else(|| lenient(&request["max_tokens"]));
    let told = told.map(|t| t.clamp(0.0, 1e12) as u64);
    *up.told.lock().unwrap() = told;
    let served = told.unwrap_or(UPSTREAM_DEFAULT);
    up.served.fetch_add(served, Ordering::SeqCst);
    let usage = json!({"usage": {"total_tokens": served}});
    let mode = headers
        .get("x-mode")
        .and_then(|m| m.to_str().ok())
        .unwrap_or("told");
    let gzip_accepted = accept
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("gzip"));
    match mode {
        "gzip" if gzip_accepted => gzipped(usage),
        "gzip-anyway" => gzipped(usage),
        "stream-untold" => events(vec![json!({"choices": [{"delta": "hi"}]})]),
        "hang" => {
            let first = Ok::<_, std::convert::Infallible>(Bytes::from_static(
                b"data: {\"choices\":[]}\n\n",
            ));
            let up = up.clone();
            let rest = async move {
                up.hang.notified().await;
                Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {usage}\n\n")))
            };
            let stream = futures::stream::iter([first]).chain(futures::stream::once(rest));
            let body = Body::from_stream(stream);
            ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
        }
        "stream" => events(vec![json!({"choices": []}), usage]),
        _ => axum::Json(usage).into_response(),
    }
}

fn events(events: Vec<Value>) -> Response {
    let mut text: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    text.push_str("data: [DONE]\n\n");
    ([(header::CONTENT_TYPE, "text/event-stream")], text).into_response()
}

fn gzipped(value: Value) -> Response {
    let body = gzip(value.to_string().as_bytes());
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CONTENT_ENCODING, "gzip"),
        ],
        body,
    )
        .into_response()
}

/// `data` as a gzip member (RFC 1952) of stored deflate blocks (RFC 1951,
/// 3.2.4): compressed by no dependency, readable by any gzip reader.
fn gzip(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255];
    let blocks: Vec<&[u8]> = data.chunks(0xffff).collect();
    let blocks = if blocks.is_empty() {
        vec![&[][..]]
    } else {
        blocks
    };
    for (i, block) in blocks.iter().enumerate() {
        out.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        out.extend(len.to_le_bytes());
        out.extend((!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    out.extend((!crc).to_le_bytes());
    out.extend((data.len() as u32).to_le_bytes());
    out
}

/// The LLM layout of the README, reading its estimate from `side`.
fn llm_rule(side: Side) -> Rule {
    let rule = Rule::new(tokens(), Global);
    let rule = match side {
        Side::Field => rule.cost_from_request_json("max_tokens"),
        Side::Header => rule.cost_from_request_header(HeaderName::from_static(MAX_TOKENS)),
    };
    rule.cost_from_response_json("usage.total_tokens")
        .settle_estimates(0.05)
}

/// An app of `rule` over `store`, `ReadBody` around the layer, in front
/// of a fresh test upstream.
fn app_of(store: Store, rule: Rule) -> (Router, Arc<Upstream>) {
    let up = Arc::new(Upstream::default());
    let layer = RateLimitLayer::builder()
        .store(store)
        .timeout(PATIENT)
        .rule(rule)
        .build()
        .expect("layer");
    let router = Router::new()
        .route("/v1/chat/completions", post(upstream))
        .with_state(up.clone())
        .layer(ReadBody::new().max_bytes(READ_BOUND).around(layer));
    (router, up)
}

/// A fresh memory store and a fresh Redis prefix, each with a looker.
fn stores(test: &str) -> Vec<(&'static str, Store, Limiter)> {
    let memory = MemoryStore::new();
    let redis = common::redis_store(&unique_prefix(test));
    vec![
        (
            "memory",
            memory.clone().into(),
            patient_limiter(memory, tokens()),
        ),
        (
            "redis",
            redis.clone().into(),
            patient_limiter(redis, tokens()),
        ),
    ]
}

/// A request: `body` as the JSON body (with its `Content-Length`), the
/// header lines `lines` of `x-max-tokens`, the upstream's answer `mode`.
fn request(body: &str, lines: &[&str], mode: &str) -> Request<Body> {
    let mut request = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, body.len())
        .header("x-mode", mode);
    for line in lines {
        request = request.header(MAX_TOKENS, *line);
    }
    request.body(Body::from(body.to_owned())).expect("request")
}

/// Sends `request`, reads the whole answer: its status and body.
async fn send(app: &Router, request: Request<Body>) -> (StatusCode, Bytes) {
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, body)
}

/// Forms an upstream can read but the crate cannot read unambiguously:
/// refused (400) before anything is taken or forwarded, on either store.
#[tokio::test]
async fn an_estimate_that_cannot_be_read_unambiguously_is_refused_and_takes_nothing() {
    let padding = "x".repeat(READ_BOUND);
    let over_bound = format!(r#"{{"max_tokens":10,"pad":"{padding}"}}"#);
    let field_forms: Vec<(&str, String)> = vec![
        (
            "duplicate name",
            r#"{"max_tokens":1,"max_tokens":100000}"#.into(),
        ),
        ("string", r#"{"max_tokens":"100000"}"#.into()),
        ("2^64", r#"{"max_tokens":18446744073709551616}"#.into()),
        ("1e400", r#"{"max_tokens":1e400}"#.into()),
        ("negative", r#"{"max_tokens":-5}"#.into()),
        ("fraction", r#"{"max_tokens":10.5}"#.into()),
        ("null", r#"{"max_tokens":null}"#.into()),
        ("zero", r#"{"max_tokens":0}"#.into()),
        ("no JSON object", r#"["max_tokens",10]"#.into()),
        ("not JSON", "max_tokens=10".into()),
        ("over ReadBody's bound", over_bound),
    ];
    let header_forms: Vec<(&str, Vec<&str>)> = vec![
        ("two lines", vec!["1", "100000"]),
        ("a string", vec!["\"100\""]),
        ("2^64", vec!["18446744073709551616"]),
        ("negative", vec!["-5"]),
        ("fraction", vec!["1.5"]),
        ("a word", vec!["many"]),
        ("a sign", vec!["+5"]),
        ("zero", vec!["0"]),
    ];
    for (store, made, looker) in stores("unreadable") {
        let (field_app, field_up) = app_of(made.clone(), llm_rule(Side::Field));
        for (form, body) in &field_forms {
            let (status, answer) = send(&field_app, request(body, &[], "told")).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{store}: {form}");
            let problem: Value = serde_json::from_slice(&answer).expect("a problem body");
            assert_eq!(problem["status"], 400, "{store}: {form}");
        }
        let (header_app, header_up) = app_of(made, llm_rule(Side::Header));
        for (form, lines) in &header_forms {
            let (status, _) = send(&header_app, request("{}", lines, "told")).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{store}: header {form}");
        }
        assert_eq!(field_up.calls.load(Ordering::SeqCst), 0, "{store}");
        assert_eq!(header_up.calls.load(Ordering::SeqCst), 0, "{store}");
        settles_to(&looker, BUDGET, store).await;
    }
}

/// One grammar: `10`, `10.0`, `1e1` are 10 in a header, in a JSON field and
/// in the usage a response tells; `1e5` is 100,000 everywhere, over the
/// share (400).
#[tokio::test]
async fn every_reader_reads_one_number_grammar() {
    for (store, made, looker) in stores("grammar") {
        for side in [Side::Field, Side::Header] {
            let (app, up) = app_of(made.clone(), llm_rule(side));
            let mut left = looker.peek("global", 0).await.expect("peek").remaining();
            for form in ["10", "10.0", "1e1", "1.0E+1"] {
                let request = match side {
                    Side::Field => request(&format!(r#"{{"max_tokens":{form}}}"#), &[], "told"),
                    Side::Header => request("{}", &[form], "told"),
                };
                let (status, _) = send(&app, request).await;
                assert_eq!(status, StatusCode::OK, "{store}: {side:?} {form}");
                assert_eq!(*up.told.lock().unwrap(), Some(10), "{store}: {form}");
                left -= 10;
                settles_to(&looker, left, store).await;
            }
            let request = match side {
                Side::Field => request(r#"{"max_tokens":1e5}"#, &[], "told"),
                Side::Header => request("{}", &["1e5"], "told"),
            };
            let (status, answer) = send(&app, request).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{store}: {side:?} 1e5");
            assert!(
                String::from_utf8_lossy(&answer).contains("100000"),
                "{store}"
            );
        }
    }
}

/// An absent estimate is charged the fallback and the forwarded request
/// says so: the field written into the JSON body (its `Content-Length`
/// fixed), or the header set. The upstream serves that, not its default.
#[tokio::test]
async fn an_absent_estimate_is_charged_the_fallback_and_the_upstream_is_told_it() {
    for (store, made, looker) in stores("absent") {
        let mut left = BUDGET;
        for side in [Side::Field, Side::Header] {
            for body in [r#"{"messages":[]}"#, "{}", " { } ", r#"{"max":1}"#] {
                let (app, up) = app_of(made.clone(), llm_rule(side));
                // the stream tells no usage: the fallback is what it costs
                let (status, _) = send(&app, request(body, &[], "stream-untold")).await;
                assert_eq!(status, StatusCode::OK, "{store}: {side:?} {body}");
                assert_eq!(*up.told.lock().unwrap(), Some(MOST), "{store}: {body}");
                assert_eq!(up.served.load(Ordering::SeqCst), MOST, "{store}: {body}");
                assert_eq!(up.bad_lengths.load(Ordering::SeqCst), 0, "{store}: {body}");
                left -= MOST;
                settles_to(&looker, left, store).await;
            }
        }
        // a fallback of the rule's own: that is written
        let (app, up) = app_of(made.clone(), llm_rule(Side::Field).estimate_fallback(20));
        let (status, _) = send(&app, request("{}", &[], "stream-untold")).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        assert_eq!(*up.told.lock().unwrap(), Some(20), "{store}");
        settles_to(&looker, left - 20, store).await;
    }
}

/// Two budgets read one field: the request that tells none is charged each
/// one's fallback, and the body forwarded holds the field once, the
/// smaller (the upstream is held to at most what each charged). A rule
/// without estimates reading the same header keeps its own fallback.
#[tokio::test]
async fn rules_reading_one_place_write_it_once() {
    for (store, made, looker) in stores("one-place") {
        let small = Limit::new("small", Quota::per_day(400).fixed_window()).expect("limit");
        let small_looker = patient_limiter(made.clone(), small.clone());
        let second = Rule::new(small, Global)
            .cost_from_request_json("max_tokens")
            .cost_from_response_json("usage.total_tokens")
            .settle_estimates(0.05);
        let up = Arc::new(Upstream::default());
        let layer = RateLimitLayer::builder()
            .store(made.clone())
            .timeout(PATIENT)
            .rule(llm_rule(Side::Field))
            .rule(second)
            .build()
            .expect("layer");
        let app = Router::new()
            .route("/v1/chat/completions", post(upstream))
            .with_state(up.clone())
            .layer(ReadBody::new().max_bytes(READ_BOUND).around(layer));
        let (status, _) = send(&app, request(r#"{"messages":[]}"#, &[], "stream-untold")).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        let body = up.body.lock().unwrap().clone();
        let text = String::from_utf8_lossy(&body).into_owned();
        assert_eq!(text.matches("max_tokens").count(), 1, "{store}: {text}");
        assert_eq!(*up.told.lock().unwrap(), Some(20), "{store}");
        settles_to(&looker, BUDGET - MOST, store).await;
        settles_to(&small_looker, 400 - 20, store).await;

        // a rule without estimates on the same header: its fallback, 1
        let count = Limit::new("count", Quota::per_day(3).fixed_window()).expect("limit");
        let count_looker = patient_limiter(made.clone(), count.clone());
        let plain =
            Rule::new(count, Global).cost_from_request_header(HeaderName::from_static(MAX_TOKENS));
        let layer = RateLimitLayer::builder()
            .store(made.clone())
            .timeout(PATIENT)
            .rule(llm_rule(Side::Header))
            .rule(plain)
            .build()
            .expect("layer");
        let app = Router::new()
            .route("/v1/chat/completions", post(upstream))
            .with_state(up.clone())
            .layer(ReadBody::new().max_bytes(READ_BOUND).around(layer));
        let (status, _) = send(&app, request("{}", &[], "stream-untold")).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        assert_eq!(*up.told.lock().unwrap(), Some(MOST), "{store}");
        let peeked = count_looker.peek("global", 0).await.expect("peek");
        assert_eq!(peeked.remaining(), 2, "{store}");
    }
}

/// A request path of several names is read as the response's is, and an
/// absent estimate is written there when the body lacks the path's first
/// name; a body that has it without the rest cannot be written into: 400.
#[tokio::test]
async fn a_nested_request_path_is_read_and_written() {
    for (store, made, _) in stores("nested-path") {
        let limit = Limit::new("nested", Quota::per_day(400).fixed_window()).expect("limit");
        let looker = patient_limiter(made.clone(), limit.clone());
        let rule = Rule::new(limit, Global)
            .cost_from_request_json("options.max_tokens")
            .cost_from_response_json("usage.total_tokens")
            .settle_estimates(0.05)
            .estimate_fallback(9);
        let up = Arc::new(Upstream::default());
        let layer = RateLimitLayer::builder()
            .store(made.clone())
            .timeout(PATIENT)
            .rule(rule)
            .build()
            .expect("layer");
        let app = Router::new()
            .route("/v1/chat/completions", post(upstream))
            .with_state(up.clone())
            .layer(ReadBody::new().max_bytes(READ_BOUND).around(layer));
        // told: 12 taken on arrival (the upstream, reading `max_tokens` at
        // the top, serves its default; the estimate is what is charged
        // until the answer settles it)
        let body = r#"{"options":{"max_tokens":12},"messages":[]}"#;
        let (status, _) = send(&app, request(body, &[], "stream-untold")).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        settles_to(&looker, 400 - 12, store).await;
        // absent: the fallback, written as `"options":{"max_tokens":9}`
        let (status, _) = send(&app, request(r#"{"messages":[]}"#, &[], "stream-untold")).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        let forwarded: Value = serde_json::from_slice(&up.body.lock().unwrap()).expect("json");
        assert_eq!(
            forwarded["options"]["max_tokens"],
            json!(9),
            "{store}: {forwarded}"
        );
        assert_eq!(forwarded["messages"], json!([]), "{store}");
        assert_eq!(up.bad_lengths.load(Ordering::SeqCst), 0, "{store}");
        settles_to(&looker, 400 - 12 - 9, store).await;
        // `options` without the field: it cannot be written, refused
        let calls = up.calls.load(Ordering::SeqCst);
        let body = r#"{"options":{"temperature":1}}"#;
        let (status, _) = send(&app, request(body, &[], "stream-untold")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{store}");
        assert_eq!(up.calls.load(Ordering::SeqCst), calls, "{store}");
        settles_to(&looker, 400 - 12 - 9, store).await;
    }
    // a path with an empty name does not build
    let limit = Limit::new("bad-path", Quota::per_day(400).fixed_window()).expect("limit");
    let built = RateLimitLayer::builder()
        .rule(Rule::new(limit, Global).cost_from_request_json("options..max_tokens"))
        .build();
    assert!(matches!(built, Err(ConfigError::Layer(_))));
}

/// A fallback of 0 would be written as a maximum some upstreams read as
/// none: a build error, as `cost_if_untold` over the capacity is.
#[test]
fn a_fallback_of_zero_and_an_untold_cost_over_the_capacity_do_not_build() {
    let built = RateLimitLayer::builder()
        .rule(llm_rule(Side::Field).estimate_fallback(0))
        .build();
    assert!(matches!(built, Err(ConfigError::Layer(_))));
    let rule = Rule::new(tokens(), Global)
        .cost_from_response_json("usage.total_tokens")
        .cost_if_untold(BUDGET + 1);
    let built = RateLimitLayer::builder().rule(rule).build();
    assert!(matches!(built, Err(ConfigError::Layer(_))));
    let rule = Rule::new(tokens(), Global).cost_if_untold(10);
    let built = RateLimitLayer::builder().rule(rule).build();
    assert!(matches!(built, Err(ConfigError::Layer(_))));
}

/// A metered body is asked for as sent: the client's `Accept-Encoding:
/// gzip` reaches the upstream as `identity`, and its usage is read. An
/// upstream that gzips anyway leaves the estimate binding.
#[tokio::test]
async fn a_compressed_answer_does_not_defeat_the_meter() {
    for (store, made, looker) in stores("gzip") {
        let (app, up) = app_of(made, llm_rule(Side::Field));
        let mut ask = request(r#"{"max_tokens":40}"#, &[], "gzip");
        ask.headers_mut()
            .insert(header::ACCEPT_ENCODING, "gzip, br".parse().expect("value"));
        let (status, answer) = send(&app, ask).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        assert_eq!(
            up.accept_encoding.lock().unwrap().as_deref(),
            Some("identity")
        );
        let usage: Value = serde_json::from_slice(&answer).expect("an answer not gzipped");
        assert_eq!(usage["usage"]["total_tokens"], 40);
        settles_to(&looker, BUDGET - 40, store).await;

        // an upstream that gzips whatever it is asked: the estimate stays
        let (status, answer) =
            send(&app, request(r#"{"max_tokens":30}"#, &[], "gzip-anyway")).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        assert_eq!(&answer[..2], &[0x1f, 0x8b], "{store}: gzip");
        settles_to(&looker, BUDGET - 40 - 30, store).await;
    }
}

/// The client drops the stream before its usage event: the estimate, the
/// upstream's maximum, stays.
#[tokio::test]
async fn a_stream_dropped_before_its_usage_keeps_the_estimate() {
    for (store, made, looker) in stores("dropped") {
        let (app, up) = app_of(made, llm_rule(Side::Field));
        let response = app
            .clone()
            .oneshot(request(r#"{"max_tokens":45}"#, &[], "hang"))
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::OK, "{store}");
        let mut body = response.into_body();
        let first = body.frame().await.expect("a frame").expect("data");
        assert!(first.is_data(), "{store}");
        drop(body);
        up.hang.notify_waiters();
        settles_to(&looker, BUDGET - 45, store).await;
    }
}

/// A rule without estimates whose answer tells nothing costs its arrival
/// cost (1); with `cost_if_untold(n)`, n.
#[tokio::test]
async fn an_answer_that_tells_nothing_costs_the_arrival_cost_or_cost_if_untold() {
    for (store, made, looker) in stores("untold") {
        let plain = Rule::new(tokens(), Global).cost_from_response_json("usage.total_tokens");
        let (app, _) = app_of(made.clone(), plain);
        let (status, _) = send(&app, request("{}", &[], "stream-untold")).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        settles_to(&looker, BUDGET - 1, store).await;
        let (status, _) = send(&app, request("{}", &[], "gzip-anyway")).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        settles_to(&looker, BUDGET - 2, store).await;

        let most = Rule::new(tokens(), Global)
            .cost_from_response_json("usage.total_tokens")
            .cost_if_untold(300);
        let (app, _) = app_of(made, most);
        let (status, _) = send(&app, request("{}", &[], "stream-untold")).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        settles_to(&looker, BUDGET - 2 - 300, store).await;
        // told: what it tells
        let (status, _) = send(&app, request(r#"{"max_tokens":7}"#, &[], "told")).await;
        assert_eq!(status, StatusCode::OK, "{store}");
        settles_to(&looker, BUDGET - 2 - 300 - 7, store).await;
    }
}

/// The attacks of the issue, in a loop: each form, sent one request at a
/// time until the budget refuses, then with 60 in flight at once; whatever
/// the form, the upstream serves at most the budget (it honours what it is
/// told and reports what it served: the bound's extra term is 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attackers_loops_take_at_most_the_budget() {
    // (side, body, header lines, answer, granted): each request-side form
    // with an answer that tells no usage, hides it or tells it; whether
    // the form is granted (the others are refused, 400)
    let forms: Vec<(Side, &str, Vec<&str>, &str, bool)> = vec![
        (
            Side::Field,
            r#"{"messages":[]}"#,
            vec![],
            "stream-untold",
            true,
        ),
        (
            Side::Field,
            r#"{"messages":[],"stream":true}"#,
            vec![],
            "gzip-anyway",
            true,
        ),
        (Side::Field, r#"{"messages":[]}"#, vec![], "hang", true),
        (
            Side::Field,
            r#"{"max_tokens":50}"#,
            vec![],
            "stream-untold",
            true,
        ),
        (Side::Field, r#"{"max_tokens":5e1}"#, vec![], "gzip", true),
        (
            Side::Field,
            r#"{"max_tokens":1,"max_tokens":100000}"#,
            vec![],
            "stream-untold",
            false,
        ),
        (
            Side::Field,
            r#"{"max_tokens":"100000"}"#,
            vec![],
            "stream-untold",
            false,
        ),
        (
            Side::Field,
            r#"{"max_tokens":1e5}"#,
            vec![],
            "stream-untold",
            false,
        ),
        (
            Side::Field,
            r#"{"max_tokens":18446744073709551616}"#,
            vec![],
            "told",
            false,
        ),
        (Side::Header, "{}", vec![], "stream-untold", true),
        (
            Side::Header,
            "{}",
            vec!["1", "100000"],
            "stream-untold",
            false,
        ),
        (Side::Header, "{}", vec!["50"], "gzip-anyway", true),
        (Side::Field, r#"{"max_tokens":40}"#, vec![], "told", true),
        (Side::Field, "{}", vec![], "stream", true),
    ];
    for (store, made, _) in stores("attack") {
        for (side, body, lines, mode, granted) in &forms {
            // one request at a time, on a budget of its own
            let fresh = match store {
                "memory" => Store::from(MemoryStore::new()),
                _ => common::redis_store(&unique_prefix("attack-one")).into(),
            };
            let (one, up) = app_of(fresh, llm_rule(*side));
            let mut ok = 0;
            for _ in 0..100 {
                let mut ask = request(body, lines, mode);
                ask.headers_mut()
                    .insert(header::ACCEPT_ENCODING, "gzip".parse().expect("value"));
                if *mode == "hang" {
                    // the client drops the stream after its first event
                    let response = one.clone().oneshot(ask).await.expect("infallible");
                    if response.status() != StatusCode::OK {
                        break;
                    }
                    let mut answer = response.into_body();
                    answer.frame().await.expect("a frame").expect("data");
                    ok += 1;
                    continue;
                }
                let (status, _) = send(&one, ask).await;
                if status != StatusCode::OK {
                    break;
                }
                ok += 1;
                // (what a response tells settles on a task of its own)
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let served = up.served.load(Ordering::SeqCst);
            let what = format!("{store}: {side:?} {body} {lines:?} {mode}");
            assert!(served <= BUDGET, "{what}: one at a time, {served} served");
            assert_eq!(ok > 0, *granted, "{what}: {ok} granted");
            if *granted {
                // not a loop that stopped early: the budget is used up
                assert!(served > BUDGET - MOST, "{what}: {served} served");
            }

            // 60 in flight at once
            let fresh = match store {
                "memory" => Store::from(MemoryStore::new()),
                _ => common::redis_store(&unique_prefix("attack-many")).into(),
            };
            let (many, up) = app_of(fresh, llm_rule(*side));
            // ("hang" answers are cut by their clients after the first event)
            let calls: Vec<_> = (0..60)
                .map(|_| {
                    let many = many.clone();
                    let ask = request(body, lines, mode);
                    tokio::spawn(async move {
                        let response = many.oneshot(ask).await.expect("infallible");
                        let mut answer = response.into_body();
                        let _ = answer.frame().await;
                    })
                })
                .collect();
            for call in calls {
                call.await.expect("task");
            }
            let served = up.served.load(Ordering::SeqCst);
            assert!(
                served <= BUDGET,
                "{store}: {side:?} {body} {lines:?} {mode}: 60 in flight, {served} served"
            );
            if *granted {
                assert!(
                    served > BUDGET - MOST,
                    "{what}: 60 in flight, {served} served"
                );
            } else {
                assert_eq!(up.calls.load(Ordering::SeqCst), 0, "{what}: forwarded");
            }
        }
        drop(made);
    }
}
