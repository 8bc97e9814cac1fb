//! Keys read from the request's head: the client IP ([`ClientIp`]), a
//! header ([`Header`], [`Bearer`]), a request extension
//! ([`RequestExtension`]) and one key for all ([`Global`]).

use std::fmt::Display;
use std::marker::PhantomData;
use std::net::SocketAddr;

#[cfg(feature = "axum")]
use ::axum::extract::ConnectInfo;
use http::request::Parts;
use http::HeaderName;

use super::warnings::Warnings;
use super::{extract_via_buf, ClientIpResolver, KeyBuf, KeyExtractor};

/// The client's IP address, grouped by prefix (IPv6 /64 by default): the TCP
/// peer, or the client behind trusted proxies (see [`ClientIpResolver`]).
///
/// The peer comes from axum's `ConnectInfo<SocketAddr>` (with the `axum`
/// feature; serve with `into_make_service_with_connect_info::<SocketAddr>()`)
/// or a plain `SocketAddr` in the request extensions (what a hyper or tower
/// server without axum inserts itself).
///
/// A request has no key (the rule's [`MissingKey`](crate::layer::MissingKey)
/// policy applies) without a peer address, or when its resolver
/// [requires a forwarded client](ClientIpResolver::require_forwarded_client)
/// and a trusted proxy's request names none.
///
/// # Misconfiguration warnings
///
/// The commonest way a deployed limiter goes wrong is a service behind a
/// load balancer that keys by the balancer's address: every client then
/// shares one limit. `ClientIp` logs one `warn` line (target
/// `tower_ratelimit`, once per extractor, not per request) naming the fix
/// when it sees:
///
/// - a request carrying `X-Forwarded-For` or `Forwarded` from a peer that
///   is not a trusted proxy: trust the proxy with
///   [`ClientIpResolver::trust_proxies`] (unless clients reach the service
///   directly and wrote the header themselves; it is then rightly ignored);
/// - a trusted proxy that sends only the header the resolver does not read:
///   choose it with [`ClientIpResolver::proxy_header`];
/// - a trusted proxy that sends no forwarding header at all (the request
///   counts under the proxy): if every request through it should name its
///   client, use [`ClientIpResolver::require_forwarded_client`];
/// - a request without a peer address: serve with
///   `into_make_service_with_connect_info::<SocketAddr>()`.
#[derive(Debug, Clone, Default)]
pub struct ClientIp {
    resolver: ClientIpResolver,
    warnings: Warnings,
}

impl ClientIp {
    /// The TCP peer's address; forwarding headers are ignored.
    pub fn peer() -> Self {
        Self::default()
    }

    /// The client address as resolved by `resolver` (trusted proxies, grouping).
    pub fn with_resolver(resolver: ClientIpResolver) -> Self {
        Self {
            resolver,
            warnings: Warnings::default(),
        }
    }
}

impl KeyExtractor for ClientIp {
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        extract_via_buf(self, parts)
    }

    fn extract_into(&self, parts: &Parts, key: &mut KeyBuf) -> bool {
        #[cfg(feature = "axum")]
        let connect_info = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(addr)| *addr);
        #[cfg(not(feature = "axum"))]
        let connect_info = None;
        let peer = connect_info.or_else(|| parts.extensions.get::<SocketAddr>().copied());
        let Some(peer) = peer else {
            self.warnings.no_peer();
            return false;
        };
        self.warnings
            .check_forwarding(&self.resolver, peer.ip(), &parts.headers);
        // (no client: a trusted proxy named none, and the resolver
        // requires one)
        let Some(net) = self.resolver.try_client_net(peer.ip(), &parts.headers) else {
            return false;
        };
        write_net_key(&net, key);
        true
    }

    /// `ClientIp`, whatever the resolver: every resolver's keys are client
    /// networks.
    fn key_kind(&self) -> String {
        "ClientIp".to_owned()
    }
}

/// The text of a client network, `203.0.113.7/32` or `2001:db8::/64`: IPv4,
/// nearly every request, written byte by byte on the stack and copied into
/// the key once (the formatting machinery costs more than the rest of the
/// key), IPv6 through its `Display`.
pub(super) fn write_net_key(net: &ipnet::IpNet, out: &mut KeyBuf) {
    match net {
        ipnet::IpNet::V4(v4) => {
            let [a, b, c, d] = v4.addr().octets();
            let mut text = V4Text::new();
            // (the longest network fits: every write succeeds)
            text.decimal(a);
            for octet in [b, c, d] {
                text.push(b'.');
                text.decimal(octet);
            }
            text.push(b'/');
            text.decimal(v4.prefix_len());
            out.extend_from_slice(text.as_bytes());
        }
        ipnet::IpNet::V6(_) => {
            use std::fmt::Write;
            // (writing to a KeyBuf cannot fail)
            let _ = write!(out, "{net}");
        }
    }
}

