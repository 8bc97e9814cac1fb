//! Misconfigurations that make every client share one limit are logged
//! once, with the fix, not per request.

mod events;

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use events::Events;
use http::HeaderName;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, Layer, ServiceExt};
use tower_ratelimit::key::{ClientIp, ClientIpResolver, Header, KeyExtractor};
use tower_ratelimit::layer::{MissingKey, RateLimitLayer, Rule};
use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn request(peer: Option<&str>, header: Option<(&'static str, &str)>) -> Request<Full<Bytes>> {
    let mut request = Request::new(Full::default());
    if let Some((name, value)) = header {
        request
            .headers_mut()
            .insert(name, value.parse().expect("header value"));
    }
    if let Some(peer) = peer {
        let ip: std::net::IpAddr = peer.parse().expect("ip");
        request.extensions_mut().insert(SocketAddr::new(ip, 40_000));
    }
    request
}

async fn status(layer: &RateLimitLayer, request: Request<Full<Bytes>>) -> StatusCode {
    let service = layer.layer(service_fn(|_: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
    }));
    service.oneshot(request).await.expect("infallible").status()
}

fn layer(key: ClientIp) -> RateLimitLayer {
    let limit = Limit::new("per-ip", Quota::per_second(1000).token_bucket()).expect("limit");
    RateLimitLayer::builder()
        .rule(Rule::new(limit, key).on_missing_key(MissingKey::Skip))
        .build()
        .expect("layer")
}

#[test]
fn forwarding_headers_from_an_untrusted_peer_warn_once() {
    let events = Events::capture();
    runtime().block_on(async {
        let layer = layer(ClientIp::peer());
        status(&layer, request(Some("10.1.2.3"), None)).await;
        assert!(events.warnings().is_empty(), "no header, no warning");
        for _ in 0..5 {
            let xff = Some(("x-forwarded-for", "203.0.113.9"));
            assert_eq!(
                status(&layer, request(Some("10.1.2.3"), xff)).await,
                StatusCode::OK
            );
            let fwd = Some(("forwarded", "for=203.0.113.9"));
            status(&layer, request(Some("10.1.2.3"), fwd)).await;
        }
    });
    let warnings = events.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("10.1.2.3"), "{warnings:?}");
    assert!(warnings[0].contains("X-Forwarded-For"), "{warnings:?}");
    assert!(
        warnings[0].contains("trust_proxies"),
        "names the fix: {warnings:?}"
    );
}

#[test]
fn a_trusted_proxy_sending_the_header_not_read_warns_once() {
    let events = Events::capture();
    runtime().block_on(async {
        let resolver = ClientIpResolver::new()
            .trust_proxies(["10.0.0.0/8"])
            .expect("cidr");
        let layer = layer(ClientIp::with_resolver(resolver));
        // the header the resolver reads: all is well
        let xff = Some(("x-forwarded-for", "203.0.113.9"));
        status(&layer, request(Some("10.1.2.3"), xff)).await;
        assert!(events.warnings().is_empty(), "{:?}", events.warnings());
        for _ in 0..5 {
            let fwd = Some(("forwarded", "for=203.0.113.9"));
            status(&layer, request(Some("10.1.2.3"), fwd)).await;
        }
    });
    let warnings = events.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("proxy_header(ProxyHeader::Forwarded)"),
        "names the fix: {warnings:?}"
    );
}

/// A trusted proxy's request without a forwarding header counts under the
/// proxy: warned about once, naming `require_forwarded_client`; not when
/// the resolver already requires a client.
#[test]
fn a_trusted_proxy_sending_no_header_warns_once_unless_required() {
    let events = Events::capture();
    let resolver = || {
        ClientIpResolver::new()
            .trust_proxies(["10.0.0.0/8"])
            .expect("cidr")
    };
    runtime().block_on(async {
        let layer = layer(ClientIp::with_resolver(resolver()));
        for _ in 0..5 {
            status(&layer, request(Some("10.1.2.3"), None)).await;
        }
        // an untrusted peer without the header is simply the client
        status(&layer, request(Some("198.51.100.9"), None)).await;
    });
    let warnings = events.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("10.1.2.3"), "{warnings:?}");
    assert!(
        warnings[0].contains("require_forwarded_client"),
        "names the fix: {warnings:?}"
    );
    // (this thread's first 16 requests are all looked at)
    runtime().block_on(async {
        let layer = layer(ClientIp::with_resolver(
            resolver().require_forwarded_client(),
        ));
        for _ in 0..5 {
            status(&layer, request(Some("10.1.2.3"), None)).await;
        }
    });
    assert_eq!(events.warnings(), warnings, "no new warning");
}

#[test]
fn requests_without_a_peer_address_warn_once() {
    let events = Events::capture();
    runtime().block_on(async {
        let layer = layer(ClientIp::peer());
        for _ in 0..5 {
            status(&layer, request(None, None)).await;
        }
    });
    let warnings = events.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("into_make_service_with_connect_info"),
        "names the fix: {warnings:?}"
    );
}

