//! What a request costs a rule when it arrives: fixed, or read from the
//! request (a function, a header, a path of its JSON body), and what the
//! layer does with an estimate.

use std::sync::Arc;

use http::request::Parts;

use super::rule::RequestCost;
use crate::key::Told;
use crate::read::JsonPath;

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
    pub(super) fn told(&self, parts: &Parts) -> Told {
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
    pub(super) fn same_place(&self, other: &Arrival) -> bool {
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
    pub(super) fn tell(&self, parts: &mut Parts, cost: u64) -> bool {
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
    pub(crate) fallback: Option<u64>,
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
