//! The Redis engine's admin operations: the quotas kept in the store and
//! the keys' penalty states, read and changed by hand.
//!
//! Quotas kept in Redis (see `Limit::use_stored_quota`): one hash per limit,
//! `<prefix>:q:<limit>` (on a cluster, one per slot, see
//! `Encoder::quota_key`), field `""` the limit's quota (on a cluster,
//! copied to every slot's hash), and per key an override, under the key's
//! first state key, in the hash of that key's slot. Each value is the
//! limit's stored form (`encode::write_stored_form`), an override's
//! followed by `@` and the store time (us) it ends, when it does: a
//! decision reads both through a mirror of the hash in the Lua VM (see
//! `lua/kept.lua`). Every
//! write here goes through the library (op 3 of its options), which drops
//! that mirror, so a change is in force for the next decision on each
//! server it wrote; reads here are plain `HGET`s. An ended override is
//! ignored, and its field deleted by the first decision of its key after
//! its end, by the next read of a mirrored hash, or when the key's
//! override is next set or removed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use super::conn::Lanes;
use super::encode::{Encoded, Encoder};
use super::script::Library;
use crate::algorithm::Params;
use crate::penalty::PenState;
use crate::store::{lock, Check, Deadline, Penalty, Quotas, Quoted};
use crate::{Error, Quota};

/// Hashes written at once while a limit's quota is copied to every slot.
#[cfg(feature = "cluster")]
const COPIES_AT_ONCE: usize = 512;

/// The admin operations of a store (the contract's `quotas` and
/// `penalty`), over its encoder, library and lanes.
#[derive(Clone, Copy)]
pub(super) struct Admin<'a> {
    pub(super) encoder: &'a Encoder,
    pub(super) library: &'a Library,
    pub(super) lanes: &'a Arc<Lanes>,
}

impl Admin<'_> {
    /// Reads `check`'s kept quota, or changes it: its key's override when
    /// `keyed`, else its limit's (on a cluster, in every slot's hash).
    pub(super) async fn quotas(
        self,
        check: &Check<'_>,
        keyed: bool,
        op: Quotas<'_>,
        deadline: Deadline,
    ) -> Result<Quoted, Error> {
        if let Quotas::Read = op {
            return Ok(Quoted::Read(self.read_quota(check, keyed, deadline).await?));
        }
        let (hash, field) = self.place(check, keyed);
        let copies = match keyed {
            true => Vec::new(),
            false => self.encoder.quota_copies(check.limit.name(), &hash),
        };
        // whether an override lasts (an ended one is replaced or dropped)
        let lasting = keyed && self.read_quota(check, true, deadline).await?.is_some();
        let changed = match op {
            Quotas::Read => false,
            Quotas::Keep {
                limit,
                ttl,
                if_absent,
            } => {
                if if_absent && lasting {
                    return Ok(Quoted::Changed(false));
                }
                let mut value = Vec::new();
                super::encode::write_stored_form(
                    &mut value,
                    limit.params(),
                    &mut itoa::Buffer::new(),
                );
                let mut value = String::from_utf8_lossy(&value).into_owned();
                if let Some(ttl) = ttl {
                    let us = i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX).max(1);
                    let ends = self.store_time(deadline).await?.saturating_add(us);
                    value.push('@');
                    value.push_str(&ends.to_string());
                }
                // (a limit's quota: only if none is kept; HSETNX answers 0 then)
                let nx = if_absent && !keyed;
                let set = if nx { "HSETNX" } else { "HSET" };
                let added = self
                    .change(&hash, set, &[&field, value.as_bytes()], deadline)
                    .await?;
                let written = !nx || added == 1;
                if written {
                    self.copy_everywhere(&copies, Some(&value), deadline)
                        .await?;
                }
                written
            }
            Quotas::Remove => {
                let deleted = self.change(&hash, "HDEL", &[&field], deadline).await?;
                self.copy_everywhere(&copies, None, deadline).await?;
                // an override that had ended counts as none
                lasting || (!keyed && deleted > 0)
            }
        };
        Ok(Quoted::Changed(changed))
    }

    /// Where `check`'s kept quota is: the hash in its key's slot, and the
    /// field, its key's (its first state key) when `keyed`, else the
    /// limit's (`""`).
    fn place(self, check: &Check<'_>, keyed: bool) -> (Vec<u8>, Vec<u8>) {
        // a configured limit's keys: its state keys, then its quotas' hash
        // (a penalty key may follow)
        let encoded = self.encoder.keys(std::slice::from_ref(check), true);
        let keys: Vec<&[u8]> = encoded.keys().collect();
        let key = |i: usize| keys.get(i).map_or_else(Vec::new, |key| key.to_vec());
        let n = check.limit.params().algorithm().key_parts().len();
        (key(n), if keyed { key(0) } else { Vec::new() })
    }

    async fn read_quota(
        self,
        check: &Check<'_>,
        keyed: bool,
        deadline: Deadline,
    ) -> Result<Option<Quota>, Error> {
        let (hash, field) = self.place(check, keyed);
        let get = redis::cmd("HGET").arg(hash).arg(field).clone();
        let value: Option<Vec<u8>> = self.lanes.command(&get, deadline).await?;
        let Some(value) = value else {
            return Ok(None);
        };
        // (one the library would ignore reads as none)
        let Some((params, ends)) = split_ends(&value) else {
            return Ok(None);
        };
        if let Some(ends) = ends {
            if ends <= self.store_time(deadline).await? {
                return Ok(None);
            }
        }
        Ok(Params::from_stored(params).map(|p| p.quota()))
    }

    /// The store's time (us): its clock's, or the server's `TIME`.
    async fn store_time(self, deadline: Deadline) -> Result<i64, Error> {
        if let Some(us) = self.encoder.clock_time() {
            return Ok(us);
        }
        let time = redis::cmd("TIME");
        let (secs, micros): (i64, i64) = self.lanes.command(&time, deadline).await?;
        Ok(secs * 1_000_000 + micros)
    }

    /// Runs `command` (`HSET`, `HSETNX` or `HDEL`) with `args` on the hash
    /// `hash` through the library (op 3, see `lua/kept.lua`), which drops
    /// its mirror of the hash: the command's integer, which the library
    /// answers as text.
    async fn change(
        self,
        hash: &[u8],
        command: &str,
        args: &[&[u8]],
        deadline: Deadline,
    ) -> Result<i64, Error> {
        let change = Encoded::change(hash, command, args);
        let reply = self.library.call(self.lanes, &change, deadline).await?;
        let count = std::str::from_utf8(&reply)
            .ok()
            .and_then(|t| t.parse().ok());
        count.ok_or_else(|| {
            let len = reply.len();
            Error::UnexpectedReply(format!("{len} bytes for a change of a kept quota"))
        })
    }

    /// Sets (`Some`) or deletes (`None`) the limit's own quota in every hash
    /// of `copies` (every other slot's, on a cluster), each through the
    /// library (see [`change`](Self::change)).
    #[cfg_attr(not(feature = "cluster"), allow(clippy::unused_async))]
    async fn copy_everywhere(
        self,
        copies: &[Vec<u8>],
        value: Option<&str>,
        deadline: Deadline,
    ) -> Result<(), Error> {
        #[cfg(feature = "cluster")]
        for chunk in copies.chunks(COPIES_AT_ONCE) {
            let calls: Vec<Encoded> = chunk
                .iter()
                .map(|hash| match value {
                    Some(value) => Encoded::change(hash, "HSET", &[b"", value.as_bytes()]),
                    None => Encoded::change(hash, "HDEL", &[b""]),
                })
                .collect();
            let sent = calls
                .iter()
                .map(|encoded| self.library.call(self.lanes, encoded, deadline));
            futures_util::future::try_join_all(sent).await?;
        }
        #[cfg(not(feature = "cluster"))]
        let _ = (copies, value, deadline);
        Ok(())
    }

    /// Applies `op` to `check`'s penalty state through the library (op 6,
    /// see `lua/penalty.lua`): the state after it (before it, for an
    /// unblock) and the store time; `None` for a limit without a penalty.
    pub(super) async fn penalty(
        self,
        check: &Check<'_>,
        op: Penalty,
        deadline: Deadline,
    ) -> Result<Option<(PenState, i64)>, Error> {
        let Some(encoded) = self.encoder.penalty(check, op) else {
            return Ok(None);
        };
        let reply = self.library.call(self.lanes, &encoded, deadline).await?;
        let values: Vec<i64> = reply
            .chunks_exact(8)
            .filter_map(|c| c.try_into().ok().map(f64::from_le_bytes))
            .filter(|x| x.fract() == 0.0 && x.abs() < crate::algorithm::EXACT as f64)
            .map(|x| x as i64)
            .collect();
        match values.as_slice() {
            &[until, offences, count, since, now] if reply.len() == 40 => Ok(Some((
                PenState {
                    until,
                    offences,
                    count,
                    since,
                },
                now,
            ))),
            _ => Err(Error::UnexpectedReply(format!(
                "{} bytes for a penalty state",
                reply.len()
            ))),
        }
    }
}

