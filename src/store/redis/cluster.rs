//! Decisions whose keys live in several cluster slots.
//!
//! Redis runs a script on one node, over keys of one slot. A decision over
//! limits keyed differently (per client IP and per phone number, say) is
//! split into one group per slot; the groups are decided in parallel, each
//! atomically on its own primary, and the decision is "all or nothing" again
//! by giving back what the groups that granted took when another refused.
//!
//! Two consequences, both documented on [`RedisStore`](super::RedisStore):
//! - Between a group's grant and its refund (one round trip), that grant is
//!   visible: a concurrent request may be refused for a permit that is about
//!   to come back. Requests are only ever refused by it, never admitted.
//! - A decision across slots never reserves a future grant (`acquire`, the
//!   layer's delay mode): each group would reserve its own earliest time on
//!   its own node's clock, and a limit granted earlier than the request runs
//!   would let its next requests in early. It grants what every slot can
//!   grant now, or refuses with the wait until each of them could.
//! - A [`Grant`](crate::Grant) of limits in several slots is given back at
//!   the decision's time, the latest of the slots' clocks: buckets and
//!   windows get it back exactly, but a sliding-log limit in a slot whose
//!   primary decided at another microsecond keeps its entry (its limit counts
//!   that request until the window passes). Refunds of one slot's limits,
//!   the login case, are exact.

use smallvec::SmallVec;

use super::RedisStore;
use crate::algorithm::{EachMode, Params, Reply, Status, Statuses, VerdictCode};
use crate::store::{keys, Answer, Check, Deadline, Engine, Settle, Settled};
use crate::Error;

/// A call of a store over checks split by the cluster slot of their
/// keys, each slot's made on its own.
pub(super) struct Split<'a> {
    store: &'a RedisStore,
    /// One per slot, first appearance first.
    groups: Vec<Group<'a>>,
    /// How many checks the call has.
    len: usize,
}

/// The checks of one slot: their indices in the call, and the checks.
type Group<'a> = (SmallVec<[usize; 2]>, SmallVec<[Check<'a>; 2]>);

