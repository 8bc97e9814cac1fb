//! An axum app limited as a user would limit it.
//!
//! ```text
//! cargo run --example server                              # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example server   # shared through Redis
//! REDIS_CLUSTER_URLS=redis://10.0.0.1:7000,redis://10.0.0.2:7000 \
//!     cargo run --example server --all-features           # shared through Redis Cluster
//! REDIS_SENTINEL_URLS=redis://10.0.0.1:26379 REDIS_SENTINEL_MASTER=mymaster \
//!     cargo run --example server --all-features           # the master Sentinel names
//! ```
//!
//! Environment: `PORT` (default 3000; the server listens on 127.0.0.1),
//! `REDIS_URL` (`rediss://` for TLS, with the `tls` feature),
//! `REDIS_CLUSTER_URLS` (comma-separated seed nodes, `cluster` feature),
//! `REDIS_SENTINEL_URLS` and `REDIS_SENTINEL_MASTER` (`sentinel` feature),
//! `REDIS_CA_FILE` (a CA certificate to trust for `rediss://`),
//! `RUST_LOG` (default `info`: no line per request, so a flood of refused
//! requests does not fill the disk; `info,tower_ratelimit=debug` logs each
//! refusal),
//! `TRUSTED_PROXIES` (comma-separated CIDRs whose
//! `X-Forwarded-For` is believed; default: none, the TCP peer is the client),
//! `ON_STORE_ERROR` (what to do while Redis fails: `closed`, the default,
//! answers 503; `open` lets requests through unlimited; `memory` enforces the
//! limits in this process until Redis is back), `LIMITS_FILE` (a TOML file
//! with the limits `per-ip`, `hello` and `sms`, such as
//! `examples/limits.toml`; default: the built-in limits below; read again
//! when it changes, a Kubernetes ConfigMap mount included, and on `SIGHUP`,
//! a file with a mistake logged and the limits in force kept),
//! `INTERNAL_TOKEN` (when set, a request whose `X-Internal-Token` equals it
//! is exempt from every limit, and `GET /metrics` is served to a request
//! carrying it; compared in constant time), `API_KEYS`
//! (comma-separated `key=plan` pairs, the plan `free` or `pro`: the API keys
//! a client sends as `Authorization: Bearer <key>`; default: none, every
//! request is on the free plan), `LOGIN_BANS` (comma-separated durations
//! such as `1m,10m,1h`, the default: the escalating bans of `/login`).
//!
//! - every limited route: 100 requests per second per client IP (burst 100)
//! - `GET /api/hello`: also 10 per second per client IP, burst 10 (GCRA)
//! - `POST /sms/{phone}`: at most 3 per 60 seconds per phone number (sliding log), 202;
//!   the number in international form, `+` and 7 to 15 digits, spaces, dashes,
//!   dots and brackets ignored (`+1 555-0100` is `+15550100`); 400 otherwise;
//!   also at most 10 texts per client IP per hour, whatever the numbers
//! - `POST /login` with `{"username": ..., "password": ...}`: every password
//!   is `correct horse`; right: 200, not counted; wrong: 401, counted (a
//!   server error too: only a success is given back); 429
//!   with `Retry-After`, whatever the password, after 5 counted failures per
//!   username from one client IP, 20 per username from all of them (both in
//!   15 minutes), or 30 per client IP across usernames in an hour (sliding
//!   logs; see `app` for what each one stops); 400 for a body that is not
//!   credentials or a username that is empty or longer than 64 characters.
//!   Escalating bans: each attempt refused by the per-(username, IP) limit
//!   is an offence that bans that address from that username, for 1 minute,
//!   then 10 minutes, then an hour for every offence after (`LOGIN_BANS`);
//!   refused with `Retry-After` the time left of the ban, whatever the
//!   password; offences forgotten a day after the last ban ended
//!   (`Limit::with_penalty`)
//! - every route refuses a client whose `User-Agent` is on the deny-list
//!   (`BadBot`, for the demonstration) with 403, without asking the store
//!   (`RateLimitLayerBuilder::deny_if`)
//! - `GET /api/report`: 2 per minute per client IP on the free plan, 20 on
//!   the pro plan, in the same limit. The plan is the authenticated one: the
//!   `authenticate` layer (a stand-in for a real authentication layer) maps
//!   the verified API key to a `Plan` request extension, which the limit
//!   reads. Never a header the client sets, such as `X-Plan: pro`: anyone
//!   can send it.
//! - `GET /api/export`: at most 2 exports running at once per client IP (a
//!   concurrency limit, leases of 30 s renewed while an export streams);
//!   each streams 10 CSV rows, 100 ms apart, and holds its permit until its
//!   last row is sent or the client goes away; a third concurrent export
//!   gets 429
//! - `POST /api/complete`: a stand-in for an LLM completion whose cost is
//!   known from its response: 2000 tokens per client IP per hour, each
//!   request taking 1 on arrival and, after its response, the rest of what
//!   its `x-tokens-used` header says (100 plus one per byte of the prompt
//!   in the request body); a client in debt gets 429 until the hour has
//!   paid it back
//! - `GET /healthz`: not limited
//! - `GET /metrics`: not limited; the limiter's metrics in the Prometheus text
//!   format, only with `INTERNAL_TOKEN` set and sent (`Authorization: Bearer
//!   <token>`, as Prometheus's `authorization` scrape setting sends it, or
//!   `X-Internal-Token`): 401 without it, 404 when no token is set. Never
//!   public: its outage gauge tells anyone when `ON_STORE_ERROR=open` lets
//!   every request through unlimited, and its counters what each limit
//!   refuses
//!
//! Two processes on one Redis share every limit.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, request::Parts, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde::Deserialize;
use subtle::ConstantTimeEq;
use tower_ratelimit::key::{Bearer, ClientIp, ClientIpResolver, KeyExtractor, RequestExtension};
use tower_ratelimit::layer::{
    OnStoreError, RateLimitInfo, RateLimitLayer, RateLimitLayerBuilder, Rule,
};
use tower_ratelimit::watch::{FileWatch, LimitsFile};
use tower_ratelimit::{
    ConfigError, Limit, LimitSource, LiveLimit, LiveLimits, MemoryStore, Penalty, Quota,
    RedisStore, RedisStoreBuilder, Store,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The log filter unless `RUST_LOG` says otherwise: `info`, at which the
/// crate logs outages, misconfigurations and limits files, not requests.
/// Its `debug` lines are per request (each refusal, each decision's span):
/// under a flood, a line per refused request (570 MB in 80 s), so opt in
/// for a while (`RUST_LOG=info,tower_ratelimit=debug`); the refusals are
/// counted in `/metrics` (`tower_ratelimit_decisions_total`).
const DEFAULT_LOG_FILTER: &str = "info";

/// The limits the routes use, live: a new reading of `LIMITS_FILE` takes
/// effect on the next request of every route, with no restart.
struct Limits {
    all: LiveLimits,
    /// Follows `LIMITS_FILE` (the crate logs each reading) while it is kept.
    _watch: Option<Arc<FileWatch>>,
}

impl Limits {
    /// The built-in limits (the same as `examples/limits.toml`).
    fn built_in() -> Result<Vec<Limit>, Error> {
        Ok(vec![
            Limit::new(
                "per-ip",
                Quota::per_second(100).allow_burst(100).token_bucket(),
            )?,
            Limit::new("hello", Quota::per_second(10).allow_burst(10).gcra())?,
            Limit::new("sms", Quota::per_minute(3).sliding_log())?,
        ])
    }

    /// The built-in limits, or those of the file at `path`, read again
    /// whenever it changes (a Kubernetes ConfigMap mount included) and on
    /// `SIGHUP`.
    fn new(path: Option<std::path::PathBuf>) -> Result<Limits, Error> {
        let all = LiveLimits::new(Self::built_in()?)?;
        let Some(path) = path else {
            return Ok(Limits { all, _watch: None });
        };
        let watch = Arc::new(LimitsFile::new(path).watch(&all)?);
        let on_hangup = watch.clone();
        let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                let _ = on_hangup.reload(); // logged by the crate
            }
        });
        Ok(Limits {
            all,
            _watch: Some(watch),
        })
    }

    fn get(&self, name: &str) -> Result<LiveLimit, Error> {
        Ok(self.all.get(name).ok_or("no such limit")?)
    }
}

