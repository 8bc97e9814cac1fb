//! [`Rule`]: one limit of a layer with its key and its own policies.

use std::sync::Arc;

use http::request::Parts;
use http::response::Parts as ResponseParts;

use super::after::CostAfter;
use super::MissingKey;
use crate::key::{KeyExtractor, KeyKind, Told};
use crate::live::Current;
use crate::read::JsonPath;
use crate::{ConfigError, Limit, LimitSource, Quota};

pub(crate) type RequestPredicate = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;
pub(crate) type RequestCost = Arc<dyn Fn(&Parts) -> Option<u64> + Send + Sync>;
pub(crate) type ResponsePredicate = Arc<dyn Fn(&ResponseParts) -> bool + Send + Sync>;
type TierChoice = Arc<dyn for<'a> Fn(&'a Parts) -> Option<&'a str> + Send + Sync>;

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
    key_kind: KeyKind,
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
    /// ([`ConfigError::Tiers`] when the layer is built otherwise, or when a
    /// [live](crate::LiveLimit) limit is set to another). A tier's quota is
    /// fixed; its shadow mode is the limit's when the layer is built.
    ///
    /// When the limit [uses a stored quota](Limit::use_stored_quota), a
    /// key's override ([`Admin::set_override`](crate::Admin::set_override))
    /// decides that key's requests in every tier: an override is about the
    /// customer, so it wins over the plan. The limit's stored quota
    /// ([`Admin::set_stored_quota`](crate::Admin::set_stored_quota)) is the
    /// default tier's: the other tiers keep their own quotas. Both are read
    /// in the decision's own round trip, as for a limit without tiers. (A
    /// live limit with tiers keeps whether it uses a stored quota:
    /// [`ConfigError::Tiers`] for a value that changes it.) The layer's
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

    /// Validates the rule and resolves its policies against the layer's;
    /// a live limit is told what the layer needs of its values: a fixed
    /// `cost` it holds, the algorithm of its tiers.
    pub(crate) fn compile(self) -> Result<CompiledRule, ConfigError> {
        let name = self.limit.name().to_owned();
        let current = Limit::clone(&self.limit.load());
        if current.is_concurrency() && self.cost_after.any() {
            return Err(ConfigError::Layer(format!(
                "limit {name:?} is a concurrency limit: its permits are held while the work \
                 runs, so no cost can be charged to it after the response"
            )));
        }
        if let Some(Err(why)) = &self.cost_after.meter {
            return Err(ConfigError::Layer(format!("limit {name:?}: {why}")));
        }
        if let Arrival::Json { path: Err(why), .. } = &self.cost {
            return Err(ConfigError::Layer(format!("limit {name:?}: {why}")));
        }
        if current.is_concurrency() && !matches!(self.cost, Arrival::Fixed(1)) {
            return Err(ConfigError::Layer(format!(
                "limit {name:?} is a concurrency limit: a request holds one permit of it, \
                 so its cost is 1"
            )));
        }
        let estimates = match self.estimates {
            None => None,
            Some(share) if !(share > 0.0 && share <= 1.0) => {
                return Err(ConfigError::Layer(format!(
                    "limit {name:?}: the share of a budget one estimate may take must be in \
                     (0, 1], not {share}"
                )))
            }
            Some(_) if !self.cost_after.any() => {
                return Err(ConfigError::Layer(format!(
                    "limit {name:?}: an estimate is settled to the cost read after the \
                     response (cost_from_response, cost_from_response_header, cost_from_response_chunks, \
                     cost_from_response_json, cost_from_response_body): the rule reads none"
                )))
            }
            Some(_) if self.fallback == Some(0) => {
                return Err(ConfigError::Layer(format!(
                    "limit {name:?}: an estimate's fallback is written into the request, \
                     and 0 is read by some upstreams as no maximum: it must be at least 1"
                )))
            }
            Some(share) => Some(Estimates {
                share,
                fallback: self.fallback,
            }),
        };
        if let Some(untold) = self.cost_after.untold {
            if !self.cost_after.any() {
                return Err(ConfigError::Layer(format!(
                    "limit {name:?}: cost_if_untold is charged when the response tells no \
                     cost, and the rule reads none from it"
                )));
            }
            if untold > current.capacity() {
                return Err(ConfigError::Layer(format!(
                    "limit {name:?}: cost_if_untold({untold}) is over the capacity {}",
                    current.capacity()
                )));
            }
        }
        let fixed = match self.cost {
            Arrival::Fixed(cost) => Some(cost),
            _ => None,
        };
        let on_missing = self.on_missing.unwrap_or_default();
        check_missing(&on_missing)?;
        if matches!(&on_missing, MissingKey::Shared(key) if key.is_empty()) {
            return Err(ConfigError::Layer(format!(
                "limit {name:?}: the shared key of requests without one cannot be empty"
            )));
        }
        match (self.tiers.is_empty(), self.choose.is_some()) {
            (false, false) => {
                return Err(ConfigError::Tiers(format!(
                    "limit {name:?} has tiers but nothing chooses them: call choose_tier"
                )))
            }
            (true, true) => {
                return Err(ConfigError::Tiers(format!(
                    "limit {name:?} chooses a tier but has none: add them with tier"
                )))
            }
            _ => {}
        }
        let keyless = matches!(on_missing, MissingKey::Shared(_));
        let mut tiers: Vec<Tier> = Vec::new();
        for (tier, quota) in self.tiers {
            if quota.algorithm() != current.quota().algorithm() {
                return Err(ConfigError::Tiers(format!(
                    "tier {tier:?} of limit {name:?} uses the {} algorithm, the limit the {}: \
                     the tiers of a limit share its state, so they share its algorithm",
                    quota.algorithm(),
                    current.quota().algorithm()
                )));
            }
            if tiers
                .iter()
                .any(|t| t.name.as_deref() == Some(tier.as_str()))
            {
                return Err(ConfigError::Tiers(format!(
                    "limit {name:?} has two tiers named {tier:?}"
                )));
            }
            let mut limit = if current.is_concurrency() {
                // a concurrency limit's tiers are concurrency limits too
                if quota.algorithm() != crate::Algorithm::SlidingLog {
                    return Err(ConfigError::Tiers(format!(
                        "limit {name:?} is a concurrency limit: its tier {tier:?} must be one \
                         too (a sliding log, as Limit::concurrency makes)"
                    )));
                }
                Limit::concurrency(name.clone(), quota.capacity(), quota.window())?
            } else {
                Limit::new(name.clone(), quota)?
            };
            if current.is_shadow() {
                limit = limit.shadow();
            }
            // one key, one penalty state, whatever the tier
            if let Some(penalty) = current.penalty() {
                limit = limit.with_penalty(penalty.clone());
            }
            // a key's override applies whatever the tier; the limit's
            // stored quota is the default tier's
            if current.uses_stored_quota() {
                limit = limit.overrides_only();
            }
            tiers.push(Tier::new(Some(tier), limit.into(), keyless));
        }
        if let Some(live) = self.limit.live() {
            let algorithm = current.quota().algorithm();
            let tiered = (!tiers.is_empty()).then(|| (algorithm, current.uses_stored_quota()));
            live.require(fixed, tiered)?;
        }
        let default = Tier::new(None, self.limit, keyless);
        Ok(CompiledRule {
            default,
            tiers,
            key: self.key,
            key_kind: self.key_kind,
            skip: self.skip,
            on_missing,
            refund_if: self.refund_if,
            cost_after: self.cost_after,
            cost: self.cost,
            estimates,
            fallback: self.fallback.unwrap_or(1),
            choose: self.choose,
            #[cfg(feature = "resolver")]
            plan: self.plan,
        })
    }
}

