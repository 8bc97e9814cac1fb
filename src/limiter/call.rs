//! The one way every decision is made ([`Limiter::answer`]): its checks
//! classified once and dispatched; the store's call made (at once on a
//! store that answers at once, else awaited by its deadline), measured,
//! traced, counted, answered from the cache of denials when it can be, and
//! its reply read into a [`Decision`].

use std::time::Duration;

use tracing::Instrument;

use super::deny_cache::{DenyCache, Sent};
use super::hot::HotPools;
use super::{Checks, Grant, Limiter, Refund};
use crate::algorithm::{self, Reply};
use crate::decision::{Decision, LimitStatus, Verdict};
use crate::metrics::{Outcome, StoreTimer};
use crate::store::{Answer, BoxFuture, Check, Deadline};
use crate::{Error, Limit};

/// The limit names of a decision, for its span.
struct LimitNames<'a, 'b>(&'a [Check<'b>]);

impl std::fmt::Display for LimitNames<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, check) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(check.limit.name())?;
        }
        Ok(())
    }
}

/// How a decision is asked: how far ahead its grant may be reserved,
/// whether it only looks (`dry`), whether its grant can be given back, and
/// whether it is counted in the metrics (a shadow round is not: see
/// `shadow.rs`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ask {
    pub(crate) max_wait: Duration,
    pub(crate) dry: bool,
    pub(crate) refundable: bool,
    pub(crate) counted: bool,
}

impl Ask {
    /// Now, taking, counted, not to be given back.
    pub(crate) const NOW: Ask = Ask {
        max_wait: Duration::ZERO,
        dry: false,
        refundable: false,
        counted: true,
    };

    /// Reserved up to `max_wait` ahead; given back when `refundable`.
    pub(crate) fn ahead(max_wait: Duration, refundable: bool) -> Ask {
        Ask {
            max_wait,
            refundable,
            ..Ask::NOW
        }
    }
}

/// What a decision's checks need, found once: the store alone, or a
/// component around it.
enum Route<'a> {
    /// The store's one call (through the cache of denials).
    Store,
    /// A concurrency limit that may wait: decided again until a permit is
    /// free (see [`Limiter::wait_for_permit`]).
    WaitForPermit,
    /// Limits in shadow mode (see `shadow.rs`).
    Shadow,
    /// Hot limits granted from local batches (see `hot.rs`).
    Hot(&'a HotPools),
}