impl<'a> Split<'a> {
    /// `store`'s call over `checks` split by slot; `None` when all share
    /// one.
    pub(super) fn of(store: &'a RedisStore, checks: &[Check<'a>]) -> Option<Self> {
        if checks.len() < 2 {
            return None;
        }
        let mut slots: SmallVec<[u16; 2]> = SmallVec::new();
        let mut groups: Vec<Group<'a>> = Vec::new();
        for (index, check) in checks.iter().enumerate() {
            let slot = slot(keys::tag(check.key));
            let at = slots.iter().position(|&s| s == slot).unwrap_or_else(|| {
                slots.push(slot);
                groups.push(Default::default());
                groups.len() - 1
            });
            groups[at].0.push(index);
            groups[at].1.push(*check);
        }
        let len = checks.len();
        (groups.len() > 1).then_some(Split { store, groups, len })
    }

    /// The answers of `call` on each slot's checks, made in parallel.
    async fn each<'s, T>(&'s self, call: impl Fn(&'s [Check<'a>]) -> Answer<'s, T>) -> Vec<T> {
        let calls = self.groups.iter().map(|(_, checks)| call(checks).get());
        futures_util::future::join_all(calls).await
    }

    /// Settles a grant across slots: each slot's checks in parallel; the
    /// first error, if any, after all were tried.
    pub(super) async fn settle(&self, how: Settle, deadline: Deadline) -> Result<Settled, Error> {
        let store = self.store;
        let results = self
            .each(|checks| store.settle(checks, how, deadline))
            .await;
        let mut settled = Settled::default();
        if let Settle::Renew { .. } = how {
            settled.renewed = smallvec::smallvec![None; self.len];
        }
        for ((group, _), result) in self.groups.iter().zip(results) {
            for (&index, renewed) in group.iter().zip(result?.renewed) {
                if let Some(slot) = settled.renewed.get_mut(index) {
                    *slot = renewed;
                }
            }
        }
        Ok(settled)
    }

    /// A set over several slots: each slot's checks decided by `mode` in a
    /// call of their own, in parallel, the replies merged. Each check of
    /// [`EachMode::Counted`] counts on its own. With the other modes, when
    /// a check is over in one slot, the slots where none was (which counted
    /// all of their checks' costs) give them back, as the crate's own
    /// decisions across slots do: not atomic with the calls (a request in
    /// between may be refused by what is given back a moment later). A
    /// refund among the checks stays applied, as on one slot.
    pub(super) async fn each_set(
        &self,
        mode: EachMode,
        deadline: Deadline,
    ) -> Result<Reply, Error> {
        let store = self.store;
        let mut replies = self.each(|checks| store.each(checks, mode, deadline)).await;
        let over_somewhere = replies.iter().any(|r| match r {
            Ok(reply) => !reply.granted(),
            Err(_) => false,
        });
        if over_somewhere && mode != EachMode::Counted {
            for ((_, checks), reply) in self.groups.iter().zip(replies.iter_mut()) {
                let Ok(reply) = reply else { continue };
                if !reply.granted() {
                    continue;
                }
                let taken: SmallVec<[Check<'a>; 2]> =
                    checks.iter().filter(|c| c.cost > 0).copied().collect();
                if taken.is_empty() {
                    continue;
                }
                let refund = Settle::Refund { at: reply.at() };
                match store.settle(&taken, refund, deadline).get().await {
                    Ok(_) => {
                        for (j, check) in checks.iter().enumerate() {
                            if check.cost <= 0 {
                                continue;
                            }
                            let capacity =
                                reply.stored(j).unwrap_or(check.limit.params()).capacity();
                            if let Some(status) = reply.limits.get_mut(j) {
                                status.give_back(check.cost, capacity);
                            }
                        }
                    }
                    Err(error) => tracing::warn!(
                        target: "tower_ratelimit::redis",
                        %error,
                        "could not give back the costs of a set refused in another slot: \
                         its limits count them until their windows pass"
                    ),
                }
            }
        }
        let allows = Status::Allows {
            wait: 0,
            remaining: 0,
            reset: 0,
        };
        let mut limits: Statuses = smallvec::smallvec![allows; self.len];
        let mut stored: Option<Box<[Option<Params>]>> = None;
        let (mut never, mut over, mut wait, mut now) = (false, false, 0i64, 0i64);
        for ((group, _), reply) in self.groups.iter().zip(replies) {
            let reply = reply?;
            now = now.max(reply.now);
            for (j, (&index, status)) in group.iter().zip(&reply.limits).enumerate() {
                if let Some(params) = reply.stored(j) {
                    let all = stored.get_or_insert_with(|| vec![None; self.len].into());
                    if let Some(slot) = all.get_mut(index) {
                        *slot = Some(*params);
                    }
                }
                if let Some(slot) = limits.get_mut(index) {
                    *slot = *status;
                }
                match status.wait() {
                    Some(w) => {
                        over |= w > 0;
                        wait = wait.max(w);
                    }
                    None => never = true,
                }
            }
        }
        let (verdict, wait) = VerdictCode::gathered(never, over, wait);
        Ok(Reply {
            verdict,
            wait,
            now,
            limits,
            stored,
        })
    }

    /// Decides across slots: each slot's checks in parallel, what they
    /// granted given back when one refused (see the module docs).
    pub(super) async fn decide(&self, dry: bool, deadline: Deadline) -> Result<Reply, Error> {
        let store = self.store;
        let replies = self
            .each(|checks| store.decide(checks, 0, dry, deadline))
            .await;
        let allows = Status::Allows {
            wait: 0,
            remaining: 0,
            reset: 0,
        };
        let mut limits: Statuses = smallvec::smallvec![allows; self.len];
        let mut stored: Option<Box<[Option<Params>]>> = None;
        let (mut never, mut wait, mut now) = (false, 0i64, 0i64);
        for ((group, _), reply) in self.groups.iter().zip(&replies) {
            let Ok(reply) = reply else { continue };
            now = now.max(reply.now);
            for (j, (&index, status)) in group.iter().zip(&reply.limits).enumerate() {
                if let Some(params) = reply.stored(j) {
                    let all = stored.get_or_insert_with(|| vec![None; self.len].into());
                    if let Some(slot) = all.get_mut(index) {
                        *slot = Some(*params);
                    }
                }
                limits[index] = *status;
                match status.wait() {
                    Some(w) => wait = wait.max(w),
                    None => never = true,
                }
            }
        }
        let failed = replies.iter().any(Result::is_err);
        let granted_all = !failed && !never && wait == 0;
        if !granted_all && !dry {
            // all or nothing: what the other slots granted goes back
            for ((group, checks), reply) in self.groups.iter().zip(&replies) {
                let Ok(reply) = reply else { continue };
                if !reply.granted() {
                    continue;
                }
                let refund = Settle::Refund { at: reply.at() };
                match store.settle(checks, refund, deadline).get().await {
                    Ok(_) => {
                        for (j, (&index, check)) in group.iter().zip(checks).enumerate() {
                            let capacity =
                                reply.stored(j).unwrap_or(check.limit.params()).capacity();
                            if let Some(status) = limits.get_mut(index) {
                                status.give_back(check.cost, capacity);
                            }
                        }
                    }
                    Err(error) => tracing::warn!(
                        target: "tower_ratelimit::redis",
                        %error,
                        "could not give back a grant of a decision refused in another slot: \
                         its limit counts one request too many until its window passes"
                    ),
                }
            }
        }
        // the first error, as one slot's decision would have failed
        for reply in replies {
            reply?;
        }
        let (verdict, wait) = VerdictCode::gathered(never, wait > 0, wait);
        Ok(Reply {
            verdict,
            wait,
            now,
            limits,
            stored,
        })
    }
}

/// The slot of a key whose hash tag is `tag` (`{...}`): CRC16 (XMODEM) of
/// what the braces enclose, modulo 16384, as Redis Cluster computes it.
pub(super) fn slot(tag: impl AsRef<[u8]>) -> u16 {
    let tag = tag.as_ref();
    let inner = tag
        .strip_prefix(b"{")
        .and_then(|t| t.strip_suffix(b"}"))
        .unwrap_or(tag);
    crc16::State::<crc16::XMODEM>::calculate(inner) % 16384
}

/// Slots of a cluster.
pub(super) const SLOTS: u16 = 16384;

/// A hash tag for each slot (`{n}` for the smallest number n that lands
/// there): where a quota kept in the store is copied, once per slot, so
/// that a decision finds it in its own slot (see `Limit::use_stored_quota`).
pub(super) fn slot_tag(of: u16) -> &'static str {
    static TAGS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        let mut tags = vec![String::new(); usize::from(SLOTS)];
        let mut missing = tags.len();
        let mut n = 0u32;
        while missing > 0 {
            let tag = format!("{{{n}}}");
            let at = usize::from(slot(&tag));
            if tags[at].is_empty() {
                tags[at] = tag;
                missing -= 1;
            }
            n += 1;
        }
        tags
    });
    tags.get(usize::from(of)).map_or("{0}", String::as_str)
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_slot_has_a_tag_that_lands_in_it() {
        for slot in 0..super::SLOTS {
            assert_eq!(super::slot(super::slot_tag(slot)), slot);
        }
    }
}
