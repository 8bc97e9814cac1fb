//! Penalties and bans ([`Penalty`]): after N refusals by a limit within a
//! time, the key is blocked for a while, longer on each repeat offence;
//! counted and decided in the same store call as the limit's decision.
//!
//! The state of a key's penalty, [`PenState`], is four integers kept
//! beside the limit's state (in Redis one more key in the same hash tag,
//! `<limit's keys>:pen`, see `lua/penalty.lua`), all in store time
//! (microseconds): when the block ends (`until`), the offences not yet
//! forgotten, the refusals counted towards the next offence and the time
//! of the first of them, or, while none is counted, when the last block
//! began. The arithmetic here is the script's, step for step.
//!
//! A state dated after the store's clock (written by a clock ahead of it:
//! an instance with its own clock, a Redis promoted with its clock ahead)
//! is moved back to that clock whole when read ([`PenState::dated`]): a
//! block ends at most its own length from now (an offence's block, so at
//! most the penalty's longest; a block by hand, its duration), never a
//! year away because its writer's clock was.

use std::sync::Arc;
use std::time::Duration;

use crate::ConfigError;

/// The longest duration a penalty accepts (ten years), so that every sum
/// of times stays far below 2^53 microseconds.
const LONGEST: Duration = Duration::from_secs(10 * 366 * 86_400);

/// How long offences are remembered when not said otherwise: a day.
pub const DEFAULT_FORGET_AFTER: Duration = Duration::from_secs(24 * 3600);

/// A limit's penalty (see [`Limit::with_penalty`](crate::Limit::with_penalty)): after
/// `refusals` refusals by the limit within `within` (counted from the first
/// of them), the key is blocked: the n-th such offence blocks it for
/// `blocks[n - 1]`, the last of `blocks` for every offence beyond. Offences
/// are forgotten once a block has ended [`forget_after`](Self::forget_after)
/// ago (default [`DEFAULT_FORGET_AFTER`]) without a new one.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{ConfigError, Penalty};
///
/// let min = Duration::from_secs(60);
/// // 5 refusals within 15 minutes: blocked 1 min, then 10 min, then 1 h
/// let penalty = Penalty::new(5, 15 * min, [min, 10 * min, 60 * min])?
///     .forget_after(Duration::from_secs(24 * 3600));
/// assert_eq!(penalty.refusals(), 5);
/// assert!(matches!(Penalty::new(5, min, []), Err(ConfigError::Penalty(_))));
/// # Ok::<(), ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Penalty {
    refusals: u32,
    within: Duration,
    blocks: Arc<[Duration]>,
    forget_after: Duration,
}

impl Penalty {
    /// A penalty of `blocks` (escalating, one per repeat offence) after
    /// `refusals` refusals within `within`. [`ConfigError::Penalty`] for 0
    /// refusals, no blocks, a zero or sub-microsecond duration, or one
    /// longer than ten years.
    pub fn new(
        refusals: u32,
        within: Duration,
        blocks: impl IntoIterator<Item = Duration>,
    ) -> Result<Self, ConfigError> {
        let blocks: Arc<[Duration]> = blocks.into_iter().collect();
        let fail = |what: String| Err(ConfigError::Penalty(what));
        if refusals == 0 {
            return fail("it needs at least 1 refusal to make an offence".into());
        }
        if blocks.is_empty() {
            return fail("it needs at least one block duration".into());
        }
        let durations = std::iter::once(("the `within` duration", within))
            .chain(blocks.iter().map(|&b| ("a block", b)));
        for (what, d) in durations {
            if d < Duration::from_micros(1) {
                return fail(format!("{what} must be at least 1 microsecond"));
            }
            if d > LONGEST {
                return fail(format!("{what} is longer than ten years"));
            }
        }
        Ok(Self {
            refusals,
            within,
            blocks,
            forget_after: DEFAULT_FORGET_AFTER,
        })
    }

    /// Offences are forgotten once a block ended this long ago without a
    /// new one (default [`DEFAULT_FORGET_AFTER`]). A duration under a
    /// microsecond or over ten years is clamped into that range.
    #[must_use]
    pub fn forget_after(mut self, quiet: Duration) -> Self {
        self.forget_after = quiet.clamp(Duration::from_micros(1), LONGEST);
        self
    }

