//! The running server: its store, its listeners (gRPC, HTTP, debug,
//! Prometheus), the configuration watcher feeding the service, health, and
//! a graceful stop. [`start`] does everything `ratelimit` does after
//! reading the environment, so that tests can run a server in-process too.

use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::health::{Component, Health};
use crate::metrics::Metrics;
use crate::proto::rate_limit_response::Code;
use crate::proto::{RateLimitRequest, RateLimitResponse, RateLimitServiceServer};
use crate::settings::{Backend, RedisTarget, Settings};

/// Why the server could not start: the setting at fault and what went
/// wrong. Displayed as `"{VARIABLE}: {message}"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartError {
    /// The environment variable whose value could not be used.
    pub variable: &'static str,
    /// What went wrong.
    pub message: String,
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.variable, self.message)
    }
}

impl std::error::Error for StartError {}

fn start_error(variable: &'static str, message: impl Into<String>) -> StartError {
    StartError {
        variable,
        message: message.into(),
    }
}

/// How long a stop waits for calls in flight and open connections before
/// it closes them.
pub const STOP_GRACE: Duration = Duration::from_secs(15);

/// A started server.
#[derive(Debug)]
pub struct Running {
    /// The HTTP port's address (`/healthcheck`, `/json`).
    pub http_addr: SocketAddr,
    /// The gRPC port's address (`None` on a Unix socket, `GRPC_UDS`).
    pub grpc_addr: Option<SocketAddr>,
    /// The debug port's address.
    pub debug_addr: SocketAddr,
    /// The Prometheus listener's address, when `USE_PROMETHEUS`.
    pub prometheus_addr: Option<SocketAddr>,
    /// The server's counters.
    pub stats: Arc<Metrics>,
    /// The server's health.
    pub health: Arc<Health>,
    stop: watch::Sender<bool>,
    /// The listeners' tasks: one ending by itself is a failure.
    tasks: JoinSet<()>,
    /// Tasks that end by themselves (the store probe) or on stop (the
    /// configuration's health).
    background: JoinSet<()>,
}

impl Running {
    /// Stops gracefully: health turns NOT_SERVING, the listeners close,
    /// calls in flight finish; returns when every task has ended.
    pub async fn stop(mut self) {
        self.health.shutting_down().await;
        let _ = self.stop.send(true);
        let drained = tokio::time::timeout(STOP_GRACE, async {
            while self.tasks.join_next().await.is_some() {}
            while self.background.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!("connections still open after {STOP_GRACE:?}: closing them");
            self.tasks.shutdown().await;
            self.background.shutdown().await;
        }
    }

    /// Waits until a server task ends by itself (a listener failing); a
    /// healthy server never returns from here.
    pub async fn wait_for_failure(&mut self) {
        if self.tasks.join_next().await.is_none() {
            std::future::pending::<()>().await;
        }
    }
}

/// The decision logic as the server calls it: `ShouldRateLimit` on a
/// request, answered or refused with a gRPC status (the same call serves
/// gRPC and `POST /json`).
pub trait Decide: Send + Sync + 'static {
    /// Decides one request.
    fn should_rate_limit(
        &self,
        request: RateLimitRequest,
    ) -> impl Future<Output = Result<RateLimitResponse, tonic::Status>> + Send;
}

/// What the server hands the decision logic it builds: the store, the
/// configuration in force (it changes live), the counters and the settings.
pub struct Parts<'a> {
    /// The store the settings chose.
    pub store: tower_ratelimit::Store,
    /// The configuration in force.
    pub config: watch::Receiver<Arc<crate::config::RateLimitConfig>>,
    /// Where the decisions are counted.
    pub stats: Arc<Metrics>,
    /// Every setting.
    pub settings: &'a Settings,
}

/// What the HTTP and debug ports share.
struct AppState<S> {
    service: Arc<S>,
    health: Arc<Health>,
    stats: Arc<Metrics>,
    config: watch::Receiver<Arc<crate::config::RateLimitConfig>>,
    prometheus_millis: bool,
}

