//! `POST /json`: a `RateLimitRequest` in protobuf's JSON mapping, answered
//! with the `RateLimitResponse` in the same mapping, as envoyproxy/ratelimit
//! reads and writes them (Go's `protojson`): field names in lowerCamelCase
//! or as in the `.proto`, enums by name or number, `uint64` and wrapper
//! values as numbers or strings, durations as `"1.5s"`; unknown fields are
//! refused. The response leaves out fields at their default value.

use serde_json::{Map, Value};

use crate::proto::rate_limit_descriptor::{Entry, RateLimitOverride};
use crate::proto::rate_limit_response::rate_limit::Unit;
use crate::proto::rate_limit_response::{Code, DescriptorStatus, Quota, RateLimit};
use crate::proto::{HeaderValue, RateLimitDescriptor, RateLimitRequest, RateLimitResponse};

/// Why a JSON request was refused (for the log; the client gets only
/// `400 Bad Request`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError(pub String);

impl std::fmt::Display for JsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for JsonError {}

fn err(msg: impl Into<String>) -> JsonError {
    JsonError(msg.into())
}

/// The fields of a JSON object, each under its proto name or its JSON name
/// (either accepted, each at most once), unknown ones refused.
struct Fields<'a> {
    message: &'static str,
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn new(
        message: &'static str,
        value: &'a Value,
        known: &[(&str, &str)],
    ) -> Result<Self, JsonError> {
        let map = value
            .as_object()
            .ok_or_else(|| err(format!("{message}: expected an object")))?;
        for key in map.keys() {
            if !known.iter().any(|(p, j)| key == p || key == j) {
                return Err(err(format!("{message}: unknown field {key:?}")));
            }
        }
        for (p, j) in known {
            if p != j && map.contains_key(*p) && map.contains_key(*j) {
                return Err(err(format!("{message}: field {p:?} given twice")));
            }
        }
        Ok(Fields { message, map })
    }

    /// The field's value; `null` counts as absent, as protojson has it.
    fn get(&self, proto: &str, json: &str) -> Option<&'a Value> {
        self.map
            .get(json)
            .or_else(|| self.map.get(proto))
            .filter(|v| !v.is_null())
    }

    fn string(&self, proto: &str, json: &str) -> Result<String, JsonError> {
        match self.get(proto, json) {
            None => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(err(format!("{}.{json}: expected a string", self.message))),
        }
    }

    fn boolean(&self, proto: &str, json: &str) -> Result<bool, JsonError> {
        match self.get(proto, json) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(err(format!(
                "{}.{json}: expected true or false",
                self.message
            ))),
        }
    }

    fn u32(&self, proto: &str, json: &str) -> Result<u32, JsonError> {
        match self.get(proto, json) {
            None => Ok(0),
            Some(v) => unsigned(v)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| err(format!("{}.{json}: expected a uint32", self.message))),
        }
    }

    fn array(&self, proto: &str, json: &str) -> Result<&'a [Value], JsonError> {
        match self.get(proto, json) {
            None => Ok(&[]),
            Some(Value::Array(items)) => Ok(items),
            Some(_) => Err(err(format!("{}.{json}: expected an array", self.message))),
        }
    }
}

/// An unsigned integer as protojson accepts it: a JSON number without a
/// fraction (`5`, `5.0`, `5e0`) or a string holding one.
fn unsigned(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            let f = n.as_f64()?;
            (f >= 0.0 && f.fract() == 0.0 && f < 18_446_744_073_709_551_616.0).then_some(f as u64)
        }),
        Value::String(s) => s.parse::<u64>().ok(),
        _ => None,
    }
}

