//! Reading a cost out of a response body as it streams: one [`Meter`] per
//! response, made from a rule's [`MeterSpec`], is given every data chunk of
//! the body as the body is polled (the body itself goes to the client
//! unchanged and without waiting) and is asked for the cost with
//! [`Meter::finish`] when the body ends or is dropped.
//!
//! Memory is bounded: a plain JSON body is kept up to [`MAX_JSON_BODY`]
//! bytes (a function of the whole body, up to its own `max_bytes`); an event
//! stream keeps only its current line and event, up to the same bound.
//!
//! A body is read as it is sent: a compressed body (a `content-encoding`
//! other than `identity`) tells no cost, so the layer asks the upstream for
//! `Accept-Encoding: identity` and must sit inside any compression of its
//! own app.

use std::fmt;
use std::sync::Arc;

use http::header::{CONTENT_LENGTH, CONTENT_TYPE};

use crate::read::{sse, JsonPath, Value};

/// The most bytes of a plain JSON body kept to read its cost (1 MiB); a
/// longer body tells none. Also the most an event stream keeps of its
/// current event (a longer event is skipped).
pub(crate) const MAX_JSON_BODY: usize = 1024 * 1024;

/// A function of a whole body giving its cost.
type WholeCost = Arc<dyn Fn(&[u8]) -> Option<u64> + Send + Sync>;

/// How a rule reads its cost from a response body (cheap to clone; shared by
/// every response).
#[derive(Clone)]
pub(crate) enum MeterSpec {
    /// A JSON number found at a dotted path (`"usage.total_tokens"`) in the
    /// body.
    ///
    /// For a response whose `content-type` is `text/event-stream`
    /// (server-sent events, as streamed LLM completions are), the body is
    /// read as events: the cost is the number at the path in the JSON
    /// `data:` of the LAST event that carries it (events without it,
    /// `data: [DONE]`, comments and non-JSON data are skipped). Otherwise
    /// the whole body is one JSON value.
    ///
    /// The value must be a cost in the crate's one grammar (a JSON number
    /// that is a whole number from 0 to 2^53: `12`, `12.0`, `1e3`; see
    /// `key/cost.rs`); any other value (negative, fractional, string,
    /// object, ...) tells no cost. A `null` at the path (or on the way to
    /// it) counts as the field missing: in an event stream, an event with
    /// `"usage": null` does not replace the usage of an earlier one. A name
    /// given twice in one object on the way (parsers disagree about which
    /// counts) makes that JSON unreadable. An empty path names the whole
    /// JSON value.
    JsonPath(JsonPath),
    /// A function of the whole body, kept up to `max_bytes` (a body over
    /// that: no cost told).
    Whole {
        /// The most bytes of the body kept.
        max_bytes: usize,
        /// The cost of the whole body, if it tells one.
        cost: WholeCost,
    },
}

impl fmt::Debug for MeterSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MeterSpec::JsonPath(path) => f.debug_tuple("JsonPath").field(path).finish(),
            MeterSpec::Whole { max_bytes, .. } => f
                .debug_struct("Whole")
                .field("max_bytes", max_bytes)
                .finish_non_exhaustive(),
        }
    }
}

impl MeterSpec {
    /// Parses `"usage.total_tokens"` (see [`JsonPath::parse`]).
    pub(crate) fn json_path(path: &str) -> Result<Self, String> {
        JsonPath::parse(path).map(MeterSpec::JsonPath)
    }

    /// A meter for one response with head `head` (one that tells nothing
    /// when the body is compressed).
    pub(crate) fn meter(&self, head: &http::response::Parts) -> Meter {
        let state = match self {
            _ if is_encoded(head) => State::Encoded,
            MeterSpec::JsonPath(path) if is_event_stream(head) => {
                State::Events(Events::new(path.clone()))
            }
            MeterSpec::JsonPath(path) => {
                State::Buffered(Buffered::new(head, MAX_JSON_BODY, Read::Json(path.clone())))
            }
            MeterSpec::Whole { max_bytes, cost } => {
                State::Buffered(Buffered::new(head, *max_bytes, Read::Whole(cost.clone())))
            }
        };
        Meter { state }
    }
}

