//! The Redis store: one `FCALL` of the `lua/` library per decision over a
//! pooled connection (`EVALSHA` of the same code where Functions are missing).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use deadpool_redis::{Manager, Pool, Runtime};
use redis::Script;
use redis::{AsyncConnectionConfig, IntoConnectionInfo};
use smallvec::SmallVec;

use self::conn::{Conn, Connector, Lanes};
use super::sealed::Sealed;
use super::{keys, BoxFuture, Check, Deadline, MemoryStore, Store};
#[cfg(feature = "cluster")]
mod cluster;
mod conn;

use crate::algorithm::Reply;
use crate::clock::Clock;
use crate::{ConfigError, Error};

/// The decision code: the helpers, the algorithms, then the driver, which
/// defines `decide(keys, args)`.
const CODE: &str = concat!(
    include_str!("../../../lua/common.lua"),
    include_str!("../../../lua/sliding_log.lua"),
    include_str!("../../../lua/token_bucket.lua"),
    include_str!("../../../lua/gcra.lua"),
    include_str!("../../../lua/fixed_window.lua"),
    include_str!("../../../lua/sliding_window.lua"),
    include_str!("../../../lua/driver.lua"),
);

/// How the decision code reaches Redis: as a Function library loaded once
/// per server (`FCALL`, Redis 7 and later), or as a script (`EVALSHA`).
///
/// The function is flagged `allow-oom`: a Function without it is refused as
/// a whole whenever Redis is over `maxmemory` and eviction cannot bring it
/// under (the library's own memory, clients and buffers count too), which
/// would turn memory pressure into an outage of every limit. Its writes are
/// small, carry TTLs and stay subject to the eviction policy, as a script's
/// writes are.
struct Delivery {
    /// `FUNCTION LOAD` source. Library and function are named after the
    /// code's SHA1, so instances running different versions of this crate
    /// on one Redis (a rolling deploy) each call their own.
    library: String,
    function: String,
    /// The same code as a script, for servers without Functions.
    script: Script,
}

static DELIVERY: LazyLock<Delivery> = LazyLock::new(|| {
    let script = Script::new(&format!("{CODE}\nreturn decide(KEYS, ARGV)\n"));
    let code = Script::new(CODE);
    let function = format!("tower_ratelimit_{}", &code.get_hash()[..16]);
    Delivery {
        library: format!(
            "#!lua name={function}\n{CODE}\n\
             redis.register_function{{function_name = '{function}', callback = decide, flags = {{ 'allow-oom' }}}}\n"
        ),
        function,
        script,
    }
});

/// What one call of the library does (op 0, 1 or 2 of its options).
#[derive(Clone, Copy)]
enum Operation {
    /// Decide, reserving up to `max_wait` us ahead; a `dry` run grants nothing.
    Decide { max_wait: i64, dry: bool },
    /// Give back the grants made at store time `at`.
    Refund { at: i64 },
    /// Take what is available, at most each check's cost.
    Take,
}

/// One call's keys and arguments, written into one buffer.
struct Encoded {
    buf: Vec<u8>,
    keys: SmallVec<[Range<usize>; 2]>,
    args: SmallVec<[Range<usize>; 2]>,
}

impl Encoded {
    fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.keys.iter().filter_map(|r| self.buf.get(r.clone()))
    }

    fn args(&self) -> impl Iterator<Item = &[u8]> {
        self.args.iter().filter_map(|r| self.buf.get(r.clone()))
    }

    /// Where the hash tag lies in the key written at `key`: after the
    /// prefix and its colon, up to and including the first `}` (escaped
    /// tags hold no other).
    fn tag_of(&self, key: Range<usize>, prefix: usize) -> Range<usize> {
        let start = key.start + prefix + 1;
        let end = self
            .buf
            .get(start..key.end)
            .and_then(|rest| rest.iter().position(|&b| b == b'}'))
            .map_or(key.end, |i| start + i + 1);
        start..end
    }
}

/// How long a cluster connection may leave a command unanswered before it
/// is considered broken (redis-rs' default is 500 ms, which a loaded machine
/// reaches without anything being broken). Single-server connections have
/// none: every command they carry is bounded by the limiter's own timeout,
/// which also discards a connection that answers nothing (see `conn`), and
/// a second timer per command costs CPU on every decision.
#[cfg(feature = "cluster")]
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long decisions run as scripts after a failed `FUNCTION LOAD`.
const LOAD_RETRY: Duration = Duration::from_secs(10);

