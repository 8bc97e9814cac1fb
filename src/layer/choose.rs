//! The limits that apply to a request: per rule, its exemption, tier and
//! key (or the missing-key policy), and the request's cost.

use http::request::Parts;
use http::Response;
use smallvec::SmallVec;

use super::refusal::rejection;
use super::response::Answers;
use super::{Config, MissingKey, Rejection, ResponseBody};
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
