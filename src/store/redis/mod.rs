//! The Redis store: one `FCALL` of the `lua/` library per decision over a
//! pooled connection (`EVALSHA` of the same code where Functions are missing),
//! or per batch of the decisions that arrived while one was in flight.
//!
//! `builder.rs` configures it, `backend.rs` is its side of the store
//! trait (decide, reset, settle, take), `encode.rs` writes each call's keys and
//! arguments, `batch.rs` coalesces decisions under load, `script.rs` runs
//! the library (loading it where missing),
//! `connector.rs` makes the connections, `conn.rs` keeps them healthy,
//! `cluster.rs` splits a decision
//! whose keys live in several slots, `durability.rs` checks once that
//! calendar quotas will be kept (persistence, no eviction).

mod backend;
mod batch;
mod builder;
#[cfg(feature = "cluster")]
mod cluster;
mod conn;
mod connector;
mod durability;
mod encode;
mod fleet;
mod script;
mod stored;

use std::sync::Arc;

use deadpool_redis::Pool;

use self::backend::read_reply;
use self::batch::Coalescer;
pub use self::builder::RedisStoreBuilder;
use self::builder::Target;
use self::conn::Lanes;
use self::encode::{Encoded, Encoder};
use self::fleet::Heartbeat;
use self::script::{Library, DELIVERY};
use self::stored::Admin;
use super::{Check, Deadline, Settle, Settled};
use crate::{ConfigError, Error};

struct Inner {
    /// Each call's keys and arguments: the prefix, the slack, the clock.
    encoder: Encoder,
    /// The library as the servers run it, loaded where missing.
    library: Library,
    /// The connections, and what replaces them when they fail.
    lanes: Arc<Lanes>,
    /// This handle's place among the instances sharing the store, and
    /// the heartbeat that keeps it (see `fleet.rs`).
    heartbeat: Heartbeat,
    /// The clock, the names, the fallback (see [`Shared`](super::Shared)).
    shared: super::Shared,
    /// Decisions waiting to go out together (see `batch.rs`).
    coalescer: Coalescer,
}

/// Limit state in Redis, shared by every instance that uses the same Redis
/// and prefix. Each decision is one `FCALL` of a Redis Function library
/// (loaded again automatically when a server lacks it; on Redis before 7.0,
/// one `EVALSHA` of the same code); the code reads the clock with `TIME`, so
/// instances with skewed clocks agree. Decisions that arrive while one is in
/// flight go out together, as one call, when it lands (see
/// [`RedisStoreBuilder::coalesce_decisions`]).
///
/// Under `maxmemory` with an eviction policy, Redis evicts to make room
/// and decisions go on. Over `maxmemory` with nothing to evict
/// (`noeviction`, as calendar quotas need), Redis refuses every decision
/// (an `OOM` error: the layer's [`OnStoreError`](crate::layer::OnStoreError)
/// answers), rather than write past the bound its operator set (the
/// function has no `allow-oom` flag). Loading the function is a write too:
/// refused, decisions run as scripts, and the load is tried again ten
/// seconds later.
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
            .field("prefix", &self.inner.encoder.prefix())
            .field("lanes", &self.inner.lanes.len())
            .finish()
    }
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
        self.inner.encoder.prefix()
    }

    /// The name of the Redis Function that decides (what `FCALL` calls); its
    /// library has the same name.
    pub fn function_name() -> &'static str {
        &DELIVERY.function
    }

    /// The source of the Function library this crate loads (`FUNCTION LOAD`
    /// takes it as it is), for a deployment that loads it ahead of time or
    /// reviews what runs on its Redis. A store loads it by itself where it
    /// is missing.
    ///
    /// ```
    /// use tower_ratelimit::RedisStore;
    ///
    /// let library = RedisStore::library();
    /// let name = RedisStore::function_name();
    /// assert!(library.starts_with(&format!("#!lua name={name}\n")));
    /// assert!(library.contains(&format!("function_name = '{name}'")));
    /// ```
    pub fn library() -> &'static str {
        &DELIVERY.library
    }

    /// The SHA1 of the same code as a script (what `EVALSHA` sends where
    /// Redis has no Functions).
    pub fn script_hash() -> &'static str {
        DELIVERY.script.get_hash()
    }

    /// The groups of `checks` whose keys share a cluster slot, when they
    /// are several: each is decided by a call of its own (see `cluster.rs`).
    /// `None` when one call serves them all.
    #[cfg(feature = "cluster")]
    fn slot_groups(&self, checks: &[Check<'_>]) -> Option<Vec<smallvec::SmallVec<[usize; 2]>>> {
        if !self.inner.lanes.is_cluster() {
            return None;
        }
        cluster::slot_groups(checks)
    }

    /// A settlement of checks whose keys share a slot (the library's ops 1,
    /// 4 and 5, see `lua/limits.lua`): one call.
    async fn settle_group(
        &self,
        checks: &[Check<'_>],
        how: Settle,
        deadline: Deadline,
    ) -> Result<Settled, Error> {
        let packed = self
            .call(&self.inner.encoder.settle(checks, how), deadline)
            .await?;
        match how {
            Settle::Renew { .. } => {
                read_reply(&packed, checks.len(), Settled::from_packed, "renewing ")
            }
            _ => Ok(Settled::default()),
        }
    }

    /// The admin operations over the store's components.
    fn admin(&self) -> Admin<'_> {
        Admin {
            encoder: &self.inner.encoder,
            library: &self.inner.library,
            lanes: &self.inner.lanes,
        }
    }

    /// Runs the library on `encoded` over a lane's connection.
    fn call<'a>(
        &'a self,
        encoded: &'a Encoded,
        deadline: Deadline,
    ) -> impl std::future::Future<Output = Result<Vec<u8>, Error>> + Send + 'a {
        self.inner
            .library
            .call(&self.inner.lanes, encoded, deadline)
    }
}
