//! Limits read from configuration files (feature `serde`): every algorithm,
//! human durations, and errors that name the limit and the field.

use std::time::Duration;

use serde::Deserialize;
use tower_ratelimit::{Limit, Quota};

#[derive(Deserialize)]
struct File {
    limits: Vec<Limit>,
}

fn parse(text: &str) -> Result<Vec<Limit>, String> {
    toml::from_str::<File>(text)
        .map(|file| file.limits)
        .map_err(|e| e.to_string())
}

#[test]
fn every_algorithm_reads_as_the_quota_it_spells() {
    let limits = parse(
        r#"
        [[limits]]
        name = "per-ip"
        algorithm = "token-bucket"
        rate = 100
        per = "1s"
        burst = 200

        [[limits]]
        name = "api"
        algorithm = "gcra"
        rate = 10
        per = "1s"
        burst = 20

        [[limits]]
        name = "sms"
        algorithm = "sliding-log"
        limit = 3
        window = "1m"

        [[limits]]
        name = "login"
        algorithm = "fixed_window"
        limit = 5
        window = "15m"

        [[limits]]
        name = "search"
        algorithm = "sliding-window"
        limit = 100000
        window = "1h 30m"
        "#,
    )
    .expect("a valid file");
    let read: Vec<(&str, Quota)> = limits.iter().map(|l| (l.name(), *l.quota())).collect();
    let minute = Duration::from_secs(60);
    assert_eq!(
        read,
        [
            (
                "per-ip",
                Quota::per_second(100).allow_burst(200).token_bucket()
            ),
            ("api", Quota::per_second(10).allow_burst(20).gcra()),
            ("sms", Quota::per_minute(3).sliding_log()),
            ("login", Quota::rate(5, 15 * minute).fixed_window()),
            ("search", Quota::rate(100_000, 90 * minute).sliding_window()),
        ]
    );
}

#[test]
fn other_formats_read_the_same_limits() {
    let limit: Limit = serde_json::from_str(
        r#"{"name": "sms", "algorithm": "sliding-log", "limit": 3, "window": "60s"}"#,
    )
    .expect("valid JSON");
    assert_eq!(*limit.quota(), Quota::per_minute(3).sliding_log());
}

/// Each mistake, and what its error must name besides the limit.
#[test]
fn errors_name_the_limit_and_the_offending_field() {
    let cases = [
        // missing field
        (
            r#"algorithm = "gcra"
            rate = 10
            per = "1s""#,
            "burst",
        ),
        // a field of another algorithm
        (
            r#"algorithm = "sliding-log"
            limit = 3
            window = "1m"
            burst = 5"#,
            "burst",
        ),
        // not a duration
        (
            r#"algorithm = "fixed-window"
            limit = 3
            window = "15 parsecs""#,
            "window",
        ),
        // a duration without its unit
        (
            r#"algorithm = "token-bucket"
            rate = 3
            per = 60
            burst = 3"#,
            "per",
        ),
        // zero
        (
            r#"algorithm = "gcra"
            rate = 0
            per = "1s"
            burst = 3"#,
            "rate",
        ),
        (
            r#"algorithm = "sliding-window"
            limit = 3
            window = "0s""#,
            "window",
        ),
        // out of range
        (
            r#"algorithm = "sliding-log"
            limit = 3
            window = "20years""#,
            "window",
        ),
    ];
    for (body, field) in cases {
        let text = format!("[[limits]]\nname = \"sms\"\n{body}\n");
        let error = parse(&text)
            .err()
            .unwrap_or_else(|| panic!("accepted:\n{text}"));
        assert!(
            error.contains("\"sms\"") && error.contains(&format!("`{field}`")),
            "the error for\n{text}\nshould name limit \"sms\" and `{field}`: {error}"
        );
    }
    // Errors serde reports itself name the field too.
    let unknown = parse("[[limits]]\nname = \"sms\"\nalgorithm = \"sliding-log\"\nlimit = 3\nwindow = \"1m\"\nbrust = 2\n");
    assert!(
        unknown.as_ref().is_err_and(|e| e.contains("brust")),
        "{unknown:?}"
    );
    let algorithm =
        parse("[[limits]]\nname = \"sms\"\nalgorithm = \"leaky\"\nlimit = 3\nwindow = \"1m\"\n");
    assert!(
        algorithm
            .as_ref()
            .is_err_and(|e| e.contains("leaky") && e.contains("sliding-log")),
        "{algorithm:?}"
    );
    let name = parse(
        "[[limits]]\nname = \"s m s\"\nalgorithm = \"sliding-log\"\nlimit = 3\nwindow = \"1m\"\n",
    );
    assert!(
        name.as_ref().is_err_and(|e| e.contains("`name`")),
        "{name:?}"
    );
}

