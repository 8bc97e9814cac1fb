//! Keys from requests: what a limit counts per. Built-ins for the client IP
//! (behind trusted proxies, IPv6 grouped by prefix), a header (API key), a
//! request extension (a user id set by an auth layer), the matched route and
//! a path parameter (with the `axum` feature), a field of a JSON body
//! ([`JsonField`], read by [`ReadBody`]), one global key, and tuples of
//! those (user id + action).
//!
//! Keys stand in the store's key names, where anyone who can read the
//! store sees them (Redis `SCAN`, `MONITOR`, the slow log, backups): key
//! a limit on API keys, bearer tokens or session cookies by an id of the
//! secret (the key's id or its tenant, set by an auth layer: see
//! [`RequestExtension`]) or by its hash, [`Hashed`]
//! (`Header::new(..).hashed()`), never by the secret itself.
//!
//! An extractor answers `None` when the request has no such key (no header, no
//! peer address); the layer then applies its [`MissingKey`](crate::layer::MissingKey) policy.

#[cfg(feature = "axum")]
mod axum;
mod body;
mod buf;
pub(crate) mod cost;
mod forwarded;
mod hashed;
mod head;
mod ip;
mod json;
mod warnings;

use http::request::Parts;

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use self::axum::{MatchedRoute, PathParam};
pub use self::body::{
    ReadBody, ReadBodyService, ReplayBody, DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY,
};
pub use self::buf::KeyBuf;
pub(crate) use self::cost::Told;
pub use self::hashed::Hashed;
pub use self::head::{Bearer, ClientIp, Global, Header, RequestExtension};
pub use self::ip::{ClientIpResolver, IpConfigError, ProxyHeader};
pub use self::json::JsonField;
pub(crate) use self::json::{json_cost, write_cost};

/// Extracts the key a limit counts per from a request's head.
///
/// Closures `Fn(&Parts) -> Option<String>` are extractors too:
///
/// ```
/// use http::request::Parts;
/// use tower_ratelimit::key::KeyExtractor;
///
/// let tenant = |parts: &Parts| parts.uri.host().map(str::to_owned);
/// let (parts, _) = http::Request::get("http://acme.example/x").body(()).unwrap().into_parts();
/// assert_eq!(tenant.extract(&parts), Some(b"acme.example".to_vec()));
/// ```
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key, or `None` when the request has none. An empty key counts
    /// as none (the layer applies its missing-key policy).
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>>;

    /// Appends the key to `key` and answers `true`, or answers `false` when
    /// the request has none (what is appended then does not matter). The
    /// layer calls this: the default goes through
    /// [`extract`](Self::extract); the crate's own extractors write into
    /// the buffer, which holds a key of up to 48 bytes without allocating.
    fn extract_into(&self, parts: &Parts, key: &mut KeyBuf) -> bool {
        let Some(bytes) = self.extract(parts) else {
            return false;
        };
        key.extend_from_slice(&bytes);
        true
    }

    /// What this extractor reads, such as `Header(x-api-key)` or `ClientIp`:
    /// with the extractor's type, the kind of key it makes.
    ///
    /// Keys are stored per limit name and key text, whatever made the text:
    /// two layers on one store that use one limit name with two kinds of key
    /// share every bucket whose key texts meet (an API key written as
    /// `203.0.113.9/32` drains that IP's bucket). So when a layer is built,
    /// its limits are registered with their kinds of key on the store (and
    /// its clones), and a name that comes back with another kind logs one
    /// `warn` line (target `tower_ratelimit`), once per name: see
    /// [`RateLimitLayerBuilder::build`](crate::layer::RateLimitLayerBuilder::build).
    /// Called once when a [`Rule`](crate::layer::Rule) is made, never per
    /// request.
    ///
    /// Two extractors make the same kind of key when they are of one type
    /// and answer alike here. The default is the type's name, so that every
    /// value of a type is one kind; an extractor whose fields choose what it
    /// reads names them (the crate's `Header` names its header,
    /// `PathParam` its parameter). To share one limit between two ways of
    /// finding the same key on purpose, key both layers with one extractor
    /// type that answers alike for both.
    fn key_kind(&self) -> String {
        std::any::type_name::<Self>().to_owned()
    }

    /// This extractor's keys replaced by a digest of them before they
    /// reach the store: see [`Hashed`], for keys that are secrets (API
    /// keys, tokens).
    fn hashed(self) -> Hashed<Self>
    where
        Self: Sized,
    {
        Hashed::new(self)
    }
}

/// The kind of key an extractor makes: its type and its
/// [`KeyExtractor::key_kind`]. Made once per rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyKind {
    type_id: std::any::TypeId,
    text: String,
}