/// The settings every layer of the server shares.
struct Setup<S> {
    store: S,
    client_ip: ClientIp,
    on_store_error: OnStoreError,
    /// `INTERNAL_TOKEN`, when set.
    internal_token: Option<Arc<[u8]>>,
    /// `LOGIN_BANS`: the bans of the 1st, 2nd, ... offence at `/login`.
    login_bans: Vec<Duration>,
}

impl<S: Into<Store> + Clone> Setup<S> {
    /// A layer over the shared store, without limits yet; requests with the
    /// internal token are exempt from all of its limits.
    fn bare(&self) -> Exempting {
        Exempting {
            builder: RateLimitLayer::builder()
                .store(self.store.clone())
                .on_store_error(self.on_store_error)
                .deny_if(deny_listed),
            token: self.internal_token.clone(),
        }
    }

    /// A layer over the shared store with the per-IP limit.
    fn layer(&self, per_ip: &LiveLimit) -> Exempting {
        self.bare().limit(per_ip, self.client_ip.clone())
    }
}

/// A layer being built whose every rule exempts the requests that carry
/// the internal token (`Rule::skip_if`).
struct Exempting {
    builder: RateLimitLayerBuilder,
    token: Option<Arc<[u8]>>,
}

impl Exempting {
    /// Adds `limit`, keyed by `key`.
    fn limit(self, limit: impl Into<LimitSource>, key: impl KeyExtractor) -> Self {
        self.rule(Rule::new(limit, key))
    }

