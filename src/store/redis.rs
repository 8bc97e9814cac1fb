//! The Redis store: one `EVALSHA` of `lua/` per decision over a pooled connection.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use deadpool_redis::{Config, Pool, Runtime};
use redis::aio::MultiplexedConnection;
use redis::Script;

use super::sealed::Sealed;
use super::{keys, BoxFuture, Check, MemoryStore, Store};
use crate::algorithm::Reply;
use crate::clock::Clock;
use crate::{ConfigError, Error};

/// The one script every decision runs: the algorithms, then the driver.
const SCRIPT: &str = concat!(
    include_str!("../../lua/common.lua"),
    include_str!("../../lua/sliding_log.lua"),
    include_str!("../../lua/token_bucket.lua"),
    include_str!("../../lua/gcra.lua"),
    include_str!("../../lua/fixed_window.lua"),
    include_str!("../../lua/sliding_window.lua"),
    include_str!("../../lua/driver.lua"),
);

/// A connection taken from the pool and kept. deadpool-redis checks every
/// connection it hands out with `UNWATCH` + `PING`, one extra round trip per
/// `get()`; a multiplexed connection pipelines concurrent requests by itself,
/// so the store keeps a few of them and goes back to the pool only to replace
/// one that failed.
struct Lane {
    held: Mutex<Option<Held>>,
    fill: tokio::sync::Mutex<()>,
}

struct Held {
    conn: MultiplexedConnection,
    _pooled: deadpool_redis::Connection,
}

impl Lane {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Held>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn current(&self) -> Option<MultiplexedConnection> {
        self.lock().as_ref().map(|held| held.conn.clone())
    }
}

struct Inner {
    pool: Pool,
    prefix: String,
    script: Script,
    lanes: Box<[Lane]>,
    next: AtomicUsize,
    clock: Option<Arc<dyn Clock>>,
    /// Microseconds keys outlive their state.
    slack: i64,
    /// Decides while Redis fails (see `Sealed::fallback`); made on first use.
    fallback: OnceLock<MemoryStore>,
}

/// Limit state in Redis, shared by every instance that uses the same Redis
/// and prefix. Each decision is one `EVALSHA` (the script is loaded again
/// automatically after a `NOSCRIPT`); the script reads the clock with `TIME`,
/// so instances with skewed clocks agree.
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

/// Configures a [`RedisStore`].
#[derive(Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    url: Option<String>,
    pool: Option<Pool>,
    prefix: String,
    lanes: usize,
    clock: Option<Arc<dyn Clock>>,
    slack: Duration,
}

impl std::fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("url", &self.url)
            .field("prefix", &self.prefix)
            .field("lanes", &self.lanes)
            .finish()
    }
}

impl RedisStoreBuilder {
    /// The prefix of every key (default `"rl"`). Instances share limits when
    /// they share the Redis and the prefix.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How many connections to keep checked out of the pool and multiplex
    /// decisions over (default 4, at least 1).
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
        let pool = match (self.pool, self.url) {
            (Some(pool), _) => pool,
            (None, Some(url)) => {
                let mut config = Config::from_url(url);
                // The lanes keep their connections; the rest of the pool is
                // headroom to replace failed ones while those are returned.
                config.pool = Some(deadpool_redis::PoolConfig::new(2 * self.lanes));
                config
                    .create_pool(Some(Runtime::Tokio1))
                    .map_err(|e| ConfigError::Redis(e.to_string()))?
            }
            (None, None) => return Err(ConfigError::Redis("no URL or pool given".into())),
        };
        if pool.status().max_size < self.lanes {
            return Err(ConfigError::Redis(format!(
                "the pool holds at most {} connections, fewer than the {} lanes",
                pool.status().max_size,
                self.lanes
            )));
        }
        let lanes = (0..self.lanes)
            .map(|_| Lane {
                held: Mutex::new(None),
                fill: tokio::sync::Mutex::new(()),
            })
            .collect();
        Ok(RedisStore {
            inner: Arc::new(Inner {
                pool,
                prefix: self.prefix,
                script: Script::new(SCRIPT),
                lanes,
                next: AtomicUsize::new(0),
                clock: self.clock,
                slack: i64::try_from(self.slack.as_micros()).unwrap_or(i64::MAX / 4),
                fallback: OnceLock::new(),
            }),
        })
    }
}

