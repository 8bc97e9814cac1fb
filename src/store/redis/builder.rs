//! Configuring a [`RedisStore`]: what it connects to (one server, a
//! cluster, Sentinel), with what prefix, lanes, clock and certificates.

use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::{Manager, Pool, Runtime};
use redis::{AsyncConnectionConfig, IntoConnectionInfo};

use super::batch::Coalescer;
use super::conn::Lanes;
use super::connector::Connector;
use super::encode::Encoder;
use super::fleet::Heartbeat;
use super::script::Library;
use super::{Inner, RedisStore};
use crate::clock::Clock;
use crate::ConfigError;

/// How long a cluster connection may leave a command unanswered before it
/// is considered broken (redis-rs' default is 500 ms, which a loaded machine
/// reaches without anything being broken). Single-server connections have
/// none: every command they carry is bounded by the limiter's own timeout,
/// which also discards a connection that answers nothing (see `conn`), and
/// a second timer per command costs CPU on every decision.
#[cfg(feature = "cluster")]
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// What a store connects to.
#[derive(Clone)]
pub(super) enum Target {
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
    coalesce: bool,
    heartbeat: Duration,
    #[cfg(feature = "tls")]
    root_certificate: Option<Vec<u8>>,
    #[cfg(feature = "tls")]
    client_identity: Option<(Vec<u8>, Vec<u8>)>,
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
    pub(super) fn new(target: Target) -> Self {
        RedisStoreBuilder {
            target,
            prefix: "rl".into(),
            lanes: 2,
            clock: None,
            slack: Duration::ZERO,
            coalesce: true,
            heartbeat: super::fleet::DEFAULT_HEARTBEAT,
            #[cfg(feature = "tls")]
            root_certificate: None,
            #[cfg(feature = "tls")]
            client_identity: None,
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

    /// Whether decisions that arrive while one is in flight go out together
    /// as one call when it lands (default `true`; on a cluster, per slot): each is
    /// still decided on its own, and Redis pays a call's fixed cost once per
    /// batch. A decision that finds none in flight goes out at once, so a
    /// lone decision waits no longer; under load one may wait for the call
    /// in flight to land before its batch goes out. `false` sends each
    /// decision at once on the shared connection (pipelined), for the lowest
    /// latency at the cost of more Redis time per decision.
    pub fn coalesce_decisions(mut self, coalesce: bool) -> Self {
        self.coalesce = coalesce;
        self
    }

    /// How often a store with a memory fallback (a layer's
    /// [`OnStoreError::FallbackToMemory`](crate::layer::OnStoreError::FallbackToMemory))
    /// tells Redis it is alive and reads how many instances are (default
    /// 5 s; at least 10 ms; `Duration::ZERO`: never). During an outage,
    /// the fallback then grants each instance its share of every limit,
    /// so that the fleet as a whole stays within about one quota (see
    /// [`FallbackToMemory`](crate::layer::OnStoreError::FallbackToMemory)
    /// for the exact bound); without a heartbeat, each instance grants the
    /// full quota.
    ///
    /// One call of the library (`FCALL`) per period, on a task of its own
    /// (decisions neither wait for it nor read what it counts): it adds
    /// this handle's random id to the sorted set `<prefix>:fleet`, scored
    /// by when it stops counting, three periods later on the server's
    /// clock (Redis `TIME`, even with a [`clock`](Self::clock) of the
    /// store's own), drops the ids past theirs, and counts the rest. The instance's count is the largest of
    /// its last four heartbeats', so that a set deleted, flushed or evicted,
    /// or a forward step of the server's clock, does not lower it while the
    /// others beat again. Every instance sharing a prefix should use the
    /// same period; an instance gone is counted for up to seven periods,
    /// one just started is counted by the others within one.
    pub fn fleet_heartbeat(mut self, period: Duration) -> Self {
        self.heartbeat = period;
        self
    }

    /// Uses this clock instead of Redis `TIME`: for tests that drive time, or
    /// for deployments that trust the application clocks more than Redis'.
    /// Decisions only: the [fleet heartbeat](Self::fleet_heartbeat) keeps
    /// to Redis `TIME`, the one clock every instance shares.
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

    /// Presents this client certificate (PEM, the chain from the leaf) and
    /// its private key (PEM) on `rediss://` connections: for servers that
    /// require clients to authenticate (`tls-auth-clients yes`). Not used
    /// with [`RedisStore::builder_with_pool`], whose pool makes its own
    /// connections.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_client_certificate(
        mut self,
        certificate_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.client_identity = Some((certificate_pem.into(), key_pem.into()));
        self
    }

    #[cfg(feature = "tls")]
    fn certificates(&self) -> Option<redis::TlsCertificates> {
        if self.root_certificate.is_none() && self.client_identity.is_none() {
            return None;
        }
        Some(redis::TlsCertificates {
            client_tls: self
                .client_identity
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.root_certificate.clone(),
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
        if !self.heartbeat.is_zero() && self.heartbeat < super::fleet::MIN_HEARTBEAT {
            return Err(ConfigError::Redis(format!(
                "the fleet heartbeat must be at least {:?} apart (or zero: none)",
                super::fleet::MIN_HEARTBEAT
            )));
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
        let cluster = connector.is_cluster();
        let slack = i64::try_from(self.slack.as_micros()).unwrap_or(i64::MAX / 4);
        Ok(RedisStore {
            inner: Arc::new_cyclic(|weak: &std::sync::Weak<Inner>| Inner {
                encoder: Encoder {
                    prefix: self.prefix,
                    slack,
                    clock: self.clock.clone(),
                    cluster,
                },
                library: Library::default(),
                coalescer: Coalescer::new(self.coalesce, cluster),
                lanes: Lanes::new(connector, self.lanes),
                heartbeat: Heartbeat::new(self.heartbeat),
                shared: crate::store::Shared::new(
                    "redis",
                    self.clock,
                    Some(crate::store::Fallback::new({
                        let weak = weak.clone();
                        move || {
                            let inner = weak.upgrade()?;
                            inner.heartbeat.fleet(&inner)
                        }
                    })),
                ),
            }),
        })
    }

    /// No response timeout in redis-rs: every command is bounded by the
    /// limiter's timeout (connection attempts by [`super::connector::CONNECT_TIMEOUT`]),
    /// and a connection that leaves a request unanswered that long is
    /// discarded by the lanes.
    fn connection_config() -> AsyncConnectionConfig {
        AsyncConnectionConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(super::connector::CONNECT_TIMEOUT))
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
                    None => connection_info(url)?,
                };
                #[cfg(not(feature = "tls"))]
                let info = connection_info(url)?;
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
                let infos = urls.iter().map(|url| connection_info(url));
                let infos = infos.collect::<Result<Vec<_>, _>>()?;
                let builder = redis::cluster::ClusterClientBuilder::new(infos)
                    .connection_timeout(super::connector::CONNECT_TIMEOUT)
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
                let addrs = urls
                    .iter()
                    .map(|url| Ok(connection_info(url)?.addr().clone()));
                let addrs = addrs.collect::<Result<Vec<_>, ConfigError>>()?;
                let first = connection_info(first)?;
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

/// `url`'s connection information. A `rediss://` URL in a build without
/// the `tls` feature is refused here, at build time rather than at the
/// first decision.
fn connection_info(url: &str) -> Result<redis::ConnectionInfo, ConfigError> {
    let info = url
        .into_connection_info()
        .map_err(|e| ConfigError::Redis(e.to_string()))?;
    if matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) && !cfg!(feature = "tls") {
        return Err(ConfigError::Redis(
            "rediss:// URLs need the crate's `tls` feature".into(),
        ));
    }
    Ok(info)
}
