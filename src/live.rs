//! Limits that change while the process runs: [`LiveLimit`] (one limit),
//! [`LiveLimits`] (a set, replaced at once from a file), and
//! [`LimitSource`], what limiters and layers take for each limit: a fixed
//! [`Limit`] or a live one.
//!
//! A live limit is read anew for every decision (an atomic pointer load, no
//! lock) and replaced by an atomic pointer swap. Its name never changes: the
//! name is the identity of its state, so a new quota takes over the state
//! the old one left (see "Changing limits at runtime" in the README).

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::quota::Algorithm;
use crate::{ConfigError, Limit};

/// A live limit's value: the limit and its twin for keyless requests
/// (see [`MissingKey::Shared`](crate::layer::MissingKey::Shared)).
#[derive(Debug)]
pub(crate) struct Value {
    limit: Limit,
    keyless: Limit,
}

impl Value {
    fn new(limit: Limit) -> Self {
        let keyless = limit.renamed(format!("{}#keyless", limit.name()));
        Self { limit, keyless }
    }
}

/// What the users of a live limit need of every value it takes (registered
/// when a layer is built with it): checked by [`LiveLimit::set`], so a
/// value that would break a running layer is refused, as it would have been
/// when the layer was built.
#[derive(Debug, Default)]
struct Needs {
    /// The largest fixed cost of a layer that uses it.
    cost: u64,
    /// The algorithm of its tiers, when a rule gives it some (tiers share
    /// the limit's state, so they share its algorithm).
    algorithm: Option<Algorithm>,
    /// Whether its tiers read their keys' overrides, when a rule gives it
    /// some: built from the value of the time, they keep it (see
    /// [`Rule::tier`](crate::layer::Rule::tier)), so every value does.
    stored: Option<bool>,
}

#[derive(Debug)]
struct Shared {
    current: ArcSwap<Value>,
    /// Held while a value is checked and swapped in.
    needs: Mutex<Needs>,
}

/// A limit that can be replaced while limiters and layers use it: every
/// decision made after [`set`](Self::set) returns uses the new value, on
/// every limiter, route and layer built with this handle (or a clone), with
/// no rebuild and no lock on the request path.
///
/// The state carries over as in a rolling deploy: the name stays, so a key
/// keeps what it used (a bucket's tokens, a window's count, a log's grants),
/// read in the new quota's units and clamped to its capacity. A new
/// algorithm starts every key afresh (its state is kept apart).
///
/// ```
/// use tower_ratelimit::{LiveLimit, Limit, Limiter, MemoryStore, Quota};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let exports = LiveLimit::new(Limit::new("exports", Quota::per_hour(2).fixed_window())?);
/// let limiter = Limiter::new(MemoryStore::new(), exports.clone());
/// limiter.check("acme", 2).await?;
/// assert!(!limiter.check("acme", 1).await?.is_allowed());
///
/// exports.set(Limit::new("exports", Quota::per_hour(5).fixed_window())?)?;
/// let d = limiter.check("acme", 1).await?; // the 2 used still count
/// assert!(d.is_allowed() && d.remaining() == 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct LiveLimit {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LiveLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LiveLimit")
            .field(&self.shared.current.load().limit)
            .finish()
    }
}

impl LiveLimit {
    /// A live limit whose first value is `limit`.
    pub fn new(limit: Limit) -> Self {
        Self {
            shared: Arc::new(Shared {
                current: ArcSwap::from_pointee(Value::new(limit)),
                needs: Mutex::new(Needs::default()),
            }),
        }
    }

    /// The current value.
    pub fn get(&self) -> Limit {
        self.shared.current.load().limit.clone()
    }

    /// Replaces the value: the next decision of every user decides with
    /// `limit`. Refused, keeping the current value, when `limit` has another
    /// name ([`ConfigError::Live`]: the name is the identity of the state),
    /// or turns a [concurrency limit](Limit::concurrency) into a rate limit
    /// or back ([`ConfigError::Live`]), when a layer using this limit has a
    /// fixed cost over its capacity
    /// ([`ConfigError::FixedCostExceedsCapacity`]), or when a rule gives it tiers
    /// of another algorithm ([`ConfigError::Tiers`]).
    pub fn set(&self, limit: Limit) -> Result<(), ConfigError> {
        let needs = self.lock_needs();
        self.check(&needs, &limit)?;
        self.shared.current.store(Arc::new(Value::new(limit)));
        Ok(())
    }

