//! `peers MODE PORT [REDIS_URL]`: one axum hello-world, limited by one
//! limiter per mode, so that `bench/run.sh` measures only the limiter.
//!
//! No quota is ever reached, except in `ours-redis-flood`.
//!
//! | mode | limiter |
//! |---|---|
//! | `bare` | none |
//! | `governor` | tower_governor, per peer IP, no headers (its default) |
//! | `governor-headers` | the same with `use_headers()` (`x-ratelimit-*` on every response) |
//! | `ours-mem` | tower-ratelimit, MemoryStore, GCRA, per client IP |
//! | `ours-mem-noheaders` | the same without the RateLimit fields |
//! | `trlr` | tower-rate-limit-redis, GCRA, keys rotated over 10k |
//! | `ours-redis` | tower-ratelimit, RedisStore, GCRA, the same 10k keys |
//! | `ours-redis-noheaders` | the same without the RateLimit fields (tower-rate-limit-redis sends none on a grant) |
//! | `ours-redis-tb`, `-fw`, `-sw`, `-log` | the same with a token bucket, fixed window, sliding window counter, sliding log |
//! | `ours-redis-flood` | RedisStore, GCRA 10/s, one key: nearly every answer a 429 |
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use http::request::Parts;
use tower_ratelimit::key::{ClientIp, Global};
use tower_ratelimit::layer::RateLimitLayer;
use tower_ratelimit::{Limit, MemoryStore, Quota, RedisStore};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map_or("bare", String::as_str).to_owned();
    let port: u16 = args.get(2).map_or(Ok(3100), |p| p.parse())?;
    let url = args
        .get(3)
        .cloned()
        .unwrap_or_else(|| "redis://127.0.0.1:6379/".into());
    let app = limited(
        Router::new().route("/", get(|| async { "hello" })),
        &mode,
        &url,
    )
    .await?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}

async fn limited(app: Router, mode: &str, url: &str) -> Result<Router, Error> {
    // 1000 per second per key with bursts of 65535: tower-rate-limit-redis'
    // largest capacity and 1 ms emission interval; 10k keys share the load.
    let per_key_with = |quota: Quota, headers: bool| -> Result<RateLimitLayer, Error> {
        let store = RedisStore::builder(url).prefix("bench").build()?;
        Ok(RateLimitLayer::builder()
            .store(store)
            .limit(Limit::new("hello", quota)?, rotated)
            .timeout(Duration::from_millis(300))
            .ietf_headers(headers)
            .build()?)
    };
    let per_key = |quota: Quota| per_key_with(quota, true);
    Ok(match mode {
        "bare" => app,
        "governor" => {
            let config = tower_governor::governor::GovernorConfigBuilder::default()
                .per_nanosecond(1)
                .burst_size(1_000_000_000)
                .finish()
                .ok_or("governor configuration")?;
            app.layer(tower_governor::GovernorLayer::new(Arc::new(config)))
        }
        "governor-headers" => {
            let config = tower_governor::governor::GovernorConfigBuilder::default()
                .per_nanosecond(1)
                .burst_size(1_000_000_000)
                .use_headers()
                .finish()
                .ok_or("governor configuration")?;
            app.layer(tower_governor::GovernorLayer::new(Arc::new(config)))
        }
        "ours-mem" | "ours-mem-noheaders" => {
            // 1000 per microsecond per client IP: never reached
            let limit = Limit::new(
                "per-ip",
                Quota::per_second(1_000_000_000)
                    .allow_burst(1_000_000_000)
                    .gcra(),
            )?;
            app.layer(
                RateLimitLayer::builder()
                    .store(MemoryStore::new())
                    .limit(limit, ClientIp::peer())
                    .ietf_headers(mode == "ours-mem")
                    .build()?,
            )
        }
        "trlr" => {
            let conn = redis::Client::open(url)?
                .get_multiplexed_async_connection()
                .await?;
            app.layer(
                tower_rate_limit_redis::RateLimitLayer::builder()
                    .conn(conn)
                    .key_resolver(Rotated)
                    .capacity(u16::MAX)
                    .emission_interval(Duration::from_millis(1))
                    .timeout(Duration::from_millis(300))
                    .build(),
            )
        }
        "ours-redis" => app.layer(per_key(Quota::per_second(1000).allow_burst(65_535).gcra())?),
        "ours-redis-noheaders" => app.layer(per_key_with(
            Quota::per_second(1000).allow_burst(65_535).gcra(),
            false,
        )?),
        "ours-redis-tb" => app.layer(per_key(
            Quota::per_second(1000).allow_burst(65_535).token_bucket(),
        )?),
        "ours-redis-fw" => app.layer(per_key(Quota::per_second(65_535).fixed_window())?),
        "ours-redis-sw" => app.layer(per_key(Quota::per_second(65_535).sliding_window())?),
        // a short window keeps each key's log to the grant or two of the last second
        "ours-redis-log" => app.layer(per_key(Quota::per_second(1000).sliding_log())?),
        "ours-redis-flood" => {
            let store = RedisStore::builder(url).prefix("flood").build()?;
            app.layer(
                RateLimitLayer::builder()
                    .store(store)
                    .limit(
                        Limit::new("global", Quota::per_second(10).allow_burst(10).gcra())?,
                        Global,
                    )
                    .timeout(Duration::from_millis(300))
                    .build()?,
            )
        }
        other => return Err(format!("unknown mode {other}").into()),
    })
}

static NEXT: AtomicU64 = AtomicU64::new(0);

/// The next of 10k keys, the same sequence for every limiter.
fn next_key(path: &str) -> String {
    format!("{path}{}", NEXT.fetch_add(1, Ordering::Relaxed) % 10_000)
}

fn rotated(parts: &Parts) -> Option<String> {
    Some(next_key(parts.uri.path()))
}

#[derive(Clone)]
struct Rotated;

impl tower_rate_limit_redis::KeyResolver for Rotated {
    type Key = String;
    type ErrorBody = axum::body::Body;
    fn key<T>(
        &self,
        request: &http::Request<T>,
    ) -> Result<String, http::Response<Self::ErrorBody>> {
        Ok(next_key(request.uri().path()))
    }
}
