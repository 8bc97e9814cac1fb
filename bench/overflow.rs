//! A full `MemoryStore` under a flood of made-up keys (issue 39, item 2):
//! 2,000,000 made-up keys against `max_keys` of 100,000, with 1,000
//! legitimate clients that first appear while it runs, each sending half
//! its quota (its requests spread over the flood), and 100 greedy clients
//! that also appear during it and send three times their quota. For each
//! algorithm (and a concurrency limit), in a store of its own:
//!
//! - the share of the legitimate clients' requests refused (target: at
//!   most 1%);
//! - the states held at the end and at most during the run (the bound),
//!   and the resident memory the run added;
//! - the over-count: the most any greedy client was granted beyond its
//!   quota, against the stated bound, its quota plus what each state given
//!   up for it had used (seen as its `remaining` going back up: the run
//!   spans 2 s of a 60 s quota, too little for a refill to add one).
//!
//! The clock moves 1 us per made-up key (2 s in all), so no state expires:
//! the store stays full and every new key must take the place of another.
//! `FLOOD_REQUESTS` (default 1) sets how many requests each made-up key
//! sends (at most its quota). Linux (resident memory from
//! `/proc/self/statm`).
//!
//! `cargo bench --bench overflow`

use std::time::{Duration, Instant};

use tower_ratelimit::{Limit, Limiter, ManualClock, MemoryStore, Quota};

const MAX_KEYS: usize = 100_000;
const FLOOD: usize = 2_000_000;
const CLIENTS: usize = 1_000;
const GREEDY: usize = 100;
const QUOTA: u64 = 10;

fn limits() -> Vec<Limit> {
    let minute = Duration::from_secs(60);
    let mut limits: Vec<Limit> = [
        ("sliding_log", Quota::rate(QUOTA, minute).sliding_log()),
        (
            "token_bucket",
            Quota::rate(QUOTA, minute).allow_burst(QUOTA).token_bucket(),
        ),
        ("gcra", Quota::rate(QUOTA, minute).allow_burst(QUOTA).gcra()),
        ("fixed_window", Quota::rate(QUOTA, minute).fixed_window()),
        (
            "sliding_window",
            Quota::rate(QUOTA, minute).sliding_window(),
        ),
    ]
    .into_iter()
    .map(|(name, quota)| Limit::new(name, quota).expect("limit"))
    .collect();
    limits.push(Limit::concurrency("concurrency", QUOTA, minute).expect("limit"));
    limits
}

/// Resident memory in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// A client that is not made up: when it sends, what it was granted, and
/// what states given up for it had used.
struct Client {
    key: String,
    /// Flood positions at which it sends, in order.
    at: Vec<usize>,
    granted: u64,
    refused: u64,
    /// Its `remaining` after its last request.
    remaining: Option<u64>,
    lost: u64,
}

impl Client {
    fn new(key: String, first: usize, requests: u64, stride: usize) -> Self {
        let at = (0..requests as usize).map(|j| first + j * stride).collect();
        Self {
            key,
            at,
            granted: 0,
            refused: 0,
            remaining: None,
            lost: 0,
        }
    }

    async fn send(&mut self, limiter: &Limiter) {
        let decision = limiter.check(&self.key, 1).await.expect("decision");
        let now = decision.remaining();
        if let Some(before) = self.remaining {
            // within the run, `remaining` only goes back up when the state
            // was given up, forgetting what it had used
            let expected = before - u64::from(decision.is_allowed() && before > 0);
            if now > expected {
                self.lost += QUOTA - before;
            }
        }
        self.remaining = Some(now);
        if decision.is_allowed() {
            self.granted += 1;
        } else {
            self.refused += 1;
        }
    }
}

fn run(limit: Limit, flood_requests: u64) {
    let name = limit.name().to_owned();
    let clock = ManualClock::new(1_800_000_000_000_000);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(MAX_KEYS)
        .build()
        .expect("store");
    let limiter = Limiter::new(store.clone(), limit);
    // legitimate clients appear over the flood's first 90%, each sending
    // half its quota spread over 10% of it; the greedy ones likewise,
    // three times their quota
    let span = FLOOD / 10;
    let mut clients: Vec<Client> = (0..CLIENTS)
        .map(|c| {
            let first = c * (FLOOD - span) / CLIENTS;
            Client::new(format!("client-{c}"), first, QUOTA / 2, span / 5)
        })
        .collect();
    let mut greedy: Vec<Client> = (0..GREEDY)
        .map(|c| {
            let first = c * (FLOOD - span) / GREEDY + 7;
            Client::new(format!("greedy-{c}"), first, 3 * QUOTA, span / 30)
        })
        .collect();
    let mut due: Vec<(usize, bool, usize)> = Vec::new();
    for (i, c) in clients.iter().enumerate() {
        due.extend(c.at.iter().map(|&at| (at, false, i)));
    }
    for (i, c) in greedy.iter().enumerate() {
        due.extend(c.at.iter().map(|&at| (at, true, i)));
    }
    due.sort_unstable();
    let started = Instant::now();
    let mut most = 0;
    futures::executor::block_on(async {
        let mut next = 0;
        let mut key = String::with_capacity(24);
        for i in 0..FLOOD {
            key.clear();
            std::fmt::Write::write_fmt(&mut key, format_args!("made-up-{i}")).expect("key");
            for _ in 0..flood_requests {
                limiter.check(&key, 1).await.expect("decision");
            }
            while let Some(&(at, is_greedy, c)) = due.get(next) {
                if at > i {
                    break;
                }
                let client = if is_greedy {
                    &mut greedy[c]
                } else {
                    &mut clients[c]
                };
                client.send(&limiter).await;
                next += 1;
            }
            if i % 1024 == 0 {
                most = most.max(store.len());
            }
            clock.advance(Duration::from_micros(1));
        }
    });
    let elapsed = started.elapsed();
    let (granted, refused) = clients
        .iter()
        .fold((0, 0), |(g, r), c| (g + c.granted, r + c.refused));
    let over = greedy
        .iter()
        .map(|c| c.granted.saturating_sub(QUOTA))
        .max()
        .unwrap_or(0);
    let within = greedy.iter().all(|c| c.granted <= QUOTA + c.lost);
    let given_up = greedy.iter().filter(|c| c.lost > 0).count();
    println!(
        "{name:>14}: legitimate refused {refused}/{} ({:.3}%); states {} at the end, at most {most} \
         (bound {MAX_KEYS}), process resident {:.0} MiB; greedy over-count at most {over} \
         (bound: quota {QUOTA} + what states given up had used; {given_up} of {GREEDY} greedy \
         clients' states given up; bound held: {within}); {:.1} s",
        granted + refused,
        100.0 * refused as f64 / (granted + refused).max(1) as f64,
        store.len(),
        rss() as f64 / (1 << 20) as f64,
        elapsed.as_secs_f64(),
    );
}

fn main() {
    let flood_requests = std::env::var("FLOOD_REQUESTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
        .clamp(1, QUOTA);
    let only = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    println!(
        "{FLOOD} made-up keys ({flood_requests} request(s) each), max_keys {MAX_KEYS}, \
         {CLIENTS} clients sending {} of {QUOTA}, {GREEDY} greedy clients sending {}",
        QUOTA / 2,
        3 * QUOTA
    );
    for limit in limits() {
        if only.as_deref().is_some_and(|o| o != limit.name()) {
            continue;
        }
        run(limit, flood_requests);
    }
}
