//! One call of the store for a decision: made (at once on a store that
//! answers at once, else awaited by its deadline), measured, traced,
//! counted, answered from the cache of denials when it can be, and its
//! reply read into a [`Decision`].

use std::time::Duration;

use tracing::Instrument;

use super::deny_cache::{DenyCache, Sent};
use super::hot::HotPools;
use super::{Checks, Limiter};
use crate::algorithm::{self, Reply};
use crate::decision::{Decision, LimitStatus, Verdict};
use crate::metrics::{Outcome, StoreTimer};
use crate::store::{Answer, Check, Deadline};
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

impl Limiter {
    /// One decision, awaited: see [`decision`](Self::decision).
    pub(super) async fn run_once(
        &self,
        checks: &[Check<'_>],
        max_wait: Duration,
        dry: bool,
        plain: bool,
    ) -> Result<Decision, Error> {
        let max_wait = i64::try_from(max_wait.as_micros()).unwrap_or(i64::MAX);
        self.decision(checks, max_wait, dry, plain).get().await
    }

    /// One decision: a plain one with a hot limit partly from local
    /// batches (see `hot.rs`), else [`decision_at_store`](Self::decision_at_store).
    pub(super) fn decision<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
        plain: bool,
    ) -> Answer<'a, Result<Decision, Error>> {
        if checks.iter().any(|c| c.key.is_empty()) {
            return Answer::Now(Err(Error::EmptyKey));
        }
        if let Some(hot) = &self.inner.hot {
            if !dry && plain && max_wait == 0 && checks.iter().any(HotPools::serves) {
                return Answer::Later(Box::pin(self.decide_hot(hot, checks)));
            }
        }
        self.decision_at_store(checks, max_wait, dry, plain, self.deadline())
    }

    /// One decision: the store call, in a `rate_limit` span (only while
    /// `debug` is enabled), measured and (when `plain`) counted (see
    /// [`crate::metrics`]), answered from the cache of denials when it can
    /// be; at once when the store answers at once. A store that waits
    /// answers by `deadline` (a started one: what is left of it).
    pub(super) fn decision_at_store<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
        plain: bool,
        deadline: Deadline,
    ) -> Answer<'a, Result<Decision, Error>> {
        // A denial known to hold needs no round trip (not for a look, which
        // must see what the store says now; a cost over a capacity is
        // answered "never" by the store; a quota kept in the store may be
        // raised, and a lease of a concurrency limit released, by another
        // instance at any time).
        let cost = checks.first().map_or(0, |c| c.cost);
        let fits = || {
            checks.iter().all(|c| {
                c.cost <= c.limit.params().capacity()
                    && !c.limit.is_quota_from_store()
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
                return Answer::Now(result);
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
            denials,
            cache_key,
            sent,
            cost,
            timer: StoreTimer::start(),
        };
        match self.inner.store.decide(checks, max_wait, dry, deadline) {
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

    pub(super) fn cost(cost: u64) -> i64 {
        // Costs above 2^53 can never fit any validated limit; clamp so the
        // arithmetic in both stores stays exact.
        i64::try_from(cost.min(1 << 53)).unwrap_or(i64::MAX)
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
        let (verdict, wait) = match reply.outcome {
            algorithm::Outcome::Granted => (Verdict::Allowed, us(reply.wait)),
            algorithm::Outcome::Denied => (
                Verdict::Denied {
                    retry_after: Duration::from_micros(us(reply.wait)),
                },
                0,
            ),
            algorithm::Outcome::Never => (Verdict::CostExceedsCapacity, 0),
        };
        let mut decision = Decision::unbound(verdict, wait);
        for (i, (check, status)) in checks.iter().zip(&reply.limits).enumerate() {
            let limit = check.limit;
            // a quota kept in the store, when one decided
            let (capacity, window_us) = match reply.stored(i) {
                Some(params) => (
                    u64::try_from(params.capacity()).unwrap_or(0),
                    params.policy_window_us(),
                ),
                None => (limit.capacity(), limit.policy_window_us()),
            };
            let blocked = matches!(status, algorithm::Status::Blocked { .. });
            let wait = status.wait();
            let violated = match reply.outcome {
                algorithm::Outcome::Never => wait.is_none(),
                algorithm::Outcome::Denied => wait.is_some_and(|w| w > max_wait),
                algorithm::Outcome::Granted => false,
            };
            // a limit in shadow mode never refuses
            let shadow = limit.is_shadow();
            decision.statuses.push(LimitStatus {
                name: limit.shared_name(),
                algorithm: limit.quota().algorithm(),
                limit: capacity,
                window_us,
                remaining: us(status.remaining()),
                wait_us: wait.map_or(u64::MAX, us),
                reset_us: us(status.reset()),
                violated: violated && !shadow,
                shadow,
                would_refuse: violated && shadow,
                blocked,
            });
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
    fn finish(self, reply: Result<Reply, Error>, span: tracing::Span) -> Result<Decision, Error> {
        let store = &self.limiter.inner.store;
        self.timer.finish(|| store.kind(), "decide");
        #[cfg(feature = "metrics")]
        if let Ok(reply) = &reply {
            store.report_size(reply.now);
        }
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
        result
    }
}