/// [`Inner::mode`]: Functions untried, in use, or missing on this server.
const UNTRIED: u8 = 0;
const FUNCTIONS: u8 = 1;
const SCRIPTS: u8 = 2;

struct Inner {
    prefix: String,
    /// `UNTRIED`, `FUNCTIONS` or `SCRIPTS`.
    mode: AtomicU8,
    /// Held while the library is loaded: one `FUNCTION LOAD` at a time, the
    /// other decisions wait for it rather than each compiling the library.
    loading: tokio::sync::Mutex<()>,
    /// After a failed `FUNCTION LOAD` (say, Redis over `maxmemory` refuses
    /// it), decisions run as scripts until then, and the load is tried again.
    scripts_until: Mutex<Option<tokio::time::Instant>>,
    /// Whether `scripts_until` may hold a time: read by every decision, so
    /// that the common one takes no lock.
    load_failed: AtomicBool,
    /// The connections, and what replaces them when they fail.
    lanes: Arc<Lanes>,
    clock: Option<Arc<dyn Clock>>,
    /// Microseconds keys outlive their state.
    slack: i64,
    /// Decides while Redis fails (see `Sealed::fallback`); made on first use.
    fallback: OnceLock<MemoryStore>,
    quotas: super::QuotaRegistry,
}

/// Limit state in Redis, shared by every instance that uses the same Redis
/// and prefix. Each decision is one `FCALL` of a Redis Function library
/// (loaded again automatically when a server lacks it; on Redis before 7.0,
/// one `EVALSHA` of the same code); the code reads the clock with `TIME`, so
/// instances with skewed clocks agree.
///
/// Under `maxmemory`, the loaded function keeps deciding (it is flagged
/// `allow-oom`; its keys are small, expire, and follow the eviction policy).
/// Loading it is a write, which Redis refuses while it is over `maxmemory`
/// and cannot evict: then decisions run as scripts, and the load is tried
/// again ten seconds later.
///
/// # Failures
///
/// Connections are made in the background, never inside a decision's time.
/// A connection that breaks, is closed by the server, answers `READONLY` (a
/// demoted master) or goes silent (a decision abandoned at its timeout with
/// nothing received on it since it was sent) is replaced; a decision whose
/// connection the server had closed is sent again on another (it may count
/// twice, never admit more). After three failures in a row the circuit opens:
/// decisions fail at once with [`Error::Unavailable`] while a background task
/// reconnects, 25 to 250 ms apart, until a new connection answers `PING`.
///
/// # Cluster
///
/// On a cluster ([`RedisStore::cluster_builder`]) each decision runs on the
/// primary of its keys' slot. The limits of one decision whose keys live in
/// different slots are decided slot by slot, in parallel, each atomically;
/// when one slot refuses, what the others granted is given back, so the
/// request counts everywhere or nowhere. Until that refund lands (one round
/// trip), the permit is seen as taken: another request may be refused for
/// it, none is admitted by it. Across slots nothing is reserved ahead (a
/// decision with a `max_wait`): it grants what every slot can grant now, or
/// refuses with the wait until all could. A [`Grant`](crate::Grant) given
/// back across slots returns bucket and window grants exactly; a sliding log
/// finds its entry only in slots that decided at the decision's microsecond.
/// One node's failure does not open the circuit: its slots fail (within the
/// timeout) until a replica is promoted, the others keep deciding.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_ratelimit::{Limit, Limiter, Quota, RedisStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::builder("redis://127.0.0.1:6379").prefix("myapp-rl").build()?;
/// let limit = Limit::new("login", Quota::gcra(5, Duration::from_secs(60), 5))?;
/// let limiter = Limiter::new(store, limit);
/// let decision = limiter.check("user-42", 1).await?;
/// # let _ = decision; Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("lanes", &self.inner.lanes.len())
            .finish()
    }
}

/// What a store connects to.
#[derive(Clone)]
enum Target {
    Url(String),
    Pool(Pool),
    #[cfg(feature = "cluster")]
    Cluster(Vec<String>),
    #[cfg(feature = "sentinel")]
    Sentinel {
        urls: Vec<String>,
        master: String,
    },
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Url(url) => f.debug_tuple("Url").field(&redacted(url)).finish(),
            Target::Pool(_) => f.write_str("Pool"),
            #[cfg(feature = "cluster")]
            Target::Cluster(urls) => f
                .debug_tuple("Cluster")
                .field(&urls.iter().map(|u| redacted(u)).collect::<Vec<_>>())
                .finish(),
            #[cfg(feature = "sentinel")]
            Target::Sentinel { urls, master } => f
                .debug_struct("Sentinel")
                .field(
                    "urls",
                    &urls.iter().map(|u| redacted(u)).collect::<Vec<_>>(),
                )
                .field("master", master)
                .finish(),
        }
    }
}

