//! [`Rule`]: one limit of a layer with its key and its own policies.

use std::sync::Arc;

use http::request::Parts;
use http::response::Parts as ResponseParts;

use super::arrival::Arrival;
use super::costs::CostAfter;
use super::MissingKey;
use crate::key::{KeyExtractor, KeyKind};
use crate::{LimitSource, Quota};

pub(crate) type RequestPredicate = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;
pub(crate) type RequestCost = Arc<dyn Fn(&Parts) -> Option<u64> + Send + Sync>;
pub(crate) type ResponsePredicate = Arc<dyn Fn(&ResponseParts) -> bool + Send + Sync>;
pub(crate) type TierChoice = Arc<dyn for<'a> Fn(&'a Parts) -> Option<&'a str> + Send + Sync>;

/// One limit of a [`RateLimitLayer`](super::RateLimitLayer): the limit, the
/// key it counts per, and policies of its own. Added with
/// [`RateLimitLayerBuilder::rule`](super::RateLimitLayerBuilder::rule);
/// [`limit(limit, key)`](super::RateLimitLayerBuilder::limit) adds
/// `Rule::new(limit, key)`.
///
/// - [`skip_if`](Self::skip_if): requests this limit does not apply to
///   (never counted, never refused by it);
/// - [`on_missing_key`](Self::on_missing_key): what a request without its
///   key gets, for this limit only;
/// - [`refund_if`](Self::refund_if): responses whose requests do not count
///   (the permit, taken when the request arrived, is given back);
/// - [`cost`](Self::cost), [`cost_from_request`](Self::cost_from_request),
///   [`cost_from_request_header`](Self::cost_from_request_header),
///   [`cost_from_request_json`](Self::cost_from_request_json): what a request
///   costs this limit on arrival (each rule its own);
/// - [`cost_from_response`](Self::cost_from_response),
///   [`cost_from_response_header`](Self::cost_from_response_header),
///   [`cost_from_response_chunks`](Self::cost_from_response_chunks),
///   [`cost_from_response_json`](Self::cost_from_response_json) and
///   [`cost_from_response_body`](Self::cost_from_response_body): a cost known only
///   from the response, charged after it, or settling an estimate
///   ([`settle_estimates`](Self::settle_estimates)); and what a response
///   that tells none costs ([`cost_if_untold`](Self::cost_if_untold));
/// - [`tier`](Self::tier) and [`choose_tier`](Self::choose_tier): the quota
///   chosen per request (a plan), in the same limit.
///
/// At most 5 failed logins per user name per 15 minutes, successes not
/// counted. The key is the user name the password is checked against, which
/// a middleware before the layer reads from the body into a request
/// extension (as `examples/server.rs` does), not a header the client sets
/// apart from it (`x-user`), which it could change on every guess. Only a
/// success is given back: a server error counts too, or a guess that makes
/// the server fail would be free.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::key::RequestExtension;
/// use tower_ratelimit::layer::{RateLimitLayer, Rule};
/// use tower_ratelimit::{Limit, Quota};
///
/// /// The user name of the login's body, set by a middleware before the layer.
/// #[derive(Clone)]
/// struct Username(String);
/// impl std::fmt::Display for Username {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         self.0.fmt(f)
///     }
/// }
///
/// let failures = Limit::new("login", Quota::rate(5, Duration::from_secs(15 * 60)).sliding_log())?;
/// let layer = RateLimitLayer::builder()
///     .rule(
///         Rule::new(failures, RequestExtension::<Username>::new())
///             .refund_if(|response| response.status.is_success()),
///     )
///     .build()?;
/// # let _ = layer;
/// # Ok::<(), tower_ratelimit::ConfigError>(())
/// ```
#[must_use]
pub struct Rule {
    pub(crate) limit: LimitSource,
    pub(crate) key: Arc<dyn KeyExtractor>,
    /// What kind of key `key` makes, registered on the store when the layer
    /// is built.
    pub(super) key_kind: KeyKind,
    pub(crate) skip: Option<RequestPredicate>,
    pub(crate) on_missing: Option<MissingKey>,
    pub(crate) refund_if: Option<ResponsePredicate>,
    pub(crate) cost_after: CostAfter,
    /// What a request costs this rule on arrival.
    pub(crate) cost: Arrival,
    /// Settling the cost on arrival as an estimate: the share of the
    /// limit's capacity one request may ask for.
    pub(crate) estimates: Option<f64>,
    /// What a cost not told counts as (absent or unreadable; for an
    /// estimate, absent only).
    pub(crate) fallback: Option<u64>,
    pub(crate) tiers: Vec<(String, Quota)>,
    pub(crate) choose: Option<TierChoice>,
    /// Where the key and tier come from instead ([`Rule::resolved`]).
    #[cfg(feature = "resolver")]
    pub(crate) plan: Option<crate::plan::PlanResolver>,
}

impl std::fmt::Debug for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rule")
            .field("limit", &self.limit)
            .field("key", &self.key_kind)
            .field("on_missing", &self.on_missing)
            .field("tiers", &self.tiers)
            .finish()
    }
}

