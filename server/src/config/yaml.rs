//! A YAML document as a tree of nodes, built from saphyr-parser's events.
//!
//! envoyproxy/ratelimit reads its files with Go's yaml.v2: plain scalars are
//! resolved as YAML 1.1 does (`yes`/`on` are booleans, `0.25` a float), a
//! string field takes any scalar's text, and only the first document counts.
//! This tree keeps each scalar's text, how it resolved and its line, so the
//! loader can do the same; it also refuses what yaml.v2 let pass silently:
//! a key written twice in one mapping.

use std::collections::HashMap;

use saphyr_parser::{Event, Parser, ScalarStyle, Span};

/// Nesting deeper than this is refused (a config is a few levels deep; the
/// bound keeps a hostile file from exhausting the stack).
const MAX_DEPTH: usize = 64;
/// Nodes (after aliases are expanded) beyond this are refused.
const MAX_NODES: usize = 1_000_000;

/// A node of the document.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Node {
    pub(crate) kind: Kind,
    /// The line it starts on (1-based).
    pub(crate) line: usize,
}

/// What a node is, scalars resolved as yaml.v2 resolves plain ones.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Kind {
    /// `~`, `null`, or nothing.
    Null(String),
    /// A boolean, with its text (`yes`, `true`, ...).
    Bool(bool, String),
    /// An integer, with its text.
    Int(i128, String),
    /// A float, with its text.
    Float(f64, String),
    /// A string (quoted, block, or plain that is nothing else).
    Str(String),
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping, in the order written.
    Map(Vec<(Node, Node)>),
}

impl Node {
    /// A scalar's text as a string field receives it (yaml.v2 sets a string
    /// field to the scalar's text whatever it resolved to); `None` for a
    /// null, a sequence or a mapping.
    pub(crate) fn scalar_text(&self) -> Option<&str> {
        match &self.kind {
            Kind::Bool(_, t) | Kind::Int(_, t) | Kind::Float(_, t) | Kind::Str(t) => Some(t),
            Kind::Null(_) | Kind::Seq(_) | Kind::Map(_) => None,
        }
    }

    /// The node as Go's `fmt` prints the value yaml.v2 decoded (`%v`), for
    /// the messages that quote a value.
    pub(crate) fn go_format(&self) -> String {
        match &self.kind {
            Kind::Null(_) => "<nil>".to_string(),
            Kind::Bool(b, _) => b.to_string(),
            Kind::Int(i, _) => i.to_string(),
            Kind::Float(f, text) => go_float(*f, text),
            Kind::Str(s) => s.clone(),
            Kind::Seq(items) => {
                let parts: Vec<String> = items.iter().map(Node::go_format).collect();
                format!("[{}]", parts.join(" "))
            }
            Kind::Map(entries) => {
                let mut parts: Vec<String> = entries
                    .iter()
                    .map(|(k, v)| format!("{}:{}", k.go_format(), v.go_format()))
                    .collect();
                parts.sort();
                format!("map[{}]", parts.join(" "))
            }
        }
    }

    /// Whether the node is a mapping.
    pub(crate) fn as_map(&self) -> Option<&[(Node, Node)]> {
        match &self.kind {
            Kind::Map(entries) => Some(entries),
            _ => None,
        }
    }

    /// The value of `key` in a mapping (keys compared as strings).
    pub(crate) fn get(&self, key: &str) -> Option<&Node> {
        self.as_map()?
            .iter()
            .find(|(k, _)| matches!(&k.kind, Kind::Str(s) if s == key))
            .map(|(_, v)| v)
    }

    /// Whether the node is null (or absent content).
    pub(crate) fn is_null(&self) -> bool {
        matches!(self.kind, Kind::Null(_))
    }
}

/// How Go prints a float64 with `%v` (`0.25`, `1e+21`), near enough: the
/// shortest text that reads back, which is Rust's `Display` but for the
/// exponent forms and the infinities.
fn go_float(f: f64, text: &str) -> String {
    if f.is_nan() {
        "NaN".to_string()
    } else if f.is_infinite() {
        if f > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else if f != 0.0 && (f.abs() >= 1e21 || f.abs() < 1e-4) {
        format!("{f:e}")
    } else if f.fract() == 0.0 && text.contains(['.', 'e', 'E']) {
        // Go prints 1.0 as 1.
        format!("{}", f as i128)
    } else {
        format!("{f}")
    }
}

/// Parses the first document of `text` (yaml.v2 reads only the first).
/// An empty text (or one of comments only) is an empty mapping, as yaml.v2
/// leaves the map it decodes into empty.
pub(crate) fn parse(text: &str) -> Result<Node, String> {
    let mut builder = Builder {
        parser: Parser::new_from_str(text),
        anchors: HashMap::new(),
        nodes: 0,
    };
    loop {
        let Some((event, span)) = builder.next()? else {
            return Ok(empty_map());
        };
        match event {
            Event::StreamStart | Event::Nothing => continue,
            Event::DocumentStart(_) => {
                let Some((event, span)) = builder.next()? else {
                    return Ok(empty_map());
                };
                if matches!(event, Event::DocumentEnd) {
                    return Ok(empty_map());
                }
                let node = builder.node(event, span, 0)?;
                // Read the rest of the stream so that a syntax error after
                // the first document is still an error (yaml.v2 reports it).
                while builder.next()?.is_some() {}
                return Ok(node);
            }
            Event::StreamEnd => return Ok(empty_map()),
            _ => return Err(format!("line {}: unexpected content", span.start.line())),
        }
    }
}

fn empty_map() -> Node {
    Node {
        kind: Kind::Map(Vec::new()),
        line: 1,
    }
}

struct Builder<'a> {
    parser: Parser<'a, saphyr_parser::StrInput<'a>>,
    anchors: HashMap<usize, Node>,
    nodes: usize,
}

