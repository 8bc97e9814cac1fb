//! A named, validated quota ([`Limit`]): its name, interned, and the integer
//! parameters the algorithms decide with, derived once.

use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::{self, Params};
use crate::hot::HotKey;
use crate::penalty::{PenParams, Penalty};
use crate::quota::{Algorithm, Quota};
use crate::ConfigError;

/// Largest integer every intermediate value must stay below (2^53, the exact
/// range of the doubles Redis Lua computes with).
pub(crate) const MAX_EXACT: u128 = 1 << 53;
/// Longest accepted window: ten years, so `now + window` stays far below 2^53 us.
const MAX_WINDOW_MICROS: u128 = 10 * 366 * 86_400 * 1_000_000;
/// How long a layer holds a permit of a [concurrency limit](Limit::concurrency)
/// at most, unless the limit says otherwise ([`Limit::hold_at_most`]).
pub const DEFAULT_MAX_HOLD: Duration = Duration::from_secs(600);
/// Sliding window counter weights have 2^20 steps per window.
const WEIGHT_STEPS: u64 = 1 << 20;

/// A named, validated quota. Cheap to clone.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{ConfigError, Limit, Quota};
///
/// let sms = Limit::new("sms", Quota::sliding_log(3, Duration::from_secs(60)))?;
/// assert_eq!(sms.name(), "sms");
/// assert!(matches!(
///     Limit::new("sms", Quota::sliding_log(0, Duration::from_secs(60))),
///     Err(ConfigError::ZeroAmount { .. })
/// ));
/// # Ok::<(), ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Limit {
    /// Interned (see [`intern`]): a decision names its limits without
    /// counting references.
    name: &'static str,
    quota: Quota,
    params: Params,
    policy_window: Duration,
    policy_window_us: u64,
    /// `algorithm:p1:p2:p3:`, what the Redis decision function reads before
    /// the cost (see `lua/driver.lua`): the same on every call, so made once.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    wire: Arc<str>,
    /// `algorithm:p1:p2:p3:`, the wire string less its prefixes (see
    /// [`stored_form`](Self::stored_form)).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    stored: Arc<str>,
    /// The penalty, if any (see [`Limit::with_penalty`]), with its integers.
    penalty: Option<Arc<(Penalty, PenParams)>>,
    /// Shadow mode: decides and records, never refuses.
    shadow: bool,
    /// Whether a quota kept in the store (or a key's override) decides in
    /// place of `quota` (see [`Limit::quota_from_store`]).
    from_store: bool,
    /// A concurrency limit: its grants are leases, given back when the
    /// work ends (see [`Limit::concurrency`]).
    leases: bool,
    /// How long a permit of a concurrency limit may be held at most (see
    /// [`Limit::hold_at_most`]); `None`: [`DEFAULT_MAX_HOLD`] in a layer,
    /// no bound for a [`Lease`](crate::Lease).
    max_hold: Option<Duration>,
    /// Batches of permits granted in this process (see [`Limit::with_hot_key`]).
    hot: Option<HotKey>,
    /// Its `tower_ratelimit_decisions_total` keys, made once.
    #[cfg(feature = "metrics")]
    metric_keys: Arc<crate::metrics::LimitKeys>,
}

impl Limit {
    /// Validates `quota` and names it. The name becomes part of every storage
    /// key and of the `RateLimit-Policy` header: 1 to 64 characters from
    /// `A-Z a-z 0-9 _ . -`.
    ///
    /// Names are configuration: the process keeps one copy of each distinct
    /// name for its whole life (a decision then names its limits without a
    /// reference count). Make limits with a bounded set of names, not one
    /// name per client.
    pub fn new(name: impl Into<String>, quota: Quota) -> Result<Self, ConfigError> {
        let name: String = name.into();
        let valid_name = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !valid_name {
            return Err(ConfigError::InvalidName(name));
        }
        let (params, policy_window) = derive(&quota)?;
        let [a, b, c] = params.wire();
        let wire: Arc<str> = format!("{}:{a}:{b}:{c}:", params.algorithm().id()).into();
        let name = intern(&name);
        Ok(Self {
            #[cfg(feature = "metrics")]
            metric_keys: Arc::new(crate::metrics::LimitKeys::new(name)),
            name,
            quota,
            params,
            policy_window,
            policy_window_us: u64::try_from(policy_window.as_micros()).unwrap_or(u64::MAX),
            stored: wire.clone(),
            wire,
            penalty: None,
            shadow: false,
            from_store: false,
            leases: false,
            max_hold: None,
            hot: None,
        })
    }

