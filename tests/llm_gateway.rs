//! The LLM gateway example (`examples/llm_gateway.rs`) as a fleet runs it:
//! two instances, each its own `Router` over its own `RedisStore` handle and
//! its own watch of one limits file, sharing one Redis, asked in turn.

mod common;

#[allow(dead_code)] // its `main`, which the test does not run
#[path = "../examples/llm_gateway.rs"]
mod gateway;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_ratelimit::watch::{FileWatch, LimitsFile};
use tower_ratelimit::{Limiter, LiveLimits, RedisStore};

use common::TestRedis;

const METRICS_TOKEN: &str = "metrics-secret-0123";
/// The test's monthly quota of requests per API key (the shipped file: 1000).
const MONTHLY: usize = 10;

/// Each API key of the example, by tenant.
fn keys_of(tenant: &str) -> Vec<&'static str> {
    let keys = gateway::API_KEYS.iter().filter(|(_, t)| *t == tenant);
    keys.map(|(key, _)| *key).collect()
}

/// The recorder of this test process (one per process), shared by every
/// instance of every test, as one process's instances would share it.
fn metrics() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    let handle = HANDLE.get_or_init(|| gateway::prometheus().expect("install the recorder"));
    handle.clone()
}

/// One instance: its app, its limits and the watch that follows the file.
struct Instance {
    app: Router,
    limits: LiveLimits,
    _watch: FileWatch,
}

/// Two instances over one Redis and one limits file.
struct Fleet {
    redis: TestRedis,
    prefix: String,
    file: PathBuf,
    _dir: tempfile::TempDir,
    instances: [Instance; 2],
}

/// The shipped limits file with the test's monthly quota.
fn limits_text(tokens: u64) -> String {
    let shipped = include_str!("../examples/llm_limits.toml");
    assert!(shipped.contains("limit = 1000\n") && shipped.contains("limit = 10000\n"));
    let text = shipped.replace("limit = 1000\n", &format!("limit = {MONTHLY}\n"));
    text.replace("limit = 10000\n", &format!("limit = {tokens}\n"))
}

impl Fleet {
    fn start() -> Fleet {
        let redis = TestRedis::spawn();
        let dir = tempfile::tempdir().expect("a temporary folder");
        let file = dir.path().join("limits.toml");
        std::fs::write(&file, limits_text(10_000)).expect("write the limits file");
        let prefix = "llm".to_owned();
        let instance = || {
            let (limits, watch) = LimitsFile::new(&file).live().expect("read the limits file");
            let store = RedisStore::builder(redis.url.as_str())
                .prefix(&prefix)
                .build()
                .expect("a Redis store");
            let token = Some(METRICS_TOKEN.to_owned());
            let app = gateway::app(store, &limits, (metrics(), token)).expect("the gateway");
            Instance {
                app,
                limits,
                _watch: watch,
            }
        };
        let instances = [instance(), instance()];
        Fleet {
            redis,
            prefix,
            file,
            _dir: dir,
            instances,
        }
    }

    /// The instance that answers the `n`-th request: each in turn.
    fn app(&self, n: usize) -> &Router {
        &self.instances[n % 2].app
    }

    /// A limiter on the store the instances share, with the limit `name` as
    /// the first instance has it, to look at what they counted.
    fn limiter(&self, name: &str) -> Limiter {
        let store = RedisStore::builder(self.redis.url.as_str())
            .prefix(&self.prefix)
            .build()
            .expect("a Redis store");
        let limit = self.instances[0].limits.get(name).expect("a limit");
        Limiter::new(store, limit)
    }

    /// Every key name in the Redis.
    fn redis_keys(&self) -> Vec<String> {
        let client = redis::Client::open(self.redis.url.as_str()).expect("a client");
        let mut conn = client.get_connection().expect("a connection");
        let keys: redis::Iter<String> = redis::Commands::scan(&mut conn).expect("SCAN");
        keys.collect::<Result<_, _>>().expect("SCAN")
    }
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        let value = self.headers.get(name);
        let value = value.unwrap_or_else(|| panic!("no {name} in {:?}", self.headers));
        value.to_str().expect("a text header")
    }

    /// `Retry-After`, in seconds.
    fn retry_after(&self) -> u64 {
        self.header("retry-after").parse().expect("seconds")
    }

    /// What the `RateLimit` field says remains of the limit `name`.
    fn remaining(&self, name: &str) -> u64 {
        let field = self.header("ratelimit");
        let item = field
            .split(", ")
            .find(|item| item.starts_with(&format!("\"{name}\";")));
        let item = item.unwrap_or_else(|| panic!("no {name} in RateLimit: {field}"));
        let r = item.split(';').find_map(|param| param.strip_prefix("r="));
        r.and_then(|r| r.parse().ok()).expect("r=")
    }
}

