//! The limits that apply to a request: per rule, its exemption, tier and
//! key (or the missing-key policy), and what the request costs it; and
//! the fallbacks of estimates not told written into the request.

use http::request::Parts;
use http::Response;
use smallvec::SmallVec;

use super::arrival::Cost;
use super::refusal::rejection;
use super::response::Protocol;
use super::{Config, MissingKey, Rejection, ResponseBody};
use crate::key::KeyBuf;
use crate::limiter::Checks;
use crate::live::Current;
use crate::store::Check;
use crate::Limiter;

/// A limit that applies to a request: the limit now (its tier's), the
/// key, the index of its rule, and what the request costs it.
pub(super) struct Applies<'a> {
    pub(super) limit: Current<'a>,
    pub(super) key: KeyBuf,
    pub(super) rule: usize,
    pub(super) cost: u64,
}

/// The limits that apply to a request, in the order of their rules: the
/// order of the limiter's checks, so a check's index finds its rule.
pub(super) type Chosen<'a> = SmallVec<[Applies<'a>; 2]>;

/// The limits that apply to a request, or the layer's response to a request
/// a rule refuses before the store is asked: no key where the rule needs
/// one, or an estimate over what one request may ask for (a shadow rule
/// counts that as a would-refuse and refuses nothing).
// (the response is returned once per refused request: not worth a box)
#[allow(clippy::result_large_err)]
pub(super) fn choose<'a, B>(
    config: &'a Config,
    parts: &mut Parts,
) -> Result<Chosen<'a>, Response<ResponseBody<B>>> {
    let mut chosen = Chosen::new();
    // estimates not told: (rule, the fallback charged), written once every
    // rule has read its own
    let mut untold: SmallVec<[(usize, u64); 1]> = SmallVec::new();
    for (i, rule) in config.rules.iter().enumerate() {
        if rule.skip.as_ref().is_some_and(|skip| skip(parts)) {
            continue;
        }
        let tier = rule.tier(parts);
        let mut key = KeyBuf::new();
        // (an empty key is none: see `Error::EmptyKey`)
        let found = rule.key.extract_into(parts, &mut key) && !key.is_empty();
        let (limit, key) = match (found, &rule.on_missing) {
            (true, _) => (tier.limit(), key),
            (false, MissingKey::Skip) => continue,
            (false, MissingKey::Shared(key)) => (tier.keyless(), KeyBuf::from(key.as_bytes())),
            (false, MissingKey::Reject(status)) => {
                let name = rule.limit().name();
                tracing::debug!(target: "tower_ratelimit", limit = name, "request without a rate-limit key");
                let why = Rejection::MissingKey(name);
                let response = || Protocol::of(parts).missing_key(*status, name);
                return Err(rejection(config, why, response));
            }
        };
        let cost = match rule.cost(parts, &limit) {
            Cost::Is(cost) => cost,
            // (a shadow limit observes: it changes nothing of the request)
            Cost::Untold(cost) if limit.is_shadow() => cost,
            Cost::Untold(cost) => {
                untold.push((i, cost));
                cost
            }
            Cost::Unreadable if limit.is_shadow() => {
                let name = limit.name();
                tracing::debug!(target: "tower_ratelimit", limit = name, "shadow limit would have refused an unreadable estimate");
                crate::limiter::count::count_one(&limit, crate::metrics::Outcome::ShadowDenied);
                continue;
            }
            Cost::Unreadable => {
                let name = limit.name();
                tracing::debug!(target: "tower_ratelimit", limit = name, "an estimate that cannot be read unambiguously");
                let why = Rejection::EstimateUnreadable { limit: name };
                return Err(rejection(config, why, || {
                    Protocol::of(parts).estimate_unreadable(name)
                }));
            }
            Cost::TooLarge { estimate, most } if limit.is_shadow() => {
                // a shadow limit never refuses: it counts what it would do,
                // and takes nothing, as for any request it would refuse
                let name = limit.name();
                tracing::debug!(target: "tower_ratelimit", limit = name, estimate, most, "shadow limit would have refused an estimate over its share");
                crate::limiter::count::count_one(&limit, crate::metrics::Outcome::ShadowDenied);
                continue;
            }
            Cost::TooLarge { estimate, most } => {
                let name = limit.name();
                tracing::debug!(target: "tower_ratelimit", limit = name, estimate, most, "an estimate over its share of a budget");
                let why = Rejection::EstimateTooLarge {
                    limit: name,
                    estimate,
                    most,
                };
                return Err(rejection(config, why, || {
                    Protocol::of(parts).estimate_too_large(name, estimate, most)
                }));
            }
        };
        if rule.meters_body() {
            // the body is metered as it is sent: asked for uncompressed
            parts.headers.insert(
                http::header::ACCEPT_ENCODING,
                http::HeaderValue::from_static("identity"),
            );
        }
        chosen.push(Applies {
            limit,
            key,
            rule: i,
            cost,
        });
    }
    if !untold.is_empty() {
        tell_untold(config, parts, &chosen, &untold)?;
    }
    Ok(chosen)
}

/// Writes the fallbacks charged for estimates not told into the request
/// forwarded, the smallest first where rules share a place (the upstream
/// is held to at most what each of them charged); a request whose body
/// cannot hold it is refused (400), as an unreadable estimate.
#[cold]
#[allow(clippy::result_large_err)]
fn tell_untold<B>(
    config: &Config,
    parts: &mut Parts,
    chosen: &Chosen<'_>,
    untold: &[(usize, u64)],
) -> Result<(), Response<ResponseBody<B>>> {
    let mut untold = untold.to_vec();
    untold.sort_by_key(|&(_, cost)| cost);
    for (j, &(i, cost)) in untold.iter().enumerate() {
        let earlier = untold[..j].iter().map(|&(r, _)| &config.rules[r]);
        if config.rules[i].tell(parts, cost, earlier) {
            continue;
        }
        let name = match chosen.iter().find(|applies| applies.rule == i) {
            Some(applies) => applies.limit.name(),
            None => config.rules[i].limit().name(),
        };
        tracing::debug!(target: "tower_ratelimit", limit = name, "an estimate not told cannot be written into the request");
        let why = Rejection::EstimateUnreadable { limit: name };
        return Err(rejection(config, why, || {
            Protocol::of(parts).estimate_unreadable(name)
        }));
    }
    Ok(())
}

/// The chosen limits and keys as the limiter decides them, each at its
/// rule's cost.
pub(super) fn checks_of<'a>(chosen: &'a Chosen<'_>) -> Checks<'a> {
    let mut checks = Checks::new();
    for applies in chosen {
        checks.push(Check {
            limit: &applies.limit,
            key: applies.key.as_bytes(),
            cost: Limiter::cost(applies.cost),
        });
    }
    checks
}