    /// A concurrency limit: at most `max` permits held at once per key
    /// ("at most 2 exports running per tenant"). A permit is a lease, held
    /// while the work runs and given back when it ends: by a
    /// [`Lease`](crate::Lease) from
    /// [`Limiter::acquire_lease`](crate::Limiter::acquire_lease), or, in a
    /// layer, from the decision through the handler until the response body
    /// is finished or dropped (at most [`max_hold`](Self::hold_at_most)). A lease lasts `lease` unless renewed: its holder renews it
    /// while it runs, so the permits of a holder that died (a crashed
    /// instance, a killed task) come back within `lease` at most.
    ///
    /// It is a sliding log of `max` per `lease` whose grants are given back
    /// at the end: exact under concurrency on both stores and a cluster, and
    /// decided with other limits in one atomic decision. A refused request
    /// is told to retry when the oldest lease would expire (a bound: a
    /// release frees a permit sooner). A decision that may wait (a layer's
    /// delay mode, [`Limiter::acquire`](crate::Limiter::acquire)) reserves
    /// no permit ahead, since a lease renewed meanwhile would run beside the
    /// reserved one: it is decided again, at pauses of 10 ms doubling up to
    /// 200 ms, until a permit is free or the wait is over.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let exports = Limit::concurrency("exports", 2, Duration::from_secs(30))?;
    /// let limiter = Limiter::new(MemoryStore::new(), exports);
    /// let first = limiter.acquire_lease("acme").await?;
    /// let second = limiter.acquire_lease("acme").await?;
    /// assert!(first.is_held() && second.is_held());
    /// assert!(!limiter.acquire_lease("acme").await?.is_held()); // two running
    /// drop(first); // the export ended
    /// assert!(limiter.acquire_lease("acme").await?.is_held());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn concurrency(
        name: impl Into<String>,
        max: u64,
        lease: Duration,
    ) -> Result<Self, ConfigError> {
        let mut limit = Self::new(name, Quota::sliding_log(max, lease))?;
        limit.leases = true;
        Ok(limit)
    }

    /// Whether this is a [concurrency limit](Self::concurrency), whose
    /// grants are leases given back when the work ends.
    pub fn is_concurrency(&self) -> bool {
        self.leases
    }

    /// The longest a permit of this [concurrency limit](Self::concurrency)
    /// is held, renewals included: past it, the permit is given back and
    /// the holder loses it. In a layer, a request holds its permit from
    /// its decision until its response body ends, so a client that stops
    /// reading a streamed body would hold it for as long as it keeps the
    /// connection open; at `max_hold` (by default [`DEFAULT_MAX_HOLD`],
    /// 10 minutes) the permit comes back and the body ends with an error
    /// at its next poll, which closes the connection. A
    /// [`Lease`](crate::Lease) is bounded only when this is set: its holder
    /// is code of the application, and a long job keeps its permit.
    ///
    /// A zero `max_hold`, or one on a limit that is not a concurrency
    /// limit, is a [`ConfigError::MaxHold`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit::Limit;
    ///
    /// let downloads = Limit::concurrency("downloads", 4, Duration::from_secs(30))?
    ///     .hold_at_most(Duration::from_secs(120))?;
    /// assert_eq!(downloads.max_hold(), Some(Duration::from_secs(120)));
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn hold_at_most(mut self, max_hold: Duration) -> Result<Self, ConfigError> {
        if !self.leases {
            return Err(ConfigError::MaxHold(format!(
                "limit {:?} is not a concurrency limit",
                self.name
            )));
        }
        if max_hold.is_zero() {
            return Err(ConfigError::MaxHold(format!(
                "the maximum hold of limit {:?} is zero",
                self.name
            )));
        }
        self.max_hold = Some(max_hold);
        Ok(self)
    }

    /// The longest a permit is held, when set with
    /// [`hold_at_most`](Self::hold_at_most).
    pub fn max_hold(&self) -> Option<Duration> {
        self.max_hold
    }

    /// This limit in shadow mode: it decides and records as if enforced
    /// (its grants count, and a request it would refuse takes nothing from
    /// it), but it never refuses. Its would-be refusals are counted under the
    /// outcome `shadow_denied` (see [`crate::metrics`]), logged at `debug`,
    /// and marked in the decision ([`LimitStatus::would_refuse`]): roll a
    /// new limit out, watch it, then enforce it. As Envoy's rate limit
    /// service does.
    ///
    /// With other limits, the request is decided once with every limit; if
    /// only shadow limits refuse, it is decided again without them (a second
    /// round trip, only then), so the enforced limits count it.
    ///
    /// ```
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let trial = Limit::new("trial", Quota::per_minute(1).sliding_log())?.shadow();
    /// let limiter = Limiter::new(MemoryStore::new(), trial);
    /// limiter.check("alice", 1).await?;
    /// let second = limiter.check("alice", 1).await?;
    /// assert!(second.is_allowed()); // never refused,
    /// assert!(second.statuses()[0].would_refuse()); // but it would have been
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    ///
    /// [`LimitStatus::would_refuse`]: crate::LimitStatus::would_refuse
    pub fn shadow(mut self) -> Self {
        self.shadow = true;
        self
    }

    /// This limit takes its quota from the store when one is kept there for
    /// it, shared by every instance: set with
    /// [`Admin::set_stored_quota`](crate::Admin::set_stored_quota), and
    /// per key with [`Admin::set_override`](crate::Admin::set_override).
    /// Both are read in the round trip of each decision (no call of their
    /// own), so a change is in force for every instance's next decision. The
    /// limit's own quota decides when none is stored, and a stored quota of
    /// another algorithm is ignored.
    ///
    /// On Redis, each server keeps what it last read of the limit's quota
    /// in its Lua VM and reads it again at most once a second (with whether
    /// any key has an override; a key's override is read by its decision,
    /// one more command, only while the limit has some): a change made
    /// through these methods drops that copy on every server it writes, so
    /// it is in force for the next decision there; a change made behind
    /// their back (the hash edited by hand, evicted or flushed, set by
    /// another version of this crate, a failover to a replica) is in force
    /// within one second of the store's clock (Redis `TIME`, or the store's
    /// [`clock`](crate::RedisStoreBuilder::clock) when it has one). During
    /// a Redis outage, a layer's
    /// [`FallbackToMemory`](crate::layer::OnStoreError::FallbackToMemory)
    /// decides with the limit's own quota. Such a limit's denials are not cached
    /// (see [`LimiterBuilder::cache_denials`](crate::LimiterBuilder::cache_denials)):
    /// a raised quota must not wait for a cached refusal to run out.
    ///
    /// ```
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let reports = Limit::new("reports", Quota::per_hour(2).fixed_window())?.quota_from_store();
    /// let store = MemoryStore::new();
    /// let (a, b) = (Limiter::new(store.clone(), reports.clone()), Limiter::new(store, reports));
    /// a.admin().set_stored_quota("reports", Quota::per_hour(10).fixed_window()).await?;
    /// assert_eq!(b.check("acme", 1).await?.capacity(), 10); // b reads what a stored
    /// b.admin().set_override("reports", "bigcorp", Quota::per_hour(1000).fixed_window(), None).await?;
    /// assert_eq!(a.check("bigcorp", 1).await?.capacity(), 1000);
    /// assert_eq!(a.check("acme", 1).await?.capacity(), 10);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn quota_from_store(mut self) -> Self {
        self.from_store = true;
        self.rewire();
        self
    }

    /// This limit with a [`Penalty`]: after the penalty's number of
    /// refusals by this limit within its time, the key is blocked, longer
    /// on each repeat offence. Counted and decided in the same store call
    /// as the limit's decision (on Redis, one more key in the key's hash
    /// tag); limits without a penalty pay nothing for it.
    ///
    /// A refusal counts when this limit itself refuses a decision that
    /// would have taken something (not a [`peek`](crate::Limiter::peek), a
    /// [`take_up_to`](crate::Limiter::take_up_to) that finds nothing or a
    /// decision refused by another limit only). While the key is blocked the
    /// limit refuses it with `retry_after` the time left of the block
    /// ([`LimitStatus::is_blocked`](crate::LimitStatus::is_blocked)), without
    /// consulting or charging its quota, whatever `max_wait` (a block is not
    /// waited out by a reservation); refusals during a block do not count.
    /// [`Admin::block`](crate::Admin::block),
    /// [`unblock`](crate::Admin::unblock) and
    /// [`inspect`](crate::Admin::inspect) manage a key's penalty. Refunds
    /// are unaffected by a block, and [`reset`](crate::Limiter::reset)
    /// leaves the penalty (an unblock forgives it). On a limit in
    /// [shadow mode](Self::shadow), would-be refusals count, and a block is a
    /// would-be refusal too.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit::{Limit, Limiter, ManualClock, MemoryStore, Penalty, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let min = Duration::from_secs(60);
    /// let logins = Limit::new("login", Quota::per_minute(1).fixed_window())?
    ///     .with_penalty(Penalty::new(2, 10 * min, [5 * min, 60 * min])?);
    /// let clock = ManualClock::new(1_800_000_000_000_000);
    /// let limiter = Limiter::new(MemoryStore::with_clock(clock.clone()), logins);
    /// assert!(limiter.check("mallory", 1).await?.is_allowed());
    /// assert!(!limiter.check("mallory", 1).await?.is_allowed()); // refusal 1
    /// let banned = limiter.check("mallory", 1).await?; // refusal 2: an offence
    /// assert_eq!(banned.retry_after(), Some(5 * min));
    /// clock.advance(2 * min); // the quota is back, the block is not
    /// assert_eq!(limiter.check("mallory", 1).await?.retry_after(), Some(3 * min));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn with_penalty(mut self, penalty: Penalty) -> Self {
        // every refusal must reach the store to be counted
        self.hot = None;
        let params = penalty.params();
        self.penalty = Some(Arc::new((penalty, params)));
        self.rewire();
        self
    }

    /// The wire string from its parts: `p...;` for a penalty, then `c`
    /// for a quota kept in the store, then the stored form.
    fn rewire(&mut self) {
        #[cfg(feature = "redis")]
        {
            let pen = self
                .penalty
                .as_ref()
                .map(|p| p.1.wire())
                .unwrap_or_default();
            let c = if self.from_store { "c" } else { "" };
            self.wire = format!("{pen}{c}{}", self.stored).into();
        }
    }

    /// This limit's keys are hot: on a store shared over a network, each
    /// instance takes batches of permits from the store and grants them in
    /// this process, so one global key can be decided far faster than one
    /// Redis could decide it alone, at a bounded cost in exactness stated
    /// in [`HotKey`]. Refusals reach the store about once per `retry_after`
    /// (as with the limiter's cache of denials). An in-process store
    /// decides every request itself and ignores this.
    ///
    /// Only a plain decision (a `check` or a layer's request, cost at most
    /// [`HotKey::permits`]) is served from a batch: a look, a reservation
    /// ahead, [`take_up_to`](crate::Limiter::take_up_to) and a limit in
    /// shadow mode are decided by the store. A refund gives nothing back
    /// to a hot limit (its permit may have come from a batch: it counts as
    /// spent). With other,
    /// ordinary limits in the same decision, those are decided by the store
    /// and, if they refuse, the permit goes back to the batch.
    ///
    /// Fails with [`ConfigError::HotKey`] when a batch is larger than the
    /// limit's capacity, or for a concurrency limit or a limit with a
    /// penalty (whose every decision must reach the store).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit::{HotKey, Limit, Quota};
    ///
    /// let global = Limit::new("global", Quota::per_second(50_000).gcra())?
    ///     .with_hot_key(HotKey::new(200, Duration::from_millis(100))?)?;
    /// assert_eq!(global.hot_key().map(HotKey::permits), Some(200));
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn with_hot_key(mut self, hot: HotKey) -> Result<Self, ConfigError> {
        if hot.permits() > self.capacity() {
            return Err(ConfigError::HotKey(format!(
                "a batch of {} is more than limit {:?} holds ({})",
                hot.permits(),
                self.name,
                self.capacity()
            )));
        }
        if self.leases || self.penalty.is_some() {
            return Err(ConfigError::HotKey(format!(
                "limit {:?} must decide every request in the store (a concurrency limit or a penalty)",
                self.name
            )));
        }
        self.hot = Some(hot);
        Ok(self)
    }

    /// How the limit's keys are served from local batches, if they are (see
    /// [`with_hot_key`](Self::with_hot_key)).
    pub fn hot_key(&self) -> Option<&HotKey> {
        self.hot.as_ref()
    }

    /// The limit's penalty, if it has one (see [`with_penalty`](Self::with_penalty)).
    pub fn penalty(&self) -> Option<&Penalty> {
        self.penalty.as_ref().map(|p| &p.0)
    }

    /// The penalty's integers.
    pub(crate) fn pen_params(&self) -> Option<&PenParams> {
        self.penalty.as_ref().map(|p| &p.1)
    }

    /// Whether the limit takes its quota from the store when one is kept
    /// there (see [`quota_from_store`](Self::quota_from_store)).
    pub fn is_quota_from_store(&self) -> bool {
        self.from_store
    }

    /// Whether the limit is in [shadow mode](Self::shadow).
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// The same limit under another name, for state kept apart from it
    /// (the name need not be valid: it never comes from a user).
    pub(crate) fn renamed(&self, name: String) -> Self {
        let mut limit = self.clone();
        limit.name = intern(&name);
        #[cfg(feature = "metrics")]
        {
            limit.metric_keys = Arc::new(crate::metrics::LimitKeys::new(limit.name));
        }
        limit
    }

    /// The name.
    pub fn name(&self) -> &str {
        self.name
    }

    /// The name, interned: the same pointer for every limit of that name.
    pub(crate) fn shared_name(&self) -> &'static str {
        self.name
    }

    #[cfg(feature = "metrics")]
    pub(crate) fn metric_keys(&self) -> &crate::metrics::LimitKeys {
        &self.metric_keys
    }

    /// The quota.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// The most one request can ever be granted.
    pub fn capacity(&self) -> u64 {
        self.quota.amount
    }

    /// The time in which a spent capacity comes back in full: the window for
    /// window algorithms, capacity / rate for the bucket algorithms. Used as the
    /// `w` of `RateLimit-Policy`.
    pub fn policy_window(&self) -> Duration {
        self.policy_window
    }

    /// [`policy_window`](Self::policy_window) in microseconds (it is whole).
    pub(crate) fn policy_window_us(&self) -> u64 {
        self.policy_window_us
    }

    pub(crate) fn params(&self) -> &Params {
        &self.params
    }

    /// The limit's argument to the Redis decision function, less the cost:
    /// `c` first for a limit whose quota may be kept in the store, and
    /// before that its penalty's `p...;` when it has one.
    #[cfg(feature = "redis")]
    pub(crate) fn wire(&self) -> &str {
        &self.wire
    }

    /// How the store keeps this limit's quota (for another limit of the
    /// same name to decide with): its wire string, less the cost and the
    /// `c`: `algorithm:p1:p2:p3:`, which the scripts complete with a
    /// cost (see `lua/driver.lua`) and [`Params::from_stored`] reads back.
    #[cfg(feature = "redis")]
    pub(crate) fn stored_form(&self) -> &str {
        &self.stored
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn exact(value: u128, what: &str) -> Result<i64, ConfigError> {
    if value >= MAX_EXACT {
        return Err(ConfigError::OutOfRange(format!(
            "{what} is {value}, which must stay below 2^53 for exact arithmetic"
        )));
    }
    i64::try_from(value).map_err(|_| ConfigError::OutOfRange(format!("{what} is too large")))
}

/// The one `&'static` copy of `text`, made on its first use: for strings
/// that come from configuration (limit names, a layer's `RateLimit-Policy`),
/// which a process keeps for its life so that every decision and response
/// can carry them without touching a reference count. Each distinct text is
/// kept once (a limit name is at most 64 bytes, plus the internal
/// `#keyless` variants).
pub(crate) fn intern(text: &str) -> &'static str {
    static TEXTS: std::sync::Mutex<Option<std::collections::HashSet<&'static str>>> =
        std::sync::Mutex::new(None);
    let mut texts = TEXTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let texts = texts.get_or_insert_with(Default::default);
    if let Some(&known) = texts.get(text) {
        return known;
    }
    let leaked: &'static str = Box::leak(text.to_owned().into_boxed_str());
    texts.insert(leaked);
    leaked
}