/// A URL without its password, for `Debug`.
fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// Configures a [`RedisStore`].
#[derive(Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    target: Target,
    prefix: String,
    lanes: usize,
    clock: Option<Arc<dyn Clock>>,
    slack: Duration,
    #[cfg(feature = "tls")]
    root_certificate: Option<Vec<u8>>,
}

impl std::fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("target", &self.target)
            .field("prefix", &self.prefix)
            .field("lanes", &self.lanes)
            .finish()
    }
}

impl RedisStoreBuilder {
    fn new(target: Target) -> Self {
        RedisStoreBuilder {
            target,
            prefix: "rl".into(),
            lanes: 2,
            clock: None,
            slack: Duration::ZERO,
            #[cfg(feature = "tls")]
            root_certificate: None,
        }
    }

    /// The prefix of every key (default `"rl"`). Instances share limits when
    /// they share the Redis and the prefix.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How many connections to keep (default 2, at least 1). Decisions are
    /// multiplexed over the first that works, so that concurrent decisions
    /// share its writes and reads; the others stand by and take over at once
    /// when it breaks or goes silent, while a new one is made in the
    /// background. On a cluster, each is a cluster connection, which holds
    /// one connection per node.
    pub fn lanes(mut self, lanes: usize) -> Self {
        self.lanes = lanes;
        self
    }

    /// Uses this clock instead of Redis `TIME`: for tests that drive time, or
    /// for deployments that trust the application clocks more than Redis'.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Lets every key live this much longer than its state needs (default:
    /// none). Decisions never depend on it: every state records when it
    /// becomes equal to a fresh one and reads as absent from then on, so a
    /// key's expiry only reclaims memory. A slack keeps keys whose state is
    /// stamped by clocks other than Redis' (see [`clock`](Self::clock)) from
    /// being reclaimed early when those clocks step or run ahead.
    pub fn expiry_slack(mut self, slack: Duration) -> Self {
        self.slack = slack;
        self
    }