impl KeyKind {
    /// The kind of key `key` makes.
    pub(crate) fn of<K: KeyExtractor>(key: &K) -> Self {
        Self {
            type_id: std::any::TypeId::of::<K>(),
            text: key.key_kind(),
        }
    }
}

impl std::fmt::Display for KeyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// The kind of key each limit name was first used with by a layer over one
/// store (the store keeps one, see `Shared::one`), to warn (once per name)
/// when a layer keys it another way: both would count in the same buckets
/// wherever their key texts meet. Only consulted when a layer is built.
#[derive(Debug, Default)]
pub(crate) struct KeyKinds {
    first: std::sync::Mutex<std::collections::HashMap<&'static str, (KeyKind, bool)>>,
}

impl KeyKinds {
    /// Records that a layer keys `limit` by `kind`, warning about a name
    /// already keyed by another kind.
    pub(crate) fn register(&self, name: &'static str, kind: &KeyKind) {
        let mut first = crate::sync::lock(&self.first);
        let (first, warned) = first.entry(name).or_insert_with(|| (kind.clone(), false));
        if first != kind && !*warned {
            *warned = true;
            let (first_text, text) = (first.to_string(), kind.to_string());
            let alike = if first_text == text {
                " (two extractor types of that name)"
            } else {
                ""
            };
            tracing::warn!(
                target: "tower_ratelimit",
                limit = name,
                "limit {:?} is keyed two ways on one store, by {} and by {}{}: both count \
                 in the same buckets wherever their key texts meet, so a client can spend \
                 another's (an API key written as an IP address drains that address). Give \
                 each its own limit name, or key both layers with one extractor.",
                name,
                first_text,
                text,
                alike
            );
        }
    }
}

/// `extract` of an extractor whose `extract_into` writes the key itself.
fn extract_via_buf(extractor: &impl KeyExtractor, parts: &Parts) -> Option<Vec<u8>> {
    let mut key = KeyBuf::new();
    extractor
        .extract_into(parts, &mut key)
        .then(|| key.as_bytes().to_vec())
}

impl<F> KeyExtractor for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        self(parts).map(String::into_bytes)
    }
}

/// Appends `part` so that no two different sequences of parts give one key.
fn push_part(out: &mut KeyBuf, part: &[u8]) {
    out.extend_from_slice(itoa::Buffer::new().format(part.len()).as_bytes());
    out.push(b':');
    out.extend_from_slice(part);
}

macro_rules! tuple_extractor {
    ($($name:ident),+) => {
        /// Several keys combined into one (e.g. user id and route); `None`
        /// when any part is missing. Parts are length-prefixed, so distinct
        /// combinations never share a key.
        impl<$($name: KeyExtractor),+> KeyExtractor for ($($name,)+) {
            fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
                extract_via_buf(self, parts)
            }

            #[allow(non_snake_case)]
            fn extract_into(&self, parts: &Parts, key: &mut KeyBuf) -> bool {
                let ($($name,)+) = self;
                let mut part = KeyBuf::new();
                $(
                    part.clear();
                    if !$name.extract_into(parts, &mut part) {
                        return false;
                    }
                    push_part(key, part.as_bytes());
                )+
                true
            }

            /// The parts' kinds, as a tuple: `(Header(x-user), ClientIp)`.
            #[allow(non_snake_case)]
            fn key_kind(&self) -> String {
                let ($($name,)+) = self;
                let kinds = [$($name.key_kind()),+];
                format!("({})", kinds.join(", "))
            }
        }
    };
}

