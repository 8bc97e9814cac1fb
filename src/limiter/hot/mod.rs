//! Hot keys (see [`Limit::with_hot_key`]): permits taken from the store in batches
//! and granted in this process.
//!
//! The pools are the store's (one per store, kept by `Shared::one`): every limiter and
//! layer over one store (its clones included) shares them, so a process
//! holds one batch per hot limit and key, however many layers apply the
//! limit. A limiter whose limit of that name differs (another quota or
//! batch) from the one that made the pool has that key decided by the
//! store (a name with two quotas is already warned about).
//!
//! Per limit and key, a [`Pool`] holds at most one batch: the permits left,
//! until when they may be granted (on the clock the limiter's cache of
//! denials reads, counted from before the store was asked, so a permit is
//! granted at most `hold` after the store counted it), and the store's
//! status after the take. One task at a time refills a pool (an async
//! mutex, waited for at most the limiter's timeout): the others wait for
//! it rather than each taking a batch, so an instance holds one batch per
//! key, which is what the bound in [`HotKey`](crate::HotKey) counts on. A
//! batch's unused permits go back to the store when its hold ends (a task
//! of the runtime wakes for it) or when a refill replaces it (a cost larger
//! than what is left).
//!
//! A refill the store refuses leaves the pool empty until the refusal's
//! `retry_after`: meanwhile the key is decided by the store as any other
//! (where the cache of denials answers a flood), so an exhausted hot key
//! costs the store about one decision per retry period too.
//!
//! Bounds, whatever clients send: at most [`MAX_POOLS`] pools per store,
//! and keys of at most [`keys::MAX_RAW_KEY`] bytes; other keys of a hot
//! limit are decided by the store one request at a time. A full table is
//! swept of idle pools at most once per [`SWEEP_EVERY`], so a flood of new
//! keys costs a scan per interval, not per request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::sync::lock;

use smallvec::SmallVec;

mod refill;

use super::{Checks, Limiter};
use crate::clock::Clock;
use crate::decision::{Decision, LimitStatus, LimitStatuses, Verdict};
use crate::metrics::Outcome;
use crate::store::{keys, Check};
use crate::{Error, Limit};

/// Pools kept at most per store (see the module's bounds).
pub(crate) const MAX_POOLS: usize = 1024;

/// The pools of the hot keys of every limiter over one store.
pub(crate) struct HotPools {
    clock: Arc<dyn Clock>,
    pools: Mutex<Pools>,
}

/// The pools by limit name, then key, and when a full table may be swept
/// again (us).
#[derive(Default)]
struct Pools {
    by_limit: HashMap<&'static str, ByKey>,
    next_sweep: i64,
}

/// How often a full table is swept at most (us): a flood of new keys costs
/// one sweep per interval, not one per request.
const SWEEP_EVERY: i64 = 100_000;

/// One limit's pools, by key.
type ByKey = HashMap<Box<[u8]>, Arc<Pool>>;

/// One key's batch, and the right to refill it.
struct Pool {
    key: Box<[u8]>,
    /// The limit it serves, as its parameters and batches: a limit of the
    /// same name that differs is not served from it.
    serves: (crate::algorithm::Params, Option<crate::HotKey>),
    batch: Mutex<Batch>,
    refill: tokio::sync::Mutex<()>,
}

/// A batch of permits taken from the store.
#[derive(Default)]
struct Batch {
    /// Permits left to grant.
    left: i64,
    /// Granted until (us on the pools' clock).
    until: i64,
    /// Counts the batches taken, so a permit goes back only to its own.
    generation: u64,
    /// The store refused a batch: the key is decided by the store until
    /// then (us).
    refused_until: i64,
    /// The last refill failed at this time (us), with this error: the
    /// tasks that waited for it fail with it too, rather than each waiting
    /// out the store again.
    failed: Option<(i64, Error)>,
    taken: Option<Taken>,
}