impl Rule {
    /// `limit` (fixed, or [live](crate::LiveLimit): every request is decided
    /// with its value at the time), counted per `key`, with the layer's
    /// policies.
    ///
    /// Reads the kind of key `key` makes ([`KeyExtractor::key_kind`]) once,
    /// here: a layer built with this rule warns if another layer on the same
    /// store keys the same limit name another way.
    pub fn new(limit: impl Into<LimitSource>, key: impl KeyExtractor) -> Self {
        Self {
            limit: limit.into(),
            key_kind: KeyKind::of(&key),
            key: Arc::new(key),
            skip: None,
            on_missing: None,
            refund_if: None,
            cost_after: CostAfter::default(),
            cost: Arrival::Fixed(1),
            estimates: None,
            fallback: None,
            tiers: Vec::new(),
            choose: None,
            #[cfg(feature = "resolver")]
            plan: None,
        }
    }

    /// Requests for which `skip` answers `true` are exempt from this limit:
    /// never counted by it, never refused by it (the layer's other limits
    /// still apply). A request every rule of a layer skips is forwarded
    /// without a decision.
    pub fn skip_if(mut self, skip: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        self.skip = Some(Arc::new(skip));
        self
    }

    /// What a request without this limit's key gets (default:
    /// [`MissingKey::Reject`] with 400 Bad Request).
    /// [`MissingKey::Shared`] counts keyless requests under a key kept apart
    /// from every real key of the limit.
    pub fn on_missing_key(mut self, policy: MissingKey) -> Self {
        self.on_missing = Some(policy);
        self
    }

    /// Gives this limit's permit back when `refund` answers `true` for the
    /// response: the request does not count. The permit is taken when the
    /// request arrives, so concurrent requests cannot all slip through
    /// before the first outcome is known ("at most 5 failed logins":
    /// `refund_if(|r| r.status.is_success())`, so that a server error counts
    /// as a failure: refunding all but 401 would make a guess that fails
    /// the server free). The refund
    /// is made before the response is returned. Responses the layer makes
    /// itself (429, 503, ...) take nothing, and an error of the inner
    /// service keeps the permit.
    pub fn refund_if(
        mut self,
        refund: impl Fn(&ResponseParts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.refund_if = Some(Arc::new(refund));
        self
    }

    /// Another quota for this limit, named `tier`, used for the requests
    /// [`choose_tier`](Self::choose_tier) names it for (the rule's own
    /// limit is the default tier). Every tier counts in the same limit, under
    /// the same keys: a client moving to another plan keeps what it used.
    /// A tier must use the same algorithm as the limit
    /// ([`ConfigError::Tiers`](crate::ConfigError::Tiers) when the layer is built otherwise, or when a
    /// [live](crate::LiveLimit) limit is set to another). A tier's quota is
    /// fixed; its shadow mode is the limit's when the layer is built.
    ///
    /// When the limit [uses a stored quota](crate::Limit::use_stored_quota), a
    /// key's override ([`Admin::set_override`](crate::Admin::set_override))
    /// decides that key's requests in every tier: an override is about the
    /// customer, so it wins over the plan. The limit's stored quota
    /// ([`Admin::set_stored_quota`](crate::Admin::set_stored_quota)) is the
    /// default tier's: the other tiers keep their own quotas. Both are read
    /// in the decision's own round trip, as for a limit without tiers. (A
    /// live limit with tiers keeps whether it uses a stored quota:
    /// [`ConfigError::Tiers`](crate::ConfigError::Tiers) for a value that changes it.) The layer's
    /// handle on them is [`RateLimitLayer::admin`](super::RateLimitLayer::admin).
    pub fn tier(mut self, tier: impl Into<String>, quota: Quota) -> Self {
        self.tiers.push((tier.into(), quota));
        self
    }

    /// The tier of each request: a name given to [`tier`](Self::tier), or
    /// `None` (or an unknown name) for the default. Called once per request,
    /// before the store is asked: one round trip, whatever the tier.
    ///
    /// ```
    /// use tower_ratelimit::key::ClientIp;
    /// use tower_ratelimit::layer::{RateLimitLayer, Rule};
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// #[derive(Clone)]
    /// enum Plan { Free, Pro } // set by an authentication layer
    ///
    /// let reports = Rule::new(Limit::new("reports", Quota::per_hour(100).sliding_window())?, ClientIp::peer())
    ///     .tier("pro", Quota::per_hour(10_000).sliding_window())
    ///     .choose_tier(|request| match request.extensions.get::<Plan>() {
    ///         Some(Plan::Pro) => Some("pro"),
    ///         _ => None,
    ///     });
    /// let layer = RateLimitLayer::builder().rule(reports).build()?;
    /// # let _ = layer;
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn choose_tier(
        mut self,
        choose: impl for<'a> Fn(&'a Parts) -> Option<&'a str> + Send + Sync + 'static,
    ) -> Self {
        self.choose = Some(Arc::new(choose));
        self
    }
}
