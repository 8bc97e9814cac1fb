//! What a check returns: [`Decision`], its [`Verdict`] and one [`LimitStatus`] per limit.

use std::time::Duration;

use smallvec::SmallVec;

use crate::fields::{Fields, HeaderSet, Shown};
use crate::Algorithm;

/// Whether the cost was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// Granted (at once, or after [`Decision::delay`] for a reservation).
    Allowed,
    /// Not granted, and nothing was consumed. The same cost would be granted
    /// after `retry_after` if nothing else consumes in between.
    Denied {
        /// Exact time until the same cost would succeed.
        retry_after: Duration,
    },
    /// The cost exceeds a limit's capacity: it can never be granted, however
    /// long the caller waits. Nothing was consumed.
    CostExceedsCapacity,
}

/// The state of one limit after a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitStatus {
    /// Interned (see [`crate::Limit::new`]): no reference count to keep.
    pub(crate) name: &'static str,
    pub(crate) limit: u64,
    /// The times in microseconds, as the stores count them: a status (and a
    /// decision) stays small enough to move without a `memcpy` call.
    pub(crate) window_us: u64,
    pub(crate) remaining: u64,
    /// `u64::MAX` for "never" (a cost over the capacity).
    pub(crate) wait_us: u64,
    pub(crate) reset_us: u64,
    pub(crate) algorithm: Algorithm,
    pub(crate) violated: bool,
    pub(crate) shadow: bool,
    pub(crate) would_refuse: bool,
    /// Whether the key is blocked by the limit's penalty.
    pub(crate) blocked: bool,
}

impl LimitStatus {
    /// The limit's name.
    pub fn name(&self) -> &str {
        self.name
    }

    /// The limit's algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The capacity: the most that can pass at once.
    pub fn capacity(&self) -> u64 {
        self.limit
    }

    /// Time for a spent capacity to come back in full (see [`crate::Limit::policy_window`]).
    pub fn window(&self) -> Duration {
        Duration::from_micros(self.window_us)
    }

    /// What could still be granted at once (after the grant, when granted).
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Time until this limit alone would grant the cost; `None` when the cost
    /// exceeds its capacity.
    pub fn available_in(&self) -> Option<Duration> {
        (self.wait_us != u64::MAX).then(|| Duration::from_micros(self.wait_us))
    }

    /// Time until this limit is fully replenished.
    pub fn reset_after(&self) -> Duration {
        Duration::from_micros(self.reset_us)
    }

    /// Whether this limit is one that refused the request (never for a
    /// limit in shadow mode: see [`would_refuse`](Self::would_refuse)).
    pub fn is_violated(&self) -> bool {
        self.violated
    }

    /// Whether the limit is in [shadow mode](crate::Limit::shadow).
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// For a limit in shadow mode, whether it would have refused the
    /// request had it been enforced (it then took nothing).
    pub fn would_refuse(&self) -> bool {
        self.would_refuse
    }

    /// Whether the key is blocked by this limit's
    /// [penalty](crate::Limit::with_penalty): refused until the block ends
    /// ([`available_in`](Self::available_in)), its [`remaining`](Self::remaining) 0.
    pub fn is_blocked(&self) -> bool {
        self.blocked
    }
}