    /// Adds `rule`, exempting internal requests.
    fn rule(mut self, rule: Rule) -> Self {
        let token = self.token.clone();
        let rule = rule.skip_if(move |request: &Parts| internal(request, token.as_deref()));
        self.builder = self.builder.rule(rule);
        self
    }

    /// The layer.
    fn build(self) -> Result<RateLimitLayer, ConfigError> {
        self.builder.build()
    }
}

/// A limit of `amount` failed logins per `window` and `key`: the permit is
/// taken when the attempt arrives and given back only when the login
/// succeeds (2xx), so 50 concurrent guesses try exactly `amount`; a 401
/// counts, and so does a server error (else a guess that made the server
/// fail would be free). With a `penalty`, its refusals ban the key.
fn failed_logins(
    name: &str,
    amount: u64,
    window: Duration,
    key: impl KeyExtractor,
    penalty: Option<Penalty>,
) -> Result<Rule, Error> {
    let mut limit = Limit::new(name, Quota::rate(amount, window).sliding_log())?;
    if let Some(penalty) = penalty {
        limit = limit.with_penalty(penalty);
    }
    Ok(Rule::new(limit, key).refund_if(|response| response.status.is_success()))
}

/// The deny-list: clients refused on every route, without a decision.
fn deny_listed(request: &Parts) -> bool {
    request
        .headers
        .get(header::USER_AGENT)
        .is_some_and(|agent| agent == "BadBot")
}

/// Whether the request carries the internal token, compared in constant
/// time: `==` on bytes stops at the first difference, so the time a wrong
/// guess takes tells how much of it was right, and a token can be guessed
/// byte by byte. (`ct_eq` answers at once for another length: the token's
/// length is not secret, its bytes are.)
fn internal(request: &Parts, token: Option<&[u8]>) -> bool {
    match (token, request.headers.get("x-internal-token")) {
        (Some(token), Some(given)) => given.as_bytes().ct_eq(token).into(),
        _ => false,
    }
}

/// `GET /metrics`: the metrics for a request that carries the internal
/// token (`Authorization: Bearer`, or `X-Internal-Token`), 401 for one that
/// does not, 404 when there is no token (then nobody may read them).
fn metrics_page(metrics: &PrometheusHandle, token: Option<&[u8]>, headers: &HeaderMap) -> Response {
    let Some(token) = token else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let given = Bearer::token(headers)
        .map(str::as_bytes)
        .or_else(|| headers.get("x-internal-token").map(|v| v.as_bytes()));
    if !given.is_some_and(|given| bool::from(given.ct_eq(token))) {
        return (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
        )
            .into_response();
    }
    let content_type = [(header::CONTENT_TYPE, "text/plain; version=0.0.4")];
    (content_type, metrics.render()).into_response()
}

