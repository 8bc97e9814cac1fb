//! The fleet's heartbeat: each store handle with a fallback registers a
//! random id in the sorted set `<prefix>:fleet`, scored by when it stops
//! counting (its last heartbeat plus three periods, on the server's clock),
//! every period, on a task of its own, and reads how many ids count (see
//! `store/fleet.rs` for what the fallback does with it). One `EVAL` per
//! period and handle; decisions never wait for it nor read the set.

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

/// Adds or refreshes `ARGV[1]`, counted until `ARGV[2]` ms from now, drops
/// the ids no longer counted, keeps the set as long as its last id, and
/// answers how many count. "Now" is the server's `TIME`, whatever clock
/// the store decides with (`RedisStoreBuilder::clock`): every instance
/// stamps and prunes on one clock, so an instance whose clock runs ahead
/// cannot drop the others, nor one behind keep the gone.
const HEARTBEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('PEXPIREAT', KEYS[1], last[2])
end
return redis.call('ZCARD', KEYS[1])
";

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

/// One heartbeat of `store`: how many instances count now, this one
/// included.
async fn heartbeat(store: &Inner, fleet: &Fleet, period: Duration) -> Result<u64, Error> {
    let counted = period.saturating_mul(PERIODS_COUNTED);
    let counted = u64::try_from(counted.as_millis()).unwrap_or(u64::MAX);
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(HEARTBEAT)
        .arg(1)
        .arg(store.encoder.fleet_key())
        .arg(fleet.id())
        .arg(counted);
    let deadline = Deadline::after(period.min(Duration::from_secs(2))).start();
    store.lanes.command::<u64>(&cmd, deadline).await
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
