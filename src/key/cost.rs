//! The one grammar of a cost, read the same way by every reader: a
//! request's header ([`Rule::cost_from_request_header`]) and JSON field
//! ([`Rule::cost_from_request_json`]), a response's header
//! ([`Rule::cost_from_response_header`]) and JSON or event-stream body
//! ([`Rule::cost_from_response_json`]).
//!
//! A cost is a JSON number token (RFC 8259, section 6; in a header, the
//! whole value) whose value is an integer from 0 to [`MAX_COST`] (2^53):
//! `100`, `100.0`, `1e2` and `1.0E+2` are all 100. Anything else is no
//! cost: a string (`"100"`), a negative (`-1`; `-0` is 0), a fraction
//! (`1.5`), a value over 2^53 (`2^64`, `1e400`), `true`, `null`, an array,
//! an object, a token with a sign `+` or leading zeros (`+5`, `007`).
//! Up to 2^53 every integer is exact as a float, so an integer and a
//! float of one value are one cost, and every reader (this crate, an
//! upstream in any language) reads the same number.
//!
//! [`Rule::cost_from_request_header`]: crate::layer::Rule::cost_from_request_header
//! [`Rule::cost_from_request_json`]: crate::layer::Rule::cost_from_request_json
//! [`Rule::cost_from_response_header`]: crate::layer::Rule::cost_from_response_header
//! [`Rule::cost_from_response_json`]: crate::layer::Rule::cost_from_response_json

/// The largest cost (2^53): every integer up to it is exact as an `f64`.
pub(crate) const MAX_COST: u64 = 1 << 53;

/// A JSON integer token read as a cost: itself up to [`MAX_COST`].
pub(crate) fn of_u64(value: u64) -> Option<u64> {
    (value <= MAX_COST).then_some(value)
}

/// A JSON negative integer token read as a cost: never one.
pub(crate) fn of_i64(value: i64) -> Option<u64> {
    u64::try_from(value).ok().and_then(of_u64)
}

/// A JSON float token (a fraction or an exponent) read as a cost: its
/// value when integral, from 0 (`-0.0` included) to [`MAX_COST`].
pub(crate) fn of_f64(value: f64) -> Option<u64> {
    // (`MAX_COST as f64` is exact; within the range, the cast is too, and
    // out of it a saturating one, unused)
    (value.fract() == 0.0 && (0.0..=MAX_COST as f64).contains(&value)).then_some(value as u64)
}

/// The cost a JSON number of a body is (see `crate::read`), if it is one.
pub(crate) fn of_json(number: crate::read::Number) -> Option<u64> {
    match number {
        crate::read::Number::U64(value) => of_u64(value),
        crate::read::Number::I64(value) => of_i64(value),
        crate::read::Number::F64(value) => of_f64(value),
    }
}

/// A JSON number read as a cost.
pub(crate) fn of_number(number: &serde_json::Number) -> Option<u64> {
    if let Some(value) = number.as_u64() {
        of_u64(value)
    } else if let Some(value) = number.as_i64() {
        of_i64(value)
    } else {
        of_f64(number.as_f64()?)
    }
}

/// A header value read as a cost: the whole value one JSON number token
/// (the same reading as a number in a JSON body).
pub(crate) fn of_text(text: &[u8]) -> Option<u64> {
    // a JSON text of one number, nothing around it
    if text
        .first()
        .is_none_or(|b| !(b.is_ascii_digit() || *b == b'-'))
    {
        return None;
    }
    let number: serde_json::Number = serde_json::from_slice(text).ok()?;
    // (JSON allows whitespace after the value; a header value has none)
    if text.last().is_some_and(u8::is_ascii_whitespace) {
        return None;
    }
    of_number(&number)
}

/// What the header `name` of `headers` tells as a cost: absent when it
/// is not there, unreadable when it is there more than once (readers
/// disagree about which line counts) or its value is no cost.
pub(crate) fn of_header(headers: &http::HeaderMap, name: &http::HeaderName) -> Told {
    let mut lines = headers.get_all(name).iter();
    match (lines.next(), lines.next()) {
        (None, _) => Told::Absent,
        (Some(value), None) => of_text(value.as_bytes()).map_or(Told::Unreadable, Told::Cost),
        (Some(_), Some(_)) => Told::Unreadable,
    }
}

/// What a request tells of its cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Told {
    /// A cost.
    Cost(u64),
    /// Nothing: the header or field is not there.
    Absent,
    /// Something that cannot be read as one cost unambiguously.
    Unreadable,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_grammar() {
        for (text, cost) in [
            ("100", Some(100)),
            ("100.0", Some(100)),
            ("1e2", Some(100)),
            ("1.0E+2", Some(100)),
            ("0", Some(0)),
            ("-0", Some(0)),
            ("-0.0", Some(0)),
            ("9007199254740992", Some(1 << 53)),
            ("9007199254740992.0", Some(1 << 53)),
            ("9007199254740993", None),
            ("9007199254740994.0", None),
            ("18446744073709551616", None),
            ("1e400", None),
            ("-1", None),
            ("1.5", None),
            ("\"100\"", None),
            ("true", None),
            ("null", None),
            ("[1]", None),
            ("{}", None),
            ("+5", None),
            ("007", None),
            (" 5", None),
            ("5 ", None),
            ("5,6", None),
            ("", None),
            ("0x10", None),
            ("NaN", None),
        ] {
            assert_eq!(of_text(text.as_bytes()), cost, "{text:?}");
            // the same value in a JSON body
            let json = format!("{{\"n\":{text}}}");
            if let Ok(serde_json::Value::Object(object)) = serde_json::from_str(&json) {
                let read = object
                    .get("n")
                    .and_then(|n| n.as_number())
                    .and_then(of_number);
                // (whitespace around a number is JSON's, not a header value's)
                let expected = of_text(text.trim().as_bytes());
                assert_eq!(read, expected, "{json}");
            }
        }
    }
}