fn app<S: Into<Store> + Clone>(
    setup: Setup<S>,
    limits: &Limits,
    api_keys: Arc<ApiKeys>,
    metrics: PrometheusHandle,
) -> Result<Router, Error> {
    let (per_ip, hello, sms) = (
        limits.get("per-ip")?,
        limits.get("hello")?,
        limits.get("sms")?,
    );
    let client_ip = setup.client_ip.clone();
    let metrics_token = setup.internal_token.clone();

    // Each route's layer holds the shared per-IP limit and the route's own:
    // one store round trip per request (two for /login, see below), and a
    // request refused by one limit consumes nothing from the others.
    let hello_layer = setup
        .layer(&per_ip)
        .limit(hello, client_ip.clone())
        .build()?;
    // Keyed by the number `read_phone` made canonical, not the path as
    // written: `+1 555 0100` and `+1-555-0100` are one number, and would
    // each get 3 texts to it if counted apart. The per-number limit spares
    // the phone; `sms-ip` spares the service: without it one address could
    // text every number there is (SMS pumping, paid by the sender) and fill
    // the store with made-up numbers' keys.
    let sms_per_ip = Limit::new(
        "sms-ip",
        Quota::rate(10, Duration::from_secs(60 * 60)).sliding_log(),
    )?;
    let sms_layer = setup
        .layer(&per_ip)
        .limit(sms, RequestExtension::<Phone>::new())
        .limit(sms_per_ip, client_ip.clone())
        .build()?;
    // Failed logins, counted three ways, as OWASP's authentication cheat
    // sheet and rate-limiter-flexible's login recipe count them. A limit per
    // username alone lets anyone lock any user out, from anywhere, with 5
    // wrong passwords; a limit per IP alone lets a botnet guess one user's
    // password from thousands of addresses.
    //
    // - `login-user-ip`: 5 per (username, client IP) per 15 minutes, the
    //   tight one. Stops one address guessing one user's password, and locks
    //   out only that address, for that user.
    // - `login-user`: 20 per username per 15 minutes, from all addresses, the
    //   loose one. Stops many addresses guessing one user's password. Each
    //   address burns at most 5 of the 20 before `login-user-ip` stops it
    //   (a refused attempt consumes nothing), so locking a user out takes
    //   at least 4 addresses: the price of a bound on distributed guessing
    //   (a real service would also alert, or ask for a second factor).
    // - `login-ip`: 30 per client IP per hour, whatever the usernames. Stops
    //   one address trying a few common passwords on many users (password
    //   spraying, credential stuffing), which no per-username limit sees.
    //
    // `login-user-ip` also bans: each attempt it refuses is an offence (one
    // refusal makes it), which blocks that address from that username for
    // the next of `login_bans` (1 minute, 10 minutes, then an hour each
    // time), counted in the same round trip. A client that waits out a ban
    // and guesses again meets a longer one.
    //
    // All three are decided together, in one round trip. The username is the
    // canonical one `read_credentials` makes, so `Ann` and ` ann` get no
    // guesses of their own.
    let fifteen_minutes = Duration::from_secs(15 * 60);
    let username = RequestExtension::<Username>::new;
    let login_layer = setup
        .bare()
        .rule(failed_logins(
            "login-user-ip",
            5,
            fifteen_minutes,
            (username(), client_ip.clone()),
            Some(Penalty::new(1, fifteen_minutes, setup.login_bans.clone())?),
        )?)
        .rule(failed_logins(
            "login-user",
            20,
            fifteen_minutes,
            username(),
            None,
        )?)
        .rule(failed_logins(
            "login-ip",
            30,
            Duration::from_secs(60 * 60),
            client_ip.clone(),
            None,
        )?)
        .build()?;
    // The per-IP limit of /login is decided before its body is read (a
    // second round trip): a body that is not credentials is answered 400
    // before the failed-login limits, which need the username, and would
    // otherwise be read and parsed without any limit.
    let login_per_ip = setup.layer(&per_ip).build()?;
    // One limit, two plans: the quota is chosen per request, from the plan
    // `authenticate` verified (a request extension no client can set), not
    // from a header (which every client can).
    let report = Rule::new(
        Limit::new("report", Quota::per_minute(2).sliding_log())?,
        client_ip,
    )
    .tier("pro", Quota::per_minute(20).sliding_log())
    .choose_tier(|request| match request.extensions.get::<Plan>() {
        Some(Plan::Pro) => Some("pro"),
        Some(Plan::Free) | None => None,
    });
    let report_layer = setup.layer(&per_ip).rule(report).build()?;
    // A concurrency limit: the permit is held from the request until the
    // streamed body ends (or the client goes away), renewed meanwhile, and
    // comes back within 30 s of an instance that dies holding it.
    let export_layer = setup
        .layer(&per_ip)
        .limit(
            Limit::concurrency("exports", 2, Duration::from_secs(30))?,
            setup.client_ip.clone(),
        )
        .build()?;
    // A budget charged after the fact: a request takes 1 token when it
    // arrives (so a client in debt is refused), the rest of what its
    // response reports once it is known. The budget is exceeded by at most
    // the responses in flight when it ran out, each at most one budget.
    let completion_layer = setup
        .layer(&per_ip)
        .rule(
            Rule::new(
                Limit::new("tokens", Quota::per_hour(2000).sliding_window())?,
                setup.client_ip.clone(),
            )
            .cost_from_response_header(header::HeaderName::from_static("x-tokens-used")),
        )
        .build()?;

    Ok(Router::new()
        .route("/api/hello", get(say_hello).route_layer(hello_layer))
        .route(
            "/sms/{phone}",
            post(send_sms)
                .route_layer(sms_layer)
                // runs first: the layer keys by the number it reads
                .route_layer(middleware::from_fn(read_phone)),
        )
        .route(
            "/login",
            post(login)
                .route_layer(login_layer)
                // runs before: the limits above key by the username it reads
                .route_layer(middleware::from_fn(read_credentials))
                // runs first: nothing is read beyond the per-IP limit
                .route_layer(login_per_ip),
        )
        .route("/api/report", get(report_handler).route_layer(report_layer))
        .route("/api/export", get(export).route_layer(export_layer))
        .route(
            "/api/complete",
            post(complete).route_layer(completion_layer),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(move |headers: HeaderMap| async move {
                metrics_page(&metrics, metrics_token.as_deref(), &headers)
            }),
        )
        // runs before every route's layers: they read the plan it sets
        .layer(middleware::from_fn_with_state(api_keys, authenticate)))
}