    fn lock_needs(&self) -> std::sync::MutexGuard<'_, Needs> {
        crate::sync::lock(&self.shared.needs)
    }

    /// Whether `limit` may replace the current value, given `needs`.
    fn check(&self, needs: &Needs, limit: &Limit) -> Result<(), ConfigError> {
        let name = self.name();
        if limit.name() != name {
            return Err(ConfigError::Live(format!(
                "limit {name:?} cannot become {:?}: a live limit keeps its name, which names \
                 its state",
                limit.name()
            )));
        }
        if limit.is_concurrency() != self.shared.current.load().limit.is_concurrency() {
            return Err(ConfigError::Live(format!(
                "limit {name:?} cannot change between a concurrency limit and a rate limit: \
                 the grants of one are leases given back, the other's are kept"
            )));
        }
        if limit.capacity() < needs.cost {
            return Err(ConfigError::FixedCostExceedsCapacity {
                cost: needs.cost,
                limit: name.to_owned(),
                capacity: limit.capacity(),
            });
        }
        if needs
            .stored
            .is_some_and(|stored| stored != limit.uses_stored_quota())
        {
            return Err(ConfigError::Tiers(format!(
                "limit {name:?} has tiers, built when it {} a stored quota: it keeps that \
                 (an override would not apply to them, or apply to them alone)",
                if limit.uses_stored_quota() {
                    "used no"
                } else {
                    "used"
                }
            )));
        }
        match needs.algorithm {
            Some(algorithm) if algorithm != limit.quota().algorithm() => {
                Err(ConfigError::Tiers(format!(
                    "limit {name:?} has tiers of the {algorithm} algorithm, so it keeps it (not {})",
                    limit.quota().algorithm()
                )))
            }
            _ => Ok(()),
        }
    }

    /// The name, the same for every value.
    pub fn name(&self) -> &'static str {
        self.shared.current.load().limit.shared_name()
    }

    /// Registers what a layer needs of every value: a fixed `cost` it can
    /// hold, and, for a rule with tiers, their algorithm and whether they
    /// read their keys' overrides (`tiers`, what they were built with).
    /// Checked against the current value first.
    pub(crate) fn require(
        &self,
        cost: Option<u64>,
        tiers: Option<(Algorithm, bool)>,
    ) -> Result<(), ConfigError> {
        let mut needs = self.lock_needs();
        let algorithm = tiers.map(|t| t.0);
        let wanted = Needs {
            cost: needs.cost.max(cost.unwrap_or(0)),
            algorithm: algorithm.or(needs.algorithm),
            stored: tiers.map(|t| t.1).or(needs.stored),
        };
        if let (Some(a), Some(b)) = (algorithm, needs.algorithm) {
            if a != b {
                return Err(ConfigError::Tiers(format!(
                    "limit {:?} has tiers of the {a} and of the {b} algorithm",
                    self.name()
                )));
            }
        }
        if let (Some((_, a)), Some(b)) = (tiers, needs.stored) {
            if a != b {
                return Err(ConfigError::Tiers(format!(
                    "limit {:?} has tiers that read overrides and tiers that do not",
                    self.name()
                )));
            }
        }
        self.check(&wanted, &self.shared.current.load().limit)?;
        *needs = wanted;
        Ok(())
    }

    fn load(&self) -> Arc<Value> {
        self.shared.current.load_full()
    }
}

