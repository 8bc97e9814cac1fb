//! The Redis engine's encoder: each call of the library written into one
//! buffer, its keys (the Redis key names, made here only) and its
//! arguments (the options, with the op code of the contract's operation,
//! and each limit's wire string with its cost).

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::algorithm::wire::{Op, Opt, Options, PENALTY_KEY};
use crate::algorithm::{EachMode, Params};
use crate::clock::Clock;
use crate::store::{keys, Check, Penalty, Settle};
use crate::Limit;

/// Writes the calls of one store: its keys under its prefix, its options
/// with its clock and slack. The contract's operations become the
/// library's here, each by its own name: [`decide`](Self::decide) (no
/// op), [`take`](Self::take), [`settle`](Self::settle) (the op of its
/// [`Settle`]), [`penalty`](Self::penalty), [`Encoded::change`] (a
/// quota's), [`Encoded::batch`] and the fleet's
/// [`heartbeat`](Self::heartbeat).
pub(super) struct Encoder {
    /// The prefix of every key.
    pub(super) prefix: String,
    /// Microseconds keys outlive their state.
    pub(super) slack: i64,
    /// The clock the store decides on, if not Redis `TIME`.
    pub(super) clock: Option<Arc<dyn Clock>>,
    /// Whether the keys live on a cluster: a kept quota's hash is then one
    /// per slot (see [`quota_key`](Self::quota_key)).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(super) cluster: bool,
}

impl Encoder {
    /// The time of the store's own clock (us), if it has one.
    pub(super) fn clock_time(&self) -> Option<i64> {
        self.clock.as_ref().map(|clock| clock.now_micros())
    }