/// As the rate-limit fields show it.
impl Shown for LimitStatus {
    fn name(&self) -> &str {
        self.name
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    fn window(&self) -> Duration {
        LimitStatus::window(self)
    }

    fn remaining(&self) -> u64 {
        self.remaining
    }

    fn reset_after(&self) -> Duration {
        LimitStatus::reset_after(self)
    }
}

/// The statuses of a decision, a [`LimitStatus`] per limit: inline for
/// one limit. (The scripts' per-limit statuses are `algorithm::Statuses`.)
pub(crate) type LimitStatuses = SmallVec<[LimitStatus; 1]>;

/// The answer to a check: a [`Verdict`] and the state of every limit.
///
/// The top-level figures (`capacity`, `remaining`, `reset_after`) are those of the
/// binding limit: the one that refused (longest wait) when denied, the one with
/// the least remaining when allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub(crate) verdict: Verdict,
    /// The reservation's wait, in microseconds.
    pub(crate) wait_us: u64,
    pub(crate) statuses: LimitStatuses,
    pub(crate) binding: u32,
    pub(crate) cached: bool,
    /// The amount granted: the cost, or what `Limiter::take_up_to` took;
    /// 0 unless allowed.
    pub(crate) granted: u64,
    /// The store time of the grant (us): what a refund names it by.
    pub(crate) at: i64,
    /// Whether the shadow limits were granted apart from the enforced ones
    /// (a reservation ahead): a refund then leaves them.
    pub(crate) shadow_apart: bool,
}

impl Decision {
    /// A decision; `wait_us` is the reservation's wait in microseconds.
    #[inline]
    pub(crate) fn new(verdict: Verdict, wait_us: u64, statuses: LimitStatuses) -> Self {
        let mut decision = Self::unbound(verdict, wait_us);
        decision.statuses = statuses;
        decision.bind();
        decision
    }

    /// A decision without statuses yet, for a caller that writes them in
    /// place (a decision is large to move), then [`bind`](Self::bind)s it.
    #[inline]
    pub(crate) fn unbound(verdict: Verdict, wait_us: u64) -> Self {
        Self {
            verdict,
            wait_us,
            statuses: LimitStatuses::new(),
            binding: 0,
            cached: false,
            granted: 0,
            at: 0,
            shadow_apart: false,
        }
    }

    /// Finds the binding limit among the statuses: an enforced one when
    /// there is one, with the least remaining when allowed, else the
    /// refusing one with the longest wait.
    #[inline]
    pub(crate) fn bind(&mut self) {
        let statuses = self.statuses.iter().enumerate();
        let binding = match self.verdict {
            Verdict::Allowed => statuses
                .min_by_key(|(_, s)| (s.shadow, s.remaining))
                .map_or(0, |(i, _)| i),
            Verdict::Denied { .. } | Verdict::CostExceedsCapacity => statuses
                .filter(|(_, s)| s.violated)
                .max_by_key(|(_, s)| s.wait_us)
                .map_or(0, |(i, _)| i),
        };
        // (a decision has at most a few limits)
        self.binding = u32::try_from(binding).unwrap_or(0);
    }

    /// The amount granted: the cost when allowed ([`Limiter::take_up_to`]:
    /// what was taken), 0 otherwise.
    ///
    /// [`Limiter::take_up_to`]: crate::Limiter::take_up_to
    pub fn granted_amount(&self) -> u64 {
        self.granted
    }

    /// Whether this denial was answered from the limiter's local cache of
    /// denials, without a store round trip (see [`crate::Limiter`]).
    pub fn from_local_cache(&self) -> bool {
        self.cached
    }

    /// The verdict.
    pub fn verdict(&self) -> Verdict {
        self.verdict
    }

    /// Whether the cost was granted.
    pub fn is_allowed(&self) -> bool {
        self.verdict == Verdict::Allowed
    }

