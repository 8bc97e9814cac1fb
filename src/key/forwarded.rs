//! Reading the hop lists of `X-Forwarded-For` and `Forwarded` (RFC 7239),
//! right to left: the resolver's trust policy ([`super::ip`]) looks at the
//! rightmost hops first and stops early, so nothing left of where it stops
//! is parsed, and nothing is buffered.
//!
//! Lines are read last first, and each line from its end. A `Forwarded`
//! line is cut into elements at the commas outside quoted strings, found
//! from the right (a quote escaped by an odd run of backslashes does not
//! count); so an element a client wrote badly, an unterminated quote
//! included, spoils only itself, never the elements its proxies appended to
//! its right.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::ops::ControlFlow;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The longest `for=` value (after unescaping) that is considered. The longest
/// valid one, `"[ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255]:65535"`, is
/// 53 bytes; obfuscated ports could be longer but are not worth a heap buffer.
const MAX_NODE_LEN: usize = 64;

/// One entry of a hop list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Hop {
    /// A usable, normalised address.
    Addr(IpAddr),
    /// Anything else: the walk stops here.
    Garbage,
}

impl From<Option<IpAddr>> for Hop {
    fn from(ip: Option<IpAddr>) -> Self {
        match ip {
            Some(ip) => Hop::Addr(ip.to_canonical()),
            None => Hop::Garbage,
        }
    }
}

/// Calls `visit` with the hops of every `X-Forwarded-For` line, rightmost
/// first, until it breaks.
pub(super) fn x_forwarded_for_from_right(
    headers: &HeaderMap,
    mut visit: impl FnMut(Hop) -> ControlFlow<()>,
) {
    for line in headers.get_all(X_FORWARDED_FOR).iter().rev() {
        let flow = match std::str::from_utf8(line.as_bytes()) {
            Ok(text) => text
                .rsplit(',')
                .try_for_each(|entry| visit(parse_xff_entry(entry).into())),
            Err(_) => visit(Hop::Garbage),
        };
        if flow.is_break() {
            return;
        }
    }
}

/// Calls `visit` with the hops of every `Forwarded` line, rightmost first,
/// until it breaks.
pub(super) fn forwarded_from_right(
    headers: &HeaderMap,
    mut visit: impl FnMut(Hop) -> ControlFlow<()>,
) {
    for line in headers.get_all(header::FORWARDED).iter().rev() {
        if elements_from_right(line, &mut visit).is_break() {
            return;
        }
    }
}

/// The hops of one `Forwarded` line, rightmost first.
fn elements_from_right(
    line: &HeaderValue,
    visit: &mut impl FnMut(Hop) -> ControlFlow<()>,
) -> ControlFlow<()> {
    let Ok(text) = std::str::from_utf8(line.as_bytes()) else {
        return visit(Hop::Garbage);
    };
    let b = text.as_bytes();
    let (mut end, mut quoted) = (b.len(), false);
    for i in (0..b.len()).rev() {
        match b[i] {
            b'"' if !escaped(b, i) => quoted = !quoted,
            b',' if !quoted => {
                visit(parse_element(&b[i + 1..end]))?;
                end = i;
            }
            _ => {}
        }
    }
    visit(parse_element(&b[..end]))
}

/// Whether the byte at `i` follows an odd run of backslashes.
fn escaped(b: &[u8], i: usize) -> bool {
    let run = b[..i].iter().rev().take_while(|&&c| c == b'\\').count();
    run % 2 == 1
}

/// Whether `c` is an RFC 7230 `tchar`.
fn is_tchar(c: u8) -> bool {
    c.is_ascii_alphanumeric()
        || matches!(
            c,
            b'!' | b'#'
                | b'$'
                | b'%'
                | b'&'
                | b'\''
                | b'*'
                | b'+'
                | b'-'
                | b'.'
                | b'^'
                | b'_'
                | b'`'
                | b'|'
                | b'~'
        )
}

