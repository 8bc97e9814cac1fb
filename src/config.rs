//! Limits from configuration files (feature `serde`): [`Limit`] implements
//! `Deserialize`, with windows written as human durations.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::{Algorithm, ConfigError, Limit, Penalty, Period, Quota};

/// A limit as written in a configuration file. Every field but `name` and
/// `algorithm` is optional here so that a missing or misplaced one is
/// reported by its name and the limit's, whatever the format.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitConfig {
    name: String,
    algorithm: Algorithm,
    limit: Option<u64>,
    window: Option<HumanDuration>,
    rate: Option<u64>,
    per: Option<HumanDuration>,
    burst: Option<u64>,
    /// A calendar quota's period, in place of `window` (see [`Period`]).
    calendar: Option<Period>,
    /// A calendar quota's offset from UTC, `"+05:30"`; UTC if absent.
    utc_offset: Option<String>,
    /// Shadow mode (see [`Limit::shadow`]).
    #[serde(default)]
    shadow: bool,
    /// A penalty (see [`Limit::with_penalty`]).
    penalty: Option<PenaltyConfig>,
}

/// A limit's penalty as written in a configuration file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PenaltyConfig {
    refusals: u32,
    within: HumanDuration,
    blocks: Vec<HumanDuration>,
    forget_after: Option<HumanDuration>,
}

impl PenaltyConfig {
    fn build(&self) -> Result<Penalty, String> {
        let within = self.within.parse().map_err(|e| format!("`within` {e}"))?;
        let blocks = self
            .blocks
            .iter()
            .map(HumanDuration::parse)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("a block {e}"))?;
        let mut penalty = Penalty::new(self.refusals, within, blocks).map_err(|e| e.to_string())?;
        if let Some(quiet) = &self.forget_after {
            let quiet = quiet.parse().map_err(|e| format!("`forget_after` {e}"))?;
            penalty = penalty.forget_after(quiet);
        }
        Ok(penalty)
    }
}

/// A duration with its unit (`"15m"`, `"1h 30m"`, `"250ms"`); a bare number
/// is refused rather than guessed to be seconds.
#[derive(Deserialize)]
#[serde(untagged)]
enum HumanDuration {
    Text(String),
    Number(f64),
}

impl HumanDuration {
    fn parse(&self) -> Result<Duration, String> {
        match self {
            HumanDuration::Text(text) => humantime::parse_duration(text)
                .map_err(|e| format!("is not a duration ({text:?}: {e}); write it like \"15m\"")),
            HumanDuration::Number(n) => Err(format!(
                "is the bare number {n}; write the unit too, like \"{n}s\" or \"{n}ms\""
            )),
        }
    }
}

impl LimitConfig {
    fn field(&self, field: &'static str, problem: impl Into<String>) -> ConfigError {
        ConfigError::Field {
            limit: self.name.clone(),
            field,
            problem: problem.into(),
        }
    }

