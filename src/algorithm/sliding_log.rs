//! Mirror of `lua/sliding_log.lua`: at most N in any window (t - W, t].

use std::collections::VecDeque;

/// Grants still inside the window, oldest first, and the sum of their costs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SlidingLog {
    entries: VecDeque<(i64, i64)>,
    sum: i64,
}

impl SlidingLog {
    /// Drops grants at or before `now - W`.
    pub(crate) fn load(&mut self, p: &[i64; 4], now: i64) {
        let cutoff = now - p[1];
        while let Some(&(t, cost)) = self.entries.front() {
            if t > cutoff {
                break;
            }
            self.sum -= cost;
            self.entries.pop_front();
        }
    }

    fn last(&self) -> Option<i64> {
        self.entries.back().map(|&(t, _)| t)
    }

    pub(crate) fn earliest(&self, p: &[i64; 4], now: i64, cost: i64) -> Option<i64> {
        let (n, w) = (p[0], p[1]);
        if cost > n {
            return None;
        }
        let base = self.last().map_or(now, |last| now.max(last));
        let excess = self.sum + cost - n;
        if excess <= 0 {
            return Some(base);
        }
        let mut dropped = 0;
        for &(t, c) in &self.entries {
            dropped += c;
            if dropped >= excess {
                return Some(base.max(t + w));
            }
        }
        Some(base.max(self.last().unwrap_or(now) + w))
    }

    pub(crate) fn grant(&mut self, at: i64, cost: i64) {
        self.entries.push_back((at, cost));
        self.sum += cost;
    }

    pub(crate) fn status(&self, p: &[i64; 4], now: i64, at: i64) -> (i64, i64) {
        let (n, w) = (p[0], p[1]);
        let Some(last) = self.last() else {
            return (n, 0);
        };
        let reset = last + w - now;
        if last > at {
            return (0, reset);
        }
        let mut sum = self.sum;
        if at > now {
            sum -= self
                .entries
                .iter()
                .take_while(|&&(t, _)| t <= at - w)
                .map(|&(_, c)| c)
                .sum::<i64>();
        }
        ((n - sum).max(0), reset)
    }

    pub(crate) fn ttl(&self, p: &[i64; 4], now: i64) -> i64 {
        self.last().map_or(0, |last| last + p[1] - now)
    }
}
