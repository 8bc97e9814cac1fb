//! Calendar quotas on the memory store and on a real Redis, both on a test
//! clock: their windows at the boundaries that matter (the last millisecond
//! of January 31st, February 29th of a leap year, December 31st, an offset
//! that moves the boundary across midnight UTC, weeks from Monday) and at
//! many instants, against a model: the `time` crate's civil dates.

mod common;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use common::{limiters_on_clock, unique_prefix};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use time::{Date, Month, OffsetDateTime, UtcOffset};
use tower::{service_fn, Layer, ServiceExt};
use tower_ratelimit::key::Global;
use tower_ratelimit::layer::RateLimitLayer;
use tower_ratelimit::{Limit, ManualClock, MemoryStore, Period, Quota};

const MS: i64 = 1_000;
const DAY: i64 = 86_400_000_000;

/// Midnight at the start of `y-m-d` at `offset` seconds east of UTC (us).
fn midnight(y: i32, m: Month, d: u8, offset: i32) -> i64 {
    let off = UtcOffset::from_whole_seconds(offset).expect("offset");
    let date = Date::from_calendar_date(y, m, d).expect("date");
    date.midnight().assume_offset(off).unix_timestamp() * 1_000_000
}

/// The model: the window of `period` at `offset` that holds `at`, its
/// start and end (us), from the `time` crate's dates.
fn model(period: Period, offset: i32, at: i64) -> (i64, i64) {
    let off = UtcOffset::from_whole_seconds(offset).expect("offset");
    let d = OffsetDateTime::from_unix_timestamp_nanos(i128::from(at) * 1000)
        .expect("time")
        .to_offset(off)
        .date();
    let (y, m) = (d.year(), d.month());
    let next_month = (y + i32::from(m == Month::December), m.next());
    match period {
        Period::Day => {
            let start = midnight(y, m, d.day(), offset);
            (start, start + DAY)
        }
        Period::Week => {
            let back = i64::from(d.weekday().number_days_from_monday());
            let start = midnight(y, m, d.day(), offset) - back * DAY;
            (start, start + 7 * DAY)
        }
        Period::Month => (
            midnight(y, m, 1, offset),
            midnight(next_month.0, next_month.1, 1, offset),
        ),
        _ => (
            midnight(y, Month::January, 1, offset),
            midnight(y + 1, Month::January, 1, offset),
        ),
    }
}

fn calendar(period: Period, offset: i32) -> tower_ratelimit::CalendarRate {
    let rate = Quota::per_calendar(2, period);
    let by = Duration::from_secs(u64::from(offset.unsigned_abs()));
    if offset >= 0 {
        rate.east_of_utc(by)
    } else {
        rate.west_of_utc(by)
    }
}

/// The boundaries: a period's end (its next one's start), the period and
/// the offset, and what the case is.
fn boundaries() -> Vec<(i64, Period, i32, &'static str)> {
    use Month::*;
    let india = 5 * 3600 + 1800;
    vec![
        (
            midnight(2027, February, 1, 0),
            Period::Month,
            0,
            "the end of January 31st",
        ),
        (
            midnight(2028, March, 1, 0),
            Period::Month,
            0,
            "the end of February 29th, 2028",
        ),
        (
            midnight(2027, March, 1, 0),
            Period::Month,
            0,
            "the end of February 28th, 2027",
        ),
        (
            midnight(2028, January, 1, 0),
            Period::Year,
            0,
            "the end of December 31st",
        ),
        (
            midnight(2028, January, 1, 0),
            Period::Month,
            0,
            "December 31st, monthly",
        ),
        (
            midnight(2029, January, 1, 0),
            Period::Year,
            0,
            "the end of the leap year 2028",
        ),
        (
            midnight(2027, January, 4, 0),
            Period::Week,
            0,
            "a week across the new year",
        ),
        (
            midnight(2027, March, 15, india),
            Period::Day,
            india,
            "midnight in India, 18:30 UTC",
        ),
        (
            midnight(2027, March, 15, -8 * 3600),
            Period::Day,
            -8 * 3600,
            "midnight at UTC-08",
        ),
        (
            midnight(2027, March, 1, 9 * 3600),
            Period::Month,
            9 * 3600,
            "March at UTC+09, Feb 28th UTC",
        ),
        (
            midnight(2028, January, 1, -5 * 3600),
            Period::Year,
            -5 * 3600,
            "a year at UTC-05",
        ),
    ]
}

