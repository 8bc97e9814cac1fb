//! The layer's default rejection responses, in the protocol of the request
//! (the rate-limit fields themselves are `crate::fields`).

use std::time::Duration;

use super::body::{RejectionBody as Body, RejectionResponse as Response};
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, StatusCode};

use crate::fields::{ceil_secs, HeaderSet};
use crate::{Decision, Verdict};

/// The problem type of RFC 9457 for an exceeded quota.
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

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

/// Adds the rate-limit fields of `shown` (a decision without its shadow
/// limits) to `headers`, per `set`.
pub(crate) fn insert_headers(headers: &mut HeaderMap, shown: &Decision, set: &HeaderSet) {
    if let Some(fields) = shown.fields(set) {
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
/// [`Protocol::store_unavailable`]).
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

/// The protocol of one request, in which the layer's own responses to it
/// are written: HTTP (problem details), or with the `grpc` feature gRPC
/// statuses for a gRPC call. Told from the request head only when the
/// layer responds itself, so granted requests never pay for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    Http,
    /// A gRPC call: trailers-only responses with a gRPC status.
    #[cfg(feature = "grpc")]
    Grpc,
}

impl Protocol {
    /// The protocol of a request with this head.
    pub(crate) fn of(parts: &http::request::Parts) -> Protocol {
        #[cfg(feature = "grpc")]
        if crate::grpc::is_call(&parts.headers) {
            return Protocol::Grpc;
        }
        let _ = parts;
        Protocol::Http
    }

    /// A refused decision: 429 (see [`too_many_requests`]), or
    /// `RESOURCE_EXHAUSTED` with the wait as `google.rpc.RetryInfo` (none
    /// when the cost can never fit).
    pub(crate) fn refused(self, decision: &Decision) -> Response {
        match self {
            Protocol::Http => too_many_requests(decision).map(Body::from),
            #[cfg(feature = "grpc")]
            Protocol::Grpc => {
                let violated: Vec<&str> = decision.violated_limits().map(|s| s.name()).collect();
                let detail = refusal_detail(decision, &violated);
                self.response(
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
            Protocol::Http => service_unavailable(retry_after).map(Body::from),
            #[cfg(feature = "grpc")]
            Protocol::Grpc => self.response(
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
        self.response(StatusCode::FORBIDDEN, detail.to_owned(), None)
    }

    /// No key for `limit`, refused with `status`: that status, or the gRPC
    /// code corresponding to it (`INVALID_ARGUMENT` for the default 400).
    pub(crate) fn missing_key(self, status: StatusCode, limit: &str) -> Response {
        let detail = format!("The request has no key for rate limit {limit}.");
        self.response(status, detail, None)
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
        self.response(StatusCode::BAD_REQUEST, detail, None)
    }

    /// An estimate for `limit` that cannot be read unambiguously: 400, or
    /// `INVALID_ARGUMENT` (the client must send one that can).
    pub(crate) fn estimate_unreadable(self, limit: &str) -> Response {
        let detail = format!(
            "The request's estimated cost for rate limit {limit} cannot be read: send it once, \
             as a whole number from 1 to the most one request may take."
        );
        self.response(StatusCode::BAD_REQUEST, detail, None)
    }

    /// `status` with an `about:blank` problem saying `detail`, or for a gRPC
    /// call the code corresponding to `status`
    /// ([`crate::grpc::code_of`]) with `retry` as
    /// `google.rpc.RetryInfo` ([`crate::grpc::trailers_only`]); with `Retry-After`
    /// when there is a `retry`.
    fn response(self, status: StatusCode, detail: String, retry: Option<Duration>) -> Response {
        let mut response = match self {
            Protocol::Http => problem(status, "about:blank", detail, None).map(Body::from),
            #[cfg(feature = "grpc")]
            Protocol::Grpc => {
                let code = crate::grpc::code_of(status);
                crate::grpc::trailers_only(code, detail, retry).map(Body::new)
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