    fn build(self) -> Result<Limit, ConfigError> {
        let bucket = self.algorithm.rate_name().is_some();
        // (a sliding log or a bucket has no calendar: `calendar` is refused
        // as a field that does not apply)
        let calendar =
            self.calendar.is_some() && !bucket && self.algorithm != Algorithm::SlidingLog;
        let (takes, amount_field, window_field): (&[&'static str], _, _) = if bucket {
            (&["rate", "per", "burst"], "burst", "per")
        } else if calendar {
            (&["limit", "calendar"], "limit", "calendar")
        } else {
            (&["limit", "window"], "limit", "window")
        };
        let present = [
            ("calendar", self.calendar.is_some()),
            ("utc_offset", self.utc_offset.is_some() && !calendar),
            ("limit", self.limit.is_some()),
            ("window", self.window.is_some()),
            ("rate", self.rate.is_some()),
            ("per", self.per.is_some()),
            ("burst", self.burst.is_some()),
        ];
        for (field, is_present) in present {
            if is_present != takes.contains(&field) {
                let (problem, which) = if is_present {
                    ("does not apply to", ", which")
                } else {
                    ("is missing:", "")
                };
                let (algorithm, takes) = (self.algorithm, takes.join("`, `"));
                return Err(self.field(
                    field,
                    format!("{problem} a {algorithm} limit{which} takes `{takes}`"),
                ));
            }
        }
        let window = match (if bucket { &self.per } else { &self.window }, calendar) {
            // (a calendar quota has no window to read)
            (_, true) => Duration::from_secs(1),
            (Some(duration), _) => duration.parse().map_err(|e| self.field(window_field, e))?,
            (None, _) => return Err(self.field(window_field, "is missing")),
        };
        if window.is_zero() {
            return Err(self.field(window_field, "must be longer than zero"));
        }
        let nonzero = |field: &'static str, value: Option<u64>| match value {
            Some(0) => Err(self.field(field, "must be at least 1")),
            Some(n) => Ok(n),
            None => Err(self.field(field, "is missing")),
        };
        let (amount, extra) = if bucket {
            let rate = nonzero("rate", self.rate)?;
            (nonzero("burst", self.burst)?, rate)
        } else {
            (nonzero("limit", self.limit)?, 0)
        };
        let quota = match self.calendar.filter(|_| calendar) {
            Some(period) => {
                let offset = match &self.utc_offset {
                    Some(text) => utc_offset(text).map_err(|e| self.field("utc_offset", e))?,
                    None => 0,
                };
                let by = Duration::from_secs(offset.unsigned_abs());
                let rate = Quota::per_calendar(amount, period);
                let rate = match offset {
                    0.. => rate.east_of_utc(by),
                    _ => rate.west_of_utc(by),
                };
                Quota {
                    algorithm: self.algorithm,
                    ..rate.fixed_window()
                }
            }
            None => Quota {
                algorithm: self.algorithm,
                amount,
                window,
                extra,
                calendar: None,
            },
        };
        let limit = Limit::new(self.name.clone(), quota).map_err(|e| match e {
            ConfigError::InvalidName(_) => self.field("name", e.to_string()),
            ConfigError::OutOfRange(_) if window > Duration::from_secs(10 * 366 * 86_400) => {
                self.field(window_field, e.to_string())
            }
            other => self.field(amount_field, other.to_string()),
        })?;
        let limit = if self.shadow { limit.shadow() } else { limit };
        let Some(penalty) = &self.penalty else {
            return Ok(limit);
        };
        let penalty = penalty.build().map_err(|e| self.field("penalty", e))?;
        Ok(limit.with_penalty(penalty))
    }
}

/// `"+05:30"`, `"-08:00"`, `"+09"` or `"UTC"`: seconds east of UTC.
fn utc_offset(text: &str) -> Result<i64, String> {
    let bad = || format!("is not an offset from UTC ({text:?}); write it like \"+05:30\"");
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

/// A limit in a configuration file: its `name`, its `algorithm`
/// (`sliding-log`, `fixed-window`, `sliding-window`, `token-bucket` or
/// `gcra`), and its amounts. Window algorithms take `limit` and `window`
/// (a fixed or sliding window may take `calendar` instead: `day`, `week`,
/// `month` or `year`, and `utc_offset` such as `"+05:30"` if not UTC; see
/// [`CalendarRate`](crate::CalendarRate));
/// the bucket algorithms take `rate` per `per`, and `burst`; `shadow = true`
/// puts it in [shadow mode](Limit::shadow); `penalty` gives it a
/// [penalty](Limit::with_penalty): `refusals`, `within`, `blocks` and, if not the
/// default, `forget_after`. Durations have
/// units: `"500ms"`, `"1s"`, `"15m"`, `"1h 30m"`, `"1day"`.
///
/// ```toml
/// [[limits]]
/// name = "per-ip"
/// algorithm = "token-bucket"
/// rate = 100
/// per = "1s"
/// burst = 100
///
/// [[limits]]
/// name = "sms"
/// algorithm = "sliding-log"
/// limit = 3
/// window = "1m"
///
/// [[limits]]
/// name = "login"
/// algorithm = "sliding-log"
/// limit = 5
/// window = "15m"
/// penalty = { refusals = 1, within = "15m", blocks = ["1m", "10m", "1h"] }
///
/// [[limits]]
/// name = "plan"
/// algorithm = "fixed-window"
/// limit = 10000
/// calendar = "month"
/// utc_offset = "+09:00"
/// ```
///
/// The same validation as [`Limit::new`] applies; errors name the limit and
/// the field (a missing one, one that does not belong to the algorithm, an
/// unknown one, or an invalid value).
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
impl<'de> Deserialize<'de> for Limit {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        LimitConfig::deserialize(deserializer)?
            .build()
            .map_err(serde::de::Error::custom)
    }
}
