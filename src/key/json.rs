//! Keys and costs read from the JSON body [`ReadBody`](super::ReadBody)
//! read: [`JsonField`] keys by a string field; a rule's cost on arrival is
//! read at a path of it (and written there when absent), all by the one
//! JSON reader of `crate::read`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;

use super::body::BodyRead;
use super::{extract_via_buf, KeyBuf, KeyExtractor, Told};
use crate::read::{JsonPath, Value};

type Normalize = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The key is a string field of a JSON object body (such as the `username`
/// of a login), as read by a [`ReadBody`](super::ReadBody) around the layer: one call keys a
/// rule by it. A body without that field, with it twice (parsers disagree
/// about which one counts), with it not a string, not a JSON object, or not
/// read has no key (the rule's [`MissingKey`](crate::layer::MissingKey)
/// applies). Without a `ReadBody` around the layer, every request has none,
/// and one `warn` line says so.
///
/// Key by the form your handler matches: when it trims and lowercases the
/// name, so must the key ([`normalize`](Self::normalize)), or ` Ann` and
/// `ann` are counted apart for one account. Every distinct value is a key,
/// so limit the senders too (a rule keyed by the client IP).
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::{routing::post, Router};
/// use tower_ratelimit::key::{ClientIp, JsonField, ReadBody};
/// use tower_ratelimit::layer::RateLimitLayer;
/// use tower_ratelimit::{Limit, Quota};
///
/// let logins = Limit::new("login", Quota::per_minute(5).sliding_log())?;
/// let username = JsonField::new("username").normalize(|name| Some(name.trim().to_lowercase()));
/// let limited = RateLimitLayer::builder()
///     .limit(logins, (username, ClientIp::peer()))
///     .build()?;
/// // the handler still reads the whole body
/// let app: Router = Router::new()
///     .route("/login", post(|body: String| async move { body }))
///     .layer(ReadBody::new().max_bytes(4096).around(limited));
/// # }
/// # Ok::<(), tower_ratelimit::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct JsonField {
    field: JsonPath,
    normalize: Option<Normalize>,
    warned: Arc<AtomicBool>,
}

impl std::fmt::Debug for JsonField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("JsonField")
            .field(&self.field.to_string())
            .finish()
    }
}

impl JsonField {
    /// The top-level field `field` of the body's JSON object.
    pub fn new(field: impl Into<String>) -> Self {
        Self {
            field: JsonPath::name(&field.into()),
            normalize: None,
            warned: Arc::default(),
        }
    }

    /// Keys by `normalize(value)` instead of the value; `None` is no key.
    pub fn normalize(
        mut self,
        normalize: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.normalize = Some(Arc::new(normalize));
        self
    }

    /// The field's value in `body`, if it is there once, as a string.
    fn value(&self, body: &[u8]) -> Option<String> {
        if !is_object(body) {
            return None;
        }
        match crate::read::find(body, &self.field)?? {
            Value::String(text) => Some(text),
            _ => None,
        }
    }
}

impl KeyExtractor for JsonField {
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        extract_via_buf(self, parts)
    }

    fn extract_into(&self, parts: &Parts, key: &mut KeyBuf) -> bool {
        let Some(BodyRead(read, _)) = parts.extensions.get::<BodyRead>() else {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    target: "tower_ratelimit",
                    field = %self.field,
                    "JsonField: no body was read, so no request has this key; put \
                     ReadBody around the rate-limit layer (ReadBody::new().around(layer))"
                );
            }
            return false;
        };
        let value = read.as_deref().and_then(|body| self.value(body));
        let value = match &self.normalize {
            Some(normalize) => value.and_then(|value| normalize(&value)),
            None => value,
        };
        value.is_some_and(|value| key.write_str(&value).is_ok())
    }

    /// `JsonField(field)`.
    fn key_kind(&self) -> String {
        format!("JsonField({})", self.field)
    }
}

/// What the dotted `path` of the JSON body [`ReadBody`](super::ReadBody) read tells as a
/// cost ([`Rule::cost_from_request_json`](crate::layer::Rule::cost_from_request_json)):
/// the cost (read as [`cost`](super::cost) says), or absent (the body is a
/// JSON object without the path), or unreadable: the body was not read
/// (no `ReadBody` around the layer: warned once through `warned`; or
/// over its bound, too slow, failed), is no JSON object, gives a name of
/// the path twice, or the value is no cost (`null` included).
pub(crate) fn json_cost(parts: &Parts, path: &JsonPath, warned: &AtomicBool) -> Told {
    let Some(BodyRead(read, _)) = parts.extensions.get::<BodyRead>() else {
        if !warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tower_ratelimit",
                path = %path,
                "cost_from_request_json: no body was read, so no request tells its cost; put \
                 ReadBody around the rate-limit layer (ReadBody::new().around(layer))"
            );
        }
        return Told::Unreadable;
    };
    let Some(body) = read.as_deref().filter(|body| is_object(body)) else {
        return Told::Unreadable;
    };
    match crate::read::find(body, path) {
        Some(None) => Told::Absent,
        Some(Some(Value::Number(number))) => {
            super::cost::of_json(number).map_or(Told::Unreadable, Told::Cost)
        }
        _ => Told::Unreadable,
    }
}

/// Whether `body` starts as a JSON object does (its first byte that is not
/// white space is `{`).
fn is_object(body: &[u8]) -> bool {
    body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

/// Writes the cost at `path` into the JSON object body [`ReadBody`](super::ReadBody) read
/// whole (which [`json_cost`] found without it), so that the body
/// forwarded says the cost charged: `"name":cost` (for a longer path,
/// `"a":{"b":cost}`) right after its opening brace, the rest unchanged byte
/// for byte; `Content-Length`, if the request has one, set to the new
/// length. `false` when there is no such body, or when the body has the
/// first name of a longer path (an object on the way is not written into).
pub(crate) fn write_cost(parts: &mut Parts, path: &JsonPath, cost: u64) -> bool {
    let Some(BodyRead(Some(body), rewrite)) = parts.extensions.get_mut::<BodyRead>() else {
        return false;
    };
    let Some(brace) = body.iter().position(|b| !b.is_ascii_whitespace()) else {
        return false;
    };
    if body[brace] != b'{' {
        return false;
    }
    let names = path.names();
    if names.len() > 1 && crate::read::find(body, &JsonPath::name(&names[0])) != Some(None) {
        return false;
    }
    let Some(field) = nest(names, cost) else {
        return false;
    };
    let empty = body[brace + 1..]
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'}');
    let mut written = Vec::with_capacity(body.len() + field.len() + 1);
    written.extend_from_slice(&body[..=brace]);
    written.extend_from_slice(field.as_bytes());
    if !empty {
        written.push(b',');
    }
    written.extend_from_slice(&body[brace + 1..]);
    let written = Bytes::from(written);
    *crate::sync::lock(rewrite) = Some(written.clone());
    *body = written;
    let length = body.len();
    if parts.headers.contains_key(http::header::CONTENT_LENGTH) {
        parts.headers.insert(
            http::header::CONTENT_LENGTH,
            http::HeaderValue::from(length),
        );
    }
    true
}

/// `"a":{"b":cost}` for the names `a`, `b` (`None` if a name cannot be
/// written as a JSON string).
fn nest(names: &[Box<str>], cost: u64) -> Option<String> {
    let (last, outer) = names.split_last()?;
    let mut field = format!("{}:{cost}", serde_json::to_string(last).ok()?);
    for name in outer.iter().rev() {
        field = format!("{}:{{{field}}}", serde_json::to_string(name).ok()?);
    }
    Some(field)
}