pub(crate) fn derive(q: &Quota) -> Result<(Params, Duration), ConfigError> {
    let window = q.window.as_micros();
    let window_name = match q.algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra => "period",
        _ => "window",
    };
    if window == 0 {
        return Err(ConfigError::ZeroWindow { what: window_name });
    }
    if window > MAX_WINDOW_MICROS {
        return Err(ConfigError::OutOfRange(format!(
            "the {window_name} is longer than ten years"
        )));
    }
    let amount_name = match q.algorithm {
        Algorithm::TokenBucket => "capacity",
        Algorithm::Gcra => "burst",
        _ => "limit",
    };
    if q.amount == 0 {
        return Err(ConfigError::ZeroAmount { what: amount_name });
    }
    let amount = u128::from(q.amount);
    let params = match q.algorithm {
        Algorithm::SlidingLog | Algorithm::FixedWindow => {
            let limit = exact(amount, "the limit")?;
            let window = exact(window, "the window in microseconds")?;
            if q.algorithm == Algorithm::SlidingLog {
                Params::SlidingLog(algorithm::sliding_log::Params { limit, window })
            } else {
                Params::FixedWindow(algorithm::fixed_window::Params { limit, window })
            }
        }
        Algorithm::SlidingWindow => {
            let steps = u128::from(WEIGHT_STEPS);
            exact(amount * steps, "the limit times 2^20")?;
            Params::SlidingWindow(algorithm::sliding_window::Params {
                limit: exact(amount, "the limit")?,
                window: exact(window, "the window in microseconds")?,
                step: exact(window.div_ceil(steps), "the weight step")?,
            })
        }
        Algorithm::TokenBucket | Algorithm::Gcra => {
            let rate_name = if q.algorithm == Algorithm::Gcra {
                "rate"
            } else {
                "refill"
            };
            if q.extra == 0 {
                return Err(ConfigError::ZeroAmount { what: rate_name });
            }
            let g = gcd(u128::from(q.extra), window);
            let (per, period) = (u128::from(q.extra) / g, window / g);
            let capacity = exact(amount, amount_name)?;
            let rate = exact(per, rate_name)?;
            let reduced = exact(period, "the reduced period in microseconds")?;
            // The largest products the scripts form: capacity * period (+ rate).
            exact(amount * period + per, "capacity times reduced period")?;
            if q.algorithm == Algorithm::Gcra {
                Params::Gcra(algorithm::gcra::Params {
                    burst: capacity,
                    rate,
                    period: reduced,
                })
            } else {
                Params::TokenBucket(algorithm::token_bucket::Params {
                    capacity,
                    rate,
                    period: reduced,
                })
            }
        }
    };
    Ok((params, Duration::from_micros(params.policy_window_us())))
}