    /// Refusals that make an offence.
    pub fn refusals(&self) -> u32 {
        self.refusals
    }

    /// The time within which they count, from the first of them.
    pub fn within(&self) -> Duration {
        self.within
    }

    /// The blocks of the first, second, ... offence (the last repeats).
    pub fn blocks(&self) -> &[Duration] {
        &self.blocks
    }

    /// How long after its block's end an offence is remembered.
    pub fn quiet_period(&self) -> Duration {
        self.forget_after
    }

    /// The integers the stores decide with.
    pub(crate) fn params(&self) -> PenParams {
        let us = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        PenParams {
            refusals: i64::from(self.refusals),
            within: us(self.within),
            forget: us(self.forget_after),
            blocks: self.blocks.iter().map(|&b| us(b)).collect(),
        }
    }
}

/// A penalty's integers (us), as the script reads them from a limit's
/// string: `p<refusals>:<within>:<forget>:<block 1>:...;` before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PenParams {
    pub(crate) refusals: i64,
    pub(crate) within: i64,
    pub(crate) forget: i64,
    pub(crate) blocks: Arc<[i64]>,
}

impl PenParams {
    /// The block of the `n`-th offence (n >= 1; the last one repeats).
    fn block(&self, n: i64) -> i64 {
        let len = i64::try_from(self.blocks.len()).unwrap_or(i64::MAX);
        let i = usize::try_from(n.clamp(1, len.max(1)) - 1).unwrap_or(0);
        self.blocks.get(i).copied().unwrap_or(0)
    }
}

/// A key's penalty state: `pen_load`, `pen_refuse` and `pen_save` in
/// `lua/penalty.lua` keep the same four fields (a value that is not four
/// integers in [0, 2^53) reads as a fresh state).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PenState {
    /// When the block ends (store time, us); 0 for never blocked.
    pub(crate) until: i64,
    /// Offences, until forgotten.
    pub(crate) offences: i64,
    /// Refusals counted towards the next offence.
    pub(crate) count: i64,
    /// The time of the first of them; while none is counted, when the
    /// last block began (0 for never, or unknown: written by a version
    /// that did not keep it).
    pub(crate) since: i64,
}

impl PenState {
    /// Moves a state dated after `now` (its `since`, the latest time it
    /// records, lies after it: its writer's clock was ahead) back to `now`
    /// whole: `until` and `since` by the same amount, so a block keeps its
    /// length from now and counted refusals count from now. Whether it
    /// moved (the caller writes it back, so that it ages from then on).
    pub(crate) fn dated(&mut self, now: i64) -> bool {
        if self.since <= now {
            return false;
        }
        let ahead = self.since - now;
        self.until = (self.until - ahead).max(0);
        self.since = now;
        true
    }

    /// The time left of a block at `now`, if the key is blocked.
    pub(crate) fn blocked(&self, now: i64) -> Option<i64> {
        (self.until > now).then(|| self.until - now)
    }

    /// The offences remembered at `now` (forgotten `forget` after the last
    /// block ended).
    pub(crate) fn offences(&self, p: &PenParams, now: i64) -> i64 {
        if self.offences > 0 && self.until + p.forget <= now {
            0
        } else {
            self.offences
        }
    }

    /// The refusals counted at `now` towards the next offence.
    pub(crate) fn refusals(&self, p: &PenParams, now: i64) -> i64 {
        if self.count > 0 && now - self.since >= p.within {
            0
        } else {
            self.count
        }
    }

    /// Counts a refusal at `now`; whether it made an offence (the key is
    /// blocked from now, see [`blocked`](Self::blocked)).
    pub(crate) fn refuse(&mut self, p: &PenParams, now: i64) -> bool {
        self.offences = self.offences(p, now);
        if self.refusals(p, now) == 0 {
            (self.count, self.since) = (1, now);
        } else {
            self.count += 1;
        }
        if self.count < p.refusals {
            return false;
        }
        self.offences += 1;
        self.until = now + p.block(self.offences);
        (self.count, self.since) = (0, now);
        true
    }

