//! One call of the library, encoded: its keys (the Redis key names, made
//! here only) and its arguments (the options and each limit's wire string
//! with its cost), written into one buffer.

use std::cell::RefCell;
use std::ops::Range;

use smallvec::SmallVec;

use super::RedisStore;
use crate::algorithm::wire::{Op, Opt, Options, PENALTY_KEY};
use crate::algorithm::Params;
use crate::store::{keys, Check};
use crate::Limit;

/// What one call of the library does (the [`Op`] of its options, see
/// `lua/driver.lua`; [`Op::Change`] is [`Encoded::change`]).
#[derive(Clone, Copy)]
pub(super) enum Operation {
    /// Decide, reserving up to `max_wait` us ahead; a `dry` run grants
    /// nothing (no op).
    Decide { max_wait: i64, dry: bool },
    /// Give back the grants made at store time `at` ([`Op::Refund`]).
    Refund { at: i64 },
    /// Take what is available, at most each check's cost ([`Op::Take`]).
    Take,
    /// Charge each check's cost, whatever is left ([`Op::Charge`]).
    Charge,
    /// Move the grants made at store time `at` to now, where still held
    /// ([`Op::Renew`]).
    Renew { at: i64 },
}

/// One call's keys and arguments, written into one buffer.
pub(super) struct Encoded {
    buf: Vec<u8>,
    keys: SmallVec<[Range<usize>; 2]>,
    args: SmallVec<[Range<usize>; 2]>,
}

impl Encoded {
    pub(super) fn key_count(&self) -> usize {
        self.keys.len()
    }

    pub(super) fn arg_count(&self) -> usize {
        self.args.len()
    }

    /// The bytes of every key and argument.
    pub(super) fn byte_len(&self) -> usize {
        self.buf.len()
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.keys.iter().filter_map(|r| self.buf.get(r.clone()))
    }

    pub(super) fn args(&self) -> impl Iterator<Item = &[u8]> {
        self.args.iter().filter_map(|r| self.buf.get(r.clone()))
    }

    /// One call of the library with the keys `keys` and the arguments
    /// `args`, each taken whole.
    fn of(keys: &[&[u8]], args: &[&[u8]]) -> Encoded {
        let size = keys.iter().chain(args).map(|a| a.len()).sum();
        let mut buf = Vec::with_capacity(size);
        let mut put = |bytes: &&[u8]| {
            let start = buf.len();
            buf.extend_from_slice(bytes);
            start..buf.len()
        };
        let keys = keys.iter().map(&mut put).collect();
        let args = args.iter().map(&mut put).collect();
        Encoded { buf, keys, args }
    }

    /// Several decisions' calls as one ([`Op::Batch`], see
    /// `lua/dispatch.lua`): every key in order; the options, then runs of
    /// decisions with the same arguments (consecutive ones, so that the
    /// order stays): `#<keys>:<arguments>:<count>` and the run's arguments
    /// once. The decisions of a batch usually share their limit: its string
    /// travels, and Redis reads it, once per run rather than per decision.
    pub(super) fn batch(parts: &[&Encoded]) -> Encoded {
        // (index of the run's first part, its length)
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            match runs.last_mut() {
                Some((start, len))
                    if parts[*start].key_count() == part.key_count()
                        && parts[*start].args().eq(part.args()) =>
                {
                    *len += 1
                }
                _ => runs.push((i, 1)),
            }
        }
        let heads: Vec<String> = runs
            .iter()
            .map(|&(start, len)| {
                let part = parts[start];
                format!("#{}:{}:{len}", part.key_count(), part.arg_count())
            })
            .collect();
        let keys: Vec<&[u8]> = parts.iter().flat_map(|part| part.keys()).collect();
        let mut options = Vec::new();
        Options::op(Op::Batch).write(&mut options);
        let mut args: Vec<&[u8]> = vec![&options];
        for (&(start, _), head) in runs.iter().zip(&heads) {
            args.push(head.as_bytes());
            args.extend(parts[start].args());
        }
        Encoded::of(&keys, &args)
    }

    /// A change of a kept quota ([`Op::Change`], see
    /// `lua/kept.lua`): the hash `hash`, then `command` (`HSET`, `HSETNX`
    /// or `HDEL`) and its arguments after the key.
    pub(super) fn change(hash: &[u8], command: &str, args: &[&[u8]]) -> Encoded {
        let mut options = Vec::new();
        Options::op(Op::Change).write(&mut options);
        let mut all: SmallVec<[&[u8]; 4]> = smallvec::smallvec![&options[..], command.as_bytes()];
        all.extend_from_slice(args);
        Encoded::of(&[hash], &all)
    }

    /// An operation on a key's penalty state ([`Op::Penalty`] of the library's
    /// options, see `lua/penalty.lua`): the key `key`, the options (with
    /// what to do) and the limit's string with a cost of 0.
    pub(super) fn penalty(key: &[u8], options: &[u8], limit: &Limit) -> Encoded {
        let mut wire = Vec::new();
        write_limit(&mut wire, limit, &mut itoa::Buffer::new());
        wire.push(b'0');
        Encoded::of(&[key], &[options, &wire])
    }

    /// Where the hash tag lies in the key written at `key`: after the
    /// prefix and its colon, up to and including the first `}` (escaped
    /// tags hold no other).
    fn tag_of(&self, key: Range<usize>, prefix: usize) -> Range<usize> {
        let start = key.start + prefix + 1;
        let end = self
            .buf
            .get(start..key.end)
            .and_then(|rest| rest.iter().position(|&b| b == b'}'))
            .map_or(key.end, |i| start + i + 1);
        start..end
    }
}

