//! The environment, read as envoyproxy/ratelimit reads it
//! (`src/settings/settings.go`): the same variable names, the same defaults,
//! the same value syntax (Go's `strconv.ParseBool`, integers, and durations
//! such as `1h30m`).
//!
//! A variable this server has no use for (a statsd sink, memcache, xDS,
//! tracing, radix's pipelining knobs) is accepted and listed in
//! [`Settings::no_effect`], for the binary to say once in its log. A
//! variable whose value cannot be read, or that asks for something this
//! server cannot do safely (a SAN check of gRPC clients, an unverified
//! Redis certificate), is a [`SettingsError`] that names it: the binary exits with it
//! rather than run differently from what was asked.
//!
//! Differences from envoyproxy/ratelimit, all on purpose:
//! - a variable set to the empty string counts as unset (its default);
//! - with no `REDIS_URL` (and `BACKEND_TYPE` unset or `memory`) the server
//!   runs on the in-memory store, one instance, where envoyproxy/ratelimit
//!   dials its default socket `/var/run/nutcracker/ratelimit.sock`;
//! - `REDIS_SOCKET_TYPE` left unset follows `REDIS_URL`: a path (starting
//!   with `/`) is a Unix socket, anything else TCP (envoyproxy/ratelimit's
//!   default is `unix` whatever the URL).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// A variable whose value is refused, and why. Displayed as
/// `"{VARIABLE}: {message}"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingsError {
    /// The environment variable.
    pub variable: &'static str,
    /// What is wrong with its value (the value itself is not repeated for
    /// variables that may hold a secret).
    pub message: String,
}

impl fmt::Display for SettingsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.variable, self.message)
    }
}

impl std::error::Error for SettingsError {}

/// `LOG_LEVEL`, as logrus names its levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// `trace`.
    Trace,
    /// `debug`.
    Debug,
    /// `info`.
    Info,
    /// `warn` / `warning` (the default, `WARN`).
    Warn,
    /// `error`, and logrus's `fatal` and `panic`.
    Error,
}

impl LogLevel {
    /// The `tracing` level filter of this level.
    pub fn as_filter(self) -> tracing::level_filters::LevelFilter {
        use tracing::level_filters::LevelFilter;
        match self {
            LogLevel::Trace => LevelFilter::TRACE,
            LogLevel::Debug => LevelFilter::DEBUG,
            LogLevel::Info => LevelFilter::INFO,
            LogLevel::Warn => LevelFilter::WARN,
            LogLevel::Error => LevelFilter::ERROR,
        }
    }
}

/// `LOG_FORMAT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Lines of text (the default).
    Text,
    /// One JSON object a line.
    Json,
}

/// The certificate and key of the gRPC port (`GRPC_SERVER_USE_TLS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcTls {
    /// `GRPC_SERVER_TLS_CERT`: the PEM certificate chain.
    pub cert: PathBuf,
    /// `GRPC_SERVER_TLS_KEY`: the PEM private key.
    pub key: PathBuf,
    /// `GRPC_CLIENT_TLS_CACERT`: when set, clients must present a
    /// certificate this CA signed (mutual TLS).
    pub client_ca: Option<PathBuf>,
}

/// What `REDIS_TYPE` and `REDIS_URL` name.
#[derive(Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// `SINGLE`: one server, as a redis-rs URL (`redis://`, `rediss://` or
    /// `redis+unix://`), credentials included.
    Single(String),
    /// `CLUSTER`: the seed nodes, as redis-rs URLs.
    Cluster(Vec<String>),
    /// `SENTINEL`: the master's name and the sentinels' URLs (the first
    /// carries the master's credentials).
    Sentinel {
        /// The master's name (the first item of `REDIS_URL`).
        master: String,
        /// The sentinels.
        sentinels: Vec<String>,
    },
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RedisTarget::Single(url) => f.debug_tuple("Single").field(&masked(url)).finish(),
            RedisTarget::Cluster(urls) => f
                .debug_tuple("Cluster")
                .field(&urls.iter().map(|u| masked(u)).collect::<Vec<_>>())
                .finish(),
            RedisTarget::Sentinel { master, sentinels } => f
                .debug_struct("Sentinel")
                .field("master", master)
                .field(
                    "sentinels",
                    &sentinels.iter().map(|u| masked(u)).collect::<Vec<_>>(),
                )
                .finish(),
        }
    }
}

