//! Property tests: random (time step, cost) sequences against plain reference
//! models, on both stores; and the memory store against Redis on random
//! multi-limit sequences with reservations.

mod common;

use std::time::Duration;

use common::{assert_keys_have_ttl, redis_store_with_clock, unique_prefix, T0};
use proptest::prelude::*;
use tower_ratelimit::{Decision, Limit, Limiter, ManualClock, MemoryStore, Quota, Verdict};

/// A plain model of one algorithm for one key: exact i128 arithmetic, no
/// shared code with the crate.
#[derive(Debug, Clone)]
enum Model {
    /// (n, w, grants as (time, cost))
    Log(i128, i128, Vec<(i128, i128)>),
    /// (capacity, refill, period, level in 1/period tokens, last time)
    Bucket(i128, i128, i128, i128, i128),
    /// (burst, rate, period, tat scaled by rate or None when fresh)
    Gcra(i128, i128, i128, Option<i128>),
    /// (n, w, window index, count)
    Fixed(i128, i128, i128, i128),
    /// (n, w, window index, previous, current)
    Sliding(i128, i128, i128, i128, i128),
}

impl Model {
    fn new(q: &Quota) -> Model {
        let w = q.window().as_micros() as i128;
        let cap = q.capacity() as i128;
        match q.algorithm() {
            tower_ratelimit::Algorithm::SlidingLog => Model::Log(cap, w, vec![]),
            tower_ratelimit::Algorithm::FixedWindow => Model::Fixed(cap, w, -1, 0),
            tower_ratelimit::Algorithm::SlidingWindow => Model::Sliding(cap, w, -1, 0, 0),
            _ => unreachable!("buckets are built by the tests"),
        }
    }

    /// Whether `cost` fits at `t` (t >= every time seen), without granting.
    fn fits(&self, t: i128, cost: i128) -> bool {
        match self {
            Model::Log(n, w, grants) => {
                grants
                    .iter()
                    .filter(|g| g.0 > t - w)
                    .map(|g| g.1)
                    .sum::<i128>()
                    + cost
                    <= *n
            }
            Model::Bucket(c, r, p, level, last) => (*level + (t - last) * r).min(c * p) >= cost * p,
            Model::Gcra(b, r, p, tat) => match tat {
                None => cost <= *b,
                Some(tat) => {
                    // on time in the tick holding the TAT (t <= ceil(tat))
                    let base = if (tat + r - 1).div_euclid(*r) < t {
                        t * r
                    } else {
                        *tat
                    };
                    base - t * r + cost * p <= b * p
                }
            },
            Model::Fixed(n, w, idx, count) => {
                let used = if t.div_euclid(*w) == *idx { *count } else { 0 };
                used + cost <= *n
            }
            Model::Sliding(n, w, idx, prev, cur) => {
                let (p, c) = Self::sliding_counts(*w, *idx, *prev, *cur, t);
                let rem = w - t.rem_euclid(*w);
                // prev * rem / w + c + cost <= n, exactly
                p * rem + (c + cost) * w <= n * w
            }
        }
    }

    fn sliding_counts(w: i128, idx: i128, prev: i128, cur: i128, t: i128) -> (i128, i128) {
        let now_idx = t.div_euclid(w);
        if now_idx == idx {
            (prev, cur)
        } else if now_idx == idx + 1 {
            (cur, 0)
        } else {
            (0, 0)
        }
    }

    fn grant(&mut self, t: i128, cost: i128) {
        match self {
            Model::Log(_, _, grants) => grants.push((t, cost)),
            Model::Bucket(c, r, p, level, last) => {
                *level = (*level + (t - *last) * *r).min(*c * *p) - cost * *p;
                *last = t;
            }
            Model::Gcra(_, r, p, tat) => {
                let base = match tat {
                    Some(tat) if (*tat + *r - 1).div_euclid(*r) >= t => *tat,
                    _ => t * *r,
                };
                *tat = Some(base + cost * *p);
            }
            Model::Fixed(_, w, idx, count) => {
                let i = t.div_euclid(*w);
                *count = if i == *idx { *count + cost } else { cost };
                *idx = i;
            }
            Model::Sliding(_, w, idx, prev, cur) => {
                let (p, c) = Self::sliding_counts(*w, *idx, *prev, *cur, t);
                *idx = t.div_euclid(*w);
                *prev = p;
                *cur = c + cost;
            }
        }
    }