#[test]
fn a_limit_name_reused_with_another_quota_on_one_store_warns_once() {
    let events = Events::capture();
    let store = MemoryStore::new();
    let ten = Quota::per_second(10).allow_burst(20).gcra();
    let five = Quota::per_second(5).allow_burst(20).gcra();
    let api = |quota| Limit::new("api", quota).expect("limit");
    let _a = Limiter::new(store.clone(), api(ten));
    let _b = Limiter::new(store.clone(), api(ten));
    let _other_store = Limiter::new(MemoryStore::new(), api(five));
    assert!(events.warnings().is_empty(), "{:?}", events.warnings());
    let _c = Limiter::builder(store.clone())
        .limit(api(five))
        .build()
        .expect("limiter");
    let _d = Limiter::new(store, api(Quota::per_minute(3).sliding_log()));
    let warnings = events.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("GCRA, 10 per 1s, bursts of 20")
            && warnings[0].contains("GCRA, 5 per 1s, bursts of 20"),
        "{warnings:?}"
    );
}

#[test]
fn a_limit_name_keyed_two_ways_on_one_store_warns_once() {
    let events = Events::capture();
    let store = MemoryStore::new();
    let api = || Limit::new("api", Quota::per_minute(2).allow_burst(2).gcra()).expect("limit");
    let header = |name: &'static str| Header::new(HeaderName::from_static(name));
    let on = |store: &MemoryStore, key: Rule| {
        RateLimitLayer::builder()
            .store(store.clone())
            .rule(key)
            .build()
            .expect("layer")
    };
    let by_ip = on(&store, Rule::new(api(), ClientIp::peer()));
    // the same kind of key on another layer: one limit, shared on purpose
    let _also_by_ip = on(&store.clone(), Rule::new(api(), ClientIp::peer()));
    // another kind of key on another store: nothing shared
    let _elsewhere = on(&MemoryStore::new(), Rule::new(api(), header("x-api-key")));
    assert!(events.warnings().is_empty(), "{:?}", events.warnings());

    let by_key = on(&store, Rule::new(api(), header("x-api-key")));
    let warnings = events.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("\"api\"")
            && warnings[0].contains("ClientIp")
            && warnings[0].contains("Header(x-api-key)"),
        "names the limit and both keys: {warnings:?}"
    );
    // What it warns of: an API key written as an IP's key drains that IP.
    runtime().block_on(async {
        let forged = Some(("x-api-key", "203.0.113.9/32"));
        for _ in 0..2 {
            assert_eq!(status(&by_key, request(None, forged)).await, StatusCode::OK);
        }
        assert_eq!(
            status(&by_ip, request(Some("203.0.113.9"), None)).await,
            StatusCode::TOO_MANY_REQUESTS
        );
    });
    // once per name
    let _third = on(&store, Rule::new(api(), header("x-user")));
    assert_eq!(events.warnings().len(), 1, "{:?}", events.warnings());
}

#[test]
fn one_extractor_type_reading_two_things_is_two_kinds_of_key() {
    let events = Events::capture();
    let store = MemoryStore::new();
    let user = || Limit::new("per-user", Quota::per_second(5).gcra()).expect("limit");
    let header = |name: &'static str| Header::new(HeaderName::from_static(name));
    let _a = RateLimitLayer::builder()
        .store(store.clone())
        .limit(user(), header("x-user-id"))
        .build()
        .expect("layer");
    let _b = RateLimitLayer::builder()
        .store(store)
        .limit(user(), header("x-api-key"))
        .build()
        .expect("layer");
    let warnings = events.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("Header(x-user-id)") && warnings[0].contains("Header(x-api-key)"),
        "{warnings:?}"
    );
}

/// A user id read from one of two places: one kind of key, whichever.
#[derive(Clone)]
enum UserId {
    Header,
    Extension,
}

impl KeyExtractor for UserId {
    fn extract(&self, parts: &http::request::Parts) -> Option<Vec<u8>> {
        match self {
            UserId::Header => parts
                .headers
                .get("x-user-id")
                .map(|v| v.as_bytes().to_vec()),
            UserId::Extension => parts
                .extensions
                .get::<u64>()
                .map(|id| id.to_string().into_bytes()),
        }
    }

    fn key_kind(&self) -> String {
        "user id".to_owned()
    }
}

#[test]
fn key_kinds_are_the_types_and_what_they_say() {
    let events = Events::capture();
    let store = MemoryStore::new();
    let limit = |name| Limit::new(name, Quota::per_second(5).gcra()).expect("limit");
    let layer = |key: Rule| {
        RateLimitLayer::builder()
            .store(store.clone())
            .rule(key)
            .build()
            .expect("layer")
    };
    // one type that answers alike: shared on purpose, no warning
    let _a = layer(Rule::new(limit("per-user"), UserId::Header));
    let _b = layer(Rule::new(limit("per-user"), UserId::Extension));
    assert!(events.warnings().is_empty(), "{:?}", events.warnings());
    // two closures: two types, though their names read alike
    let tenant = |parts: &http::request::Parts| parts.uri.host().map(str::to_owned);
    let user = |parts: &http::request::Parts| parts.uri.query().map(str::to_owned);
    let _c = layer(Rule::new(limit("per-tenant"), tenant));
    let _d = layer(Rule::new(limit("per-tenant"), tenant));
    assert!(events.warnings().is_empty(), "{:?}", events.warnings());
    let _e = layer(Rule::new(limit("per-tenant"), user));
    let warnings = events.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("{{closure}}")
            && warnings[0].contains("two extractor types of that name"),
        "{warnings:?}"
    );
}
