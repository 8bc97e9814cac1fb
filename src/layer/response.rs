//! Rate-limit header fields and the default rejection responses.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::body::{RejectionBody as Body, RejectionResponse as Response};
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use sfv::{Integer, KeyRef, ListSerializer, StringRef};

use crate::{Decision, Verdict};

/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// Legacy `X-RateLimit-Limit`.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// Legacy `X-RateLimit-Remaining`.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// Legacy `X-RateLimit-Reset` (UTC epoch seconds, as GitHub sends it).
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// The problem type of RFC 9457 for an exceeded quota.
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// Whole seconds, rounded up: a positive wait never becomes 0.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Structured-field integers have at most 15 digits.
fn sf_int(n: u64) -> Integer {
    Integer::try_from(n.min(999_999_999_999_999)).unwrap_or(Integer::MAX)
}

/// Which rate-limit header fields to send.
#[derive(Debug, Clone)]
pub(crate) struct HeaderSet {
    pub(crate) ietf: bool,
    pub(crate) legacy: bool,
    /// The layer's `RateLimit-Policy` and the number of limits it lists.
    pub(crate) policy: Option<(usize, HeaderValue)>,
}

impl Default for HeaderSet {
    /// The IETF fields, not the legacy ones, the policy made per response.
    fn default() -> Self {
        Self {
            ietf: true,
            legacy: false,
            policy: None,
        }
    }
}

/// `RateLimit-Policy` for these limits: (name, quota, window) each. The
/// same for every response of a layer that decides all its limits, so the
/// layer computes it once (see [`HeaderSet::policy`]).
pub(crate) fn policy_value<'a>(
    limits: impl Iterator<Item = (&'a str, u64, Duration)>,
) -> Option<HeaderValue> {
    let mut policy = ListSerializer::new();
    for (name, quota, window) in limits {
        // Limit names are validated to [A-Za-z0-9_.-]: always valid strings.
        let Ok(name) = StringRef::from_str(name) else {
            continue;
        };
        policy
            .bare_item(name)
            .parameter(KeyRef::constant("q"), sf_int(quota))
            .parameter(KeyRef::constant("w"), sf_int(ceil_secs(window).max(1)));
    }
    HeaderValue::from_str(&policy.finish()?).ok()
}

/// The one `'static` copy of a header value a layer sends on every
/// response (its `RateLimit-Policy`), made once per distinct value: a
/// response then carries it without touching a reference count shared by
/// every thread. Layers are configuration, and so are their policies.
pub(crate) fn shared_value(value: &HeaderValue) -> HeaderValue {
    match value.to_str() {
        // `from_static` accepts exactly what `to_str` did (visible ASCII and tab)
        Ok(text) => HeaderValue::from_static(crate::limit::intern(text)),
        Err(_) => value.clone(),
    }
}

/// `RateLimit` for these statuses: `"name";r=remaining;t=seconds, ...`, a
/// structured List (RFC 9651) written directly: limit names are validated to
/// `[A-Za-z0-9_.-]`, which a String holds unescaped, and integers are capped
/// at the 15 digits an Integer may have.
fn state_value(decision: &Decision) -> Option<HeaderValue> {
    // On the stack, copied once into the value: one limit always fits (a
    // name has at most 64 bytes, an integer 15 digits), and usually two.
    let mut line = crate::text::StackText::<160>::new();
    if write_state(decision, |text| line.put(text)) {
        return HeaderValue::from_bytes(line.as_bytes()).ok();
    }
    let mut out = Vec::new();
    write_state(decision, |text| {
        out.extend_from_slice(text);
        true
    });
    HeaderValue::from_bytes(&out).ok()
}

/// Writes the `RateLimit` value of `decision` through `put`; `false` as soon
/// as `put` refuses a piece.
#[inline(always)]
fn write_state(decision: &Decision, mut put: impl FnMut(&[u8]) -> bool) -> bool {
    let mut digits = itoa::Buffer::new();
    let cap = |n: u64| n.min(999_999_999_999_999);
    for (i, s) in decision.statuses().iter().enumerate() {
        let written = (i == 0 || put(b", "))
            && put(b"\"")
            && put(s.name().as_bytes())
            && put(b"\";r=")
            && put(digits.format(cap(s.remaining())).as_bytes())
            && put(b";t=")
            && put(digits.format(cap(ceil_secs(s.reset_after()))).as_bytes());
        if !written {
            return false;
        }
    }
    true
}