    /// Trusts this CA certificate (PEM) for `rediss://` connections, in
    /// addition to the system's roots: for servers whose certificates a
    /// private CA signed. Not used with [`RedisStore::builder_with_pool`],
    /// whose pool makes its own connections.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.root_certificate = Some(pem.into());
        self
    }

    #[cfg(feature = "tls")]
    fn certificates(&self) -> Option<redis::TlsCertificates> {
        self.root_certificate
            .as_ref()
            .map(|pem| redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            })
    }

    /// Builds the store. No connection is made until the first decision.
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        let valid_prefix = !self.prefix.is_empty()
            && !self.prefix.contains(['{', '}'])
            && !self.prefix.chars().any(char::is_whitespace);
        if !valid_prefix {
            return Err(ConfigError::InvalidPrefix(self.prefix));
        }
        if self.slack > Duration::from_secs(10 * 366 * 86_400) {
            return Err(ConfigError::Redis(
                "the expiry slack must not exceed ten years".into(),
            ));
        }
        if self.lanes == 0 {
            return Err(ConfigError::Redis("at least one lane is needed".into()));
        }
        let connector = self.connector()?;
        if let Some(max) = connector.capacity() {
            if max < self.lanes {
                return Err(ConfigError::Redis(format!(
                    "the pool holds at most {max} connections, fewer than the {} lanes",
                    self.lanes
                )));
            }
        }
        Ok(RedisStore {
            inner: Arc::new(Inner {
                prefix: self.prefix,
                mode: AtomicU8::new(UNTRIED),
                loading: tokio::sync::Mutex::new(()),
                scripts_until: Mutex::new(None),
                load_failed: AtomicBool::new(false),
                lanes: Lanes::new(connector, self.lanes),
                clock: self.clock,
                slack: i64::try_from(self.slack.as_micros()).unwrap_or(i64::MAX / 4),
                fallback: OnceLock::new(),
                quotas: Default::default(),
            }),
        })
    }

    /// No response timeout in redis-rs: every command is bounded by the
    /// limiter's timeout (connection attempts by [`conn::CONNECT_TIMEOUT`]),
    /// and a connection that leaves a request unanswered that long is
    /// discarded by the lanes.
    fn connection_config() -> AsyncConnectionConfig {
        AsyncConnectionConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(conn::CONNECT_TIMEOUT))
    }

    fn connector(&self) -> Result<Connector, ConfigError> {
        // redis-rs builds its TLS configuration from the process's default
        // rustls provider: ring, unless the application installed another
        #[cfg(feature = "tls")]
        let _ = rustls::crypto::ring::default_provider().install_default();
        let invalid = |e: redis::RedisError| ConfigError::Redis(e.to_string());
        Ok(match &self.target {
            Target::Pool(pool) => Connector::Pool(pool.clone()),
            Target::Url(url) => {
                #[cfg(feature = "tls")]
                let info = match self.certificates() {
                    Some(certs) => redis::Client::build_with_tls(url.as_str(), certs)
                        .map_err(invalid)?
                        .get_connection_info()
                        .clone(),
                    None => url.as_str().into_connection_info().map_err(invalid)?,
                };
                #[cfg(not(feature = "tls"))]
                let info = url.as_str().into_connection_info().map_err(invalid)?;
                reject_unsupported(&info)?;
                let manager =
                    Manager::new_with_config(info, Self::connection_config()).map_err(invalid)?;
                // The lanes keep their connections; the rest of the pool is
                // headroom while broken ones are replaced.
                let pool = Pool::builder(manager)
                    .max_size(2 * self.lanes)
                    .runtime(Runtime::Tokio1)
                    .build()
                    .map_err(|e| ConfigError::Redis(e.to_string()))?;
                Connector::Pool(pool)
            }
            #[cfg(feature = "cluster")]
            Target::Cluster(urls) => {
                if urls.is_empty() {
                    return Err(ConfigError::Redis(
                        "a cluster needs at least one seed URL".into(),
                    ));
                }
                let mut infos = Vec::with_capacity(urls.len());
                for url in urls {
                    let info = url.as_str().into_connection_info().map_err(invalid)?;
                    reject_unsupported(&info)?;
                    infos.push(info);
                }
                let builder = redis::cluster::ClusterClientBuilder::new(infos)
                    .connection_timeout(conn::CONNECT_TIMEOUT)
                    .response_timeout(RESPONSE_TIMEOUT)
                    // redis-rs waits 1.28 s and more between retries (a
                    // failover, TRYAGAIN while a slot moves); a decision is
                    // bounded far sooner, so it retries within that bound
                    .retries(8)
                    .min_retry_wait(5)
                    .max_retry_wait(100)
                    .retry_wait_formula(10, 2);
                #[cfg(feature = "tls")]
                let builder = match self.certificates() {
                    Some(certs) => builder.certs(certs),
                    None => builder,
                };
                Connector::Cluster(builder.build().map_err(invalid)?)
            }
            #[cfg(feature = "sentinel")]
            Target::Sentinel { urls, master } => {
                use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
                let first = urls.first().ok_or_else(|| {
                    ConfigError::Redis("Sentinel needs at least one sentinel URL".into())
                })?;
                let mut addrs = Vec::with_capacity(urls.len());
                for url in urls {
                    let info = url.as_str().into_connection_info().map_err(invalid)?;
                    reject_unsupported(&info)?;
                    addrs.push(info.addr().clone());
                }
                let first = first.as_str().into_connection_info().map_err(invalid)?;
                let redis_info = first.redis_settings();
                let mut builder =
                    SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)
                        .map_err(invalid)?
                        .set_client_to_redis_db(redis_info.db());
                if let Some(user) = redis_info.username() {
                    builder = builder.set_client_to_redis_username(user);
                }
                if let Some(password) = redis_info.password() {
                    builder = builder.set_client_to_redis_password(password);
                }
                if let redis::ConnectionAddr::TcpTls { insecure, .. } = first.addr() {
                    let mode = if *insecure {
                        redis::TlsMode::Insecure
                    } else {
                        redis::TlsMode::Secure
                    };
                    builder = builder.set_client_to_redis_tls_mode(mode);
                    #[cfg(feature = "tls")]
                    if let Some(certs) = self.certificates() {
                        builder = builder
                            .set_client_to_redis_certificates(certs.clone())
                            .set_client_to_sentinel_certificates(certs);
                    }
                }
                Connector::Sentinel {
                    client: tokio::sync::Mutex::new(builder.build().map_err(invalid)?),
                    config: Self::connection_config(),
                }
            }
        })
    }
}

/// Refuses a `rediss://` URL in a build without the `tls` feature, at build
/// time rather than at the first decision.
fn reject_unsupported(info: &redis::ConnectionInfo) -> Result<(), ConfigError> {
    if matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) && !cfg!(feature = "tls") {
        return Err(ConfigError::Redis(
            "rediss:// URLs need the crate's `tls` feature".into(),
        ));
    }
    Ok(())
}

