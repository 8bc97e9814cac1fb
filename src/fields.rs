//! The rate-limit header fields (`RateLimit-Policy`, `RateLimit`, the
//! legacy `X-RateLimit-*`) written from the limits a decision shows: below
//! both the decision, which writes its own
//! ([`Decision::insert_headers`](crate::Decision::insert_headers)), and the
//! layer, which writes them on the responses it forwards or refuses.
//! Nothing here knows a decision: it reads each limit through [`Shown`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};
use sfv::{Integer, KeyRef, ListSerializer, StringRef};

/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// Legacy `X-RateLimit-Limit`.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// Legacy `X-RateLimit-Remaining`.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// Legacy `X-RateLimit-Reset` (UTC epoch seconds, as GitHub sends it).
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// One limit as the fields show it (a decision's `LimitStatus`).
pub(crate) trait Shown {
    /// The limit's name.
    fn name(&self) -> &str;
    /// Its capacity: `q` of `RateLimit-Policy`.
    fn capacity(&self) -> u64;
    /// Its window: `w` of `RateLimit-Policy`.
    fn window(&self) -> Duration;
    /// What it still grants: `r` of `RateLimit`.
    fn remaining(&self) -> u64;
    /// The time until it is full again: `t` of `RateLimit`.
    fn reset_after(&self) -> Duration;
}

/// Whole seconds, rounded up: a positive wait never becomes 0.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Structured-field integers have at most 15 digits.
fn sf_int(n: u64) -> Integer {
    Integer::try_from(n.min(999_999_999_999_999)).unwrap_or(Integer::MAX)
}

/// Which rate-limit header fields to send.
#[derive(Debug, Clone)]
pub(crate) struct HeaderSet {
    pub(crate) ietf: bool,
    pub(crate) legacy: bool,
    /// The layer's `RateLimit-Policy` and the number of limits it lists.
    pub(crate) policy: Option<(usize, HeaderValue)>,
}

impl Default for HeaderSet {
    /// The IETF fields, not the legacy ones, the policy made per response.
    fn default() -> Self {
        Self {
            ietf: true,
            legacy: false,
            policy: None,
        }
    }
}

/// `RateLimit-Policy` for these limits: (name, quota, window) each. The
/// same for every response of a layer that decides all its limits, so the
/// layer computes it once (see [`HeaderSet::policy`]).
pub(crate) fn policy_value<'a>(
    limits: impl Iterator<Item = (&'a str, u64, Duration)>,
) -> Option<HeaderValue> {
    let mut policy = ListSerializer::new();
    for (name, quota, window) in limits {
        // Limit names are validated to [A-Za-z0-9_.-]: always valid strings.
        let Ok(name) = StringRef::from_str(name) else {
            continue;
        };
        policy
            .bare_item(name)
            .parameter(KeyRef::constant("q"), sf_int(quota))
            .parameter(KeyRef::constant("w"), sf_int(ceil_secs(window).max(1)));
    }
    HeaderValue::from_str(&policy.finish()?).ok()
}

/// `RateLimit` for these limits: `"name";r=remaining;t=seconds, ...`, a
/// structured List (RFC 9651) written directly: limit names are validated to
/// `[A-Za-z0-9_.-]`, which a String holds unescaped, and integers are capped
/// at the 15 digits an Integer may have.
fn state_value<S: Shown>(limits: &[S]) -> Option<HeaderValue> {
    // On the stack, copied once into the value: one limit always fits (a
    // name has at most 64 bytes, an integer 15 digits), and usually two.
    let mut line = crate::text::StackText::<160>::new();
    if write_state(limits, |text| line.put(text)) {
        return HeaderValue::from_bytes(line.as_bytes()).ok();
    }
    let mut out = Vec::new();
    write_state(limits, |text| {
        out.extend_from_slice(text);
        true
    });
    HeaderValue::from_bytes(&out).ok()
}

/// Writes the `RateLimit` value of `limits` through `put`; `false` as soon
/// as `put` refuses a piece.
#[inline(always)]
fn write_state<S: Shown>(limits: &[S], mut put: impl FnMut(&[u8]) -> bool) -> bool {
    let mut digits = itoa::Buffer::new();
    let cap = |n: u64| n.min(999_999_999_999_999);
    for (i, s) in limits.iter().enumerate() {
        let written = (i == 0 || put(b", "))
            && put(b"\"")
            && put(s.name().as_bytes())
            && put(b"\";r=")
            && put(digits.format(cap(s.remaining())).as_bytes())
            && put(b";t=")
            && put(digits.format(cap(ceil_secs(s.reset_after()))).as_bytes());
        if !written {
            return false;
        }
    }
    true
}

