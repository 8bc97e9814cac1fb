//! Coalesced decisions (and sets, `Limiter::decide_set`: op 9 rides in a
//! batch as a decision does). While a decision's call is in flight, the decisions
//! that arrive meanwhile wait, and go out together as one call of the
//! library (op 7 of `lua/dispatch.lua`) when it lands: each decided on its own,
//! as its own call would decide it, and each caller given its own reply.
//! No timer and no added wait at low load: a decision that finds nothing in
//! flight goes out at once. Under load, one call carries what arrived during
//! the last one's round trip, and, unless that is already half as many as
//! the last call carried, what the tasks already runnable add when it lands
//! (the batch is taken after yielding to them), and Redis pays the
//! call's fixed cost (waking up, reading, parsing: far more than a decision
//! costs it) once per batch rather than once per decision. Consecutive
//! decisions with the same arguments (one limit, usually) travel as one run
//! of the batch, their limit's string once (see `Encoded::batch`).
//!
//! A decision whose caller went away (its deadline passed, or its future was
//! dropped) before its batch is sent is left out of it: it counts nowhere.
//! A batch that fails fails each of its decisions with its error. On a
//! cluster, batches form per slot (a call's keys must share one): the
//! decisions of one key, a hot one above all, coalesce; those of keys in
//! different slots go out apart.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::oneshot;

use super::encode::Encoded;
use super::RedisStore;
use crate::store::{Check, Deadline};
use crate::Error;

/// The most decisions one call carries: one call runs its decisions one
/// after the other, and Redis serves nothing else meanwhile (64 GCRA
/// decisions take about 0.2 ms of its time).
const MAX_BATCH: usize = 64;

/// The most yields to the runnable tasks a driver makes before it takes
/// the decisions waiting: it takes them as soon as one yield added none
/// (or a full batch waits). In the bench at 50 in flight, the batches grew
/// from 21 decisions per call with one yield to 26 with up to four, and no
/// further with up to sixteen.
const GATHER_YIELDS: usize = 4;

/// The Redis engine's coalescer: whether decisions are coalesced, and
/// the decisions waiting for the call in flight, per cluster slot (a
/// call's keys share one; on one server, all are slot 0).
pub(super) struct Coalescer {
    /// Whether decisions are coalesced (see
    /// [`RedisStoreBuilder::coalesce_decisions`](super::RedisStoreBuilder::coalesce_decisions)).
    on: bool,
    /// Whether calls route by slot over a cluster's nodes: batches form
    /// per slot then.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    per_slot: bool,
    slots: Mutex<HashMap<u16, State>>,
}

#[derive(Default)]
struct State {
    /// A call of the coalesced kind is in flight.
    busy: bool,
    waiting: Vec<Waiter>,
}

/// A decision waiting for the next batch.
struct Waiter {
    encoded: Encoded,
    deadline: Deadline,
    reply: oneshot::Sender<Result<Vec<u8>, Error>>,
}

impl Coalescer {
    pub(super) fn new(on: bool, per_slot: bool) -> Self {
        Self {
            on,
            per_slot,
            slots: Mutex::default(),
        }
    }

    /// The reply to `encoded`, the call of a decision over `checks` (whose
    /// keys share a slot), sent by `store`: at once when decisions are not
    /// coalesced or none is in flight in its slot, else in the next batch.
    pub(super) async fn decide(
        &self,
        store: &RedisStore,
        checks: &[Check<'_>],
        encoded: Encoded,
        deadline: Deadline,
    ) -> Result<Vec<u8>, Error> {
        if !self.on {
            return store.call(&encoded, deadline).await;
        }
        let slot = self.slot(checks);
        // queued behind the call in flight, or sent now (`Err`: nothing is)
        let queued = self.with(slot, |state| {
            if state.busy {
                let (reply, receiver) = oneshot::channel();
                state.waiting.push(Waiter {
                    encoded,
                    deadline,
                    reply,
                });
                Ok(receiver)
            } else {
                state.busy = true;
                Err(encoded)
            }
        });
        match queued {
            Ok(receiver) => {
                let reply = async { receiver.await.unwrap_or(Err(Error::Unavailable)) };
                deadline.bound(reply).await
            }
            Err(encoded) => {
                let _flight = InFlight(self, store, slot);
                store.call(&encoded, deadline).await
            }
        }
    }

    /// The slot whose batch a decision over `checks` joins.
    fn slot(&self, checks: &[Check<'_>]) -> u16 {
        #[cfg(feature = "cluster")]
        if self.per_slot {
            let first = checks
                .first()
                .map(|check| crate::store::keys::tag(check.key));
            return first.map_or(0, super::cluster::slot);
        }
        let _ = checks;
        0
    }

    /// Runs `f` on `slot`'s state, which is dropped once idle (a cluster's
    /// slots come and go with their keys).
    fn with<R>(&self, slot: u16, f: impl FnOnce(&mut State) -> R) -> R {
        let mut slots = crate::store::lock(&self.slots);
        let state = slots.entry(slot).or_default();
        let result = f(state);
        if !state.busy && state.waiting.is_empty() {
            slots.remove(&slot);
        }
        result
    }
}

/// Marks the end of a flight when dropped, landed or abandoned: the
/// decisions that arrived meanwhile go out then.
struct InFlight<'a>(&'a Coalescer, &'a RedisStore, u16);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.landed(self.1, self.2);
    }
}