/// Sends `request` to `app` and reads the whole answer (its body's end
/// settles what it cost).
async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = app.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, 1 << 20).await.expect("the body");
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8(body.to_vec()).expect("a text body"),
    }
}

fn post_json(path: &str, bearer: Option<&str>, body: Value) -> Request<Body> {
    let mut request = Request::post(path).header("content-type", "application/json");
    if let Some(token) = bearer {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    request
        .body(Body::from(body.to_string()))
        .expect("a request")
}

/// The messages of a chat completion asking `prompt`.
fn messages(prompt: &str) -> Value {
    json!([{"role": "user", "content": prompt}])
}

/// What the fake upstream counts `prompt` as: one token per byte of its
/// messages.
fn prompt_tokens(prompt: &str) -> u64 {
    messages(prompt).to_string().len() as u64
}

/// A chat completion with `api_key`: the prompt, then `max_tokens` and
/// `stream` if given.
fn chat(api_key: &str, prompt: &str, max_tokens: Option<u64>, stream: bool) -> Request<Body> {
    let mut body = json!({"model": "fake", "messages": messages(prompt)});
    if let Some(max_tokens) = max_tokens {
        body["max_tokens"] = json!(max_tokens);
    }
    if stream {
        body["stream"] = json!(true);
    }
    post_json("/v1/chat/completions", Some(api_key), body)
}

/// A text to `phone`.
fn sms(phone: &str) -> Request<Body> {
    let path = format!("/v1/sms/{phone}");
    Request::post(path).body(Body::empty()).expect("a request")
}

/// Waits (at most 5 s) until `limiter` says `remaining` is left for `key`:
/// a settlement is made on a task of its own once the body has ended.
async fn settles_to(limiter: &Limiter, key: &str, remaining: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = limiter.peek(key, 0).await.expect("peek").remaining();
        if now == remaining {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{key}: {now} left, expected {remaining}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_monthly_quota_is_per_api_key_across_instances_and_keys_are_hashed() {
    let fleet = Fleet::start();
    let globex = keys_of("globex")[0];
    for n in 0..MONTHLY {
        let answer = send(fleet.app(n), chat(globex, "hi", Some(1), false)).await;
        assert_eq!(
            answer.status,
            StatusCode::OK,
            "request {n}: {}",
            answer.body
        );
        assert_eq!(answer.remaining("requests"), (MONTHLY - n - 1) as u64);
    }
    let refused = send(fleet.app(MONTHLY), chat(globex, "hi", Some(1), false)).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    let retry_after = refused.retry_after();
    assert!((1..=31 * 24 * 3600).contains(&retry_after), "{retry_after}");
    assert_eq!(refused.header("content-type"), "application/problem+json");
    assert_eq!(refused.remaining("requests"), 0);
    // another key of the tenant has its own month; an unknown key has none
    let acme = send(fleet.app(0), chat(keys_of("acme")[0], "hi", Some(1), false)).await;
    assert_eq!(acme.status, StatusCode::OK);
    assert_eq!(acme.remaining("requests"), MONTHLY as u64 - 1);
    let unknown = send(fleet.app(1), chat("sk-nobody", "hi", Some(1), false)).await;
    assert_eq!(unknown.status, StatusCode::UNAUTHORIZED);
    let anonymous = post_json("/v1/chat/completions", None, json!({"max_tokens": 1}));
    assert_eq!(
        send(fleet.app(0), anonymous).await.status,
        StatusCode::UNAUTHORIZED
    );

    let names = fleet.redis_keys();
    assert!(
        names.iter().any(|name| name.contains("requests")),
        "{names:?}"
    );
    assert!(names.iter().any(|name| name.contains("acme")), "{names:?}");
    for (secret, _) in gateway::API_KEYS {
        let start = &secret[..8];
        let leaked: Vec<_> = names.iter().filter(|name| name.contains(start)).collect();
        assert!(leaked.is_empty(), "API key in key names: {leaked:?}");
    }
    assert!(
        !names.iter().any(|name| name.contains("Bearer")),
        "{names:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_budget_is_estimated_from_max_tokens_then_settled_to_usage() {
    let fleet = Fleet::start();
    let tokens = fleet.limiter("tokens");
    let acme = keys_of("acme");
    let mut left = 10_000;

    // an answer: max_tokens on arrival, then the usage (its prompt + 100)
    let answer = send(fleet.app(0), chat(acme[0], "hello", Some(100), false)).await;
    assert_eq!(answer.status, StatusCode::OK);
    let usage = prompt_tokens("hello") + 100;
    let body: Value = serde_json::from_str(&answer.body).expect("JSON");
    assert_eq!(body["usage"]["total_tokens"], usage);
    assert_eq!(answer.remaining("tokens"), left - 100);
    left -= usage;
    settles_to(&tokens, "acme", left).await;

    // a stream, from the other instance and the tenant's other key: the
    // usage of its last event (its prompt + 50)
    let answer = send(fleet.app(1), chat(acme[1], "hi there", Some(50), true)).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.header("content-type"), "text/event-stream");
    let events: Vec<&str> = answer.body.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 3, "{}", answer.body);
    assert_eq!(events[2], "data: [DONE]");
    let last: Value = serde_json::from_str(&events[1]["data: ".len()..]).expect("JSON");
    let usage = prompt_tokens("hi there") + 50;
    assert_eq!(last["usage"]["total_tokens"], usage);
    assert_eq!(answer.remaining("tokens"), left - 50);
    left -= usage;
    settles_to(&tokens, "acme", left).await;

    // no max_tokens: not free, the most one call may ask for (1000) on
    // arrival, written into the body the upstream reads, then the usage
    // (the prompt + 256 streamed)
    let answer = send(fleet.app(2), chat(acme[0], "x", None, true)).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.remaining("tokens"), left - 1000);
    left -= prompt_tokens("x") + gateway::MAX_COMPLETION;
    settles_to(&tokens, "acme", left).await;
    // 0 (some upstreams read it as no maximum): refused, nothing taken
    let answer = send(fleet.app(3), chat(acme[1], "y", Some(0), false)).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    settles_to(&tokens, "acme", left).await;

    // more than a tenth of the budget: refused, nothing taken
    let answer = send(fleet.app(4), chat(acme[0], "z", Some(1001), false)).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(answer.body.contains("1000"), "{}", answer.body);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        tokens.peek("acme", 0).await.expect("peek").remaining(),
        left
    );
    let monthly = send(fleet.app(5), chat(acme[0], "z", Some(1), false)).await;
    assert_eq!(monthly.remaining("requests"), MONTHLY as u64 - 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_locks_a_username_out_after_5_failures_and_successes_are_free() {
    let fleet = Fleet::start();
    let login = |username: &str, password: &str| {
        post_json(
            "/login",
            None,
            json!({"username": username, "password": password}),
        )
    };
    for n in 0..8 {
        let answer = send(fleet.app(n), login("ann", "correct horse")).await;
        assert_eq!(answer.status, StatusCode::OK, "success {n}");
    }
    // one username however it is written
    for (n, name) in ["ann", " Ann", "ANN ", "ann", "Ann"]
        .into_iter()
        .enumerate()
    {
        let answer = send(fleet.app(n), login(name, "guess")).await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "failure {n}");
    }
    let locked = send(fleet.app(1), login("ann", "correct horse")).await;
    assert_eq!(locked.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(locked.retry_after() > 0);
    let other = send(fleet.app(0), login("bob", "correct horse")).await;
    assert_eq!(other.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_limits_file_applies_to_both_instances() {
    let fleet = Fleet::start();
    let acme = keys_of("acme")[0];
    let before = send(fleet.app(0), chat(acme, "a", Some(300), false)).await;
    assert_eq!(before.status, StatusCode::OK);
    assert!(before
        .header("ratelimit-policy")
        .contains("\"tokens\";q=10000;"));

    std::fs::write(&fleet.file, limits_text(2000)).expect("rewrite the limits file");
    let deadline = Instant::now() + Duration::from_secs(10);
    for instance in &fleet.instances {
        let tokens = instance.limits.get("tokens").expect("a limit");
        while tokens.get().capacity() != 2000 {
            assert!(Instant::now() < deadline, "the file was not read again");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    for n in 0..2 {
        let after = send(fleet.app(n), chat(acme, "a", Some(200), false)).await;
        assert_eq!(after.status, StatusCode::OK);
        let policy = after.header("ratelimit-policy");
        assert!(policy.contains("\"tokens\";q=2000;"), "{policy}");
        // the most one call may ask for is now 200
        let over = send(fleet.app(n), chat(acme, "a", Some(300), false)).await;
        assert_eq!(over.status, StatusCode::BAD_REQUEST);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sms_answers_202_with_the_fields_then_429_then_503() {
    let mut fleet = Fleet::start();
    // one number however it is written
    for (n, phone) in ["+15550100", "+1-555-0100", "+1%20555%200100"]
        .into_iter()
        .enumerate()
    {
        let answer = send(fleet.app(n), sms(phone)).await;
        assert_eq!(answer.status, StatusCode::ACCEPTED, "text {n}");
        assert_eq!(answer.header("ratelimit-policy"), "\"sms\";q=3;w=60");
        assert_eq!(answer.remaining("sms"), 2 - n as u64);
    }
    let refused = send(fleet.app(3), sms("+15550100")).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.header("content-type"), "application/problem+json");
    assert!(refused.body.contains("quota-exceeded"), "{}", refused.body);
    let retry_after = refused.retry_after();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let short = send(fleet.app(0), sms("12345")).await;
    assert_eq!(short.status, StatusCode::BAD_REQUEST);

    fleet.redis.stop();
    let failed = send(fleet.app(1), sms("+15550199")).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(failed.header("content-type"), "application/problem+json");
    assert!(failed.retry_after() > 0);
    let chat = chat(keys_of("acme")[0], "hi", Some(1), false);
    let failed = send(fleet.app(0), chat).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
}

/// The names of the metrics a text in the Prometheus format holds.
fn rendered_names(text: &str) -> BTreeSet<&str> {
    let samples = text.lines().filter(|line| !line.starts_with('#'));
    let names = samples.filter_map(|line| line.split(['{', ' ']).next());
    names.filter(|name| !name.is_empty()).collect()
}

/// The metric names `text` (a dashboard, alert rules) queries.
fn queried_names(text: &str) -> BTreeSet<&str> {
    let words = text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
    words
        .filter(|word| word.starts_with("tower_ratelimit_"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_hold_every_name_the_dashboard_and_alerts_query_behind_a_token() {
    let fleet = Fleet::start();
    // traffic: a charge after the fact (usage over its estimate), a grant
    // near a limit, refusals
    let acme = keys_of("acme")[0];
    let answer = send(fleet.app(0), chat(acme, "hello", Some(10), false)).await;
    assert_eq!(answer.status, StatusCode::OK);
    for n in 0..4 {
        send(fleet.app(n), sms("+15550142")).await;
    }
    let limiter = fleet.limiter("tokens");
    settles_to(&limiter, "acme", 10_000 - prompt_tokens("hello") - 10).await;

    let get = |token: Option<&str>| {
        let mut request = Request::get("/metrics");
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        request.body(Body::empty()).expect("a request")
    };
    let metrics = send(fleet.app(1), get(Some(METRICS_TOKEN))).await;
    assert_eq!(metrics.status, StatusCode::OK);
    let rendered = rendered_names(&metrics.body);
    let dashboard = include_str!("../examples/grafana-dashboard.json");
    let alerts = include_str!("../examples/prometheus-alerts.yml");
    let queried: BTreeSet<&str> = queried_names(dashboard)
        .union(&queried_names(alerts))
        .copied()
        .collect();
    assert!(queried.len() >= 10, "{queried:?}");
    let missing: Vec<_> = queried
        .iter()
        .filter(|name| {
            // a histogram's name stands for its _bucket, _sum and _count series
            !rendered.contains(*name) && !rendered.contains(format!("{name}_count").as_str())
        })
        .collect();
    assert!(
        missing.is_empty(),
        "not in /metrics: {missing:?}\n{}",
        metrics.body
    );

    for token in [None, Some("wrong"), Some("")] {
        let refused = send(fleet.app(0), get(token)).await;
        assert_eq!(refused.status, StatusCode::UNAUTHORIZED, "{token:?}");
        assert!(!refused.body.contains("tower_ratelimit"));
    }
}
