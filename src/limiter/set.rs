//! Sets: several limits, each with its own key and cost, decided in one
//! store call ([`Limiter::decide_set`]), counted together or each on its
//! own ([`SetMode`]): what a rate limit service decides for the
//! descriptors of one request.

use std::collections::HashMap;
use std::time::Duration;

use smallvec::SmallVec;

use super::{Ask, Limiter};
use crate::algorithm::{self, EachMode, Reply};
use crate::decision::{Decision, Verdict};
use crate::metrics::StoreTimer;
use crate::store::Check;
use crate::{Error, Limit};

/// One member of a set ([`Limiter::decide_set`]): a limit, a key in it, and
/// what to take from it (or give back to it).
#[derive(Debug, Clone, Copy)]
pub struct SetItem<'a> {
    /// The limit. Any limit: the limiter's own limits take no part in a
    /// set, and a set's limits are registered nowhere. (A limit's name is
    /// kept for the process's life, as every limit's: limits made for one
    /// request, such as a client's override, should share one name; the
    /// stores keep their state by name and key, and the Lua library's
    /// cache of parsed limits is bounded.)
    pub limit: &'a Limit,
    /// The key (not empty).
    pub key: &'a [u8],
    /// The amount to take; 0 checks without taking.
    pub cost: u64,
    /// Give `cost` back instead of taking it: a refund, as of a grant made
    /// now (a fixed window uncounts it in the current window, a sliding
    /// window counter from the current window, a token bucket and GCRA
    /// take it back, never above their capacity; a sliding log drops only
    /// an entry made at this very microsecond, so in effect nothing). Never
    /// below empty. The item is then checked at a cost of 0.
    pub refund: bool,
}

impl<'a> SetItem<'a> {
    /// Takes `cost` of `limit` for `key`.
    pub fn new(limit: &'a Limit, key: &'a [u8], cost: u64) -> Self {
        Self {
            limit,
            key,
            cost,
            refund: false,
        }
    }

    /// Gives `cost` back to `limit` for `key` (see [`SetItem::refund`]).
    pub fn refund(limit: &'a Limit, key: &'a [u8], cost: u64) -> Self {
        Self {
            refund: true,
            ..Self::new(limit, key, cost)
        }
    }
}

/// How the items of a set are counted ([`Limiter::decide_set`]). In every
/// mode an item is *over* when its cost does not fit its limit now (a cost
/// of 0: when its limit is spent beyond its capacity), and the decision is
/// allowed when no item is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SetMode {
    /// All or nothing: every item takes its cost if none is over, else none
    /// takes anything (the crate's own decisions: denials take nothing).
    #[default]
    AllOrNothing,
    /// Each item on its own, counted always: every cost is taken now, past
    /// the limit too (a fixed window's count goes over its limit, a bucket
    /// into debt), whatever the other items say. Envoy's rate limit service
    /// (envoyproxy/ratelimit) counts descriptors so.
    EachCounted,
    /// Each item on its own, sparing the items within their limits when
    /// any is over: if no item is over, every cost is taken; if one is,
    /// only the items over take theirs. envoyproxy/ratelimit counts so
    /// with `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`.
    EachSparing,
}

impl SetMode {
    fn code(self) -> EachMode {
        match self {
            SetMode::AllOrNothing => EachMode::All,
            SetMode::EachCounted => EachMode::Counted,
            SetMode::EachSparing => EachMode::Sparing,
        }
    }
}

