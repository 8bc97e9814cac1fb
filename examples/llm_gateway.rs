//! An LLM API gateway: a fake upstream model behind the limits an API
//! gateway needs, shared by every instance through Redis.
//!
//! ```text
//! cargo run --example llm_gateway --all-features                 # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example llm_gateway --all-features
//! ```
//!
//! Environment: `PORT` (default 3000, on 127.0.0.1), `REDIS_URL` (limits
//! shared by every instance on that Redis; default: in this process only),
//! `LIMITS_FILE` (default `examples/llm_limits.toml`: read again whenever
//! it changes), `METRICS_TOKEN` (`GET /metrics` answers only a request with
//! `Authorization: Bearer <METRICS_TOKEN>`; unset: never).
//!
//! - `POST /v1/chat/completions` (`Authorization: Bearer <API key>`, an
//!   OpenAI-style JSON body): 401 for an unknown key; `requests` per API
//!   key per calendar month, and `tokens` per tenant per minute in the same
//!   layer: a call pays its `max_tokens` on arrival (absent: the most one
//!   call may ask for, a tenth of the budget, written into the body the
//!   model reads; more than that, 0, or unreadable, as `"100"` or given
//!   twice: 400), and is settled to the `usage.total_tokens` of the answer,
//!   streamed or not (`"stream": true`: server-sent events, the last with
//!   the usage; an answer without it keeps what was paid).
//!   The monthly quota is keyed by a hash of the `Authorization` header,
//!   never the API key itself; its counts need a Redis that keeps them
//!   (AOF or RDB, `noeviction`: see `CalendarRate`), as the crate warns.
//! - `POST /login` with `{"username": ..., "password": ...}` (every password
//!   is `correct horse`): 200, or 401 counted under `login` per username;
//!   429 once a username has used its failures.
//! - `POST /v1/sms/{phone}`: decided by the limiter itself (no layer),
//!   `sms` per phone number; 202 with the rate-limit fields, 429 or 503 as
//!   the layer would respond; 400 for a number without 7 to 15 digits.
//! - `GET /metrics`: the limiter's metrics in the Prometheus text format,
//!   histograms with the buckets of `examples/grafana-dashboard.json` and
//!   `examples/prometheus-alerts.yml`.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, request::Parts, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde_json::{json, Value};
use subtle::ConstantTimeEq;
use tower_ratelimit::key::{Bearer, JsonField, KeyExtractor, ReadBody};
use tower_ratelimit::layer::{respond, MissingKey, RateLimitLayer, Rule};
use tower_ratelimit::watch::LimitsFile;
use tower_ratelimit::{Limiter, LiveLimit, LiveLimits, MemoryStore, RedisStore, Store};

type Result<T, E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

/// The API keys and their tenants (a real gateway looks them up).
pub const API_KEYS: [(&str, &str); 3] = [
    ("sk-acme-4f9c2a7d1e", "acme"),
    ("sk-acme-b83e60c5f2", "acme"),
    ("sk-globex-7d21a9e4c0", "globex"),
];

/// What `GET /metrics` renders, and the token a request for it must carry.
pub type Metrics = (PrometheusHandle, Option<String>);

/// The longest answer the fake upstream writes, in tokens.
pub const MAX_COMPLETION: u64 = 256;

/// Whether `given` is `secret`, in constant time.
fn same(given: &str, secret: &str) -> bool {
    given.as_bytes().ct_eq(secret.as_bytes()).into()
}

/// The tenant of the request's API key; none for an unknown key (401).
fn tenant(request: &Parts) -> Option<String> {
    let key = Bearer::token(&request.headers)?;
    let (_, tenant) = API_KEYS.iter().find(|(known, _)| same(key, known))?;
    Some((*tenant).to_owned())
}

/// The process's Prometheus recorder, histograms with the crate's buckets
/// (the `_bucket` series the dashboard and alerts query).
pub fn prometheus() -> Result<PrometheusHandle> {
    let mut exporter = PrometheusBuilder::new();
    for (name, bounds) in tower_ratelimit::metrics::buckets() {
        exporter = exporter.set_buckets_for_metric(Matcher::Full(name.to_owned()), bounds)?;
    }
    Ok(exporter.install_recorder()?)
}