impl RedisTarget {
    /// The target for a log line, without credentials.
    pub fn describe(&self) -> String {
        match self {
            RedisTarget::Single(url) => format!("single {}", masked(url)),
            RedisTarget::Cluster(urls) => format!(
                "cluster {}",
                urls.iter().map(|u| masked(u)).collect::<Vec<_>>().join(",")
            ),
            RedisTarget::Sentinel { master, sentinels } => format!(
                "sentinel master {master} via {}",
                sentinels
                    .iter()
                    .map(|u| masked(u))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
}

/// A URL with its credentials replaced by `*****`.
fn masked(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://*****@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// The Redis backend's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// What to connect to.
    pub target: RedisTarget,
    /// `REDIS_POOL_SIZE` (default 10): the connections the store keeps
    /// (its lanes; decisions are multiplexed over them).
    pub pool_size: usize,
    /// `REDIS_TLS_CACERT`: a CA certificate (PEM file) trusted besides the
    /// system's roots.
    pub tls_ca: Option<PathBuf>,
    /// `REDIS_TLS_CLIENT_CERT` and `REDIS_TLS_CLIENT_KEY`: a client
    /// certificate (PEM file) and its key (PEM file) for servers that
    /// require one.
    pub tls_client: Option<(PathBuf, PathBuf)>,
    /// `REDIS_TIMEOUT` (default 10 s): how long one decision may wait for
    /// Redis before it fails (`UNAVAILABLE`).
    pub timeout: Duration,
    /// `REDIS_STARTUP_INITIAL_INTERVAL` (default 1 s): the first wait
    /// between startup probes of Redis.
    pub startup_initial_interval: Duration,
    /// `REDIS_STARTUP_MAX_INTERVAL` (default 30 s): the longest wait between
    /// startup probes.
    pub startup_max_interval: Duration,
    /// `REDIS_STARTUP_MAX_ELAPSED_TIME` (default 0: forever): how long to
    /// keep probing before giving up and exiting.
    pub startup_max_elapsed: Duration,
}

/// Where limit state lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// The in-memory store of this one process (no `REDIS_URL`, or
    /// `BACKEND_TYPE=memory`).
    Memory,
    /// Redis.
    Redis(RedisSettings),
}

pub use crate::runtime::RuntimeSettings;

/// The names of the headers added when `LIMIT_RESPONSE_HEADERS_ENABLED`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderNames {
    /// `LIMIT_LIMIT_HEADER` (default `RateLimit-Limit`).
    pub limit: String,
    /// `LIMIT_REMAINING_HEADER` (default `RateLimit-Remaining`).
    pub remaining: String,
    /// `LIMIT_RESET_HEADER` (default `RateLimit-Reset`).
    pub reset: String,
}

/// What the decision logic is told by the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceSettings {
    /// `SHADOW_MODE`: never answer `OVER_LIMIT` (counted and reported only),
    /// unless the request carried its own limit.
    pub shadow_mode: bool,
    /// `QUOTA_MODE`: over-limit quota descriptors set metadata but never
    /// answer `OVER_LIMIT`.
    pub quota_mode: bool,
    /// `NEAR_LIMIT_RATIO` (default 0.8): the share of a limit past which
    /// hits count as `near_limit`.
    pub near_limit_ratio: f32,
    /// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`: hits refused are not
    /// counted.
    pub stop_increment_when_over_limit: bool,
    /// `LOCAL_CACHE_SIZE_IN_BYTES` (default 0: none): over a zero size,
    /// keys known to be over their limit are refused without asking the
    /// store until their window ends.
    pub local_cache_size: u64,
    /// `LIMIT_RESPONSE_HEADERS_ENABLED` with the header names, or `None`.
    pub response_headers: Option<HeaderNames>,
    /// `RESPONSE_DYNAMIC_METADATA`: the response carries the request's
    /// descriptors (and statuses) as dynamic metadata.
    pub response_dynamic_metadata: bool,
}

/// Every setting of the environment.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `HOST` (default `0.0.0.0`): the HTTP port's address.
    pub host: String,
    /// `PORT` (default 8080): `/healthcheck` and `/json`.
    pub port: u16,
    /// `GRPC_HOST` (default `0.0.0.0`).
    pub grpc_host: String,
    /// `GRPC_PORT` (default 8081).
    pub grpc_port: u16,
    /// `GRPC_UDS`: listen for gRPC on this Unix socket instead.
    pub grpc_uds: Option<PathBuf>,
    /// `GRPC_MAX_CONNECTION_AGE` (default 24 h).
    pub grpc_max_connection_age: Duration,
    /// `GRPC_MAX_CONNECTION_AGE_GRACE` (default 1 h).
    pub grpc_max_connection_age_grace: Duration,
    /// `GRPC_SERVER_USE_TLS` with its certificate and key.
    pub grpc_tls: Option<GrpcTls>,
    /// `DEBUG_HOST` (default `0.0.0.0`).
    pub debug_host: String,
    /// `DEBUG_PORT` (default 6070): `/rlconfig`, `/stats`.
    pub debug_port: u16,
    /// `LOG_LEVEL` (default `WARN`).
    pub log_level: LogLevel,
    /// `LOG_FORMAT` (default `text`).
    pub log_format: LogFormat,
    /// `USE_PROMETHEUS` (default false).
    pub use_prometheus: bool,
    /// `PROMETHEUS_ADDR` (default `:9090`), as `host:port` (an empty host:
    /// every interface).
    pub prometheus_addr: String,
    /// `PROMETHEUS_PATH` (default `/metrics`).
    pub prometheus_path: String,
    /// `PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS` (default false): the
    /// response time histogram in milliseconds rather than seconds.
    pub prometheus_response_time_ms: bool,
    /// The store.
    pub backend: Backend,
    /// `CACHE_KEY_PREFIX` (default empty): put before every counter key.
    pub cache_key_prefix: String,
    /// Where the configuration is read (`RUNTIME_*`, `MERGE_DOMAIN_CONFIG`).
    pub runtime: RuntimeSettings,
    /// `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED` (default false): unhealthy
    /// until a configuration with at least one domain is loaded.
    pub healthy_with_at_least_one_config_loaded: bool,
    /// `FORCE_START_WITHOUT_INITIAL_CONFIG` (default false).
    pub force_start_without_initial_config: bool,
    /// What the decision logic needs.
    pub service: ServiceSettings,
    /// Variables set in the environment that have no effect here, each with
    /// why: for the log, once each.
    pub no_effect: Vec<(&'static str, &'static str)>,
}

