//! The opt-in extension (`tower_ratelimit` blocks) and the crate limit of
//! every rule.
//!
//! A domain turns it on with a block beside `domain` (`tower_ratelimit: {}`,
//! or with a default `algorithm` for its rate limits); a rate limit of such
//! a domain may then carry its own block:
//!
//! ```yaml
//! domain: api
//! tower_ratelimit: {}
//! descriptors:
//!   - key: user
//!     rate_limit:
//!       unit: second
//!       requests_per_unit: 10
//!       tower_ratelimit:
//!         algorithm: token_bucket   # fixed_window, sliding_window, sliding_log, token_bucket, gcra
//!         burst: 50                 # token_bucket and gcra
//!   - key: plan
//!     rate_limit:
//!       requests_per_unit: 10000
//!       tower_ratelimit:
//!         calendar: month           # day, week, month, year (fixed or sliding window)
//!         utc_offset: "+05:30"
//!   - key: report
//!     rate_limit:
//!       requests_per_unit: 100
//!       tower_ratelimit:
//!         window: 15m               # any length, in place of the unit's
//! ```

use std::time::Duration;

use sha2::{Digest, Sha256};
use tower_ratelimit::{Limit, Period, Quota};

use super::load::TOWER;
use super::yaml::{Kind, Node};
use super::{Algorithm, Extension, Unit};

/// The keys of a `tower_ratelimit` block.
pub(super) const KEYS: [&str; 5] = ["algorithm", "burst", "window", "calendar", "utc_offset"];

/// What a domain-level block says.
pub(super) struct DomainBlock {
    /// The algorithm of the domain's rate limits that name none.
    pub(super) algorithm: Option<Algorithm>,
}

/// Reads the domain-level block (`{}`, null, or `algorithm` only).
pub(super) fn domain_block(node: &Node) -> Result<DomainBlock, String> {
    match &node.kind {
        Kind::Null(_) => Ok(DomainBlock { algorithm: None }),
        Kind::Map(entries) => {
            for (key, _) in entries {
                let k = key.scalar_text().unwrap_or_default();
                if k != "algorithm" {
                    return Err(format!(
                        "the domain's {TOWER} block takes only `algorithm` (the default of its \
                         rate limits); `{k}` goes in a rate limit's own block (line {})",
                        key.line
                    ));
                }
            }
            let algorithm = match node.get("algorithm") {
                Some(a) => Some(algorithm(a)?),
                None => None,
            };
            Ok(DomainBlock { algorithm })
        }
        _ => Err(format!(
            "the domain's {TOWER} block must be a mapping (`{TOWER}: {{}}`), line {}",
            node.line
        )),
    }
}

/// Whether a rule's block gives the window (so the unit may be left out).
pub(super) fn gives_window(block: &Node) -> bool {
    ["window", "calendar"]
        .iter()
        .any(|k| block.get(k).is_some_and(|n| !n.is_null()))
}

impl Extension {
    /// The extension of a rule that only takes its domain's algorithm.
    pub(super) fn with_algorithm(algorithm: Algorithm) -> Extension {
        Extension {
            algorithm,
            burst: None,
            window: None,
            calendar: None,
        }
    }
}

fn algorithm(node: &Node) -> Result<Algorithm, String> {
    let text = node.scalar_text().unwrap_or_default();
    Ok(match text.replace('-', "_").as_str() {
        "fixed_window" => Algorithm::FixedWindow,
        "sliding_window" => Algorithm::SlidingWindow,
        "sliding_log" => Algorithm::SlidingLog,
        "token_bucket" => Algorithm::TokenBucket,
        "gcra" => Algorithm::Gcra,
        _ => {
            return Err(format!(
                "unknown algorithm '{text}' (line {}): use fixed_window, sliding_window, \
                 sliding_log, token_bucket or gcra",
                node.line
            ))
        }
    })
}