/// What one request costs a rule when it arrives.
#[derive(Clone)]
pub(crate) enum Arrival {
    /// The same for every request.
    Fixed(u64),
    /// Read from the request; `None`: not told.
    Request(RequestCost),
    /// Read from the request header of this name
    /// ([`Rule::cost_from_request_header`]).
    Header(http::HeaderName),
    /// Read at a dotted path of the JSON body
    /// ([`Rule::cost_from_request_json`]; `Err`: the path is no path, a
    /// build error), warned once when no body was read.
    Json {
        path: Result<JsonPath, String>,
        warned: Arc<std::sync::atomic::AtomicBool>,
    },
}

impl Arrival {
    /// What `parts` tells of its cost.
    fn told(&self, parts: &Parts) -> Told {
        match self {
            Arrival::Fixed(cost) => Told::Cost(*cost),
            Arrival::Request(cost) => cost(parts).map_or(Told::Absent, Told::Cost),
            Arrival::Header(name) => crate::key::cost::of_header(&parts.headers, name),
            Arrival::Json {
                path: Ok(path),
                warned,
            } => crate::key::json_cost(parts, path, warned),
            Arrival::Json { path: Err(_), .. } => Told::Unreadable,
        }
    }

    /// Whether `self` and `other` read the same place of a request.
    fn same_place(&self, other: &Arrival) -> bool {
        match (self, other) {
            (Arrival::Header(a), Arrival::Header(b)) => a == b,
            (Arrival::Json { path: Ok(a), .. }, Arrival::Json { path: Ok(b), .. }) => a == b,
            _ => false,
        }
    }