/// Variables that are accepted and have no effect here, with the reason
/// said in the log.
const NO_EFFECT: &[(&str, &str)] = &[
    (
        "REDIS_PIPELINE_WINDOW",
        "decisions arriving together already share one Redis call",
    ),
    (
        "REDIS_PIPELINE_LIMIT",
        "decisions arriving together already share one Redis call",
    ),
    (
        "REDIS_CLUSTER_PIPELINE_PARALLELISM",
        "a decision's cluster slots are always decided in parallel",
    ),
    (
        "REDIS_POOL_ON_EMPTY_BEHAVIOR",
        "decisions are multiplexed over the pool's connections, never waiting for a free one",
    ),
    (
        "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
        "a broken connection is replaced at once; decisions fail with UNAVAILABLE meanwhile",
    ),
    (
        "REDIS_PERSECOND",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_SOCKET_TYPE",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_TYPE",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_URL",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_POOL_SIZE",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_AUTH",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_TLS",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_SENTINEL_AUTH",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_PIPELINE_WINDOW",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_PIPELINE_LIMIT",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_TIMEOUT",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR",
        "per-second limits live on REDIS_URL with the others",
    ),
    (
        "EXPIRATION_JITTER_MAX_SECONDS",
        "keys expire when their state no longer matters, not at window ends shared by many keys",
    ),
    ("USE_STATSD", "no statsd sink: use USE_PROMETHEUS"),
    ("USE_DOG_STATSD", "no statsd sink: use USE_PROMETHEUS"),
    (
        "USE_DOG_STATSD_MOGRIFIERS",
        "no statsd sink: use USE_PROMETHEUS",
    ),
    ("STATSD_HOST", "no statsd sink: use USE_PROMETHEUS"),
    ("STATSD_PORT", "no statsd sink: use USE_PROMETHEUS"),
    (
        "STATS_FLUSH_INTERVAL",
        "counters are read live when scraped",
    ),
    ("EXTRA_TAGS", "extra tags are not added to the metrics"),
    (
        "DISABLE_STATS",
        "counters are kept in memory and cost nothing unless scraped",
    ),
    (
        "PROMETHEUS_MAPPER_YAML",
        "the metric names are envoyproxy/ratelimit's default mapping, fixed",
    ),
    ("TRACING_ENABLED", "no OpenTelemetry tracing"),
    ("TRACING_SERVICE_NAME", "no OpenTelemetry tracing"),
    ("TRACING_SERVICE_NAMESPACE", "no OpenTelemetry tracing"),
    ("TRACING_SERVICE_INSTANCE_ID", "no OpenTelemetry tracing"),
    ("TRACING_EXPORTER_PROTOCOL", "no OpenTelemetry tracing"),
    ("TRACING_SAMPLING_RATE", "no OpenTelemetry tracing"),
    ("MEMCACHE_HOST_PORT", "no memcache backend"),
    ("MEMCACHE_MAX_IDLE_CONNS", "no memcache backend"),
    ("MEMCACHE_SRV", "no memcache backend"),
    ("MEMCACHE_SRV_REFRESH", "no memcache backend"),
    ("MEMCACHE_TLS", "no memcache backend"),
    ("MEMCACHE_TLS_CLIENT_CERT", "no memcache backend"),
    ("MEMCACHE_TLS_CLIENT_KEY", "no memcache backend"),
    ("MEMCACHE_TLS_CACERT", "no memcache backend"),
    (
        "MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION",
        "no memcache backend",
    ),
    (
        "CONFIG_GRPC_XDS_NODE_ID",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "CONFIG_GRPC_XDS_NODE_METADATA",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "CONFIG_GRPC_XDS_SERVER_URL",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "CONFIG_GRPC_XDS_SERVER_USE_TLS",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "XDS_CLIENT_BACKOFF_JITTER",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
    (
        "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
        "the configuration is read from files only (CONFIG_TYPE=FILE)",
    ),
];

/// Every variable that has no effect here, with why (for the README's
/// table and the log).
pub fn no_effect_variables() -> &'static [(&'static str, &'static str)] {
    NO_EFFECT
}

/// Reads variables through a lookup (the process environment, or a map in
/// tests), an empty value counting as unset.
struct Env<F> {
    lookup: F,
}

impl<F: Fn(&str) -> Option<String>> Env<F> {
    fn get(&self, var: &str) -> Option<String> {
        (self.lookup)(var).filter(|v| !v.is_empty())
    }

    fn string(&self, var: &'static str, default: &str) -> String {
        self.get(var).unwrap_or_else(|| default.to_owned())
    }