/// Reads a rate limit's block and checks its combination.
pub(super) fn rule_block(node: &Node, default: Option<Algorithm>) -> Result<Extension, String> {
    if node.is_null() {
        return Ok(Extension::with_algorithm(
            default.unwrap_or(Algorithm::FixedWindow),
        ));
    }
    if node.as_map().is_none() {
        return Err(format!("the block must be a mapping, line {}", node.line));
    }
    let algorithm = match node.get("algorithm") {
        Some(a) if !a.is_null() => algorithm(a)?,
        _ => default.unwrap_or(Algorithm::FixedWindow),
    };
    let bucket = matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra);
    let name = match algorithm {
        Algorithm::FixedWindow => "fixed_window",
        Algorithm::SlidingWindow => "sliding_window",
        Algorithm::SlidingLog => "sliding_log",
        Algorithm::TokenBucket => "token_bucket",
        Algorithm::Gcra => "gcra",
    };
    let burst = match node.get("burst") {
        None => None,
        Some(n) if n.is_null() => None,
        Some(n) => match n.kind {
            Kind::Int(b, _) if b >= 1 => Some(
                u64::try_from(b)
                    .map_err(|_| format!("`burst` {b} is out of range (line {})", n.line))?,
            ),
            _ => {
                return Err(format!(
                    "`burst` must be a whole number of at least 1 (line {})",
                    n.line
                ))
            }
        },
    };
    if burst.is_some() && !bucket {
        return Err(format!(
            "`burst` is for token_bucket and gcra, not {name} (a window lets its \
             requests_per_unit through at most)"
        ));
    }
    let window = match node.get("window") {
        None => None,
        Some(n) if n.is_null() => None,
        Some(n) => Some(duration(n)?),
    };
    let calendar = match node.get("calendar") {
        None => None,
        Some(n) if n.is_null() => None,
        Some(n) => Some(period(n)?),
    };
    let offset = match node.get("utc_offset") {
        None => None,
        Some(n) if n.is_null() => None,
        Some(n) => Some(utc_offset(n)?),
    };
    if window.is_some() && calendar.is_some() {
        return Err("`window` and `calendar` are two ways to give the window: give one".into());
    }
    if calendar.is_some() && !matches!(algorithm, Algorithm::FixedWindow | Algorithm::SlidingWindow)
    {
        return Err(format!(
            "`calendar` is for fixed_window and sliding_window, not {name}"
        ));
    }
    if offset.is_some() && calendar.is_none() {
        return Err("`utc_offset` goes with `calendar` (the periods it moves)".into());
    }
    Ok(Extension {
        algorithm,
        burst,
        window,
        calendar: calendar.map(|p| (p, offset.unwrap_or(0))),
    })
}

fn duration(node: &Node) -> Result<Duration, String> {
    let line = node.line;
    let text = match &node.kind {
        Kind::Str(s) => s.as_str(),
        Kind::Int(..) | Kind::Float(..) => {
            return Err(format!(
            "`window` is a bare number (line {line}): write its unit too, like \"90s\" or \"15m\""
        ))
        }
        _ => {
            return Err(format!(
                "`window` must be a duration like \"90s\" (line {line})"
            ))
        }
    };
    let window = humantime::parse_duration(text).map_err(|e| {
        format!("`window` \"{text}\" is not a duration ({e}), line {line}; write it like \"15m\"")
    })?;
    if window.is_zero() {
        return Err(format!("`window` must be longer than zero (line {line})"));
    }
    Ok(window)
}

fn period(node: &Node) -> Result<Period, String> {
    match node.scalar_text().unwrap_or_default() {
        "day" => Ok(Period::Day),
        "week" => Ok(Period::Week),
        "month" => Ok(Period::Month),
        "year" => Ok(Period::Year),
        other => Err(format!(
            "unknown `calendar` '{other}' (line {}): use day, week, month or year",
            node.line
        )),
    }
}

/// `"+05:30"`, `"-08:00"`, `"+09"`, `"UTC"` or `"Z"`: seconds east of UTC.
fn utc_offset(node: &Node) -> Result<i64, String> {
    let text = node.scalar_text().unwrap_or_default();
    let bad = || {
        format!(
            "`utc_offset` '{text}' is not an offset from UTC (line {}): write it like \"+05:30\"",
            node.line
        )
    };
    if text == "UTC" || text == "Z" {
        return Ok(0);
    }
    let (sign, rest) = match text.split_at_checked(1) {
        Some(("+", rest)) => (1, rest),
        Some(("-", rest)) => (-1, rest),
        _ => return Err(bad()),
    };
    let (h, m) = rest.split_once(':').unwrap_or((rest, "00"));
    let two = |s: &str| (s.len() == 2).then(|| s.parse::<i64>().ok()).flatten();
    match (two(h), two(m)) {
        (Some(h), Some(m)) if h < 24 && m < 60 => Ok(sign * (h * 3600 + m * 60)),
        _ => Err(bad()),
    }
}