/// A penalty reads from its table; a mistake in it names the field.
#[test]
fn a_penalty_reads_from_its_table() {
    let limits = parse(
        r#"
        [[limits]]
        name = "login"
        algorithm = "sliding-log"
        limit = 5
        window = "15m"
        penalty = { refusals = 2, within = "15m", blocks = ["1m", "1h"], forget_after = "2days" }
        "#,
    )
    .expect("valid");
    let penalty = limits[0].penalty().expect("a penalty");
    assert_eq!(penalty.refusals(), 2);
    assert_eq!(penalty.within(), Duration::from_secs(15 * 60));
    assert_eq!(
        penalty.blocks(),
        [Duration::from_secs(60), Duration::from_secs(3600)]
    );
    assert_eq!(penalty.quiet_period(), Duration::from_secs(2 * 86_400));
    for wrong in [
        r#"{ refusals = 0, within = "1m", blocks = ["1m"] }"#,
        r#"{ refusals = 1, within = "1m", blocks = [] }"#,
        r#"{ refusals = 1, within = "1m", blocks = ["soon"] }"#,
    ] {
        let text = format!(
            "[[limits]]\nname = \"login\"\nalgorithm = \"sliding-log\"\nlimit = 5\n\
             window = \"15m\"\npenalty = {wrong}\n"
        );
        let error = parse(&text).expect_err(wrong);
        assert!(
            error.contains("login") && error.contains("penalty"),
            "{wrong}: {error}"
        );
    }
}

/// A calendar quota: `calendar` in place of `window`, `utc_offset` if not
/// UTC; mistakes name the field.
#[test]
fn calendar_quotas_read_with_their_offset() {
    let limits = parse(
        r#"
        [[limits]]
        name = "plan"
        algorithm = "fixed-window"
        limit = 10000
        calendar = "month"

        [[limits]]
        name = "sms"
        algorithm = "sliding-window"
        limit = 500
        calendar = "day"
        utc_offset = "+05:30"

        [[limits]]
        name = "weekly"
        algorithm = "fixed-window"
        limit = 7
        calendar = "week"
        utc_offset = "-08"
        "#,
    )
    .expect("a valid file");
    let read: Vec<Quota> = limits.iter().map(|l| *l.quota()).collect();
    let hours = |h: u64, m: u64| Duration::from_secs(h * 3600 + m * 60);
    assert_eq!(
        read,
        [
            Quota::per_month(10_000).fixed_window(),
            Quota::per_calendar_day(500)
                .east_of_utc(hours(5, 30))
                .sliding_window(),
            Quota::per_week(7).west_of_utc(hours(8, 0)).fixed_window(),
        ]
    );
    for (body, field) in [
        (
            "algorithm = \"sliding-log\"\nlimit = 3\ncalendar = \"day\"",
            "calendar",
        ),
        (
            "algorithm = \"fixed-window\"\nlimit = 3\ncalendar = \"day\"\nwindow = \"1d\"",
            "window",
        ),
        (
            "algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1d\"\nutc_offset = \"+01:00\"",
            "utc_offset",
        ),
        (
            "algorithm = \"fixed-window\"\nlimit = 3\ncalendar = \"day\"\nutc_offset = \"+5:30\"",
            "utc_offset",
        ),
        (
            "algorithm = \"fixed-window\"\nlimit = 3\ncalendar = \"day\"\nutc_offset = \"+24:00\"",
            "utc_offset",
        ),
        (
            "algorithm = \"fixed-window\"\nlimit = 0\ncalendar = \"day\"",
            "limit",
        ),
    ] {
        let text = format!("[[limits]]\nname = \"sms\"\n{body}\n");
        let error = parse(&text)
            .err()
            .unwrap_or_else(|| panic!("accepted:\n{text}"));
        assert!(error.contains(&format!("`{field}`")), "{text}\n{error}");
    }
    let period = parse("[[limits]]\nname = \"a\"\nalgorithm = \"fixed-window\"\nlimit = 3\ncalendar = \"fortnight\"\n");
    assert!(period.is_err_and(|e| e.contains("fortnight") && e.contains("month")));
}
