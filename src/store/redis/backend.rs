//! The Redis store's side of the store trait: a decision, a reset, a
//! settlement and a take, each one call of the library (or one per slot of
//! a cluster).

use super::RedisStore;
use crate::algorithm::Reply;
use crate::store::{
    Answer, Check, Deadline, Engine, Penalty, Quotas, Quoted, Settle, Settled, Shared,
};
use crate::Error;

/// Reads `packed`, the library's reply to a call over `limits` limits, with
/// `read`; a reply it cannot read is an [`Error::UnexpectedReply`] (`what`:
/// the operation, as the error names it).
pub(super) fn read_reply<T>(
    packed: &[u8],
    limits: usize,
    read: fn(&[u8], usize) -> Option<T>,
    what: &str,
) -> Result<T, Error> {
    read(packed, limits).ok_or_else(|| {
        Error::UnexpectedReply(format!("{} bytes for {what}{limits} limits", packed.len()))
    })
}

impl Engine for RedisStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
        deadline: Deadline,
    ) -> Answer<'a, Result<Reply, Error>> {
        let deadline = deadline.start();
        Answer::Later(Box::pin(async move {
            if self.inner.shared.names.take_calendar_check() {
                let inner = &self.inner;
                super::durability::check(&inner.lanes, inner.encoder.prefix());
            }
            #[cfg(feature = "cluster")]
            if let Some(groups) = self.slot_groups(checks) {
                // boxed: the common decision's future stays small
                return Box::pin(self.decide_across_slots(checks, &groups, dry, deadline)).await;
            }
            // keys in one slot: one call
            let encoded = self.inner.encoder.decide(checks, max_wait, dry);
            let coalescer = &self.inner.coalescer;
            let packed = coalescer.decide(self, checks, encoded, deadline).await?;
            super::stored::report_ignored(self.prefix(), &packed, checks, 0);
            read_reply(&packed, checks.len(), Reply::from_packed, "")
        }))
    }

    fn reset<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        deadline: Deadline,
    ) -> Answer<'a, Result<(), Error>> {
        let deadline = deadline.start();
        Answer::Later(Box::pin(async move {
            let mut cmd = redis::cmd("DEL");
            for key in self.inner.encoder.keys(checks, false).keys() {
                cmd.arg(key);
            }
            self.inner.lanes.command(&cmd, deadline).await
        }))
    }

    fn settle<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        how: Settle,
        deadline: Deadline,
    ) -> Answer<'a, Result<Settled, Error>> {
        let deadline = deadline.start();
        Answer::Later(Box::pin(async move {
            #[cfg(feature = "cluster")]
            if let Some(groups) = self.slot_groups(checks) {
                return self
                    .settle_across_slots(checks, &groups, how, deadline)
                    .await;
            }
            self.settle_group(checks, how, deadline).await
        }))
    }

    fn take<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        deadline: Deadline,
    ) -> Answer<'a, Result<(Reply, i64), Error>> {
        let deadline = deadline.start();
        Answer::Later(Box::pin(async move {
            let encoded = self.inner.encoder.take(checks);
            let packed = self.call(&encoded, deadline).await?;
            super::stored::report_ignored(self.prefix(), &packed, checks, 1);
            read_reply(
                &packed,
                checks.len(),
                Reply::from_packed_take,
                "taking from ",
            )
        }))
    }

    fn quotas<'a>(
        &'a self,
        check: &'a Check<'a>,
        keyed: bool,
        op: Quotas<'a>,
        deadline: Deadline,
    ) -> Answer<'a, Result<Quoted, Error>> {
        Answer::Later(Box::pin(self.admin().quotas(
            check,
            keyed,
            op,
            deadline.start(),
        )))
    }

    fn penalty<'a>(
        &'a self,
        check: &'a Check<'a>,
        op: Penalty,
        deadline: Deadline,
    ) -> Answer<'a, Result<Option<(crate::penalty::PenState, i64)>, Error>> {
        Answer::Later(Box::pin(self.admin().penalty(check, op, deadline.start())))
    }

    fn shared(&self) -> &Shared {
        &self.inner.shared
    }
}
