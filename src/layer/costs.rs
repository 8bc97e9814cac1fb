//! What a request costs a rule: the methods of [`Rule`] that say it, on
//! arrival (fixed, or read from the request, perhaps an estimate settled
//! later) and after the response (read from its head or its body), and
//! how the cost after the response is kept.

use std::sync::Arc;

use http::request::Parts;
use http::response::Parts as ResponseParts;

use super::arrival::Arrival;
use super::meter::MeterSpec;
use super::Rule;

/// How a rule's cost after the response is read (see
/// [`Rule::cost_from_response`], [`Rule::cost_from_response_chunks`]).
#[derive(Clone, Default)]
pub(crate) struct CostAfter {
    pub(crate) head: Option<HeadCost>,
    pub(crate) body: Option<BodyCost>,
    /// A cost read out of the body ([`Rule::cost_from_response_json`],
    /// [`Rule::cost_from_response_body`]), or why it cannot be.
    pub(crate) meter: Option<Result<MeterSpec, String>>,
    /// What a request costs in all when its response tells no cost
    /// ([`Rule::cost_if_untold`]).
    pub(crate) untold: Option<u64>,
}

pub(crate) type HeadCost = Arc<dyn Fn(&ResponseParts) -> Option<u64> + Send + Sync>;
pub(crate) type BodyCost = Arc<dyn Fn(&bytes::Bytes) -> u64 + Send + Sync>;

impl CostAfter {
    /// Whether the rule charges anything after the response.
    pub(crate) fn any(&self) -> bool {
        self.head.is_some() || self.body.is_some() || self.meter.is_some()
    }
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

/// Costs read from the response.
impl Rule {
    /// Charges this limit, after the response, the cost `cost` reads from
    /// its head (`None`: nothing more), such as the tokens an LLM reports:
    /// see [`cost_from_response_header`](Self::cost_from_response_header) for the common case
    /// and the module docs for the bound.
    ///
    /// The request's cost to this rule ([`cost`](Self::cost), 1 by
    /// default) is taken when it arrives, so a key already in debt is refused; once the
    /// response is known, what its cost exceeds that by is charged (see
    /// [`Limiter::charge`](crate::Limiter::charge)), whatever is left, on a
    /// task of its own: the response is not held up. With
    /// [`cost_from_response_chunks`](Self::cost_from_response_chunks) too, both are added, and the
    /// charge is made when the body ends. The response's RateLimit fields
    /// show the limit as the request found it, before its own charge.
    pub fn cost_from_response(
        mut self,
        cost: impl Fn(&ResponseParts) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.cost_after.head = Some(Arc::new(cost));
        self
    }

    /// [`cost_from_response`](Self::cost_from_response) read from the
    /// response header `name`: one JSON number token that is a whole
    /// number from 0 to 2^53 (`100`, `100.0`, `1e2`: the one grammar of a
    /// cost, see [`cost_from_request_header`](Self::cost_from_request_header)).
    /// Absent, given more than once or not such a number: no cost told.
    pub fn cost_from_response_header(self, name: http::HeaderName) -> Self {
        self.cost_from_response(move |response| {
            match crate::key::cost::of_header(&response.headers, &name) {
                crate::key::Told::Cost(cost) => Some(cost),
                _ => None,
            }
        })
    }