impl<'a> Builder<'a> {
    fn next(&mut self) -> Result<Option<(Event<'a>, Span)>, String> {
        match self.parser.next() {
            None => Ok(None),
            Some(Ok((Event::StreamEnd, _))) => Ok(None),
            Some(Ok(pair)) => Ok(Some(pair)),
            Some(Err(e)) => Err(format!("line {}: {}", e.marker().line(), e.info())),
        }
    }

    fn count(&mut self, n: usize, line: usize) -> Result<(), String> {
        self.nodes = self.nodes.saturating_add(n);
        if self.nodes > MAX_NODES {
            return Err(format!(
                "line {line}: the document has more than {MAX_NODES} nodes"
            ));
        }
        Ok(())
    }

    fn node(&mut self, event: Event<'a>, span: Span, depth: usize) -> Result<Node, String> {
        let line = span.start.line();
        if depth > MAX_DEPTH {
            return Err(format!(
                "line {line}: nested deeper than {MAX_DEPTH} levels"
            ));
        }
        self.count(1, line)?;
        let (node, anchor) = match event {
            Event::Scalar(text, style, anchor, tag) => {
                let is_str_tag = tag.as_ref().is_some_and(|t| t.suffix == "str");
                let kind = if style == ScalarStyle::Plain && !is_str_tag {
                    resolve(&text)
                } else {
                    Kind::Str(text.into_owned())
                };
                (Node { kind, line }, anchor)
            }
            Event::SequenceStart(anchor, _) => {
                let mut items = Vec::new();
                loop {
                    let Some((event, span)) = self.next()? else {
                        return Err(format!("line {line}: unterminated sequence"));
                    };
                    if matches!(event, Event::SequenceEnd) {
                        break;
                    }
                    items.push(self.node(event, span, depth + 1)?);
                }
                (
                    Node {
                        kind: Kind::Seq(items),
                        line,
                    },
                    anchor,
                )
            }
            Event::MappingStart(anchor, _) => {
                let mut entries: Vec<(Node, Node)> = Vec::new();
                loop {
                    let Some((event, span)) = self.next()? else {
                        return Err(format!("line {line}: unterminated mapping"));
                    };
                    if matches!(event, Event::MappingEnd) {
                        break;
                    }
                    let key = self.node(event, span, depth + 1)?;
                    let Some((event, span)) = self.next()? else {
                        return Err(format!("line {}: a key without a value", key.line));
                    };
                    let value = self.node(event, span, depth + 1)?;
                    if let Some((first, _)) = entries.iter().find(|(k, _)| same_key(k, &key)) {
                        return Err(format!(
                            "line {}: key '{}' already defined at line {}",
                            key.line,
                            key.go_format(),
                            first.line
                        ));
                    }
                    entries.push((key, value));
                }
                (
                    Node {
                        kind: Kind::Map(entries),
                        line,
                    },
                    anchor,
                )
            }
            Event::Alias(id) => {
                let Some(node) = self.anchors.get(&id).cloned() else {
                    return Err(format!("line {line}: unknown anchor"));
                };
                self.count(size(&node), line)?;
                return Ok(Node { line, ..node });
            }
            _ => return Err(format!("line {line}: unexpected content")),
        };
        if anchor != 0 {
            self.anchors.insert(anchor, node.clone());
        }
        Ok(node)
    }
}

/// The number of nodes of a tree.
fn size(node: &Node) -> usize {
    match &node.kind {
        Kind::Seq(items) => 1 + items.iter().map(size).sum::<usize>(),
        Kind::Map(entries) => {
            1 + entries
                .iter()
                .map(|(k, v)| size(k) + size(v))
                .sum::<usize>()
        }
        _ => 1,
    }
}

/// Whether two mapping keys are the same key (as yaml.v2 would decode them).
fn same_key(a: &Node, b: &Node) -> bool {
    match (&a.kind, &b.kind) {
        (Kind::Str(x), Kind::Str(y)) => x == y,
        (Kind::Int(x, _), Kind::Int(y, _)) => x == y,
        (Kind::Bool(x, _), Kind::Bool(y, _)) => x == y,
        (Kind::Float(x, _), Kind::Float(y, _)) => x == y,
        (Kind::Null(_), Kind::Null(_)) => true,
        _ => false,
    }
}