/// The text of an IPv4 network: at most `255.255.255.255/32`, 18 bytes.
type V4Text = crate::text::StackText<18>;

/// The value of a request header, such as an API key: the key is the
/// value as sent, so for a secret hash it ([`KeyExtractor::hashed`]) or key
/// by its id (see the [module docs](crate::key)).
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
}

impl Header {
    /// Reads the header `name` (the first line when there are several).
    pub fn new(name: HeaderName) -> Self {
        Self { name }
    }
}

impl KeyExtractor for Header {
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        extract_via_buf(self, parts)
    }

    fn extract_into(&self, parts: &Parts, key: &mut KeyBuf) -> bool {
        let Some(value) = parts.headers.get(&self.name).filter(|v| !v.is_empty()) else {
            return false;
        };
        key.extend_from_slice(value.as_bytes());
        true
    }

    /// `Header(name)`.
    fn key_kind(&self) -> String {
        format!("Header({})", self.name)
    }
}

/// The token of an `Authorization: Bearer <token>` header (the scheme in
/// any case, RFC 9110; the token as sent, without the spaces around it):
/// an API key. A token is a secret: key by its hash
/// ([`Bearer.hashed()`](KeyExtractor::hashed)) or by the id it stands for.
/// A request without one, or with another scheme, has no key.
///
/// ```
/// use tower_ratelimit::key::{Bearer, KeyExtractor};
///
/// let request = http::Request::get("/").header("authorization", "bearer sk-123").body(()).unwrap();
/// let (parts, _) = request.into_parts();
/// assert_eq!(Bearer::token(&parts.headers), Some("sk-123"));
/// assert_eq!(Bearer.extract(&parts), Some(b"sk-123".to_vec()));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Bearer;

impl Bearer {
    /// The bearer token of `headers`, if they carry one (the first
    /// `Authorization` line).
    pub fn token(headers: &http::HeaderMap) -> Option<&str> {
        let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
        let (scheme, token) = value.trim().split_once(' ')?;
        let token = token.trim();
        (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
    }
}

impl KeyExtractor for Bearer {
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        extract_via_buf(self, parts)
    }

    fn extract_into(&self, parts: &Parts, key: &mut KeyBuf) -> bool {
        let Some(token) = Self::token(&parts.headers) else {
            return false;
        };
        key.extend_from_slice(token.as_bytes());
        true
    }

    /// `Bearer`.
    fn key_kind(&self) -> String {
        "Bearer".to_owned()
    }
}

/// A value of type `T` that an earlier layer put in the request extensions,
/// such as an authenticated user id; the key is its `Display` form.
///
/// Named so that it does not clash with `axum::Extension` in files that
/// import both.
///
/// ```
/// use tower_ratelimit::key::{KeyExtractor, RequestExtension};
///
/// #[derive(Clone)]
/// struct UserId(u64);
/// impl std::fmt::Display for UserId {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         self.0.fmt(f)
///     }
/// }
///
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(UserId(42));
/// let (parts, ()) = request.into_parts();
/// assert_eq!(RequestExtension::<UserId>::new().extract(&parts), Some(b"42".to_vec()));
/// ```
pub struct RequestExtension<T> {
    _type: PhantomData<fn() -> T>,
}

impl<T> RequestExtension<T> {
    /// Reads the extension of type `T`.
    pub fn new() -> Self {
        Self { _type: PhantomData }
    }
}

impl<T> Default for RequestExtension<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for RequestExtension<T> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<T> std::fmt::Debug for RequestExtension<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RequestExtension<{}>", std::any::type_name::<T>())
    }
}

impl<T: Display + Send + Sync + 'static> KeyExtractor for RequestExtension<T> {
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        parts
            .extensions
            .get::<T>()
            .map(|value| value.to_string().into_bytes())
    }

    /// `RequestExtension<T>`, with `T`'s full path.
    fn key_kind(&self) -> String {
        format!("RequestExtension<{}>", std::any::type_name::<T>())
    }
}

/// The same key for every request: one limit for the whole service.
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract(&self, _: &Parts) -> Option<Vec<u8>> {
        Some(b"global".to_vec())
    }

    fn extract_into(&self, _: &Parts, key: &mut KeyBuf) -> bool {
        key.extend_from_slice(b"global");
        true
    }

    /// `Global`.
    fn key_kind(&self) -> String {
        "Global".to_owned()
    }
}
