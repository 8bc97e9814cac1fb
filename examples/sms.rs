//! The programmatic API without HTTP: at most 3 SMS per phone number per
//! minute (exact sliding window), shared through Redis when `REDIS_URL` is set.
//!
//! ```text
//! cargo run --example sms                    # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example sms
//! ```

use std::time::Duration;

use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota, RedisStore, Verdict};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let sms = Limit::new("sms", Quota::per_minute(3).sliding_log())?;
    let limiter = match std::env::var("REDIS_URL") {
        Ok(url) => {
            println!("store: Redis at {url}");
            Limiter::new(RedisStore::builder(url).prefix("example").build()?, sms)
        }
        Err(_) => {
            println!("store: in memory (set REDIS_URL to share limits through Redis)");
            Limiter::new(MemoryStore::new(), sms)
        }
    };
    let phone = "+15550100";
    limiter.reset(phone).await?;
    for attempt in 1..=5 {
        let decision = limiter.check(phone, 1).await?;
        match decision.verdict() {
            Verdict::Allowed => println!(
                "SMS {attempt}: sent, {} left this minute",
                decision.remaining()
            ),
            Verdict::Denied { retry_after } => {
                println!("SMS {attempt}: refused, retry in {retry_after:?}")
            }
            other => println!("SMS {attempt}: {other:?}"),
        }
    }
    // A batch job that would rather wait than fail: reserve a slot and sleep.
    let batch = Limit::new("batch", Quota::per_second(5).allow_burst(1).gcra())?;
    let jobs = Limiter::new(MemoryStore::new(), batch);
    for job in 1..=3 {
        let d = jobs.acquire("nightly", 1, Duration::from_secs(2)).await?;
        println!("job {job}: started after waiting {:?}", d.delay());
    }
    Ok(())
}