    fn boolean(&self, var: &'static str, default: bool) -> Result<bool, SettingsError> {
        match self.get(var) {
            None => Ok(default),
            Some(v) => parse_bool(&v).ok_or_else(|| SettingsError {
                variable: var,
                message: format!(
                    "{v:?} is not a boolean (true, false, 1, 0, t, f, TRUE, FALSE, True, False)"
                ),
            }),
        }
    }

    fn integer<T>(&self, var: &'static str, default: T, what: &str) -> Result<T, SettingsError>
    where
        T: TryFrom<i64> + Copy,
    {
        match self.get(var) {
            None => Ok(default),
            Some(v) => parse_int(&v)
                .and_then(|n| T::try_from(n).ok())
                .ok_or_else(|| SettingsError {
                    variable: var,
                    message: format!("{v:?} is not {what}"),
                }),
        }
    }

    fn port(&self, var: &'static str, default: u16) -> Result<u16, SettingsError> {
        self.integer(var, default, "a port number (0 to 65535)")
    }

    fn duration(&self, var: &'static str, default: Duration) -> Result<Duration, SettingsError> {
        match self.get(var) {
            None => Ok(default),
            Some(v) => parse_go_duration(&v).ok_or_else(|| SettingsError {
                variable: var,
                message: format!("{v:?} is not a duration (such as 300ms, 10s, 1h30m)"),
            }),
        }
    }
}

/// Go's `strconv.ParseBool`.
fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Go's `strconv.ParseInt(v, 0, 64)` (envconfig's reading): decimal, or
/// `0x`, `0o`, `0b` and leading-`0` octal, with an optional sign and `_`
/// between digits.
fn parse_int(v: &str) -> Option<i64> {
    let (negative, body) = match v.as_bytes().first()? {
        b'-' => (true, &v[1..]),
        b'+' => (false, &v[1..]),
        _ => (false, v),
    };
    let lower = body.to_ascii_lowercase();
    let (radix, digits) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d)
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d)
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..])
    } else {
        (10, lower.as_str())
    };
    if digits.is_empty()
        || digits.starts_with('_')
        || digits.ends_with('_')
        || digits.contains("__")
    {
        return None;
    }
    let digits: String = digits.chars().filter(|c| *c != '_').collect();
    let magnitude = i128::from_str_radix(&digits, radix).ok()?;
    let n = if negative { -magnitude } else { magnitude };
    i64::try_from(n).ok()
}

/// Go's `time.ParseDuration`: `[-+]?` then one or more decimal numbers each
/// with a unit (`ns`, `us`, `µs`, `ms`, `s`, `m`, `h`), or `0`. Negative
/// durations are refused (no setting here has a use for them).
fn parse_go_duration(v: &str) -> Option<Duration> {
    let s = v.strip_prefix('+').unwrap_or(v);
    if s == "0" {
        return Some(Duration::ZERO);
    }
    if s.is_empty() || s.starts_with('-') {
        return None;
    }
    let mut rest = s;
    let mut total_nanos: f64 = 0.0;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..number_len];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return None;
        }
        let value: f64 = number.parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total_nanos += value * scale;
    }
    // Go's durations are int64 nanoseconds: about 292 years at most
    if !total_nanos.is_finite() || total_nanos > i64::MAX as f64 {
        return None;
    }
    Some(Duration::from_nanos(total_nanos.round() as u64))
}

/// `host:port` of `REDIS_URL` as a redis-rs URL: `redis://` (or `rediss://`
/// with TLS), the credentials of `REDIS_AUTH` (`password` or
/// `user:password`) percent-encoded before the host. A value that already
/// names a scheme is kept as written.
fn redis_url(
    var: &'static str,
    address: &str,
    unix: bool,
    tls: bool,
    auth: Option<&str>,
) -> Result<String, SettingsError> {
    let address = address.trim();
    if address.is_empty() {
        return Err(SettingsError {
            variable: var,
            message: "an address is empty (expected host:port, comma separated)".into(),
        });
    }
    if address.contains("://") {
        return Ok(address.to_owned());
    }
    let credentials = match auth {
        None => String::new(),
        Some(auth) => match auth.split_once(':') {
            Some((user, password)) => format!("{}:{}@", encode(user), encode(password)),
            None => format!(":{}@", encode(auth)),
        },
    };
    if unix {
        if tls {
            return Err(SettingsError {
                variable: "REDIS_TLS",
                message: "TLS over a Unix socket is not supported".into(),
            });
        }
        // redis-rs reads the password of a socket URL from its query
        let mut url = format!("redis+unix://{address}");
        if let Some(auth) = auth {
            let (user, password) = match auth.split_once(':') {
                Some((u, p)) => (Some(u), p),
                None => (None, auth),
            };
            url.push_str(&format!("?pass={}", encode(password)));
            if let Some(user) = user {
                url.push_str(&format!("&user={}", encode(user)));
            }
        }
        return Ok(url);
    }
    let (host, port) = address.rsplit_once(':').ok_or_else(|| SettingsError {
        variable: var,
        message: format!("{address:?} is not host:port"),
    })?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(SettingsError {
            variable: var,
            message: format!("{address:?} is not host:port"),
        });
    }
    let scheme = if tls { "rediss" } else { "redis" };
    Ok(format!("{scheme}://{credentials}{host}:{port}"))
}