/// The rate-limit fields of one decision, computed before the request is
/// forwarded (the decision then moves into the request's extensions) and
/// added to the response when it comes back.
#[derive(Debug)]
pub(crate) struct Fields {
    policy: Option<HeaderValue>,
    state: Option<HeaderValue>,
    /// Legacy fields: the binding limit's capacity, remaining and reset.
    legacy: Option<(u64, u64, Duration)>,
}

impl Fields {
    /// The fields describing `limits` (a decision's, in its order) and its
    /// `binding` limit, per `set`; `None` when there are none.
    pub(crate) fn of<S: Shown>(
        limits: &[S],
        binding: Option<&S>,
        set: &HeaderSet,
    ) -> Option<Fields> {
        let mut fields = Fields {
            policy: None,
            state: None,
            legacy: None,
        };
        if set.ietf && !limits.is_empty() {
            // The layer's policy when the decision covers all its limits (some
            // are skipped for a request without their key).
            fields.policy = match &set.policy {
                Some((count, value)) if *count == limits.len() => Some(value.clone()),
                _ => policy_value(limits.iter().map(|s| (s.name(), s.capacity(), s.window()))),
            };
            fields.state = state_value(limits);
        }
        if set.legacy {
            fields.legacy = binding.map(|b| (b.capacity(), b.remaining(), b.reset_after()));
        }
        let empty = fields.policy.is_none() && fields.state.is_none() && fields.legacy.is_none();
        (!empty).then_some(fields)
    }

    /// Adds the fields to `headers`.
    pub(crate) fn apply(self, headers: &mut HeaderMap) {
        // Appended, not replaced: with nested layers each adds its limits, and
        // several lines of a structured List are one List (RFC 9651).
        if let Some(policy) = self.policy {
            headers.append(RATELIMIT_POLICY, policy);
        }
        if let Some(state) = self.state {
            headers.append(RATELIMIT, state);
        }
        if let Some((limit, remaining, reset_after)) = self.legacy {
            // One value each: keep the most restrictive of nested layers.
            let current = headers
                .get(X_RATELIMIT_REMAINING)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            if current.is_none_or(|current| remaining < current) {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                let reset = ceil_secs(now + reset_after);
                headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from(limit));
                headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(remaining));
                headers.insert(X_RATELIMIT_RESET, HeaderValue::from(reset));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_round_up_to_whole_seconds() {
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(2)), 2);
        assert_eq!(ceil_secs(Duration::from_millis(2001)), 3);
        assert_eq!(ceil_secs(Duration::ZERO), 0);
    }

    /// A limit's name, its remaining amount (and capacity) and reset (us).
    struct Status(&'static str, u64, u64);

    impl Shown for Status {
        fn name(&self) -> &str {
            self.0
        }
        fn capacity(&self) -> u64 {
            self.1
        }
        fn window(&self) -> Duration {
            Duration::from_micros(1)
        }
        fn remaining(&self) -> u64 {
            self.1
        }
        fn reset_after(&self) -> Duration {
            Duration::from_micros(self.2)
        }
    }

    /// The value written on the stack and the one written on the heap (more
    /// than fits on the stack) are the same text, RFC 9651's List.
    #[test]
    fn the_ratelimit_value_is_the_same_list_on_the_stack_and_beyond_it() {
        let long: &'static str = "a-name-of-the-longest-length-a-limit-may-have.0123456789_abcdefg";
        assert_eq!(long.len(), 64);
        let big = 10_u64.pow(18);
        for limits in [
            vec![Status("per-ip", 9, 1_500_000)],
            vec![Status(long, big, big)],
            vec![Status(long, big, big), Status("b", 0, 0)],
            // beyond the stack's 160 bytes
            vec![Status(long, big, big), Status(long, big, big)],
            vec![
                Status("a", 1, 1),
                Status(long, 7, 8),
                Status("c", 2, 2_000_001),
                Status(long, 0, 0),
            ],
        ] {
            let expected = limits
                .iter()
                .map(|s| {
                    let (r, t) = (
                        s.remaining().min(999_999_999_999_999),
                        ceil_secs(s.reset_after()),
                    );
                    format!("\"{}\";r={r};t={}", s.name(), t.min(999_999_999_999_999))
                })
                .collect::<Vec<_>>()
                .join(", ");
            let value = state_value(&limits).expect("a valid value");
            assert_eq!(value.to_str().ok(), Some(expected.as_str()));
            let parsed = sfv::Parser::new(&expected).parse::<sfv::List>();
            assert!(parsed.is_ok(), "{expected}");
        }
    }
}
