//! Distributed rate limiting for Tower and axum, and for any code that must
//! not do something too often ("at most 3 SMS per phone number per minute").
//!
//! # The 30-second tour
//!
//! - A [`Quota`] says how much may pass, in named steps: a rate
//!   (`Quota::per_second(10)`), a burst for the bucket algorithms
//!   (`.allow_burst(20)`), then the algorithm: `.sliding_log()` (exact),
//!   `.token_bucket()`, `.gcra()`, `.fixed_window()`, `.sliding_window()`
//!   (two counters, for large limits).
//! - A [`Limit`] names a validated quota; invalid ones are a [`ConfigError`].
//! - A [`Limiter`] decides one or more limits per key over a store:
//!   [`MemoryStore`] in-process (the default), or [`RedisStore`] shared by every
//!   instance (feature `redis`): one `FCALL` of a Redis Function per
//!   decision (under load, one per batch of the decisions that arrived
//!   while one was in flight), clock read from Redis `TIME`.
//! - Limits can change while the fleet runs: a [`LiveLimit`] is swapped in
//!   the process, a limit marked [`Limit::use_stored_quota`] takes its
//!   stored quota (and per-key overrides) every instance reads from the
//!   store.
//! - Beyond rates: a [`Limit::concurrency`] counts work in progress with
//!   [leases](Lease) that expire unless renewed, and [`Limiter::charge`]
//!   (or a layer rule's `cost_from_response`) charges a cost known only
//!   after the fact, leaving a key in debt until it is paid back.
//! - A limit may carry a [`Penalty`] ([`Limit::with_penalty`]): after N refusals
//!   within a time the key is blocked, longer on each repeat offence,
//!   counted in the decision's own round trip; [`Admin::block`],
//!   [`Admin::unblock`] and [`Admin::inspect`] manage bans by hand.
//! - A [`Decision`] says allowed or not, remaining, the exact `retry_after`,
//!   `reset_after`, and tells apart a cost that can never fit.
//!
//! ```
//! use std::time::Duration;
//! use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota, Verdict};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let sms = Limit::new("sms", Quota::per_minute(3).sliding_log())?;
//! let limiter = Limiter::new(MemoryStore::new(), sms);
//! for _ in 0..3 {
//!     assert!(limiter.check("+15550100", 1).await?.is_allowed());
//! }
//! let denied = limiter.check("+15550100", 1).await?;
//! assert!(matches!(denied.verdict(), Verdict::Denied { .. }));
//! assert!(denied.retry_after().unwrap() <= Duration::from_secs(60));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! # Algorithms
//!
//! Each algorithm lives in two files with the same name: its Lua script in
//! `lua/` (its steps, each written once; `build.rs` assembles the library
//! and pastes the steps into the driver's one-limit decision) and its Rust
//! mirror in `src/algorithm/`. Both use integer
//! microseconds and exact integer arithmetic, so a fresh 10-per-second limit
//! reports 9 remaining after one hit, in any year. Several limits are decided
//! together: each finds the earliest time its cost fits, and all are granted
//! at the latest of those times or none is.
//!
//! # In operation
//!
//! Stored state is independent of the quota that wrote it: absolute times
//! and amounts, each amount with its unit, and the clock of the writer.
//!
//! - **Quota changes** (a rolling deploy runs old and new parameters side by
//!   side on the same keys): buckets keep what is left, clamped to the new
//!   capacity; windows keep what was used. A bucket keeps its state until it
//!   would have refilled to the largest capacity that wrote it, so a larger
//!   bucket never reads as full a key a smaller one let expire; a sliding
//!   log keeps the entries of a longer window for one such window after that
//!   limiter's last write.
//!   What one quota grants never exceeds what the older or the newer quota
//!   alone would allow from the true history (a property test checks this
//!   for every parameter of every algorithm, up and down).
//! - **Evicted, deleted or foreign keys**: a missing key, a key of another
//!   type or a value that does not parse reads as absent and is repaired by
//!   the next write; a sliding log trusts its log over its `meta` cache.
//!   No state makes a decision fail.
//! - **Clock steps**: each key records the clock of its last write, and a
//!   decision never runs earlier than the latest of those it reads. After a
//!   backward step, grants stay grants and reservations stay reservations;
//!   refills pause until the clock catches up. A forward step refills early
//!   by the size of the step.
//! - **Expiry**: every state knows when it becomes equal to a fresh one and
//!   reads as absent from then on; a key's TTL only reclaims memory (see
//!   [`RedisStoreBuilder::expiry_slack`]).
//!
//! # Floors
//!
//! Imports only go down. Each module of `src/` stands on a floor and
//! imports only from modules on lower floors: the modules of one floor do
//! not import one another (a module's own files aside, and its test
//! module, which may use anything). `tests/floors.rs` reads this table and
//! holds every `crate::` path of `src/` to it.
//!
//! | floor | modules | what they are |
//! |---|---|---|
//! | 9 | `layer` | the Tower layer: rules, the service, its responses |
//! | 8 | `plan`, `watch` | the layer's plan resolver; a file of limits, watched |
//! | 7 | `limiter`, `key`, `config` | the decisions a request and an operator make; what a request is counted by; limits read from configuration |
//! | 6 | `store`, `live` | the memory and Redis engines, which know nothing of the limiter, the keys or the layer; limits swapped while running |
//! | 5 | `limit` | a named, validated quota and what it does besides counting |
//! | 4 | `metrics` | the counters and gauges, read off a limit's status |
//! | 3 | `algorithm`, `decision` | the in-process mirror of `lua/`; what a check returns |
//! | 2 | `quota`, `fields`, `penalty`, `hot` | what a quota is; the rate-limit header fields a decision and the layer write; penalties; hot keys |
//! | 1 | `calendar`, `clock`, `error`, `grpc`, `read`, `sync`, `text` | shared below everything: calendar periods, time, errors, gRPC statuses, the JSON and event-stream readers, the lock, text on the stack |
//!
//! # Features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `redis` | yes | [`RedisStore`] (redis-rs, deadpool-redis) |
//! | `axum` | yes | `ClientIp` reads axum's `ConnectInfo`; the `MatchedRoute` and `PathParam` keys; [`RateLimitInfo`](layer::RateLimitInfo) as an extractor |
//! | `cluster` | no | [`RedisStore::cluster_builder`]: Redis Cluster; implies `redis` |
//! | `sentinel` | no | [`RedisStore::sentinel_builder`]: the master Redis Sentinel names; implies `redis` |
//! | `tls` | no | `rediss://` URLs for every store kind (rustls with ring, the system's root certificates, [`RedisStoreBuilder::tls_root_certificate`]); implies `redis` |
//! | `metrics` | no | counters, histograms and gauges through the `metrics` facade: see [`metrics`] |
//! | `serde` | no | [`Limit`] deserializes from configuration files, windows as human durations (`"15m"`) |
//! | `watch` | no | `watch::LimitsFile`: a file of limits applied to [`LiveLimits`] and read again whenever it changes |
//! | `resolver` | no | `layer::PlanResolver`: a rule's key and tier from an async lookup (API key to tenant and plan), in a bounded cache with a TTL (`moka`) |
//!
//! Without default features the crate is the in-memory limiter and the Tower
//! layer for any `http` service, with neither Redis nor axum in the build.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![deny(unreachable_pub)]
#![forbid(unsafe_code)]

