//! A hot key's batch refilled from the store when it runs out, and what an
//! ended batch did not grant given back (see the parent module).

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::{HotPools, Permit, Pool, Taken};
use crate::limiter::{Inner, Limiter};
use crate::metrics::StoreTimer;
use crate::store::{Check, Deadline, Settle};
use crate::sync::lock;
use crate::{Error, Limit};

impl HotPools {
    /// A permit of `check` from its batch, refilling it when empty, by
    /// `deadline` (the wait for the refill and the refill itself; started
    /// here, unless it already was); `None`
    /// when the store is to decide it (no pool, a refusal in force, or too
    /// little left after a refill).
    pub(super) async fn permit(
        &self,
        limiter: &Limiter,
        check: &Check<'_>,
        deadline: &mut Deadline,
    ) -> Result<Option<Permit>, Error> {
        let hot = self;
        let Some(pool) = hot.pool(check) else {
            return Ok(None);
        };
        let started = hot.now();
        if let Some(permit) = pool.take(check.cost, started) {
            return Ok(Some(permit));
        }
        if started < lock(&pool.batch).refused_until {
            return Ok(None);
        }
        *deadline = deadline.start();
        let deadline = *deadline;
        let Ok(_refilling) = tokio::time::timeout_at(deadline.at(), pool.refill.lock()).await
        else {
            return Err(deadline.error());
        };
        // another task may have refilled it, been refused or failed meanwhile
        let now = hot.now();
        if let Some(permit) = pool.take(check.cost, now) {
            return Ok(Some(permit));
        }
        {
            let batch = lock(&pool.batch);
            if now < batch.refused_until {
                return Ok(None);
            }
            if let Some((_, error)) = batch.failed.as_ref().filter(|(at, _)| *at >= started) {
                return Err(error.clone());
            }
        }
        // what the batch holds (too little for this cost, or its hold is
        // over) goes back before another is taken: one batch at a time
        if let Some(ended) = pool.end(now, None) {
            // (on a task of its own: this request waits for its batch only)
            let (limiter, ended_pool) = (limiter.clone(), pool.clone());
            let give_back = async move { HotPools::give_back(&limiter, &ended_pool, ended).await };
            crate::limiter::run_detached(give_back, false, || {});
        }
        let Some(hot_key) = check.limit.hot_key() else {
            return Ok(None);
        };
        let batch = [Check {
            limit: check.limit,
            key: check.key,
            cost: i64::try_from(hot_key.permits()).unwrap_or(i64::MAX),
        }];
        let sent = hot.now();
        let timer = StoreTimer::start();
        let taken = limiter
            .inner
            .store
            .engine()
            .take(&batch, deadline)
            .get()
            .await;
        limiter.called(timer, "take", taken.is_err());
        let taken = taken.and_then(|(reply, k)| Ok((Limiter::decision_of(&batch, reply, 0)?, k)));
        let (decision, k) = match taken {
            Ok(taken) => taken,
            Err(error) => {
                lock(&pool.batch).failed = Some((hot.now(), error.clone()));
                return Err(error);
            }
        };
        let Some(status) = decision.statuses().first().cloned() else {
            return Ok(None);
        };
        let generation = {
            let mut batch = lock(&pool.batch);
            batch.failed = None;
            if !decision.is_allowed() || k <= 0 {
                // (within a hold, other instances give unused permits back)
                let wait = decision
                    .retry_after()
                    .map_or(hot_key.hold(), |wait| wait.min(hot_key.hold()));
                let wait = i64::try_from(wait.as_micros()).unwrap_or(i64::MAX);
                batch.refused_until = sent.saturating_add(wait);
                return Ok(None);
            }
            crate::metrics::overshoot(check.limit.shared_name(), "hot_batch", k);
            batch.generation += 1;
            batch.left = k;
            batch.until = sent.saturating_add(hot_key.hold_us());
            batch.taken = Some(Taken {
                limit: check.limit.clone(),
                at: decision.at,
                status,
                sent,
            });
            batch.generation
        };
        Self::end_later(limiter, &pool, generation, hot_key.hold());
        Ok(pool.take(check.cost, hot.now()))
    }

    /// Gives back what an ended batch of `pool` did not grant.
    async fn give_back(limiter: &Limiter, pool: &Pool, (limit, at, left): (Limit, i64, i64)) {
        let check = [Check {
            limit: &limit,
            key: &pool.key,
            cost: left,
        }];
        let refunded = limiter
            .settle_checks(&check, Settle::Refund { at }, limiter.inner.timeout)
            .await;
        if let Err(error) = refunded {
            tracing::debug!(target: "tower_ratelimit", %error, "could not give back a hot key's unused permits");
        }
    }

    /// Wakes when batch `generation` of `pool` ends, to give back what it
    /// did not grant (without a runtime, the next refill does).
    fn end_later(limiter: &Limiter, pool: &Arc<Pool>, generation: u64, hold: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (pool, inner): (Weak<Pool>, Weak<Inner>) =
            (Arc::downgrade(pool), Arc::downgrade(&limiter.inner));
        runtime.spawn(async move {
            tokio::time::sleep(hold).await;
            let (Some(pool), Some(inner)) = (pool.upgrade(), inner.upgrade()) else {
                return;
            };
            let limiter = Limiter { inner };
            let Some(hot) = limiter.inner.hot.as_ref() else {
                return;
            };
            if let Some(ended) = pool.end(hot.now(), Some(generation)) {
                HotPools::give_back(&limiter, &pool, ended).await;
            }
        });
    }
}