impl<S> Clone for AppState<S> {
    fn clone(&self) -> Self {
        AppState {
            service: self.service.clone(),
            health: self.health.clone(),
            stats: self.stats.clone(),
            config: self.config.clone(),
            prometheus_millis: self.prometheus_millis,
        }
    }
}

async fn bind(variable: &'static str, addr: String) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr.as_str())
        .await
        .map_err(|e| start_error(variable, format!("cannot listen on {addr}: {e}")))
}

fn read_file(variable: &'static str, path: &std::path::Path) -> Result<Vec<u8>, StartError> {
    std::fs::read(path)
        .map_err(|e| start_error(variable, format!("cannot read {}: {e}", path.display())))
}

/// The store the settings choose.
fn build_store(settings: &Settings) -> Result<tower_ratelimit::Store, StartError> {
    let redis = match &settings.backend {
        Backend::Memory => return Ok(tower_ratelimit::MemoryStore::new().into()),
        Backend::Redis(redis) => redis,
    };
    let mut builder = match &redis.target {
        RedisTarget::Single(url) => tower_ratelimit::RedisStore::builder(url.clone()),
        RedisTarget::Cluster(urls) => tower_ratelimit::RedisStore::cluster_builder(urls.clone()),
        RedisTarget::Sentinel { master, sentinels } => {
            tower_ratelimit::RedisStore::sentinel_builder(sentinels.clone(), master.clone())
        }
    }
    .lanes(redis.pool_size);
    if let Some(ca) = &redis.tls_ca {
        builder = builder.tls_root_certificate(read_file("REDIS_TLS_CACERT", ca)?);
    }
    if let Some((cert, key)) = &redis.tls_client {
        builder = builder.tls_client_certificate(
            read_file("REDIS_TLS_CLIENT_CERT", cert)?,
            read_file("REDIS_TLS_CLIENT_KEY", key)?,
        );
    }
    let store = builder
        .build()
        .map_err(|e| start_error("REDIS_URL", e.to_string()))?;
    Ok(store.into())
}

/// Starts the server on the decision logic of [`crate::service`]: what the
/// `ratelimit` binary runs.
pub async fn start(settings: Settings) -> Result<Running, StartError> {
    start_with(settings, |parts| {
        let s = parts.settings;
        let options = crate::service::Options {
            shadow_mode: s.service.shadow_mode,
            quota_mode: s.service.quota_mode,
            stop_increment_when_over_limit: s.service.stop_increment_when_over_limit,
            near_limit_ratio: s.service.near_limit_ratio,
            local_cache_size_in_bytes: usize::try_from(s.service.local_cache_size)
                .unwrap_or(usize::MAX),
            cache_key_prefix: s.cache_key_prefix.clone(),
            response_headers: s.service.response_headers.as_ref().map(|h| {
                crate::service::ResponseHeaders {
                    limit: h.limit.clone(),
                    remaining: h.remaining.clone(),
                    reset: h.reset.clone(),
                }
            }),
            dynamic_metadata: s.service.response_dynamic_metadata,
            store_timeout: match &s.backend {
                Backend::Redis(redis) => redis.timeout,
                Backend::Memory => crate::service::Options::default().store_timeout,
            },
        };
        crate::service::Service::new(parts.store, parts.config, options, parts.stats)
            .map_err(|e| start_error("REDIS_TIMEOUT", e.to_string()))
    })
    .await
}

impl Decide for crate::service::Service {
    async fn should_rate_limit(
        &self,
        request: RateLimitRequest,
    ) -> Result<RateLimitResponse, tonic::Status> {
        crate::service::Service::should_rate_limit(self, request)
            .await
            .map_err(Into::into)
    }
}