/// Appends `limit`'s argument to the decision function, less its cost
/// (see `lua/driver.lua`): its penalty's `p<refusals>:<within>:<forget>:<block
/// 1>:...;` when it has one, `c` when its quota may be kept in the store,
/// then its [stored form](write_stored_form).
pub(super) fn write_limit(out: &mut Vec<u8>, limit: &Limit, digits: &mut itoa::Buffer) {
    if let Some(pen) = limit.pen_params() {
        out.push(b'p');
        let head = [pen.refusals, pen.within, pen.forget];
        for (i, x) in head.iter().chain(pen.blocks.iter()).enumerate() {
            if i > 0 {
                out.push(b':');
            }
            out.extend_from_slice(digits.format(*x).as_bytes());
        }
        out.push(b';');
    }
    if limit.is_quota_from_store() {
        out.push(b'c');
    }
    write_stored_form(out, limit.params(), digits);
}

/// Appends how the store keeps a quota of parameters `p` (for a limit of
/// the same name to decide with, see `lua/kept.lua`):
/// `algorithm:p1:p2:p3:`, which the scripts complete with a cost and
/// [`Params::from_stored`] reads back. A limit's form is the same on every
/// call and its digits cost more to write than to find: each thread keeps
/// the forms it wrote last, a few by their parameters.
pub(super) fn write_stored_form(out: &mut Vec<u8>, p: &Params, digits: &mut itoa::Buffer) {
    type Forms = [(Option<Params>, Vec<u8>); 4];
    thread_local!(static FORMS: RefCell<Forms> = const {
        RefCell::new([const { (None, Vec::new()) }; 4])
    });
    FORMS.with_borrow_mut(|forms| {
        let (params, form) = &mut forms[usize::try_from(p.capacity()).unwrap_or(0) % 4];
        if *params != Some(*p) {
            form.clear();
            form.extend_from_slice(digits.format(p.algorithm().id()).as_bytes());
            form.push(b':');
            for x in p.wire() {
                form.extend_from_slice(digits.format(x).as_bytes());
                form.push(b':');
            }
            *params = Some(*p);
        }
        out.extend_from_slice(form);
    });
}

