//! One-time warnings about the misconfigurations of [`ClientIp`](super::ClientIp)
//! that make every client share one limit.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use http::header::FORWARDED;
use http::{HeaderMap, HeaderName};

use super::{ClientIpResolver, ProxyHeader};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Which warnings an extractor (and its clones) has given. Until both
/// forwarding warnings are given, the first requests on each thread, then
/// one in [`SAMPLE`], cost two header lookups; afterwards one relaxed load.
#[derive(Debug, Clone, Default)]
pub(super) struct Warnings(Arc<Flags>);

#[derive(Debug, Default)]
struct Flags {
    untrusted_forwarder: AtomicBool,
    unread_header: AtomicBool,
    /// A trusted proxy's request without the header, counted under it.
    silent_proxy: AtomicBool,
    no_peer: AtomicBool,
    /// Both forwarding warnings given: nothing left to check per request.
    forwarding_done: AtomicBool,
}

/// After the first [`SAMPLE`] requests of a thread, one in `SAMPLE` is looked
/// at: a misconfiguration that concerns every request is still reported
/// within a few requests, without two header lookups on every request of a
/// service that is configured right.
const SAMPLE: u32 = 16;

fn sampled() -> bool {
    thread_local! {
        static SEEN: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    SEEN.with(|seen| {
        let n = seen.get();
        seen.set(n.wrapping_add(1));
        n < SAMPLE || n % SAMPLE == 0
    })
}

/// Sets `flag`; true for the one caller that set it first.
fn first(flag: &AtomicBool) -> bool {
    !flag.load(Ordering::Relaxed) && !flag.swap(true, Ordering::AcqRel)
}

impl Warnings {
    /// The request has no peer address: every request would be keyless.
    pub(super) fn no_peer(&self) {
        if first(&self.0.no_peer) {
            tracing::warn!(
                target: "tower_ratelimit",
                "ClientIp found no peer address in a request, so it has no rate-limit key \
                 (the layer's MissingKey policy applies to every such request). With axum, \
                 serve the app with `into_make_service_with_connect_info::<SocketAddr>()`; \
                 with another server, insert the peer's `SocketAddr` into the request extensions."
            );
        }
    }

    /// Warns when forwarding headers suggest a proxy the resolver does not
    /// trust or a header it does not read.
    pub(super) fn check_forwarding(
        &self,
        resolver: &ClientIpResolver,
        peer: IpAddr,
        headers: &HeaderMap,
    ) {
        let flags = &self.0;
        if flags.forwarding_done.load(Ordering::Relaxed) || !sampled() {
            return;
        }
        let xff = headers.contains_key(X_FORWARDED_FOR);
        let forwarded = headers.contains_key(FORWARDED);
        if !xff && !forwarded {
            if !resolver.requires_client()
                && resolver.is_trusted(peer)
                && first(&flags.silent_proxy)
            {
                tracing::warn!(
                    target: "tower_ratelimit",
                    peer = %peer,
                    "a request from the trusted proxy {peer} has no forwarding header: it counts \
                     under {peer}, in one limit with every other such request. If every request \
                     through {peer} should name its client, build the resolver with \
                     `.require_forwarded_client()`: such a request then has no key (the \
                     MissingKey policy applies). (Logged once.)"
                );
            }
            return;
        }
        let name = if xff { "X-Forwarded-For" } else { "Forwarded" };
        if !resolver.is_trusted(peer) {
            if first(&flags.untrusted_forwarder) {
                tracing::warn!(
                    target: "tower_ratelimit",
                    peer = %peer,
                    "a request from {peer} carries {name}, but {peer} is not a trusted proxy: \
                     the header is ignored and the limit counts per {peer}. If this service runs \
                     behind a load balancer or reverse proxy, every client behind it now shares \
                     one limit: trust the proxy with \
                     `ClientIp::with_resolver(ClientIpResolver::new().trust_proxies([\"<proxy CIDR>\"])?)`. \
                     (If clients reach the service directly, they wrote the header themselves \
                     and ignoring it is right.)"
                );
            }
        } else {
            let (reads, other_present, other) = match resolver.header() {
                ProxyHeader::XForwardedFor => ("X-Forwarded-For", !xff && forwarded, "Forwarded"),
                ProxyHeader::Forwarded => ("Forwarded", xff && !forwarded, "XForwardedFor"),
            };
            if other_present && first(&flags.unread_header) {
                tracing::warn!(
                    target: "tower_ratelimit",
                    peer = %peer,
                    "the trusted proxy {peer} sends {name} but not {reads}, the header the \
                     resolver reads: the limit counts per proxy. Choose the header it sends with \
                     `ClientIpResolver::proxy_header(ProxyHeader::{other})`."
                );
            }
        }
        if flags.untrusted_forwarder.load(Ordering::Relaxed)
            && flags.unread_header.load(Ordering::Relaxed)
        {
            flags.forwarding_done.store(true, Ordering::Relaxed);
        }
    }
}