impl Coalescer {
    /// A flight landed: the decisions that arrived meanwhile go out as one
    /// batch, on a task of their own (the caller whose call landed is not
    /// held up), which sends the next batch when it lands, and so on until
    /// none is waiting.
    fn landed(&self, store: &RedisStore, slot: u16) {
        let waiting = self.with(slot, |state| {
            if state.waiting.is_empty() {
                state.busy = false;
            }
            !state.waiting.is_empty()
        });
        if !waiting {
            return;
        }
        // (a runtime gone before the task ran drops it, and the driver
        // with it, which frees the coalescer)
        let driver = Driver {
            store: store.clone(),
            slot,
            done: false,
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(driver.send_batches())),
            Err(_) => drop(driver),
        }
    }

    /// How many decisions wait in `slot`.
    fn waiting(&self, slot: u16) -> usize {
        self.with(slot, |state| state.waiting.len())
    }
}

/// Sends the batches while decisions keep arriving. Dropped before it is
/// done (its task cancelled, its runtime shut down), it frees the coalescer:
/// the decisions still waiting fail (their replies are dropped), and the
/// next decision goes out at once.
struct Driver {
    store: RedisStore,
    slot: u16,
    /// Nothing was left waiting when it stopped: the coalescer is free.
    done: bool,
}

impl Drop for Driver {
    fn drop(&mut self) {
        if !self.done {
            self.store.inner.coalescer.with(self.slot, |state| {
                state.busy = false;
                state.waiting.clear();
            });
        }
    }
}

impl Driver {
    /// Sends what is waiting (as calls of at most [`MAX_BATCH`] decisions,
    /// side by side), then what gathered meanwhile, until nothing has.
    ///
    /// When at least half as many decisions wait as the last call carried
    /// (under steady load, those that arrived during its flight), they go
    /// out at once: Redis decides them while this process answers the
    /// batch that just landed. Fewer first let the tasks that are ready run
    /// (a yield, no timer; again while that added decisions, up to
    /// [`GATHER_YIELDS`] times): the callers whose replies just came, and
    /// the requests the runtime has already read, add their next decisions
    /// to the batch, so that a call carries more decisions (Redis wakes once
    /// per call, which costs it far more than a decision does). The first
    /// decision of a quiet spell never waits (it goes out at once, without
    /// a driver), and a driver starts as if the last call was full.
    async fn send_batches(mut self) {
        let store = self.store.clone();
        let coalescer = &store.inner.coalescer;
        // how many decisions the last call carried (a full call before the first)
        let mut last = MAX_BATCH;
        loop {
            let ready = coalescer.waiting(self.slot);
            let yields = if 2 * ready >= last { 0 } else { GATHER_YIELDS };
            // yields while the batch grows (a few times at most)
            let mut gathered = 0;
            for _ in 0..yields {
                tokio::task::yield_now().await;
                let now = coalescer.waiting(self.slot);
                if now == gathered || now >= MAX_BATCH {
                    break;
                }
                gathered = now;
            }
            let mut waiting = coalescer.with(self.slot, |state| {
                if state.waiting.is_empty() {
                    state.busy = false;
                }
                std::mem::take(&mut state.waiting)
            });
            if waiting.is_empty() {
                self.done = true;
                return;
            }
            // callers gone: left out, counted nowhere
            waiting.retain(|waiter| !waiter.reply.is_closed());
            last = waiting.len().max(1);
            let mut calls = Vec::new();
            while waiting.len() > MAX_BATCH {
                let rest = waiting.split_off(MAX_BATCH);
                let batch = std::mem::replace(&mut waiting, rest);
                let store = store.clone();
                calls.push(tokio::spawn(async move { send_batch(&store, batch).await }));
            }
            if !waiting.is_empty() {
                send_batch(&store, std::mem::take(&mut waiting)).await;
            }
            for call in calls {
                let _ = call.await;
            }
        }
    }
}