impl RedisStore {
    /// Every key of every check (`<prefix>:{<escaped key>}:<limit>:<part>`,
    /// see [`keys`]), written into a new buffer: the one place Redis key
    /// names are made. With `configured`, a limit whose quota may be kept in
    /// the store has one more after its own: the hash of its kept quotas
    /// (see [`quota_key`](Self::quota_key)), and a limit with a penalty one
    /// more after all of its own, its penalty key,
    /// `<prefix>:{<escaped key>}:<limit>:pen` (in the same slot).
    pub(super) fn encode_keys(&self, checks: &[Check<'_>], configured: bool) -> Encoded {
        let prefix = self.inner.prefix.as_bytes();
        let mut out = Encoded {
            buf: Vec::with_capacity(checks.iter().map(|c| 2 * c.key.len() + 96).sum()),
            keys: SmallVec::new(),
            args: SmallVec::new(),
        };
        // the first key of the check before (a quota's hash or a penalty
        // key may follow it)
        let mut before: Option<Range<usize>> = None;
        for (i, check) in checks.iter().enumerate() {
            // limits of one request often share its key: escape it once
            let shared = i > 0 && checks[i - 1].key == check.key;
            let tag = match (shared, before.take()) {
                (true, Some(first)) => Some(out.tag_of(first, prefix.len())),
                _ => None,
            };
            let name = check.limit.name().as_bytes();
            let stored = configured && check.limit.is_quota_from_store();
            let own = out.keys.len();
            for part in check.limit.params().algorithm().key_parts() {
                let start = out.buf.len();
                out.buf.extend_from_slice(prefix);
                out.buf.push(b':');
                match &tag {
                    Some(range) => out.buf.extend_from_within(range.clone()),
                    None => keys::write_tag(&mut out.buf, check.key),
                }
                out.buf.push(b':');
                out.buf.extend_from_slice(name);
                out.buf.push(b':');
                out.buf.extend_from_slice(part.as_bytes());
                out.keys.push(start..out.buf.len());
            }
            before = out.keys.get(own).cloned();
            if stored {
                let tag = out.keys.last().map(|k| out.tag_of(k.clone(), prefix.len()));
                let tag = tag
                    .and_then(|t| out.buf.get(t))
                    .unwrap_or_default()
                    .to_vec();
                let start = out.buf.len();
                self.write_quota_key(&mut out.buf, check.limit.name(), &tag);
                out.keys.push(start..out.buf.len());
            }
            if configured && check.limit.pen_params().is_some() {
                let start = out.buf.len();
                out.buf.extend_from_slice(prefix);
                out.buf.push(b':');
                if let Some(first) = out.keys.get(own) {
                    let tag = out.tag_of(first.clone(), prefix.len());
                    out.buf.extend_from_within(tag);
                }
                out.buf.push(b':');
                out.buf.extend_from_slice(name);
                out.buf.push(b':');
                out.buf.extend_from_slice(PENALTY_KEY.as_bytes());
                out.keys.push(start..out.buf.len());
            }
        }
        out
    }

    /// The hash of the quotas kept in the store for the limit `name`, as a
    /// decision in the slot of the hash tag `tag` reads it: field `""` the
    /// limit's, and per key an override under the key's first state key
    /// (see `lua/kept.lua`). One hash, `<prefix>:q:<name>`, or on a
    /// cluster one per slot, `<prefix>:q:{<slot's tag>}:<name>` (see
    /// `cluster::slot_tag`), each with the limit's quota and the overrides
    /// of the keys in that slot.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(super) fn quota_key(&self, name: &str, tag: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_quota_key(&mut out, name, tag);
        out
    }

    /// Appends [`quota_key`](Self::quota_key)`(name, tag)` to `out`.
    fn write_quota_key(&self, out: &mut Vec<u8>, name: &str, tag: &[u8]) {
        out.extend_from_slice(self.inner.prefix.as_bytes());
        out.extend_from_slice(b":q:");
        #[cfg(feature = "cluster")]
        if self.inner.lanes.is_cluster() {
            let slot = super::cluster::slot(tag);
            out.extend_from_slice(super::cluster::slot_tag(slot).as_bytes());
            out.push(b':');
        }
        let _ = tag;
        out.extend_from_slice(name.as_bytes());
    }