/// A client's plan, as the authentication layer verified it: the report
/// limit's tier. Set only by [`authenticate`]; a request extension, which no
/// client can send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    Free,
    Pro,
}

/// The API keys of `API_KEYS` and their plans.
#[derive(Default)]
struct ApiKeys(Vec<(Box<[u8]>, Plan)>);

impl ApiKeys {
    /// `API_KEYS`: comma-separated `key=plan` pairs, the plan `free` or
    /// `pro`. Errors name the pair by its position, never its key.
    fn parse(text: &str) -> Result<ApiKeys, Error> {
        let mut keys = Vec::new();
        let pairs = text.split(',').map(str::trim).filter(|p| !p.is_empty());
        for (i, pair) in pairs.enumerate() {
            let number = i + 1;
            let (key, plan) = pair
                .rsplit_once('=')
                .ok_or_else(|| format!("API_KEYS: pair {number} is not key=plan"))?;
            let plan = match plan.trim() {
                "free" => Plan::Free,
                "pro" => Plan::Pro,
                other => {
                    return Err(format!(
                        "API_KEYS: pair {number} has the plan {other:?}; the plans are free and pro"
                    )
                    .into())
                }
            };
            let key = key.trim();
            if key.is_empty() {
                return Err(format!("API_KEYS: pair {number} has an empty key").into());
            }
            keys.push((key.as_bytes().into(), plan));
        }
        Ok(ApiKeys(keys))
    }

    /// The plan of the API key `given`, if it is one. Every key is compared,
    /// each in constant time, so the time taken says nothing of how close a
    /// guess came.
    fn plan(&self, given: &[u8]) -> Option<Plan> {
        let mut found = None;
        for (key, plan) in &self.0 {
            if bool::from(key.ct_eq(given)) {
                found = Some(*plan);
            }
        }
        found
    }
}