/// Percent-encodes what a URL's user information cannot hold as is.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A variable that asks for what this server cannot do.
fn unsupported(variable: &'static str, message: &str) -> SettingsError {
    SettingsError {
        variable,
        message: message.to_owned(),
    }
}

impl Settings {
    /// Reads the process environment.
    pub fn from_env() -> Result<Settings, SettingsError> {
        Settings::from_lookup(|var| std::env::var(var).ok())
    }

    /// Reads the variables through `lookup` (`None`: unset).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Settings, SettingsError> {
        let env = Env { lookup };

        let log_level = match env
            .string("LOG_LEVEL", "WARN")
            .to_ascii_lowercase()
            .as_str()
        {
            "trace" => LogLevel::Trace,
            "debug" => LogLevel::Debug,
            "info" => LogLevel::Info,
            "warn" | "warning" => LogLevel::Warn,
            "error" | "fatal" | "panic" => LogLevel::Error,
            other => {
                return Err(SettingsError {
                    variable: "LOG_LEVEL",
                    message: format!(
                        "{other:?} is not a level (trace, debug, info, warn, error, fatal, panic)"
                    ),
                })
            }
        };
        // envoyproxy/ratelimit takes anything but `json` as text
        let log_format = if env
            .string("LOG_FORMAT", "text")
            .eq_ignore_ascii_case("json")
        {
            LogFormat::Json
        } else {
            LogFormat::Text
        };

        let grpc_tls = if env.boolean("GRPC_SERVER_USE_TLS", false)? {
            let cert = env.get("GRPC_SERVER_TLS_CERT").ok_or_else(|| {
                unsupported(
                    "GRPC_SERVER_TLS_CERT",
                    "GRPC_SERVER_USE_TLS is true but no certificate file is given",
                )
            })?;
            let key = env.get("GRPC_SERVER_TLS_KEY").ok_or_else(|| {
                unsupported(
                    "GRPC_SERVER_TLS_KEY",
                    "GRPC_SERVER_USE_TLS is true but no key file is given",
                )
            })?;
            if env.get("GRPC_CLIENT_TLS_SAN").is_some() {
                return Err(unsupported(
                    "GRPC_CLIENT_TLS_SAN",
                    "checking the client certificate's SAN is not supported here \
                     (GRPC_CLIENT_TLS_CACERT alone is: any certificate the CA signed)",
                ));
            }
            Some(GrpcTls {
                cert: cert.into(),
                key: key.into(),
                client_ca: env.get("GRPC_CLIENT_TLS_CACERT").map(PathBuf::from),
            })
        } else {
            None
        };

        match env.string("CONFIG_TYPE", "FILE").as_str() {
            "FILE" => {}
            "GRPC_XDS_SOTW" => {
                return Err(unsupported(
                    "CONFIG_TYPE",
                    "GRPC_XDS_SOTW is not supported here: only FILE (RUNTIME_ROOT)",
                ))
            }
            other => {
                return Err(unsupported(
                    "CONFIG_TYPE",
                    &format!("{other:?} is not a config type (FILE)"),
                ))
            }
        }

        let near_limit_ratio = match env.get("NEAR_LIMIT_RATIO") {
            None => 0.8,
            Some(v) => match v.trim().parse::<f32>() {
                Ok(r) if r.is_finite() && r >= 0.0 => r,
                _ => {
                    return Err(unsupported(
                        "NEAR_LIMIT_RATIO",
                        &format!("{v:?} is not a ratio (a number such as 0.8)"),
                    ))
                }
            },
        };

        let response_headers = if env.boolean("LIMIT_RESPONSE_HEADERS_ENABLED", false)? {
            Some(HeaderNames {
                limit: header_name(&env, "LIMIT_LIMIT_HEADER", "RateLimit-Limit")?,
                remaining: header_name(&env, "LIMIT_REMAINING_HEADER", "RateLimit-Remaining")?,
                reset: header_name(&env, "LIMIT_RESET_HEADER", "RateLimit-Reset")?,
            })
        } else {
            None
        };

        let cache_key_prefix = env.string("CACHE_KEY_PREFIX", "");

        let backend = backend(&env)?;