/// The rate-limit fields of one decision, computed before the request is
/// forwarded (the decision then moves into the request's extensions) and
/// added to the response when it comes back.
#[derive(Debug)]
pub(crate) struct Fields {
    policy: Option<HeaderValue>,
    state: Option<HeaderValue>,
    /// Legacy fields: the binding limit's capacity, remaining and reset.
    legacy: Option<(u64, u64, Duration)>,
}

impl Fields {
    /// The fields describing `decision`, per `set`; `None` when there are none.
    pub(crate) fn of(decision: &Decision, set: &HeaderSet) -> Option<Fields> {
        let mut fields = Fields {
            policy: None,
            state: None,
            legacy: None,
        };
        if set.ietf && !decision.statuses().is_empty() {
            // The layer's policy when the decision covers all its limits (some
            // are skipped for a request without their key).
            fields.policy = match &set.policy {
                Some((limits, value)) if *limits == decision.statuses().len() => {
                    Some(value.clone())
                }
                _ => policy_value(
                    decision
                        .statuses()
                        .iter()
                        .map(|s| (s.name(), s.capacity(), s.window())),
                ),
            };
            fields.state = state_value(decision);
        }
        if set.legacy {
            fields.legacy = decision
                .binding()
                .map(|b| (b.capacity(), b.remaining(), b.reset_after()));
        }
        let empty = fields.policy.is_none() && fields.state.is_none() && fields.legacy.is_none();
        (!empty).then_some(fields)
    }

    /// Adds the fields to `headers`.
    pub(crate) fn apply(self, headers: &mut HeaderMap) {
        // Appended, not replaced: with nested layers each adds its limits, and
        // several lines of a structured List are one List (RFC 9651).
        if let Some(policy) = self.policy {
            headers.append(RATELIMIT_POLICY, policy);
        }
        if let Some(state) = self.state {
            headers.append(RATELIMIT, state);
        }
        if let Some((limit, remaining, reset_after)) = self.legacy {
            // One value each: keep the most restrictive of nested layers.
            let current = headers
                .get(X_RATELIMIT_REMAINING)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            if current.is_none_or(|current| remaining < current) {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                let reset = ceil_secs(now + reset_after);
                headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from(limit));
                headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(remaining));
                headers.insert(X_RATELIMIT_RESET, HeaderValue::from(reset));
            }
        }
    }
}

/// Adds the rate-limit fields describing `decision` to `headers`.
pub(crate) fn insert_headers(headers: &mut HeaderMap, decision: &Decision, set: &HeaderSet) {
    if let Some(fields) = Fields::of(decision, set) {
        fields.apply(headers);
    }
}

