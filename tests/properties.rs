//! Property tests: random (time step, cost) sequences against plain reference
//! models, on both stores; and the memory store against Redis on random
//! multi-limit sequences with reservations.

mod common;

use std::time::Duration;

use common::{
    assert_keys_expire, patient_limiter, redis_store_with_clock, state_lifetime, unique_prefix,
    PATIENT, T0, TEST_CLOCK_SLACK,
};
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
        (n.clone(), w.clone())
            .prop_map(|(n, w)| Quota::rate(n, Duration::from_micros(w)).sliding_log()),
        (n.clone(), 1u64..4, w.clone()).prop_map(|(c, r, p)| Quota::rate(
            r,
            Duration::from_micros(p)
        )
        .allow_burst(c)
        .token_bucket()),
        (1u64..20, w.clone(), n.clone()).prop_map(|(r, p, b)| Quota::rate(
            r,
            Duration::from_micros(p)
        )
        .allow_burst(b)
        .gcra()),
        (n.clone(), w.clone())
            .prop_map(|(n, w)| Quota::rate(n, Duration::from_micros(w)).fixed_window()),
        (n, 1u64..1_000_000)
            .prop_map(|(n, w)| Quota::rate(n, Duration::from_micros(w)).sliding_window()),
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
            quota: Quota::rate(r, Duration::from_micros(p))
                .allow_burst(c)
                .token_bucket(),
            model: Model::Bucket(c as i128, r as i128, p as i128, (c * p) as i128, T0 as i128),
        }),
        (1u64..20, w, n).prop_map(|(r, p, b)| Case {
            quota: Quota::rate(r, Duration::from_micros(p))
                .allow_burst(b)
                .gcra(),
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
        let limiter = patient_limiter(MemoryStore::with_clock(clock.clone()), limit);
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
        let limiter = patient_limiter(redis_store_with_clock(&prefix, &clock), limit.clone());
        runtime().block_on(check_against_model(&limiter, &clock, &case, &steps));
        assert_keys_expire(&prefix, state_lifetime([&limit], Duration::ZERO) + TEST_CLOCK_SLACK);
    }

    /// Two or three limits, shared or separate keys, reservations: the Lua
    /// scripts and their Rust mirrors give identical decisions.
    #[test]
    fn memory_and_redis_agree_on_multi_limit_reservations(
        quotas in proptest::collection::vec(quota_strategy(), 1..4),
        steps in proptest::collection::vec(
            (prop_oneof![Just(0i64), 0i64..100_000, 0i64..3_000_000], 0u64..9, prop_oneof![Just(0u64), 0u64..2_000_000], 0usize..3),
            1..40),
    ) {
        memory_and_redis_agree(&quotas, &steps)?;
    }

    /// The same after the clock steps back from where the states were
    /// written, by up to a few windows or by a year: states believed ahead,
    /// and states moved back to the decision's clock, decide identically.
    /// (The states are all written at one instant: a decision at a later
    /// instant ahead would make the memory store drop states that had
    /// expired by then, which Redis, whose expiries run on real time rather
    /// than the test clock, would still hold after the step back.)
    #[test]
    fn memory_and_redis_agree_after_a_backward_clock_step(
        quotas in proptest::collection::vec(quota_strategy(), 1..4),
        lead in prop_oneof![0i64..3_000_000, Just(YEAR)],
        ahead in proptest::collection::vec(
            (0u64..9, prop_oneof![Just(0u64), 0u64..2_000_000], 0usize..3), 1..6),
        steps in proptest::collection::vec(
            (prop_oneof![Just(0i64), 0i64..100_000, 0i64..3_000_000], 0u64..9, prop_oneof![Just(0u64), 0u64..2_000_000], 0usize..3),
            1..30),
    ) {
        let ahead = ahead.iter().enumerate().map(|(i, &(cost, wait, keys))| (if i == 0 { lead } else { 0 }, cost, wait, keys));
        let back = steps.iter().enumerate().map(|(i, &(step, cost, wait, keys))| (if i == 0 { step - lead } else { step }, cost, wait, keys));
        memory_and_redis_agree(&quotas, &ahead.chain(back).collect::<Vec<_>>())?;
    }
}

const YEAR: i64 = 365 * 86_400 * 1_000_000;

