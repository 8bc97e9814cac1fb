//! The Redis store's connections: the lanes that keep them, and the health
//! checks that replace them (where they come from: `connector.rs`).
//!
//! Failure handling, in one place:
//! - A request whose connection breaks (an I/O error, a closed socket, a
//!   replica that refuses writes) discards that connection and is sent
//!   again on another: connections the server closed while idle cost no
//!   request. (A resent decision may count twice; it never admits more.)
//! - A request still unanswered at its deadline (the limiter's timeout),
//!   while its connection answered nothing since it was sent, marks that
//!   connection as silent: it is discarded, whatever keeps it open. A request
//!   whose caller goes away before its deadline (an HTTP client that closes
//!   its socket drops the request's future) says nothing about the
//!   connection: it is neither discarded nor counted, and the command, once
//!   written, still runs on the server (its grant counts there).
//! - New connections are made by one background task per store, never inside
//!   a request: requests meanwhile use the other lanes' connections, or wait
//!   (within their own timeout) when none is left.
//! - After [`OPEN_AFTER`] failures in a row (requests past their deadline on
//!   a silent connection, unless a new connection answered since they were sent;
//!   failed connection attempts; on a cluster only the latter, since one
//!   node's failure must not stop the other nodes' slots) the circuit opens: every lane is
//!   discarded and requests fail at once ([`Error::Unavailable`]) while the
//!   background task reconnects, backing off from [`MIN_BACKOFF`] to
//!   [`MAX_BACKOFF`] between refused attempts. Its first connection that
//!   answers `PING` closes the circuit.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::{RedisError, RedisResult};

use super::connector::{Conn, Connector, CONNECT_TIMEOUT};

use crate::store::Deadline;
use crate::Error;

/// Consecutive failures that open the circuit.
pub(super) const OPEN_AFTER: u32 = 3;
/// The first pause after a refused connection attempt; it doubles up to
/// [`MAX_BACKOFF`].
pub(super) const MIN_BACKOFF: Duration = Duration::from_millis(25);
/// The longest pause between connection attempts.
pub(super) const MAX_BACKOFF: Duration = Duration::from_millis(250);

/// A lane's current connection.
struct Live {
    conn: Conn,
    generation: u64,
    /// Keeps the pool's count of the connection while the lane holds it.
    pooled: Option<deadpool_redis::Connection>,
}

impl Live {
    /// Forgets the connection: out of the pool, closed when its last clone goes.
    fn close(self) {
        if let Some(pooled) = self.pooled {
            drop(deadpool_redis::Connection::take(pooled));
        }
    }
}

#[derive(Default)]
struct Lane {
    live: Mutex<Option<Live>>,
    /// How many answers this lane's connections have received: a request
    /// abandoned while it still reads what it read when it was sent had no
    /// answer of any kind meanwhile.
    answers: AtomicU64,
}

impl Lane {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Live>> {
        crate::store::lock(&self.live)
    }
}

/// The connections a store multiplexes its requests over, and their health.
pub(super) struct Lanes {
    connector: Connector,
    lanes: Box<[Lane]>,
    generation: AtomicU64,
    /// Failures since the last success (requests and connection attempts).
    failures: AtomicU32,
    /// The circuit: while open, requests fail at once.
    open: AtomicBool,
    /// Whether the background task that makes connections runs.
    repairing: AtomicBool,
    /// Woken when a lane gets a connection or the circuit opens.
    changed: tokio::sync::Notify,
}

/// A connection lent to one request (see [`Lanes::run`]).
struct Loan {
    conn: Conn,
    index: usize,
    generation: u64,
}

/// What became of one request on a loaned connection.
pub(super) enum Landing<T> {
    /// An answer, or an error that is not the connection's.
    Done(RedisResult<T>),
    /// The connection broke; the request may be sent again on another.
    Broken(RedisError),
}

impl Lanes {
    pub(super) fn new(connector: Connector, lanes: usize) -> Arc<Lanes> {
        Arc::new(Lanes {
            connector,
            lanes: (0..lanes).map(|_| Lane::default()).collect(),
            generation: AtomicU64::new(0),
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            repairing: AtomicBool::new(false),
            changed: tokio::sync::Notify::new(),
        })
    }

    /// Whether the connections route by slot over several nodes.
    #[cfg(feature = "cluster")]
    pub(super) fn is_cluster(&self) -> bool {
        self.connector.is_cluster()
    }