/// Starts the server: binds every listener (an address in use is a
/// [`StartError`] naming its variable), starts the configuration watcher,
/// builds the decision logic with `service`, and serves until
/// [`Running::stop`].
pub async fn start_with<S: Decide>(
    settings: Settings,
    service: impl FnOnce(Parts<'_>) -> Result<S, StartError>,
) -> Result<Running, StartError> {
    let stats = Arc::new(Metrics::new());
    let store = build_store(&settings)?;
    let memory = matches!(settings.backend, Backend::Memory);

    // every listener first: a port in use stops the start before anything runs
    let http = bind("PORT", settings.http_addr()).await?;
    let debug = bind("DEBUG_PORT", settings.debug_addr()).await?;
    let grpc = match &settings.grpc_uds {
        Some(path) => {
            // a socket left by an earlier run is replaced; any other file
            // at the path is left alone (the bind below then fails)
            if std::fs::symlink_metadata(path)
                .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
            {
                let _ = std::fs::remove_file(path);
            }
            let uds = tokio::net::UnixListener::bind(path).map_err(|e| {
                start_error(
                    "GRPC_UDS",
                    format!("cannot listen on {}: {e}", path.display()),
                )
            })?;
            GrpcListener::Unix(uds)
        }
        None => GrpcListener::Tcp(bind("GRPC_PORT", settings.grpc_addr()).await?),
    };
    let prometheus = if settings.use_prometheus {
        Some(bind("PROMETHEUS_ADDR", settings.prometheus_bind_addr()).await?)
    } else {
        None
    };
    let tls = match &settings.grpc_tls {
        None => None,
        Some(tls) => {
            let cert = read_file("GRPC_SERVER_TLS_CERT", &tls.cert)?;
            let key = read_file("GRPC_SERVER_TLS_KEY", &tls.key)?;
            let mut config = tonic::transport::ServerTlsConfig::new()
                .identity(tonic::transport::Identity::from_pem(cert, key));
            if let Some(ca) = &tls.client_ca {
                config = config.client_ca_root(tonic::transport::Certificate::from_pem(read_file(
                    "GRPC_CLIENT_TLS_CACERT",
                    ca,
                )?));
            }
            Some(config)
        }
    };

    let (reporter, health_service) = tonic_health::server::health_reporter();
    let health = Arc::new(
        Health::new(
            reporter,
            memory,
            settings.healthy_with_at_least_one_config_loaded,
        )
        .await,
    );

    // the configuration, and the service deciding on it
    let (config_rx, runtime) = {
        let stats = stats.clone();
        crate::runtime::Runtime::start_with(settings.runtime.clone(), move |outcome| {
            stats.config_load(outcome.is_ok())
        })
        .map_err(|e| start_error("RUNTIME_ROOT", e.to_string()))?
    };
    let service = Arc::new(service(Parts {
        store: store.clone(),
        config: config_rx.clone(),
        stats: stats.clone(),
        settings: &settings,
    })?);

    let (stop, stopped) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut background = JoinSet::new();

    // health follows the configuration (HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED)
    {
        let health = health.clone();
        let mut config = config_rx.clone();
        let mut stopped = stopped.clone();
        background.spawn(async move {
            loop {
                let has_domains = !config.borrow_and_update().is_empty();
                health.set(Component::Config, has_domains).await;
                tokio::select! {
                    changed = config.changed() => if changed.is_err() { break },
                    _ = stopped.wait_for(|s| *s) => break,
                }
            }
            // stops following the files (joins the watching thread)
            let _ = tokio::task::spawn_blocking(move || drop(runtime)).await;
        });
    }

    if let Backend::Redis(redis) = &settings.backend {
        background.spawn(probe_store(
            store.clone(),
            redis.clone(),
            health.clone(),
            stopped.clone(),
        ));
        tracing::warn!(redis = %redis.target.describe(), pool = redis.pool_size, "using Redis");
    } else {
        tracing::warn!("using the in-memory store: limits are this instance's alone");
    }

    let state = AppState {
        service: service.clone(),
        health: health.clone(),
        stats: stats.clone(),
        config: config_rx.clone(),
        prometheus_millis: settings.prometheus_response_time_ms,
    };

    // gRPC
    let mut builder = tonic::transport::Server::builder()
        .max_connection_age(settings.grpc_max_connection_age)
        .max_connection_age_grace(settings.grpc_max_connection_age_grace);
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .map_err(|e| start_error("GRPC_SERVER_TLS_CERT", e.to_string()))?;
    }
    let timed = TimedService {
        inner: service.clone(),
        stats: stats.clone(),
    };
    let router = builder
        .add_service(health_service)
        .add_service(RateLimitServiceServer::new(timed));
    let grpc_addr = match grpc {
        GrpcListener::Tcp(listener) => {
            let addr = listener.local_addr().ok();
            tracing::warn!("Listening for gRPC on '{}'", addr_text(addr));
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            tasks.spawn(log_end(
                "gRPC",
                router.serve_with_incoming_shutdown(incoming, stopped_signal(stopped.clone())),
            ));
            addr
        }
        GrpcListener::Unix(listener) => {
            tracing::warn!(
                "Listening for gRPC on '{}'",
                settings
                    .grpc_uds
                    .as_deref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            );
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            tasks.spawn(log_end(
                "gRPC",
                router.serve_with_incoming_shutdown(incoming, stopped_signal(stopped.clone())),
            ));
            None
        }
    };

    // HTTP
    let http_addr = local_addr("PORT", &http)?;
    let app = Router::new()
        .route("/healthcheck", get(healthcheck::<S>))
        .route("/json", any(json::<S>))
        .with_state(state.clone());
    tracing::warn!("Listening for HTTP on '{http_addr}'");
    tasks.spawn(log_end(
        "HTTP",
        axum::serve(http, app)
            .with_graceful_shutdown(stopped_signal(stopped.clone()))
            .into_future(),
    ));

    // debug
    let debug_addr = local_addr("DEBUG_PORT", &debug)?;
    let debug_app = Router::new()
        .route("/", get(debug_index))
        .route("/rlconfig", get(rlconfig::<S>))
        .route("/stats", get(stats_listing::<S>))
        .with_state(state.clone());
    tracing::warn!("Listening for debug on '{debug_addr}'");
    tasks.spawn(log_end(
        "debug",
        axum::serve(debug, debug_app)
            .with_graceful_shutdown(stopped_signal(stopped.clone()))
            .into_future(),
    ));

    // Prometheus
    let prometheus_addr = match prometheus {
        None => None,
        Some(listener) => {
            let addr = local_addr("PROMETHEUS_ADDR", &listener)?;
            let app = Router::new()
                .route(&settings.prometheus_path, get(metrics::<S>))
                .with_state(state.clone());
            tracing::info!(
                "Starting prometheus sink on {addr}{}",
                settings.prometheus_path
            );
            tasks.spawn(log_end(
                "Prometheus",
                axum::serve(listener, app)
                    .with_graceful_shutdown(stopped_signal(stopped.clone()))
                    .into_future(),
            ));
            Some(addr)
        }
    };

    Ok(Running {
        http_addr,
        grpc_addr,
        debug_addr,
        prometheus_addr,
        stats,
        health,
        stop,
        tasks,
        background,
    })
}

