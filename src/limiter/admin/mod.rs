//! What an operator does, apart from what a request does: [`Admin`], the
//! handle [`Limiter::admin`] lends.
//!
//! A [`Limiter`]'s own methods are the decisions a request makes (`check`,
//! `acquire`, `peek`, `take_up_to`, `reset`, ...). Managing the limits
//! behind them lives here: the stored quotas and their per-key
//! overrides (`stored.rs`, see [`Limit::use_stored_quota`](crate::Limit::use_stored_quota)),
//! and the penalties and bans (`penalties.rs`, see
//! [`Limit::with_penalty`](crate::Limit::with_penalty)): block, unblock, inspect. Each
//! operation names the limit it acts on.
//!
//! The handle borrows the limiter (nothing is cloned to make it); keep a
//! [`Limiter`] (cheap to clone) where an admin endpoint needs one, or the
//! [`RateLimitLayer`](crate::layer::RateLimitLayer), whose
//! [`admin`](crate::layer::RateLimitLayer::admin) is the same handle on
//! the layer's limits.

mod penalties;
mod stored;

pub use self::penalties::Inspection;
use super::Limiter;

/// The operator's handle on a [`Limiter`]: stored quotas, overrides,
/// penalties, reset; from [`Limiter::admin`], or for a layer's limits
/// (every rule's, tiers included) from
/// [`RateLimitLayer::admin`](crate::layer::RateLimitLayer::admin).
///
/// ```
/// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let limit = Limit::new("reports", Quota::per_hour(10).fixed_window())?.use_stored_quota();
/// let limiter = Limiter::new(MemoryStore::new(), limit);
/// let admin = limiter.admin();
/// admin.set_stored_quota("reports", Quota::per_hour(500).fixed_window()).await?;
/// assert_eq!(limiter.check("acme", 1).await?.remaining(), 499);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Admin<'a> {
    pub(in crate::limiter) limiter: &'a Limiter,
}

impl Admin<'_> {
    /// Forgets `key`'s state in every limit of the limiter (or layer):
    /// [`Limiter::reset`]. Its overrides stay.
    pub async fn reset(self, key: impl AsRef<[u8]>) -> Result<(), crate::Error> {
        self.limiter.reset(key).await
    }
}
