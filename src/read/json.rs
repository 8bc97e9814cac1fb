//! The value at a dotted path (`"usage.total_tokens"`) of one JSON text,
//! read without building the values it skips.
//!
//! A path is non-empty names separated by single dots; each name is looked
//! up in the object it reaches (a value on the way that is no object, or
//! `null`, leaves the path absent). A name given twice in an object on the
//! way makes the text unreadable: parsers disagree about which one counts,
//! so the upstream and the limiter could read two different values.

use std::fmt;
use std::sync::Arc;

use serde::de::{DeserializeSeed, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// A dotted path into a JSON value (cheap to clone).
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct JsonPath(Arc<[Box<str>]>);

impl fmt::Debug for JsonPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0.join("."))
    }
}

impl fmt::Display for JsonPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("."))
    }
}

impl JsonPath {
    /// Parses `"usage.total_tokens"`; `Err(message)` when the path is empty
    /// or has an empty name.
    pub(crate) fn parse(path: &str) -> Result<Self, String> {
        if path.is_empty() {
            return Err("a JSON path is empty".to_owned());
        }
        let names: Vec<Box<str>> = path.split('.').map(Box::from).collect();
        if names.iter().any(|name| name.is_empty()) {
            return Err(format!(
                "the JSON path {path:?} has an empty name \
                 (names are separated by single dots)"
            ));
        }
        Ok(JsonPath(names.into()))
    }

    /// The path of one name, taken whole (dots included): a top-level
    /// field.
    pub(crate) fn name(name: &str) -> Self {
        JsonPath(Arc::from([Box::from(name)]))
    }

    /// The path's names, in order (at least one).
    pub(crate) fn names(&self) -> &[Box<str>] {
        &self.0
    }
}

/// A JSON number: a whole number that fits `u64` or `i64`, else a float.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Number {
    /// A non-negative whole number.
    U64(u64),
    /// A negative whole number.
    I64(i64),
    /// Any other number.
    F64(f64),
}

/// The value found at the end of a path.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    /// `null`.
    Null,
    /// A number, as the JSON text wrote it (read as a cost by
    /// `key/cost.rs`'s one grammar).
    Number(Number),
    /// A string.
    String(String),
    /// `true`, `false`, an object or an array.
    Other,
}

/// The value at `path` in the JSON text `json`: `Some(None)` when the path
/// is absent (a name missing, or a value on the way that is no object);
/// `None` when `json` is not one JSON value, or an object on the way gives
/// a name of the path twice.
pub(crate) fn find(json: &[u8], path: &JsonPath) -> Option<Option<Value>> {
    let mut reader = serde_json::Deserializer::from_slice(json);
    let found = At(path.names()).deserialize(&mut reader).ok()?;
    reader.end().ok()?;
    Some(found)
}

/// Reads the value at a path, skipping everything else unparsed.
struct At<'p>(&'p [Box<str>]);

impl<'de> DeserializeSeed<'de> for At<'_> {
    type Value = Option<Value>;

    fn deserialize<D: serde::Deserializer<'de>>(self, json: D) -> Result<Self::Value, D::Error> {
        if self.0.is_empty() {
            json.deserialize_any(Leaf).map(Some)
        } else {
            json.deserialize_any(self)
        }
    }
}

impl<'de> Visitor<'de> for At<'_> {
    type Value = Option<Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let Some((name, rest)) = self.0.split_first() else {
            return Err(A::Error::custom("no name to look for"));
        };
        let mut found = None;
        while let Some(matches) = map.next_key_seed(NameIs(name))? {
            if !matches {
                map.next_value::<IgnoredAny>()?;
            } else if found.replace(map.next_value_seed(At(rest))?).is_some() {
                return Err(A::Error::custom("a name is given twice"));
            }
        }
        Ok(found.flatten())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// Reads the value at the end of a path.
struct Leaf;

impl<'de> Visitor<'de> for Leaf {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_u64<E>(self, value: u64) -> Result<Value, E> {
        Ok(Value::Number(Number::U64(value)))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Value, E> {
        Ok(Value::Number(Number::I64(value)))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Value, E> {
        Ok(Value::Number(Number::F64(value)))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Value, E> {
        Ok(Value::Other)
    }

    fn visit_str<E>(self, text: &str) -> Result<Value, E> {
        Ok(Value::String(text.to_owned()))
    }

    fn visit_string<E>(self, text: String) -> Result<Value, E> {
        Ok(Value::String(text))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Value::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Value::Other)
    }
}

/// Reads an object's name: whether it is this one, without keeping it.
struct NameIs<'n>(&'n str);

impl<'de> DeserializeSeed<'de> for NameIs<'_> {
    type Value = bool;

    fn deserialize<D: serde::Deserializer<'de>>(self, json: D) -> Result<bool, D::Error> {
        json.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a name")
    }

    fn visit_str<E>(self, name: &str) -> Result<bool, E> {
        Ok(name == self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(json: &str, path: &str) -> Option<Option<Value>> {
        find(json.as_bytes(), &JsonPath::parse(path).unwrap())
    }

    #[test]
    fn paths_need_names() {
        assert!(JsonPath::parse("").is_err());
        assert!(JsonPath::parse("a..b").is_err());
        assert!(JsonPath::parse(".a").is_err());
        assert!(JsonPath::parse("a.").is_err());
        assert_eq!(
            JsonPath::parse("usage.total_tokens").unwrap().names().len(),
            2
        );
    }

    #[test]
    fn values_at_paths() {
        let json = r#"{"model":"m","usage":{"total_tokens":12,"who":"ann","n":null},"x":[1]}"#;
        assert_eq!(
            at(json, "usage.total_tokens"),
            Some(Some(Value::Number(Number::U64(12))))
        );
        assert_eq!(
            at(json, "usage.who"),
            Some(Some(Value::String("ann".into())))
        );
        assert_eq!(at(json, "usage.n"), Some(Some(Value::Null)));
        assert_eq!(at(json, "usage"), Some(Some(Value::Other)));
        assert_eq!(at(json, "x"), Some(Some(Value::Other)));
        assert_eq!(at(json, "usage.none"), Some(None));
        assert_eq!(at(json, "model.deeper"), Some(None));
        assert_eq!(at(json, "x.0"), Some(None));
        assert_eq!(
            at(r#"{"a":-1.5}"#, "a"),
            Some(Some(Value::Number(Number::F64(-1.5))))
        );
        assert_eq!(
            at(r#"{"a":1e2}"#, "a"),
            Some(Some(Value::Number(Number::F64(100.0))))
        );
    }

    #[test]
    fn names_twice_on_the_way_and_broken_json_are_unreadable() {
        assert_eq!(at(r#"{"a":1,"a":2}"#, "a"), None);
        assert_eq!(at(r#"{"u":{"a":1,"a":2}}"#, "u.a"), None);
        assert_eq!(at(r#"{"a":1"#, "a"), None);
        assert_eq!(at(r#"{"a":1} {}"#, "a"), None);
        // a name given twice off the path is not read
        assert_eq!(
            at(r#"{"b":1,"b":2,"a":3}"#, "a"),
            Some(Some(Value::Number(Number::U64(3))))
        );
    }
}