/// The gateway over `store`, with `limits` (each instance of a fleet builds
/// its own, over the same Redis).
pub fn app(
    store: impl Into<Store> + Clone,
    limits: &LiveLimits,
    metrics: Metrics,
) -> Result<Router> {
    let limit = |name: &str| -> Result<LiveLimit> { Ok(limits.get(name).ok_or(name)?) };
    // Two budgets in one layer, each rule with its own key and cost: one
    // request per API key (hashed: the key is a secret, Redis key names are
    // not), and its tokens per tenant, estimated then settled.
    let api_key = Bearer.hashed();
    let chat = RateLimitLayer::builder()
        .store(store.clone())
        .rule(
            Rule::new(limit("requests")?, api_key)
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED)),
        )
        .rule(
            Rule::new(limit("tokens")?, tenant)
                .on_missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
                .cost_from_request_json("max_tokens")
                .cost_from_response_json("usage.total_tokens")
                .settle_estimates(0.1),
        )
        .build()?;
    let username = JsonField::new("username").normalize(|name| Some(name.trim().to_lowercase()));
    let login = RateLimitLayer::builder()
        .store(store.clone())
        .rule(Rule::new(limit("login")?, username).refund_if(|r| r.status.is_success()))
        .build()?;
    let sms = Limiter::new(store, limit("sms")?);
    let (chat, login) = (ReadBody::new().around(chat), ReadBody::new().around(login));
    Ok(Router::new()
        .route("/v1/chat/completions", post(complete).layer(chat))
        .route("/login", post(log_in).layer(login))
        .route("/v1/sms/{phone}", post(text).with_state(sms))
        .route("/metrics", get(render).with_state(metrics)))
}

/// The fake upstream model: a prompt of one token per byte of its messages
/// (as JSON), an answer of `max_tokens` tokens (at most [`MAX_COMPLETION`]),
/// and their usage; as server-sent events when asked to stream, the usage
/// in the last before `[DONE]`.
async fn complete(Json(request): Json<Value>) -> Response {
    let prompt = request["messages"].to_string().len() as u64;
    let answer = MAX_COMPLETION.min(request["max_tokens"].as_u64().unwrap_or(MAX_COMPLETION));
    let usage = json!({"prompt_tokens": prompt, "completion_tokens": answer,
        "total_tokens": prompt + answer});
    let message = json!({"role": "assistant", "content": "Hello!"});
    if request["stream"] != true {
        return Json(json!({"choices": [{"message": message}], "usage": usage})).into_response();
    }
    let delta = json!({"choices": [{"delta": message}]});
    let last = json!({"choices": [], "usage": usage});
    let events = [delta, last].map(|event| format!("data: {event}\n\n"));
    let chunks = events.into_iter().chain(["data: [DONE]\n\n".into()]);
    let body = Body::from_stream(futures::stream::iter(chunks.map(Ok::<_, Infallible>)));
    ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
}

async fn log_in(Json(credentials): Json<Value>) -> StatusCode {
    // (a real service verifies a password hash: argon2, scrypt, bcrypt)
    match credentials["password"].as_str() {
        Some(password) if same(password, "correct horse") => StatusCode::OK,
        _ => StatusCode::UNAUTHORIZED,
    }
}

/// Queues a text to `phone` if its limit allows one now: the layer's
/// responses to the limiter's own decision, without a layer. Keyed by the digits, so that `+1 555-0100`
/// and `+15550100` are one number.
async fn text(State(sms): State<Limiter>, Path(phone): Path<String>) -> Response {
    let digits: String = phone.chars().filter(char::is_ascii_digit).collect();
    if !(7..=15).contains(&digits.len()) {
        return StatusCode::BAD_REQUEST.into_response();
    }
    let queued = (StatusCode::ACCEPTED, "queued\n").into_response();
    respond(sms.check(&digits, 1).await, queued)
}

async fn render(State((metrics, token)): State<Metrics>, headers: HeaderMap) -> Response {
    match (Bearer::token(&headers), token) {
        (Some(given), Some(token)) if same(given, &token) => metrics.render().into_response(),
        _ => StatusCode::UNAUTHORIZED.into_response(),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt::init();
    let var = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/llm_limits.toml");
    let (limits, _watch) = LimitsFile::new(var("LIMITS_FILE").unwrap_or(shipped.into())).live()?;
    let metrics = (prometheus()?, var("METRICS_TOKEN"));
    let redis = |url: String| RedisStore::builder(url).prefix("llm").build();
    let app = match var("REDIS_URL") {
        Some(url) => app(redis(url)?, &limits, metrics)?,
        None => app(MemoryStore::new(), &limits, metrics)?,
    };
    let port: u16 = var("PORT").map_or(Ok(3000), |port| port.parse())?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