        let use_prometheus = env.boolean("USE_PROMETHEUS", false)?;
        let prometheus_addr = env.string("PROMETHEUS_ADDR", ":9090");
        if prometheus_addr
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse::<u16>().ok())
            .is_none()
        {
            return Err(unsupported(
                "PROMETHEUS_ADDR",
                &format!("{prometheus_addr:?} is not [host]:port"),
            ));
        }
        let prometheus_path = env.string("PROMETHEUS_PATH", "/metrics");
        if !prometheus_path.starts_with('/') {
            return Err(unsupported(
                "PROMETHEUS_PATH",
                &format!("{prometheus_path:?} does not start with /"),
            ));
        }

        let mut no_effect = Vec::new();
        for &(var, why) in NO_EFFECT {
            if env.get(var).is_some() {
                no_effect.push((var, why));
            }
        }

        Ok(Settings {
            host: env.string("HOST", "0.0.0.0"),
            port: env.port("PORT", 8080)?,
            grpc_host: env.string("GRPC_HOST", "0.0.0.0"),
            grpc_port: env.port("GRPC_PORT", 8081)?,
            grpc_uds: env.get("GRPC_UDS").map(PathBuf::from),
            grpc_max_connection_age: env
                .duration("GRPC_MAX_CONNECTION_AGE", Duration::from_secs(24 * 3600))?,
            grpc_max_connection_age_grace: env
                .duration("GRPC_MAX_CONNECTION_AGE_GRACE", Duration::from_secs(3600))?,
            grpc_tls,
            debug_host: env.string("DEBUG_HOST", "0.0.0.0"),
            debug_port: env.port("DEBUG_PORT", 6070)?,
            log_level,
            log_format,
            use_prometheus,
            prometheus_addr,
            prometheus_path,
            prometheus_response_time_ms: env
                .boolean("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", false)?,
            backend,
            cache_key_prefix,
            runtime: RuntimeSettings {
                root: env
                    .string("RUNTIME_ROOT", "/srv/runtime_data/current")
                    .into(),
                subdirectory: env.string("RUNTIME_SUBDIRECTORY", ""),
                app_directory: env.string("RUNTIME_APPDIRECTORY", "config"),
                watch_root: env.boolean("RUNTIME_WATCH_ROOT", true)?,
                ignore_dot_files: env.boolean("RUNTIME_IGNOREDOTFILES", false)?,
                merge_domains: env.boolean("MERGE_DOMAIN_CONFIG", false)?,
                ..RuntimeSettings::default()
            },
            healthy_with_at_least_one_config_loaded: env
                .boolean("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", false)?,
            force_start_without_initial_config: env
                .boolean("FORCE_START_WITHOUT_INITIAL_CONFIG", false)?,
            service: ServiceSettings {
                shadow_mode: env.boolean("SHADOW_MODE", false)?,
                quota_mode: env.boolean("QUOTA_MODE", false)?,
                near_limit_ratio,
                stop_increment_when_over_limit: env
                    .boolean("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", false)?,
                local_cache_size: env.integer(
                    "LOCAL_CACHE_SIZE_IN_BYTES",
                    0u64,
                    "a size in bytes (0 or more)",
                )?,
                response_headers,
                response_dynamic_metadata: env.boolean("RESPONSE_DYNAMIC_METADATA", false)?,
            },
            no_effect,
        })
    }

    /// The HTTP port's address, `HOST:PORT`.
    pub fn http_addr(&self) -> String {
        join_host_port(&self.host, self.port)
    }

    /// The gRPC port's address, `GRPC_HOST:GRPC_PORT`.
    pub fn grpc_addr(&self) -> String {
        join_host_port(&self.grpc_host, self.grpc_port)
    }

    /// The debug port's address, `DEBUG_HOST:DEBUG_PORT`.
    pub fn debug_addr(&self) -> String {
        join_host_port(&self.debug_host, self.debug_port)
    }

    /// The Prometheus listener's address (`PROMETHEUS_ADDR`, an empty host
    /// meaning every interface).
    pub fn prometheus_bind_addr(&self) -> String {
        match self.prometheus_addr.rsplit_once(':') {
            Some(("", port)) => format!("0.0.0.0:{port}"),
            _ => self.prometheus_addr.clone(),
        }
    }
}

/// Go's `net.JoinHostPort`: an IPv6 host in brackets.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn header_name<F: Fn(&str) -> Option<String>>(
    env: &Env<F>,
    var: &'static str,
    default: &str,
) -> Result<String, SettingsError> {
    let name = env.string(var, default);
    let valid = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if valid {
        Ok(name)
    } else {
        Err(unsupported(var, &format!("{name:?} is not a header name")))
    }
}