/// Reads a `RateLimitRequest`.
pub fn parse_request(body: &[u8]) -> Result<RateLimitRequest, JsonError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| err(format!("invalid JSON: {e}")))?;
    let f = Fields::new(
        "RateLimitRequest",
        &value,
        &[
            ("domain", "domain"),
            ("descriptors", "descriptors"),
            ("hits_addend", "hitsAddend"),
        ],
    )?;
    Ok(RateLimitRequest {
        domain: f.string("domain", "domain")?,
        descriptors: f
            .array("descriptors", "descriptors")?
            .iter()
            .map(parse_descriptor)
            .collect::<Result<_, _>>()?,
        hits_addend: f.u32("hits_addend", "hitsAddend")?,
    })
}

fn parse_descriptor(value: &Value) -> Result<RateLimitDescriptor, JsonError> {
    let f = Fields::new(
        "RateLimitDescriptor",
        value,
        &[
            ("entries", "entries"),
            ("limit", "limit"),
            ("hits_addend", "hitsAddend"),
            ("is_negative_hits", "isNegativeHits"),
        ],
    )?;
    let entries = f
        .array("entries", "entries")?
        .iter()
        .map(|e| {
            let f = Fields::new("Entry", e, &[("key", "key"), ("value", "value")])?;
            Ok(Entry {
                key: f.string("key", "key")?,
                value: f.string("value", "value")?,
            })
        })
        .collect::<Result<_, JsonError>>()?;
    let limit = match f.get("limit", "limit") {
        None => None,
        Some(v) => {
            let l = Fields::new(
                "RateLimitOverride",
                v,
                &[("requests_per_unit", "requestsPerUnit"), ("unit", "unit")],
            )?;
            Some(RateLimitOverride {
                requests_per_unit: l.u32("requests_per_unit", "requestsPerUnit")?,
                unit: match l.get("unit", "unit") {
                    None => 0,
                    Some(u) => parse_unit(u)?,
                },
            })
        }
    };
    // google.protobuf.UInt64Value: its JSON form is the bare value
    let hits_addend = match f.get("hits_addend", "hitsAddend") {
        None => None,
        Some(v) => Some(
            unsigned(v).ok_or_else(|| err("RateLimitDescriptor.hitsAddend: expected a uint64"))?,
        ),
    };
    Ok(RateLimitDescriptor {
        entries,
        limit,
        hits_addend,
        is_negative_hits: f.boolean("is_negative_hits", "isNegativeHits")?,
    })
}

fn parse_unit(v: &Value) -> Result<i32, JsonError> {
    let unit = match v {
        Value::String(name) => UNITS
            .iter()
            .find(|(_, n)| n == name)
            .map(|(u, _)| *u as i32),
        Value::Number(n) => n
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .filter(|n| Unit::try_from(*n).is_ok()),
        _ => None,
    };
    unit.ok_or_else(|| err(format!("RateLimitOverride.unit: {v} is not a unit")))
}

/// The units' names in the `.proto`.
const UNITS: [(Unit, &str); 8] = [
    (Unit::Unknown, "UNKNOWN"),
    (Unit::Second, "SECOND"),
    (Unit::Minute, "MINUTE"),
    (Unit::Hour, "HOUR"),
    (Unit::Day, "DAY"),
    (Unit::Month, "MONTH"),
    (Unit::Year, "YEAR"),
    (Unit::Week, "WEEK"),
];

/// The codes' names in the `.proto`.
const CODES: [(Code, &str); 3] = [
    (Code::Unknown, "UNKNOWN"),
    (Code::Ok, "OK"),
    (Code::OverLimit, "OVER_LIMIT"),
];

/// Writes a `RateLimitResponse` as protojson does (default values left out).
pub fn response_to_json(response: &RateLimitResponse) -> Value {
    let mut o = Map::new();
    if response.overall_code != 0 {
        o.insert("overallCode".into(), code(response.overall_code));
    }
    if !response.statuses.is_empty() {
        o.insert(
            "statuses".into(),
            Value::Array(response.statuses.iter().map(status).collect()),
        );
    }
    if !response.response_headers_to_add.is_empty() {
        o.insert(
            "responseHeadersToAdd".into(),
            Value::Array(
                response
                    .response_headers_to_add
                    .iter()
                    .map(header)
                    .collect(),
            ),
        );
    }
    if !response.request_headers_to_add.is_empty() {
        o.insert(
            "requestHeadersToAdd".into(),
            Value::Array(response.request_headers_to_add.iter().map(header).collect()),
        );
    }
    if !response.raw_body.is_empty() {
        o.insert("rawBody".into(), Value::String(base64(&response.raw_body)));
    }
    if let Some(metadata) = &response.dynamic_metadata {
        o.insert("dynamicMetadata".into(), structure(metadata));
    }
    if let Some(q) = &response.quota {
        o.insert("quota".into(), quota(q));
    }
    Value::Object(o)
}