/// A fixed window of 2 per period, on both stores: at the last
/// millisecond of a period 2 pass and a third waits until the boundary
/// (its `retry_after` and the reset say so); at the boundary the count
/// is back and the reset is the next period's end. Every figure is the
/// model's.
#[tokio::test]
async fn fixed_windows_turn_at_the_models_boundaries_on_both_stores() {
    for (b, period, offset, case) in boundaries() {
        // the case is what it says, by the model
        assert_eq!(model(period, offset, b - 1).1, b, "{case}");
        if offset != 0 {
            assert_ne!(b % DAY, 0, "{case}: the boundary is not at midnight UTC");
        }
        let limit = Limit::new("cal", calendar(period, offset).fixed_window()).expect("limit");
        let clock = ManualClock::new(b - MS);
        for (store, limiter) in limiters_on_clock(&unique_prefix("calendar"), &limit, &clock) {
            let ctx = format!("{case} on {store}");
            clock.set(b - MS);
            let d = limiter.check("k", 2).await.expect("decision");
            assert!(d.is_allowed(), "{ctx}: {d:?}");
            assert_eq!(
                (d.remaining(), d.reset_after()),
                (0, Duration::from_millis(1)),
                "{ctx}"
            );
            clock.set(b - 1);
            let d = limiter.check("k", 1).await.expect("decision");
            assert_eq!(
                d.retry_after(),
                Some(Duration::from_micros(1)),
                "{ctx}: {d:?}"
            );
            // a reservation of 1 us takes one of the next period's 2
            let d = limiter
                .decide(&["k"], 1, Duration::from_micros(1))
                .await
                .expect("decision");
            assert_eq!(d.delay(), Duration::from_micros(1), "{ctx}: {d:?}");
            clock.set(b);
            let d = limiter.check("k", 1).await.expect("decision");
            assert!(d.is_allowed(), "{ctx}: {d:?}");
            let end = model(period, offset, b).1;
            assert_eq!(d.remaining(), 0, "{ctx}");
            assert_eq!(d.reset_after().as_micros() as i64, end - b, "{ctx}");
            let d = limiter.check("k", 1).await.expect("decision");
            let retry = d.retry_after().expect("refused").as_micros() as i64;
            assert_eq!(retry, end - b, "{ctx}: {d:?}");
        }
    }
}

/// One decision on a fresh key at each of 60 instants from 1971 to 2250,
/// for every period at four offsets and both algorithms, on both stores:
/// the reset is the model's period end (a fixed window's), or when the
/// count stops weighing (a sliding window's: the period's length after the
/// next period begins, or that one's end if sooner).
#[tokio::test]
async fn every_instant_falls_in_the_models_period_on_both_stores() {
    let clock = ManualClock::new(0);
    let periods = [Period::Day, Period::Week, Period::Month, Period::Year];
    let (from, to) = (
        midnight(1971, Month::January, 1, 0),
        midnight(2250, Month::January, 1, 0),
    );
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let instants: Vec<i64> = (0..60)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            from + ((x >> 11) % (to - from) as u64) as i64
        })
        .collect();
    for (period, sliding) in periods.into_iter().flat_map(|p| [(p, false), (p, true)]) {
        for offset in [0, 5 * 3600 + 1800, -8 * 3600, 14 * 3600] {
            let rate = calendar(period, offset);
            let quota = if sliding {
                rate.sliding_window()
            } else {
                rate.fixed_window()
            };
            let limit = Limit::new("cal", quota).expect("limit");
            for (store, limiter) in limiters_on_clock(&unique_prefix("calendar"), &limit, &clock) {
                for (i, &at) in instants.iter().enumerate() {
                    clock.set(at);
                    let d = limiter.check(&format!("k{i}"), 1).await.expect("decision");
                    let (start, end) = model(period, offset, at);
                    let next_end = model(period, offset, end).1;
                    let expected = match sliding {
                        false => end,
                        true => end + (end - start).min(next_end - end),
                    };
                    assert_eq!(
                        d.reset_after().as_micros() as i64,
                        expected - at,
                        "{period:?}, sliding {sliding}, at {offset} s on {store}, at {at} us"
                    );
                }
            }
        }
    }
}