    /// What a request costs this limit in all when its response tells no
    /// cost (the response's head and body read as the rule says: a header
    /// absent, a stream without its usage, a compressed or unreadable
    /// body): the most a request may cost, say. Without it such a request
    /// costs what it paid on arrival: its [`cost`](Self::cost) (1 by
    /// default), or its [estimate](Self::settle_estimates), kept. With it,
    /// what `cost` exceeds that by is charged, as a cost told would be.
    /// A request dropped before its response pays only what it paid on
    /// arrival. Over the limit's capacity, or on a rule that reads no cost
    /// after the response, the layer does not build
    /// ([`ConfigError::Layer`](crate::ConfigError::Layer)).
    ///
    /// ```
    /// use tower_ratelimit::key::Global;
    /// use tower_ratelimit::layer::{RateLimitLayer, Rule};
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// // a call that reports no usage pays 4096 tokens, the most it may use
    /// let tokens = Limit::new("tokens", Quota::per_minute(100_000).sliding_window())?;
    /// let layer = RateLimitLayer::builder()
    ///     .rule(
    ///         Rule::new(tokens, Global)
    ///             .cost_from_response_json("usage.total_tokens")
    ///             .cost_if_untold(4096),
    ///     )
    ///     .build()?;
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn cost_if_untold(mut self, cost: u64) -> Self {
        self.cost_after.untold = Some(cost);
        self
    }

    /// Charges this limit, after the response, the cost `cost` counts in
    /// each chunk of its body as it streams (the bytes served:
    /// `|chunk| chunk.len() as u64`), when the body ends or is dropped (a
    /// client gone mid-stream pays for what it was sent). As with
    /// [`cost_from_response`](Self::cost_from_response), the request's own
    /// cost is taken when it arrives and only the excess is charged.
    pub fn cost_from_response_chunks(
        mut self,
        cost: impl Fn(&bytes::Bytes) -> u64 + Send + Sync + 'static,
    ) -> Self {
        self.cost_after.body = Some(Arc::new(cost));
        self
    }

    /// Charges this limit, after the response, the integer at the dotted
    /// `path` (`"usage.total_tokens"`) of the response's JSON body (a
    /// whole number from 0 to 2^53 in the one grammar of a cost: `100`,
    /// `100.0`, `1e2`; see
    /// [`cost_from_request_header`](Self::cost_from_request_header)), read
    /// as the body streams to the client (unchanged, and without waiting
    /// for its end), whatever its chunks, and settled when it ends or is
    /// dropped. A streamed response (`content-type: text/event-stream`,
    /// server-sent events, as a streamed completion is) tells the number
    /// at `path` in the JSON data of the last event that carries one, so
    /// a stream dropped mid-way tells the usage it had sent. A body that
    /// is not JSON, is cut short, is over 1 MiB, compressed (a
    /// `Content-Encoding` other than `identity`: the request forwarded asks
    /// for `Accept-Encoding: identity`), or has no such number there
    /// tells nothing (for an [estimate](Self::settle_estimates): it is
    /// kept; see also [`cost_if_untold`](Self::cost_if_untold)). A path
    /// with an empty segment is a build error
    /// ([`ConfigError::Layer`](crate::ConfigError::Layer)).
    ///
    /// ```
    /// use tower_ratelimit::key::Global;
    /// use tower_ratelimit::layer::{RateLimitLayer, Rule};
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// let tokens = Limit::new("tokens", Quota::per_minute(10_000).sliding_window())?;
    /// let layer = RateLimitLayer::builder()
    ///     .rule(
    ///         Rule::new(tokens, Global)
    ///             .cost_from_request_json("max_tokens") // (with ReadBody around the layer)
    ///             .cost_from_response_json("usage.total_tokens")
    ///             .settle_estimates(0.1),
    ///     )
    ///     .build()?;
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn cost_from_response_json(mut self, path: &str) -> Self {
        self.cost_after.meter = Some(MeterSpec::json_path(path));
        self
    }

    /// Charges this limit, after the response, what `cost` makes of its
    /// whole body (`None`: nothing told), kept up to `max_bytes` as it
    /// streams to the client; a longer body tells nothing, and so does a
    /// compressed one (the request forwarded asks for
    /// `Accept-Encoding: identity`).
    pub fn cost_from_response_body(
        mut self,
        max_bytes: usize,
        cost: impl Fn(&[u8]) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.cost_after.meter = Some(Ok(MeterSpec::Whole {
            max_bytes,
            cost: Arc::new(cost),
        }));
        self
    }
}
