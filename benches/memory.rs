//! Bytes per stored key in `MemoryStore`: the growth of the process's
//! resident memory (`/proc/self/statm`, so allocator overhead and table slack
//! count) while 1,000,000 distinct keys are stored, one algorithm per child
//! process so that no case reuses memory another freed.
//!
//! Keys are `user-0` .. `user-999999` (6 to 11 bytes, stored inline); the
//! clock stands still, so every state stays alive. Linux only.
//!
//! `cargo bench --bench memory`

use std::process::Command;
use std::time::Duration;

use tower_ratelimit::{Limit, Limiter, ManualClock, MemoryStore, Quota};

const KEYS: usize = 1_000_000;
const CASE: &str = "TOWER_RATELIMIT_MEMORY_CASE";

fn cases() -> [(&'static str, Quota); 5] {
    let minute = Duration::from_secs(60);
    [
        ("gcra", Quota::rate(10, minute).allow_burst(10).gcra()),
        (
            "token_bucket",
            Quota::rate(1, minute).allow_burst(10).token_bucket(),
        ),
        ("fixed_window", Quota::rate(10, minute).fixed_window()),
        ("sliding_window", Quota::rate(10, minute).sliding_window()),
        (
            "sliding_log (1 grant)",
            Quota::rate(10, minute).sliding_log(),
        ),
    ]
}

/// Resident memory in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages");
    pages * 4096
}

fn measure(name: &str, quota: Quota) {
    let store = MemoryStore::builder()
        .clock(ManualClock::new(1_800_000_000_000_000))
        .max_keys(KEYS)
        .build()
        .expect("store");
    let limiter = Limiter::new(store.clone(), Limit::new("l", quota).expect("limit"));
    // No Tokio runtime: no background task, nothing else allocates.
    futures::executor::block_on(async {
        limiter.check("warm-up", 1).await.expect("decision");
        limiter.reset("warm-up").await.expect("reset");
        let before = rss();
        let mut key = String::with_capacity(16);
        for i in 0..KEYS {
            key.clear();
            std::fmt::Write::write_fmt(&mut key, format_args!("user-{i}")).expect("key");
            let decision = limiter.check(&key, 1).await.expect("decision");
            assert!(decision.is_allowed());
        }
        let grown = rss() - before;
        assert_eq!(store.len(), KEYS);
        println!(
            "{name:>22}: {:6.1} bytes per key ({} keys, resident memory +{:.1} MiB)",
            grown as f64 / KEYS as f64,
            KEYS,
            grown as f64 / (1 << 20) as f64
        );
    });
}

fn main() {
    if let Ok(case) = std::env::var(CASE) {
        let (name, quota) = cases()
            .into_iter()
            .find(|(name, _)| *name == case)
            .expect("a known case");
        measure(name, quota);
        return;
    }
    let exe = std::env::current_exe().expect("this program");
    for (name, _) in cases() {
        let out = Command::new(&exe)
            .env(CASE, name)
            .output()
            .expect("run a case");
        print!("{}", String::from_utf8_lossy(&out.stdout));
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
    }
}