    /// An administrator's block of `us` from `now`: no offence, the
    /// refusals counted so far dropped.
    pub(crate) fn block(&mut self, now: i64, us: i64) {
        self.until = now + us;
        (self.count, self.since) = (0, now);
    }

    /// When the state becomes equal to a fresh one (the key's expiry).
    pub(crate) fn expires_at(&self, p: &PenParams) -> i64 {
        let mut exp = self.until;
        if self.offences > 0 {
            exp = exp.max(self.until + p.forget);
        }
        if self.count > 0 {
            exp = exp.max(self.since + p.within);
        }
        exp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000_000;

    fn params() -> PenParams {
        Penalty::new(
            3,
            Duration::from_secs(60),
            [Duration::from_secs(60), Duration::from_secs(600)],
        )
        .expect("penalty")
        .forget_after(Duration::from_secs(3600))
        .params()
    }

    #[test]
    fn offences_escalate_up_to_the_last_block_and_are_forgotten() {
        let p = params();
        let mut s = PenState::default();
        let t = 1_000 * MIN;
        assert!(!s.refuse(&p, t));
        assert!(!s.refuse(&p, t + 1));
        assert!(s.refuse(&p, t + 2));
        assert_eq!(s.blocked(t + 2), Some(MIN));
        // second offence: 10 minutes; third: the last again
        let t = t + 2 * MIN;
        for i in 0..3 {
            assert_eq!(s.refuse(&p, t + i), i == 2);
        }
        assert_eq!(s.blocked(t + 2), Some(10 * MIN));
        let t = t + 11 * MIN;
        for i in 0..3 {
            s.refuse(&p, t + i);
        }
        assert_eq!((s.blocked(t + 2), s.offences), (Some(10 * MIN), 3));
        // quiet for an hour after the block: forgotten
        let t = t + 2 + 10 * MIN + 60 * MIN;
        assert_eq!(s.offences(&p, t), 0);
        for i in 0..3 {
            s.refuse(&p, t + i);
        }
        assert_eq!((s.blocked(t + 2), s.offences), (Some(MIN), 1));
    }

    #[test]
    fn refusals_count_within_their_window_only() {
        let p = params();
        let mut s = PenState::default();
        assert!(!s.refuse(&p, 0));
        assert!(!s.refuse(&p, 1));
        // the window from the first has passed: counting starts again
        assert!(!s.refuse(&p, MIN));
        assert_eq!(s.refusals(&p, MIN), 1);
        assert_eq!(s.expires_at(&p), 2 * MIN);
    }

    #[test]
    fn a_state_dated_ahead_is_moved_back_whole() {
        let p = params();
        let year = 366 * 24 * 60 * MIN;
        let t = 1_000 * MIN;
        // written by a clock a year ahead: an offence, blocked 1 minute
        let mut s = PenState::default();
        for i in 0..3 {
            s.refuse(&p, t + year + i);
        }
        assert!(s.dated(t));
        assert_eq!((s.blocked(t), s.offences), (Some(MIN), 1));
        assert!(!s.dated(t), "moved once");
        // a block by hand keeps its own length
        let mut s = PenState::default();
        s.block(t + year, 2 * year);
        assert!(s.dated(t));
        assert_eq!(s.blocked(t), Some(2 * year));
        // refusals counted ahead count from now, and an ended block stays ended
        let mut s = PenState::default();
        for i in 0..3 {
            s.refuse(&p, t + year + i);
        }
        s.refuse(&p, t + year + 2 * MIN);
        assert!(s.dated(t));
        assert_eq!((s.blocked(t), s.refusals(&p, t)), (None, 1));
        assert_eq!(s.refusals(&p, t + MIN), 0);
    }

    #[test]
    fn invalid_penalties_are_config_errors() {
        let s = Duration::from_secs(1);
        assert!(Penalty::new(0, s, [s]).is_err());
        assert!(Penalty::new(1, Duration::ZERO, [s]).is_err());
        assert!(Penalty::new(1, s, [s, Duration::ZERO]).is_err());
        assert!(Penalty::new(1, s, []).is_err());
        assert!(Penalty::new(1, s, [LONGEST + s]).is_err());
        // not increasing is fine
        assert!(Penalty::new(1, s, [2 * s, s]).is_ok());
    }
}