fn skip_ows(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && (b[i] == b' ' || b[i] == b'\t') {
        i += 1;
    }
    i
}

/// A decimal port: 1 to 5 digits, at most 65535.
fn is_port(p: &str) -> bool {
    (1..=5).contains(&p.len()) && p.bytes().all(|c| c.is_ascii_digit()) && p.parse::<u16>().is_ok()
}

/// An RFC 7239 obfuscated port: `_` followed by ALPHA / DIGIT / `.` `_` `-`.
fn is_obf_port(p: &str) -> bool {
    p.strip_prefix('_').is_some_and(|rest| {
        !rest.is_empty()
            && rest
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
    })
}

/// Accepts `1.2.3.4`, `1.2.3.4:8080`, `2001:db8::1`, `[2001:db8::1]` and
/// `[2001:db8::1]:443`, with surrounding spaces or tabs.
pub(super) fn parse_xff_entry(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim_matches(|c| c == ' ' || c == '\t');
    if let Some(rest) = entry.strip_prefix('[') {
        let (inner, after) = rest.split_once(']')?;
        let ip = inner.parse::<Ipv6Addr>().ok()?;
        if !after.is_empty() && !after.strip_prefix(':').is_some_and(is_port) {
            return None;
        }
        return Some(IpAddr::V6(ip));
    }
    if let Ok(ip) = entry.parse::<IpAddr>() {
        return Some(ip);
    }
    let (host, port) = entry.rsplit_once(':')?;
    let ip = host.parse::<Ipv4Addr>().ok()?;
    is_port(port).then_some(IpAddr::V4(ip))
}

/// An unescaped parameter value, with room for one byte more than
/// [`MAX_NODE_LEN`]: a value that fills it is too long (see [`node_text`]).
type ValueBuf = crate::text::StackText<{ MAX_NODE_LEN + 1 }>;

/// The text of a `for=` value, `None` when it is longer than
/// [`MAX_NODE_LEN`] or not UTF-8.
fn node_text(value: &ValueBuf) -> Option<&str> {
    let bytes = value.as_bytes();
    if bytes.len() > MAX_NODE_LEN {
        return None;
    }
    std::str::from_utf8(bytes).ok()
}

/// One `Forwarded` element (the text between two separating commas): its
/// `for=` node, or garbage unless it is well formed with exactly one `for=`.
fn parse_element(b: &[u8]) -> Hop {
    // `None` until a `for=` is seen; then its parsed node, if any.
    let mut node: Option<Option<IpAddr>> = None;
    let mut i = 0;
    loop {
        i = skip_ows(b, i);
        let name_start = i;
        while i < b.len() && is_tchar(b[i]) {
            i += 1;
        }
        let name = &b[name_start..i];
        if !name.is_empty() {
            if b.get(i) != Some(&b'=') {
                return Hop::Garbage;
            }
            i += 1;
            let mut value = ValueBuf::new();
            let quoted = b.get(i) == Some(&b'"');
            if quoted {
                match read_quoted(b, i + 1, &mut value) {
                    Some(end) => i = end,
                    None => return Hop::Garbage,
                }
            } else {
                let start = i;
                // Lenient: `:` is allowed so that `for=192.0.2.1:80` parses.
                while i < b.len() && (is_tchar(b[i]) || b[i] == b':') {
                    value.push(b[i]);
                    i += 1;
                }
                if i == start {
                    return Hop::Garbage;
                }
            }
            if name.eq_ignore_ascii_case(b"for") {
                if node.is_some() {
                    // RFC 7239: a parameter must not occur twice in an element.
                    return Hop::Garbage;
                }
                node = Some(node_text(&value).and_then(|v| parse_node(v, quoted)));
            }
            i = skip_ows(b, i);
        }
        match b.get(i) {
            Some(b';') => i += 1,
            None => return node.flatten().into(),
            Some(_) => return Hop::Garbage,
        }
    }
}