    pub(super) fn len(&self) -> usize {
        self.lanes.len()
    }

    /// Whether the circuit is open (requests fail at once).
    pub(super) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Runs `op` on a connection, again on another while they turn out
    /// broken (at most once per lane, then once on a new one), until
    /// `deadline`. Fails at once while the circuit is open.
    pub(super) async fn run<T, F, Fut>(
        self: &Arc<Self>,
        deadline: Deadline,
        mut op: F,
    ) -> Result<T, Error>
    where
        F: FnMut(Conn) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let mut attempts = 0;
        loop {
            attempts += 1;
            // the common case, a live connection in the first lane, needs no
            // future; waiting for one is boxed, so that every request's
            // future stays small
            let loan = match self.try_loan() {
                Some(loan) => loan,
                None => deadline.bound(Box::pin(self.loan())).await?,
            };
            let flight = Flight {
                lanes: self,
                index: loan.index,
                generation: loan.generation,
                answers: self.lanes[loan.index].answers.load(Ordering::Relaxed),
                installed: self.generation.load(Ordering::Relaxed),
            };
            let Ok(result) = tokio::time::timeout_at(deadline.at(), op(loan.conn)).await else {
                flight.unanswered();
                return Err(deadline.error());
            };
            match flight.land(result) {
                Landing::Done(result) => return result.map_err(Error::from),
                // every lane may hold a connection the server closed
                Landing::Broken(e) if attempts > self.lanes.len() => return Err(Error::from(e)),
                Landing::Broken(e) => {
                    tracing::debug!(target: "tower_ratelimit::redis", error = %e, "a Redis connection broke; sending again on another");
                }
            }
        }
    }

    /// `cmd`'s reply over a lane's connection (see [`run`](Self::run)).
    pub(super) async fn command<T: redis::FromRedisValue>(
        self: &Arc<Self>,
        cmd: &redis::Cmd,
        deadline: Deadline,
    ) -> Result<T, Error> {
        self.run(deadline, |mut conn| async move { conn.query(cmd).await })
            .await
    }

    /// The first live lane's connection, if any and the circuit is closed.
    ///
    /// Lanes are tried in order, not in turn: every decision goes over the
    /// same connection while it works, so that concurrent decisions share
    /// its writes and reads (redis-rs pipelines what is queued), and the
    /// other lanes stand by to take over at once: decisions spread over the
    /// lanes in turn would make more and smaller writes and reads, which
    /// cost the server more CPU per decision, and one more shared counter
    /// written per decision.
    fn try_loan(&self) -> Option<Loan> {
        if self.is_open() {
            return None;
        }
        (0..self.lanes.len()).find_map(|index| self.live(index))
    }

    /// A connection: the first live one; waits for the background task
    /// when no lane has one.
    async fn loan(self: &Arc<Self>) -> Result<Loan, Error> {
        loop {
            if self.is_open() {
                self.repair();
                return Err(Error::Unavailable);
            }
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(loan) = self.try_loan() {
                // (the lanes before it have none)
                if loan.index > 0 {
                    self.repair();
                }
                return Ok(loan);
            }
            self.repair();
            notified.await;
        }
    }

    /// Lane `index`'s connection, if it has one.
    fn live(&self, index: usize) -> Option<Loan> {
        let lane = self.lanes.get(index)?.lock();
        let live = lane.as_ref()?;
        Some(Loan {
            conn: live.conn.clone(),
            index,
            generation: live.generation,
        })
    }

    /// Drops lane `index`'s connection if it is still `generation`.
    fn discard(self: &Arc<Self>, index: usize, generation: u64) {
        let taken = {
            let mut live = self.lanes[index].lock();
            match live.as_ref() {
                Some(current) if current.generation == generation => live.take(),
                _ => None,
            }
        };
        if let Some(live) = taken {
            live.close();
            self.repair();
        }
    }

    fn failed(self: &Arc<Self>) {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if failures >= OPEN_AFTER && !self.open.swap(true, Ordering::AcqRel) {
            tracing::info!(
                target: "tower_ratelimit::redis",
                failures,
                "Redis failed {failures} times in a row: decisions fail at once until a new connection answers"
            );
            for index in 0..self.lanes.len() {
                if let Some(live) = self.lanes[index].lock().take() {
                    live.close();
                }
            }
            self.changed.notify_waiters();
        }
        self.repair();
    }

    fn succeeded(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Release);
        }
    }

    /// Starts the background task that fills empty lanes, unless it runs.
    fn repair(self: &Arc<Self>) {
        if self.repairing.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(Self::repair_loop(Arc::downgrade(self)));
            }
            Err(_) => self.repairing.store(false, Ordering::Release),
        }
    }

    fn empty_lane(&self) -> Option<usize> {
        (0..self.lanes.len()).find(|&index| self.lanes[index].lock().is_none())
    }

    async fn repair_loop(store: Weak<Lanes>) {
        let mut backoff = MIN_BACKOFF;
        loop {
            let Some(lanes) = store.upgrade() else { return };
            let Some(index) = lanes.empty_lane() else {
                lanes.repairing.store(false, Ordering::Release);
                // a lane emptied after the look: carry on unless another task took over
                if lanes.empty_lane().is_some() && !lanes.repairing.swap(true, Ordering::AcqRel) {
                    continue;
                }
                return;
            };
            match tokio::time::timeout(CONNECT_TIMEOUT, lanes.connector.connect()).await {
                Ok(Ok((conn, pooled))) => {
                    backoff = MIN_BACKOFF;
                    lanes.install(index, conn, pooled);
                }
                Ok(Err(error)) => {
                    tracing::debug!(target: "tower_ratelimit::redis", %error, "cannot connect to Redis");
                    lanes.failed();
                    drop(lanes);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                // the attempt took its whole time: try again at once (a
                // server that was only slow answers the next one as soon as
                // it wakes)
                Err(_) => {
                    tracing::debug!(target: "tower_ratelimit::redis", "connecting to Redis timed out");
                    lanes.failed();
                }
            }
        }
    }

    fn install(&self, index: usize, conn: Conn, pooled: Option<deadpool_redis::Connection>) {
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let replaced = self.lanes[index].lock().replace(Live {
            conn,
            generation,
            pooled,
        });
        if let Some(old) = replaced {
            old.close();
        }
        self.failures.store(0, Ordering::Release);
        if self.open.swap(false, Ordering::AcqRel) {
            tracing::info!(target: "tower_ratelimit::redis", "Redis answers again: deciding through it");
        }
        self.changed.notify_waiters();
    }
}

