//! What the limiter reports through the [`metrics`](https://docs.rs/metrics)
//! facade (feature `metrics`), so an application picks the exporter:
//! Prometheus, OpenTelemetry, StatsD, ... Without the feature nothing is
//! recorded and this module only names what would be.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | [`DECISIONS`] | counter | `limit`, `outcome` | decisions, per limit and [`Outcome`] |
//! | [`STORE_DURATION`] | histogram | `store` (`redis`, `memory`), `operation` (`decide`, `reset`, `refund`, `take`, `charge`, `renew`) | seconds per store call, failures and timeouts included |
//! | [`MEMORY_STORE_KEYS`] | gauge | | key states held by this process's memory stores (the stores, a layer's memory fallback), refreshed at most once a second per store |
//! | [`CHARGES`] | counter | `result` (`charged`, `retried`, `failed`, `estimate_kept`, `untold`) | costs charged after the fact ([`Limiter::charge`](crate::Limiter::charge), a rule's cost from its response): `retried` charged after a failed try, `failed` not charged; `estimate_kept`: a response that told no cost to a rule that [settles estimates](crate::layer::Rule::settle_estimates) (no usage event, a client gone before it, a compressed or unreadable body), its estimate kept as its cost; `untold`: one that told none to a rule with [`cost_if_untold`](crate::layer::Rule::cost_if_untold), charged that |
//! | [`PENALTIES_NOT_STORED`] | counter | `limit` | new penalty states (a block, refusals or offences counted) a [`MemoryStore`](crate::MemoryStore) did not keep on their own: they take at most half its `max_keys` (active blocks kept as ban records, 4 to a state), and when none can be given up and no record fits, the state goes to the state its key's bucket of the hash shares (1/2^21 of the limit's keys, at most 8 blocking per limit and shard), or is not stored (the key is not told it is blocked); a block by [`Admin::block`](crate::Admin::block) then fails with [`Error::PenaltyNotStored`](crate::Error::PenaltyNotStored) |
//! | [`PLAN_LOOKUPS`] | counter | `result` (`found`, `unknown`, `failed`, `timed_out`, `oversized`) | lookups of plan resolvers (feature `resolver`), cache hits not counted; `oversized`: a lookup key too long, refused without a lookup |
//! | [`LIMIT_CAPACITY`] | gauge | `limit` | the capacity of the quota that last decided for the limit |
//! | [`LIMIT_WINDOW`] | gauge | `limit` | that quota's [policy window](crate::Limit::policy_window), in seconds |
//! | [`NEAR_LIMIT`] | counter | `limit` | grants that left the limit under a fifth of its capacity (`remaining × 5 < capacity`) |
//! | [`OVERSHOOT`] | histogram | `limit`, `source` (`charge`, `hot_batch`) | how far a limit may be put past its capacity, per event (see below) |
//! | [`STORE_OUTAGE`] | gauge | `store` (`redis`, `memory`) | 1 while the store's calls fail, 0 once one answers |
//!
//! A decision counts once under each limit it involved: under every limit
//! when it is allowed or the store failed, under the limits that refused it
//! when it is refused. A [`peek`](crate::Limiter::peek) consumes nothing and
//! is not counted. A limit in [shadow mode](crate::Limit::shadow) that would
//! have refused counts `shadow_denied`; a refund is not a decision and is not
//! counted here. Under the layer's
//! [`OnStoreError::FallbackToMemory`](crate::layer::OnStoreError::FallbackToMemory),
//! a request the store failed counts twice: `store_error`, then the outcome
//! of the in-memory fallback's decision. A request a layer's deny-list
//! refuses counts `deny_listed` under every limit of the layer (no decision
//! is made); a key blocked by a [penalty](crate::Limit::with_penalty) counts
//! `denied` (or `local_cache`) like any refusal. A request whose estimate
//! a layer refuses as over its share of a limit (see
//! [`settle_estimates`](crate::layer::Rule::settle_estimates))
//! counts `estimate_too_large` under that limit, and nothing is decided;
//! one whose estimate cannot be read unambiguously counts
//! `estimate_unreadable`.
//!
//! The quota gauges show what decided: a limit's quota, its new value after
//! a [live change](crate::LiveLimit) (from the first decision the new
//! value makes), and a [stored quota](crate::Limit::use_stored_quota)
//! when one decided. They are set when that quota differs from the one they
//! show, not on every decision (with overrides per key, the last that
//! decided). A grant near the limit counts under every limit of the
//! decision it left under a fifth of its capacity.
//!
//! [`OVERSHOOT`] records, neither store's reply telling a limit's debt, the
//! most each event can put a limit past its capacity: `charge`, each cost
//! charged after the fact ([`Limiter::charge`](crate::Limiter::charge), a
//! rule's cost from its response), at most the capacity, per limit charged
//! (the debt it leaves is at most this); `hot_batch`, the permits a
//! [hot key](crate::Limit::with_hot_key)'s batch took from the store (an
//! instance grants at most its batch beyond what the store counts).
//!
//! The cache of denials' hits are the decisions counted with the outcome
//! `local_cache` under [`DECISIONS`]: no metric of their own.
//!
//! [`STORE_OUTAGE`] is set by each limiter's store calls (decisions,
//! batches, refunds, charges) and by each layer's outage log (see
//! [`OnStoreError`](crate::layer::OnStoreError)), when what they see
//! changes: per store kind, so two stores of one kind share it (the last
//! change shows). A memory store never fails: under a layer's memory
//! fallback, `store="memory"` stays 0 while `store="redis"` is 1.
//!
//! Adding an outcome where it happens is one call with its [`Outcome`]; the
//! label set is fixed here, so dashboards can be built before a limiter
//! ever reports one.
//!
//! ```
//! # #[cfg(feature = "metrics")] {
//! use tower_ratelimit::metrics::{Outcome, DECISIONS};
//!
//! // What a Prometheus query filters on:
//! assert_eq!(DECISIONS, "tower_ratelimit_decisions_total");
//! assert_eq!(Outcome::Denied.as_str(), "denied");
//! assert!(Outcome::ALL.contains(&Outcome::StoreError));
//! # }
//! ```
//!
//! # Histogram buckets
//!
//! Dashboards and alerts compute quantiles from a histogram's buckets
//! (`histogram_quantile` over `_bucket` series, summed across instances).
//! An exporter may render histograms otherwise: `metrics-exporter-prometheus`
//! renders a summary (quantiles per instance, no `_bucket` series) unless
//! told the buckets of the metric. [`buckets`] gives each histogram of this
//! crate with the bounds the example dashboard and alert rules
//! (`examples/grafana-dashboard.json`, `examples/prometheus-alerts.yml`)
//! are written for; the exporter is the application's choice, so this is
//! data for it, not a call into it:
//!
//! ```
//! use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
//!
//! let mut builder = PrometheusBuilder::new();
//! for (name, bounds) in tower_ratelimit::metrics::buckets() {
//!     builder = builder.set_buckets_for_metric(Matcher::Full(name.to_owned()), bounds)?;
//! }
//! let recorder = builder.build_recorder(); // or `.install_recorder()?`
//! # let _ = recorder;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # What the recorder needs
//!
//! [`STORE_DURATION`] gets a sample per store call: under a flood, hundreds
//! of thousands a second. A recorder that keeps samples until they are
//! rendered grows by each of them while no one scrapes:
//! `metrics-exporter-prometheus` keeps every histogram sample until its
//! *upkeep* drains them into the buckets. Its `install` and `build` spawn
//! the upkeep (every 5 s, `upkeep_timeout`); `install_recorder` and
//! `build_recorder` do not, and the application must call
//! `PrometheusHandle::run_upkeep` every few seconds itself (the example
//! server did not, and grew from 26 to 80 MiB over 4 million requests
//! unscraped). Give it the [`buckets`] too: a histogram with buckets is a
//! fixed set of counters once drained, where a summary keeps a sketch per
//! label set. Other exporters have their own flush (OpenTelemetry's export
//! interval, StatsD's aggregation), to be checked the same way.
//!
//! ```no_run
//! use std::time::Duration;
//! use metrics_exporter_prometheus::PrometheusBuilder;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let handle = PrometheusBuilder::new().install_recorder()?;
//! let upkeep = handle.clone();
//! tokio::spawn(async move {
//!     let mut every = tokio::time::interval(Duration::from_secs(5));
//!     loop {
//!         every.tick().await;
//!         upkeep.run_upkeep(); // drains histogram samples into their buckets
//!     }
//! });
//! # Ok(()) }
//! ```
//!
//! Every decision also runs in a `tracing` span `rate_limit` (target
//! `tower_ratelimit`, level `debug`) with the fields `limits` (the names)
//! and `outcome` (as in [`Outcome::as_str`]).