impl Limiter {
    /// Decides a set of items, each a limit, a key and a cost, in one store
    /// call (one `FCALL` on Redis; on Redis Cluster one per hash slot the
    /// keys fall in, in parallel), at one clock, counted as `mode` says.
    /// (On Redis Cluster, with [`SetMode::EachSparing`] and
    /// [`SetMode::AllOrNothing`], the slots where no item was over give
    /// back what they counted when an item is over in another slot, as the
    /// crate's decisions across slots do: not atomically with the calls.)
    /// The decision has one status per item, in order: its limit, what is
    /// left after the counting ([`LimitStatus::remaining`](crate::LimitStatus::remaining)), when its limit
    /// is whole again ([`LimitStatus::reset_after`](crate::LimitStatus::reset_after)) and whether it is over
    /// ([`LimitStatus::is_violated`](crate::LimitStatus::is_violated)); it is allowed when no item is over,
    /// else denied with the longest wait among the items over
    /// ([`Verdict::CostExceedsCapacity`] when a cost exceeds a capacity).
    ///
    /// The limiter's own limits take no part (a limiter for sets alone is
    /// built with [`LimiterBuilder::build_for_sets`](crate::LimiterBuilder::build_for_sets)):
    /// its store, timeout and metrics of store calls are used. Each item's limit is decided as
    /// configured but for its [shadow mode](Limit::shadow), [penalty](Limit::with_penalty)
    /// and [hot-key](Limit::with_hot_key) batches, which a set neither reads nor
    /// feeds (a caller that wants a shadow limit reads its status and lets
    /// the request pass); a [stored quota](Limit::use_stored_quota) decides
    /// as it does elsewhere. Nothing is reserved ahead and no denial is
    /// answered from the cache of denials, but with
    /// [`SetMode::AllOrNothing`] when every item takes a cost (no refund, no
    /// check of 0): the set is then the crate's plain decision over the
    /// items (as [`check`](Limiter::check), with a key and cost per limit),
    /// which the cache of denials may answer.
    ///
    /// Items of one limit (by name) and key are one counter: their costs
    /// (a refund's negative) are summed and decided once, with the first
    /// one's limit, and each of them answered with the counter's status.
    /// An item with an empty key is refused ([`Error::EmptyKey`]); an empty
    /// set is allowed at once.
    ///
    /// ```
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota, SetItem, SetMode};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let store = MemoryStore::new();
    /// let per_user = Limit::new("per-user", Quota::per_minute(2).fixed_window())?;
    /// let per_path = Limit::new("per-path", Quota::per_minute(100).fixed_window())?;
    /// let limiter = Limiter::new(store, per_user.clone());
    /// let set = [
    ///     SetItem::new(&per_user, b"alice", 1),
    ///     SetItem::new(&per_path, b"/upload", 1),
    /// ];
    /// for _ in 0..2 {
    ///     assert!(limiter.decide_set(&set, SetMode::EachCounted).await?.is_allowed());
    /// }
    /// // the third is over "per-user", and still counted under both
    /// let d = limiter.decide_set(&set, SetMode::EachCounted).await?;
    /// assert!(!d.is_allowed());
    /// assert!(d.statuses()[0].is_violated() && !d.statuses()[1].is_violated());
    /// assert_eq!(d.statuses()[1].remaining(), 97);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn decide_set(
        &self,
        items: &[SetItem<'_>],
        mode: SetMode,
    ) -> Result<Decision, Error> {
        if items.is_empty() {
            return Ok(Decision::unbound(Verdict::Allowed, 0));
        }
        if items.iter().any(|item| item.key.is_empty()) {
            return Err(Error::EmptyKey);
        }
        // one check per counter (limit name and key): the items of one
        // counter summed, each answered with its counter's status
        let mut checks: SmallVec<[Check<'_>; 2]> = SmallVec::new();
        let mut of_item: SmallVec<[usize; 2]> = SmallVec::with_capacity(items.len());
        let mut counters: HashMap<(&str, &[u8]), usize> = HashMap::new();
        for item in items {
            let cost = Self::cost(item.cost);
            let cost = if item.refund { -cost } else { cost };
            let at = *counters
                .entry((item.limit.name(), item.key))
                .or_insert_with(|| {
                    checks.push(Check {
                        limit: item.limit,
                        key: item.key,
                        cost: 0,
                    });
                    checks.len() - 1
                });
            if let Some(check) = checks.get_mut(at) {
                check.cost = check.cost.saturating_add(cost);
            }
            of_item.push(at);
        }
        let plain = |c: &Check<'_>| !c.limit.is_shadow() && !c.limit.is_concurrency();
        let decision =
            if mode == SetMode::AllOrNothing && checks.iter().all(|c| c.cost > 0 && plain(c)) {
                self.decided(&checks, Ask::NOW).await?
            } else {
                let store = &self.inner.store;
                let timer = StoreTimer::start();
                let reply = store
                    .engine()
                    .each(&checks, mode.code(), self.deadline())
                    .get()
                    .await;
                self.called(timer, "decide_set", reply.is_err());
                Self::decision_of_set(&checks, reply?)?
            };
        if checks.len() == items.len() {
            return Ok(decision);
        }
        // back to one status per item
        let mut per_item = decision.clone();
        per_item.statuses = of_item
            .iter()
            .filter_map(|&at| decision.statuses.get(at).cloned())
            .collect();
        per_item.bind();
        Ok(per_item)
    }

    /// The decision of a set's `reply` (see `each` in `lua/limits.lua`):
    /// an item is over when its limit did not allow its cost now.
    fn decision_of_set(checks: &[Check<'_>], reply: Reply) -> Result<Decision, Error> {
        if reply.limits.len() != checks.len() {
            return Err(Error::UnexpectedReply(format!(
                "{} statuses for a set of {}",
                reply.limits.len(),
                checks.len()
            )));
        }
        let us = |us: i64| u64::try_from(us).unwrap_or(0);
        let verdict = match reply.verdict {
            algorithm::VerdictCode::Granted => Verdict::Allowed,
            algorithm::VerdictCode::Denied => Verdict::Denied {
                retry_after: Duration::from_micros(us(reply.wait)),
            },
            algorithm::VerdictCode::Never => Verdict::CostExceedsCapacity,
        };
        let mut decision = Decision::unbound(verdict, 0);
        for (i, (check, status)) in checks.iter().zip(&reply.limits).enumerate() {
            // (a set reports each item over or not: shadow mode is its caller's)
            let violated = status.wait() != Some(0);
            let status = Self::limit_status(check, &reply, i, status, violated, false);
            decision.statuses.push(status);
        }
        decision.bind();
        decision.at = reply.at();
        Ok(decision)
    }
}
