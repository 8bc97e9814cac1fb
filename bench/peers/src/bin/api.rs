//! `api REDIS_URL SECONDS [IN_FLIGHT] [COALESCE] [HOT]`: decisions per
//! second through `Limiter::check` over a RedisStore (GCRA, never
//! reached), with IN_FLIGHT (50) decisions in flight, coalesced unless
//! COALESCE is 0, over 10k keys; with HOT, over one key: hot
//! (`Limit::hot`, batches of HOT permits held 100 ms) when HOT > 0, every
//! decision in Redis when HOT is 0. Prints `decisions/s N redis_cpu_us X
//! calls_per_decision C`: X the Redis server's CPU time (`used_cpu_user +
//! used_cpu_sys` of `INFO cpu`) over the run per decision, C the calls of
//! the library (`FCALL`) per decision.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tower_ratelimit::{HotKey, Limit, Limiter, Quota, RedisStore};

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
    let hot: Option<u64> = args.get(5).map(|s| s.parse()).transpose()?;
    let store = RedisStore::builder(url.clone())
        .prefix("api")
        .coalesce_decisions(coalesce)
        .build()?;
    let mut info = redis::Client::open(url)?.get_connection()?;
    // (the Redis CPU time so far, s, and the library's calls)
    let cpu = |conn: &mut redis::Connection| -> Result<(f64, f64), Error> {
        let text: String = redis::cmd("INFO").arg("all").query(conn)?;
        let field = |name: &str| {
            text.lines()
                .find_map(|l| {
                    let rest = l.strip_prefix(name)?;
                    rest.split(',').next()?.trim().parse::<f64>().ok()
                })
                .unwrap_or(0.0)
        };
        Ok((
            field("used_cpu_user:") + field("used_cpu_sys:"),
            field("cmdstat_fcall:calls="),
        ))
    };
    let limit = match hot {
        None => Limit::new("api", Quota::per_second(1000).allow_burst(65_535).gcra())?,
        Some(permits) => {
            let global = Limit::new("api", Quota::per_second(100_000_000).gcra())?;
            if permits > 0 {
                global.with_hot_key(HotKey::new(permits, Duration::from_millis(100))?)?
            } else {
                global
            }
        }
    };
    let keys = if hot.is_some() { 1 } else { 10_000 };
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
                    if limiter.check(format!("k{}", i % keys), 1).await.is_ok() {
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
    let after = cpu(&mut info)?;
    let cpu_us = (after.0 - cpu_before.0) * 1e6 / decisions.max(1.0);
    let per_decision = (after.1 - cpu_before.1) / decisions.max(1.0);
    println!(
        "decisions/s {:.0} redis_cpu_us {cpu_us:.2} calls_per_decision {per_decision:.4}",
        decisions / seconds as f64
    );
    Ok(())
}