/// A set of live limits by name, such as the limits of a configuration
/// file: [`update`](Self::update) replaces them all from a new reading of
/// the file, or none of them.
///
/// ```
/// use tower_ratelimit::{LiveLimits, Limit, Quota};
///
/// let limits = LiveLimits::new([
///     Limit::new("per-ip", Quota::per_second(100).token_bucket())?,
///     Limit::new("login", Quota::per_minute(5).sliding_log())?,
/// ])?;
/// let per_ip = limits.get("per-ip").expect("defined above"); // give it to a layer
///
/// // a reload: both limits, or an error and no change
/// let changed = limits.update([
///     Limit::new("per-ip", Quota::per_second(50).token_bucket())?,
///     Limit::new("login", Quota::per_minute(5).sliding_log())?,
/// ])?;
/// assert_eq!(changed, ["per-ip"]);
/// assert_eq!(per_ip.get().capacity(), 50);
/// assert!(limits.update([Limit::new("per-ip", Quota::per_second(10).token_bucket())?]).is_err());
/// # Ok::<(), tower_ratelimit::ConfigError>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct LiveLimits {
    limits: Arc<BTreeMap<&'static str, LiveLimit>>,
}

impl LiveLimits {
    /// A live limit for each of `limits`; [`ConfigError::DuplicateName`]
    /// when two share a name.
    pub fn new(limits: impl IntoIterator<Item = Limit>) -> Result<Self, ConfigError> {
        let by_name = Self::by_name(limits)?;
        let limits = by_name
            .into_iter()
            .map(|(name, limit)| (name, LiveLimit::new(limit)))
            .collect();
        Ok(Self {
            limits: Arc::new(limits),
        })
    }

    fn by_name(
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<BTreeMap<&'static str, Limit>, ConfigError> {
        let mut by_name = BTreeMap::new();
        for limit in limits {
            let name = limit.shared_name();
            if by_name.insert(name, limit).is_some() {
                return Err(ConfigError::DuplicateName(name.to_owned()));
            }
        }
        Ok(by_name)
    }

    /// The live limit named `name`.
    pub fn get(&self, name: &str) -> Option<LiveLimit> {
        self.limits.get(name).cloned()
    }

    /// The names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.limits.keys().copied()
    }

    /// Replaces every limit with the one of its name in `limits`, and
    /// returns the names of those whose value changed. All or nothing: when
    /// `limits` misses a name of the set, has a name the set has not, has a
    /// name twice, or has a value [`LiveLimit::set`] refuses, the error names
    /// the limit and nothing changes. (Each limit is swapped on its own: a
    /// decision made during the update may see some limits new and others
    /// still old.)
    pub fn update(
        &self,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<Vec<&'static str>, ConfigError> {
        let mut new = Self::by_name(limits)?;
        if let Some(name) = new.keys().find(|name| !self.limits.contains_key(*name)) {
            return Err(ConfigError::Live(format!(
                "no live limit is named {name:?} (adding a limit takes a restart)"
            )));
        }
        let mut pairs = Vec::with_capacity(self.limits.len());
        for (name, live) in self.limits.iter() {
            let Some(limit) = new.remove(name) else {
                return Err(ConfigError::Live(format!(
                    "limit {name:?} is missing (removing a limit takes a restart)"
                )));
            };
            pairs.push((live, limit));
        }
        // every value checked, with every limit's needs held, before any is set
        let mut held = Vec::with_capacity(pairs.len());
        for (live, limit) in &pairs {
            let needs = live.lock_needs();
            live.check(&needs, limit)?;
            held.push(needs);
        }
        let mut changed = Vec::new();
        for ((live, limit), needs) in pairs.into_iter().zip(held) {
            let current = live.load();
            if current.limit.quota() != limit.quota()
                || current.limit.is_shadow() != limit.is_shadow()
            {
                changed.push(live.name());
                live.shared.current.store(Arc::new(Value::new(limit)));
            }
            drop(needs);
        }
        Ok(changed)
    }
}

/// What a limiter or a layer takes for each limit: a [`Limit`], fixed for
/// the limiter's life, or a [`LiveLimit`], read for each decision. Made by
/// `From`: pass either where a `impl Into<LimitSource>` is asked for.
#[derive(Clone, Debug)]
pub struct LimitSource(Source);

#[derive(Clone, Debug)]
enum Source {
    Fixed(Limit),
    Live(LiveLimit),
}