/// A plain scalar resolved as yaml.v2 resolves it (YAML 1.1 booleans,
/// integers in decimal, `0x`, `0o`/`0` octal and `0b` binary with `_`
/// separators, floats and their `.inf`/`.nan` forms).
fn resolve(text: &str) -> Kind {
    match text {
        "" | "~" | "null" | "Null" | "NULL" => return Kind::Null(text.to_string()),
        "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" | "true" | "True" | "TRUE" => {
            return Kind::Bool(true, text.to_string())
        }
        "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" | "false" | "False" | "FALSE" => {
            return Kind::Bool(false, text.to_string())
        }
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => {
            return Kind::Float(f64::INFINITY, text.to_string())
        }
        "-.inf" | "-.Inf" | "-.INF" => return Kind::Float(f64::NEG_INFINITY, text.to_string()),
        ".nan" | ".NaN" | ".NAN" => return Kind::Float(f64::NAN, text.to_string()),
        _ => {}
    }
    if let Some(i) = parse_int(text) {
        return Kind::Int(i, text.to_string());
    }
    if looks_like_float(text) {
        if let Ok(f) = text.replace('_', "").parse::<f64>() {
            return Kind::Float(f, text.to_string());
        }
    }
    Kind::Str(text.to_string())
}

fn parse_int(text: &str) -> Option<i128> {
    let (negative, digits) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let plain = digits.replace('_', "");
    if plain.is_empty() {
        return None;
    }
    let value = if let Some(hex) = plain.strip_prefix("0x") {
        i128::from_str_radix(hex, 16).ok()?
    } else if let Some(bin) = plain.strip_prefix("0b") {
        i128::from_str_radix(bin, 2).ok()?
    } else if let Some(oct) = plain.strip_prefix("0o") {
        i128::from_str_radix(oct, 8).ok()?
    } else if plain.len() > 1 && plain.starts_with('0') {
        i128::from_str_radix(&plain[1..], 8).ok()?
    } else if plain.bytes().all(|b| b.is_ascii_digit()) {
        plain.parse::<i128>().ok()?
    } else {
        return None;
    };
    // Every digit string parsed above is non-negative.
    Some(if negative { -value } else { value })
}

fn looks_like_float(text: &str) -> bool {
    let t = text.strip_prefix(['-', '+']).unwrap_or(text);
    let mut digits = false;
    let mut chars = t.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_ascii_digit() || c == '_' {
            digits |= c.is_ascii_digit();
            chars.next();
        } else {
            break;
        }
    }
    if chars.peek() == Some(&'.') {
        chars.next();
        while let Some(&c) = chars.peek() {
            if c.is_ascii_digit() || c == '_' {
                digits |= c.is_ascii_digit();
                chars.next();
            } else {
                break;
            }
        }
    }
    if !digits {
        return false;
    }
    if matches!(chars.peek(), Some('e' | 'E')) {
        chars.next();
        if matches!(chars.peek(), Some('-' | '+')) {
            chars.next();
        }
        let mut exp = false;
        while let Some(&c) = chars.peek() {
            if c.is_ascii_digit() {
                exp = true;
                chars.next();
            } else {
                break;
            }
        }
        if !exp {
            return false;
        }
    }
    chars.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_resolve_as_yaml_v2() {
        assert!(matches!(resolve("0.25"), Kind::Float(f, _) if f == 0.25));
        assert!(matches!(resolve("5"), Kind::Int(5, _)));
        assert!(matches!(resolve("-5"), Kind::Int(-5, _)));
        assert!(matches!(resolve("yes"), Kind::Bool(true, _)));
        assert!(matches!(resolve("off"), Kind::Bool(false, _)));
        assert!(matches!(resolve("~"), Kind::Null(_)));
        assert!(matches!(resolve("foo*"), Kind::Str(_)));
        assert!(matches!(resolve("1.2.3"), Kind::Str(_)));
        assert!(matches!(resolve("e5"), Kind::Str(_)));
        assert!(matches!(resolve("1e5"), Kind::Float(..)));
        assert!(matches!(resolve("-"), Kind::Str(_)));
    }

    #[test]
    fn duplicate_keys_are_refused_and_aliases_expand() {
        assert!(parse("a: 1\nb: 2\na: 3\n")
            .unwrap_err()
            .contains("'a' already defined"));
        let doc = parse("x: &v {k: 1}\nz: *v\n").unwrap();
        assert_eq!(
            doc.get("z")
                .and_then(|n| n.get("k"))
                .and_then(Node::scalar_text),
            Some("1")
        );
        assert_eq!(parse("").unwrap().as_map().map(<[_]>::len), Some(0));
        assert_eq!(parse("# only\n").unwrap().as_map().map(<[_]>::len), Some(0));
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(parse(&deep).is_err());
    }
}
