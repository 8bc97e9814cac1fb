//! gRPC responses (feature `grpc`): the layer's refusals as gRPC statuses
//! in a trailers-only response, for requests that are gRPC calls. The
//! layer (`layer/response.rs`, its `Protocol`) chooses them per request and
//! boxes their bodies.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// Whether a request is a gRPC call: its `content-type` is
/// `application/grpc`, or `application/grpc+proto`, `application/grpc;...`
/// (the gRPC over HTTP/2 specification's forms). `application/grpc-web` is
/// not a gRPC call: its statuses travel in the body, not in trailers.
pub(crate) fn is_call(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(CONTENT_TYPE) else {
        return false;
    };
    let value = value.as_bytes();
    let prefix = b"application/grpc";
    value.len() >= prefix.len()
        && value[..prefix.len()].eq_ignore_ascii_case(prefix)
        && matches!(value.get(prefix.len()), None | Some(b'+' | b';'))
}

/// A trailers-only response: HTTP 200, `content-type: application/grpc`,
/// `grpc-status`, `grpc-message` (percent-encoded) and, when there is a
/// delay, `grpc-status-details-bin` (base64 without padding) holding a
/// `google.rpc.Status` whose details carry `google.rpc.RetryInfo`, and
/// `cache-control: no-store`, as every HTTP refusal of the layer (a proxy
/// or cache must not answer a later call with it). The body is empty, so
/// the headers end the stream.
pub(crate) fn trailers_only(
    code: Code,
    message: String,
    retry: Option<Duration>,
) -> Response<Full<Bytes>> {
    let status = match retry {
        Some(delay) => {
            Status::with_error_details(code, message, ErrorDetails::with_retry_info(Some(delay)))
        }
        None => Status::new(code, message),
    };
    let mut response = Response::new(Full::new(Bytes::new()));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    // Writes only what is valid in a header: the message is percent-encoded,
    // the details base64. A failure would leave `grpc-status` out: none then.
    if status.add_header(headers).is_err() {
        headers.insert("grpc-status", HeaderValue::from(code as i32));
    }
    response
}

/// The gRPC code of a layer's response with HTTP `status`, after the
/// correspondence of HTTP statuses and gRPC codes that gRPC documents:
/// 401 is `UNAUTHENTICATED`, 403 `PERMISSION_DENIED`, 404 `NOT_FOUND`, 429
/// `RESOURCE_EXHAUSTED`, 503 `UNAVAILABLE`; any other status
/// `INVALID_ARGUMENT`. So a refusal is `RESOURCE_EXHAUSTED`, a failed store
/// `UNAVAILABLE`, the deny-list `PERMISSION_DENIED`, an estimate too large
/// (400) `INVALID_ARGUMENT`, and a missing key
/// ([`MissingKey::Reject`](crate::layer::MissingKey::Reject)) the code of
/// its status (`INVALID_ARGUMENT` for the default 400: the call lacks what
/// the rule keys on).
pub(crate) fn code_of(status: StatusCode) -> Code {
    match status {
        StatusCode::UNAUTHORIZED => Code::Unauthenticated,
        StatusCode::FORBIDDEN => Code::PermissionDenied,
        StatusCode::NOT_FOUND => Code::NotFound,
        StatusCode::TOO_MANY_REQUESTS => Code::ResourceExhausted,
        StatusCode::SERVICE_UNAVAILABLE => Code::Unavailable,
        _ => Code::InvalidArgument,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_type(value: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(value));
        headers
    }

    #[test]
    fn grpc_calls_are_told_by_their_content_type() {
        for grpc in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc+json",
            "Application/GRPC",
            "application/grpc;charset=utf-8",
        ] {
            assert!(is_call(&with_type(grpc)), "{grpc}");
        }
        for other in [
            "application/json",
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grp",
            "text/application/grpc",
        ] {
            assert!(!is_call(&with_type(other)), "{other}");
        }
        assert!(!is_call(&HeaderMap::new()));
    }

    #[test]
    fn a_response_is_trailers_only_with_the_status_and_its_delay() {
        let response = trailers_only(
            Code::ResourceExhausted,
            "Rate limit a exceeded; retry in 2 s.".to_owned(),
            Some(Duration::from_millis(1500)),
        );
        assert_eq!(response.status(), StatusCode::OK);
        let headers = response.headers();
        assert_eq!(headers[CONTENT_TYPE], "application/grpc");
        assert_eq!(headers[CACHE_CONTROL], "no-store");
        assert_eq!(headers["grpc-status"], "8");
        // percent-encoded, as gRPC requires
        assert_eq!(
            headers["grpc-message"],
            "Rate%20limit%20a%20exceeded;%20retry%20in%202%20s."
        );
        let details = headers["grpc-status-details-bin"].as_bytes();
        assert!(!details.ends_with(b"="), "no padding");
        let status = Status::from_header_map(headers).expect("a status");
        assert_eq!(status.code(), Code::ResourceExhausted);
        let retry = status.get_details_retry_info().expect("RetryInfo");
        assert_eq!(retry.retry_delay, Some(Duration::from_millis(1500)));
        assert!(http_body::Body::is_end_stream(response.body()));

        let plain = trailers_only(Code::InvalidArgument, "no key".to_owned(), None);
        assert_eq!(plain.headers()["grpc-status"], "3");
        assert!(!plain.headers().contains_key("grpc-status-details-bin"));
    }

    #[test]
    fn missing_keys_map_to_the_documented_codes() {
        assert_eq!(code_of(StatusCode::BAD_REQUEST), Code::InvalidArgument);
        assert_eq!(code_of(StatusCode::UNAUTHORIZED), Code::Unauthenticated);
        assert_eq!(code_of(StatusCode::FORBIDDEN), Code::PermissionDenied);
        assert_eq!(
            code_of(StatusCode::UNPROCESSABLE_ENTITY),
            Code::InvalidArgument
        );
    }
}
