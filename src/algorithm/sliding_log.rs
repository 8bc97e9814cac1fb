//! Mirror of `lua/sliding_log.lua`: at most N in any window (t - W, t].

use std::collections::VecDeque;

use super::Algo;

/// The integers it decides with: at most `limit` permits in any window of
/// `window` microseconds.
pub(crate) type Params = super::params::Window;

/// Grants, oldest first, the sum of their costs, and the longest window in
/// use with the time until which it is honoured (`wmax`, `wexp` in Redis).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlidingLog {
    entries: VecDeque<(i64, i64)>,
    sum: i64,
    wmax: Option<(i64, i64)>,
    /// How far back entries are kept (this window, or a longer one in use).
    keep: i64,
    /// The sum of the entries inside this limit's window, and how many older
    /// ones (kept for a longer window) precede them.
    win: i64,
    skip: usize,
}

/// What the store keeps of a sliding log: the grants, their sum and the
/// longest window in use (the `log` and `meta` keys in Redis).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Log {
    entries: VecDeque<(i64, i64)>,
    sum: i64,
    wmax: Option<(i64, i64)>,
}

/// What the store keeps of a sliding log: its [`Log`] and expiry.
pub(crate) type Stored = Box<(Log, i64)>;

impl super::StoredForm for Stored {
    fn expires_at(&self) -> i64 {
        self.1
    }

    fn move_back(&mut self, by: i64) {
        self.0.move_back(by);
        self.1 -= by;
    }
}

impl Log {
    fn move_back(&mut self, by: i64) {
        for entry in &mut self.entries {
            entry.0 -= by;
        }
        if let Some((_, wexp)) = &mut self.wmax {
            *wexp -= by;
        }
    }
}

impl SlidingLog {
    /// What the store keeps, once prepared or saved.
    pub(crate) fn into_log(self) -> Log {
        let Self {
            entries, sum, wmax, ..
        } = self;
        Log { entries, sum, wmax }
    }

    fn last(&self) -> Option<i64> {
        self.entries.back().map(|&(t, _)| t)
    }

    fn in_window(&self) -> impl Iterator<Item = &(i64, i64)> {
        self.entries.iter().skip(self.skip)
    }

    /// Records the window in use; returns when the state becomes equal to a
    /// fresh one.
    fn close(&mut self, p: &Params, now: i64) -> i64 {
        if self.keep <= p.window {
            self.wmax = Some((p.window, now + p.window));
        }
        self.last().map_or(now, |last| last + self.keep)
    }

    /// Records a grant at `at`, in time order: after the last one, or
    /// before a reservation when a lease is renewed (see `Algo::renew`).
    pub(crate) fn grant(&mut self, at: i64, cost: i64) {
        match self.last() {
            Some(last) if at < last => {
                let i = self.entries.partition_point(|&(t, _)| t <= at);
                self.entries.insert(i, (at, cost));
            }
            _ => self.entries.push_back((at, cost)),
        }
        self.sum += cost;
        self.win += cost;
    }

    /// Gives back one grant of `cost` made at `at` (as `slog_refund`): the
    /// last such entry leaves the log (entries with equal time and cost are
    /// interchangeable); without one, the last larger entry made at `at`
    /// keeps the rest of its cost (what a hot key's batch did not grant).
    /// `false` when the log holds neither (pruned, or never granted).
    pub(crate) fn refund(&mut self, at: i64, cost: i64) -> bool {
        let found = self.entries.iter().rposition(|&e| e == (at, cost));
        let Some(i) =
            found.or_else(|| self.entries.iter().rposition(|&(t, c)| t == at && c > cost))
        else {
            return false;
        };
        let whole = found.is_some();
        if whole {
            self.entries.remove(i);
        } else if let Some(entry) = self.entries.get_mut(i) {
            entry.1 -= cost;
        }
        self.sum -= cost;
        if i >= self.skip {
            self.win -= cost;
        } else if whole {
            self.skip -= 1;
        }
        true
    }
}