/// Logs, once per limit name and process, that a decision's reply
/// `packed` over `checks` (of the store of prefix `prefix`) says a
/// limit's quota kept in the store, or
/// its key's override, was ignored (not valid, or of another algorithm:
/// see `valid_kept` in `lua/kept.lua`); the limit's own quota decided.
/// `extra` doubles follow the statuses (a take's amount). Reads nothing
/// from a reply without notes, the usual one.
pub(super) fn report_ignored(prefix: &str, packed: &[u8], checks: &[Check<'_>], extra: usize) {
    if packed.len() <= crate::algorithm::packed_len(checks.len(), extra) {
        return;
    }
    static WARNED: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    for i in crate::algorithm::ignored(packed, checks.len(), extra) {
        let Some(check) = checks.get(i) else { continue };
        let name = check.limit.shared_name();
        let first = lock(&WARNED).get_or_insert_with(HashSet::new).insert(name);
        if first {
            tracing::warn!(
                target: "tower_ratelimit",
                limit = name,
                prefix = %prefix,
                "a quota kept in the store for this limit, or an override of one of its \
                 keys, in <prefix>:q:<limit> is not valid (or of another algorithm): \
                 ignored, the limit's own quota decides; logged once"
            );
        }
    }
}

/// A kept value's stored form, and when it ends (`@<us>` after it, digits
/// below 2^53); `None` for a value whose end the library cannot read (see
/// `kept_quota` in `lua/kept.lua`).
fn split_ends(value: &[u8]) -> Option<(&[u8], Option<i64>)> {
    match value.iter().position(|&b| b == b'@') {
        Some(at) => {
            let digits = &value[at + 1..];
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let ends = std::str::from_utf8(digits).ok()?.parse::<i64>().ok()?;
            (ends < crate::algorithm::EXACT).then_some((&value[..at], Some(ends)))
        }
        None => Some((value, None)),
    }
}