/// Whether the response's `content-type` is `text/event-stream` (in any
/// case, parameters such as `; charset=utf-8` allowed).
fn is_event_stream(head: &http::response::Parts) -> bool {
    head.headers.get(CONTENT_TYPE).is_some_and(|value| {
        let essence = value.as_bytes().split(|&b| b == b';').next();
        essence.is_some_and(|essence| {
            essence
                .trim_ascii()
                .eq_ignore_ascii_case(b"text/event-stream")
        })
    })
}

/// Whether the response's body is sent encoded: a `content-encoding` other
/// than `identity` (a body the meter cannot read as it is).
fn is_encoded(head: &http::response::Parts) -> bool {
    head.headers
        .get_all(http::header::CONTENT_ENCODING)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b','))
        .any(|coding| {
            let coding = coding.trim_ascii();
            !coding.is_empty() && !coding.eq_ignore_ascii_case(b"identity")
        })
}

/// One response's meter.
pub(crate) struct Meter {
    state: State,
}

impl fmt::Debug for Meter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.state {
            State::Buffered(_) => "Buffered",
            State::Events(_) => "Events",
            State::Encoded => "Encoded",
        };
        f.debug_struct("Meter")
            .field("reads", &kind)
            .finish_non_exhaustive()
    }
}

impl Meter {
    /// Counts one data chunk.
    pub(crate) fn chunk(&mut self, data: &[u8]) {
        match &mut self.state {
            State::Buffered(buffered) => buffered.chunk(data),
            State::Events(events) => events.chunk(data),
            State::Encoded => {}
        }
    }

    /// The cost the body told, if it told one (a body cut short, over its
    /// bound, not JSON, without the field, or a value that is not a
    /// non-negative integer that fits u64: None).
    ///
    /// Called when the body ended or was dropped (for an event stream, a
    /// stream dropped mid-way still tells the usage of the last complete
    /// event that carried one). A buffered body is known to be cut short when
    /// the response has a `content-length` and fewer (or more) bytes came;
    /// without one, a plain JSON body cut short is no complete JSON value,
    /// but a function of the whole body is given what came.
    pub(crate) fn finish(self) -> Option<u64> {
        match self.state {
            State::Buffered(buffered) => buffered.finish(),
            State::Events(events) => events.finish(),
            State::Encoded => None,
        }
    }
}

/// What a meter reads.
enum State {
    /// The whole body, kept up to a bound.
    Buffered(Buffered),
    /// A stream of server-sent events, read event by event.
    Events(Events),
    /// A compressed body: not read, no cost told.
    Encoded,
}

/// What is read from a buffered body.
enum Read {
    /// The number at this path of the body's JSON.
    Json(JsonPath),
    /// This function of the body.
    Whole(WholeCost),
}

/// A body buffered whole, up to a bound, to be read when it ends.
struct Buffered {
    /// The body so far; emptied (and no more kept) once over the bound.
    body: Vec<u8>,
    /// The most bytes kept.
    max: usize,
    /// Whether the body went over `max` (it tells no cost).
    over: bool,
    /// The bytes counted so far, kept or not.
    seen: u64,
    /// The response's `content-length`, if it has a readable one.
    expected: Option<u64>,
    /// What is read from the body.
    read: Read,
}

impl Buffered {
    /// A buffered body for the response with head `head`, at most `max` bytes.
    fn new(head: &http::response::Parts, max: usize, read: Read) -> Self {
        let expected = head
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok());
        let over = expected.is_some_and(|length| length > max as u64);
        let body = match expected {
            // room for the whole body, up to MAX_JSON_BODY (a function's
            // bound may be larger)
            Some(length) if !over => {
                Vec::with_capacity(usize::try_from(length).map_or(0, |n| n.min(MAX_JSON_BODY)))
            }
            _ => Vec::new(),
        };
        Buffered {
            body,
            max,
            over,
            seen: 0,
            expected,
            read,
        }
    }

    /// Keeps `data`, unless that takes the body over the bound.
    fn chunk(&mut self, data: &[u8]) {
        self.seen = self.seen.saturating_add(data.len() as u64);
        if self.over {
            return;
        }
        if data.len() > self.max - self.body.len() {
            self.over = true;
            self.body = Vec::new();
            return;
        }
        self.body.extend_from_slice(data);
    }

    /// The cost the buffered body tells.
    fn finish(self) -> Option<u64> {
        if self.over || self.expected.is_some_and(|length| length != self.seen) {
            return None;
        }
        match &self.read {
            Read::Json(path) => cost_at(&self.body, path)?,
            Read::Whole(cost) => cost(&self.body),
        }
    }
}