/// An RFC 9457 problem details response.
fn problem(
    status: StatusCode,
    kind: &str,
    detail: String,
    extra: Option<(&str, serde_json::Value)>,
) -> http::Response<String> {
    let mut body = serde_json::json!({
        "type": kind,
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    if let (Some((name, value)), Some(map)) = (extra, body.as_object_mut()) {
        map.insert(name.to_owned(), value);
    }
    let mut response = http::Response::new(body.to_string());
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The default 429: a quota-exceeded problem naming the violated limits
/// (`Retry-After` is added by [`insert_retry_after`]).
pub(crate) fn too_many_requests(decision: &Decision) -> http::Response<String> {
    let violated: Vec<&str> = decision.violated_limits().map(|s| s.name()).collect();
    problem(
        StatusCode::TOO_MANY_REQUESTS,
        QUOTA_EXCEEDED,
        refusal_detail(decision, &violated),
        Some(("violated-policies", serde_json::json!(violated))),
    )
}

/// What a refusal says: the violated limits, and the wait unless the cost
/// can never fit.
fn refusal_detail(decision: &Decision, violated: &[&str]) -> String {
    match decision.verdict() {
        Verdict::Denied { retry_after } => {
            format!(
                "Rate limit {} exceeded; retry in {} s.",
                violated.join(", "),
                ceil_secs(retry_after).max(1)
            )
        }
        _ => format!(
            "The request costs more than rate limit {} can ever grant.",
            violated.join(", ")
        ),
    }
}

/// What the layer's 503 says when the store failed: nothing of the error.
const STORE_UNAVAILABLE: &str = "The rate limiter is temporarily unavailable; retry later.";

/// The default 503 of a store that failed, closed: an `about:blank`
/// problem with a generic detail and `Retry-After` (see
/// [`Answers::store_unavailable`]).
pub(crate) fn service_unavailable(retry_after: Duration) -> http::Response<String> {
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "about:blank",
        STORE_UNAVAILABLE.to_owned(),
        None,
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, retry_after_value(retry_after));
    response
}

/// `Retry-After` for a wait: whole seconds, rounded up, at least 1.
fn retry_after_value(wait: Duration) -> HeaderValue {
    HeaderValue::from(ceil_secs(wait).max(1))
}

/// Adds `Retry-After` for a denial, unless already present.
pub(crate) fn insert_retry_after(headers: &mut HeaderMap, decision: &Decision) {
    if let Some(retry) = decision.retry_after() {
        if !headers.contains_key(RETRY_AFTER) {
            headers.insert(RETRY_AFTER, retry_after_value(retry));
        }
    }
}

/// The layer's own answers to one request, in its protocol: HTTP (problem
/// details), or with the `grpc` feature gRPC statuses for a gRPC call.
/// Told from the request head only when the layer answers, so granted
/// requests never pay for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answers {
    Http,
    /// A gRPC call: trailers-only responses with a gRPC status.
    #[cfg(feature = "grpc")]
    Grpc,
}

impl Answers {
    /// The answers a request with this head gets.
    pub(crate) fn to(parts: &http::request::Parts) -> Answers {
        #[cfg(feature = "grpc")]
        if crate::grpc::is_call(&parts.headers) {
            return Answers::Grpc;
        }
        let _ = parts;
        Answers::Http
    }

    /// A refused decision: 429 (see [`too_many_requests`]), or
    /// `RESOURCE_EXHAUSTED` with the wait as `google.rpc.RetryInfo` (none
    /// when the cost can never fit).
    pub(crate) fn refused(self, decision: &Decision) -> Response {
        match self {
            Answers::Http => too_many_requests(decision).map(Body::from),
            #[cfg(feature = "grpc")]
            Answers::Grpc => {
                let violated: Vec<&str> = decision.violated_limits().map(|s| s.name()).collect();
                let detail = refusal_detail(decision, &violated);
                self.answer(
                    StatusCode::TOO_MANY_REQUESTS,
                    detail,
                    decision.retry_after(),
                )
            }
        }
    }

    /// The store failed, closed: 503, or `UNAVAILABLE` with `retry_after`
    /// as `google.rpc.RetryInfo`; `Retry-After` either way, and a generic
    /// detail. The error itself (Redis and Lua messages, addresses) is for
    /// the logs, never for clients.
    pub(crate) fn store_unavailable(self, retry_after: Duration) -> Response {
        match self {
            Answers::Http => service_unavailable(retry_after).map(Body::from),
            #[cfg(feature = "grpc")]
            Answers::Grpc => self.answer(
                StatusCode::SERVICE_UNAVAILABLE,
                STORE_UNAVAILABLE.to_owned(),
                Some(retry_after),
            ),
        }
    }

    /// A request of the deny-list: 403, or `PERMISSION_DENIED`, with a
    /// generic detail.
    pub(crate) fn forbidden(self) -> Response {
        let detail = "The request is not allowed.";
        self.answer(StatusCode::FORBIDDEN, detail.to_owned(), None)
    }

    /// No key for `limit`, refused with `status`: that status, or the gRPC
    /// code corresponding to it (`INVALID_ARGUMENT` for the default 400).
    pub(crate) fn missing_key(self, status: StatusCode, limit: &str) -> Response {
        let detail = format!("The request has no key for rate limit {limit}.");
        self.answer(status, detail, None)
    }

    /// An estimate over what one request may take of `limit`: 400, or
    /// `INVALID_ARGUMENT`.
    ///
    /// 400, not 413 Content Too Large: 413 says the request's content is
    /// larger than the server will read (RFC 9110, 15.5.14), and a server
    /// may close the connection after it; here the content may be small
    /// and well formed, and what is too large is a value it asks for (an
    /// LLM call's `max_tokens`), which the client fixes by asking for less.
    /// That is a request the client must change, 400, as LLM APIs answer
    /// a `max_tokens` over the model's bound. Waiting cannot help either,
    /// so no `Retry-After`.
    pub(crate) fn estimate_too_large(self, limit: &str, estimate: u64, most: u64) -> Response {
        let detail = format!(
            "The request's estimated cost {estimate} is over the {most} one request may take \
             of rate limit {limit}: ask for at most {most}."
        );
        self.answer(StatusCode::BAD_REQUEST, detail, None)
    }

    /// `status` with an `about:blank` problem saying `detail`, or for a gRPC
    /// call the code corresponding to `status`
    /// ([`crate::grpc::code_of`]) with `retry` as
    /// `google.rpc.RetryInfo` ([`crate::grpc::answer`]); with `Retry-After`
    /// when there is a `retry`.
    fn answer(self, status: StatusCode, detail: String, retry: Option<Duration>) -> Response {
        let mut response = match self {
            Answers::Http => problem(status, "about:blank", detail, None).map(Body::from),
            #[cfg(feature = "grpc")]
            Answers::Grpc => {
                let code = crate::grpc::code_of(status);
                crate::grpc::answer(code, detail, retry).map(Body::new)
            }
        };
        if let Some(retry) = retry {
            response
                .headers_mut()
                .insert(RETRY_AFTER, retry_after_value(retry));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_round_up_to_whole_seconds() {
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(2)), 2);
        assert_eq!(ceil_secs(Duration::from_millis(2001)), 3);
        assert_eq!(ceil_secs(Duration::ZERO), 0);
    }

    fn status(name: &'static str, remaining: u64, reset_us: u64) -> crate::LimitStatus {
        crate::LimitStatus {
            name,
            limit: remaining,
            window_us: 1,
            remaining,
            wait_us: 0,
            reset_us,
            algorithm: crate::Algorithm::Gcra,
            violated: false,
            shadow: false,
            would_refuse: false,
            blocked: false,
        }
    }

    /// The value written on the stack and the one written on the heap (more
    /// than fits on the stack) are the same text, RFC 9651's List.
    #[test]
    fn the_ratelimit_value_is_the_same_list_on_the_stack_and_beyond_it() {
        let long: &'static str = "a-name-of-the-longest-length-a-limit-may-have.0123456789_abcdefg";
        assert_eq!(long.len(), 64);
        let big = 10_u64.pow(18);
        for statuses in [
            vec![status("per-ip", 9, 1_500_000)],
            vec![status(long, big, big)],
            vec![status(long, big, big), status("b", 0, 0)],
            // beyond the stack's 160 bytes
            vec![status(long, big, big), status(long, big, big)],
            vec![
                status("a", 1, 1),
                status(long, 7, 8),
                status("c", 2, 2_000_001),
                status(long, 0, 0),
            ],
        ] {
            let expected = statuses
                .iter()
                .map(|s| {
                    let (r, t) = (
                        s.remaining.min(999_999_999_999_999),
                        ceil_secs(s.reset_after()),
                    );
                    format!("\"{}\";r={r};t={}", s.name, t.min(999_999_999_999_999))
                })
                .collect::<Vec<_>>()
                .join(", ");
            let decision = Decision::new(Verdict::Allowed, 0, statuses.into_iter().collect());
            let value = state_value(&decision).expect("a valid value");
            assert_eq!(value.to_str().ok(), Some(expected.as_str()));
            let parsed = sfv::Parser::new(&expected).parse::<sfv::List>();
            assert!(parsed.is_ok(), "{expected}");
        }
    }
}