    /// A decision over `checks`, reserving up to `max_wait` us ahead; a
    /// `dry` one grants nothing. The options travel only when one differs
    /// from the production default.
    pub(super) fn decide(&self, checks: &[Check<'_>], max_wait: i64, dry: bool) -> Encoded {
        let now = self.clock_time().unwrap_or(0);
        let options = ((now, max_wait, dry, self.slack) != (0, 0, false, 0)).then(|| {
            Options::default()
                .with(Opt::Now, now)
                .with(Opt::Slack, self.slack)
                .with(Opt::MaxWait, max_wait)
                .with(Opt::Dry, i64::from(dry))
        });
        self.call(checks, options)
    }

    /// A take of what is available, at most each check's cost.
    pub(super) fn take(&self, checks: &[Check<'_>]) -> Encoded {
        self.call(checks, Some(self.options(Op::Take)))
    }

    /// A settlement: [`Op::Refund`], [`Op::Charge`] or [`Op::Renew`].
    /// A set decided by `mode` (op 9); a check's negative cost a refund.
    pub(super) fn each(&self, checks: &[Check<'_>], mode: EachMode) -> Encoded {
        let options = self.options(Op::Each).with(Opt::At, mode as i64);
        self.call(checks, Some(options))
    }

    pub(super) fn settle(&self, checks: &[Check<'_>], how: Settle) -> Encoded {
        let options = match how {
            Settle::Refund { at } => self.options(Op::Refund).with(Opt::At, at),
            Settle::Charge => self.options(Op::Charge),
            Settle::Renew { at } => self.options(Op::Renew).with(Opt::At, at),
        };
        self.call(checks, Some(options))
    }

    /// `op` on the penalty state of `check`'s key ([`Op::Penalty`], see
    /// `lua/penalty.lua`): its penalty key, the options (with what to do)
    /// and the limit's string with a cost of 0; `None` for a limit without
    /// a penalty.
    pub(super) fn penalty(&self, check: &Check<'_>, op: Penalty) -> Option<Encoded> {
        check.limit.pen_params()?;
        let keys = self.keys(std::slice::from_ref(check), true);
        let key = keys.keys().last()?;
        let (what, us) = op.code();
        let mut options = Vec::new();
        self.options(Op::Penalty)
            .with(Opt::At, what)
            .with(Opt::Block, us)
            .write(&mut options);
        let mut wire = Vec::new();
        write_limit(&mut wire, check.limit, &mut itoa::Buffer::new());
        wire.push(b'0');
        Some(Encoded::of(&[key], &[&options, &wire]))
    }

    /// The options of a call of `op`, with the clock and the slack.
    fn options(&self, op: Op) -> Options {
        Options::op(op)
            .with(Opt::Now, self.clock_time().unwrap_or(0))
            .with(Opt::Slack, self.slack)
    }

    /// The keys and arguments of one call of the library over `checks`
    /// (see the header of `lua/driver.lua`): every key of every check, the
    /// `options` if any, then each limit with its cost.
    fn call(&self, checks: &[Check<'_>], options: Option<Options>) -> Encoded {
        let mut out = self.keys(checks, true);
        if let Some(options) = options {
            out.push_arg(|buf| options.write(buf));
        }
        let mut digits = itoa::Buffer::new();
        for check in checks {
            out.push_arg(|buf| {
                write_limit(buf, check.limit, &mut digits);
                buf.extend_from_slice(digits.format(check.cost).as_bytes());
            });
        }
        out
    }

    /// Every key of every check (`<prefix>:{<escaped key>}:<limit>:<part>`,
    /// see [`keys`]): the one place Redis key names are made. With
    /// `configured`, a limit whose quota may be kept in the store has one
    /// more after its own: the hash of its kept quotas (see
    /// [`quota_key`](Self::quota_key)), and a limit with a penalty one
    /// more after all of its own, its penalty key,
    /// `<prefix>:{<escaped key>}:<limit>:pen` (in the same slot).
    pub(super) fn keys(&self, checks: &[Check<'_>], configured: bool) -> Encoded {
        let prefix = self.prefix.as_bytes();
        let mut out = Encoded {
            buf: Vec::with_capacity(checks.iter().map(|c| 2 * c.key.len() + 96).sum()),
            keys: SmallVec::new(),
            args: SmallVec::new(),
        };
        // where the tag of the check's key is written: limits of one
        // request often share its key, which is escaped once
        let mut tag: Option<Range<usize>> = None;
        for (i, check) in checks.iter().enumerate() {
            if i > 0 && checks[i - 1].key != check.key {
                tag = None;
            }
            let name = check.limit.name().as_bytes();
            for part in check.limit.params().algorithm().key_parts() {
                tag = Some(out.push_key(prefix, tag, check.key, name, part.as_bytes()));
            }
            if configured && check.limit.uses_stored_quota() {
                let written = tag.clone().and_then(|t| out.buf.get(t));
                let hash = self.quota_key(check.limit.name(), written.unwrap_or_default());
                out.keys.push(out.buf.len()..out.buf.len() + hash.len());
                out.buf.extend_from_slice(&hash);
            }
            if configured && check.limit.pen_params().is_some() {
                let pen = PENALTY_KEY.as_bytes();
                tag = Some(out.push_key(prefix, tag, check.key, name, pen));
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
    fn quota_key(&self, name: &str, tag: &[u8]) -> Vec<u8> {
        let mut out = format!("{}:q:", self.prefix).into_bytes();
        #[cfg(feature = "cluster")]
        if self.cluster {
            let slot = super::cluster::slot(tag);
            out.extend_from_slice(super::cluster::slot_tag(slot).as_bytes());
            out.push(b':');
        }
        let _ = tag;
        out.extend_from_slice(name.as_bytes());
        out
    }

    /// The hashes where the limit `name`'s own quota is copied besides
    /// `own`, its hash in a check's slot: every other slot's on a cluster
    /// (a decision reads it in its own slot), none on one server.
    pub(super) fn quota_copies(&self, name: &str, own: &[u8]) -> Vec<Vec<u8>> {
        #[cfg(feature = "cluster")]
        if self.cluster {
            let slots = 0..super::cluster::SLOTS;
            let hashes =
                slots.map(|slot| self.quota_key(name, super::cluster::slot_tag(slot).as_bytes()));
            return hashes.filter(|hash| hash != own).collect();
        }
        let _ = (name, own);
        Vec::new()
    }

    /// The sorted set of the fleet's heartbeats (see `fleet.rs`).
    pub(super) fn fleet_key(&self) -> String {
        format!("{}:fleet", self.prefix)
    }

    /// A heartbeat of the instance `id`, counted `counted_ms` after it
    /// (`lua/fleet.lua`): no clock in its options, the server's is the
    /// heartbeats' one clock.
    pub(super) fn heartbeat(&self, id: &str, counted_ms: u64) -> Encoded {
        let mut options = Vec::new();
        Options::op(Op::Fleet).write(&mut options);
        let key = self.fleet_key();
        let mut digits = itoa::Buffer::new();
        let counted = digits.format(counted_ms);
        Encoded::of(
            &[key.as_bytes()],
            &[&options, id.as_bytes(), counted.as_bytes()],
        )
    }
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

    /// Appends the key `<prefix>:<tag>:<name>:<part>`, its tag copied from
    /// `tag` where it is written already, else escaped from `key`; answers
    /// where its tag lies.
    fn push_key(
        &mut self,
        prefix: &[u8],
        tag: Option<Range<usize>>,
        key: &[u8],
        name: &[u8],
        part: &[u8],
    ) -> Range<usize> {
        let start = self.buf.len();
        self.buf.extend_from_slice(prefix);
        self.buf.push(b':');
        let at = self.buf.len();
        match tag {
            Some(tag) => self.buf.extend_from_within(tag),
            None => keys::write_tag(&mut self.buf, key),
        }
        let tag = at..self.buf.len();
        for piece in [b":", name, b":", part] {
            self.buf.extend_from_slice(piece);
        }
        self.keys.push(start..self.buf.len());
        tag
    }

    /// Appends the argument `write` writes.
    fn push_arg(&mut self, write: impl FnOnce(&mut Vec<u8>)) {
        let start = self.buf.len();
        write(&mut self.buf);
        self.args.push(start..self.buf.len());
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

    /// A change of a kept quota ([`Op::Quotas`], see
    /// `lua/kept.lua`): the hash `hash`, then `command` (`HSET`, `HSETNX`
    /// or `HDEL`) and its arguments after the key.
    pub(super) fn change(hash: &[u8], command: &str, args: &[&[u8]]) -> Encoded {
        let mut options = Vec::new();
        Options::op(Op::Quotas).write(&mut options);
        let mut all: SmallVec<[&[u8]; 4]> = smallvec::smallvec![&options[..], command.as_bytes()];
        all.extend_from_slice(args);
        Encoded::of(&[hash], &all)
    }
}

/// Appends `limit`'s argument to the decision function, less its cost
/// (see `lua/driver.lua`): its penalty's `p<refusals>:<within>:<forget>:<block
/// 1>:...;` when it has one, `c` when its quota may be kept in the store,
/// then its [stored form](write_stored_form).
fn write_limit(out: &mut Vec<u8>, limit: &Limit, digits: &mut itoa::Buffer) {
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
    if limit.uses_stored_quota() {
        // 'k': a tier, which only its key's override decides in place of
        // its own quota (see `Limit::overrides_only`)
        out.push(if limit.is_overrides_only() {
            b'k'
        } else {
            b'c'
        });
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::Quota;

    fn encoder() -> Encoder {
        Encoder {
            prefix: "p".into(),
            slack: 0,
            clock: None,
            cluster: false,
        }
    }

    fn check<'a>(limit: &'a Limit, key: &'a [u8], cost: i64) -> Check<'a> {
        Check { limit, key, cost }
    }

    /// One buffer holds what the reset's key names and the limits' wire
    /// strings say, in order, with a key's tag written once and reused.
    #[test]
    fn encoded_keys_and_arguments_name_every_key_of_every_check() {
        let encoder = encoder();
        let minute = Duration::from_secs(60);
        let log = Limit::new("log", Quota::rate(3, minute).sliding_log()).expect("limit");
        let gcra = Limit::new("g", Quota::rate(1, minute).allow_burst(2).gcra()).expect("limit");
        let checks = [
            check(&log, b"a}:{b", 1),
            check(&gcra, b"a}:{b", 1),
            check(&gcra, b"x", 2),
        ];
        let encoded = encoder.decide(&checks, 0, false);
        let got: Vec<&[u8]> = encoded.keys().collect();
        let expected: [&[u8]; 4] = [
            b"p:{a%7D:%7Bb}:log:log",
            b"p:{a%7D:%7Bb}:log:meta",
            b"p:{a%7D:%7Bb}:g:gcra",
            b"p:{x}:g:gcra",
        ];
        assert_eq!(got, expected);
        let reset = encoder.keys(&checks, false);
        assert!(reset.keys().eq(expected.iter().copied()));
        assert_eq!(reset.args().count(), 0);
        let args: Vec<&[u8]> = encoded.args().collect();
        // a sliding log of 3 per minute, a GCRA of 1 per minute, bursts of 2
        let (log, gcra) = ("1:3:60000000:0:".to_owned(), "3:2:1:60000000:".to_owned());
        let wire = |l: &str, cost: &str| format!("{l}{cost}").into_bytes();
        assert_eq!(args, [wire(&log, "1"), wire(&gcra, "1"), wire(&gcra, "2")]);
        let refund = encoder.settle(&checks[2..], Settle::Refund { at: 7 });
        let args: Vec<&[u8]> = refund.args().collect();
        assert_eq!(args, [b"o:0:0:0:0:1:7".to_vec(), wire(&gcra, "2")]);
    }

    /// A limit keyed like the one before it takes that key's tag from the
    /// other's own keys, not from the hash of its kept quotas that
    /// follows them: a decision and a reset name the same keys.
    #[test]
    fn a_key_shared_with_a_limit_whose_quota_is_kept_keeps_its_tag() {
        let encoder = encoder();
        let minute = Duration::from_secs(60);
        let kept = Limit::new("a", Quota::rate(1, minute).allow_burst(2).gcra())
            .expect("limit")
            .use_stored_quota();
        let own = Limit::new("b", Quota::rate(1, minute).allow_burst(2).gcra()).expect("limit");
        let checks = [check(&kept, b"k", 1), check(&own, b"k", 1)];
        let decided = encoder.keys(&checks, true);
        let expected: [&[u8]; 3] = [b"p:{k}:a:gcra", b"p:q:a", b"p:{k}:b:gcra"];
        assert!(decided.keys().eq(expected.iter().copied()));
        let reset = encoder.keys(&checks, false);
        assert!(reset.keys().eq([expected[0], expected[2]]));
    }

    /// A batch sends consecutive decisions with the same arguments as one
    /// run, their limit's string once, every key in order.
    #[test]
    fn a_batch_sends_the_arguments_of_a_run_once() {
        let encoder = encoder();
        let minute = Duration::from_secs(60);
        let gcra = Limit::new("g", Quota::rate(1, minute).allow_burst(2).gcra()).expect("limit");
        let one = |key, cost| encoder.decide(&[check(&gcra, key, cost)], 0, false);
        let parts = [one(b"a", 1), one(b"b", 1), one(b"c", 2), one(b"d", 1)];
        let batch = Encoded::batch(&parts.iter().collect::<Vec<_>>());
        let keys: Vec<&[u8]> = batch.keys().collect();
        let expected = ["a", "b", "c", "d"].map(|key| format!("p:{{{key}}}:g:gcra"));
        assert_eq!(keys, expected.map(String::into_bytes));
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
