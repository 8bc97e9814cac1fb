//! Client IP resolution behind reverse proxies, and grouping of addresses
//! into rate-limit keys.
//!
//! See [`ClientIpResolver`] for the resolution rules.

use std::fmt;
use std::net::IpAddr;

use std::ops::ControlFlow;

use http::header::HeaderMap;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::forwarded::{self, Hop};

/// The most hops examined, counted from the right end of the list.
const MAX_HOPS: usize = 32;

const DEFAULT_IPV4_PREFIX: u8 = 32;
const DEFAULT_IPV6_PREFIX: u8 = 64;

/// Decides the client address of a request, and groups addresses into
/// rate-limit keys.
///
/// By default no proxy is trusted, IPv4 addresses are keyed individually
/// (`/32`) and IPv6 addresses by their `/64` (the usual size of one
/// subscriber's allocation, so rotating through it does not escape a limit).
/// # Rules
///
/// 1. IPv4-mapped IPv6 addresses (`::ffff:192.0.2.1`) are turned into plain
///    IPv4 everywhere (peer, header entries, trusted ranges, grouping) before
///    any check.
/// 2. If the peer is not in a trusted range, headers are ignored and the peer
///    is the client.
/// 3. Otherwise the hop list is taken from the one header chosen with
///    [`ClientIpResolver::proxy_header`]: `X-Forwarded-For` by default, or
///    `Forwarded` (RFC 7239); the other is never read. All lines of the
///    chosen header are read, in order, as one list. The list is walked from
///    the right: trusted entries are skipped, and the first untrusted entry is
///    the client. When an entry cannot be used (not an address, `unknown`, an
///    obfuscated `_identifier`, an empty entry, a `Forwarded` element without
///    exactly one `for=`, a malformed element, or a line that is not UTF-8),
///    the walk stops and the last trusted hop seen is returned: nothing left
///    of such an entry is believed, and the entry itself never becomes a key.
///    If every entry is trusted, the leftmost one is returned.
///    With [`require_forwarded_client`](ClientIpResolver::require_forwarded_client),
///    such a request (no header, an empty one, only trusted entries, or an
///    unusable entry before any untrusted one) has no client address
///    instead: [`ClientIp`](super::ClientIp) gives it no key, and the rule's
///    [`MissingKey`](crate::layer::MissingKey) policy applies.
/// 4. `X-Forwarded-For` entries may be `192.0.2.1`, `192.0.2.1:8080`,
///    `2001:db8::1`, `[2001:db8::1]` or `[2001:db8::1]:443`. In `Forwarded`,
///    only `for=` matters; IPv6 must be quoted and bracketed
///    (`for="[2001:db8::1]:4711"`), IPv4 may be bare or quoted, with an
///    optional (possibly obfuscated) port.
/// 5. At most the 32 rightmost entries are examined. If all of them are
///    trusted, the walk stops there as it does at an unusable entry, and the
///    last (leftmost examined) trusted hop is returned. Lines are parsed from
///    their end, only as far as the walk goes, with fixed-size buffers:
///    resolving an address never allocates. `Forwarded` elements are cut at
///    the commas outside quoted strings, so a malformed element (an
///    unterminated quote included) is garbage on its own and cannot swallow
///    the elements to its right.
///
/// # Deployment caveat
///
/// Every trusted proxy must append to (or replace) the header it maintains
/// rather than pass a client's copy through untouched, and only the addresses
/// of proxies that do so may be trusted. Otherwise a client can write the list
/// that is read.
///
/// # Example
///
/// ```
/// use std::net::IpAddr;
///
/// use http::HeaderMap;
/// use tower_ratelimit::key::ClientIpResolver;
///
/// let resolver = ClientIpResolver::new()
///     .trust_proxies(["10.0.0.0/8", "::1"])?
///     .ipv6_prefix(56)?;
///
/// // The request reached us through two of our proxies.
/// let mut headers = HeaderMap::new();
/// headers.insert("x-forwarded-for", "6.6.6.6, 203.0.113.7, 10.0.0.2".parse()?);
/// let peer: IpAddr = "10.0.0.1".parse()?;
/// let client = resolver.client_ip(peer, &headers);
/// assert_eq!(client, "203.0.113.7".parse::<IpAddr>()?);
///
/// // A peer we do not trust cannot choose its address.
/// let peer: IpAddr = "198.51.100.9".parse()?;
/// assert_eq!(resolver.client_ip(peer, &headers), peer);
///
/// // IPv6 clients are grouped by prefix.
/// let peer: IpAddr = "2001:db8:1:2ff::1".parse()?;
/// let key = resolver.client_net(peer, &HeaderMap::new());
/// assert_eq!(key.to_string(), "2001:db8:1:200::/56");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct ClientIpResolver {
    trusted: Vec<IpNet>,
    ipv4_prefix: u8,
    ipv6_prefix: u8,
    header: ProxyHeader,
    /// A trusted peer's request must name an untrusted client.
    require_client: bool,
}

/// The header your trusted proxies maintain. Only that one is read: a proxy
/// that appends to `X-Forwarded-For` usually passes a client's `Forwarded`
/// through untouched, so reading both would let the client choose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProxyHeader {
    /// `X-Forwarded-For` (nginx, HAProxy, AWS ALB, most CDNs). The default.
    #[default]
    XForwardedFor,
    /// `Forwarded` (RFC 7239), `for=` parameters only.
    Forwarded,
}

/// Error for an invalid [`ClientIpResolver`] configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum IpConfigError {
    /// A trusted proxy range did not parse as an IP address or CIDR.
    InvalidCidr(String),
    /// A grouping prefix is longer than the address family allows
    /// (IPv4: `0..=32`, IPv6: `0..=128`).
    InvalidPrefix {
        /// `"IPv4"` or `"IPv6"`.
        family: &'static str,
        /// The rejected prefix length.
        len: u8,
    },
}

impl fmt::Display for IpConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IpConfigError::InvalidCidr(s) => write!(
                f,
                "invalid trusted proxy range {s:?}: expected an IP address or a CIDR such as \"10.0.0.0/8\""
            ),
            IpConfigError::InvalidPrefix { family, len } => write!(
                f,
                "invalid {family} grouping prefix /{len}: it must be between 0 and {}",
                max_prefix(family)
            ),
        }
    }
}

impl std::error::Error for IpConfigError {}

