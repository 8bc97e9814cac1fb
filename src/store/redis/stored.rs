//! Quotas kept in Redis (see `Limit::quota_from_store`): a key's override
//! beside its state (`<prefix>:{<escaped key>}:<limit>:ovr`), and a limit's
//! quota, `<prefix>:q:<limit>`, or on a cluster one copy per slot (a
//! decision reads only keys of its own slot), each holding the limit's
//! stored form (`Limit::stored_form`).

use super::RedisStore;
use crate::algorithm::Params;
use crate::store::{Check, Deadline, QuotaChange};
use crate::Error;

/// Keys written at once while a limit's quota is copied to every slot.
#[cfg(feature = "cluster")]
const COPIES_AT_ONCE: usize = 512;

impl RedisStore {
    /// The keys of `check`'s stored quota: its key's override when `keyed`;
    /// else the limit's quota key, or on a cluster its copy in every slot
    /// (the first: the copy in the slot of `check`'s key).
    fn quota_keys(&self, check: &Check<'_>, keyed: bool) -> Vec<Vec<u8>> {
        // the last two keys of a configured limit: its override, its quota
        let encoded = self.encode_keys(std::slice::from_ref(check), true);
        let keys: Vec<&[u8]> = encoded.keys().collect();
        let [.., over, quota] = keys.as_slice() else {
            return Vec::new();
        };
        if keyed {
            return vec![over.to_vec()];
        }
        #[allow(unused_mut)]
        let mut all = vec![quota.to_vec()];
        #[cfg(feature = "cluster")]
        if self.inner.lanes.is_cluster() {
            let name = check.limit.name();
            all.extend((0..super::cluster::SLOTS).filter_map(|slot| {
                let key = self.quota_key(name, super::cluster::slot_tag(slot).as_bytes());
                (key != *quota).then_some(key)
            }));
        }
        all
    }

    pub(super) async fn read_quota_now(
        &self,
        check: &Check<'_>,
        keyed: bool,
        deadline: Deadline,
    ) -> Result<Option<crate::Quota>, Error> {
        let Some(key) = self.quota_keys(check, keyed).into_iter().next() else {
            return Ok(None);
        };
        let cmd = &redis::cmd("GET").arg(key).clone();
        let value: Option<Vec<u8>> = self
            .inner
            .lanes
            .run(deadline, |mut conn| async move { conn.query(cmd).await })
            .await?;
        Ok(value
            .as_deref()
            .and_then(Params::from_stored)
            .map(|p| p.quota()))
    }

    pub(super) async fn write_quota_now(
        &self,
        check: &Check<'_>,
        keyed: bool,
        change: QuotaChange<'_>,
        deadline: Deadline,
    ) -> Result<bool, Error> {
        let keys = self.quota_keys(check, keyed);
        let Some((first, copies)) = keys.split_first() else {
            return Ok(false);
        };
        let run = |cmd: redis::Cmd| async move {
            let cmd = &cmd;
            self.inner
                .lanes
                .run(deadline, |mut conn| async move {
                    conn.query::<redis::Value>(cmd).await
                })
                .await
        };
        let changed = match change {
            QuotaChange::Keep {
                limit,
                ttl,
                if_absent,
            } => {
                let value = limit.stored_form();
                let mut set = redis::cmd("SET");
                set.arg(first).arg(value);
                if let Some(ttl) = ttl {
                    let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
                    set.arg("PX").arg(ms);
                }
                if if_absent {
                    set.arg("NX");
                }
                // nil: NX found one kept already
                let written = !matches!(run(set).await?, redis::Value::Nil);
                if written {
                    self.copy_everywhere(copies, Some(value), deadline).await?;
                }
                written
            }
            QuotaChange::Remove => {
                let deleted = run(redis::cmd("DEL").arg(first).clone()).await?;
                self.copy_everywhere(copies, None, deadline).await?;
                matches!(deleted, redis::Value::Int(n) if n > 0)
            }
        };
        Ok(changed)
    }

    /// Sets (`Some`) or deletes (`None`) every key of `copies`: a limit's
    /// quota in every slot of a cluster but the first.
    #[cfg_attr(not(feature = "cluster"), allow(clippy::unused_async))]
    async fn copy_everywhere(
        &self,
        copies: &[Vec<u8>],
        value: Option<&str>,
        deadline: Deadline,
    ) -> Result<(), Error> {
        #[cfg(feature = "cluster")]
        for chunk in copies.chunks(COPIES_AT_ONCE) {
            let cmds: Vec<redis::Cmd> = chunk
                .iter()
                .map(|key| match value {
                    Some(value) => redis::cmd("SET").arg(key).arg(value).clone(),
                    None => redis::cmd("DEL").arg(key).clone(),
                })
                .collect();
            let cmds = &cmds;
            self.inner
                .lanes
                .run(deadline, |conn| async move {
                    let sent = cmds.iter().map(|cmd| {
                        let mut conn = conn.clone();
                        async move { conn.query::<redis::Value>(cmd).await }
                    });
                    futures_util::future::try_join_all(sent).await
                })
                .await?;
        }
        #[cfg(not(feature = "cluster"))]
        let _ = (copies, value, deadline);
        Ok(())
    }
}