/// The store the variables choose.
fn backend<F: Fn(&str) -> Option<String>>(env: &Env<F>) -> Result<Backend, SettingsError> {
    let url = env.get("REDIS_URL");
    match env.get("BACKEND_TYPE").as_deref() {
        None => {}
        Some("redis") if url.is_none() => {
            return Err(unsupported(
                "REDIS_URL",
                "BACKEND_TYPE is redis but REDIS_URL is not set \
                 (leave both unset for the in-memory store)",
            ))
        }
        Some("redis") => {}
        Some("memory") => return Ok(Backend::Memory),
        Some("memcache") => {
            return Err(unsupported(
                "BACKEND_TYPE",
                "memcache is not supported here: redis, or memory (one instance)",
            ))
        }
        Some(other) => {
            return Err(unsupported(
                "BACKEND_TYPE",
                &format!("{other:?} is not a backend (redis, memory)"),
            ))
        }
    }
    let Some(url) = url else {
        return Ok(Backend::Memory);
    };

    let tls = env.boolean("REDIS_TLS", false)?;
    let tls_client = match (
        env.get("REDIS_TLS_CLIENT_CERT"),
        env.get("REDIS_TLS_CLIENT_KEY"),
    ) {
        (None, None) => None,
        (Some(cert), Some(key)) => Some((PathBuf::from(cert), PathBuf::from(key))),
        (Some(_), None) => {
            return Err(unsupported(
                "REDIS_TLS_CLIENT_KEY",
                "REDIS_TLS_CLIENT_CERT is set but not the key that goes with it",
            ))
        }
        (None, Some(_)) => {
            return Err(unsupported(
                "REDIS_TLS_CLIENT_CERT",
                "REDIS_TLS_CLIENT_KEY is set but not the certificate that goes with it",
            ))
        }
    };
    if env.boolean("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", false)? {
        return Err(unsupported(
            "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
            "Redis certificates are always verified here (give the CA with REDIS_TLS_CACERT)",
        ));
    }
    let tls_ca = env.get("REDIS_TLS_CACERT").map(PathBuf::from);
    let auth = env.get("REDIS_AUTH");
    let unix = match env
        .get("REDIS_SOCKET_TYPE")
        .map(|s| s.to_ascii_lowercase())
        .as_deref()
    {
        None => url.starts_with('/'),
        Some("unix") => true,
        Some("tcp") => false,
        Some(other) => {
            return Err(unsupported(
                "REDIS_SOCKET_TYPE",
                &format!("{other:?} is not a socket type (tcp, unix)"),
            ))
        }
    };
    let kind = env.string("REDIS_TYPE", "SINGLE").to_ascii_lowercase();
    let target = match kind.as_str() {
        "single" => RedisTarget::Single(redis_url("REDIS_URL", &url, unix, tls, auth.as_deref())?),
        "cluster" => RedisTarget::Cluster(
            url.split(',')
                .map(|a| redis_url("REDIS_URL", a, unix, tls, auth.as_deref()))
                .collect::<Result<_, _>>()?,
        ),
        "sentinel" => {
            if env.get("REDIS_SENTINEL_AUTH").is_some() {
                return Err(unsupported(
                    "REDIS_SENTINEL_AUTH",
                    "sentinels with a password are not supported here",
                ));
            }
            let mut parts = url.split(',');
            let master = parts.next().unwrap_or_default().trim().to_owned();
            let sentinels: Vec<String> = parts
                .map(|a| redis_url("REDIS_URL", a, unix, tls, auth.as_deref()))
                .collect::<Result<_, _>>()?;
            if master.is_empty() || sentinels.is_empty() {
                return Err(unsupported(
                    "REDIS_URL",
                    "REDIS_TYPE is sentinel: expected <master name>,<sentinel1>,...,<sentinelN>",
                ));
            }
            RedisTarget::Sentinel { master, sentinels }
        }
        other => {
            return Err(unsupported(
                "REDIS_TYPE",
                &format!("{other:?} is not a Redis type (single, sentinel, cluster)"),
            ))
        }
    };
    let pool_size: usize = env.integer("REDIS_POOL_SIZE", 10usize, "a pool size (1 or more)")?;
    if pool_size == 0 {
        return Err(unsupported(
            "REDIS_POOL_SIZE",
            "a pool needs at least one connection",
        ));
    }
    Ok(Backend::Redis(RedisSettings {
        target,
        pool_size,
        tls_ca,
        tls_client,
        timeout: env.duration("REDIS_TIMEOUT", Duration::from_secs(10))?,
        startup_initial_interval: env
            .duration("REDIS_STARTUP_INITIAL_INTERVAL", Duration::from_secs(1))?,
        startup_max_interval: env
            .duration("REDIS_STARTUP_MAX_INTERVAL", Duration::from_secs(30))?,
        startup_max_elapsed: env.duration("REDIS_STARTUP_MAX_ELAPSED_TIME", Duration::ZERO)?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(vars: &[(&str, &str)]) -> Result<Settings, SettingsError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Settings::from_lookup(move |k| map.get(k).cloned())
    }

    #[test]
    fn defaults_are_envoyproxys() {
        let s = settings(&[]).unwrap();
        assert_eq!(s.http_addr(), "0.0.0.0:8080");
        assert_eq!(s.grpc_addr(), "0.0.0.0:8081");
        assert_eq!(s.debug_addr(), "0.0.0.0:6070");
        assert_eq!(s.log_level, LogLevel::Warn);
        assert_eq!(s.log_format, LogFormat::Text);
        assert_eq!(s.backend, Backend::Memory);
        assert_eq!(
            s.runtime.config_dir(),
            PathBuf::from("/srv/runtime_data/current/config")
        );
        assert!(s.runtime.watch_root);
        assert_eq!(s.service.near_limit_ratio, 0.8);
        assert_eq!(s.prometheus_bind_addr(), "0.0.0.0:9090");
        assert_eq!(s.prometheus_path, "/metrics");
        assert_eq!(s.grpc_max_connection_age, Duration::from_secs(86_400));
        assert!(s.no_effect.is_empty());
    }

    #[test]
    fn istio_sample_environment() {
        let s = settings(&[
            ("LOG_LEVEL", "debug"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("USE_STATSD", "false"),
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("RUNTIME_WATCH_ROOT", "false"),
            ("RUNTIME_IGNOREDOTFILES", "true"),
        ])
        .unwrap();
        assert_eq!(s.log_level, LogLevel::Debug);
        let Backend::Redis(redis) = &s.backend else {
            panic!("redis expected")
        };
        assert_eq!(
            redis.target,
            RedisTarget::Single("redis://redis:6379".into())
        );
        assert_eq!(redis.pool_size, 10);
        assert_eq!(
            s.runtime.config_dir(),
            PathBuf::from("/data/ratelimit/config")
        );
        assert!(!s.runtime.watch_root);
        assert!(s.runtime.ignore_dot_files);
        assert_eq!(s.no_effect.len(), 1);
        assert_eq!(s.no_effect[0].0, "USE_STATSD");
    }

    #[test]
    fn redis_forms() {
        let target = |vars: &[(&str, &str)]| match settings(vars).unwrap().backend {
            Backend::Redis(r) => r.target,
            Backend::Memory => panic!("redis expected"),
        };
        assert_eq!(
            target(&[
                ("REDIS_URL", "h:1"),
                ("REDIS_AUTH", "p@ss"),
                ("REDIS_TLS", "true")
            ]),
            RedisTarget::Single("rediss://:p%40ss@h:1".into())
        );
        assert_eq!(
            target(&[("REDIS_URL", "h:1"), ("REDIS_AUTH", "user:pw")]),
            RedisTarget::Single("redis://user:pw@h:1".into())
        );
        assert_eq!(
            target(&[("REDIS_URL", "/run/redis.sock")]),
            RedisTarget::Single("redis+unix:///run/redis.sock".into())
        );
        assert_eq!(
            target(&[("REDIS_URL", "a:1,b:2"), ("REDIS_TYPE", "cluster")]),
            RedisTarget::Cluster(vec!["redis://a:1".into(), "redis://b:2".into()])
        );
        assert_eq!(
            target(&[
                ("REDIS_URL", "mymaster,a:1,b:2"),
                ("REDIS_TYPE", "SENTINEL")
            ]),
            RedisTarget::Sentinel {
                master: "mymaster".into(),
                sentinels: vec!["redis://a:1".into(), "redis://b:2".into()]
            }
        );
        assert_eq!(
            target(&[("REDIS_URL", "redis://x:9/2")]),
            RedisTarget::Single("redis://x:9/2".into())
        );
    }

    #[test]
    fn bad_values_name_their_variable() {
        for (vars, var) in [
            (&[("PORT", "http")][..], "PORT"),
            (&[("GRPC_PORT", "70000")][..], "GRPC_PORT"),
            (&[("DEBUG_PORT", "-1")][..], "DEBUG_PORT"),
            (&[("SHADOW_MODE", "yes")][..], "SHADOW_MODE"),
            (&[("LOG_LEVEL", "loud")][..], "LOG_LEVEL"),
            (&[("NEAR_LIMIT_RATIO", "x")][..], "NEAR_LIMIT_RATIO"),
            (&[("REDIS_URL", "nohost")][..], "REDIS_URL"),
            (
                &[("REDIS_URL", "h:1"), ("REDIS_TYPE", "ring")][..],
                "REDIS_TYPE",
            ),
            (
                &[("REDIS_URL", "master"), ("REDIS_TYPE", "sentinel")][..],
                "REDIS_URL",
            ),
            (
                &[("REDIS_URL", "h:1"), ("REDIS_POOL_SIZE", "0")][..],
                "REDIS_POOL_SIZE",
            ),
            (
                &[("REDIS_URL", "h:1"), ("REDIS_TIMEOUT", "10")][..],
                "REDIS_TIMEOUT",
            ),
            (&[("BACKEND_TYPE", "memcache")][..], "BACKEND_TYPE"),
            (
                &[("REDIS_URL", "h:1"), ("REDIS_TLS_CLIENT_CERT", "c.pem")][..],
                "REDIS_TLS_CLIENT_KEY",
            ),
            (&[("BACKEND_TYPE", "redis")][..], "REDIS_URL"),
            (
                &[("GRPC_SERVER_USE_TLS", "true")][..],
                "GRPC_SERVER_TLS_CERT",
            ),
            (&[("CONFIG_TYPE", "GRPC_XDS_SOTW")][..], "CONFIG_TYPE"),
            (&[("PROMETHEUS_ADDR", "9090")][..], "PROMETHEUS_ADDR"),
            (
                &[
                    ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
                    ("LIMIT_RESET_HEADER", "a b"),
                ][..],
                "LIMIT_RESET_HEADER",
            ),
        ] {
            let err = settings(vars).expect_err(var);
            assert_eq!(err.variable, var, "{vars:?}: {err}");
            assert!(err.to_string().starts_with(var));
        }
    }

    #[test]
    fn go_syntax() {
        assert_eq!(parse_go_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("300ms"), Some(Duration::from_millis(300)));
        assert_eq!(parse_go_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_go_duration("10"), None);
        assert_eq!(parse_go_duration("-1s"), None);
        assert_eq!(parse_go_duration("1x"), None);
        assert_eq!(parse_int("0x10"), Some(16));
        assert_eq!(parse_int("010"), Some(8));
        assert_eq!(parse_int("1_000"), Some(1000));
        assert_eq!(parse_int("-3"), Some(-3));
        assert_eq!(parse_int("3.0"), None);
        assert_eq!(parse_bool("True"), Some(true));
        assert_eq!(parse_bool("yes"), None);
    }

    #[test]
    fn masked_credentials() {
        let t = RedisTarget::Single("redis://u:secret@h:1".into());
        assert!(!format!("{t:?}").contains("secret"));
        assert!(!t.describe().contains("secret"));
    }
}