tuple_extractor!(A, B);
tuple_extractor!(A, B, C);
tuple_extractor!(A, B, C, D);

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use http::HeaderName;

    use proptest::prelude::*;

    fn key_of(net: &ipnet::IpNet) -> Vec<u8> {
        let mut key = super::KeyBuf::new();
        super::head::write_net_key(net, &mut key);
        key.as_bytes().to_vec()
    }

    #[test]
    fn the_longest_ipv4_network_fits() {
        let net = ipnet::IpNet::V4(ipnet::Ipv4Net::new([255; 4].into(), 32).expect("prefix"));
        assert_eq!(key_of(&net), b"255.255.255.255/32");
        let net = ipnet::IpNet::V4(ipnet::Ipv4Net::new([0; 4].into(), 0).expect("prefix"));
        assert_eq!(key_of(&net), b"0.0.0.0/0");
    }

    proptest! {
        #[test]
        fn network_keys_are_the_networks_text(a in any::<[u8; 4]>(), len in 0u8..=32, v6 in any::<[u16; 8]>(), len6 in 0u8..=128) {
            let v4 = ipnet::IpNet::V4(ipnet::Ipv4Net::new(a.into(), len).expect("prefix"));
            prop_assert_eq!(key_of(&v4), v4.to_string().into_bytes());
            let v6 = ipnet::IpNet::V6(ipnet::Ipv6Net::new(v6.into(), len6).expect("prefix"));
            prop_assert_eq!(key_of(&v6), v6.to_string().into_bytes());
        }
    }

    use super::*;

    fn parts(req: http::Request<()>) -> Parts {
        req.into_parts().0
    }

    #[test]
    fn built_in_extractors() {
        let mut req = http::Request::get("/sms/%2B1555")
            .header("x-api-key", "k1")
            .body(())
            .unwrap();
        req.extensions_mut()
            .insert(SocketAddr::from(([203, 0, 113, 7], 4242)));
        req.extensions_mut().insert(42u64);
        let p = parts(req);
        assert_eq!(
            ClientIp::peer().extract(&p),
            Some(b"203.0.113.7/32".to_vec())
        );
        assert_eq!(
            Header::new(HeaderName::from_static("x-api-key")).extract(&p),
            Some(b"k1".to_vec())
        );
        assert_eq!(
            Header::new(HeaderName::from_static("x-other")).extract(&p),
            None
        );
        assert_eq!(
            RequestExtension::<u64>::new().extract(&p),
            Some(b"42".to_vec())
        );
        assert_eq!(RequestExtension::<String>::new().extract(&p), None);
        // MatchedRoute and PathParam need axum's MatchedPath: tested through a Router in tests/layer.rs
        #[cfg(feature = "axum")]
        {
            assert_eq!(MatchedRoute.extract(&p), None);
            assert_eq!(PathParam::new("phone").extract(&p), None);
        }
        assert_eq!(Global.extract(&p), Some(b"global".to_vec()));
        assert_eq!(
            (RequestExtension::<u64>::new(), Global).extract(&p),
            Some(b"2:426:global".to_vec())
        );
        assert_eq!(
            (
                RequestExtension::<u64>::new(),
                RequestExtension::<String>::new()
            )
                .extract(&p),
            None
        );
        assert_eq!(
            ClientIp::peer().extract(&parts(http::Request::new(()))),
            None
        );
    }

    #[test]
    fn key_kinds_name_what_is_read() {
        let api_key = Header::new(HeaderName::from_static("x-api-key"));
        assert_eq!(api_key.key_kind(), "Header(x-api-key)");
        assert_eq!(ClientIp::peer().key_kind(), "ClientIp");
        assert_eq!(Global.key_kind(), "Global");
        assert_eq!(
            (RequestExtension::<u64>::new(), api_key.clone()).key_kind(),
            "(RequestExtension<u64>, Header(x-api-key))"
        );
        #[cfg(feature = "axum")]
        {
            assert_eq!(PathParam::new("phone").key_kind(), "PathParam(phone)");
            assert_eq!(MatchedRoute.key_kind(), "MatchedRoute");
        }
        let closure = |_: &Parts| None::<String>;
        assert!(closure.key_kind().contains("{{closure}}"));
        // one type, two headers: two kinds; one type and text: one kind
        let user = Header::new(HeaderName::from_static("x-user"));
        assert_ne!(KeyKind::of(&api_key), KeyKind::of(&user));
        assert_eq!(KeyKind::of(&api_key), KeyKind::of(&api_key.clone()));
        // two closures: two types, whatever their names
        let other = |_: &Parts| None::<String>;
        assert_eq!(closure.key_kind(), other.key_kind());
        assert_ne!(KeyKind::of(&closure), KeyKind::of(&other));
    }

    #[test]
    fn tuples_do_not_collide() {
        let a = |s: &'static str| move |_: &Parts| Some(s.to_owned());
        let p = parts(http::Request::new(()));
        assert_ne!((a("ab"), a("c")).extract(&p), (a("a"), a("bc")).extract(&p));
        assert_ne!(
            (a("1:a"), a("b")).extract(&p),
            (a("1"), a("a1:b")).extract(&p)
        );
    }

    #[test]
    fn ipv6_clients_are_grouped_by_64() {
        let mut req = http::Request::new(());
        req.extensions_mut().insert(SocketAddr::from((
            [0x2001, 0xdb8, 1, 2, 0xaaaa, 1, 2, 3],
            1,
        )));
        assert_eq!(
            ClientIp::peer().extract(&parts(req)),
            Some(b"2001:db8:1:2::/64".to_vec())
        );
    }
}