/// A sliding window of 10 per month: the previous month weighs in
/// proportion to how much of it lies within its own length of now. January
/// (31 days) still weighs a little on the last day of February and not at
/// all from March 1st; February (28 days) weighs nothing in the last three
/// days of March. The figures where the weight is whole are the model's
/// dates; the others are checked by what a peek a microsecond earlier says.
#[tokio::test]
async fn sliding_windows_weigh_the_previous_month_by_its_length_on_both_stores() {
    use Month::*;
    let limit = Limit::new("cal", Quota::per_month(10).sliding_window()).expect("limit");
    let (feb, mar) = (midnight(2027, February, 1, 0), midnight(2027, March, 1, 0));
    let clock = ManualClock::new(feb - MS);
    for (store, limiter) in limiters_on_clock(&unique_prefix("calendar"), &limit, &clock) {
        let ctx = |what: &str| format!("{what} on {store}");
        // the last millisecond of January 31st: all 10
        clock.set(feb - MS);
        let d = limiter.check("jan", 10).await.expect("decision");
        assert!(d.is_allowed(), "{}", ctx("January"));
        // full until January stops weighing: March 1st, February being short
        assert_eq!(
            d.reset_after().as_micros() as i64,
            mar - (feb - MS),
            "{}",
            ctx("reset")
        );
        // February 1st: January weighs whole
        clock.set(feb);
        let d = limiter.check("jan", 1).await.expect("decision");
        let retry = d.retry_after().expect("refused").as_micros() as i64;
        // 9 of 10 left to January: after a tenth of its 31 days, about
        assert!(
            (3 * DAY..4 * DAY).contains(&retry),
            "{}: {retry}",
            ctx("retry")
        );
        clock.set(feb + retry - 1);
        assert_eq!(
            limiter.peek("jan", 0).await.expect("peek").remaining(),
            0,
            "{}",
            ctx("before")
        );
        clock.set(feb + retry);
        assert_eq!(
            limiter.peek("jan", 0).await.expect("peek").remaining(),
            1,
            "{}",
            ctx("at")
        );
        // the last millisecond of February 28th: 3 days of January's 31 weigh 1
        clock.set(mar - MS);
        assert_eq!(
            limiter.peek("jan", 0).await.expect("peek").remaining(),
            9,
            "{}",
            ctx("Feb 28")
        );
        clock.set(mar);
        let d = limiter.peek("jan", 0).await.expect("peek");
        assert_eq!(
            (d.remaining(), d.reset_after()),
            (10, Duration::ZERO),
            "{}",
            ctx("March")
        );

        // February's count weighs its 28 days into March, then nothing
        clock.set(mar - MS);
        assert!(limiter
            .check("feb", 10)
            .await
            .expect("decision")
            .is_allowed());
        clock.set(mar);
        let d = limiter.peek("feb", 0).await.expect("peek");
        let until = midnight(2027, March, 29, 0);
        assert_eq!(d.remaining(), 0, "{}", ctx("March 1st"));
        assert_eq!(
            d.reset_after().as_micros() as i64,
            until - mar,
            "{}",
            ctx("reset")
        );
        clock.set(until - 1);
        assert_eq!(
            limiter.peek("feb", 0).await.expect("peek").remaining(),
            9,
            "{}",
            ctx("Mar 28")
        );
        clock.set(until);
        assert_eq!(
            limiter.peek("feb", 0).await.expect("peek").remaining(),
            10,
            "{}",
            ctx("Mar 29")
        );
    }
}

/// Through the layer: a refusal at 23:59 on January 31st says `Retry-After:
/// 60` and the RateLimit fields reset in 60 seconds, at the month's end.
#[tokio::test]
async fn the_layer_answers_with_the_months_end() {
    let feb = midnight(2027, Month::February, 1, 0);
    let clock = ManualClock::new(feb - 60_000_000);
    let limit = Limit::new("plan", Quota::per_month(1).fixed_window()).expect("limit");
    let layer = RateLimitLayer::builder()
        .store(MemoryStore::with_clock(clock))
        .limit(limit, Global)
        .build()
        .expect("layer");
    let hello = service_fn(|_: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::<Bytes>::from("hi")))
    });
    let service = layer.layer(hello);
    let ok = service
        .clone()
        .oneshot(Request::new(Full::default()))
        .await
        .expect("infallible");
    assert_eq!(ok.status(), StatusCode::OK);
    let refused = service
        .oneshot(Request::new(Full::default()))
        .await
        .expect("infallible");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "60");
    let fields = refused.headers()["ratelimit"].to_str().expect("ascii");
    assert!(
        fields.contains("r=0") && fields.contains("t=60"),
        "{fields}"
    );
    let policy = refused.headers()["ratelimit-policy"]
        .to_str()
        .expect("ascii");
    assert!(
        policy.contains("q=1") && policy.contains("w=2678400"),
        "{policy}"
    );
}

/// A calendar quota reads back as it was written; an offset of a day or
/// more, or not of whole minutes, is refused.
#[test]
fn calendar_quotas_read_as_sentences() {
    let q = Quota::per_month(10_000).fixed_window();
    assert_eq!(q.to_string(), "fixed window, 10000 per month (UTC)");
    assert_eq!(q.calendar(), Some(Period::Month));
    let q = Quota::per_calendar_day(500)
        .west_of_utc(Duration::from_secs(3 * 3600 + 1800))
        .sliding_window();
    assert_eq!(
        q.to_string(),
        "sliding window counter, 500 per day (UTC-03:30)"
    );
    assert_eq!(q.utc_offset_secs(), -12_600);
    // `per_day` is unchanged: 24 hours from the epoch, no calendar
    assert_eq!(Quota::per_day(5).fixed_window().calendar(), None);
    for bad in [
        Duration::from_secs(86_400),
        Duration::from_secs(90),
        Duration::from_millis(60_500),
    ] {
        assert!(Limit::new("x", Quota::per_week(1).east_of_utc(bad).fixed_window()).is_err());
    }
}