/// An enum value by name, or its number when it has none.
fn code(n: i32) -> Value {
    match CODES.iter().find(|(c, _)| *c as i32 == n) {
        Some((_, name)) => Value::String((*name).into()),
        None => Value::from(n),
    }
}

fn status(s: &DescriptorStatus) -> Value {
    let mut o = Map::new();
    if s.code != 0 {
        o.insert("code".into(), code(s.code));
    }
    if let Some(limit) = &s.current_limit {
        o.insert("currentLimit".into(), rate_limit(limit));
    }
    if s.limit_remaining != 0 {
        o.insert("limitRemaining".into(), Value::from(s.limit_remaining));
    }
    if let Some(d) = &s.duration_until_reset {
        o.insert("durationUntilReset".into(), duration(d));
    }
    if let Some(q) = &s.quota {
        o.insert("quota".into(), quota(q));
    }
    Value::Object(o)
}

fn rate_limit(l: &RateLimit) -> Value {
    let mut o = Map::new();
    if !l.name.is_empty() {
        o.insert("name".into(), Value::String(l.name.clone()));
    }
    if l.requests_per_unit != 0 {
        o.insert("requestsPerUnit".into(), Value::from(l.requests_per_unit));
    }
    if l.unit != 0 {
        let unit = match UNITS.iter().find(|(u, _)| *u as i32 == l.unit) {
            Some((_, name)) => Value::String((*name).into()),
            None => Value::from(l.unit),
        };
        o.insert("unit".into(), unit);
    }
    Value::Object(o)
}

fn quota(q: &Quota) -> Value {
    let mut o = Map::new();
    if q.requests != 0 {
        o.insert("requests".into(), Value::from(q.requests));
    }
    if let Some(t) = &q.valid_until {
        o.insert("validUntil".into(), Value::String(rfc3339(t)));
    }
    if !q.id.is_empty() {
        o.insert("id".into(), Value::String(q.id.clone()));
    }
    Value::Object(o)
}

fn header(h: &HeaderValue) -> Value {
    let mut o = Map::new();
    if !h.key.is_empty() {
        o.insert("key".into(), Value::String(h.key.clone()));
    }
    if !h.value.is_empty() {
        o.insert("value".into(), Value::String(h.value.clone()));
    }
    if !h.raw_value.is_empty() {
        o.insert("rawValue".into(), Value::String(base64(&h.raw_value)));
    }
    Value::Object(o)
}

/// `google.protobuf.Duration`: seconds with 0, 3, 6 or 9 fractional digits
/// and an `s`.
fn duration(d: &prost_types::Duration) -> Value {
    let negative = d.seconds < 0 || d.nanos < 0;
    let secs = d.seconds.unsigned_abs();
    let nanos = d.nanos.unsigned_abs();
    let sign = if negative { "-" } else { "" };
    let text = if nanos == 0 {
        format!("{sign}{secs}s")
    } else if nanos.is_multiple_of(1_000_000) {
        format!("{sign}{secs}.{:03}s", nanos / 1_000_000)
    } else if nanos.is_multiple_of(1_000) {
        format!("{sign}{secs}.{:06}s", nanos / 1_000)
    } else {
        format!("{sign}{secs}.{nanos:09}s")
    };
    Value::String(text)
}