/// Counter of decisions, labelled `limit` and `outcome`.
pub const DECISIONS: &str = "tower_ratelimit_decisions_total";
/// Histogram of store call durations in seconds, labelled `store` and `operation`.
pub const STORE_DURATION: &str = "tower_ratelimit_store_duration_seconds";
/// Gauge of the key states held in memory stores.
pub const MEMORY_STORE_KEYS: &str = "tower_ratelimit_memory_store_keys";
/// Counter of costs charged after the fact, labelled `result`.
pub const CHARGES: &str = "tower_ratelimit_charges_total";
/// Counter of new penalty states a memory store did not keep on their own
/// (kept in a block shared per limit and shard, or refused), labelled
/// `limit`.
pub const PENALTIES_NOT_STORED: &str = "tower_ratelimit_memory_store_penalties_not_stored_total";
/// Counter of plan lookups (feature `resolver`), labelled `result`.
pub const PLAN_LOOKUPS: &str = "tower_ratelimit_plan_lookups_total";
/// Gauge of a limit's capacity, labelled `limit`.
pub const LIMIT_CAPACITY: &str = "tower_ratelimit_limit_capacity";
/// Gauge of a limit's policy window in seconds, labelled `limit`.
pub const LIMIT_WINDOW: &str = "tower_ratelimit_limit_window_seconds";
/// Counter of grants that left under a fifth of a limit's capacity,
/// labelled `limit`.
pub const NEAR_LIMIT: &str = "tower_ratelimit_near_limit_total";
/// Histogram of what may put a limit over its capacity, labelled `limit`
/// and `source`.
pub const OVERSHOOT: &str = "tower_ratelimit_overshoot";
/// Gauge, 1 while a store's calls fail, else 0, labelled `store`.
pub const STORE_OUTAGE: &str = "tower_ratelimit_store_outage";