/// The unit a rule reports to Envoy when its block gives the window and
/// its `unit` was left out: the calendar period's own, or the longest unit
/// that fits in the window (a second at least).
pub(super) fn unit_of(ext: &Extension) -> Unit {
    if let Some((period, _)) = ext.calendar {
        return match period {
            Period::Day => Unit::Day,
            Period::Week => Unit::Week,
            Period::Month => Unit::Month,
            _ => Unit::Year,
        };
    }
    let secs = ext.window.map_or(1, |w| w.as_secs());
    Unit::ALL
        .into_iter()
        .filter(|u| u.seconds() <= secs)
        .max_by_key(|u| u.seconds())
        .unwrap_or(Unit::Second)
}

/// The crate limit of a rule: by default a fixed window of
/// `requests_per_unit` per unit aligned to the epoch, as envoyproxy counts;
/// with the extension, its algorithm, window or calendar and burst.
pub(super) fn limit(
    domain: &str,
    path: &[String],
    requests_per_unit: u32,
    unit: Unit,
    ext: Option<&Extension>,
) -> Result<Limit, String> {
    let n = u64::from(requests_per_unit);
    let unit_window = Duration::from_secs(unit.seconds());
    let quota = match ext {
        None => Quota::rate(n, unit_window).fixed_window(),
        Some(ext) => {
            let window = ext.window.unwrap_or(unit_window);
            match (&ext.algorithm, ext.calendar) {
                (Algorithm::FixedWindow | Algorithm::SlidingWindow, Some((period, offset))) => {
                    let by = Duration::from_secs(offset.unsigned_abs());
                    let rate = Quota::per_calendar(n, period);
                    let rate = if offset >= 0 {
                        rate.east_of_utc(by)
                    } else {
                        rate.west_of_utc(by)
                    };
                    if ext.algorithm == Algorithm::FixedWindow {
                        rate.fixed_window()
                    } else {
                        rate.sliding_window()
                    }
                }
                (Algorithm::FixedWindow, _) => Quota::rate(n, window).fixed_window(),
                (Algorithm::SlidingWindow, _) => Quota::rate(n, window).sliding_window(),
                (Algorithm::SlidingLog, _) => Quota::rate(n, window).sliding_log(),
                (Algorithm::TokenBucket, _) => Quota::rate(n, window)
                    .allow_burst(ext.burst.unwrap_or(n))
                    .token_bucket(),
                (Algorithm::Gcra, _) => Quota::rate(n, window)
                    .allow_burst(ext.burst.unwrap_or(n))
                    .gcra(),
            }
        }
    };
    Limit::new(limit_name(domain, path), quota).map_err(|e| e.to_string())
}

/// The crate limit's name of a rule, from its domain and its path of
/// `key` / `key_value` components, made of the characters a limit name
/// allows, injectively: each component escaped (every character but
/// `A-Z a-z 0-9 -` as `_` and two uppercase hex digits per byte, `_` itself
/// as `__`) and the components joined by dots. A name longer than 64 then
/// becomes `_x` + 40 hex digits of the SHA-256 of the escaped name + `.` +
/// its beginning (no escaped name starts with `_x`, so the two forms never
/// meet).
pub(crate) fn limit_name(domain: &str, path: &[String]) -> String {
    let mut name = escape(domain);
    for component in path {
        name.push('.');
        name.push_str(&escape(component));
    }
    if name.len() <= 64 {
        return name;
    }
    let digest = Sha256::digest(name.as_bytes());
    let mut hashed = String::from("_x");
    for byte in &digest[..20] {
        hashed.push_str(&format!("{byte:02x}"));
    }
    hashed.push('.');
    let room = 64 - hashed.len();
    hashed.extend(name.chars().take(room));
    hashed
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' => out.push(byte as char),
            b'_' => out.push_str("__"),
            _ => out.push_str(&format!("_{byte:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_names_are_valid_and_distinct() {
        let p = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let names = [
            limit_name("d", &p(&["a.b"])),
            limit_name("d", &p(&["a", "b"])),
            limit_name("d.a", &p(&["b"])),
            limit_name("d", &p(&["a_b"])),
            limit_name("d", &p(&["a_2E", "b"])),
            limit_name("d", &p(&["files_files/*"])),
            limit_name("d", &p(&[&"x".repeat(100)])),
            limit_name("d", &p(&[&"x".repeat(101)])),
        ];
        for (i, a) in names.iter().enumerate() {
            assert!(
                Limit::new(a.clone(), Quota::per_second(1).fixed_window()).is_ok(),
                "{a}"
            );
            for b in &names[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
