//! A [`Rule`] as the layer applies it: validated against its limit
//! ([`Rule::compile`]), with its tiers and what a request costs it.

use std::sync::Arc;

use http::request::Parts;

use super::arrival::{Arrival, Cost, Estimates};
use super::costs::CostAfter;
use super::rule::{RequestPredicate, ResponsePredicate, TierChoice};
use super::{MissingKey, Rule};
use crate::key::{KeyExtractor, KeyKind, Told};
use crate::live::Current;
use crate::{ConfigError, Limit, LimitSource};

impl Rule {
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