impl ClientIpResolver {
    /// Creates a resolver that trusts no proxy: the peer address is the
    /// client. IPv4 is grouped at `/32`, IPv6 at `/64`.
    pub fn new() -> Self {
        ClientIpResolver {
            trusted: Vec::new(),
            ipv4_prefix: DEFAULT_IPV4_PREFIX,
            ipv6_prefix: DEFAULT_IPV6_PREFIX,
            header: ProxyHeader::XForwardedFor,
            require_client: false,
        }
    }

    /// A request from a trusted proxy whose forwarding header names no
    /// untrusted client (no header at all, an empty one, only trusted
    /// entries, or an unusable entry before any untrusted one) has no
    /// client address, instead of the proxy's: [`ClientIp`](super::ClientIp)
    /// gives it no key, so the rule's [`MissingKey`](crate::layer::MissingKey)
    /// policy applies (400 by default, or one shared limit with
    /// `MissingKey::Shared`, or no limit with `MissingKey::Skip`), and the
    /// clients of a proxy that forgot the header never share its one limit.
    /// A peer that is not a trusted proxy is still the client.
    ///
    /// Opt-in: without it such a request counts under the last trusted hop
    /// (the proxy), as it always has, so that health checks and internal
    /// callers on a trusted address keep working after an upgrade. Choose it
    /// when every request through a trusted address really comes from a
    /// proxy that writes the header.
    ///
    /// ```
    /// use std::net::IpAddr;
    ///
    /// use http::HeaderMap;
    /// use tower_ratelimit::key::ClientIpResolver;
    ///
    /// let resolver = ClientIpResolver::new()
    ///     .trust_proxies(["10.0.0.0/8"])?
    ///     .require_forwarded_client();
    /// let proxy: IpAddr = "10.0.0.1".parse()?;
    /// // the proxy sent no X-Forwarded-For: no client, so no key
    /// assert_eq!(resolver.try_client_ip(proxy, &HeaderMap::new()), None);
    /// let mut headers = HeaderMap::new();
    /// headers.insert("x-forwarded-for", "203.0.113.7".parse()?);
    /// assert_eq!(resolver.try_client_ip(proxy, &headers), Some("203.0.113.7".parse()?));
    /// // an untrusted peer is the client, header or not
    /// let peer: IpAddr = "198.51.100.9".parse()?;
    /// assert_eq!(resolver.try_client_ip(peer, &HeaderMap::new()), Some(peer));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn require_forwarded_client(mut self) -> Self {
        self.require_client = true;
        self
    }

    /// Chooses the header the trusted proxies maintain (default
    /// [`ProxyHeader::XForwardedFor`]); the other one is ignored.
    pub fn proxy_header(mut self, header: ProxyHeader) -> Self {
        self.header = header;
        self
    }

    /// Adds trusted proxy ranges, such as `["10.0.0.0/8", "::1",
    /// "192.168.1.7"]`.
    ///
    /// A bare address means that single address (`/32` or `/128`).
    /// Surrounding whitespace is ignored, host bits after the prefix are
    /// cleared, and IPv4-mapped IPv6 ranges of `/96` or longer
    /// (`::ffff:10.0.0.0/104`) are stored as the IPv4 range they cover.
    /// Ranges are added to those already trusted.
    ///
    /// # Errors
    ///
    /// [`IpConfigError::InvalidCidr`] with the first string that is neither an
    /// address nor a CIDR (zone ids such as `fe80::1%eth0` are rejected).
    pub fn trust_proxies<I, S>(mut self, cidrs: I) -> Result<Self, IpConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        for cidr in cidrs {
            let text = cidr.as_ref();
            let net =
                parse_trusted(text).ok_or_else(|| IpConfigError::InvalidCidr(text.to_owned()))?;
            self.trusted.push(net);
        }
        Ok(self)
    }

    /// Adds already-parsed trusted proxy ranges, normalised as in
    /// [`trust_proxies`](Self::trust_proxies).
    pub fn trust_nets(mut self, nets: impl IntoIterator<Item = IpNet>) -> Self {
        self.trusted.extend(nets.into_iter().map(normalise_net));
        self
    }

    /// Sets the IPv6 grouping prefix (default 64; 128 keys each address
    /// separately).
    ///
    /// # Errors
    ///
    /// [`IpConfigError::InvalidPrefix`] if `len` is greater than 128.
    pub fn ipv6_prefix(mut self, len: u8) -> Result<Self, IpConfigError> {
        self.ipv6_prefix = checked_prefix("IPv6", len)?;
        Ok(self)
    }

    /// Sets the IPv4 grouping prefix (default 32, one key per address).
    ///
    /// # Errors
    ///
    /// [`IpConfigError::InvalidPrefix`] if `len` is greater than 32.
    pub fn ipv4_prefix(mut self, len: u8) -> Result<Self, IpConfigError> {
        self.ipv4_prefix = checked_prefix("IPv4", len)?;
        Ok(self)
    }

    /// Returns the client address of a request whose TCP peer is `peer`.
    ///
    /// The result is always either the (normalised) peer or an address that
    /// appears in the request's `Forwarded` or `X-Forwarded-For` headers. See
    /// the [rules](ClientIpResolver#rules). Never panics and never allocates.
    ///
    /// A request that names no untrusted client gets the last trusted hop,
    /// even with [`require_forwarded_client`](Self::require_forwarded_client):
    /// [`try_client_ip`](Self::try_client_ip) tells that case apart.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        self.walk(peer, headers)
            .unwrap_or_else(|last_trusted| last_trusted)
    }

    /// The client address as [`client_ip`](Self::client_ip) finds it, or
    /// `None` when the resolver
    /// [requires a forwarded client](Self::require_forwarded_client) and a
    /// trusted peer's request names none. Never panics and never allocates.
    #[inline]
    pub fn try_client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> Option<IpAddr> {
        match self.walk(peer, headers) {
            Ok(client) => Some(client),
            Err(_) if self.require_client => None,
            Err(last_trusted) => Some(last_trusted),
        }
    }

    /// The client: the untrusted peer, or the rightmost untrusted hop of a
    /// trusted peer's header; `Err` with the last trusted hop when the walk
    /// ends without an untrusted one.
    #[inline]
    fn walk(&self, peer: IpAddr, headers: &HeaderMap) -> Result<IpAddr, IpAddr> {
        let peer = peer.to_canonical();
        if !self.is_trusted(peer) {
            return Ok(peer);
        }

        // Walk from the right. Running out of hops (all trusted, or the cap
        // reached) and meeting garbage both end at the last trusted hop.
        let (mut last_trusted, mut client, mut seen) = (peer, None, 0);
        let visit = |hop: Hop| {
            if seen == MAX_HOPS {
                return ControlFlow::Break(());
            }
            seen += 1;
            match hop {
                Hop::Addr(ip) if self.is_trusted(ip) => {
                    last_trusted = ip;
                    ControlFlow::Continue(())
                }
                Hop::Addr(ip) => {
                    client = Some(ip);
                    ControlFlow::Break(())
                }
                Hop::Garbage => ControlFlow::Break(()),
            }
        };
        match self.header {
            ProxyHeader::Forwarded => forwarded::forwarded_from_right(headers, visit),
            ProxyHeader::XForwardedFor => forwarded::x_forwarded_for_from_right(headers, visit),
        }
        client.ok_or(last_trusted)
    }

    /// Returns the client address (see [`client_ip`](Self::client_ip))
    /// grouped by the configured prefix, e.g. `2001:db8:1:2:aa::1` becomes
    /// `2001:db8:1:2::/64`.
    pub fn client_net(&self, peer: IpAddr, headers: &HeaderMap) -> IpNet {
        self.group(self.client_ip(peer, headers))
    }

    /// [`try_client_ip`](Self::try_client_ip), grouped by the configured
    /// prefix: what [`ClientIp`](super::ClientIp) keys by.
    #[inline]
    pub fn try_client_net(&self, peer: IpAddr, headers: &HeaderMap) -> Option<IpNet> {
        self.try_client_ip(peer, headers).map(|ip| self.group(ip))
    }

    /// Groups `ip` by the configured prefix, after turning an IPv4-mapped
    /// IPv6 address into IPv4. The result has its host bits cleared.
    pub fn group(&self, ip: IpAddr) -> IpNet {
        match ip.to_canonical() {
            IpAddr::V4(v4) => match Ipv4Net::new(v4, self.ipv4_prefix) {
                Ok(net) => IpNet::V4(net.trunc()),
                // Unreachable: the prefix is validated when it is set.
                Err(_) => IpNet::from(IpAddr::V4(v4)),
            },
            IpAddr::V6(v6) => match Ipv6Net::new(v6, self.ipv6_prefix) {
                Ok(net) => IpNet::V6(net.trunc()),
                Err(_) => IpNet::from(IpAddr::V6(v6)),
            },
        }
    }

    /// The header the trusted proxies are believed to maintain.
    pub(crate) fn header(&self) -> ProxyHeader {
        self.header
    }

    /// Whether a trusted peer's request must name its client
    /// ([`require_forwarded_client`](Self::require_forwarded_client)).
    pub(crate) fn requires_client(&self) -> bool {
        self.require_client
    }

    /// Returns whether `ip` (IPv4-mapped addresses as IPv4) falls in a
    /// trusted range.
    pub fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.trusted.iter().any(|net| net.contains(&ip))
    }
}