/// `google.protobuf.Timestamp` as RFC 3339 in UTC.
pub(crate) fn rfc3339(t: &prost_types::Timestamp) -> String {
    // days since the epoch to a civil date (Howard Hinnant's algorithm)
    let days = t.seconds.div_euclid(86_400);
    let secs = t.seconds.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let frac = if t.nanos > 0 {
        format!(".{:09}", t.nanos).trim_end_matches('0').to_owned()
    } else {
        String::new()
    };
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}{frac}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

fn structure(s: &prost_types::Struct) -> Value {
    Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), struct_value(v)))
            .collect(),
    )
}

fn struct_value(v: &prost_types::Value) -> Value {
    use prost_types::value::Kind;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(*n)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        Some(Kind::StructValue(s)) => structure(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(struct_value).collect()),
    }
}

/// Standard base64 with padding (protojson's `bytes`).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_spellings() {
        let r = parse_request(
            br#"{"domain":"d","hits_addend":2,"descriptors":[
                {"entries":[{"key":"k","value":"v"}],"hitsAddend":"0","isNegativeHits":true,
                 "limit":{"requests_per_unit":5,"unit":"MINUTE"}},
                {"entries":[{"key":"perday"}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.domain, "d");
        assert_eq!(r.hits_addend, 2);
        assert_eq!(r.descriptors.len(), 2);
        let d = &r.descriptors[0];
        assert_eq!(d.hits_addend, Some(0));
        assert!(d.is_negative_hits);
        assert_eq!(
            d.limit,
            Some(RateLimitOverride {
                requests_per_unit: 5,
                unit: Unit::Minute as i32
            })
        );
        assert_eq!(r.descriptors[1].entries[0].value, "");
        assert_eq!(r.descriptors[1].hits_addend, None);
    }

    #[test]
    fn refuses_what_protojson_refuses() {
        for body in [
            &b"not json"[..],
            br#"[]"#,
            br#"{"domain":1}"#,
            br#"{"domian":"d"}"#,
            br#"{"domain":"d","descriptors":{}}"#,
            br#"{"hitsAddend":-1}"#,
            br#"{"hitsAddend":1.5}"#,
            br#"{"hitsAddend":4294967296}"#,
            br#"{"hits_addend":1,"hitsAddend":1}"#,
            br#"{"descriptors":[{"limit":{"unit":"FORTNIGHT"}}]}"#,
            br#"{"descriptors":[{"entries":[{"key":"k","extra":1}]}]}"#,
        ] {
            assert!(
                parse_request(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn writes_as_protojson() {
        let response = RateLimitResponse {
            overall_code: Code::OverLimit as i32,
            statuses: vec![
                DescriptorStatus {
                    code: Code::OverLimit as i32,
                    current_limit: Some(RateLimit {
                        requests_per_unit: 1,
                        unit: Unit::Minute as i32,
                        name: String::new(),
                    }),
                    limit_remaining: 0,
                    duration_until_reset: Some(prost_types::Duration {
                        seconds: 3,
                        nanos: 500_000_000,
                    }),
                    quota: None,
                },
                DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                },
            ],
            response_headers_to_add: vec![HeaderValue {
                key: "RateLimit-Limit".into(),
                value: "1".into(),
                raw_value: vec![],
            }],
            ..Default::default()
        };
        assert_eq!(
            response_to_json(&response),
            serde_json::json!({
                "overallCode": "OVER_LIMIT",
                "statuses": [
                    {"code": "OVER_LIMIT",
                     "currentLimit": {"requestsPerUnit": 1, "unit": "MINUTE"},
                     "durationUntilReset": "3.500s"},
                    {"code": "OK"}
                ],
                "responseHeadersToAdd": [{"key": "RateLimit-Limit", "value": "1"}]
            })
        );
    }

    #[test]
    fn encodings() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(
            rfc3339(&prost_types::Timestamp {
                seconds: 1_700_000_000,
                nanos: 5_000_000
            }),
            "2023-11-14T22:13:20.005Z"
        );
    }
}