    /// Writes `cost` where the request tells its cost, so that the request
    /// forwarded says it: the header set, or the field written into the
    /// JSON body; `false` when it cannot be (a cost from a function of the
    /// request, a body that is no JSON object).
    fn tell(&self, parts: &mut Parts, cost: u64) -> bool {
        match self {
            Arrival::Header(name) => {
                parts.headers.insert(name, http::HeaderValue::from(cost));
                true
            }
            Arrival::Json { path: Ok(path), .. } => crate::key::write_cost(parts, path, cost),
            Arrival::Json { path: Err(_), .. } | Arrival::Fixed(_) | Arrival::Request(_) => false,
        }
    }
}

/// A rule's cost on arrival taken as an estimate, settled after the
/// response ([`Rule::settle_estimates`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Estimates {
    /// The share of the limit's capacity one request may ask for.
    pub(crate) share: f64,
    /// What an estimate not told counts as (`None`: the most one request
    /// may ask for).
    fallback: Option<u64>,
}

/// A request's cost to a rule, or why the rule refuses it.
pub(crate) enum Cost {
    Is(u64),
    TooLarge {
        estimate: u64,
        most: u64,
    },
    /// An estimate that cannot be read unambiguously (refused, 400).
    Unreadable,
    /// An estimate not told: the fallback, to be written into the request
    /// ([`CompiledRule::tell`]) once every rule has read its own.
    Untold(u64),
}

/// Refuses a missing key answered with a success or informational status.
pub(super) fn check_missing(policy: &MissingKey) -> Result<(), ConfigError> {
    match policy {
        MissingKey::Reject(status) if status.is_success() || status.is_informational() => Err(
            ConfigError::Layer(format!("a missing key cannot be answered with {status}")),
        ),
        _ => Ok(()),
    }
}

/// One quota of a rule, with the limit keyless requests count under.
pub(crate) struct Tier {
    name: Option<String>,
    limit: LimitSource,
    /// For [`MissingKey::Shared`]: the same quota under a name no user limit
    /// can have (`name#keyless`), so its key never meets a real one (made
    /// once for a fixed limit; a live limit's value carries its own).
    keyless: Option<Option<Limit>>,
}

impl Tier {
    fn new(name: Option<String>, limit: LimitSource, keyless: bool) -> Self {
        let keyless = keyless.then(|| match limit.live() {
            Some(_) => None,
            None => {
                let limit = limit.load();
                Some(limit.renamed(format!("{}#keyless", limit.name())))
            }
        });
        Self {
            name,
            limit,
            keyless,
        }
    }

    /// The limit a request with its key is decided with now.
    pub(crate) fn limit(&self) -> Current<'_> {
        self.limit.load()
    }

    /// The limit a request without its key is counted under now, for
    /// [`MissingKey::Shared`].
    pub(crate) fn keyless(&self) -> Current<'_> {
        match &self.keyless {
            Some(Some(fixed)) => Current::Fixed(fixed),
            _ => self.limit.load().keyless(),
        }
    }
}

/// A rule as the layer applies it.
pub(crate) struct CompiledRule {
    pub(crate) default: Tier,
    /// The other tiers.
    tiers: Vec<Tier>,
    pub(crate) key: Arc<dyn KeyExtractor>,
    pub(crate) key_kind: KeyKind,
    pub(crate) skip: Option<RequestPredicate>,
    pub(crate) on_missing: MissingKey,
    pub(crate) refund_if: Option<ResponsePredicate>,
    /// The cost charged after the response, if any.
    pub(crate) cost_after: CostAfter,
    /// What a request costs on arrival.
    cost: Arrival,
    /// The cost on arrival is an estimate, settled after the response.
    pub(crate) estimates: Option<Estimates>,
    /// What a cost from the request that is not told counts as, where
    /// the rule settles no estimate.
    fallback: u64,
    choose: Option<TierChoice>,
    #[cfg(feature = "resolver")]
    pub(crate) plan: Option<crate::plan::PlanResolver>,
}