/// Runs (clock step in us, cost, max_wait in us, key choice) steps on a
/// limiter of `quotas` over each store; they must decide identically.
fn memory_and_redis_agree(
    quotas: &[Quota],
    steps: &[(i64, u64, u64, usize)],
) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("prop-diff");
    let limits: Vec<Limit> = quotas
        .iter()
        .enumerate()
        .map(|(i, q)| Limit::new(format!("l{i}"), *q).expect("valid"))
        .collect();
    let with = |limiter: tower_ratelimit::LimiterBuilder| {
        limits
            .iter()
            .cloned()
            .fold(limiter.timeout(PATIENT).cache_denials(false), |b, l| {
                b.limit(l)
            })
            .build()
            .expect("limiter")
    };
    let memory = with(Limiter::builder(MemoryStore::with_clock(clock.clone())));
    let redis = with(Limiter::builder(redis_store_with_clock(&prefix, &clock)));
    // 0: one key for all limits; 1, 2: a key per limit from a small set
    let names = |keys: usize| -> Vec<String> {
        if keys == 0 {
            vec!["shared".to_owned(); limits.len()]
        } else {
            (0..limits.len())
                .map(|l| format!("k{}", (l + keys) % 2))
                .collect()
        }
    };
    // how long a state reaches past the store's clock when it is written:
    // further by up to its limit's horizon (at most two windows) when the
    // clock steps back and a key's clock ahead is believed
    let longest_wait = steps.iter().map(|s| s.2).max().unwrap_or(0);
    let mut reach = state_lifetime(&limits, Duration::from_micros(longest_wait));
    if steps.iter().any(|s| s.0 < 0) {
        reach += state_lifetime(&limits, Duration::ZERO);
    }
    runtime().block_on(async {
        let mut now = T0;
        for (i, &(step, cost, max_wait, keys)) in steps.iter().enumerate() {
            now += step;
            clock.set(now);
            let wait = Duration::from_micros(max_wait);
            let m = memory
                .decide(&names(keys), cost, wait)
                .await
                .expect("memory");
            let r = redis.decide(&names(keys), cost, wait).await.expect("redis");
            prop_assert_eq!(&m, &r, "step {} (cost {}, max_wait {})", i, cost, max_wait);
        }
        // quiet for longer than any state reaches, twice (a state written
        // far ahead counts as made when it is first read): then every key
        // is granted again, whatever clock wrote it
        for quiet in 0..2 {
            now += reach.as_micros() as i64;
            clock.set(now);
            for keys in 0..3 {
                let m = memory
                    .decide(&names(keys), 1, Duration::ZERO)
                    .await
                    .expect("memory");
                let r = redis
                    .decide(&names(keys), 1, Duration::ZERO)
                    .await
                    .expect("redis");
                prop_assert_eq!(&m, &r, "after quiet {}", quiet);
                prop_assert!(quiet == 0 || m.is_allowed(), "after the quiet: {:?}", m);
            }
        }
        Ok(())
    })?;
    assert_keys_expire(&prefix, reach + TEST_CLOCK_SLACK);
    Ok(())
}

/// An algorithm and its three numbers: (amount, rate, window in us), where the
/// amount is the limit, capacity or burst and the rate is the bucket's refill
/// or GCRA's rate per window (unused by the window algorithms).
#[derive(Debug, Clone, Copy)]
enum Kind {
    Log,
    Bucket,
    Gcra,
    Fixed,
    Sliding,
}

fn build(kind: Kind, (a, r, w): (u64, u64, u64)) -> (Quota, Model) {
    let us = Duration::from_micros(w);
    let (ai, ri, wi) = (a as i128, r as i128, w as i128);
    match kind {
        Kind::Log => (Quota::rate(a, us).sliding_log(), Model::Log(ai, wi, vec![])),
        Kind::Bucket => (
            Quota::rate(r, us).allow_burst(a).token_bucket(),
            Model::Bucket(ai, ri, wi, ai * wi, T0 as i128),
        ),
        Kind::Gcra => (
            Quota::rate(r, us).allow_burst(a).gcra(),
            Model::Gcra(ai, ri, wi, None),
        ),
        Kind::Fixed => (
            Quota::rate(a, us).fixed_window(),
            Model::Fixed(ai, wi, -1, 0),
        ),
        Kind::Sliding => (
            Quota::rate(a, us).sliding_window(),
            Model::Sliding(ai, wi, -1, 0, 0),
        ),
    }
}