/// A calendar quota is not kept in the store, on either store: the
/// scripts would not read its code back.
#[tokio::test]
async fn a_calendar_quota_is_not_kept_in_the_store() {
    let limit = Limit::new("plan", Quota::per_month(10).fixed_window())
        .expect("limit")
        .use_stored_quota();
    let clock = ManualClock::new(midnight(2027, Month::March, 1, 0));
    for (store, limiter) in limiters_on_clock(&unique_prefix("calendar"), &limit, &clock) {
        let kept = limiter
            .admin()
            .set_stored_quota("plan", Quota::per_month(20).fixed_window())
            .await;
        assert!(
            matches!(kept, Err(tower_ratelimit::Error::Config(_))),
            "{store}: {kept:?}"
        );
        // its own quota decides
        let d = limiter.check("k", 1).await.expect("decision");
        assert_eq!((d.capacity(), d.remaining()), (10, 9), "{store}");
    }
}

/// A calendar quota of `amount` per `period` (0 day, 1 week, 2 month, 3
/// year) at `offset` minutes, by its algorithm (`sliding`).
fn calendar_quota((period, sliding, offset, amount): (usize, bool, i16, u64)) -> Quota {
    let period = [Period::Day, Period::Week, Period::Month, Period::Year][period];
    let rate = Quota::per_calendar(amount, period);
    let by = Duration::from_secs(u64::from(offset.unsigned_abs()) * 60);
    let rate = if offset >= 0 {
        rate.east_of_utc(by)
    } else {
        rate.west_of_utc(by)
    };
    if sliding {
        rate.sliding_window()
    } else {
        rate.fixed_window()
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(40))]

    /// One to three calendar quotas (both algorithms, every period, offsets
    /// east and west), decided together from just before one of the
    /// boundaries above, with reservations and steps of a second, an hour
    /// or days: the memory store and Redis make the same decisions.
    #[test]
    fn memory_and_redis_agree_on_calendar_quotas(
        quotas in proptest::collection::vec(
            (0usize..4, proptest::bool::ANY, -720i16..=840, 1u64..12), 1..4),
        from in 0usize..11,
        steps in proptest::collection::vec((
            proptest::prop_oneof![0i64..1_000_000, 0i64..3_600_000_000, 0i64..10 * DAY],
            0u64..6,
            proptest::prop_oneof![proptest::strategy::Just(0u64), 0u64..3_600_000_000],
            0usize..3,
        ), 1..30),
    ) {
        let limits: Vec<Limit> = quotas
            .iter()
            .enumerate()
            .map(|(i, q)| Limit::new(format!("c{i}"), calendar_quota(*q)).expect("valid"))
            .collect();
        let (b, _, _, _) = boundaries()[from];
        let clock = ManualClock::new(b - 3_600_000_000);
        let prefix = unique_prefix("calendar-prop");
        let with = |builder: tower_ratelimit::LimiterBuilder| {
            limits
                .iter()
                .cloned()
                .fold(builder.timeout(common::PATIENT).cache_denials(false), |b, l| b.limit(l))
                .build()
                .expect("limiter")
        };
        let memory = with(tower_ratelimit::Limiter::builder(MemoryStore::with_clock(clock.clone())));
        let redis = with(tower_ratelimit::Limiter::builder(common::redis_store_with_clock(&prefix, &clock)));
        // 0: one key for every limit; 1, 2: a key per limit from two
        let names = |keys: usize| -> Vec<String> {
            (0..limits.len())
                .map(|l| if keys == 0 { "shared".to_owned() } else { format!("k{}", (l + keys) % 2) })
                .collect()
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let mut now = b - 3_600_000_000;
            for (i, &(step, cost, max_wait, keys)) in steps.iter().enumerate() {
                now += step;
                clock.set(now);
                let wait = Duration::from_micros(max_wait);
                let m = memory.decide(&names(keys), cost, wait).await.expect("memory");
                let r = redis.decide(&names(keys), cost, wait).await.expect("redis");
                proptest::prop_assert_eq!(&m, &r, "step {} (cost {}, max_wait {})", i, cost, max_wait);
            }
            Ok(())
        })?;
    }
}
