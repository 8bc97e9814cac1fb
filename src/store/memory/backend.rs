//! The memory store's side of the store trait: every operation answered
//! at once, under the shards' locks (see the parent module).

use smallvec::SmallVec;

use super::kept::may_be_kept;
use super::penalized::{is_penalized, Run};
use super::MemoryStore;
use crate::algorithm::Reply;
use crate::penalty::PenState;
use crate::store::keys::{bounded_keys, bounded_one, is_bounded};
use crate::store::{
    Answer, Check, Deadline, Engine, Penalty, Quotas, Quoted, Settle, Settled, Shared,
};
use crate::Error;

impl Engine for MemoryStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
        _: Deadline,
    ) -> Answer<'a, Result<Reply, Error>> {
        // one limit that none of the steps below changes: straight to the
        // decision, without the steps' closures
        let reply = match checks {
            [check] if is_bounded(check) && !is_penalized(check) && !may_be_kept(check) => {
                self.decide_now(checks, max_wait, dry)
            }
            _ => bounded_keys(checks, |checks| {
                self.with_penalties(checks, Run::Decide { max_wait, dry }, |checks, blocked| {
                    self.with_kept(checks, |checks| {
                        self.decide_now(checks, max_wait, dry || blocked)
                    })
                })
            }),
        };
        #[cfg(feature = "metrics")]
        self.inner.size_gauge.report(reply.now, || self.len());
        Answer::Now(Ok(reply))
    }

    fn reset<'a>(&'a self, checks: &'a [Check<'a>], _: Deadline) -> Answer<'a, Result<(), Error>> {
        bounded_keys(checks, |checks| self.reset_now(checks));
        Answer::Now(Ok(()))
    }

    fn settle<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        how: Settle,
        _: Deadline,
    ) -> Answer<'a, Result<Settled, Error>> {
        Answer::Now(Ok(bounded_keys(checks, |checks| {
            self.with_kept(checks, |checks| self.settle_now(checks, how))
        })))
    }

    fn take<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        _: Deadline,
    ) -> Answer<'a, Result<(Reply, i64), Error>> {
        let most = checks.first().map_or(0, |c| c.cost);
        Answer::Now(Ok(bounded_keys(checks, |checks| {
            self.with_penalties(checks, Run::Take, |checks, blocked| {
                if !blocked {
                    return self.with_kept(checks, |checks| self.take_now(checks, most));
                }
                // blocked: a cost of 1 decided, not granted (as k = 0 is)
                let ones: SmallVec<[Check<'_>; 2]> =
                    checks.iter().map(|c| Check { cost: 1, ..*c }).collect();
                (self.with_kept(&ones, |c| self.decide_now(c, 0, true)), 0)
            })
        })))
    }

    fn penalty<'a>(
        &'a self,
        check: &'a Check<'a>,
        op: Penalty,
        _: Deadline,
    ) -> Answer<'a, Result<Option<(PenState, i64)>, Error>> {
        let changed = bounded_one(check, |check| self.change_pen_now(check, op));
        Answer::Now(changed.transpose().map(Option::flatten))
    }

    fn quotas<'a>(
        &'a self,
        check: &'a Check<'a>,
        keyed: bool,
        op: Quotas<'a>,
        _: Deadline,
    ) -> Answer<'a, Result<Quoted, Error>> {
        Answer::Now(Ok(match op {
            Quotas::Read => Quoted::Read(
                bounded_one(check, |check| self.read_quota_now(check, keyed)).flatten(),
            ),
            change => Quoted::Changed(
                bounded_one(check, |check| self.write_quota_now(check, keyed, change))
                    .unwrap_or(false),
            ),
        }))
    }

    fn shared(&self) -> &Shared {
        &self.inner.shared
    }
}