/// Sends `waiting` as one call over `store`, and each decision its reply.
async fn send_batch(store: &RedisStore, mut waiting: Vec<Waiter>) {
    // the batch may take as long as its most patient decision
    let deadline = waiting
        .iter()
        .map(|w| w.deadline)
        .max_by_key(|d| d.at())
        .unwrap_or_else(|| Deadline::after(std::time::Duration::ZERO).start());
    if let [waiter] = waiting.as_mut_slice() {
        let result = store.call(&waiter.encoded, deadline).await;
        if let Some(waiter) = waiting.pop() {
            let _ = waiter.reply.send(result);
        }
        return;
    }
    let parts: Vec<&Encoded> = waiting.iter().map(|w| &w.encoded).collect();
    let batch = Encoded::batch(&parts);
    let replies = store
        .call(&batch, deadline)
        .await
        .and_then(|packed| split(&packed, waiting.len()));
    match replies {
        Ok(replies) => {
            for (waiter, reply) in waiting.into_iter().zip(replies) {
                let _ = waiter.reply.send(reply);
            }
        }
        Err(error) => {
            for waiter in waiting {
                let _ = waiter.reply.send(Err(error.clone()));
            }
        }
    }
}

/// The replies of a batch of `n` decisions: each after its length, a
/// little-endian double (see op 7 in `lua/dispatch.lua`). A decision the
/// library failed on (its reply is `!` and the error's text) gets that
/// error, as [`Error::Redis`] (as its own call would have, a script
/// error); the others their replies.
fn split(packed: &[u8], n: usize) -> Result<Vec<Result<Vec<u8>, Error>>, Error> {
    let unexpected =
        || Error::UnexpectedReply(format!("{} bytes for a batch of {n}", packed.len()));
    let mut replies = Vec::with_capacity(n);
    let mut rest = packed;
    while !rest.is_empty() {
        let (len, tail) = rest.split_at_checked(8).ok_or_else(unexpected)?;
        let len = f64::from_le_bytes(len.try_into().map_err(|_| unexpected())?);
        if !(0.0..=tail.len() as f64).contains(&len) || len.fract() != 0.0 {
            return Err(unexpected());
        }
        let (reply, tail) = tail.split_at(len as usize);
        replies.push(match reply.strip_prefix(b"!") {
            Some(error) => Err(failed(error)),
            None => Ok(reply.to_vec()),
        });
        rest = tail;
    }
    if replies.len() != n {
        return Err(unexpected());
    }
    Ok(replies)
}

/// The error of one decision of a batch that the library failed on, from
/// the error's text.
fn failed(text: &[u8]) -> Error {
    let kind = redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError);
    let text = String::from_utf8_lossy(text).into_owned();
    Error::Redis(redis::RedisError::from((
        kind,
        "the decision failed in the store",
        text,
    )))
}

#[cfg(test)]
mod tests {
    use super::split;

    /// A batch's reply: each of `replies` after its length.
    fn packed(replies: &[&[u8]]) -> Vec<u8> {
        let mut packed = Vec::new();
        for reply in replies {
            packed.extend_from_slice(&(reply.len() as f64).to_le_bytes());
            packed.extend_from_slice(reply);
        }
        packed
    }

    #[test]
    fn a_batch_reply_splits_into_its_decisions_replies() {
        let packed = packed(&[b"abc", b"", b"de"]);
        let replies = split(&packed, 3).expect("three replies");
        let replies: Vec<_> = replies.into_iter().map(Result::unwrap).collect();
        assert_eq!(replies, [b"abc".to_vec(), Vec::new(), b"de".to_vec()]);
        assert!(split(&packed, 2).is_err());
        assert!(split(&packed[..packed.len() - 1], 3).is_err());
        assert!(split(&[0xff; 8], 1).is_err());
    }

    #[test]
    fn a_decision_the_library_failed_on_fails_alone() {
        let packed = packed(&[b"\0abc", b"!table index is NaN", b"\0de"]);
        let replies = split(&packed, 3).expect("three replies");
        assert_eq!(replies[0].as_deref().ok(), Some(&b"\0abc"[..]));
        let error = replies[1].as_ref().expect_err("the second failed");
        assert!(matches!(error, crate::Error::Redis(_)), "{error:?}");
        assert!(error.to_string().contains("table index is NaN"), "{error}");
        assert_eq!(replies[2].as_deref().ok(), Some(&b"\0de"[..]));
    }
}