    /// The keys and arguments of one call of the library (see the header of
    /// `lua/driver.lua`): every key of every check, the options when they
    /// differ from a plain decision's, then each limit with its cost, written
    /// into one buffer.
    pub(super) fn encode(&self, checks: &[Check<'_>], operation: Operation) -> Encoded {
        let mut out = self.encode_keys(checks, true);
        let now = self
            .inner
            .shared
            .clock
            .as_ref()
            .map_or(0, |c| c.now_micros());
        let slack = self.inner.slack;
        let base = Options::default()
            .with(Opt::Now, now)
            .with(Opt::Slack, slack);
        let options = match operation {
            // The options travel only when one differs from the production default.
            Operation::Decide { max_wait, dry } => {
                ((now, max_wait, dry, slack) != (0, 0, false, 0)).then(|| {
                    base.with(Opt::MaxWait, max_wait)
                        .with(Opt::Dry, i64::from(dry))
                })
            }
            Operation::Refund { at } => {
                Some(base.with(Opt::Op, Op::Refund as i64).with(Opt::At, at))
            }
            Operation::Take => Some(base.with(Opt::Op, Op::Take as i64)),
            Operation::Charge => Some(base.with(Opt::Op, Op::Charge as i64)),
            Operation::Renew { at } => Some(base.with(Opt::Op, Op::Renew as i64).with(Opt::At, at)),
        };
        if let Some(options) = options {
            let start = out.buf.len();
            options.write(&mut out.buf);
            out.args.push(start..out.buf.len());
        }
        let mut digits = itoa::Buffer::new();
        for check in checks {
            let start = out.buf.len();
            write_limit(&mut out.buf, check.limit, &mut digits);
            out.buf
                .extend_from_slice(digits.format(check.cost).as_bytes());
            out.args.push(start..out.buf.len());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::redis::RedisStore;
    use crate::Quota;

    /// One buffer holds what the reset's key names and the limits' wire
    /// strings say, in order, with a key's tag written once and reused.
    #[test]
    fn encoded_keys_and_arguments_name_every_key_of_every_check() {
        let store = RedisStore::builder("redis://127.0.0.1:1/")
            .prefix("p")
            .build()
            .expect("store");
        let minute = Duration::from_secs(60);
        let log = Limit::new("log", Quota::sliding_log(3, minute)).expect("limit");
        let gcra = Limit::new("g", Quota::gcra(1, minute, 2)).expect("limit");
        let keys: [&[u8]; 3] = [b"a}:{b", b"a}:{b", b"x"];
        let checks = [
            Check {
                limit: &log,
                key: keys[0],
                cost: 1,
            },
            Check {
                limit: &gcra,
                key: keys[1],
                cost: 1,
            },
            Check {
                limit: &gcra,
                key: keys[2],
                cost: 2,
            },
        ];
        let encoded = store.encode(
            &checks,
            Operation::Decide {
                max_wait: 0,
                dry: false,
            },
        );
        let got: Vec<&[u8]> = encoded.keys().collect();
        let expected: [&[u8]; 4] = [
            b"p:{a%7D:%7Bb}:log:log",
            b"p:{a%7D:%7Bb}:log:meta",
            b"p:{a%7D:%7Bb}:g:gcra",
            b"p:{x}:g:gcra",
        ];
        assert_eq!(got, expected);
        let reset = store.encode_keys(&checks, false);
        assert!(reset.keys().eq(expected.iter().copied()));
        assert_eq!(reset.args().count(), 0);
        let args: Vec<&[u8]> = encoded.args().collect();
        // a sliding log of 3 per minute, a GCRA of 1 per minute, bursts of 2
        let (log, gcra) = ("1:3:60000000:0:".to_owned(), "3:2:1:60000000:".to_owned());
        let wire = |l: &str, cost: &str| format!("{l}{cost}").into_bytes();
        assert_eq!(args, [wire(&log, "1"), wire(&gcra, "1"), wire(&gcra, "2")]);
        let refund = store.encode(&checks[2..], Operation::Refund { at: 7 });
        let args: Vec<&[u8]> = refund.args().collect();
        assert_eq!(args, [b"o:0:0:0:0:1:7".to_vec(), wire(&gcra, "2")]);
    }

    /// A limit keyed like the one before it takes that key's tag from the
    /// other's own keys, not from the hash of its kept quotas that
    /// follows them: a decision and a reset name the same keys.
    #[test]
    fn a_key_shared_with_a_limit_whose_quota_is_kept_keeps_its_tag() {
        let store = RedisStore::builder("redis://127.0.0.1:1/")
            .prefix("p")
            .build()
            .expect("store");
        let minute = Duration::from_secs(60);
        let kept = Limit::new("a", Quota::gcra(1, minute, 2))
            .expect("limit")
            .quota_from_store();
        let own = Limit::new("b", Quota::gcra(1, minute, 2)).expect("limit");
        let checks = [&kept, &own].map(|limit| Check {
            limit,
            key: b"k",
            cost: 1,
        });
        let decided = store.encode_keys(&checks, true);
        let expected: [&[u8]; 3] = [b"p:{k}:a:gcra", b"p:q:a", b"p:{k}:b:gcra"];
        assert!(decided.keys().eq(expected.iter().copied()));
        let reset = store.encode_keys(&checks, false);
        assert!(reset.keys().eq([expected[0], expected[2]]));
    }

    /// A batch sends consecutive decisions with the same arguments as one
    /// run, their limit's string once, every key in order.
    #[test]
    fn a_batch_sends_the_arguments_of_a_run_once() {
        let store = RedisStore::builder("redis://127.0.0.1:1/")
            .prefix("p")
            .build()
            .expect("store");
        let minute = Duration::from_secs(60);
        let gcra = Limit::new("g", Quota::gcra(1, minute, 2)).expect("limit");
        let decide = Operation::Decide {
            max_wait: 0,
            dry: false,
        };
        let one = |key: &'static [u8], cost: i64| {
            let check = Check {
                limit: &gcra,
                key,
                cost,
            };
            store.encode(&[check], decide)
        };
        let parts = [one(b"a", 1), one(b"b", 1), one(b"c", 2), one(b"d", 1)];
        let batch = Encoded::batch(&parts.iter().collect::<Vec<_>>());
        let keys: Vec<&[u8]> = batch.keys().collect();
        let expected: [&[u8]; 4] = [
            b"p:{a}:g:gcra",
            b"p:{b}:g:gcra",
            b"p:{c}:g:gcra",
            b"p:{d}:g:gcra",
        ];
        assert_eq!(keys, expected);
        let args: Vec<Vec<u8>> = batch.args().map(<[u8]>::to_vec).collect();
        let wire = |cost: &str| format!("3:2:1:60000000:{cost}").into_bytes();
        let expected = [
            b"o:0:0:0:0:7".to_vec(),
            b"#1:1:2".to_vec(),
            wire("1"),
            b"#1:1:1".to_vec(),
            wire("2"),
            b"#1:1:1".to_vec(),
            wire("1"),
        ];
        assert_eq!(args, expected);
    }
}