    fn remaining(&self, t: i128) -> i128 {
        match self {
            Model::Log(n, w, grants) => {
                n - grants
                    .iter()
                    .filter(|g| g.0 > t - w)
                    .map(|g| g.1)
                    .sum::<i128>()
            }
            Model::Bucket(c, r, p, level, last) => (*level + (t - last) * r).min(c * p) / p,
            Model::Gcra(b, r, p, tat) => match tat {
                Some(tat) if *tat > t * r => ((b * p - (tat - t * r)).div_euclid(*p)).clamp(0, *b),
                _ => *b,
            },
            Model::Fixed(n, w, idx, count) => n - if t.div_euclid(*w) == *idx { *count } else { 0 },
            Model::Sliding(n, w, idx, prev, cur) => {
                let (p, c) = Self::sliding_counts(*w, *idx, *prev, *cur, t);
                let rem = w - t.rem_euclid(*w);
                (n - c - (p * rem + w - 1).div_euclid(*w)).max(0)
            }
        }
    }

    fn capacity(&self) -> i128 {
        match self {
            Model::Log(n, ..) | Model::Fixed(n, ..) | Model::Sliding(n, ..) => *n,
            Model::Bucket(c, ..) => *c,
            Model::Gcra(b, ..) => *b,
        }
    }