impl Limiter {
    /// The one way every decision is made: its checks classified once and
    /// decided by the store or by the component their kind needs; ready at
    /// once when the store answers at once (in memory), else a future.
    pub(crate) fn answer<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        ask: Ask,
    ) -> Answer<'a, Result<Grant, Error>> {
        // a limiter for sets alone has no limits of its own to decide
        if checks.is_empty() && self.inner.limits.is_empty() {
            return Answer::Now(Err(Error::Config(crate::ConfigError::NoLimits)));
        }
        // (one pass over the checks: this runs for every decision)
        let (mut empty, mut leases, mut shadow) = (false, false, false);
        for check in checks {
            empty |= check.key.is_empty();
            leases |= check.limit.is_concurrency();
            shadow |= check.limit.is_shadow();
        }
        if empty {
            return Answer::Now(Err(Error::EmptyKey));
        }
        let waits = !ask.max_wait.is_zero();
        let route = if waits && leases {
            Route::WaitForPermit
        } else if shadow {
            Route::Shadow
        } else {
            match &self.inner.hot {
                Some(hot)
                    if !ask.dry && ask.counted && !waits && checks.iter().any(HotPools::serves) =>
                {
                    Route::Hot(hot)
                }
                _ => Route::Store,
            }
        };
        let decided: BoxFuture<'a, Result<Decision, Error>> = match route {
            Route::Store => return self.decision_at_store(checks, ask, self.deadline()),
            Route::WaitForPermit => Box::pin(self.wait_for_permit(checks, ask)),
            Route::Shadow if waits => Box::pin(super::shadow::decide_ahead(self, checks, ask)),
            Route::Shadow => Box::pin(super::shadow::decide(self, checks, ask)),
            Route::Hot(hot) => Box::pin(hot.decide(self, checks)),
        };
        Answer::Later(Box::pin(async move {
            let decision = decided.await?;
            Ok(self.grant(checks, decision, ask.refundable))
        }))
    }

    /// The decision of `checks` as [`answer`](Self::answer) makes it,
    /// awaited.
    pub(crate) async fn decided(&self, checks: &[Check<'_>], ask: Ask) -> Result<Decision, Error> {
        match self.answer(checks, ask) {
            Answer::Now(result) => result.map(Grant::into_decision),
            Answer::Later(grant) => grant.await.map(Grant::into_decision),
        }
    }

    /// `decision` of `checks` as a grant, given back only when `refundable`.
    fn grant(&self, checks: &[Check<'_>], decision: Decision, refundable: bool) -> Grant {
        let refund = if refundable {
            Refund::of(self, &decision, Self::charged(checks, &decision))
        } else {
            None
        };
        Grant::new(decision, refund)
    }

    /// A decision with a [concurrency limit](Limit::concurrency) that may
    /// wait `max_wait`: no reservation ahead (a lease renewed meanwhile
    /// would run beside the reserved one), but the decision made again, at
    /// pauses of 10 ms doubling up to 200 ms, until it is granted, refused
    /// for good, or `max_wait` has passed (the last refusal is the answer).
    async fn wait_for_permit(&self, checks: &[Check<'_>], ask: Ask) -> Result<Decision, Error> {
        let until = tokio::time::Instant::now() + ask.max_wait;
        let mut pause = Duration::from_millis(10);
        let now = Ask {
            max_wait: Duration::ZERO,
            refundable: false,
            ..ask
        };
        loop {
            let decision = self.decided(checks, now).await?;
            let waited = tokio::time::Instant::now() + pause;
            if decision.is_allowed() || decision.retry_after().is_none() || waited > until {
                return Ok(decision);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// One decision by the store: the store call, in a `rate_limit` span
    /// (only while `debug` is enabled), measured and (when counted) counted
    /// (see [`crate::metrics`]), answered from the cache of denials when it
    /// can be; at once when the store answers at once. A store that waits
    /// answers by `deadline` (a started one: what is left of it).
    pub(super) fn decision_at_store<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        ask: Ask,
        deadline: Deadline,
    ) -> Answer<'a, Result<Grant, Error>> {
        let Ask {
            dry,
            counted: plain,
            refundable,
            ..
        } = ask;
        let max_wait = i64::try_from(ask.max_wait.as_micros()).unwrap_or(i64::MAX);
        // A denial known to hold needs no round trip (not for a look, which
        // must see what the store says now; a cost over a capacity is
        // answered "never" by the store; a stored quota may be
        // raised, and a lease of a concurrency limit released, by another
        // instance at any time). A denial is cached at one cost: not for
        // checks of several costs (a layer's rules may each cost another).
        let cost = checks.first().map_or(0, |c| c.cost);
        let fits = || {
            checks.iter().all(|c| {
                c.cost == cost
                    && c.cost <= c.limit.params().capacity()
                    && !c.limit.uses_stored_quota()
                    && !c.limit.is_concurrency()
            })
        };
        let denials = self
            .inner
            .denials
            .as_ref()
            .filter(|_| !dry && plain && fits());
        let sent = denials.map_or_else(Default::default, DenyCache::sent);
        // the key is only built while the cache holds a denial, or for a new one
        let cache_key = denials
            .filter(|d| d.holds_any())
            .map(|_| DenyCache::key(checks));
        if let (Some(denials), Some(key)) = (denials, &cache_key) {
            if let Some(denied) = denials.lookup(key, cost, max_wait, sent.at) {
                let result = Ok(denied);
                super::count::count(checks, &result, Outcome::LocalCache);
                // (a denial: nothing to give back)
                return Answer::Now(result.map(|denied| Grant::new(denied, None)));
            }
        }
        // (checked first: without a subscriber, tracing's `log` fallback,
        // which axum turns on, would build the span for nothing)
        let span = if tracing::level_enabled!(tracing::Level::DEBUG) {
            tracing::debug_span!(
                target: "tower_ratelimit",
                "rate_limit",
                limits = %LimitNames(checks),
                outcome = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        let pending = Pending {
            limiter: self,
            checks,
            max_wait,
            dry,
            plain,
            refundable,
            denials,
            cache_key,
            sent,
            cost,
            timer: StoreTimer::start(),
        };
        match self
            .inner
            .store
            .engine()
            .decide(checks, max_wait, dry, deadline)
        {
            Answer::Now(reply) => Answer::Now(pending.finish(reply, span)),
            // (instrumented only with a span: entering and leaving a
            // disabled one on every poll is not free)
            Answer::Later(reply) if span.is_none() => {
                Answer::Later(Box::pin(async move { pending.finish(reply.await, span) }))
            }
            Answer::Later(reply) => Answer::Later(Box::pin(async move {
                let reply = reply.instrument(span.clone()).await;
                pending.finish(reply, span)
            })),
        }
    }

    /// When a store call starting now must have answered: the store bounds
    /// its own waits by it (see [`Deadline`]).
    pub(super) fn deadline(&self) -> Deadline {
        Deadline::after(self.inner.timeout)
    }

    /// One check of `cost` per (limit, key) pair.
    pub(crate) fn checks<'a>(
        pairs: impl Iterator<Item = (&'a Limit, &'a [u8])>,
        cost: u64,
    ) -> Checks<'a> {
        let cost = Self::cost(cost);
        let mut checks = Checks::new();
        for (limit, key) in pairs {
            checks.push(Check { limit, key, cost });
        }
        checks
    }

    pub(crate) fn cost(cost: u64) -> i64 {
        // Costs above 2^53 can never fit any validated limit; clamp so the
        // arithmetic in both stores stays exact.
        i64::try_from(cost.min(1 << 53)).unwrap_or(i64::MAX)
    }

    /// The status of `check`, the `i`-th limit of `reply`, as `status`
    /// says (its capacity and window a stored quota's when one decided).
    pub(super) fn limit_status(
        check: &Check<'_>,
        reply: &Reply,
        i: usize,
        status: &algorithm::Status,
        violated: bool,
        shadow: bool,
    ) -> LimitStatus {
        let us = |us: i64| u64::try_from(us).unwrap_or(0);
        let limit = check.limit;
        let (capacity, window_us) = match reply.stored(i) {
            Some(params) => (
                u64::try_from(params.capacity()).unwrap_or(0),
                params.policy_window_us(),
            ),
            None => (limit.capacity(), limit.policy_window_us()),
        };
        LimitStatus {
            name: limit.shared_name(),
            algorithm: limit.quota().algorithm(),
            limit: capacity,
            window_us,
            remaining: us(status.remaining()),
            wait_us: status.wait().map_or(u64::MAX, us),
            reset_us: us(status.reset()),
            violated: violated && !shadow,
            shadow,
            would_refuse: violated && shadow,
            blocked: matches!(status, algorithm::Status::Blocked { .. }),
        }
    }

    #[inline(always)]
    pub(super) fn decision_of(
        checks: &[Check<'_>],
        reply: Reply,
        max_wait: i64,
    ) -> Result<Decision, Error> {
        if reply.limits.len() != checks.len() {
            return Err(Error::UnexpectedReply(format!(
                "{} statuses for {} limits",
                reply.limits.len(),
                checks.len()
            )));
        }
        let us = |us: i64| u64::try_from(us).unwrap_or(0);
        let (verdict, wait) = match reply.verdict {
            algorithm::VerdictCode::Granted => (Verdict::Allowed, us(reply.wait)),
            algorithm::VerdictCode::Denied => (
                Verdict::Denied {
                    retry_after: Duration::from_micros(us(reply.wait)),
                },
                0,
            ),
            algorithm::VerdictCode::Never => (Verdict::CostExceedsCapacity, 0),
        };
        let mut decision = Decision::unbound(verdict, wait);
        for (i, (check, status)) in checks.iter().zip(&reply.limits).enumerate() {
            let blocked = matches!(status, algorithm::Status::Blocked { .. });
            let wait = status.wait();
            // (a block refuses whatever the wait allowed: it is never
            // reserved through)
            let violated = match reply.verdict {
                algorithm::VerdictCode::Never => wait.is_none(),
                algorithm::VerdictCode::Denied => blocked || wait.is_some_and(|w| w > max_wait),
                algorithm::VerdictCode::Granted => false,
            };
            // a limit in shadow mode never refuses
            let shadow = check.limit.is_shadow();
            let status = Self::limit_status(check, &reply, i, status, violated, shadow);
            decision.statuses.push(status);
        }
        decision.bind();
        if reply.granted() {
            decision.granted = checks
                .first()
                .map_or(0, |c| u64::try_from(c.cost).unwrap_or(0));
        }
        decision.at = reply.at();
        Ok(decision)
    }
}

/// A decision between its store call and the store's reply: what the reply
/// is read, counted and cached with.
struct Pending<'a> {
    limiter: &'a Limiter,
    checks: &'a [Check<'a>],
    max_wait: i64,
    dry: bool,
    plain: bool,
    refundable: bool,
    denials: Option<&'a DenyCache>,
    /// The denial cache's key, when it was built before the call.
    cache_key: Option<Vec<u8>>,
    sent: Sent,
    cost: i64,
    timer: StoreTimer,
}

impl Pending<'_> {
    /// The decision of the store's `reply`: measured, traced, counted, and
    /// a denial cached.
    #[inline(always)]
    fn finish(self, reply: Result<Reply, Error>, span: tracing::Span) -> Result<Grant, Error> {
        self.limiter.called(self.timer, "decide", reply.is_err());
        let checks = self.checks;
        let result = reply.and_then(|reply| Limiter::decision_of(checks, reply, self.max_wait));
        let outcome = super::count::outcome_of(&result);
        span.record("outcome", outcome.as_str());
        if !self.dry && self.plain {
            super::count::count(checks, &result, outcome);
        }
        if let (Some(denials), Ok(decision)) = (self.denials, &result) {
            // a penalized limit's refusals are counted by the store: its
            // denials are cached only while it blocks (until the block
            // ends: exact, but for an unblock by another process)
            let counted = |(c, s): (&Check<'_>, &LimitStatus)| {
                c.limit.pen_params().is_none() || s.is_blocked()
            };
            if !decision.is_allowed() && checks.iter().zip(decision.statuses()).all(counted) {
                let key = self.cache_key.unwrap_or_else(|| DenyCache::key(checks));
                denials.insert(key, checks, self.cost, self.sent, decision);
            }
        }
        let limiter = self.limiter;
        result.map(|decision| limiter.grant(checks, decision, self.refundable))
    }
}