/// The authentication layer (a stand-in for a real one: sessions, signed
/// tokens, hashed API keys): the plan of the API key in `Authorization:
/// Bearer <key>`, as a [`Plan`] extension for the limits. A request without
/// a key, or with a key that is none, is on the free plan, so a guessed key
/// gets what no key gets, within the same free quota.
async fn authenticate(
    State(keys): State<Arc<ApiKeys>>,
    mut request: Request,
    next: Next,
) -> Response {
    let plan = Bearer::token(request.headers())
        .and_then(|key| keys.plan(key.as_bytes()))
        .unwrap_or(Plan::Free);
    request.extensions_mut().insert(plan);
    next.run(request).await
}

/// `RateLimitInfo` always extracts: it has no decision when the request was
/// let through without one (Redis down with `ON_STORE_ERROR=open`).
async fn say_hello(info: RateLimitInfo) -> String {
    match info.decision() {
        Some(decision) => format!("hello! {} more this second\n", decision.remaining()),
        None => "hello! (not rate-limited right now)\n".to_owned(),
    }
}

async fn send_sms(Extension(phone): Extension<Phone>) -> (StatusCode, String) {
    (StatusCode::ACCEPTED, format!("SMS to {phone} queued\n"))
}

/// A phone number in international (E.164) form, `+` and 7 to 15 digits,
/// the first not 0: the SMS limit's key and the handler's number.
#[derive(Clone)]
struct Phone(String);

impl Phone {
    /// The number `written` stands for: `+`, then digits, with spaces,
    /// dashes, dots and brackets ignored (`+1 (555) 010-0`, `+1.555.0100` and
    /// `+15550100` are one number); `None` for anything else. A real service
    /// would parse with its phone-number library, to the same canonical form
    /// it sends to.
    fn parse(written: &str) -> Option<Phone> {
        let digits = written.strip_prefix('+')?;
        let mut number = String::from("+");
        for c in digits.chars() {
            match c {
                '0'..='9' if number.len() <= 15 => number.push(c),
                ' ' | '-' | '.' | '(' | ')' => {}
                _ => return None,
            }
        }
        let count = number.len() - 1;
        let valid = (7..=15).contains(&count) && !number[1..].starts_with('0');
        valid.then_some(Phone(number))
    }
}

impl std::fmt::Display for Phone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Reads the number of `POST /sms/{phone}` into the request's extensions,
/// canonical (for the limit and the handler); 400 for anything else.
async fn read_phone(Path(written): Path<String>, mut request: Request, next: Next) -> Response {
    let Some(phone) = Phone::parse(&written) else {
        let message = "expected a phone number in international form, such as +15550100\n";
        return (StatusCode::BAD_REQUEST, message).into_response();
    };
    request.extensions_mut().insert(phone);
    next.run(request).await
}

/// The Redis store the environment names, if any: a cluster
/// (`REDIS_CLUSTER_URLS`), the master Sentinel names (`REDIS_SENTINEL_URLS`
/// with `REDIS_SENTINEL_MASTER`), or one server (`REDIS_URL`, `rediss://`
/// for TLS). `REDIS_CA_FILE` adds a CA certificate (PEM) to trust.
fn redis_store() -> Result<Option<RedisStore>, Error> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let list = |value: String| -> Vec<String> {
        value
            .split(',')
            .map(|url| url.trim().to_owned())
            .filter(|url| !url.is_empty())
            .collect()
    };
    let builder = if let Some(urls) = var("REDIS_CLUSTER_URLS") {
        tracing::info!("store: Redis Cluster through {urls}");
        cluster_builder(list(urls))?
    } else if let Some(urls) = var("REDIS_SENTINEL_URLS") {
        let master = var("REDIS_SENTINEL_MASTER")
            .ok_or("REDIS_SENTINEL_URLS needs REDIS_SENTINEL_MASTER, the master's name")?;
        tracing::info!("store: the Redis master {master:?} of the sentinels {urls}");
        sentinel_builder(list(urls), master)?
    } else if let Some(url) = var("REDIS_URL") {
        tracing::info!("store: Redis at {url}");
        RedisStore::builder(url)
    } else {
        return Ok(None);
    };
    let builder = match var("REDIS_CA_FILE") {
        Some(path) => trusting(
            builder,
            std::fs::read(&path).map_err(|e| format!("REDIS_CA_FILE={path}: {e}"))?,
        )?,
        None => builder,
    };
    Ok(Some(builder.prefix("example").build()?))
}