enum GrpcListener {
    Tcp(TcpListener),
    Unix(tokio::net::UnixListener),
}

fn addr_text(addr: Option<SocketAddr>) -> String {
    addr.map(|a| a.to_string()).unwrap_or_default()
}

fn local_addr(variable: &'static str, l: &TcpListener) -> Result<SocketAddr, StartError> {
    l.local_addr()
        .map_err(|e| start_error(variable, format!("no local address: {e}")))
}

/// Resolves once the stop flag is raised.
async fn stopped_signal(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|s| *s).await;
}

/// Runs a server to its end and logs how it ended.
async fn log_end<E: std::fmt::Display>(
    what: &'static str,
    served: impl Future<Output = Result<(), E>>,
) {
    match served.await {
        Ok(()) => tracing::info!("{what} server stopped"),
        Err(e) => tracing::error!("{what} server failed: {e}"),
    }
}

/// Probes the store until it answers (envoyproxy/ratelimit's `PING` at
/// startup), backing off from `REDIS_STARTUP_INITIAL_INTERVAL` to
/// `REDIS_STARTUP_MAX_INTERVAL`; health's store component turns healthy
/// then. Past `REDIS_STARTUP_MAX_ELAPSED_TIME` (when not 0) the process
/// exits, as envoyproxy/ratelimit's does.
async fn probe_store(
    store: tower_ratelimit::Store,
    redis: crate::settings::RedisSettings,
    health: Arc<Health>,
    mut stopped: watch::Receiver<bool>,
) {
    use tower_ratelimit::{Limit, Limiter, Quota};
    let limiter = Limit::new(
        "ratelimit-startup-probe",
        Quota::per_second(1).fixed_window(),
    )
    .ok()
    .and_then(|limit| {
        Limiter::builder(store)
            .limit(limit)
            .timeout(redis.timeout.max(Duration::from_millis(1)))
            .build()
            .ok()
    });
    let Some(limiter) = limiter else {
        tracing::error!("cannot build the store probe");
        return;
    };
    let started = Instant::now();
    let mut wait = redis
        .startup_initial_interval
        .max(Duration::from_millis(10));
    loop {
        match limiter.peek("probe", 1).await {
            Ok(_) => {
                tracing::warn!(redis = %redis.target.describe(), "Redis reached");
                health.set(Component::Store, true).await;
                return;
            }
            Err(e) => {
                let elapsed = started.elapsed();
                if !redis.startup_max_elapsed.is_zero() && elapsed >= redis.startup_max_elapsed {
                    tracing::error!(
                        "timed out waiting for Redis ({}) after {elapsed:?}: {e}",
                        redis.target.describe()
                    );
                    std::process::exit(1);
                }
                tracing::warn!(
                    "Retrying Redis connection to {} in {wait:?} (elapsed: {elapsed:?}): {e}",
                    redis.target.describe()
                );
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stopped.wait_for(|s| *s) => return,
        }
        wait = (wait * 2).min(redis.startup_max_interval.max(Duration::from_millis(10)));
    }
}

/// The service behind gRPC, timing each call for
/// `ratelimit_service_total_requests` and `..._response_time_seconds`.
struct TimedService<S> {
    inner: Arc<S>,
    stats: Arc<Metrics>,
}

impl<S: Decide> crate::proto::RateLimitService for TimedService<S> {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let started = Instant::now();
        let answer = self.inner.should_rate_limit(request.into_inner()).await;
        self.stats.observe_call(started.elapsed());
        answer.map(tonic::Response::new)
    }
}