impl CompiledRule {
    /// Every limit of the rule as it is now: its tiers.
    pub(crate) fn limits(&self) -> impl Iterator<Item = Current<'_>> {
        std::iter::once(&self.default)
            .chain(&self.tiers)
            .map(Tier::limit)
    }

    /// The default tier's limit.
    pub(crate) fn limit(&self) -> &LimitSource {
        &self.default.limit
    }

    /// Whether a request's quota can differ from the default's (tiers, a
    /// live limit, a stored quota), or a keyless request be
    /// counted under another name.
    pub(crate) fn varies(&self) -> bool {
        !self.tiers.is_empty()
            || self.default.keyless.is_some()
            || self.default.limit.live().is_some()
            || self.default.limit.load().uses_stored_quota()
    }

    /// Whether the rule holds its grants until the response body ends (a
    /// [concurrency limit](Limit::concurrency)) or charges after it.
    pub(crate) fn settles_after(&self) -> bool {
        self.cost_after.any() || self.limits().any(|l| l.is_concurrency())
    }

    /// Whether the key and tier come from a plan resolver, awaited before
    /// the rule is applied ([`Rule::resolved`]).
    pub(crate) fn is_resolved(&self) -> bool {
        #[cfg(feature = "resolver")]
        return self.plan.is_some();
        #[cfg(not(feature = "resolver"))]
        false
    }

    /// What `parts` costs this rule under `limit` (its tier's, now).
    ///
    /// Without estimates, a cost not told or unreadable counts as the
    /// fallback (1 unless set). With estimates: one over the most one
    /// request may ask for is too large; one that is unreadable, or 0
    /// (which some upstreams read as "no maximum"), is refused; one not
    /// told counts as the fallback (that most unless set), to be written
    /// into the request where it tells its cost ([`tell`](Self::tell)), so
    /// that the upstream sees what was charged.
    #[inline]
    pub(crate) fn cost(&self, parts: &Parts, limit: &Limit) -> Cost {
        let told = match &self.cost {
            // (the common case: a fixed cost, no estimate)
            Arrival::Fixed(cost) if self.estimates.is_none() => return Cost::Is(*cost),
            arrival => arrival.told(parts),
        };
        let Some(estimates) = self.estimates else {
            return Cost::Is(match told {
                Told::Cost(cost) => cost,
                Told::Absent | Told::Unreadable => self.fallback,
            });
        };
        let most = crate::limiter::share_of(limit.capacity(), estimates.share);
        let fallback = estimates.fallback.unwrap_or(most);
        match told {
            Told::Cost(estimate) if estimate > most => Cost::TooLarge { estimate, most },
            // (a fixed estimate of 0 is the operator's: not told)
            Told::Cost(0) if matches!(self.cost, Arrival::Fixed(_)) => Cost::Is(fallback),
            Told::Cost(0) | Told::Unreadable => Cost::Unreadable,
            Told::Cost(estimate) => Cost::Is(estimate),
            // a function of the request has nowhere to write it
            Told::Absent if matches!(self.cost, Arrival::Request(_)) => Cost::Is(fallback),
            Told::Absent => Cost::Untold(fallback),
        }
    }

    /// Writes `cost`, charged for an estimate not told, where the request
    /// tells its estimate (the header set, the field written into the JSON
    /// body), unless `earlier` (rules that wrote theirs before) wrote that
    /// place already; `false` when it cannot be written (a body that is no
    /// JSON object).
    pub(crate) fn tell<'r>(
        &self,
        parts: &mut Parts,
        cost: u64,
        mut earlier: impl Iterator<Item = &'r CompiledRule>,
    ) -> bool {
        if earlier.any(|rule| rule.cost.same_place(&self.cost)) {
            return true;
        }
        self.cost.tell(parts, cost)
    }

    /// Whether the rule reads its cost from the response body
    /// ([`Rule::cost_from_response_json`], [`Rule::cost_from_response_body`]): the
    /// body must come as it is sent, not compressed.
    pub(crate) fn meters_body(&self) -> bool {
        self.cost_after.meter.is_some()
    }

    /// The fixed cost of every request, if it is one.
    pub(crate) fn fixed_cost(&self) -> Option<u64> {
        match self.cost {
            Arrival::Fixed(cost) => Some(cost),
            _ => None,
        }
    }

    /// The tier of this request.
    pub(crate) fn tier(&self, parts: &Parts) -> &Tier {
        let chosen = self.choose.as_ref().and_then(|choose| choose(parts));
        chosen
            .and_then(|name| self.tiers.iter().find(|t| t.name.as_deref() == Some(name)))
            .unwrap_or(&self.default)
    }
}