/// What a batch took from the store.
struct Taken {
    limit: Limit,
    /// The store time of the take, what giving back names it by.
    at: i64,
    /// The limit's status after the take, and when it was asked for (us).
    status: LimitStatus,
    sent: i64,
}

/// A permit granted from a batch, until the rest of its decision is known.
struct Permit {
    pool: Arc<Pool>,
    generation: u64,
    cost: i64,
    status: LimitStatus,
}

impl HotPools {
    /// Pools read `clock`. (Made by the stores that serve batches.)
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            pools: Mutex::new(Pools::default()),
        }
    }

    /// Whether `check` may be served from a batch: a hot limit not in
    /// shadow mode (`Limit::with_hot_key` refuses a concurrency limit and a penalty,
    /// and a penalty added later turns it off), and a cost one batch can
    /// hold.
    pub(crate) fn serves(check: &Check<'_>) -> bool {
        check.limit.hot_key().is_some_and(|hot| {
            u64::try_from(check.cost).is_ok_and(|cost| cost > 0 && cost <= hot.permits())
                && !check.limit.is_shadow()
        })
    }

    fn now(&self) -> i64 {
        self.clock.now_micros()
    }

    /// `check`'s pool; `None` for a key too long or when every pool is in
    /// use.
    fn pool(&self, check: &Check<'_>) -> Option<Arc<Pool>> {
        if check.key.len() > keys::MAX_RAW_KEY {
            return None;
        }
        let serves = (*check.limit.params(), check.limit.hot_key().copied());
        let mut pools = lock(&self.pools);
        if let Some(pool) = pools
            .by_limit
            .get(check.limit.shared_name())
            .and_then(|by_key| by_key.get(check.key))
        {
            return (pool.serves == serves).then(|| pool.clone());
        }
        let size = |pools: &Pools| pools.by_limit.values().map(HashMap::len).sum::<usize>();
        if size(&pools) >= MAX_POOLS {
            let now = self.now();
            if now < pools.next_sweep {
                return None;
            }
            pools.next_sweep = now.saturating_add(SWEEP_EVERY);
            // the pools no task holds whose batch has ended
            for by_key in pools.by_limit.values_mut() {
                by_key.retain(|_, pool| Arc::strong_count(pool) > 1 || pool.in_use(now));
            }
            pools.by_limit.retain(|_, by_key| !by_key.is_empty());
            if size(&pools) >= MAX_POOLS {
                return None;
            }
        }
        let pool = Arc::new(Pool {
            key: check.key.into(),
            serves,
            batch: Mutex::new(Batch::default()),
            refill: tokio::sync::Mutex::new(()),
        });
        pools
            .by_limit
            .entry(check.limit.shared_name())
            .or_default()
            .insert(check.key.into(), pool.clone());
        Some(pool)
    }
}

impl Pool {
    /// Whether the pool holds permits or a refusal at `now`.
    fn in_use(&self, now: i64) -> bool {
        let batch = lock(&self.batch);
        (batch.left > 0 && now < batch.until) || now < batch.refused_until
    }

    /// A permit of `cost` from the batch, if it has one now.
    fn take(self: &Arc<Self>, cost: i64, now: i64) -> Option<Permit> {
        let mut batch = lock(&self.batch);
        let left = batch.left - cost;
        let (true, Some(taken)) = (now < batch.until && left >= 0, batch.taken.as_ref()) else {
            return None;
        };
        let mut status = taken.status.clone();
        status.remaining = status
            .remaining
            .saturating_add(u64::try_from(left).unwrap_or(0));
        status.reset_us = status
            .reset_us
            .saturating_sub(u64::try_from(now - taken.sent).unwrap_or(0));
        batch.left = left;
        Some(Permit {
            pool: self.clone(),
            generation: batch.generation,
            cost,
            status,
        })
    }