mod algorithm;
mod calendar;
mod clock;
#[cfg(feature = "serde")]
mod config;
mod decision;
mod error;
mod fields;
#[cfg(feature = "grpc")]
mod grpc;
mod hot;
pub mod key;
pub mod layer;
mod limit;
mod limiter;
mod live;
pub mod metrics;
mod penalty;
#[cfg(feature = "resolver")]
mod plan;
mod quota;
mod read;
mod store;
mod sync;
mod text;
#[cfg(feature = "watch")]
#[cfg_attr(docsrs, doc(cfg(feature = "watch")))]
pub mod watch;

/// The README's examples, compiled as doctests so they stay true.
#[cfg(all(
    doctest,
    feature = "axum",
    feature = "cluster",
    feature = "sentinel",
    feature = "tls",
    feature = "resolver"
))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use calendar::Period;
pub use clock::{Clock, ManualClock, SystemClock};
pub use decision::{Decision, LimitStatus, Verdict};
pub use error::{ConfigError, Error};

pub use hot::HotKey;
pub use limit::Limit;
pub use limiter::{
    Admin, Grant, Inspection, Lease, Limiter, LimiterBuilder, Refundable, SetItem, SetMode,
    DEFAULT_TIMEOUT, MAX_WAIT,
};
pub use live::{LimitSource, LiveLimit, LiveLimits};
pub use penalty::{Penalty, DEFAULT_FORGET_AFTER};
pub use quota::{Algorithm, Burst, CalendarRate, Quota, Rate};
pub use store::{MemoryStore, MemoryStoreBuilder, Store};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::{RedisStore, RedisStoreBuilder};