#[cfg(feature = "cluster")]
fn cluster_builder(urls: Vec<String>) -> Result<RedisStoreBuilder, Error> {
    Ok(RedisStore::cluster_builder(urls))
}

#[cfg(not(feature = "cluster"))]
fn cluster_builder(_: Vec<String>) -> Result<RedisStoreBuilder, Error> {
    Err(
        "REDIS_CLUSTER_URLS needs the `cluster` feature: cargo run --example server --all-features"
            .into(),
    )
}

#[cfg(feature = "sentinel")]
fn sentinel_builder(urls: Vec<String>, master: String) -> Result<RedisStoreBuilder, Error> {
    Ok(RedisStore::sentinel_builder(urls, master))
}

#[cfg(not(feature = "sentinel"))]
fn sentinel_builder(_: Vec<String>, _: String) -> Result<RedisStoreBuilder, Error> {
    Err("REDIS_SENTINEL_URLS needs the `sentinel` feature: cargo run --example server --all-features".into())
}

#[cfg(feature = "tls")]
fn trusting(builder: RedisStoreBuilder, ca: Vec<u8>) -> Result<RedisStoreBuilder, Error> {
    Ok(builder.tls_root_certificate(ca))
}

#[cfg(not(feature = "tls"))]
fn trusting(_: RedisStoreBuilder, _: Vec<u8>) -> Result<RedisStoreBuilder, Error> {
    Err("REDIS_CA_FILE needs the `tls` feature: cargo run --example server --all-features".into())
}

/// The body of `POST /login`.
#[derive(Clone, Deserialize)]
struct Credentials {
    username: String,
    password: String,
}

/// The longest username accepted, in characters, after trimming.
const MAX_USERNAME: usize = 64;

/// The username of a login attempt, in canonical form: the key of the
/// failed-login limits.
///
/// A limit keyed by the name as typed counts `Ann`, `ann` and ` ann` apart,
/// 5 guesses each, when the user lookup takes them for one account: the key
/// must be the form the lookup matches. This example's lookup (every
/// password is right or wrong for any name) takes the trimmed, lowercased
/// name; a real service keys by what its own user table matches (NFKC and
/// case folding where names may be non-ASCII, its account id once found).
#[derive(Clone)]
struct Username(String);

impl Username {
    /// The canonical form of `typed`: trimmed and lowercased; `None` when it
    /// is empty or longer than [`MAX_USERNAME`] characters (no account has
    /// such a name, and a key need not be made for it).
    fn canonical(typed: &str) -> Option<Username> {
        let trimmed = typed.trim();
        if trimmed.is_empty() || trimmed.chars().count() > MAX_USERNAME {
            return None;
        }
        Some(Username(trimmed.to_lowercase()))
    }
}

