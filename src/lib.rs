//! Distributed rate limiting for Tower and axum, and for any code that must
//! not do something too often ("at most 3 SMS per phone number per minute").
//!
//! # The 30-second tour
//!
//! - A [`Quota`] says how much may pass: [`Quota::sliding_log`] (exact),
//!   [`Quota::token_bucket`], [`Quota::gcra`], [`Quota::fixed_window`],
//!   [`Quota::sliding_window`] (two counters, for large limits).
//! - A [`Limit`] names a validated quota; invalid ones are a [`ConfigError`].
//! - A [`Limiter`] decides one or more limits per key over a store:
//!   [`MemoryStore`] in-process (the default), or [`RedisStore`] shared by every
//!   instance: one `EVALSHA` per decision, clock read from Redis `TIME`.
//! - A [`Decision`] says allowed or not, remaining, the exact `retry_after`,
//!   `reset_after`, and tells apart a cost that can never fit.
//!
//! ```
//! use std::time::Duration;
//! use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota, Verdict};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let sms = Limit::new("sms", Quota::sliding_log(3, Duration::from_secs(60)))?;
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
//! Each algorithm lives in exactly two places with the same name: its Lua
//! script in `lua/` and its Rust mirror in `src/algorithm/`. Both use integer
//! microseconds and exact integer arithmetic, so a fresh 10-per-second limit
//! reports 9 remaining after one hit, in any year. Several limits are decided
//! together: each finds the earliest time its cost fits, and all are granted
//! at the latest of those times or none is.
#![warn(missing_docs)]
#![deny(unreachable_pub)]
#![forbid(unsafe_code)]

mod algorithm;
mod clock;
mod decision;
mod error;
pub mod key;
pub mod layer;
mod limiter;
mod quota;
pub mod store;

/// The README's examples, compiled as doctests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use clock::{Clock, ManualClock, SystemClock};
pub use decision::{Decision, LimitStatus, Verdict};
pub use error::{ConfigError, Error};
pub use limiter::{Limiter, LimiterBuilder, DEFAULT_TIMEOUT};
pub use quota::{Algorithm, Limit, Quota};
pub use store::{MemoryStore, RedisStore, RedisStoreBuilder, Store};