async fn healthcheck<S>(State(state): State<AppState<S>>) -> Response {
    if state.health.is_ok() {
        (StatusCode::OK, "OK").into_response()
    } else {
        StatusCode::INTERNAL_SERVER_ERROR.into_response()
    }
}

/// A plain-text answer with the status's reason phrase, as Go's
/// `http.Error` writes it.
fn plain_status(status: StatusCode) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        format!("{}\n", status.canonical_reason().unwrap_or("")),
    )
        .into_response()
}

async fn json<S: Decide>(State(state): State<AppState<S>>, body: Bytes) -> Response {
    let request = match crate::json::parse_request(&body) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("error: {e}");
            return plain_status(StatusCode::BAD_REQUEST);
        }
    };
    // not a gRPC call: envoyproxy/ratelimit's request counters leave it out
    let response = match state.service.should_rate_limit(request).await {
        Ok(r) => r,
        Err(status) => {
            tracing::warn!("error: {}", status.message());
            return plain_status(StatusCode::BAD_REQUEST);
        }
    };
    let code = if response.overall_code == Code::OverLimit as i32 {
        StatusCode::TOO_MANY_REQUESTS
    } else if response.overall_code == Code::Ok as i32 {
        StatusCode::OK
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        crate::json::response_to_json(&response).to_string(),
    )
        .into_response()
}

async fn debug_index() -> &'static str {
    "/rlconfig: print out the currently loaded configuration for debugging\n\
     /stats: print out stats\n"
}

async fn rlconfig<S>(State(state): State<AppState<S>>) -> String {
    let config = state.config.borrow().clone();
    config.dump()
}

async fn stats_listing<S>(State(state): State<AppState<S>>) -> String {
    state.stats.statsd_listing()
}

async fn metrics<S>(State(state): State<AppState<S>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.stats.prometheus(state.prometheus_millis),
    )
        .into_response()
}