/// Reads a quoted string whose opening quote is just before `i`, unescaping
/// into `value`. Returns the index past the closing quote, or `None` if the
/// string is not terminated or holds a character quoted strings may not.
fn read_quoted(b: &[u8], mut i: usize, value: &mut ValueBuf) -> Option<usize> {
    let allowed = |c: u8| c == b'\t' || (c >= 0x20 && c != 0x7f);
    loop {
        let c = *b.get(i)?;
        i += 1;
        let c = match c {
            b'"' => return Some(i),
            b'\\' => {
                let escaped = *b.get(i)?;
                i += 1;
                escaped
            }
            _ => c,
        };
        value.push(allowed(c).then_some(c)?);
    }
}

/// Parses a `for=` node: `192.0.2.1`, `192.0.2.1:80`, and, quoted only,
/// `[2001:db8::1]` or `[2001:db8::1]:443`. Ports may be obfuscated
/// (`_abc`). `unknown`, obfuscated identifiers and unbracketed IPv6 give
/// `None`.
fn parse_node(v: &str, quoted: bool) -> Option<IpAddr> {
    let port_ok = |p: &str| is_port(p) || is_obf_port(p);
    if let Some(rest) = v.strip_prefix('[') {
        if !quoted {
            return None;
        }
        let (inner, after) = rest.split_once(']')?;
        let ip = inner.parse::<Ipv6Addr>().ok()?;
        if !after.is_empty() && !after.strip_prefix(':').is_some_and(port_ok) {
            return None;
        }
        return Some(IpAddr::V6(ip));
    }
    let (host, port) = match v.split_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (v, None),
    };
    let ip = host.parse::<Ipv4Addr>().ok()?;
    if port.is_some_and(|p| !port_ok(p)) {
        return None;
    }
    Some(IpAddr::V4(ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every hop of one `Forwarded` line, rightmost first.
    fn elements(line: &str) -> Vec<Hop> {
        let mut hops = Vec::new();
        let line = HeaderValue::from_str(line).expect("a header value");
        let _ = elements_from_right(&line, &mut |hop| {
            hops.push(hop);
            ControlFlow::Continue(())
        });
        hops
    }

    fn addr(s: &str) -> Hop {
        Hop::Addr(s.parse().expect("an address"))
    }

    #[test]
    fn forwarded_elements_are_cut_at_commas_outside_quotes_from_the_right() {
        assert_eq!(
            elements(r#"for=1.2.3.4, for="[2001:db8::1]:80";proto=https"#),
            [addr("2001:db8::1"), addr("1.2.3.4")]
        );
        // a quoted comma and an escaped quote inside a value
        assert_eq!(
            elements(r#"for=1.2.3.4;x="a,\"b", for=5.6.7.8"#),
            [addr("5.6.7.8"), addr("1.2.3.4")]
        );
        // an escaped backslash before the closing quote
        assert_eq!(
            elements(r#"for=1.2.3.4;x="a\\", for=5.6.7.8"#),
            [addr("5.6.7.8"), addr("1.2.3.4")]
        );
        // an unterminated quote spoils its own element only
        assert_eq!(
            elements(r#"for="6.6.6.6, for=5.5.5.5"#),
            [addr("5.5.5.5"), Hop::Garbage]
        );
        assert_eq!(elements(""), [Hop::Garbage]);
    }

    #[test]
    fn the_walk_stops_where_the_visitor_does() {
        let line = HeaderValue::from_static("1.1.1.1, 2.2.2.2, 3.3.3.3");
        let mut headers = HeaderMap::new();
        headers.append(X_FORWARDED_FOR, line);
        headers.append(X_FORWARDED_FOR, HeaderValue::from_static("4.4.4.4"));
        let mut seen = Vec::new();
        x_forwarded_for_from_right(&headers, |hop| {
            seen.push(hop);
            if seen.len() == 3 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        assert_eq!(seen, [addr("4.4.4.4"), addr("3.3.3.3"), addr("2.2.2.2")]);
    }
}
