//! Keys only axum can give: the matched route and its path parameters.

use axum::extract::{FromRequestParts, MatchedPath, RawPathParams};
use http::request::Parts;

use super::{extract_via_buf, KeyBuf, KeyExtractor};

/// The method and matched route, e.g. `GET /users/{id}`: one key per endpoint,
/// whatever the path parameters. Needs axum's `MatchedPath`.
///
/// Named so that it does not clash with `axum::routing::Route`.
#[derive(Debug, Clone, Copy, Default)]
pub struct MatchedRoute;

impl KeyExtractor for MatchedRoute {
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        extract_via_buf(self, parts)
    }

    fn extract_into(&self, parts: &Parts, key: &mut KeyBuf) -> bool {
        let Some(path) = parts.extensions.get::<MatchedPath>() else {
            return false;
        };
        key.extend_from_slice(parts.method.as_str().as_bytes());
        key.push(b' ');
        key.extend_from_slice(path.as_str().as_bytes());
        true
    }

    /// `MatchedRoute`.
    fn key_kind(&self) -> String {
        "MatchedRoute".to_owned()
    }
}

/// One path parameter of the matched route, e.g. `phone` in `/sms/{phone}` or
/// `rest` in `/files/{*rest}`: the value axum captured when it routed the
/// request, percent-decoded by axum.
///
/// The value comes from axum's own path-parameter extraction (what
/// [`axum::extract::RawPathParams`] reads), never from matching the pattern
/// against the URI, so it is right under [`Router::nest`](axum::Router::nest),
/// [`Router::nest_service`](axum::Router::nest_service) (where the inner
/// service sees the URI without the prefix) and routers nested several levels
/// deep. Parameters captured by an outer nest (`/orgs/{org}`) count too; if
/// two levels capture the same name, the innermost value is used.
///
/// The value is the client's text: where several texts stand for one thing
/// (`+1 555 0100` and `+15550100`, `Ann` and `ann`), each would be counted
/// apart. Key such values by a canonical form instead, made by a closure
/// extractor or by a middleware that puts it in the request extensions
/// ([`RequestExtension`](super::RequestExtension)), as the example server does for phone numbers.
///
/// `None` (the layer then applies its
/// [`MissingKey`](crate::layer::MissingKey) policy) when the request was not
/// routed by axum, the route has no such parameter, its value is empty, or a
/// parameter of the route is not valid UTF-8 once decoded (axum refuses to
/// capture such paths). The layer must run after the router that captures
/// the parameter: added with `Router::layer`, `Router::route_layer` or
/// `MethodRouter::layer` on that router or a router nested in it, not
/// wrapped around a `Router` used as a service (which has not routed yet).
#[derive(Debug, Clone)]
pub struct PathParam {
    name: String,
}

impl PathParam {
    /// Reads the parameter `name` (without braces or `*`).
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
        }
    }
}

impl KeyExtractor for PathParam {
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        let params = raw_path_params(parts)?;
        let value = params
            .iter()
            .filter(|(name, _)| *name == self.name)
            .map(|(_, value)| value)
            .last()?;
        (!value.is_empty()).then(|| value.as_bytes().to_vec())
    }

    /// `PathParam(name)`.
    fn key_kind(&self) -> String {
        format!("PathParam({})", self.name)
    }
}

/// The path parameters axum stored in the request extensions when it routed
/// the request (merged across nesting levels), read through
/// [`RawPathParams`]: axum keeps them in a private extension type, so its
/// extractor is the only way in.
///
/// `from_request_parts` needs `&mut Parts`, so it runs on a head holding
/// only a clone of the extensions (cheap: reference-counted values). Its
/// future completes on the first poll (it only reads the extensions); were a
/// later axum to make it wait, this answers `None` rather than block.
fn raw_path_params(parts: &Parts) -> Option<RawPathParams> {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    let (mut head, ()) = http::Request::new(()).into_parts();
    head.extensions = parts.extensions.clone();
    let future = std::pin::pin!(RawPathParams::from_request_parts(&mut head, &()));
    match future.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Ok(params)) => Some(params),
        Poll::Ready(Err(_)) | Poll::Pending => None,
    }
}