impl Model {
    /// Records a grant the quota itself may not have made (another quota
    /// did): the quota "alone from the true history". A bucket cannot hold
    /// less than nothing, so its level stops at empty.
    fn force(&mut self, t: i128, cost: i128) {
        self.grant(t, cost);
        match self {
            Model::Bucket(_, _, _, level, _) => *level = (*level).max(0),
            Model::Gcra(b, r, p, Some(tat)) => *tat = (*tat).min(t * *r + *b * *p),
            _ => {}
        }
    }
}

/// A quota and the same quota with exactly one of its numbers changed, up
/// or down (a rolling deploy).
fn change_strategy() -> impl Strategy<Value = (Kind, (u64, u64, u64), (u64, u64, u64))> {
    let kind = prop_oneof![
        Just(Kind::Log),
        Just(Kind::Bucket),
        Just(Kind::Gcra),
        Just(Kind::Fixed),
        Just(Kind::Sliding)
    ];
    (
        kind,
        1u64..8,
        1u64..4,
        1_000u64..1_000_000,
        0usize..3,
        any::<bool>(),
        2u64..4,
    )
        .prop_map(|(kind, a, r, w, which, up, factor)| {
            let old = (a, r, w);
            let scale = |x: u64| if up { x * factor } else { (x / factor).max(1) };
            // windows have no rate: change their window instead
            let which = match kind {
                Kind::Log | Kind::Fixed | Kind::Sliding if which == 1 => 2,
                _ => which,
            };
            let new = match which {
                0 => (scale(a), r, w),
                1 => (a, scale(r), w),
                _ => (a, r, scale(w).min(1_000_000)),
            };
            (kind, old, new)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]
    /// Old and new limiters alternate on the same keys, on both stores: the
    /// stores agree, and the amount available never exceeds what the older or
    /// the newer quota alone would allow from the true history of grants.
    #[test]
    fn quota_changes_over_live_state_never_over_admit(
        (kind, old, new) in change_strategy(),
        steps in proptest::collection::vec(
            (prop_oneof![Just(0u64), 0u64..50_000, 0u64..2_000_000], any::<bool>(), 0u64..4),
            1..40),
    ) {
        let (old_quota, mut old_model) = build(kind, old);
        let (new_quota, mut new_model) = build(kind, new);
        let clock = ManualClock::new(T0);
        let prefix = unique_prefix("prop-deploy");
        let memory = MemoryStore::with_clock(clock.clone());
        let redis = redis_store_with_clock(&prefix, &clock);
        let limits = [Limit::new("q", old_quota).expect("valid"), Limit::new("q", new_quota).expect("valid")];
        let limiters: Vec<(Limiter, Limiter)> = limits
            .iter()
            .map(|l| (patient_limiter(memory.clone(), l.clone()), patient_limiter(redis.clone(), l.clone())))
            .collect();
        runtime().block_on(async {
            let mut now = T0 as i128;
            for (i, &(step, newer, cost)) in steps.iter().enumerate() {
                now += step as i128;
                clock.set(now as i64);
                let (m, r) = &limiters[usize::from(newer)];
                let look = m.peek("k", 1).await.expect("memory");
                prop_assert_eq!(&look, &r.peek("k", 1).await.expect("redis"), "peek, step {}", i);
                let bound = old_model.remaining(now).max(new_model.remaining(now)).max(0);
                prop_assert!(
                    look.remaining() as i128 <= bound,
                    "step {} ({}): {} available, old alone {:?} and new alone {:?} allow {}",
                    i, if newer { "new" } else { "old" }, look.remaining(), old_model, new_model, bound
                );
                let d = m.check("k", cost).await.expect("memory");
                prop_assert_eq!(&d, &r.check("k", cost).await.expect("redis"), "check, step {}", i);
                if d.is_allowed() && cost > 0 {
                    prop_assert!(cost as i128 <= bound, "step {}: granted {} of {}", i, cost, bound);
                    old_model.force(now, cost as i128);
                    new_model.force(now, cost as i128);
                }
            }
            Ok(())
        })?;
        assert_keys_expire(&prefix, state_lifetime(&limits, Duration::ZERO) + TEST_CLOCK_SLACK);
    }
}
