//! An axum app limited as a user would limit it.
//!
//! ```text
//! cargo run --example server                              # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example server   # shared through Redis
//! ```
//!
//! Environment: `PORT` (default 3000; the server listens on 127.0.0.1),
//! `REDIS_URL`, `TRUSTED_PROXIES` (comma-separated CIDRs whose
//! `X-Forwarded-For` is believed; default: none, the TCP peer is the client),
//! `ON_STORE_ERROR` (what to do while Redis fails: `closed`, the default,
//! answers 503; `open` lets requests through unlimited; `memory` enforces the
//! limits in this process until Redis is back).
//!
//! - every limited route: 100 requests per second per client IP (burst 100)
//! - `GET /api/hello`: also 10 per second per client IP, burst 10 (GCRA)
//! - `POST /sms/{phone}`: at most 3 per 60 seconds per phone number (sliding log), 202
//! - `GET /healthz`: not limited
//!
//! Two processes on one Redis share every limit.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use tower_ratelimit::key::{ClientIp, ClientIpResolver, PathParam};
use tower_ratelimit::layer::{OnStoreError, RateLimitInfo, RateLimitLayer};
use tower_ratelimit::{Limit, MemoryStore, Quota, RedisStore, Store};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn app<S: Store + Clone>(
    store: S,
    client_ip: ClientIp,
    on_store_error: OnStoreError,
) -> Result<Router, Error> {
    let per_ip = Limit::new(
        "per-ip",
        Quota::token_bucket(100, 100, Duration::from_secs(1)),
    )?;
    let hello = Limit::new("hello", Quota::gcra(10, Duration::from_secs(1), 10))?;
    let sms = Limit::new("sms", Quota::sliding_log(3, Duration::from_secs(60)))?;

    // Each route's layer holds the shared per-IP limit and the route's own:
    // one store round trip per request, and a request refused by one limit
    // consumes nothing from the other.
    let hello_layer = RateLimitLayer::builder()
        .store(store.clone())
        .limit(per_ip.clone(), client_ip.clone())
        .limit(hello, client_ip.clone())
        .on_store_error(on_store_error)
        .build()?;
    let sms_layer = RateLimitLayer::builder()
        .store(store)
        .limit(per_ip, client_ip)
        .limit(sms, PathParam::new("phone"))
        .on_store_error(on_store_error)
        .build()?;

    Ok(Router::new()
        .route("/api/hello", get(say_hello).route_layer(hello_layer))
        .route("/sms/{phone}", post(send_sms).route_layer(sms_layer))
        .route("/healthz", get(|| async { "ok" })))
}

/// `RateLimitInfo` always extracts: it has no decision when the request was
/// let through without one (Redis down with `ON_STORE_ERROR=open`).
async fn say_hello(info: RateLimitInfo) -> String {
    match info.decision() {
        Some(decision) => format!("hello! {} more this second\n", decision.remaining()),
        None => "hello! (not rate-limited right now)\n".to_owned(),
    }
}

async fn send_sms(Path(phone): Path<String>) -> (StatusCode, String) {
    (StatusCode::ACCEPTED, format!("SMS to {phone} queued\n"))
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_ratelimit=debug".into()),
        )
        .init();
    let port: u16 = std::env::var("PORT")
        .ok()
        .map(|p| p.parse())
        .transpose()?
        .unwrap_or(3000);
    let resolver = match std::env::var("TRUSTED_PROXIES") {
        Ok(cidrs) => ClientIpResolver::new()
            .trust_proxies(cidrs.split(',').filter(|c| !c.trim().is_empty()))?,
        Err(_) => ClientIpResolver::new(),
    };
    let client_ip = ClientIp::with_resolver(resolver);
    let on_store_error = match std::env::var("ON_STORE_ERROR").as_deref() {
        Ok("open") => OnStoreError::FailOpen,
        Ok("memory") => OnStoreError::FallbackToMemory,
        Ok("closed") | Err(_) => OnStoreError::default(),
        Ok(other) => {
            return Err(format!("ON_STORE_ERROR={other}: use open, closed or memory").into())
        }
    };
    let app = match std::env::var("REDIS_URL") {
        Ok(url) => {
            tracing::info!("store: Redis at {url}");
            app(
                RedisStore::builder(url).prefix("example").build()?,
                client_ip,
                on_store_error,
            )?
        }
        Err(_) => {
            tracing::info!("store: in memory (set REDIS_URL to share limits between processes)");
            app(MemoryStore::new(), client_ip, on_store_error)?
        }
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
