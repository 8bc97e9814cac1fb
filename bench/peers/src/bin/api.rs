//! `api REDIS_URL SECONDS [IN_FLIGHT]`: decisions per second through
//! `Limiter::check` over a RedisStore (GCRA, 10k keys, never reached), with
//! IN_FLIGHT (50) decisions in flight; prints `decisions/s N`.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tower_ratelimit::{Limit, Limiter, Quota, RedisStore};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let url = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "redis://127.0.0.1:6379/".into());
    let seconds: u64 = args.get(2).map_or(Ok(5), |s| s.parse())?;
    let in_flight: usize = args.get(3).map_or(Ok(50), |s| s.parse())?;
    let store = RedisStore::builder(url).prefix("api").build()?;
    let limit = Limit::new("api", Quota::gcra(1000, Duration::from_secs(1), 65_535))?;
    let limiter = Limiter::builder(store)
        .limit(limit)
        .timeout(Duration::from_secs(1))
        .build()?;
    limiter.check("warm-up", 1).await?;
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(seconds);
    let tasks: Vec<_> = (0..in_flight)
        .map(|task| {
            let (limiter, done) = (limiter.clone(), done.clone());
            tokio::spawn(async move {
                let mut i = task as u64;
                while Instant::now() < until {
                    if limiter.check(format!("k{}", i % 10_000), 1).await.is_ok() {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    i += in_flight as u64;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await?;
    }
    println!(
        "decisions/s {:.0}",
        done.load(Ordering::Relaxed) as f64 / seconds as f64
    );
    Ok(())
}