    /// Ends the batch: batch `generation` once its hold has passed at
    /// `now`, or with `None` whatever it holds (a refill replaces it): what
    /// it did not grant, to give back.
    fn end(&self, now: i64, generation: Option<u64>) -> Option<(Limit, i64, i64)> {
        let mut batch = lock(&self.batch);
        let ended = generation.is_none_or(|g| g == batch.generation && now >= batch.until);
        if !ended || batch.left <= 0 {
            return None;
        }
        let left = std::mem::take(&mut batch.left);
        let taken = batch.taken.as_ref()?;
        Some((taken.limit.clone(), taken.at, left))
    }
}

impl Permit {
    /// Back to its batch, while that batch grants (else it counts as
    /// spent: its batch gave back what was left without it).
    fn give_back(self, now: i64) {
        let mut batch = lock(&self.pool.batch);
        if batch.generation == self.generation && now < batch.until {
            batch.left += self.cost;
        }
    }
}

impl HotPools {
    /// The decision of `checks`, some of them hot: each hot one granted
    /// from its batch (refilled from the store when empty), the others
    /// decided by the store as usual; if they refuse, the permits go back
    /// to their batches.
    pub(super) async fn decide(
        &self,
        limiter: &Limiter,
        checks: &[Check<'_>],
    ) -> Result<Decision, Error> {
        let hot = self;
        // one deadline for the whole decision: the refills of its hot
        // limits and the store's decision of the rest (started by the first
        // refill: a permit from a batch reads no clock)
        let mut deadline = limiter.deadline();
        let mut permits: SmallVec<[(usize, Permit); 2]> = SmallVec::new();
        let mut cold = Checks::new();
        for (i, check) in checks.iter().enumerate() {
            if HotPools::serves(check) {
                match self.permit(limiter, check, &mut deadline).await {
                    Ok(Some(permit)) => {
                        permits.push((i, permit));
                        continue;
                    }
                    Ok(None) => {}
                    Err(error) => {
                        let now = hot.now();
                        permits.into_iter().for_each(|(_, p)| p.give_back(now));
                        let result = Err(error);
                        super::count::count(checks, &result, Outcome::StoreError);
                        return result;
                    }
                }
            }
            cold.push(*check);
        }
        if cold.is_empty() {
            let statuses = permits.iter().map(|(_, p)| p.status.clone()).collect();
            let mut decision = Decision::new(Verdict::Allowed, 0, statuses);
            let cost = checks.first().map_or(0, |c| c.cost);
            decision.granted = u64::try_from(cost).unwrap_or(0);
            let result = Ok(decision);
            super::count::count(checks, &result, Outcome::Allowed);
            return result;
        }
        let result = limiter
            .decision_at_store(&cold, super::Ask::NOW, deadline)
            .get()
            .await
            .map(super::Grant::into_decision);
        let local: SmallVec<[(usize, LimitStatus); 2]> = permits
            .iter()
            .map(|(i, p)| (*i, p.status.clone()))
            .collect();
        if matches!(&result, Ok(decision) if decision.is_allowed()) {
            for check in local.iter().filter_map(|(i, _)| checks.get(*i)) {
                super::count::count_one(check.limit, Outcome::Allowed);
            }
        } else {
            let now = hot.now();
            permits.into_iter().for_each(|(_, p)| p.give_back(now));
        }
        result.map(|decision| Self::with_local(decision, local))
    }

    /// `decision` of the checks the store decided, with the statuses of
    /// those granted from batches put back in their places.
    fn with_local(
        decision: Decision,
        local: impl IntoIterator<Item = (usize, LimitStatus)>,
    ) -> Decision {
        let mut statuses: LimitStatuses = decision.statuses().iter().cloned().collect();
        for (i, status) in local {
            statuses.insert(i.min(statuses.len()), status);
        }
        let mut merged = Decision::new(decision.verdict(), decision.wait_us, statuses);
        merged.granted = decision.granted;
        merged.at = decision.at;
        merged.cached = decision.cached;
        merged
    }
}
