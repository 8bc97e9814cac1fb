//! `api REDIS_URL SECONDS [IN_FLIGHT] [COALESCE]`: decisions per second
//! through `Limiter::check` over a RedisStore (GCRA, 10k keys, never
//! reached), with IN_FLIGHT (50) decisions in flight, coalesced unless
//! COALESCE is 0; prints `decisions/s N redis_cpu_us X`, X the Redis
//! server's CPU time (`used_cpu_user + used_cpu_sys` of `INFO cpu`) over the
//! run per decision.
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
    let coalesce = args.get(4).is_none_or(|s| s != "0");
    let store = RedisStore::builder(url.clone())
        .prefix("api")
        .coalesce_decisions(coalesce)
        .build()?;
    let mut info = redis::Client::open(url)?.get_connection()?;
    let cpu = |conn: &mut redis::Connection| -> Result<f64, Error> {
        let text: String = redis::cmd("INFO").arg("cpu").query(conn)?;
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        Ok(field("used_cpu_user:") + field("used_cpu_sys:"))
    };
    let limit = Limit::new("api", Quota::gcra(1000, Duration::from_secs(1), 65_535))?;
    let limiter = Limiter::builder(store)
        .limit(limit)
        .timeout(Duration::from_secs(1))
        .build()?;
    limiter.check("warm-up", 1).await?;
    let cpu_before = cpu(&mut info)?;
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
    let decisions = done.load(Ordering::Relaxed) as f64;
    let cpu_us = (cpu(&mut info)? - cpu_before) * 1e6 / decisions.max(1.0);
    println!(
        "decisions/s {:.0} redis_cpu_us {cpu_us:.2}",
        decisions / seconds as f64
    );
    Ok(())
}
