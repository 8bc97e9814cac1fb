//! The Redis store: one `FCALL` of the `lua/` library per decision over a
//! pooled connection (`EVALSHA` of the same code where Functions are missing),
//! or per batch of the decisions that arrived while one was in flight.
//!
//! The engine is a struct of components, each a type of its own in a file
//! of its own, which its side of the store contract (here, top to bottom)
//! puts together:
//! - the encoder (`encode.rs`): every key name and each call's arguments,
//!   the contract's operations mapped to the library's op codes;
//! - the library (`script.rs`): the one call that runs it, `FCALL` or
//!   `EVALSHA`, loading it where missing;
//! - the coalescer (`batch.rs`): decisions under load, in batches;
//! - the lanes (`conn.rs`, connections from `connector.rs`): the
//!   connections, kept healthy;
//! - the fleet heartbeat (`fleet.rs`);
//!
//! and, over these, the admin operations (`stored.rs`: the quotas kept in
//! the store, the penalties by hand), the split of a decision whose keys
//! live in several cluster slots (`cluster.rs`), and the check that
//! calendar quotas will be kept (`durability.rs`: persistence, no
//! eviction). `builder.rs` configures it all.

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

use std::future::Future;
use std::sync::Arc;

use deadpool_redis::Pool;

use self::batch::Coalescer;
pub use self::builder::RedisStoreBuilder;
use self::builder::Target;
#[cfg(feature = "cluster")]
use self::cluster::Split;
use self::conn::Lanes;
use self::encode::{Encoded, Encoder};
use self::fleet::Heartbeat;
use self::script::{Library, DELIVERY};
use self::stored::Admin;
use super::{Answer, Check, Deadline, Engine, Penalty, Quotas, Quoted, Settle, Settled, Shared};
use crate::algorithm::Reply;
use crate::{ConfigError, Error};

/// The Redis engine: its components, shared by the store's clones.
struct Inner {
    /// Each call's keys and arguments: the prefix, the slack, the clock.
    encoder: Encoder,
    /// The library as the servers run it, loaded where missing.
    library: Library,
    /// Decisions waiting to go out together.
    coalescer: Coalescer,
    /// The connections, and what replaces them when they fail.
    lanes: Arc<Lanes>,
    /// This handle's place among the instances sharing the store, and
    /// the heartbeat that keeps it.
    heartbeat: Heartbeat,
    /// The clock, the names, the fallback (see [`Shared`]).
    shared: Shared,
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
/// let limit = Limit::new("login", Quota::per_minute(5).allow_burst(5).gcra())?;
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
            .field("prefix", &self.inner.encoder.prefix)
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
        &self.inner.encoder.prefix
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
}