impl From<Limit> for LimitSource {
    fn from(limit: Limit) -> Self {
        Self(Source::Fixed(limit))
    }
}

impl From<LiveLimit> for LimitSource {
    fn from(live: LiveLimit) -> Self {
        Self(Source::Live(live))
    }
}

impl From<&LiveLimit> for LimitSource {
    fn from(live: &LiveLimit) -> Self {
        Self(Source::Live(live.clone()))
    }
}

impl LimitSource {
    /// The limit to decide with now.
    #[inline]
    pub(crate) fn load(&self) -> Current<'_> {
        match &self.0 {
            Source::Fixed(limit) => Current::Fixed(limit),
            Source::Live(live) => Current::Live(live.load()),
        }
    }

    /// The name, the same for every value.
    pub(crate) fn name(&self) -> &'static str {
        match &self.0 {
            Source::Fixed(limit) => limit.shared_name(),
            Source::Live(live) => live.name(),
        }
    }

    /// The live limit, if this is one.
    pub(crate) fn live(&self) -> Option<&LiveLimit> {
        match &self.0 {
            Source::Fixed(_) => None,
            Source::Live(live) => Some(live),
        }
    }
}

/// A limit as one decision reads it: borrowed when fixed, the value current
/// when the decision began when live.
#[derive(Debug)]
pub(crate) enum Current<'a> {
    Fixed(&'a Limit),
    Live(Arc<Value>),
    /// A live limit's twin for keyless requests.
    LiveKeyless(Arc<Value>),
}

impl Current<'_> {
    /// The twin of a live limit for keyless requests.
    pub(crate) fn keyless(self) -> Self {
        match self {
            Current::Live(value) => Current::LiveKeyless(value),
            other => other,
        }
    }
}

impl Deref for Current<'_> {
    type Target = Limit;

    #[inline]
    fn deref(&self) -> &Limit {
        match self {
            Current::Fixed(limit) => limit,
            Current::Live(value) => &value.limit,
            Current::LiveKeyless(value) => &value.keyless,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Quota;

    fn limit(name: &str, per_minute: u64) -> Limit {
        Limit::new(name, Quota::per_minute(per_minute).sliding_log()).expect("valid")
    }

    #[test]
    fn set_keeps_the_name_and_the_needs() {
        let live = LiveLimit::new(limit("a", 10));
        assert!(matches!(
            live.set(limit("b", 10)),
            Err(ConfigError::Live(_))
        ));
        live.require(Some(5), Some((Algorithm::SlidingLog, false)))
            .expect("10 holds 5");
        assert!(matches!(
            live.set(limit("a", 4)),
            Err(ConfigError::FixedCostExceedsCapacity { cost: 5, .. })
        ));
        let gcra = Limit::new("a", Quota::per_minute(10).gcra()).expect("valid");
        assert!(matches!(live.set(gcra), Err(ConfigError::Tiers(_))));
        assert_eq!(live.get().capacity(), 10);
        live.set(limit("a", 5)).expect("holds the cost");
        assert_eq!(live.get().capacity(), 5);
        assert!(live.require(Some(6), None).is_err());
    }

    #[test]
    fn update_is_all_or_nothing() {
        let set = LiveLimits::new([limit("a", 1), limit("b", 2)]).expect("distinct");
        let a = set.get("a").expect("a");
        assert!(set.update([limit("a", 3)]).is_err()); // b missing
        assert!(set
            .update([limit("a", 3), limit("b", 2), limit("c", 1)])
            .is_err());
        assert!(set
            .update([limit("a", 3), limit("a", 4), limit("b", 2)])
            .is_err());
        assert_eq!(a.get().capacity(), 1);
        assert_eq!(set.update([limit("a", 3), limit("b", 2)]), Ok(vec!["a"]));
        assert_eq!(a.get().capacity(), 3);
        assert!(a.require(Some(4), None).is_err());
        a.require(Some(2), None).expect("3 holds 2");
        assert!(set.update([limit("a", 1), limit("b", 9)]).is_err()); // a below its cost
        assert_eq!(set.get("b").expect("b").get().capacity(), 2);
    }
}
