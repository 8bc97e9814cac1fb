//! The limits that apply to a request: per rule, its exemption, tier and
//! key (or the missing-key policy), and what the request costs it; and
//! the methods of [`Rule`] that say what a request costs on arrival.

use std::sync::Arc;

use http::request::Parts;
use http::Response;
use smallvec::SmallVec;

use super::refusal::rejection;
use super::response::Protocol;
use super::rule::{Arrival, Cost};
use super::{Config, MissingKey, Rejection, ResponseBody, Rule};
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

/// What a request costs a rule when it arrives.
impl Rule {
    /// Every request costs this rule `cost` (default 1): checked against
    /// the capacity of its limit (and tiers) when the layer is built
    /// ([`ConfigError::FixedCostExceedsCapacity`](crate::ConfigError::FixedCostExceedsCapacity)).
    /// Each rule of a layer has its own cost: a request can cost 1 to a
    /// request-count rule and 500 to a token budget, decided together in
    /// one store call.
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = Arrival::Fixed(cost);
        self
    }

    /// What each request costs this rule, computed from its head
    /// (weighted endpoints). `None` (not told) counts as the
    /// [fallback](Self::estimate_fallback): 1 unless set, or, for a rule
    /// that [settles estimates](Self::settle_estimates), the most one
    /// request may ask for (the function's request is not changed: the
    /// upstream is told nothing of it). A cost over the limit's capacity
    /// is answered 429 without `Retry-After`.
    ///
    /// A cost the client chooses (a header, a body field) is only as
    /// honest as the client: settle it after the response
    /// ([`settle_estimates`](Self::settle_estimates)) when the real cost
    /// is known then.
    pub fn cost_from_request(
        mut self,
        cost: impl Fn(&Parts) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.cost = Arrival::Request(Arc::new(cost));
        self
    }

    /// What each request costs this rule, read from its header `name` (an
    /// LLM call's `max_tokens`, say). The value is one JSON number token
    /// that is a whole number from 0 to 2^53 (`100`, `100.0`, `1e2`: the
    /// one grammar of a cost, the same for every reader of a request or a
    /// response; not `"100"`, `-1`, `1.5`, `+5`, `1e400`).
    ///
    /// Without [`settle_estimates`](Self::settle_estimates), a header
    /// absent, given more than once or not such a number counts as the
    /// [fallback](Self::estimate_fallback) (1 unless set). With it, see
    /// there: a header given more than once or not such a number is
    /// refused (400), and an absent one is charged the fallback and set
    /// to it on the request forwarded.
    pub fn cost_from_request_header(mut self, name: http::HeaderName) -> Self {
        self.cost = Arrival::Header(name);
        self
    }

    /// What each request costs this rule, read at the dotted `path` of its
    /// JSON object body (`"max_tokens"`, `"options.max_tokens"`: the path
    /// syntax of [`cost_from_response_json`](Self::cost_from_response_json);
    /// a path with an empty name is a build error,
    /// [`ConfigError::Layer`](crate::ConfigError::Layer)): a JSON number that
    /// is a whole number from 0 to 2^53 (`100`, `100.0`, `1e2`; see
    /// [`cost_from_request_header`](Self::cost_from_request_header)). The
    /// body is read once, before the layer, by
    /// [`ReadBody`](crate::key::ReadBody), whatever number of rules and
    /// keys ([`JsonField`](crate::key::JsonField)) read it; without
    /// `ReadBody` around the layer no request tells it (warned once).
    ///
    /// Without [`settle_estimates`](Self::settle_estimates), a field not
    /// told or unreadable counts as the [fallback](Self::estimate_fallback)
    /// (1 unless set). With it, see there: a field given twice, not such a
    /// number (`null` included), or a body not read whole (over
    /// `ReadBody`'s bound, slow, no `ReadBody`) or no JSON object is
    /// refused (400), and an absent field is charged the fallback and
    /// written into the body forwarded (as `"max_tokens":N` right after the
    /// body's `{`; for a longer path, as `"options":{"max_tokens":N}` when
    /// the body has no `options`: one that has it without the field cannot
    /// be written into and is refused, 400).
    pub fn cost_from_request_json(mut self, path: &str) -> Self {
        self.cost = Arrival::Json {
            path: crate::read::JsonPath::parse(path),
            warned: Arc::default(),
        };
        self
    }

    /// Takes this rule's cost on arrival as an estimate, settled after the
    /// response to the cost the rule reads from it
    /// ([`cost_from_response`](Self::cost_from_response),
    /// [`cost_from_response_header`](Self::cost_from_response_header),
    /// [`cost_from_response_chunks`](Self::cost_from_response_chunks),
    /// [`cost_from_response_json`](Self::cost_from_response_json)): what the
    /// estimate was over is given back, what it was under is charged in
    /// full, into debt if need be (at most the limit's capacity, as
    /// [`Limiter::charge`](crate::Limiter::charge) does).
    ///
    /// `max_share` (in (0, 1]) is the most one request may *ask for*, as
    /// a share of the limit's capacity (rounded down, at least 1): an
    /// estimate over it is refused with 400 (a problem body;
    /// [`Rejection::EstimateTooLarge`](super::Rejection::EstimateTooLarge)),
    /// taking nothing of any rule, except by a rule in
    /// [shadow mode](crate::Limit::shadow), which counts it as a
    /// would-refuse.
    ///
    /// The estimate is the number the upstream sees:
    ///
    /// - one that cannot be read unambiguously is refused with 400
    ///   ([`Rejection::EstimateUnreadable`](super::Rejection::EstimateUnreadable)),
    ///   taking nothing: a header given more than once, a JSON name given
    ///   twice, a value that is not a whole number from 1 to 2^53 (a
    ///   string, a negative, a fraction, `null`; and 0, which some
    ///   upstreams read as "no maximum"), a body over
    ///   [`ReadBody`](crate::key::ReadBody)'s bound or no JSON object;
    /// - one not told (the header or field absent) is charged the
    ///   [fallback](Self::estimate_fallback) (by default the most one
    ///   request may ask for), and the request forwarded says so: the
    ///   header is set to it, or the field is written into the JSON body
    ///   (`Content-Length` updated); where rules read one place, once, the
    ///   smallest of their fallbacks (a rule without estimates reading it
    ///   reads the request as it came).
    ///   With [`cost_from_request`](Self::cost_from_request), the function's
    ///   `None` is charged the fallback and nothing is written: the
    ///   function must only answer `None` where the upstream's own
    ///   default is at most that;
    /// - a response that tells no cost (a stream without its usage event, a
    ///   client gone before it, a compressed body) keeps the estimate,
    ///   counted `result="estimate_kept"` under
    ///   [`CHARGES`](crate::metrics::CHARGES); so does a request dropped
    ///   before its response (not counted there). A rule that reads the
    ///   response body asks the upstream for it uncompressed
    ///   (`Accept-Encoding: identity`).
    ///
    /// What the upstream must honour: the header or field (as forwarded)
    /// as the most it serves, and a usage it reports at most what it
    /// served. Then a budget of capacity C is exceeded by at most the
    /// costs, beyond their estimates, that responses tell of the requests
    /// granted before it ran out and not yet settled, each at most C (a
    /// charge into debt is capped at C): one request at a time, at most C
    /// beyond the budget (0 when the usage told is at most the estimate,
    /// as an upstream that honours the estimate and counts only what it
    /// serves reports), then the client waits out its debt; with N in
    /// flight, at most N × C (0 likewise). For every form above, on the
    /// memory store and on Redis (`BOUNDS.md`, "Settled costs").
    ///
    /// Outside (0, 1], on a rule that reads no cost after the response, or
    /// with a fallback of 0, the layer does not build
    /// ([`ConfigError::Layer`](crate::ConfigError::Layer)).
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_ratelimit::key::Global;
    /// use tower_ratelimit::layer::{RateLimitLayer, Rule};
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// // 100 000 tokens a day; a call pays its max_tokens, then what it used
    /// let tokens = Limit::new("tokens", Quota::per_day(100_000).fixed_window())?;
    /// let layer = RateLimitLayer::builder()
    ///     .rule(
    ///         Rule::new(tokens, Global)
    ///             .cost_from_request_header(HeaderName::from_static("x-max-tokens"))
    ///             .cost_from_response_header(HeaderName::from_static("x-tokens-used"))
    ///             .settle_estimates(0.05),
    ///     )
    ///     .build()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn settle_estimates(mut self, max_share: f64) -> Self {
        self.estimates = Some(max_share);
        self
    }

    /// What a cost that the request does not tell counts as: default 1
    /// (absent or unreadable), or, for a rule that
    /// [settles estimates](Self::settle_estimates), the most one request
    /// may ask for (absent only: an unreadable estimate is refused). For an
    /// estimate, the request forwarded is told it (the header set, or the
    /// field written into the JSON body): the upstream must honour it as
    /// the most it serves. At least 1 for an estimate
    /// ([`ConfigError::Layer`](crate::ConfigError::Layer) when the layer
    /// is built otherwise).
    pub fn estimate_fallback(mut self, cost: u64) -> Self {
        self.fallback = Some(cost);
        self
    }
}
