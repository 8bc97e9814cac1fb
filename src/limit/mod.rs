//! A named, validated quota ([`Limit`]): its name, interned (`intern.rs`),
//! and the integer parameters the algorithms decide with, derived once
//! ([`Params::derive`]); what it does besides counting its quota (leases, shadow
//! mode, a stored quota, a penalty, hot keys) in `options.rs`.

mod intern;
mod options;

use std::sync::Arc;
use std::time::Duration;

pub(crate) use self::intern::intern;
pub(crate) use self::intern::Name;

use crate::algorithm::Params;
use crate::hot::HotKey;
use crate::penalty::{PenParams, Penalty};
use crate::quota::Quota;
use crate::ConfigError;

/// A named, validated quota. Cheap to clone.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{ConfigError, Limit, Quota};
///
/// let sms = Limit::new("sms", Quota::per_minute(3).sliding_log())?;
/// assert_eq!(sms.name(), "sms");
/// assert!(matches!(
///     Limit::new("sms", Quota::per_minute(0).sliding_log()),
///     Err(ConfigError::ZeroAmount { .. })
/// ));
/// # Ok::<(), ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Limit {
    /// Interned (see [`Name`]): a decision names its limits without
    /// counting references, and counts under them without a lookup.
    name: &'static Name,
    quota: Quota,
    params: Params,
    policy_window: Duration,
    policy_window_us: u64,
    /// The penalty, if any (see [`Limit::with_penalty`]), with its integers.
    penalty: Option<Arc<(Penalty, PenParams)>>,
    /// Shadow mode: decides and records, never refuses.
    shadow: bool,
    /// Whether a stored quota (or a key's override) decides in place of
    /// `quota` (see [`Limit::use_stored_quota`]).
    stored_quota: bool,
    /// With `stored_quota`: a tier of a layer's rule (`Rule::tier`), which
    /// its key's override decides, never the limit's stored quota (that is
    /// the default tier's).
    overrides_only: bool,
    /// A concurrency limit: its grants are leases, given back when the
    /// work ends (see [`Limit::concurrency`]).
    leases: bool,
    /// How long a permit of a concurrency limit may be held at most (see
    /// [`Limit::hold_at_most`]); `None`: no bound (in a layer, a client
    /// that stops reading still loses it after a lease time),
    /// no bound for a [`Lease`](crate::Lease).
    max_hold: Option<Duration>,
    /// Batches of permits granted in this process (see [`Limit::with_hot_key`]).
    hot: Option<HotKey>,
}

impl Limit {
    /// Validates `quota` and names it. The name becomes part of every storage
    /// key and of the `RateLimit-Policy` header: 1 to 64 characters from
    /// `A-Z a-z 0-9 _ . -`.
    ///
    /// Names are configuration: the process keeps one copy of each distinct
    /// name for its whole life (a decision then names its limits without a
    /// reference count). Make limits with a bounded set of names, not one
    /// name per client.
    pub fn new(name: impl Into<String>, quota: Quota) -> Result<Self, ConfigError> {
        let name: String = name.into();
        let valid_name = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !valid_name {
            return Err(ConfigError::InvalidName(name));
        }
        let (params, policy_window) = Params::derive(&quota)?;
        Ok(Self {
            name: Name::of(&name),
            quota,
            params,
            policy_window,
            policy_window_us: u64::try_from(policy_window.as_micros()).unwrap_or(u64::MAX),
            penalty: None,
            shadow: false,
            stored_quota: false,
            overrides_only: false,
            leases: false,
            max_hold: None,
            hot: None,
        })
    }

    /// The same limit under another name, for state kept apart from it
    /// (the name need not be valid: it never comes from a user).
    pub(crate) fn renamed(&self, name: String) -> Self {
        let mut limit = self.clone();
        limit.name = Name::of(&name);
        limit
    }

    /// The name.
    pub fn name(&self) -> &str {
        self.name.text
    }

    /// The name, interned: the same pointer for every limit of that name.
    pub(crate) fn shared_name(&self) -> &'static str {
        self.name.text
    }

    /// The metric keys of its name (see [`Name`]).
    #[cfg(feature = "metrics")]
    pub(crate) fn metric_keys(&self) -> &'static crate::metrics::LimitKeys {
        &self.name.keys
    }

    /// The quota.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// The most one request can ever be granted.
    pub fn capacity(&self) -> u64 {
        self.quota.amount
    }

    /// The time in which a spent capacity comes back in full: the window for
    /// window algorithms (a calendar quota's longest period: 31 days for a
    /// month), capacity / rate for the bucket algorithms. Used as the
    /// `w` of `RateLimit-Policy`.
    pub fn policy_window(&self) -> Duration {
        self.policy_window
    }

    /// [`policy_window`](Self::policy_window) in microseconds (it is whole).
    pub(crate) fn policy_window_us(&self) -> u64 {
        self.policy_window_us
    }

    pub(crate) fn params(&self) -> &Params {
        &self.params
    }
}