impl std::fmt::Display for Username {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Reads the JSON body of a login attempt into the request's extensions
/// (the credentials for the handler, the canonical username for the limits
/// and the handler); 400 for anything else.
async fn read_credentials(request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 16 * 1024).await else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let Ok(credentials) = serde_json::from_slice::<Credentials>(&bytes) else {
        return (
            StatusCode::BAD_REQUEST,
            "expected {\"username\": ..., \"password\": ...}\n",
        )
            .into_response();
    };
    let Some(username) = Username::canonical(&credentials.username) else {
        let message = format!("a username has 1 to {MAX_USERNAME} characters\n");
        return (StatusCode::BAD_REQUEST, message).into_response();
    };
    parts.extensions.insert(username);
    parts.extensions.insert(credentials);
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

async fn login(
    Extension(credentials): Extension<Credentials>,
    Extension(username): Extension<Username>,
) -> (StatusCode, String) {
    // (a real service verifies a password hash: argon2, scrypt, bcrypt)
    if bool::from(credentials.password.as_bytes().ct_eq(b"correct horse")) {
        (StatusCode::OK, format!("welcome, {username}\n"))
    } else {
        (StatusCode::UNAUTHORIZED, "wrong password\n".to_owned())
    }
}

async fn report_handler(info: RateLimitInfo) -> String {
    match info.decision() {
        Some(decision) => format!("report ready; {} more this minute\n", decision.remaining()),
        None => "report ready\n".to_owned(),
    }
}

/// 10 CSV rows, 100 ms apart: a slow export, whose permit is held until
/// its last row is sent.
async fn export() -> Response {
    let rows = futures::stream::unfold(0u32, |row| async move {
        if row == 10 {
            return None;
        }
        if row > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let line = format!("{row},row {row}\n");
        Some((Ok::<_, std::convert::Infallible>(line), row + 1))
    });
    (
        [(header::CONTENT_TYPE, "text/csv")],
        Body::from_stream(rows),
    )
        .into_response()
}

/// A stand-in for a completion: 100 tokens plus one per byte of the
/// prompt, reported in `x-tokens-used` for the limit to charge.
async fn complete(prompt: axum::body::Bytes) -> Response {
    let tokens = 100 + prompt.len();
    (
        [("x-tokens-used", tokens.to_string())],
        format!("completed with {tokens} tokens\n"),
    )
        .into_response()
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| DEFAULT_LOG_FILTER.into()),
        )
        .init();
    let port: u16 = std::env::var("PORT")
        .ok()
        .map(|p| p.parse())
        .transpose()?
        .unwrap_or(3000);
    let resolver = match std::env::var("TRUSTED_PROXIES") {
        Ok(cidrs) => ClientIpResolver::new()
            .trust_proxies(cidrs.split(',').filter(|c| !c.trim().is_empty()))?,
        Err(_) => ClientIpResolver::new(),
    };
    let client_ip = ClientIp::with_resolver(resolver);
    let limits_file = std::env::var_os("LIMITS_FILE").map(std::path::PathBuf::from);
    if let Some(path) = &limits_file {
        tracing::info!(
            "limits: from {} (read again when it changes)",
            path.display()
        );
    }
    let limits = Limits::new(limits_file)?;
    // The limiter reports through the `metrics` facade; this exporter
    // renders what it records for `GET /metrics`, its histograms with
    // buckets (Prometheus sums them across instances; see
    // examples/grafana-dashboard.json and examples/prometheus-alerts.yml).
    let mut exporter = PrometheusBuilder::new();
    for (name, bounds) in tower_ratelimit::metrics::buckets() {
        exporter = exporter.set_buckets_for_metric(Matcher::Full(name.to_owned()), bounds)?;
    }
    // `install_recorder` runs no upkeep: without it the recorder keeps
    // every histogram sample (a store call's duration per request) until
    // the next scrape, and grows without bound while no one scrapes (26 to
    // 80 MiB over 4 million requests). Drained every 5 s into the buckets,
    // a fixed set of counters.
    let metrics = exporter.install_recorder()?;
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    let on_store_error = match std::env::var("ON_STORE_ERROR").as_deref() {
        Ok("open") => OnStoreError::FailOpen,
        Ok("memory") => OnStoreError::FallbackToMemory,
        Ok("closed") | Err(_) => OnStoreError::default(),
        Ok(other) => {
            return Err(format!("ON_STORE_ERROR={other}: use open, closed or memory").into())
        }
    };
    let api_keys = match std::env::var("API_KEYS") {
        Ok(text) => ApiKeys::parse(&text)?,
        Err(_) => ApiKeys::default(),
    };
    let api_keys = Arc::new(api_keys);
    let internal_token: Option<Arc<[u8]>> = std::env::var("INTERNAL_TOKEN")
        .ok()
        .filter(|token| !token.is_empty())
        .map(|token| token.into_bytes().into());
    let login_bans = match std::env::var("LOGIN_BANS") {
        Ok(text) => text
            .split(',')
            .map(|d| humantime::parse_duration(d.trim()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("LOGIN_BANS={text}: {e}; write them like 1m,10m,1h"))?,
        Err(_) => [1, 10, 60].map(|m| Duration::from_secs(60 * m)).to_vec(),
    };
    let app = match redis_store()? {
        Some(store) => {
            let setup = Setup {
                store,
                client_ip,
                on_store_error,
                internal_token,
                login_bans,
            };
            app(setup, &limits, api_keys, metrics)?
        }
        None => {
            tracing::info!(
                "store: in memory (set REDIS_URL, REDIS_CLUSTER_URLS or REDIS_SENTINEL_URLS \
                 to share limits between processes)"
            );
            let setup = Setup {
                store: MemoryStore::new(),
                client_ip,
                on_store_error,
                internal_token,
                login_bans,
            };
            app(setup, &limits, api_keys, metrics)?
        }
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