/// One request in flight on a loaned connection, until it lands or meets its deadline.
/// Dropped otherwise (its caller went away), it leaves no trace: a caller
/// leaving is no news of the connection.
struct Flight<'a> {
    lanes: &'a Arc<Lanes>,
    index: usize,
    generation: u64,
    /// The lane's answer count when the request was sent.
    answers: u64,
    /// The latest connection's generation when the request was sent.
    installed: u64,
}

impl Flight<'_> {
    fn land<T>(self, result: RedisResult<T>) -> Landing<T> {
        let lanes = self.lanes;
        match result {
            // not counted against the circuit: a connection closed by the
            // server says nothing of its health; a dead server fails the
            // connection attempts that follow
            Err(e) if breaks_connection(&e) => {
                lanes.discard(self.index, self.generation);
                Landing::Broken(e)
            }
            other => {
                lanes.lanes[self.index]
                    .answers
                    .fetch_add(1, Ordering::Relaxed);
                if other.is_ok() {
                    lanes.succeeded();
                }
                Landing::Done(other)
            }
        }
    }

    /// The request met its deadline unanswered.
    fn unanswered(self) {
        let lane = &self.lanes.lanes[self.index];
        if lane.answers.load(Ordering::Relaxed) == self.answers {
            // nothing came back on this connection since the request left:
            // it may be silent for good (a proxy that forwards nothing, a
            // half-open socket), so it is replaced
            self.lanes.discard(self.index, self.generation);
            // on a cluster, one node's failure (answered on its slots until
            // a replica is promoted) must not stop the other nodes' slots;
            // and a new connection that answered `PING` since this request
            // left is newer news than its silence: requests that were in
            // flight on the silent connections, timed out after the
            // recovery, must not open the circuit again
            if !self.lanes.connector.is_cluster()
                && self.lanes.generation.load(Ordering::Relaxed) == self.installed
            {
                self.lanes.failed();
            }
        }
    }
}

/// Whether an error means the connection cannot be used again: it broke, or
/// it reaches a server that no longer takes writes (a demoted master).
fn breaks_connection(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_timeout()
        || e.is_unrecoverable_error()
        || e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
}