impl Algo for SlidingLog {
    type Params = Params;
    type Stored = Stored;
    const NAME: &'static str = "sliding log";
    const KEYS: &'static [&'static str] = &["log", "meta"];
    const AMOUNT: &'static str = "limit";
    const RATE: Option<&'static str> = None;

    /// The working state of what the store keeps (its grants moved, not
    /// copied), as the script's `prepare`: drops grants no window in use
    /// still counts, once a log dated after `now` (its writer's clock
    /// `written`) is moved back to it (see `State::prepare`); `true` when it
    /// was and still holds something.
    fn prepare(p: &Params, stored: Option<&mut Stored>, written: i64, now: i64) -> (Self, bool) {
        let mut log = stored.map_or_else(Log::default, |stored| std::mem::take(&mut stored.0));
        let moved = written > now;
        if moved {
            log.move_back(written - now);
        }
        let Log { entries, sum, wmax } = log;
        let mut s = Self {
            entries,
            sum,
            wmax,
            keep: 0,
            win: 0,
            skip: 0,
        };
        let w = p.window;
        s.keep = match s.wmax {
            Some((wmax, wexp)) if wmax > w && wexp > now => wmax,
            _ => w,
        };
        let mut cutoff = now - s.keep;
        if let (Some((wmax, _)), Some(last)) = (s.wmax, s.last()) {
            // the writer's state is over once its newest grant left its window
            if last + wmax <= now {
                cutoff = i64::MAX;
            }
        }
        while let Some(&(t, cost)) = s.entries.front() {
            if t > cutoff {
                break;
            }
            s.sum -= cost;
            s.entries.pop_front();
        }
        (s.win, s.skip) = (s.sum, 0);
        if s.keep > w {
            for &(t, cost) in &s.entries {
                if t > now - w {
                    break;
                }
                s.win -= cost;
                s.skip += 1;
            }
        }
        if moved && s.entries.is_empty() {
            // nothing left: fresh, as the script deletes it
            s.wmax = None;
        }
        let moved = moved && !s.entries.is_empty();
        (s, moved)
    }

    fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
        let (n, w) = (p.limit, p.window);
        if cost > n {
            return None;
        }
        let base = self.last().map_or(now, |last| now.max(last));
        let excess = self.win + cost - n;
        if excess <= 0 {
            return Some(base);
        }
        let mut dropped = 0;
        for &(t, c) in self.in_window() {
            dropped += c;
            if dropped >= excess {
                return Some(base.max(t + w));
            }
        }
        Some(base.max(self.last().unwrap_or(now) + w))
    }

    fn restore(self, stored: &mut Stored) {
        stored.0 = self.into_log();
    }

    fn grant(&mut self, _p: &Params, at: i64, cost: i64) {
        SlidingLog::grant(self, at, cost);
    }

    fn refund(&mut self, _p: &Params, _now: i64, at: i64, cost: i64) -> bool {
        SlidingLog::refund(self, at, cost)
    }

    fn renew(&mut self, at: i64, to: i64, cost: i64) -> bool {
        let held = SlidingLog::refund(self, at, cost);
        if held {
            SlidingLog::grant(self, to, cost);
        }
        held
    }

    fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
        let (n, w) = (p.limit, p.window);
        let Some(last) = self.last() else {
            return (n, 0);
        };
        let reset = last + w - now;
        if last > at {
            return (0, reset);
        }
        let mut sum = self.win;
        if at > now {
            sum -= self
                .in_window()
                .take_while(|&&(t, _)| t <= at - w)
                .map(|&(_, c)| c)
                .sum::<i64>();
        }
        ((n - sum).max(0), reset)
    }

    fn save(mut self, p: &Params, now: i64) -> Stored {
        let expires_at = self.close(p, now);
        Box::new((self.into_log(), expires_at))
    }

    /// Reuses the allocation of `stored`.
    fn save_into(mut self, p: &Params, now: i64, stored: &mut Stored) -> i64 {
        let expires_at = self.close(p, now);
        **stored = (self.into_log(), expires_at);
        expires_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refund of part of a grant (what a hot key's batch did not grant)
    /// leaves the rest of it in place; one of a whole grant removes it.
    #[test]
    fn a_refund_takes_a_whole_grant_or_part_of_a_larger_one() {
        let p = Params {
            limit: 10,
            window: 1_000,
            calendar: None,
        };
        let (mut log, _) = SlidingLog::prepare(&p, None, 0, 0);
        log.grant(5, 10);
        log.grant(5, 1);
        assert!(log.refund(5, 1), "the grant of 1 itself");
        assert_eq!((log.sum, log.win, log.entries.len()), (10, 10, 1));
        assert!(log.refund(5, 4), "part of the grant of 10");
        assert_eq!((log.sum, log.win), (6, 6));
        assert_eq!(log.entries.front(), Some(&(5, 6)));
        assert_eq!(log.status(&p, 5, 5), (4, 1_000));
        assert!(!log.refund(5, 7), "more than is left at that time");
        assert!(!log.refund(6, 1), "nothing granted then");
        assert!(log.refund(5, 6));
        assert!(log.entries.is_empty());
    }
}