impl RedisStore {
    /// Configures a store for one Redis server, at a URL such as
    /// `redis://127.0.0.1:6379/0`, or `rediss://` for TLS (with the `tls`
    /// feature).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(Target::Url(url.into()))
    }

    /// Configures a store over an existing deadpool-redis pool, whose size must
    /// be at least the number of lanes.
    pub fn builder_with_pool(pool: Pool) -> RedisStoreBuilder {
        RedisStoreBuilder::new(Target::Pool(pool))
    }

    /// Configures a store on a Redis Cluster, found through these seed nodes
    /// (any reachable one is enough; list several). Each decision runs on the
    /// primary of its keys' slot; limits of one request whose keys live in
    /// different slots are decided slot by slot, in parallel, and what one
    /// slot granted is given back when another refuses (see [`RedisStore`]).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), tower_ratelimit::ConfigError> {
    /// let store = tower_ratelimit::RedisStore::cluster_builder([
    ///     "redis://10.0.0.1:6379",
    ///     "redis://10.0.0.2:6379",
    ///     "redis://10.0.0.3:6379",
    /// ])
    /// .prefix("myapp-rl")
    /// .build()?;
    /// # let _ = store; Ok(()) }
    /// ```
    #[cfg(feature = "cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
    pub fn cluster_builder<I>(seeds: I) -> RedisStoreBuilder
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        RedisStoreBuilder::new(Target::Cluster(seeds.into_iter().map(Into::into).collect()))
    }

    /// Configures a store on the master that Redis Sentinel names `master`,
    /// asking these sentinels (list several). Every new connection asks
    /// them again, so the store follows a failover: connections to a master
    /// that died or became a replica are replaced. The database, user and
    /// password of the first URL are those of the master; a `rediss://`
    /// first URL makes the master connections TLS too.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), tower_ratelimit::ConfigError> {
    /// let store = tower_ratelimit::RedisStore::sentinel_builder(
    ///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
    ///     "mymaster",
    /// )
    /// .build()?;
    /// # let _ = store; Ok(()) }
    /// ```
    #[cfg(feature = "sentinel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
    pub fn sentinel_builder<I>(sentinels: I, master: impl Into<String>) -> RedisStoreBuilder
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        RedisStoreBuilder::new(Target::Sentinel {
            urls: sentinels.into_iter().map(Into::into).collect(),
            master: master.into(),
        })
    }

    /// A store for `url` with the default settings.
    pub fn new(url: impl Into<String>) -> Result<Self, ConfigError> {
        Self::builder(url).build()
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The name of the Redis Function that decides (what `FCALL` calls); its
    /// library has the same name.
    pub fn function_name() -> &'static str {
        &DELIVERY.function
    }

    /// The SHA1 of the same code as a script (what `EVALSHA` sends where
    /// Redis has no Functions).
    pub fn script_hash() -> &'static str {
        DELIVERY.script.get_hash()
    }

    /// The Redis keys that hold the state of one check, whose key escapes
    /// to `tag` (see [`keys::tag`]).
    fn keys(&self, check: &Check<'_>, tag: &str) -> Vec<String> {
        let (prefix, name) = (&self.inner.prefix, check.limit.name());
        let parts = check.limit.params().algorithm.key_parts();
        parts
            .iter()
            .map(|part| {
                let len = prefix.len() + tag.len() + name.len() + part.len() + 3;
                let mut key = String::with_capacity(len);
                for piece in [prefix.as_str(), ":", tag, ":", name, ":", *part] {
                    key.push_str(piece);
                }
                key
            })
            .collect()
    }

    async fn run_decide(
        &self,
        checks: &[Check<'_>],
        max_wait: i64,
        dry: bool,
        deadline: Deadline,
    ) -> Result<Reply, Error> {
        #[cfg(feature = "cluster")]
        if self.inner.lanes.is_cluster() {
            if let Some(groups) = cluster::slot_groups(checks) {
                // boxed: the common decision's future stays small
                return Box::pin(self.decide_across_slots(checks, &groups, dry, deadline)).await;
            }
        }
        self.decide_group(checks, max_wait, dry, deadline).await
    }

    /// One decision over checks whose keys share a slot: one call.
    async fn decide_group(
        &self,
        checks: &[Check<'_>],
        max_wait: i64,
        dry: bool,
        deadline: Deadline,
    ) -> Result<Reply, Error> {
        let encoded = self.encode(checks, Operation::Decide { max_wait, dry });
        let packed = self.invoke(&encoded, deadline).await?;
        Reply::from_packed(&packed, checks.len()).ok_or_else(|| {
            Error::UnexpectedReply(format!(
                "{} bytes for {} limits",
                packed.len(),
                checks.len()
            ))
        })
    }

    /// The keys and arguments of one call of the library (see the header of
    /// `lua/driver.lua`): every key of every check, the options when they
    /// differ from a plain decision's, then each limit with its cost, written
    /// into one buffer.
    fn encode(&self, checks: &[Check<'_>], operation: Operation) -> Encoded {
        let prefix = self.inner.prefix.as_bytes();
        let mut out = Encoded {
            buf: Vec::with_capacity(checks.iter().map(|c| 2 * c.key.len() + 96).sum()),
            keys: SmallVec::new(),
            args: SmallVec::new(),
        };
        for (i, check) in checks.iter().enumerate() {
            // limits of one request often share its key: escape it once
            let shared = i > 0 && checks[i - 1].key == check.key;
            let tag = match (shared, out.keys.last()) {
                (true, Some(last)) => Some(out.tag_of(last.clone(), prefix.len())),
                _ => None,
            };
            let name = check.limit.name().as_bytes();
            for part in check.limit.params().algorithm.key_parts() {
                let start = out.buf.len();
                out.buf.extend_from_slice(prefix);
                out.buf.push(b':');
                match &tag {
                    Some(range) => out.buf.extend_from_within(range.clone()),
                    None => keys::write_tag(&mut out.buf, check.key),
                }
                out.buf.push(b':');
                out.buf.extend_from_slice(name);
                out.buf.push(b':');
                out.buf.extend_from_slice(part.as_bytes());
                out.keys.push(start..out.buf.len());
            }
        }
        let now = self.inner.clock.as_ref().map_or(0, |c| c.now_micros());
        let slack = self.inner.slack;
        let start = out.buf.len();
        let mut digits = itoa::Buffer::new();
        let mut options = |out: &mut Encoded, fields: &[i64]| {
            out.buf.push(b'o');
            for field in fields {
                out.buf.push(b':');
                out.buf.extend_from_slice(digits.format(*field).as_bytes());
            }
            out.args.push(start..out.buf.len());
        };
        match operation {
            // The options travel only when one differs from the production default.
            Operation::Decide { max_wait, dry } => {
                if (now, max_wait, dry, slack) != (0, 0, false, 0) {
                    options(&mut out, &[now, max_wait, i64::from(dry), slack]);
                }
            }
            Operation::Refund { at } => options(&mut out, &[now, 0, 0, slack, 1, at]),
            Operation::Take => options(&mut out, &[now, 0, 0, slack, 2, 0]),
        }
        let mut digits = itoa::Buffer::new();
        for check in checks {
            let start = out.buf.len();
            out.buf.extend_from_slice(check.limit.wire().as_bytes());
            out.buf
                .extend_from_slice(digits.format(check.cost).as_bytes());
            out.args.push(start..out.buf.len());
        }
        out
    }

    /// Runs the library's function with these keys and arguments over a
    /// lane's connection: the one way every operation reaches Redis.
    async fn invoke(&self, encoded: &Encoded, deadline: Deadline) -> Result<Vec<u8>, Error> {
        self.inner
            .lanes
            .run(deadline, |mut conn| async move {
                self.call(&mut conn, encoded).await
            })
            .await
    }

    /// Runs the decision code: `FCALL`, loading the library when the server
    /// lacks it (a new server, a flushed one, a promoted replica), or
    /// `EVALSHA` on a server without Functions (before Redis 7).
    ///
    /// Only the common path, one `FCALL` that finds the library, lives in
    /// this future; loading the library and `EVALSHA` are boxed in
    /// [`call_slowly`](Self::call_slowly), so that every decision's future
    /// (which holds this one) stays small: it is moved and allocated per
    /// decision.
    async fn call(&self, conn: &mut Conn, encoded: &Encoded) -> redis::RedisResult<Vec<u8>> {
        let mode = self.inner.mode.load(Ordering::Relaxed);
        if mode == SCRIPTS || self.load_failed_lately() {
            return Box::pin(self.call_slowly(conn, encoded, None)).await;
        }
        let delivery = &*DELIVERY;
        // sized up front: growing the command's buffers argument by
        // argument reallocated three times per decision
        let count = encoded.keys.len() + encoded.args.len();
        let data = encoded.buf.len() + delivery.function.len() + 32;
        let mut fcall = redis::Cmd::with_capacity(count + 3, data);
        fcall
            .arg("FCALL")
            .arg(&delivery.function)
            .arg(encoded.keys.len());
        for arg in encoded.keys().chain(encoded.args()) {
            fcall.arg(arg);
        }
        match conn.query::<Vec<u8>>(&fcall).await {
            Ok(values) => {
                // written once, not by every decision: a store to the line
                // that every thread reads
                if mode != FUNCTIONS {
                    self.inner.mode.store(FUNCTIONS, Ordering::Relaxed);
                }
                Ok(values)
            }
            Err(e) if is_missing_function(&e) || is_unknown_command(&e) => {
                Box::pin(self.call_slowly(conn, encoded, Some((fcall, e)))).await
            }
            Err(e) => Err(e),
        }
    }

    /// [`call`](Self::call) after its `FCALL` failed (`failed`: the command
    /// and its error) for want of the library or of Functions, or at once
    /// while the store decides with `EVALSHA`.
    async fn call_slowly(
        &self,
        conn: &mut Conn,
        encoded: &Encoded,
        failed: Option<(redis::Cmd, redis::RedisError)>,
    ) -> redis::RedisResult<Vec<u8>> {
        let delivery = &*DELIVERY;
        match failed {
            Some((fcall, e)) if is_missing_function(&e) => {
                let _loading = self.inner.loading.lock().await;
                // another decision may have loaded it while this one waited
                match fcall.query_async::<Vec<u8>>(conn).await {
                    Err(e) if is_missing_function(&e) => {}
                    done => return done,
                }
                tracing::debug!(target: "tower_ratelimit", library = %delivery.function, "loading the decision library");
                let loaded = redis::cmd("FUNCTION")
                    .arg("LOAD")
                    .arg(&delivery.library)
                    .query_async::<String>(conn)
                    .await;
                match loaded {
                    // loaded, or another process loaded it first
                    Ok(_) => return fcall.query_async(conn).await,
                    Err(e) if e.to_string().contains("already exists") => {
                        return fcall.query_async(conn).await
                    }
                    Err(e) => {
                        tracing::warn!(target: "tower_ratelimit", error = %e, "cannot load the decision library; deciding with EVALSHA for {LOAD_RETRY:?}");
                        *lock(&self.inner.scripts_until) =
                            Some(tokio::time::Instant::now() + LOAD_RETRY);
                        self.inner.load_failed.store(true, Ordering::Relaxed);
                    }
                }
            }
            Some(_) => {
                tracing::info!(target: "tower_ratelimit", "Redis has no Functions (before 7.0): deciding with EVALSHA");
                self.inner.mode.store(SCRIPTS, Ordering::Relaxed);
            }
            None => {}
        }
        let mut invocation = delivery.script.prepare_invoke();
        for key in encoded.keys() {
            invocation.key(key);
        }
        for arg in encoded.args() {
            invocation.arg(arg);
        }
        invocation.invoke_async(conn).await
    }

    async fn run_reset(&self, checks: &[Check<'_>], deadline: Deadline) -> Result<(), Error> {
        let mut cmd = redis::cmd("DEL");
        for check in checks {
            for key in self.keys(check, &keys::tag(check.key)) {
                cmd.arg(key);
            }
        }
        let cmd = &cmd;
        self.inner
            .lanes
            .run(deadline, |mut conn| async move {
                cmd.query_async::<()>(&mut conn).await
            })
            .await?;
        Ok(())
    }
}

impl RedisStore {
    /// Gives back each check's grant made at store time `at`: the library's
    /// refund operation (op 1 of the options, see `lua/driver.lua`), in one
    /// call through [`invoke`](Self::invoke).
    async fn run_refund(
        &self,
        checks: &[Check<'_>],
        at: i64,
        deadline: Deadline,
    ) -> Result<(), Error> {
        #[cfg(feature = "cluster")]
        if self.inner.lanes.is_cluster() {
            if let Some(groups) = cluster::slot_groups(checks) {
                return self
                    .refund_across_slots(checks, &groups, at, deadline)
                    .await;
            }
        }
        self.refund_group(checks, at, deadline).await
    }

    /// A refund of checks whose keys share a slot: one call.
    async fn refund_group(
        &self,
        checks: &[Check<'_>],
        at: i64,
        deadline: Deadline,
    ) -> Result<(), Error> {
        let encoded = self.encode(checks, Operation::Refund { at });
        self.invoke(&encoded, deadline).await?;
        Ok(())
    }

    /// Takes what is available, at most the checks' cost: the library's
    /// take operation (op 2, see `lua/driver.lua`), in one call through
    /// [`invoke`](Self::invoke).
    async fn run_take(
        &self,
        checks: &[Check<'_>],
        deadline: Deadline,
    ) -> Result<(Reply, i64), Error> {
        let encoded = self.encode(checks, Operation::Take);
        let packed = self.invoke(&encoded, deadline).await?;
        Reply::from_packed_take(&packed, checks.len()).ok_or_else(|| {
            Error::UnexpectedReply(format!(
                "{} bytes for taking from {} limits",
                packed.len(),
                checks.len()
            ))
        })
    }
}

impl RedisStore {
    /// Whether a recent `FUNCTION LOAD` failed, so decisions run as scripts.
    fn load_failed_lately(&self) -> bool {
        if !self.inner.load_failed.load(Ordering::Relaxed) {
            return false;
        }
        let mut until = lock(&self.inner.scripts_until);
        match *until {
            Some(at) if tokio::time::Instant::now() < at => true,
            Some(_) => {
                *until = None;
                self.inner.load_failed.store(false, Ordering::Relaxed);
                false
            }
            None => false,
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn is_missing_function(e: &redis::RedisError) -> bool {
    e.to_string().contains("Function not found")
}

fn is_unknown_command(e: &redis::RedisError) -> bool {
    let text = e.to_string();
    text.contains("unknown command") && (text.contains("FCALL") || text.contains("fcall"))
}

impl Store for RedisStore {}

impl Sealed for RedisStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
        deadline: Deadline,
    ) -> BoxFuture<'a, Result<Reply, Error>> {
        Box::pin(self.run_decide(checks, max_wait, dry, deadline))
    }

    fn reset<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        deadline: Deadline,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.run_reset(checks, deadline))
    }

    fn refund<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        at: i64,
        deadline: Deadline,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.run_refund(checks, at, deadline))
    }

    fn take<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        deadline: Deadline,
    ) -> BoxFuture<'a, Result<(Reply, i64), Error>> {
        Box::pin(self.run_take(checks, deadline))
    }

    fn clock(&self) -> Option<Arc<dyn Clock>> {
        self.inner.clock.clone()
    }

    fn remote(&self) -> bool {
        true
    }

    fn fallback(&self) -> Option<MemoryStore> {
        Some(self.inner.fallback.get_or_init(MemoryStore::new).clone())
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn quotas(&self) -> Option<&super::QuotaRegistry> {
        Some(&self.inner.quotas)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Limit, Quota};

    /// One buffer holds what the reset's key names and the limits' wire
    /// strings say, in order, with a key's tag written once and reused.
    #[test]
    fn encoded_keys_and_arguments_name_every_key_of_every_check() {
        let store = RedisStore::builder("redis://127.0.0.1:1/")
            .prefix("p")
            .build()
            .expect("store");
        let minute = Duration::from_secs(60);
        let log = Limit::new("log", Quota::sliding_log(3, minute)).expect("limit");
        let gcra = Limit::new("g", Quota::gcra(1, minute, 2)).expect("limit");
        let keys: [&[u8]; 3] = [b"a}:{b", b"a}:{b", b"x"];
        let checks = [
            Check {
                limit: &log,
                key: keys[0],
                cost: 1,
            },
            Check {
                limit: &gcra,
                key: keys[1],
                cost: 1,
            },
            Check {
                limit: &gcra,
                key: keys[2],
                cost: 2,
            },
        ];
        let encoded = store.encode(
            &checks,
            Operation::Decide {
                max_wait: 0,
                dry: false,
            },
        );
        let expected: Vec<String> = checks
            .iter()
            .flat_map(|c| store.keys(c, &keys::tag(c.key)))
            .collect();
        let got: Vec<&[u8]> = encoded.keys().collect();
        assert_eq!(
            got,
            expected.iter().map(String::as_bytes).collect::<Vec<_>>()
        );
        assert_eq!(got[0], b"p:{a%7D:%7Bb}:log:log");
        let args: Vec<&[u8]> = encoded.args().collect();
        let wire = |l: &Limit, cost: &str| format!("{}{cost}", l.wire()).into_bytes();
        assert_eq!(args, [wire(&log, "1"), wire(&gcra, "1"), wire(&gcra, "2")]);
        let refund = store.encode(&checks[2..], Operation::Refund { at: 7 });
        let args: Vec<&[u8]> = refund.args().collect();
        assert_eq!(args, [b"o:0:0:0:0:1:7".to_vec(), wire(&gcra, "2")]);
    }
}
