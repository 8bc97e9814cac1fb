//! Penalties and bans (see [`Limit::with_penalty`]): block, unblock and inspect
//! a key, each naming the limit, as the stored quotas' operations do.

use std::time::Duration;

use super::Admin;
use crate::decision::Decision;
use crate::limiter::Ask;
use crate::store::{Check, Penalty};
use crate::{ConfigError, Error, Limit};

/// What [`Admin::inspect`] finds of a key in a limit with a penalty.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// The limit's answer for a cost of 1 now, taking nothing (a
    /// [`peek`](crate::Limiter::peek) by this limit alone): its `remaining`, and
    /// while blocked the refusal with the time left of the block.
    pub decision: Decision,
    /// The time left of the key's block, if it is blocked.
    pub blocked_for: Option<Duration>,
    /// The offences remembered (see [`Penalty`](crate::Penalty)).
    pub offences: u32,
    /// The refusals counted towards the next offence.
    pub refusals: u32,
}

/// The longest block [`Admin::block`] accepts: ten years.
const LONGEST_BLOCK: Duration = Duration::from_secs(10 * 366 * 86_400);

impl Admin<'_> {
    /// This limiter's limit named `name`, if it has a penalty.
    fn penalized(&self, name: &str) -> Result<Limit, Error> {
        self.limiter
            .limits()
            .into_iter()
            .find(|l| l.name() == name && l.pen_params().is_some())
            .ok_or_else(|| {
                ConfigError::Penalty(format!(
                    "the limiter has no limit {name:?} with a penalty (see Limit::with_penalty)"
                ))
                .into()
            })
    }

    async fn change_penalty(
        &self,
        limit: &Limit,
        key: &[u8],
        change: Penalty,
    ) -> Result<(crate::penalty::PenState, i64), Error> {
        let key = crate::limiter::non_empty(key)?;
        let check = Check {
            limit,
            key,
            cost: 0,
        };
        let store = &self.limiter.inner.store;
        let changed = store
            .engine()
            .penalty(&check, change, self.limiter.deadline());
        let changed = changed.get().await?;
        changed.ok_or_else(|| ConfigError::Penalty("the limit has no penalty".into()).into())
    }

    /// Blocks `key` in the limit `limit` for `duration` from now (a ban by
    /// hand): every instance refuses it until then, as after an offence.
    /// It counts as no offence and drops the refusals counted so far; a
    /// block already in force is replaced (so this also shortens one). The
    /// limit must have a [penalty](Limit::with_penalty) (it keeps the state);
    /// [`Error::Config`] otherwise, or for a zero duration or one over ten
    /// years. A [`MemoryStore`](crate::MemoryStore) at its bound keeps the
    /// block in place of a rate state it gives up; one whose penalty
    /// states take half its bound keeps it in place of one given up (an
    /// active block kept as a ban record, 4 to a state); when all of them
    /// are active blocks and no record fits, it keeps no new one:
    /// [`Error::PenaltyNotStored`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Penalty, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let hour = Duration::from_secs(3600);
    /// let api = Limit::new("api", Quota::per_second(10).gcra())?
    ///     .with_penalty(Penalty::new(100, hour, [hour])?);
    /// let limiter = Limiter::new(MemoryStore::new(), api);
    /// limiter.admin().block("api", "203.0.113.9", hour).await?;
    /// let seen = limiter.admin().inspect("api", "203.0.113.9").await?;
    /// assert!(seen.blocked_for.is_some() && seen.offences == 0);
    /// assert!(!limiter.check("203.0.113.9", 1).await?.is_allowed());
    /// assert!(limiter.admin().unblock("api", "203.0.113.9").await?);
    /// assert!(limiter.check("203.0.113.9", 1).await?.is_allowed());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn block(
        self,
        limit: &str,
        key: impl AsRef<[u8]>,
        duration: Duration,
    ) -> Result<(), Error> {
        let limit = self.penalized(limit)?;
        if duration < Duration::from_micros(1) || duration > LONGEST_BLOCK {
            return Err(ConfigError::Penalty(format!(
                "a block of {duration:?}: from 1 microsecond to ten years"
            ))
            .into());
        }
        let us = i64::try_from(duration.as_micros()).unwrap_or(i64::MAX);
        self.change_penalty(&limit, key.as_ref(), Penalty::Block(us))
            .await?;
        Ok(())
    }

    /// Forgives `key` in the limit `limit`: lifts its block and forgets
    /// the refusals counted and the offences (the next offence is a first
    /// one again). Whether it was blocked. The limit must have a
    /// [penalty](Limit::with_penalty) ([`Error::Config`] otherwise). In a
    /// [`MemoryStore`](crate::MemoryStore), a key whose block is the one
    /// its bucket of the key hash shares (see
    /// [`MemoryStoreBuilder::max_keys`](crate::MemoryStoreBuilder::max_keys))
    /// has that block lifted for its bucket.
    ///
    /// Cached denials of the key in this limiter are dropped (see
    /// [`LimiterBuilder::cache_denials`](crate::LimiterBuilder::cache_denials));
    /// another instance that cached the block's refusal answers it from its
    /// cache until the block would have ended.
    pub async fn unblock(self, limit: &str, key: impl AsRef<[u8]>) -> Result<bool, Error> {
        let limit = self.penalized(limit)?;
        let key = key.as_ref();
        if let Some(denials) = &self.limiter.inner.denials {
            denials.forget(key);
        }
        let (before, now) = self.change_penalty(&limit, key, Penalty::Unblock).await?;
        Ok(before.blocked(now).is_some())
    }

    /// What the limit `limit` holds of `key`: its answer for a cost of 1
    /// now (taking nothing, counting no refusal), whether it is blocked and
    /// for how long, its offences and the refusals counted towards the
    /// next. Two store calls. The limit must have a
    /// [penalty](Limit::with_penalty) ([`Error::Config`] otherwise).
    pub async fn inspect(self, limit: &str, key: impl AsRef<[u8]>) -> Result<Inspection, Error> {
        let limit = self.penalized(limit)?;
        let key = key.as_ref();
        let (state, now) = self.change_penalty(&limit, key, Penalty::Read).await?;
        let check = [Check {
            limit: &limit,
            key,
            cost: 1,
        }];
        let look = Ask {
            dry: true,
            counted: false,
            ..Ask::NOW
        };
        let deadline = self.limiter.deadline();
        let decision = self.limiter.decision_at_store(&check, look, deadline);
        let decision = decision.get().await?.into_decision();
        let count = |n: i64| u32::try_from(n).unwrap_or(u32::MAX);
        let p = limit.pen_params();
        let (offences, refusals) = p.map_or((0, 0), |p| {
            (count(state.offences(p, now)), count(state.refusals(p, now)))
        });
        let us = |us: i64| Duration::from_micros(u64::try_from(us).unwrap_or(0));
        Ok(Inspection {
            decision,
            blocked_for: state.blocked(now).map(us),
            offences,
            refusals,
        })
    }
}