    /// The first time >= t at which `cost` fits: a binary search, which is
    /// only valid because feasibility never decreases with time.
    fn earliest(&self, t: i128, cost: i128) -> i128 {
        let (mut lo, mut hi) = (t, t + 1);
        while !self.fits(hi, cost) {
            hi = t + (hi - t) * 2;
        }
        if self.fits(lo, cost) {
            return lo;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.fits(mid, cost) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi
    }
}

fn quota_strategy() -> impl Strategy<Value = Quota> {
    let n = 1u64..8;
    let w = 1u64..3_000_000; // us; sliding window weights are exact below 2^20 us
    prop_oneof![
        (n.clone(), w.clone()).prop_map(|(n, w)| Quota::sliding_log(n, Duration::from_micros(w))),
        (n.clone(), 1u64..4, w.clone()).prop_map(|(c, r, p)| Quota::token_bucket(
            c,
            r,
            Duration::from_micros(p)
        )),
        (1u64..20, w.clone(), n.clone()).prop_map(|(r, p, b)| Quota::gcra(
            r,
            Duration::from_micros(p),
            b
        )),
        (n.clone(), w.clone()).prop_map(|(n, w)| Quota::fixed_window(n, Duration::from_micros(w))),
        (n, 1u64..1_000_000).prop_map(|(n, w)| Quota::sliding_window(n, Duration::from_micros(w))),
    ]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// A quota and its model, built side by side from the same numbers.
#[derive(Debug, Clone)]
struct Case {
    quota: Quota,
    model: Model,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    let n = 1u64..8;
    let w = 1u64..3_000_000;
    prop_oneof![
        quota_strategy()
            .prop_filter("window algorithms", |q| matches!(
                q.algorithm(),
                tower_ratelimit::Algorithm::SlidingLog
                    | tower_ratelimit::Algorithm::FixedWindow
                    | tower_ratelimit::Algorithm::SlidingWindow
            ))
            .prop_map(|q| Case {
                model: Model::new(&q),
                quota: q
            }),
        (n.clone(), 1u64..4, w.clone()).prop_map(|(c, r, p)| Case {
            quota: Quota::token_bucket(c, r, Duration::from_micros(p)),
            model: Model::Bucket(c as i128, r as i128, p as i128, (c * p) as i128, T0 as i128),
        }),
        (1u64..20, w, n).prop_map(|(r, p, b)| Case {
            quota: Quota::gcra(r, Duration::from_micros(p), b),
            model: Model::Gcra(b as i128, r as i128, p as i128, None),
        }),
    ]
}

async fn check_against_model(
    limiter: &Limiter,
    clock: &ManualClock,
    case: &Case,
    steps: &[(u64, u64)],
) {
    let mut model = case.model.clone();
    let mut now = T0 as i128;
    clock.set(T0);
    for (i, &(step, cost)) in steps.iter().enumerate() {
        now += step as i128;
        clock.set(now as i64);
        let d: Decision = limiter.check("k", cost).await.expect("decision");
        let cost = cost as i128;
        let ctx = format!(
            "step {i} at +{} cost {cost}: {model:?} {d:?}",
            now - T0 as i128
        );
        if cost > model.capacity() {
            assert_eq!(d.verdict(), Verdict::CostExceedsCapacity, "{ctx}");
            continue;
        }
        if model.fits(now, cost) {
            assert!(d.is_allowed(), "model allows, {ctx}");
            if cost > 0 {
                model.grant(now, cost);
            }
        } else {
            let retry = model.earliest(now, cost) - now;
            assert_eq!(
                d.retry_after(),
                Some(Duration::from_micros(retry as u64)),
                "retry_after, {ctx}"
            );
        }
        assert_eq!(
            d.remaining() as i128,
            model.remaining(now),
            "remaining, {ctx}"
        );
    }
}

fn steps_strategy() -> impl Strategy<Value = Vec<(u64, u64)>> {
    proptest::collection::vec(
        (
            prop_oneof![Just(0u64), 0u64..50_000, 0u64..4_000_000],
            0u64..9,
        ),
        1..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn memory_store_matches_the_reference_models(case in case_strategy(), steps in steps_strategy()) {
        let limit = Limit::new("p", case.quota).expect("valid quota");
        let clock = ManualClock::new(T0);
        let limiter = Limiter::new(MemoryStore::with_clock(clock.clone()), limit);
        runtime().block_on(check_against_model(&limiter, &clock, &case, &steps));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn redis_store_matches_the_reference_models(case in case_strategy(), steps in steps_strategy()) {
        let limit = Limit::new("p", case.quota).expect("valid quota");
        let clock = ManualClock::new(T0);
        let prefix = unique_prefix("prop-model");
        let limiter = Limiter::new(redis_store_with_clock(&prefix, &clock), limit);
        runtime().block_on(check_against_model(&limiter, &clock, &case, &steps));
        assert_keys_have_ttl(&prefix);
    }

    /// Two or three limits, shared or separate keys, reservations: the Lua
    /// scripts and their Rust mirrors give identical decisions.
    #[test]
    fn memory_and_redis_agree_on_multi_limit_reservations(
        quotas in proptest::collection::vec(quota_strategy(), 1..4),
        steps in proptest::collection::vec(
            (prop_oneof![Just(0u64), 0u64..100_000, 0u64..3_000_000], 0u64..9, prop_oneof![Just(0u64), 0u64..2_000_000], 0usize..3),
            1..40),
    ) {
        let clock = ManualClock::new(T0);
        let prefix = unique_prefix("prop-diff");
        let limits: Vec<Limit> = quotas.iter().enumerate().map(|(i, q)| Limit::new(format!("l{i}"), *q).expect("valid")).collect();
        let with = |limiter: tower_ratelimit::LimiterBuilder| limits.iter().cloned().fold(limiter, |b, l| b.limit(l)).build().expect("limiter");
        let memory = with(Limiter::builder(MemoryStore::with_clock(clock.clone())));
        let redis = with(Limiter::builder(redis_store_with_clock(&prefix, &clock)));
        runtime().block_on(async {
            let mut now = T0;
            for (i, &(step, cost, max_wait, keys)) in steps.iter().enumerate() {
                now += step as i64;
                clock.set(now);
                // 0: one key for all limits; 1, 2: a key per limit from a small set
                let names: Vec<String> = (0..limits.len()).map(|l| format!("k{}", (l + keys) % 2)).collect();
                let keys: Vec<&str> = if keys == 0 { vec!["shared"] } else { names.iter().map(String::as_str).collect() };
                let wait = Duration::from_micros(max_wait);
                let m = memory.decide(&keys, cost, wait).await.expect("memory");
                let r = redis.decide(&keys, cost, wait).await.expect("redis");
                prop_assert_eq!(&m, &r, "step {} (cost {}, max_wait {})", i, cost, max_wait);
            }
            Ok(())
        })?;
        assert_keys_have_ttl(&prefix);
    }
}