/// An event stream read for the number at a path of each event's JSON
/// data: the last event that carries one tells the cost.
struct Events {
    /// The events.
    stream: sse::Events,
    /// The path of the number in each event's JSON data.
    path: JsonPath,
    /// The cost told by the last event that carried the path.
    told: Option<u64>,
}

impl Events {
    /// A reader of an event stream, for the number at `path`.
    fn new(path: JsonPath) -> Self {
        Events {
            stream: sse::Events::new(MAX_JSON_BODY),
            path,
            told: None,
        }
    }

    /// Reads one chunk: each event it completes that carries the path
    /// tells the cost so far.
    fn chunk(&mut self, data: &[u8]) {
        let (path, told) = (&self.path, &mut self.told);
        self.stream.chunk(data, &mut |event| {
            if let Some(found) = cost_at(event, path) {
                *told = found;
            }
        });
    }

    /// The cost told by the last complete event that carried the path.
    fn finish(self) -> Option<u64> {
        self.told
    }
}

/// What the JSON `json` tells at `path`: `None` when it tells nothing (not
/// JSON, the path absent or `null`), else the cost (`Some(None)` for a
/// value that is no cost).
fn cost_at(json: &[u8], path: &JsonPath) -> Option<Option<u64>> {
    match crate::read::find(json, path)?? {
        Value::Null => None,
        Value::Number(number) => Some(crate::key::cost::of_json(number)),
        Value::String(_) | Value::Other => Some(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response head with this `content-type` and `content-length`.
    fn head(content_type: Option<&str>, length: Option<usize>) -> http::response::Parts {
        let mut response = http::Response::builder();
        if let Some(content_type) = content_type {
            response = response.header(CONTENT_TYPE, content_type);
        }
        if let Some(length) = length {
            response = response.header(CONTENT_LENGTH, length);
        }
        response.body(()).unwrap().into_parts().0
    }

    fn usage() -> MeterSpec {
        MeterSpec::json_path("usage.total_tokens").unwrap()
    }

    /// What `spec` reads from the body sent as `chunks`.
    fn read(spec: &MeterSpec, head: &http::response::Parts, chunks: &[&[u8]]) -> Option<u64> {
        let mut meter = spec.meter(head);
        for chunk in chunks {
            meter.chunk(chunk);
        }
        meter.finish()
    }

    /// What `spec` reads from `body`, checked to be the same whatever the
    /// chunks: split in two at every position, one byte per chunk, and
    /// with empty chunks between.
    fn split_every_way(spec: &MeterSpec, head: &http::response::Parts, body: &[u8]) -> Option<u64> {
        let whole = read(spec, head, &[body]);
        for at in 0..=body.len() {
            let (a, b) = body.split_at(at);
            assert_eq!(read(spec, head, &[a, b]), whole, "split at {at}");
            assert_eq!(read(spec, head, &[a, b"", b, b""]), whole, "split at {at}");
        }
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(read(spec, head, &bytes), whole, "one byte per chunk");
        whole
    }

    /// What `usage()` reads from the plain body `body` (with and without a
    /// `content-length`), every way split.
    fn json(body: &str) -> Option<u64> {
        let plain = split_every_way(&usage(), &head(None, None), body.as_bytes());
        let sized = split_every_way(
            &usage(),
            &head(Some("application/json"), Some(body.len())),
            body.as_bytes(),
        );
        assert_eq!(plain, sized);
        plain
    }

    /// What `usage()` reads from the event stream `body`, every way split.
    fn events(body: &str) -> Option<u64> {
        split_every_way(
            &usage(),
            &head(Some("text/event-stream"), None),
            body.as_bytes(),
        )
    }

    #[test]
    fn meters_go_with_bodies_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<MeterSpec>();
        send_sync::<Meter>();
    }

    #[test]
    fn json_path_needs_names() {
        let MeterSpec::JsonPath(path) = MeterSpec::json_path("usage.total_tokens").unwrap() else {
            panic!("not a path");
        };
        assert_eq!(
            path.names(),
            &["usage".into(), "total_tokens".into()] as &[Box<str>]
        );
        assert!(MeterSpec::json_path("tokens").is_ok());
        for bad in ["", ".", "usage.", ".usage", "usage..total"] {
            assert!(MeterSpec::json_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn json_body_with_usage_nested() {
        let body = r#"{"id":"chatcmpl-1","object":"chat.completion",
            "choices":[{"index":0,"message":{"role":"assistant","content":"Hi \"there\""},"finish_reason":"stop"}],
            "usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21}}"#;
        assert_eq!(json(body), Some(21));
        assert_eq!(json("  {\"usage\" : { \"total_tokens\" : 0 } }\n"), Some(0));
        // a name written with escapes is the same name
        assert_eq!(json(r#"{"usage":{"total\u005ftokens":4}}"#), Some(4));
    }

    #[test]
    fn json_body_without_the_field() {
        assert_eq!(json(r#"{"usage":{"prompt_tokens":9}}"#), None);
        assert_eq!(json(r#"{"total_tokens":9}"#), None);
        assert_eq!(json(r#"{"usage":5}"#), None);
        assert_eq!(json(r#"{"usage":[{"total_tokens":5}]}"#), None);
        assert_eq!(json(r#"{"usage":null}"#), None);
        assert_eq!(json(r#"[{"usage":{"total_tokens":5}}]"#), None);
        assert_eq!(json("{}"), None);
    }

    #[test]
    fn body_not_json() {
        assert_eq!(json(""), None);
        assert_eq!(json("total_tokens: 5"), None);
        assert_eq!(json(r#"{"usage":{"total_tokens":5}} trailing"#), None);
        assert_eq!(json(r#"{"usage":{"total_tokens":5}}{}"#), None);
        assert_eq!(json(r#"{"usage":{"total_tokens":5}"#), None);
        // a name given twice on the way: unreadable
        assert_eq!(
            json(r#"{"usage":{"total_tokens":5,"total_tokens":6}}"#),
            None
        );
        assert_eq!(json(r#"{"usage":{"total_tokens":5},"usage":{}}"#), None);
        // an event stream not labelled as one is not JSON
        assert_eq!(json("data: {\"usage\":{\"total_tokens\":5}}\n\n"), None);
    }

    #[test]
    fn body_cut_short() {
        let body = br#"{"usage":{"total_tokens":5}}  "#;
        let spec = usage();
        let sized = head(None, Some(body.len()));
        assert_eq!(read(&spec, &sized, &[body]), Some(5));
        // the JSON is whole, but the body is not all there
        assert_eq!(read(&spec, &sized, &[&body[..body.len() - 1]]), None);
        assert_eq!(read(&spec, &sized, &[body, b" "]), None);
        // without a length, a cut object is no JSON
        assert_eq!(read(&spec, &head(None, None), &[&body[..20]]), None);
    }

    #[test]
    fn values_that_are_no_cost() {
        assert_eq!(json(r#"{"usage":{"total_tokens":-1}}"#), None);
        assert_eq!(json(r#"{"usage":{"total_tokens":12.5}}"#), None);
        assert_eq!(json(r#"{"usage":{"total_tokens":"12"}}"#), None);
        assert_eq!(json(r#"{"usage":{"total_tokens":true}}"#), None);
        assert_eq!(json(r#"{"usage":{"total_tokens":null}}"#), None);
        assert_eq!(json(r#"{"usage":{"total_tokens":[12]}}"#), None);
        assert_eq!(json(r#"{"usage":{"total_tokens":{"n":12}}}"#), None);
        // over 2^53: no cost (the one grammar, `key/cost.rs`)
        assert_eq!(
            json(r#"{"usage":{"total_tokens":18446744073709551615}}"#),
            None
        );
        assert_eq!(json(r#"{"usage":{"total_tokens":9007199254740993}}"#), None);
        assert_eq!(
            json(r#"{"usage":{"total_tokens":18446744073709551616}}"#),
            None
        );
        assert_eq!(json(r#"{"usage":{"total_tokens":1e400}}"#), None);
    }

    #[test]
    fn integral_floats_up_to_2_pow_53() {
        assert_eq!(json(r#"{"usage":{"total_tokens":12.0}}"#), Some(12));
        assert_eq!(json(r#"{"usage":{"total_tokens":1e3}}"#), Some(1000));
        assert_eq!(json(r#"{"usage":{"total_tokens":-0.0}}"#), Some(0));
        assert_eq!(
            json(r#"{"usage":{"total_tokens":9007199254740992.0}}"#),
            Some(1 << 53)
        );
        assert_eq!(
            json(r#"{"usage":{"total_tokens":9007199254740994.0}}"#),
            None
        );
        assert_eq!(json(r#"{"usage":{"total_tokens":-3.0}}"#), None);
    }

    #[test]
    fn json_body_over_the_bound() {
        let spec = usage();
        let with_padding = |len: usize| {
            let start = r#"{"usage":{"total_tokens":7},"pad":""#;
            let mut body = start.to_owned();
            body.extend(std::iter::repeat_n('x', len - start.len() - 2));
            body.push_str("\"}");
            assert_eq!(body.len(), len);
            body.into_bytes()
        };
        let at_bound = with_padding(MAX_JSON_BODY);
        let chunks: Vec<&[u8]> = at_bound.chunks(4096).collect();
        assert_eq!(read(&spec, &head(None, None), &chunks), Some(7));
        assert_eq!(
            read(&spec, &head(None, Some(MAX_JSON_BODY)), &chunks),
            Some(7)
        );

        let over = with_padding(MAX_JSON_BODY + 1);
        let mut meter = spec.meter(&head(None, None));
        for chunk in over.chunks(4096) {
            meter.chunk(chunk);
        }
        let State::Buffered(buffered) = &meter.state else {
            panic!("not buffered");
        };
        assert!(buffered.over);
        assert_eq!(
            buffered.body.capacity(),
            0,
            "nothing kept once over the bound"
        );
        assert_eq!(meter.finish(), None);
        // said over by its length: nothing kept from the start
        let meter = spec.meter(&head(None, Some(MAX_JSON_BODY + 1)));
        let State::Buffered(buffered) = &meter.state else {
            panic!("not buffered");
        };
        assert!(buffered.over);
        assert_eq!(read(&spec, &head(None, Some(over.len())), &[&over]), None);
    }

    /// A stream as OpenAI's chat completions send it with
    /// `stream_options.include_usage`.
    const OPENAI: &str = concat!(
        ": keep-alive\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":50,\"completion_tokens\":7,\"total_tokens\":57}}\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn event_stream_like_openai() {
        assert_eq!(events(OPENAI), Some(57));
        // without `usage: null` on the others
        let plain = OPENAI.replace(",\"usage\":null", "");
        assert_eq!(events(&plain), Some(57));
        // no usage at all
        let none = OPENAI.replace("\"total_tokens\":57", "\"total\":57");
        assert_eq!(events(&none), None);
    }

    #[test]
    fn content_type_of_event_streams() {
        let spec = usage();
        let body = OPENAI.as_bytes();
        for content_type in [
            "text/event-stream",
            "Text/Event-Stream",
            "text/event-stream; charset=utf-8",
            " text/event-stream ;charset=UTF-8",
        ] {
            assert_eq!(
                read(&spec, &head(Some(content_type), None), &[body]),
                Some(57),
                "{content_type}"
            );
        }
        for content_type in ["application/json", "text/event-streams", "text/plain"] {
            assert_eq!(
                read(&spec, &head(Some(content_type), None), &[body]),
                None,
                "{content_type}"
            );
        }
        assert_eq!(read(&spec, &head(None, None), &[body]), None);
    }

    #[test]
    fn last_event_with_usage_wins() {
        let body = concat!(
            "data: {\"usage\":{\"total_tokens\":3}}\n\n",
            "data: {\"usage\":{\"total_tokens\":11}}\n\n",
            "data: {\"choices\":[]}\n\n",
            "data: {\"usage\":null}\n\n",
            "data: {\"usage\":{\"total_tokens\":null}}\n\n",
            "data: not json\n\n",
            "data: [DONE]\n\n",
        );
        assert_eq!(events(body), Some(11));
        // a later value that is no cost replaces the earlier one
        let bad = format!("{body}data: {{\"usage\":{{\"total_tokens\":-2}}}}\n\n");
        assert_eq!(events(&bad), None);
        let good = format!("{bad}data: {{\"usage\":{{\"total_tokens\":4.0}}}}\n\n");
        assert_eq!(events(&good), Some(4));
    }

    #[test]
    fn crlf_and_cr_line_ends() {
        let lf = concat!(
            ": comment\n",
            "event: message\nid: 1\n",
            "data: {\"usage\":{\"total_tokens\":5}}\n\n",
            "data: {\"usage\":\n",
            "data: {\"total_tokens\":8}}\n\n",
            "data: [DONE]\n\n",
        );
        assert_eq!(events(lf), Some(8));
        assert_eq!(events(&lf.replace('\n', "\r\n")), Some(8));
        assert_eq!(events(&lf.replace('\n', "\r")), Some(8));
        // `\r\r` and `\n\r` are two line ends: the event ends
        let mixed = "data: {\"usage\":{\"total_tokens\":6}}\r\r:x\n\rdata: {\"usage\":{\"total_tokens\":9}}\n\r";
        assert_eq!(events(mixed), Some(9));
        // `\r\n` is one line end, not an empty line
        let one = "data: {\"usage\":\r\ndata: {\"total_tokens\":2}}\r\n\r\n";
        assert_eq!(events(one), Some(2));
    }

    #[test]
    fn byte_order_mark_and_field_names() {
        let bom = "\u{feff}data: {\"usage\":{\"total_tokens\":5}}\n\n";
        assert_eq!(events(bom), Some(5));
        // only at the very start
        let later = "\n\u{feff}data: {\"usage\":{\"total_tokens\":5}}\n\n";
        assert_eq!(events(later), None);
        // fields named like `data`, but not `data`
        let names = concat!(
            "dat: {\"usage\":{\"total_tokens\":1}}\n\n",
            "datas: {\"usage\":{\"total_tokens\":2}}\n\n",
            "Data: {\"usage\":{\"total_tokens\":3}}\n\n",
            " data: {\"usage\":{\"total_tokens\":4}}\n\n",
        );
        assert_eq!(events(names), None);
    }

    #[test]
    fn stream_dropped_mid_event() {
        let complete = "data: {\"usage\":{\"total_tokens\":12}}\n\n";
        let cut = format!("{complete}data: {{\"usage\":{{\"total_tokens\":99}}}}\n");
        assert_eq!(events(&cut), Some(12));
        let cut = format!("{complete}data: {{\"usage\":{{\"total_tokens\":99}}}}");
        assert_eq!(events(&cut), Some(12));
        let cut = format!("{complete}data: {{\"usage\":{{\"total_tok");
        assert_eq!(events(&cut), Some(12));
        // a stream that ends without the empty line after its last event
        // does not dispatch it (WHATWG)
        assert_eq!(events("data: {\"usage\":{\"total_tokens\":99}}\n"), None);
        assert_eq!(events("data: {\"usage\":{\"total_tokens\":99}}\r"), None);
        assert_eq!(events(""), None);
    }

    #[test]
    fn event_over_the_bound_is_skipped_not_kept() {
        let spec = usage();
        let mut meter = spec.meter(&head(Some("text/event-stream"), None));
        meter.chunk(b"data: {\"usage\":{\"total_tokens\":3}}\n\n");
        // an event of 3 MiB, usage in it, as a stream sends it
        meter.chunk(b"data: {\"usage\":{\"total_tokens\":1000},\"pad\":\"");
        let pad = vec![b'x'; 64 * 1024];
        for _ in 0..48 {
            meter.chunk(&pad);
            let State::Events(events) = &meter.state else {
                panic!("not an event stream");
            };
            assert!(events.stream.kept() <= 2 * MAX_JSON_BODY);
        }
        meter.chunk(b"\"}\ndata: more\n\n");
        {
            let State::Events(events) = &meter.state else {
                panic!("not an event stream");
            };
            assert!(!events.stream.skipping());
            assert_eq!(events.told, Some(3), "the big event was skipped");
        }
        // over the bound with several data lines
        let line = vec![b'y'; MAX_JSON_BODY / 2];
        for _ in 0..3 {
            meter.chunk(b"data: ");
            meter.chunk(&line);
            meter.chunk(b"\r\n");
        }
        meter.chunk(b"data: {\"usage\":{\"total_tokens\":77}}\r\n\r\n");
        meter.chunk(b"data: {\"usage\":{\"total_tokens\":5}}\n\n");
        assert_eq!(meter.finish(), Some(5));

        // an event exactly at the bound is read
        let start = "data: {\"usage\":{\"total_tokens\":8},\"pad\":\"";
        let json_len = MAX_JSON_BODY;
        let pad = json_len - (start.len() - "data: ".len()) - 2;
        let mut body = start.as_bytes().to_vec();
        body.extend(std::iter::repeat_n(b'x', pad));
        body.extend_from_slice(b"\"}\n\n");
        let stream = head(Some("text/event-stream"), None);
        let chunks: Vec<&[u8]> = body.chunks(1000).collect();
        assert_eq!(read(&spec, &stream, &chunks), Some(8));
        // and one byte more is not
        body.insert(start.len(), b'x');
        let chunks: Vec<&[u8]> = body.chunks(1000).collect();
        assert_eq!(read(&spec, &stream, &chunks), None);
    }

    #[test]
    fn a_compressed_body_tells_nothing() {
        let body = br#"{"usage":{"total_tokens":5}}"#;
        let mut encoded = head(Some("application/json"), None);
        for (coding, told) in [
            ("gzip", None),
            ("br", None),
            ("identity", Some(5)),
            ("Identity", Some(5)),
            ("identity, gzip", None),
        ] {
            encoded
                .headers
                .insert(http::header::CONTENT_ENCODING, coding.parse().unwrap());
            assert_eq!(read(&usage(), &encoded, &[body]), told, "{coding}");
        }
        let mut stream = head(Some("text/event-stream"), None);
        stream
            .headers
            .insert(http::header::CONTENT_ENCODING, "gzip".parse().unwrap());
        let events = b"data: {\"usage\":{\"total_tokens\":5}}\n\n";
        assert_eq!(read(&usage(), &stream, &[events]), None);
    }

    #[test]
    fn whole_body_function() {
        let spec = MeterSpec::Whole {
            max_bytes: 16,
            cost: Arc::new(|body| Some(body.iter().filter(|&&b| b == b'a').count() as u64)),
        };
        let body = b"banana, ananas";
        assert_eq!(split_every_way(&spec, &head(None, None), body), Some(6));
        assert_eq!(
            split_every_way(&spec, &head(None, Some(body.len())), body),
            Some(6)
        );
        // whatever the content type
        let stream = head(Some("text/event-stream"), None);
        assert_eq!(split_every_way(&spec, &stream, body), Some(6));
        assert_eq!(
            read(&spec, &head(None, Some(body.len() + 1)), &[body]),
            None
        );
        assert_eq!(
            split_every_way(&spec, &head(None, None), &[b'a'; 16]),
            Some(16)
        );
        assert_eq!(split_every_way(&spec, &head(None, None), &[b'a'; 17]), None);
        assert_eq!(read(&spec, &head(None, Some(17)), &[]), None);
        let never = MeterSpec::Whole {
            max_bytes: usize::MAX,
            cost: Arc::new(|_| None),
        };
        assert_eq!(read(&never, &head(None, Some(usize::MAX)), &[b"x"]), None);
    }
}