/// The bucket bounds of [`STORE_DURATION`], in seconds: 0.5 ms to 1 s,
/// finer where a store's calls usually land, with 50 ms (the example
/// alert's threshold for a slow store) among them.
pub const STORE_DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// The bucket bounds of [`OVERSHOOT`], in the limits' own units (requests,
/// tokens, bytes): powers of ten from 1 to 100 000.
pub const OVERSHOOT_BUCKETS: &[f64] = &[1.0, 10.0, 100.0, 1000.0, 10_000.0, 100_000.0];

/// Every histogram of this crate, by metric name, with its bucket bounds
/// ([`STORE_DURATION`] with [`STORE_DURATION_BUCKETS`], [`OVERSHOOT`] with
/// [`OVERSHOOT_BUCKETS`]): what an exporter needs to render `_bucket`
/// series (see [the module docs](self#histogram-buckets)).
///
/// ```
/// use tower_ratelimit::metrics::{buckets, OVERSHOOT, STORE_DURATION};
///
/// let names: Vec<&str> = buckets().map(|(name, _)| name).collect();
/// assert_eq!(names, [STORE_DURATION, OVERSHOOT]);
/// assert!(buckets().all(|(_, bounds)| bounds.windows(2).all(|w| w[0] < w[1])));
/// ```
pub fn buckets() -> impl Iterator<Item = (&'static str, &'static [f64])> {
    [
        (STORE_DURATION, STORE_DURATION_BUCKETS),
        (OVERSHOOT, OVERSHOOT_BUCKETS),
    ]
    .into_iter()
}

/// The `outcome` label of [`DECISIONS`]: every value it can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// Granted (at once or as a reservation).
    Allowed,
    /// Refused: the limit has no room for the cost yet.
    Denied,
    /// Would have been refused, but let through because the limit only
    /// observes (shadow mode, see [`Limit::shadow`](crate::Limit::shadow)).
    ShadowDenied,
    /// Refused: the cost exceeds the limit's capacity and never fits.
    CostExceedsCapacity,
    /// The store failed or timed out; the layer's [`OnStoreError`]
    /// policy decided the request's fate.
    ///
    /// [`OnStoreError`]: crate::layer::OnStoreError
    StoreError,
    /// Refused from the limiter's local cache of denials without asking
    /// the store (see [`crate::LimiterBuilder::cache_denials`]).
    LocalCache,
    /// Refused by a layer's deny-list without asking the store (see
    /// [`RateLimitLayerBuilder::deny_if`](crate::layer::RateLimitLayerBuilder::deny_if)):
    /// counted under every limit of the layer.
    DenyListed,
    /// Refused by a layer before asking the store: the request's estimate
    /// is over the share of the limit's capacity one request may take (see
    /// [`Rule::settle_estimates`](crate::layer::Rule::settle_estimates)).
    /// Counted under that limit, whatever answer a custom
    /// [`on_rejection`](crate::layer::RateLimitLayerBuilder::on_rejection)
    /// handler gives.
    EstimateTooLarge,
    /// Refused by a layer before asking the store: the request's estimate
    /// cannot be read unambiguously (see
    /// [`Rejection::EstimateUnreadable`](crate::layer::Rejection::EstimateUnreadable)).
    /// Counted under that limit.
    EstimateUnreadable,
}

impl Outcome {
    /// Every outcome, for dashboards and exporters that declare label values.
    pub const ALL: [Outcome; 9] = [
        Outcome::Allowed,
        Outcome::Denied,
        Outcome::ShadowDenied,
        Outcome::CostExceedsCapacity,
        Outcome::StoreError,
        Outcome::LocalCache,
        Outcome::DenyListed,
        Outcome::EstimateTooLarge,
        Outcome::EstimateUnreadable,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::ShadowDenied => "shadow_denied",
            Outcome::CostExceedsCapacity => "cost_exceeds_capacity",
            Outcome::StoreError => "store_error",
            Outcome::LocalCache => "local_cache",
            Outcome::DenyListed => "deny_listed",
            Outcome::EstimateTooLarge => "estimate_too_large",
            Outcome::EstimateUnreadable => "estimate_unreadable",
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

mod record;

pub(crate) use self::record::{
    charged, overshoot, penalty_not_stored, store_outage, OutageGauge, StoreTimer,
};
#[cfg(feature = "metrics")]
pub(crate) use self::record::{LimitKeys, SizeGauge};