impl RedisStore {
    /// Configures a store for a Redis URL such as `redis://127.0.0.1:6379/0`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: Some(url.into()),
            pool: None,
            prefix: "rl".into(),
            lanes: 4,
            clock: None,
            slack: Duration::ZERO,
        }
    }

    /// Configures a store over an existing deadpool-redis pool, whose size must
    /// be at least the number of lanes.
    pub fn builder_with_pool(pool: Pool) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: None,
            pool: Some(pool),
            prefix: "rl".into(),
            lanes: 4,
            clock: None,
            slack: Duration::ZERO,
        }
    }

    /// A store for `url` with the default settings.
    pub fn new(url: impl Into<String>) -> Result<Self, ConfigError> {
        Self::builder(url).build()
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The SHA1 of the decision script (what `EVALSHA` sends).
    pub fn script_hash(&self) -> &str {
        self.inner.script.get_hash()
    }

    /// The Redis keys that hold the state of one check.
    fn keys(&self, check: &Check<'_>) -> Vec<String> {
        let tag = keys::tag(check.key);
        let (prefix, name) = (&self.inner.prefix, check.limit.name());
        let parts = check.limit.params().algorithm.key_parts();
        parts
            .iter()
            .map(|part| format!("{prefix}:{tag}:{name}:{part}"))
            .collect()
    }

    /// A connection of the next lane, taken from the pool if the lane is empty.
    async fn connection(&self) -> Result<(usize, MultiplexedConnection), Error> {
        let index = self.inner.next.fetch_add(1, Ordering::Relaxed) % self.inner.lanes.len();
        let lane = &self.inner.lanes[index];
        if let Some(conn) = lane.current() {
            return Ok((index, conn));
        }
        // One task fills an empty lane; the others wait for it rather than
        // draining the pool (whose connections the lanes keep checked out).
        let _filling = lane.fill.lock().await;
        if let Some(conn) = lane.current() {
            return Ok((index, conn));
        }
        let pooled = self.inner.pool.get().await.map_err(|e| match e {
            deadpool_redis::PoolError::Backend(e) => Error::Redis(e),
            other => Error::Pool(other.to_string()),
        })?;
        let conn = (*pooled).clone();
        *lane.lock() = Some(Held {
            conn: conn.clone(),
            _pooled: pooled,
        });
        Ok((index, conn))
    }

    /// Drops a lane whose connection failed; the next use takes a fresh one.
    fn discard(&self, index: usize, error: &redis::RedisError) {
        if error.is_io_error() || error.is_connection_dropped() || error.is_unrecoverable_error() {
            self.inner.lanes[index].lock().take();
        }
    }

    async fn run_decide(
        &self,
        checks: &[Check<'_>],
        max_wait: i64,
        dry: bool,
    ) -> Result<Reply, Error> {
        let mut invocation = self.inner.script.prepare_invoke();
        for check in checks {
            for key in self.keys(check) {
                invocation.key(key);
            }
        }
        let now = self.inner.clock.as_ref().map_or(0, |c| c.now_micros());
        invocation
            .arg(now)
            .arg(max_wait)
            .arg(u8::from(dry))
            .arg(self.inner.slack)
            .arg(checks.len());
        for check in checks {
            let p = check.limit.params();
            invocation
                .arg(p.algorithm.id())
                .arg(&p.p[..])
                .arg(check.cost);
        }
        let (index, mut conn) = self.connection().await?;
        let values: Vec<i64> = invocation
            .invoke_async(&mut conn)
            .await
            .inspect_err(|e| self.discard(index, e))?;
        Reply::from_flat(&values, checks.len()).ok_or_else(|| {
            Error::UnexpectedReply(format!(
                "{} integers for {} limits",
                values.len(),
                checks.len()
            ))
        })
    }

    async fn run_reset(&self, checks: &[Check<'_>]) -> Result<(), Error> {
        let mut cmd = redis::cmd("DEL");
        for check in checks {
            for key in self.keys(check) {
                cmd.arg(key);
            }
        }
        let (index, mut conn) = self.connection().await?;
        cmd.query_async::<()>(&mut conn)
            .await
            .inspect_err(|e| self.discard(index, e))?;
        Ok(())
    }
}

impl Store for RedisStore {}

impl Sealed for RedisStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
    ) -> BoxFuture<'a, Result<Reply, Error>> {
        Box::pin(self.run_decide(checks, max_wait, dry))
    }

    fn reset<'a>(&'a self, checks: &'a [Check<'a>]) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.run_reset(checks))
    }

    fn fallback(&self) -> Option<MemoryStore> {
        Some(self.inner.fallback.get_or_init(MemoryStore::new).clone())
    }
}
