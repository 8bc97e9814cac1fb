//! `layer_cost MODE N`: N requests through the hello-world app of MODE
//! (`bare`, `governor` or `ours-mem`), in process, one at a time: a program
//! to run under `valgrind --tool=callgrind` and see where a request's
//! instructions go (no sockets, no HTTP parsing).
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::Router;
use tower::ServiceExt;
use tower_ratelimit::key::ClientIp;
use tower_ratelimit::layer::RateLimitLayer;
use tower_ratelimit::{Limit, MemoryStore, Quota};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map_or("ours-mem", String::as_str);
    let n: usize = args.get(2).map_or(Ok(100_000), |n| n.parse())?;
    let app = Router::new().route("/", get(|| async { "hello" }));
    let app = match mode {
        "bare" => app,
        "governor" => {
            let config = tower_governor::governor::GovernorConfigBuilder::default()
                .per_nanosecond(1)
                .burst_size(1_000_000_000)
                .finish()
                .ok_or("governor configuration")?;
            app.layer(tower_governor::GovernorLayer::new(Arc::new(config)))
        }
        _ => {
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
                    .build()?,
            )
        }
    };
    let peer = ConnectInfo(SocketAddr::from(([203, 0, 113, 7], 40_000)));
    let mut ok = 0;
    for _ in 0..n {
        let mut request = http::Request::get("/").body(Body::empty())?;
        request.extensions_mut().insert(peer);
        let response = app.clone().oneshot(request).await?;
        ok += usize::from(response.status().is_success());
    }
    println!("{ok} of {n} answered 2xx");
    Ok(())
}