impl Engine for RedisStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
        deadline: Deadline,
    ) -> Answer<'a, Result<Reply, Error>> {
        let deadline = deadline.start();
        Answer::Later(Box::pin(async move {
            let inner = &*self.inner;
            if inner.shared.names.take_calendar_check() {
                durability::check(&inner.lanes, self.prefix());
            }
            #[cfg(feature = "cluster")]
            if let Some(split) = self.split(checks) {
                // boxed: the common decision's future stays small
                return Box::pin(split.decide(dry, deadline)).await;
            }
            // keys in one slot: one call, perhaps in a batch
            let encoded = inner.encoder.decide(checks, max_wait, dry);
            let packed = inner
                .coalescer
                .decide(self, checks, encoded, deadline)
                .await?;
            stored::report_ignored(self.prefix(), &packed, checks, 0);
            read_reply(&packed, checks.len(), Reply::from_packed, "")
        }))
    }

    /// One call (a take is not split across cluster slots).
    fn take<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        deadline: Deadline,
    ) -> Answer<'a, Result<(Reply, i64), Error>> {
        let deadline = deadline.start();
        Answer::Later(Box::pin(async move {
            let packed = self
                .call(&self.inner.encoder.take(checks), deadline)
                .await?;
            stored::report_ignored(self.prefix(), &packed, checks, 1);
            let read = Reply::from_packed_take;
            read_reply(&packed, checks.len(), read, "taking from ")
        }))
    }

    fn settle<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        how: Settle,
        deadline: Deadline,
    ) -> Answer<'a, Result<Settled, Error>> {
        let deadline = deadline.start();
        Answer::Later(Box::pin(async move {
            #[cfg(feature = "cluster")]
            if let Some(split) = self.split(checks) {
                return split.settle(how, deadline).await;
            }
            let packed = self
                .call(&self.inner.encoder.settle(checks, how), deadline)
                .await?;
            match how {
                Settle::Renew { .. } => {
                    read_reply(&packed, checks.len(), Settled::from_packed, "renewing ")
                }
                Settle::Refund { .. } | Settle::Charge => Ok(Settled::default()),
            }
        }))
    }

    fn each<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        mode: crate::algorithm::EachMode,
        deadline: Deadline,
    ) -> Answer<'a, Result<Reply, Error>> {
        let deadline = deadline.start();
        Answer::Later(Box::pin(async move {
            #[cfg(feature = "cluster")]
            if let Some(split) = self.split(checks) {
                return Box::pin(split.each_set(mode, deadline)).await;
            }
            let packed = self
                .call(&self.inner.encoder.each(checks, mode), deadline)
                .await?;
            stored::report_ignored(self.prefix(), &packed, checks, 0);
            read_reply(&packed, checks.len(), Reply::from_packed, "a set of ")
        }))
    }

    fn reset<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        deadline: Deadline,
    ) -> Answer<'a, Result<(), Error>> {
        let deadline = deadline.start();
        Answer::Later(Box::pin(async move {
            let mut del = redis::cmd("DEL");
            for key in self.inner.encoder.keys(checks, false).keys() {
                del.arg(key);
            }
            self.inner.lanes.command(&del, deadline).await
        }))
    }

    fn quotas<'a>(
        &'a self,
        check: &'a Check<'a>,
        keyed: bool,
        op: Quotas<'a>,
        deadline: Deadline,
    ) -> Answer<'a, Result<Quoted, Error>> {
        Answer::Later(Box::pin(self.admin().quotas(
            check,
            keyed,
            op,
            deadline.start(),
        )))
    }

    fn penalty<'a>(
        &'a self,
        check: &'a Check<'a>,
        op: Penalty,
        deadline: Deadline,
    ) -> Answer<'a, Result<Option<(crate::penalty::PenState, i64)>, Error>> {
        Answer::Later(Box::pin(self.admin().penalty(check, op, deadline.start())))
    }

    fn shared(&self) -> &Shared {
        &self.inner.shared
    }
}

impl RedisStore {
    /// Runs the library on `encoded` over a lane's connection.
    fn call<'a>(
        &'a self,
        encoded: &'a Encoded,
        deadline: Deadline,
    ) -> impl Future<Output = Result<Vec<u8>, Error>> + Send + 'a {
        self.inner
            .library
            .call(&self.inner.lanes, encoded, deadline)
    }

    /// The admin operations, over the store's components.
    fn admin(&self) -> Admin<'_> {
        Admin {
            encoder: &self.inner.encoder,
            library: &self.inner.library,
            lanes: &self.inner.lanes,
        }
    }

    /// A call over `checks` split by cluster slot, on a cluster when their
    /// keys live in several: each slot's are made by a call of its own.
    #[cfg(feature = "cluster")]
    fn split<'a>(&'a self, checks: &[Check<'a>]) -> Option<Split<'a>> {
        let cluster = self.inner.lanes.is_cluster();
        cluster.then(|| Split::of(self, checks)).flatten()
    }
}

/// Reads `packed`, the library's reply to a call over `limits` limits, with
/// `read`; a reply it cannot read is an [`Error::UnexpectedReply`] (`what`:
/// the operation, as the error names it).
fn read_reply<T>(
    packed: &[u8],
    limits: usize,
    read: fn(&[u8], usize) -> Option<T>,
    what: &str,
) -> Result<T, Error> {
    read(packed, limits).ok_or_else(|| {
        Error::UnexpectedReply(format!("{} bytes for {what}{limits} limits", packed.len()))
    })
}