impl Default for ClientIpResolver {
    fn default() -> Self {
        Self::new()
    }
}

/// The longest prefix of an address of `family` ("IPv4" or "IPv6").
fn max_prefix(family: &str) -> u8 {
    if family == "IPv4" {
        32
    } else {
        128
    }
}

/// `len`, if a prefix of an address of `family` can be that long.
fn checked_prefix(family: &'static str, len: u8) -> Result<u8, IpConfigError> {
    if len > max_prefix(family) {
        return Err(IpConfigError::InvalidPrefix { family, len });
    }
    Ok(len)
}

/// Parses a trusted range: a CIDR or a bare address.
fn parse_trusted(text: &str) -> Option<IpNet> {
    let text = text.trim();
    let net = match text.parse::<IpNet>() {
        Ok(net) => net,
        Err(_) => IpNet::from(text.parse::<IpAddr>().ok()?),
    };
    Some(normalise_net(net))
}

/// Clears host bits, and turns an IPv4-mapped IPv6 range into IPv4.
fn normalise_net(net: IpNet) -> IpNet {
    let net = net.trunc();
    let as_v4 = match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => v6
            .network()
            .to_ipv4_mapped()
            .and_then(|v4| Ipv4Net::new(v4, v6.prefix_len() - 96).ok()),
        _ => None,
    };
    as_v4.map_or(net, IpNet::V4)
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::net::Ipv4Addr;

    use http::header::{self, HeaderName, HeaderValue};

    use crate::key::forwarded::parse_xff_entry;

    const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    fn xff(values: &[&str]) -> HeaderMap {
        let pairs: Vec<_> = values.iter().map(|v| ("x-forwarded-for", *v)).collect();
        headers(&pairs)
    }

    fn fwd(values: &[&str]) -> HeaderMap {
        let pairs: Vec<_> = values.iter().map(|v| ("forwarded", *v)).collect();
        headers(&pairs)
    }

    /// Trusts 10.0.0.0/8, 192.168.1.7 and ::1.
    fn resolver() -> ClientIpResolver {
        ClientIpResolver::new()
            .trust_proxies(["10.0.0.0/8", "192.168.1.7", "::1"])
            .unwrap()
    }

    const PROXY: &str = "10.0.0.1";

    /// Reads `Forwarded` when the request has one, else `X-Forwarded-For`.
    fn via_proxy(h: &HeaderMap) -> IpAddr {
        let header = if h.contains_key("forwarded") {
            ProxyHeader::Forwarded
        } else {
            ProxyHeader::XForwardedFor
        };
        resolver().proxy_header(header).client_ip(ip(PROXY), h)
    }

    // --- Rule 2: untrusted peer -------------------------------------------

    #[test]
    fn untrusted_peer_ignores_spoofed_xff() {
        let h = xff(&["1.2.3.4"]);
        assert_eq!(resolver().client_ip(ip("8.8.8.8"), &h), ip("8.8.8.8"));
    }

    #[test]
    fn untrusted_peer_ignores_spoofed_forwarded() {
        let h = fwd(&["for=1.2.3.4"]);
        assert_eq!(resolver().client_ip(ip("8.8.8.8"), &h), ip("8.8.8.8"));
    }

    #[test]
    fn default_trusts_nobody() {
        let h = xff(&["1.2.3.4"]);
        let r = ClientIpResolver::default();
        assert_eq!(r.client_ip(ip("10.0.0.1"), &h), ip("10.0.0.1"));
        assert_eq!(r.client_ip(ip("::1"), &h), ip("::1"));
        assert!(!r.is_trusted(ip("127.0.0.1")));
    }

    #[test]
    fn trusted_peer_without_headers_is_client() {
        assert_eq!(via_proxy(&HeaderMap::new()), ip(PROXY));
    }

    #[test]
    fn a_required_client_is_never_a_trusted_hop() {
        let strict = resolver().require_forwarded_client();
        let proxy = ip(PROXY);
        // a trusted proxy that names no untrusted client: none
        for h in [
            HeaderMap::new(),
            xff(&[""]),
            xff(&["10.0.0.2, 10.0.0.3"]),
            xff(&["203.0.113.7, nonsense"]),
            fwd(&["for=203.0.113.7"]), // not the header it reads
        ] {
            assert_eq!(strict.try_client_ip(proxy, &h), None, "{h:?}");
            assert_eq!(strict.try_client_net(proxy, &h), None, "{h:?}");
            // client_ip still answers the last trusted hop
            assert!(strict.is_trusted(strict.client_ip(proxy, &h)), "{h:?}");
            // and without the requirement, so does try_client_ip
            assert_eq!(
                resolver().try_client_ip(proxy, &h),
                Some(resolver().client_ip(proxy, &h))
            );
        }
        // the client it names
        let h = xff(&["6.6.6.6, 203.0.113.7, 10.0.0.2"]);
        assert_eq!(strict.try_client_ip(proxy, &h), Some(ip("203.0.113.7")));
        let h = fwd(&["for=203.0.113.7"]);
        let strict_fwd = strict.clone().proxy_header(ProxyHeader::Forwarded);
        assert_eq!(strict_fwd.try_client_ip(proxy, &h), Some(ip("203.0.113.7")));
        // an untrusted peer is the client, whatever it sends
        for h in [HeaderMap::new(), xff(&["1.2.3.4"])] {
            assert_eq!(
                strict.try_client_ip(ip("198.51.100.9"), &h),
                Some(ip("198.51.100.9"))
            );
        }
    }

    // --- Rule 3: walking the list -------------------------------------------

    #[test]
    fn rightmost_untrusted_wins() {
        assert_eq!(via_proxy(&xff(&["6.6.6.6, 1.2.3.4"])), ip("1.2.3.4"));
    }

    #[test]
    fn trusted_hops_are_skipped() {
        let h = xff(&["1.2.3.4, 10.0.0.2, 10.0.0.3"]);
        assert_eq!(via_proxy(&h), ip("1.2.3.4"));
        let h = xff(&["6.6.6.6, 1.2.3.4, 192.168.1.7, ::1, 10.9.9.9"]);
        assert_eq!(via_proxy(&h), ip("1.2.3.4"));
    }

    #[test]
    fn all_trusted_gives_leftmost() {
        let h = xff(&["10.0.0.5, 10.0.0.2, 10.0.0.3"]);
        assert_eq!(via_proxy(&h), ip("10.0.0.5"));
        let h = xff(&["::1"]);
        assert_eq!(via_proxy(&h), ip("::1"));
    }

    #[test]
    fn multiple_xff_lines_are_merged_in_order() {
        let h = xff(&["6.6.6.6, 1.2.3.4", "10.0.0.2"]);
        assert_eq!(via_proxy(&h), ip("1.2.3.4"));
        let h = xff(&["1.2.3.4", "5.6.7.8"]);
        assert_eq!(via_proxy(&h), ip("5.6.7.8"));
        let h = xff(&["1.2.3.4", "10.0.0.7", "10.0.0.8, 10.0.0.9"]);
        assert_eq!(via_proxy(&h), ip("1.2.3.4"));
    }

    #[test]
    fn garbage_in_the_middle_stops_at_its_right_neighbour() {
        let h = xff(&["1.2.3.4, garbage, 10.0.0.2, 10.0.0.3"]);
        assert_eq!(via_proxy(&h), ip("10.0.0.2"));
        let h = xff(&["1.2.3.4, unknown, 10.0.0.2"]);
        assert_eq!(via_proxy(&h), ip("10.0.0.2"));
        let h = xff(&["1.2.3.4, _hidden, 10.0.0.2"]);
        assert_eq!(via_proxy(&h), ip("10.0.0.2"));
        let h = xff(&["1.2.3.4, , 10.0.0.2"]);
        assert_eq!(via_proxy(&h), ip("10.0.0.2"));
        // Garbage left of the client does not matter.
        let h = xff(&["garbage, 1.2.3.4, 10.0.0.2"]);
        assert_eq!(via_proxy(&h), ip("1.2.3.4"));
    }

    #[test]
    fn rightmost_garbage_gives_peer() {
        assert_eq!(via_proxy(&xff(&["1.2.3.4, unknown"])), ip(PROXY));
        assert_eq!(via_proxy(&xff(&["1.2.3.4,"])), ip(PROXY));
        assert_eq!(via_proxy(&xff(&[""])), ip(PROXY));
        assert_eq!(via_proxy(&xff(&["1.2.3.4", ""])), ip(PROXY));
    }

    #[test]
    fn non_utf8_line_is_garbage() {
        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", HeaderValue::from_static("6.6.6.6"));
        h.append(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"1.2.3.4, \xff").unwrap(),
        );
        assert_eq!(via_proxy(&h), ip(PROXY));

        let mut h = HeaderMap::new();
        h.append(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"1.2.3.4\xfe").unwrap(),
        );
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.2"));
        assert_eq!(via_proxy(&h), ip("10.0.0.2"));
        h.append("x-forwarded-for", HeaderValue::from_static("5.5.5.5"));
        assert_eq!(via_proxy(&h), ip("5.5.5.5"));

        let mut h = HeaderMap::new();
        h.append(
            "forwarded",
            HeaderValue::from_bytes(b"for=1.2.3.4;by=\"\xff\"").unwrap(),
        );
        assert_eq!(via_proxy(&h), ip(PROXY));
    }

    // --- Rule 4: X-Forwarded-For entry syntax -------------------------------

    #[test]
    fn xff_entry_forms() {
        let accepted = [
            ("1.2.3.4", "1.2.3.4"),
            ("  1.2.3.4\t", "1.2.3.4"),
            ("1.2.3.4:8080", "1.2.3.4"),
            ("1.2.3.4:0", "1.2.3.4"),
            ("1.2.3.4:65535", "1.2.3.4"),
            ("2001:db8::1", "2001:db8::1"),
            ("[2001:db8::1]", "2001:db8::1"),
            ("[2001:db8::1]:443", "2001:db8::1"),
            (" [2001:db8::1]:443 ", "2001:db8::1"),
        ];
        for (entry, expected) in accepted {
            assert_eq!(parse_xff_entry(entry), Some(ip(expected)), "{entry:?}");
            assert_eq!(via_proxy(&xff(&[entry])), ip(expected), "{entry:?}");
        }
        let rejected = [
            "",
            " ",
            "unknown",
            "_hidden",
            "fe80::1%eth0",
            "[fe80::1%eth0]",
            "[fe80::1%eth0]:80",
            "[1.2.3.4]",
            "1.2.3.4:",
            "1.2.3.4:abc",
            "1.2.3.4:+80",
            "1.2.3.4:65536",
            "1.2.3.4:123456",
            "1.2.3.4 :80",
            "[2001:db8::1]443",
            "[2001:db8::1]:",
            "[2001:db8::1",
            "2001:db8::1]",
            "::ffff:1.2.3.4:80",
            "01.2.3.4",
            "1.2.3",
            "1.2.3.4.5",
            "example.com",
            "\"1.2.3.4\"",
            "1.2.3.4 5.6.7.8",
        ];
        for entry in rejected {
            assert_eq!(parse_xff_entry(entry), None, "{entry:?}");
            assert_eq!(via_proxy(&xff(&[entry])), ip(PROXY), "{entry:?}");
        }
    }

    // --- Rule 5: Forwarded ---------------------------------------------------

    #[test]
    fn forwarded_basic() {
        let h = fwd(&["for=192.0.2.60;proto=http;by=203.0.113.43"]);
        assert_eq!(via_proxy(&h), ip("192.0.2.60"));
        let h = fwd(&["for=192.0.2.43, for=198.51.100.17"]);
        assert_eq!(via_proxy(&h), ip("198.51.100.17"));
        let h = fwd(&["for=192.0.2.43, for=10.0.0.9;by=10.0.0.1"]);
        assert_eq!(via_proxy(&h), ip("192.0.2.43"));
        let h = fwd(&["proto=https;For=192.0.2.43", "FOR=10.0.0.2"]);
        assert_eq!(via_proxy(&h), ip("192.0.2.43"));
    }

    #[test]
    fn forwarded_quoted_ipv6_and_ports() {
        let h = fwd(&["for=\"[2001:db8:cafe::17]:4711\""]);
        assert_eq!(via_proxy(&h), ip("2001:db8:cafe::17"));
        let h = fwd(&["For=\"[2001:db8:cafe::17]\";proto=https"]);
        assert_eq!(via_proxy(&h), ip("2001:db8:cafe::17"));
        let h = fwd(&["for=\"192.0.2.60:8080\""]);
        assert_eq!(via_proxy(&h), ip("192.0.2.60"));
        let h = fwd(&["for=\"192.0.2.60\""]);
        assert_eq!(via_proxy(&h), ip("192.0.2.60"));
        let h = fwd(&["for=\"[2001:db8::1]:_obf-port\""]);
        assert_eq!(via_proxy(&h), ip("2001:db8::1"));
        let h = fwd(&["for=192.0.2.60:_p"]);
        assert_eq!(via_proxy(&h), ip("192.0.2.60"));
        // Lenient: unquoted IPv4 with a port.
        let h = fwd(&["for=192.0.2.60:8080"]);
        assert_eq!(via_proxy(&h), ip("192.0.2.60"));
        let h = fwd(&["for=\"[::1]:80\", for=\"[2001:db8::1]\" , for=\"[::1]\""]);
        assert_eq!(via_proxy(&h), ip("2001:db8::1"));
    }

    #[test]
    fn forwarded_quoting_and_escapes() {
        // Commas and semicolons inside quotes do not split.
        let h = fwd(&["for=192.0.2.1;by=\"a,for=6.6.6.6;b\""]);
        assert_eq!(via_proxy(&h), ip("192.0.2.1"));
        // An escaped quote does not end the string.
        let h = fwd(&["for=192.0.2.1;host=\"x\\\", for=6.6.6.6, y\""]);
        assert_eq!(via_proxy(&h), ip("192.0.2.1"));
        // Escapes inside the for value are undone.
        let h = fwd(&["for=\"192.0.2.\\1\""]);
        assert_eq!(via_proxy(&h), ip("192.0.2.1"));
        // Whitespace around pairs and elements.
        let h = fwd(&["  for=192.0.2.1 ; proto=http  ,\tfor=10.0.0.3 "]);
        assert_eq!(via_proxy(&h), ip("192.0.2.1"));
        // Empty pairs are allowed by the grammar.
        let h = fwd(&["for=192.0.2.1;;proto=http;"]);
        assert_eq!(via_proxy(&h), ip("192.0.2.1"));
    }

    #[test]
    fn forwarded_garbage() {
        let garbage = [
            "for=unknown",
            "for=\"unknown\"",
            "for=_hidden",
            "for=\"_hidden:80\"",
            "proto=https",
            "",
            "for=",
            "for=\"\"",
            "for=2001:db8::1",
            "for=\"2001:db8::1\"",
            "for=[2001:db8::1]",
            "for=\"[fe80::1%eth0]\"",
            "for=\"[1.2.3.4]\"",
            "for=\"1.2.3.4:99999\"",
            "for=\"1.2.3.4:\"",
            "for=1.2.3.4;for=5.6.7.8",
            "for =1.2.3.4",
            "for= 1.2.3.4",
            "for=1.2.3.4 proto=http",
            "for=1.2.3.4\"x\"",
            "=1.2.3.4",
            "for=1.2.3.4;by=[::1]",
            "for=\"0000000000000000000000000000000000000000000000000000000000001.2.3.4\"",
        ];
        for g in garbage {
            // Rightmost garbage: the peer.
            assert_eq!(via_proxy(&fwd(&[g])), ip(PROXY), "{g:?}");
            // Garbage in the middle: its trusted right neighbour.
            let line = format!("for=6.6.6.6, {g}, for=10.0.0.2");
            assert_eq!(via_proxy(&fwd(&[&line])), ip("10.0.0.2"), "{line:?}");
        }
        // An unterminated quoted string spoils its own element (and, read
        // from the right, what lies left of it), never its right neighbours.
        for g in ["for=\"1.2.3.4", "for=\"1.2.3.4\\"] {
            assert_eq!(via_proxy(&fwd(&[g])), ip(PROXY), "{g:?}");
            let line = format!("for=6.6.6.6, {g}, for=10.0.0.2");
            assert_eq!(via_proxy(&fwd(&[&line])), ip("10.0.0.2"), "{line:?}");
            assert_eq!(via_proxy(&fwd(&[g, "for=10.0.0.2"])), ip("10.0.0.2"));
        }
        // An empty element between two commas.
        let h = fwd(&["for=6.6.6.6,,for=10.0.0.2"]);
        assert_eq!(via_proxy(&h), ip("10.0.0.2"));
    }

    #[test]
    fn forwarded_unterminated_quote_spoils_only_its_element() {
        // Same line: the element with the quote is garbage, the one a proxy
        // appended after it is read (elements are cut from the right).
        let h = fwd(&["for=\"6.6.6.6, for=5.5.5.5"]);
        assert_eq!(via_proxy(&h), ip("5.5.5.5"));
        let h = fwd(&["for=\"6.6.6.6, for=10.0.0.2"]);
        assert_eq!(via_proxy(&h), ip("10.0.0.2"));
        // A later line is read on its own.
        let h = fwd(&["for=\"6.6.6.6", "for=5.5.5.5"]);
        assert_eq!(via_proxy(&h), ip("5.5.5.5"));
    }

    #[test]
    fn only_the_chosen_header_is_read() {
        let h = headers(&[
            ("x-forwarded-for", "5.5.5.5"),
            ("forwarded", "for=192.0.2.1"),
        ]);
        let r = resolver();
        assert_eq!(r.client_ip(ip(PROXY), &h), ip("5.5.5.5"));
        let r = r.proxy_header(ProxyHeader::Forwarded);
        assert_eq!(r.client_ip(ip(PROXY), &h), ip("192.0.2.1"));
        // Garbage in the chosen header: no fallback to the other one.
        let h = headers(&[("forwarded", "for=unknown"), ("x-forwarded-for", "5.5.5.5")]);
        assert_eq!(r.client_ip(ip(PROXY), &h), ip(PROXY));
        // A client's Forwarded behind an X-Forwarded-For proxy is ignored.
        let h = headers(&[("forwarded", "for=6.6.6.6"), ("x-forwarded-for", "5.5.5.5")]);
        assert_eq!(resolver().client_ip(ip(PROXY), &h), ip("5.5.5.5"));
    }

    // --- Rule 1: IPv4-mapped IPv6 --------------------------------------------

    #[test]
    fn ipv4_mapped_addresses_are_normalised() {
        let r = resolver();
        let mapped_proxy = ip("::ffff:10.0.0.1");
        assert!(r.is_trusted(mapped_proxy));
        assert_eq!(r.client_ip(mapped_proxy, &HeaderMap::new()), ip("10.0.0.1"));
        // Untrusted mapped peer comes back as IPv4.
        assert_eq!(
            r.client_ip(ip("::ffff:8.8.8.8"), &xff(&["1.2.3.4"])),
            ip("8.8.8.8")
        );
        // Mapped entries in headers.
        let h = xff(&["::ffff:1.2.3.4"]);
        assert_eq!(r.client_ip(mapped_proxy, &h), ip("1.2.3.4"));
        let h = xff(&["1.2.3.4, [::ffff:10.0.0.5]:80"]);
        assert_eq!(r.client_ip(mapped_proxy, &h), ip("1.2.3.4"));
        let rf = r.clone().proxy_header(ProxyHeader::Forwarded);
        let h = fwd(&["for=1.2.3.4, for=\"[::ffff:10.0.0.5]\""]);
        assert_eq!(rf.client_ip(mapped_proxy, &h), ip("1.2.3.4"));
        let h = fwd(&["for=\"[::ffff:1.2.3.4]:80\""]);
        assert_eq!(rf.client_ip(mapped_proxy, &h), ip("1.2.3.4"));
        // Grouping uses the IPv4 prefix.
        assert_eq!(r.group(ip("::ffff:1.2.3.4")), net("1.2.3.4/32"));
        // Mapped trusted ranges become IPv4 ranges.
        let r = ClientIpResolver::new()
            .trust_proxies(["::ffff:10.0.0.0/104"])
            .unwrap();
        assert!(r.is_trusted(ip("10.1.2.3")));
        assert!(!r.is_trusted(ip("11.1.2.3")));
        let r = ClientIpResolver::new().trust_nets([net("::ffff:192.168.0.1/128")]);
        assert!(r.is_trusted(ip("192.168.0.1")));
        assert!(r.is_trusted(ip("::ffff:192.168.0.1")));
        // IPv4-compatible (not mapped) addresses are left alone.
        assert_eq!(r.group(ip("::1.2.3.4")), net("::/64"));
    }

    // --- Rule 6: the cap -----------------------------------------------------

    #[test]
    fn only_32_rightmost_entries_are_examined() {
        let trusted: Vec<String> = (1..=40).map(|i| format!("10.0.0.{i}")).collect();

        // 32 entries, leftmost untrusted: found.
        let mut list = vec!["1.2.3.4".to_owned()];
        list.extend(trusted[..31].iter().cloned());
        assert_eq!(via_proxy(&xff(&[&list.join(", ")])), ip("1.2.3.4"));

        // 33 entries, leftmost untrusted: out of reach, last trusted seen.
        let mut list = vec!["1.2.3.4".to_owned()];
        list.extend(trusted[..32].iter().cloned());
        assert_eq!(via_proxy(&xff(&[&list.join(", ")])), ip("10.0.0.1"));

        // 41 entries split over lines; the 32nd from the right is 10.0.0.9.
        let mut h = xff(&["1.2.3.4, 10.0.0.1"]);
        for chunk in trusted[1..].chunks(7) {
            h.append(
                "x-forwarded-for",
                HeaderValue::from_str(&chunk.join(",")).unwrap(),
            );
        }
        assert_eq!(via_proxy(&h), ip("10.0.0.9"));

        // Same for Forwarded.
        let elements: Vec<String> = std::iter::once("for=1.2.3.4".to_owned())
            .chain(trusted[..32].iter().map(|t| format!("for={t}")))
            .collect();
        assert_eq!(via_proxy(&fwd(&[&elements.join(",")])), ip("10.0.0.1"));
        assert_eq!(via_proxy(&fwd(&[&elements[1..].join(",")])), ip("10.0.0.1"));
        assert_eq!(via_proxy(&fwd(&[&elements[..32].join(",")])), ip("1.2.3.4"));
    }

    // --- Grouping --------------------------------------------------------------

    #[test]
    fn ipv6_grouped_by_64_by_default() {
        let r = ClientIpResolver::new();
        assert_eq!(r.group(ip("2001:db8:1:2:aa::1")), net("2001:db8:1:2::/64"));
        assert_eq!(
            r.client_net(ip("2001:db8:1:2:aa::1"), &HeaderMap::new()),
            net("2001:db8:1:2::/64")
        );
        assert_eq!(r.group(ip("203.0.113.9")), net("203.0.113.9/32"));
    }

    #[test]
    fn custom_ipv6_prefixes() {
        let r = ClientIpResolver::new().ipv6_prefix(56).unwrap();
        assert_eq!(r.group(ip("2001:db8:1:2ff::1")), net("2001:db8:1:200::/56"));
        let r = ClientIpResolver::new().ipv6_prefix(128).unwrap();
        assert_eq!(
            r.group(ip("2001:db8:1:2:aa::1")),
            net("2001:db8:1:2:aa::1/128")
        );
        let r = ClientIpResolver::new().ipv6_prefix(0).unwrap();
        assert_eq!(r.group(ip("2001:db8::1")), net("::/0"));
    }

    #[test]
    fn custom_ipv4_prefix() {
        let r = ClientIpResolver::new().ipv4_prefix(24).unwrap();
        assert_eq!(r.group(ip("203.0.113.9")), net("203.0.113.0/24"));
        let r = resolver().ipv4_prefix(16).unwrap();
        let h = xff(&["198.51.100.200"]);
        assert_eq!(r.client_net(ip(PROXY), &h), net("198.51.0.0/16"));
        let r = ClientIpResolver::new().ipv4_prefix(0).unwrap();
        assert_eq!(r.group(ip("203.0.113.9")), net("0.0.0.0/0"));
    }

    #[test]
    fn invalid_prefixes_are_rejected() {
        assert_eq!(
            ClientIpResolver::new().ipv4_prefix(33).unwrap_err(),
            IpConfigError::InvalidPrefix {
                family: "IPv4",
                len: 33
            }
        );
        assert_eq!(
            ClientIpResolver::new().ipv6_prefix(129).unwrap_err(),
            IpConfigError::InvalidPrefix {
                family: "IPv6",
                len: 129
            }
        );
        assert!(ClientIpResolver::new().ipv6_prefix(255).is_err());
        assert!(ClientIpResolver::new().ipv4_prefix(32).is_ok());
        assert!(ClientIpResolver::new().ipv6_prefix(128).is_ok());
        let msg = ClientIpResolver::new()
            .ipv6_prefix(129)
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "invalid IPv6 grouping prefix /129: it must be between 0 and 128"
        );
        let msg = ClientIpResolver::new()
            .ipv4_prefix(40)
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "invalid IPv4 grouping prefix /40: it must be between 0 and 32"
        );
    }

    // --- Configuration -----------------------------------------------------------

    #[test]
    fn invalid_cidrs_are_rejected() {
        for bad in [
            "",
            "not-an-ip",
            "10.0.0.0/33",
            "::/129",
            "10.0.0.0/8/8",
            "10.0.0.0/",
            "fe80::1%eth0",
            "10.0.0.0/-1",
            "01.2.3.4",
        ] {
            let err = ClientIpResolver::new()
                .trust_proxies(["10.0.0.0/8", bad])
                .unwrap_err();
            assert_eq!(err, IpConfigError::InvalidCidr(bad.to_owned()));
        }
        let err = IpConfigError::InvalidCidr("nope".into());
        assert_eq!(
            err.to_string(),
            "invalid trusted proxy range \"nope\": expected an IP address or a CIDR such as \"10.0.0.0/8\""
        );
        let _: &dyn std::error::Error = &err;
    }

    #[test]
    fn trusted_ranges() {
        let r = resolver();
        assert!(r.is_trusted(ip("10.255.0.1")));
        assert!(r.is_trusted(ip("192.168.1.7")));
        assert!(!r.is_trusted(ip("192.168.1.8")));
        assert!(r.is_trusted(ip("::1")));
        assert!(!r.is_trusted(ip("::2")));
        assert!(!r.is_trusted(ip("11.0.0.1")));

        let r = ClientIpResolver::new()
            .trust_proxies([" 172.16.5.4/12 ".to_owned()])
            .unwrap()
            .trust_nets([net("2001:db8::/32")]);
        assert!(r.is_trusted(ip("172.31.0.1")));
        assert!(r.is_trusted(ip("2001:db8:ffff::1")));
        assert!(!r.is_trusted(ip("2001:db9::1")));
        // Ranges accumulate.
        let r = r.trust_proxies(Vec::<String>::new()).unwrap();
        assert!(r.is_trusted(ip("172.31.0.1")));
    }

    #[test]
    fn trusted_ipv6_proxy_chain() {
        let r = ClientIpResolver::new()
            .trust_proxies(["2001:db8:ffff::/48"])
            .unwrap();
        let h = xff(&["2001:db8:1:2:aa::1, [2001:db8:ffff::2]:443"]);
        let peer = ip("2001:db8:ffff::1");
        assert_eq!(r.client_ip(peer, &h), ip("2001:db8:1:2:aa::1"));
        assert_eq!(r.client_net(peer, &h), net("2001:db8:1:2::/64"));
    }

    // --- Properties ----------------------------------------------------------------

    /// Every address that could be read out of the headers, generously:
    /// maximal runs of address characters, with and without a trailing
    /// `:port`, in the text as is and with backslashes removed.
    fn candidates(h: &HeaderMap) -> Vec<IpAddr> {
        let mut out = Vec::new();
        for value in h.values() {
            let raw = String::from_utf8_lossy(value.as_bytes()).into_owned();
            let unescaped = raw.replace('\\', "");
            for text in [raw, unescaped] {
                let runs = text.split(|c: char| !(c.is_ascii_hexdigit() || c == '.' || c == ':'));
                for run in runs {
                    let mut forms = vec![run];
                    if let Some((host, _)) = run.rsplit_once(':') {
                        forms.push(host);
                    }
                    for form in forms {
                        if let Ok(addr) = form.parse::<IpAddr>() {
                            out.push(addr.to_canonical());
                        }
                    }
                }
            }
        }
        out
    }

    fn header_value(bytes: Vec<u8>) -> HeaderValue {
        let bytes: Vec<u8> = bytes
            .into_iter()
            .map(|b| {
                if (b < 0x20 && b != b'\t') || b == 0x7f {
                    b','
                } else {
                    b
                }
            })
            .collect();
        HeaderValue::from_bytes(&bytes).unwrap()
    }

    /// Header text assembled from pieces that look like the real thing.
    fn plausible_value() -> impl Strategy<Value = HeaderValue> {
        let piece = prop::sample::select(vec![
            "1.2.3.4",
            "10.0.0.2",
            "10.0.0.3",
            "192.168.1.7",
            "6.6.6.6",
            "::1",
            "[::1]",
            "2001:db8::1",
            "[2001:db8::1]:443",
            "::ffff:10.0.0.9",
            "::ffff:6.6.6.6",
            "fe80::1%eth0",
            ",",
            ", ",
            ";",
            "for=",
            "FOR=",
            "by=",
            "proto=http",
            "=",
            "\"",
            "\\",
            "\\\"",
            "[",
            "]",
            ":80",
            ":",
            "unknown",
            "_hidden",
            " ",
            "\t",
            "\u{e9}",
        ]);
        prop::collection::vec(piece, 0..24)
            .prop_map(|pieces| HeaderValue::from_bytes(pieces.concat().as_bytes()).unwrap())
    }

    /// A hop list of random addresses in every accepted syntax, with the
    /// odd bit of garbage, meant to be mostly valid.
    fn structured_value() -> impl Strategy<Value = HeaderValue> {
        let entry =
            (any_ip(), 0u8..8, any::<u16>()).prop_map(|(addr, form, port)| match (form, addr) {
                (0, _) => addr.to_string(),
                (1, IpAddr::V4(v4)) => format!("{v4}:{port}"),
                (1, IpAddr::V6(v6)) => format!("[{v6}]:{port}"),
                (2, IpAddr::V4(v4)) => format!("for={v4}"),
                (2 | 3, IpAddr::V6(v6)) => format!("for=\"[{v6}]:{port}\""),
                (3, IpAddr::V4(v4)) => format!("for=\"{v4}:{port}\";proto=http"),
                (4, _) => format!("For=\"{addr}\""),
                (5, _) => "unknown".to_owned(),
                (6, _) => "by=\"a,b\\\";c\"".to_owned(),
                _ => format!("[{addr}]"),
            });
        prop::collection::vec(entry, 1..8)
            .prop_map(|entries| HeaderValue::from_str(&entries.join(", ")).unwrap())
    }

    fn any_value() -> impl Strategy<Value = HeaderValue> {
        prop_oneof![
            1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(header_value),
            1 => plausible_value(),
            2 => structured_value(),
        ]
    }

    fn header_map() -> impl Strategy<Value = HeaderMap> {
        (
            prop::collection::vec(any_value(), 0..4),
            prop::collection::vec(any_value(), 0..4),
        )
            .prop_map(|(forwarded, xff)| {
                let mut h = HeaderMap::new();
                for v in forwarded {
                    h.append(header::FORWARDED, v);
                }
                for v in xff {
                    h.append(X_FORWARDED_FOR, v);
                }
                h
            })
    }

    fn any_ip() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<[u8; 4]>().prop_map(IpAddr::from),
            any::<[u8; 16]>().prop_map(IpAddr::from),
            any::<[u8; 4]>().prop_map(|o| IpAddr::V6(Ipv4Addr::from(o).to_ipv6_mapped())),
            Just(ip("10.0.0.1")),
            Just(ip("::ffff:10.0.0.1")),
            Just(ip("::1")),
        ]
    }

    fn untrusted_ip() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<[u8; 4]>().prop_map(IpAddr::from),
            any::<[u8; 16]>().prop_map(IpAddr::from),
            any::<[u8; 4]>().prop_map(|o| IpAddr::V6(Ipv4Addr::from(o).to_ipv6_mapped())),
            Just(ip("::ffff:8.8.8.8")),
        ]
        .prop_filter("trusted peer", |peer| !resolver().is_trusted(*peer))
    }

    proptest! {
        #[test]
        fn never_panics_and_only_returns_peer_or_header_address(
            h in header_map(),
            peer in any_ip(),
            trust_all in any::<bool>(),
            forwarded in any::<bool>(),
        ) {
            let r = if trust_all {
                resolver().trust_proxies(["0.0.0.0/0", "::/0"]).unwrap()
            } else {
                resolver()
            };
            let r = if forwarded { r.proxy_header(ProxyHeader::Forwarded) } else { r };
            let client = r.client_ip(peer, &h);
            let net = r.client_net(peer, &h);
            prop_assert!(net.contains(&client));
            prop_assert!(
                client == peer.to_canonical() || candidates(&h).contains(&client),
                "{client} is neither the peer nor in {h:?}"
            );
        }

        #[test]
        fn untrusted_peer_is_always_the_client(h in header_map(), peer in untrusted_ip()) {
            prop_assert_eq!(resolver().client_ip(peer, &h), peer.to_canonical());
        }

        #[test]
        fn grouping_contains_the_address(
            addr in any_ip(),
            v4 in 0u8..=32,
            v6 in 0u8..=128,
        ) {
            let r = ClientIpResolver::new().ipv4_prefix(v4).unwrap().ipv6_prefix(v6).unwrap();
            let net = r.group(addr);
            prop_assert!(net.contains(&addr.to_canonical()));
            let expected = if addr.to_canonical().is_ipv4() { v4 } else { v6 };
            prop_assert_eq!(net.prefix_len(), expected);
            prop_assert_eq!(net, net.trunc());
        }
    }
}
