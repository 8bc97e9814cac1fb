//! The limits that apply to a request: per rule, its exemption, tier and
//! key (or the missing-key policy), and the request's cost.

use std::sync::Arc;

use http::request::Parts;
use http::Response;
use smallvec::SmallVec;

use super::refusal::rejection;
use super::response::Answers;
use super::{Config, MissingKey, RateLimitLayerBuilder, Rejection, ResponseBody};
use crate::key::KeyBuf;
use crate::limiter::Checks;
use crate::live::Current;
use crate::Limiter;

/// The limits that apply to a request: (limit, key, rule) each, or the
/// answer to a request without a key that its rule refuses.
pub(super) type Chosen<'a> = SmallVec<[(Current<'a>, KeyBuf, usize); 2]>;

// (the answer is returned once per refused request: not worth a box)
#[allow(clippy::result_large_err)]
pub(super) fn choose<'a, B>(
    config: &'a Config,
    parts: &Parts,
) -> Result<Chosen<'a>, Response<ResponseBody<B>>> {
    let mut chosen = Chosen::new();
    for (i, rule) in config.rules.iter().enumerate() {
        if rule.skip.as_ref().is_some_and(|skip| skip(parts)) {
            continue;
        }
        let tier = rule.tier(parts);
        let mut key = KeyBuf::new();
        // (an empty key is none: see `Error::EmptyKey`)
        let found = rule.key.extract_into(parts, &mut key) && !key.is_empty();
        match (found, &rule.on_missing) {
            (true, _) => chosen.push((tier.limit(), key, i)),
            (false, MissingKey::Skip) => {}
            (false, MissingKey::Shared(key)) => {
                chosen.push((tier.keyless(), KeyBuf::from(key.as_bytes()), i));
            }
            (false, MissingKey::Reject(status)) => {
                let name = rule.limit().name();
                tracing::debug!(target: "tower_ratelimit", limit = name, "request without a rate-limit key");
                let why = Rejection::MissingKey(name);
                let answer = || Answers::to(parts).missing_key(*status, name);
                return Err(rejection(config, why, answer));
            }
        }
    }
    Ok(chosen)
}

/// A request's cost: the layer's function of the request, or its fixed cost.
pub(super) fn cost_of(config: &Config, parts: &Parts) -> u64 {
    config
        .cost
        .as_ref()
        .map_or(config.fixed_cost, |cost| cost(parts))
}

/// The chosen limits and keys as the limiter decides them, at `cost`.
pub(super) fn checks_of<'a>(chosen: &'a Chosen<'_>, cost: u64) -> Checks<'a> {
    let pairs = chosen
        .iter()
        .map(|(limit, key, _)| (&**limit, key.as_bytes()));
    Limiter::checks(pairs, cost)
}

/// The 413 (or `INVALID_ARGUMENT`) for a request whose estimate `cost` is
/// over `share` of the capacity of a limit it is checked against whose rule
/// reads the cost after the response (see
/// [`settle_estimates`](super::RateLimitLayerBuilder::settle_estimates));
/// `None` when it is within every one.
pub(super) fn estimate_too_large<B>(
    config: &Config,
    parts: &Parts,
    chosen: &Chosen<'_>,
    cost: u64,
    share: f64,
) -> Option<Response<ResponseBody<B>>> {
    chosen.iter().find_map(|(limit, _, rule)| {
        let budget = config.rules.get(*rule)?.cost_after.any();
        let most = crate::limiter::share_of(limit.capacity(), share);
        (budget && cost > most).then(|| {
            let limit = limit.name();
            tracing::debug!(target: "tower_ratelimit", limit, cost, most, "an estimate over its share of a budget");
            let why = Rejection::EstimateTooLarge {
                limit,
                estimate: cost,
                most,
            };
            rejection(config, why, || {
                Answers::to(parts).estimate_too_large(limit, cost, most)
            })
        })
    })
}

/// A request's cost, and costs as estimates settled after the response.
impl RateLimitLayerBuilder {
    /// Every request costs `cost` (default 1); checked against every limit's
    /// capacity when built.
    pub fn fixed_cost(mut self, cost: u64) -> Self {
        self.fixed_cost = cost;
        self.cost = None;
        self
    }

    /// The cost of each request is computed from it (weighted endpoints).
    /// A cost over a limit's capacity is answered 429 without `Retry-After`.
    pub fn cost_from_request(
        mut self,
        cost: impl Fn(&Parts) -> u64 + Send + Sync + 'static,
    ) -> Self {
        self.cost = Some(Arc::new(cost));
        self
    }

    /// [`cost_from_request`](Self::cost_from_request) read from the request
    /// header `name`, a decimal integer (an LLM call's `max_tokens`, say);
    /// absent or unreadable: the [fixed cost](Self::fixed_cost), 1 unless set.
    pub fn cost_from_request_header(self, name: http::HeaderName) -> Self {
        let fixed = self.fixed_cost;
        self.cost_from_request(move |parts| {
            let value = parts.headers.get(&name).and_then(|v| v.to_str().ok());
            value.and_then(|v| v.trim().parse().ok()).unwrap_or(fixed)
        })
    }

    /// Takes each request's cost as an estimate, settled after the response
    /// to the actual cost that its rules read from it
    /// ([`Rule::cost_from_response`](super::Rule::cost_from_response), [`Rule::cost_from_body`](super::Rule::cost_from_body)): what the
    /// estimate was over is given back, what it was under is charged. A
    /// request dropped before its response keeps its estimate; a response
    /// that tells no cost keeps it too.
    ///
    /// `max_share` (in (0, 1]) bounds what one request may take of each
    /// budget (the limits of rules that read a cost after the response):
    /// an estimate over `max_share` of a limit's capacity is answered
    /// 413 (a problem body; [`Rejection::EstimateTooLarge`](super::Rejection::EstimateTooLarge)), taking nothing,
    /// and a cost over the estimate is charged at most `max_share` of
    /// the capacity more. So a limit's overshoot is at most the sum, over
    /// the requests in flight, of their cost less their estimate, and at
    /// most `max_share` of its capacity for each. Outside (0, 1], or
    /// without a rule that reads a cost after the response, the layer
    /// does not build ([`ConfigError::Layer`](crate::ConfigError::Layer)).
    ///
    /// ```
    /// use std::time::Duration;
    /// use http::HeaderName;
    /// use tower_ratelimit::key::Global;
    /// use tower_ratelimit::layer::{RateLimitLayer, Rule};
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// // 100 000 tokens a day; a call pays its max_tokens, then what it used
    /// let tokens = Limit::new("tokens", Quota::per_day(100_000).fixed_window())?;
    /// let layer = RateLimitLayer::builder()
    ///     .rule(Rule::new(tokens, Global).cost_from_header(HeaderName::from_static("x-tokens-used")))
    ///     .cost_from_request_header(HeaderName::from_static("x-max-tokens"))
    ///     .settle_estimates(0.05)
    ///     .build()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn settle_estimates(mut self, max_share: f64) -> Self {
        self.estimates = Some(max_share);
        self
    }
}
