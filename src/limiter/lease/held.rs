//! What a held lease does: give its grants back once, renew them while
//! held, and tell its holder when they are lost.

use std::sync::atomic::Ordering;
use std::sync::Weak;

use super::Held;
use crate::limiter::grant::{Charged, ChargedTo};
use crate::store::Settle;
use crate::Error;

impl Held {
    /// Gives back every grant still held, once.
    pub(super) async fn release(&self) -> Result<bool, Error> {
        self.give_back(true).await
    }

    /// Gives back every grant still held, once; stops the renewal task
    /// with `stop_renewals` (not when that task itself gives them back).
    pub(super) async fn give_back(&self, stop_renewals: bool) -> Result<bool, Error> {
        let mut grants = self.grants.lock().await;
        if self.released.swap(true, Ordering::AcqRel) {
            return Ok(false);
        }
        if let Some(renewer) = self.renewer.get().filter(|_| stop_renewals) {
            renewer.abort();
        }
        let mut result = Ok(false);
        for (at, charged) in by_time(&grants.held) {
            let done = self
                .limiter
                .refund_charged(&charged, at)
                .await
                .map(|()| true);
            result = result.and(done);
        }
        grants.held.clear();
        result
    }

    /// Gives the permits back because they were held for the maximum hold
    /// (or their body stalled), and marks the lease lost.
    pub(super) async fn expire(&self) {
        if self.released.load(Ordering::Acquire) {
            return;
        }
        self.expired.store(true, Ordering::Release);
        self.lost.send_replace(true);
        let waker = self.on_expiry.lock().ok().and_then(|mut slot| slot.take());
        if let Some(waker) = waker {
            waker.wake();
        }
        tracing::debug!(target: "tower_ratelimit", "a permit was held for its maximum hold, or by a client that stopped reading: given back");
        if let Err(error) = self.give_back(false).await {
            tracing::warn!(target: "tower_ratelimit", %error, "could not give back a permit held for its maximum hold: it comes back when the lease time ends");
        }
    }

    /// Renews every grant still held; marks the lease lost when one is gone
    /// from the store, or none could be renewed for a lease time.
    pub(super) async fn renew(&self) {
        let mut grants = self.grants.lock().await;
        if self.released.load(Ordering::Acquire) {
            return;
        }
        let mut failed = false;
        for (at, charged) in by_time(&grants.held) {
            let renewal = Settle::Renew { at };
            match self.limiter.settle_charged(&charged, renewal).await {
                Ok(settled) => {
                    for (charge, renewed) in charged.iter().zip(settled.renewed) {
                        let grant = grants.held.iter_mut().find(|(c, t)| {
                            *t == Some(at)
                                && c.limit.name() == charge.limit.name()
                                && c.key == charge.key
                        });
                        if let Some((_, t)) = grant {
                            *t = renewed;
                        }
                    }
                }
                Err(error) => {
                    failed = true;
                    tracing::debug!(target: "tower_ratelimit", %error, "could not renew a lease");
                }
            }
        }
        if !failed {
            grants.renewed = tokio::time::Instant::now();
        }
        let gone = grants.held.iter().any(|(_, t)| t.is_none());
        if gone || grants.renewed.elapsed() >= self.lasts {
            self.lost.send_replace(true);
        }
    }
}

/// The held grants grouped by their store time: one store call each.
pub(super) fn by_time(held: &[(ChargedTo, Option<i64>)]) -> Vec<(i64, Charged)> {
    let mut groups: Vec<(i64, Charged)> = Vec::new();
    for (charge, at) in held {
        let Some(at) = *at else { continue };
        match groups.iter_mut().find(|(t, _)| *t == at) {
            Some((_, charged)) => charged.push(charge.clone()),
            None => groups.push((at, vec![charge.clone()])),
        }
    }
    groups
}

/// Renews the lease every [`Held::every`] until it is released, lost or
/// dropped; past [`Held::until`], or once its body has stalled for the
/// lease time, gives it back and marks it lost.
pub(super) async fn renewals(held: Weak<Held>) {
    let (every, until) = match held.upgrade() {
        Some(held) => (held.every, held.until),
        None => return,
    };
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let held_too_long = match until {
            Some(until) => tokio::time::timeout_at(until, ticks.tick()).await.is_err(),
            None => {
                ticks.tick().await;
                false
            }
        };
        let Some(held) = held.upgrade() else { return };
        let stalled = held
            .stall
            .as_ref()
            .is_some_and(|stall| stall.stalled_for() >= held.lasts);
        if held_too_long || stalled {
            held.expire().await;
            return;
        }
        if held.released.load(Ordering::Acquire) || *held.lost.borrow() {
            return;
        }
        held.renew().await;
    }
}