    /// When denied, the exact time until the same cost would be granted.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.verdict {
            Verdict::Denied { retry_after } => Some(retry_after),
            _ => None,
        }
    }

    /// For a reservation ([`crate::Limiter::acquire`]), how long the grant lies
    /// in the future; zero for an immediate grant or a denial.
    pub fn delay(&self) -> Duration {
        Duration::from_micros(self.wait_us)
    }

    /// The binding limit's capacity.
    pub fn capacity(&self) -> u64 {
        self.binding().map_or(0, |s| s.limit)
    }

    /// The binding limit's remaining amount.
    pub fn remaining(&self) -> u64 {
        self.binding().map_or(0, |s| s.remaining)
    }

    /// The binding limit's time until full replenishment.
    pub fn reset_after(&self) -> Duration {
        self.binding()
            .map_or(Duration::ZERO, LimitStatus::reset_after)
    }

    /// The binding limit: see the type's documentation.
    pub fn binding(&self) -> Option<&LimitStatus> {
        self.statuses.get(self.binding as usize)
    }

    /// Adds to `headers` the rate-limit fields the layer writes on a
    /// response it forwards with this decision: `RateLimit-Policy` and
    /// `RateLimit` (limits in shadow mode left out), for a handler that
    /// calls the limiter itself and builds its own response (a `202
    /// Accepted` for a queued job). Appended, as the layer appends them,
    /// so that fields already there (an outer layer's) stay. For a
    /// refused decision, the layer's [`Refusal::of`](crate::layer::Refusal::of)
    /// is the whole response.
    ///
    /// Behind a layer, leave this to the layer: it adds the fields of its
    /// own decision to the handler's response, and these would be listed
    /// twice.
    ///
    /// ```
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let limiter = Limiter::new(MemoryStore::new(), Limit::new("sms", Quota::per_minute(5).sliding_log())?);
    /// let decision = limiter.check("+15550100", 1).await?;
    /// let mut response = http::Response::new("queued");
    /// *response.status_mut() = http::StatusCode::ACCEPTED;
    /// decision.insert_headers(response.headers_mut());
    /// assert_eq!(response.headers()["ratelimit-policy"], "\"sms\";q=5;w=60");
    /// assert_eq!(response.headers()["ratelimit"], "\"sms\";r=4;t=60");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn insert_headers(&self, headers: &mut http::HeaderMap) {
        if let Some(fields) = self.without_shadow().fields(&HeaderSet::default()) {
            fields.apply(headers);
        }
    }

    /// The rate-limit fields of this decision, per `set`: of every limit,
    /// so that the fields a response shows come from
    /// [`without_shadow`](Self::without_shadow).
    #[inline]
    pub(crate) fn fields(&self, set: &HeaderSet) -> Option<Fields> {
        Fields::of(&self.statuses, self.binding(), set)
    }

    /// Every limit's status, in the limiter's order.
    pub fn statuses(&self) -> &[LimitStatus] {
        &self.statuses
    }

    /// This decision after its grants were given back in the limits of
    /// `given_back` (each name with the amount given back to it, what the
    /// request paid that rule): their remaining amounts as the refund
    /// leaves them (never above their capacity), what the rate-limit fields
    /// of a response that did not count show.
    pub(crate) fn given_back<'a>(&mut self, given_back: impl Iterator<Item = (&'a str, u64)>) {
        for (name, amount) in given_back {
            if let Some(status) = self.statuses.iter_mut().find(|s| s.name == name) {
                status.remaining = status.remaining.saturating_add(amount).min(status.limit);
            }
        }
        self.bind();
    }

    /// This decision without the statuses of limits in shadow mode: what
    /// the rate-limit headers show.
    #[inline]
    pub(crate) fn without_shadow(&self) -> std::borrow::Cow<'_, Decision> {
        if self.statuses.iter().any(|s| s.shadow) {
            std::borrow::Cow::Owned(self.shown())
        } else {
            std::borrow::Cow::Borrowed(self)
        }
    }

    /// A copy without the statuses of limits in shadow mode.
    #[cold]
    fn shown(&self) -> Decision {
        let statuses = self
            .statuses
            .iter()
            .filter(|s| !s.shadow)
            .cloned()
            .collect();
        let mut shown = Decision::new(self.verdict, self.wait_us, statuses);
        shown.granted = self.granted;
        shown.at = self.at;
        shown
    }

    /// The limits that refused the request (empty when allowed).
    pub fn violated_limits(&self) -> impl Iterator<Item = &LimitStatus> {
        self.statuses.iter().filter(|s| s.violated)
    }
}
