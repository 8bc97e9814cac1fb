//! The fleet's heartbeat: each store handle with a fallback registers a
//! random id in the sorted set `<prefix>:fleet`, scored by when it stops
//! counting (its last heartbeat plus three periods, on the server's clock:
//! Redis `TIME`, whatever clock the store decides with), every period, on
//! a task of its own, and reads how many ids count (see `store/fleet.rs`
//! for what the fallback does with it). One call of the library per period
//! and handle (op 8, `lua/fleet.lua`); decisions never wait for it nor
//! read the set.

use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use super::Inner;
use crate::store::fleet::{Fleet, PERIODS_COUNTED};
use crate::store::Deadline;
use crate::Error;

/// The default of [`RedisStoreBuilder::fleet_heartbeat`](super::RedisStoreBuilder::fleet_heartbeat).
pub(super) const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);

/// The shortest heartbeat period a builder accepts.
pub(super) const MIN_HEARTBEAT: Duration = Duration::from_millis(10);

/// The Redis engine's fleet heartbeat: its period, and the fleet it
/// keeps.
pub(super) struct Heartbeat {
    /// Its period; zero: none.
    period: Duration,
    /// This handle's place among the instances sharing the store, made
    /// (and its heartbeat started) when the fallback is set up.
    fleet: OnceLock<Arc<Fleet>>,
}

impl Heartbeat {
    pub(super) fn new(period: Duration) -> Self {
        Self {
            period,
            fleet: OnceLock::new(),
        }
    }

    /// The fleet of `store`, whose heartbeat this is, its heartbeat
    /// started (see [`Fallback::fleet`](crate::store::Fallback::fleet));
    /// `None` without a heartbeat.
    pub(super) fn fleet(&self, store: &Arc<Inner>) -> Option<Arc<Fleet>> {
        let period = self.period;
        if period.is_zero() {
            return None;
        }
        let fleet = self.fleet.get_or_init(|| Arc::new(Fleet::new()));
        if !fleet.beating() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    if fleet.start() {
                        let beat = beat(Arc::downgrade(store), fleet.clone(), period);
                        drop(runtime.spawn(beat));
                    }
                }
                // (tried again by the next layer built over the store)
                Err(_) => tracing::warn!(
                    target: "tower_ratelimit",
                    prefix = %store.encoder.prefix,
                    "a memory fallback was set up outside a Tokio runtime: its fleet heartbeat \
                     cannot start, so during a Redis outage this instance grants the full quota \
                     of each limit rather than its share. Build the layer inside the runtime."
                ),
            }
        }
        Some(fleet.clone())
    }
}

/// One heartbeat of `store` (op 8 of the library, `lua/fleet.lua`): how
/// many instances count now, this one included.
async fn heartbeat(store: &Inner, fleet: &Fleet, period: Duration) -> Result<u64, Error> {
    let counted = period.saturating_mul(PERIODS_COUNTED);
    let counted = u64::try_from(counted.as_millis()).unwrap_or(u64::MAX);
    let encoded = store.encoder.heartbeat(fleet.id(), counted);
    let deadline = Deadline::after(period.min(Duration::from_secs(2))).start();
    let reply = store.library.call(&store.lanes, &encoded, deadline).await?;
    std::str::from_utf8(&reply)
        .ok()
        .and_then(|count| count.parse().ok())
        .ok_or_else(|| Error::UnexpectedReply(format!("{} bytes for a heartbeat", reply.len())))
}

/// Beats every `period` while a handle of the store is left.
async fn beat(store: Weak<Inner>, fleet: Arc<Fleet>, period: Duration) {
    loop {
        let Some(store) = store.upgrade() else {
            return;
        };
        match heartbeat(&store, &fleet, period).await {
            Ok(counted) => fleet.learn(counted),
            Err(error) => {
                tracing::debug!(
                    target: "tower_ratelimit",
                    %error,
                    "fleet heartbeat failed; the fallback keeps the last count ({})",
                    fleet.count()
                );
            }
        }
        // (no handle held while asleep: the last one dropped ends the task)
        drop(store);
        tokio::time::sleep(period).await;
    }
}
