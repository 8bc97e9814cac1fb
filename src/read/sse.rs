//! Server-sent events (`text/event-stream`), cut into events as the
//! stream's chunks arrive, per the WHATWG parsing rules, keeping only the
//! current line's first bytes and the current event's data, up to a bound.

/// The byte order mark an event stream may start with (ignored, per the
/// WHATWG parsing rules).
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// What a line of an event stream is known to be so far.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Line {
    /// Too short to tell: kept (at most a few bytes).
    Undecided,
    /// A `data:` field: its value added to the event's data as it comes
    /// (`data:` and the space after it left out); `fresh` until a byte of the value has come (the first
    /// one, if a space, is left out).
    Data {
        /// No byte of the value has come yet.
        fresh: bool,
    },
    /// A comment, a field the meter does not read, or a line of an event
    /// over the bound: not kept.
    Ignored,
}

/// A stream of server-sent events, read line by line as it arrives, per the
/// WHATWG parsing rules (lines end in `\n`, `\r\n` or `\r`; an empty line
/// ends an event; the `data:` lines of one event are joined with `\n`, one
/// space after the colon stripped; lines starting with `:` are comments; a
/// leading byte order mark is ignored). A last event without the empty line
/// after it when the stream ends is not dispatched, as the rules say: its
/// usage is not told, as it would not be to a browser's `EventSource`.
pub(crate) struct Events {
    /// The most bytes of one event's data kept (a longer event is skipped).
    max: usize,
    /// The first bytes of the current line while they do not tell what
    /// it is (see [`Line`]; at most the byte order mark and `data`).
    line: Vec<u8>,
    /// What the current line is.
    kind: Line,
    /// The current event's data lines, each followed by `\n` once it
    /// ended, at most `max` bytes and that `\n`.
    data: Vec<u8>,
    /// Whether the current event went over the bound (it is skipped).
    over: bool,
    /// Whether the last byte was a `\r` ending a line (a `\n` right after
    /// it, perhaps in the next chunk, ends no other line).
    after_cr: bool,
    /// Whether no line has ended yet (a byte order mark may come first).
    at_start: bool,
}

impl Events {
    /// A reader of an event stream whose events' data is kept up to `max`
    /// bytes (a longer event is skipped).
    pub(crate) fn new(max: usize) -> Self {
        Events {
            max,
            line: Vec::new(),
            kind: Line::Undecided,
            data: Vec::new(),
            over: false,
            after_cr: false,
            at_start: true,
        }
    }

    /// Reads the lines of one chunk, giving the data of each event it
    /// completes to `on_event`.
    pub(crate) fn chunk(&mut self, mut data: &[u8], on_event: &mut impl FnMut(&[u8])) {
        if self.after_cr {
            if let Some((&first, rest)) = data.split_first() {
                self.after_cr = false;
                if first == b'\n' {
                    data = rest;
                }
            }
        }
        while !data.is_empty() {
            let Some(end) = data.iter().position(|&b| b == b'\n' || b == b'\r') else {
                self.take(data);
                return;
            };
            self.take(&data[..end]);
            self.end_line(on_event);
            let cr = data[end] == b'\r';
            data = &data[end + 1..];
            if cr {
                match data.split_first() {
                    Some((b'\n', rest)) => data = rest,
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
    }

    /// The bytes the reader holds room for (its line and its event).
    #[cfg(test)]
    pub(crate) fn kept(&self) -> usize {
        self.line.capacity() + self.data.capacity()
    }

    /// Whether the current event is being skipped (over the bound).
    #[cfg(test)]
    pub(crate) fn skipping(&self) -> bool {
        self.over
    }

    /// Adds `bytes` (no line end among them) to the current line.
    fn take(&mut self, mut bytes: &[u8]) {
        // an undecided line is told by its first few bytes: kept one by one
        while self.kind == Line::Undecided {
            let Some((&first, rest)) = bytes.split_first() else {
                return;
            };
            self.line.push(first);
            bytes = rest;
            self.kind = self.classify();
            if self.kind != Line::Undecided {
                self.line.clear();
            }
        }
        let Line::Data { fresh } = self.kind else {
            return;
        };
        if fresh {
            let Some((&first, rest)) = bytes.split_first() else {
                return;
            };
            self.kind = Line::Data { fresh: false };
            if first == b' ' {
                bytes = rest;
            }
        }
        if bytes.len() > self.max - self.data.len().min(self.max) {
            self.skip_event();
        } else {
            self.data.extend_from_slice(bytes);
        }
    }

    /// Skips the current event (over the bound): nothing more of it is
    /// kept.
    fn skip_event(&mut self) {
        self.over = true;
        self.kind = Line::Ignored;
        self.line = Vec::new();
        self.data = Vec::new();
    }

    /// What the current (undecided) line is, by its first bytes; a byte
    /// order mark at the start of the stream is dropped.
    fn classify(&mut self) -> Line {
        if self.at_start {
            if self.line.len() < BOM.len() && BOM.starts_with(&self.line) {
                return Line::Undecided;
            }
            self.at_start = false;
            if self.line.starts_with(BOM) {
                self.line.drain(..BOM.len());
            }
        }
        if self.over || self.line.first() == Some(&b':') {
            Line::Ignored
        } else if self.line.starts_with(b"data:") {
            Line::Data { fresh: true }
        } else if b"data:".starts_with(&self.line) {
            Line::Undecided
        } else {
            Line::Ignored
        }
    }

    /// Ends the current line: an empty one ends the event, a data line
    /// adds to its data.
    fn end_line(&mut self, on_event: &mut impl FnMut(&[u8])) {
        let line = std::mem::take(&mut self.line);
        let kind = std::mem::replace(&mut self.kind, Line::Undecided);
        self.at_start = false;
        match kind {
            Line::Ignored => {}
            Line::Data { .. } => self.end_data_line(),
            // `data` alone is a data field with an empty value
            Line::Undecided if line == b"data" && !self.over => self.end_data_line(),
            Line::Undecided if line.is_empty() => self.dispatch(on_event),
            // a field named by a prefix of `data` (or of the byte order mark)
            Line::Undecided => {}
        }
        // the buffer (a few bytes) is reused
        self.line = line;
        self.line.clear();
    }

    /// Ends a data line of the current event (its value added to the
    /// event's data already), unless that takes the data over the bound.
    fn end_data_line(&mut self) {
        // the last `\n` is not part of the event's data
        if self.data.len() > self.max {
            self.skip_event();
        } else {
            self.data.push(b'\n');
        }
    }

    /// Ends the current event: its data (if any, and within the bound) goes
    /// to `on_event`.
    fn dispatch(&mut self, on_event: &mut impl FnMut(&[u8])) {
        let over = std::mem::replace(&mut self.over, false);
        if !over && self.data.pop().is_some() {
            on_event(&self.data);
        }
        self.data.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The data of each event `chunks` complete.
    fn events(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut stream = Events::new(64);
        let mut seen = Vec::new();
        for chunk in chunks {
            stream.chunk(chunk, &mut |data| seen.push(data.to_vec()));
        }
        seen
    }

    #[test]
    fn data_lines_joined_and_one_space_stripped() {
        let seen = events(&[
            b"data:  two spaces\ndata:none\ndata\ndata: one\nignored: x\n",
            b"\n",
        ]);
        assert_eq!(seen, [b" two spaces\nnone\n\none".to_vec()]);
        // an event without data is not dispatched; `data` alone is empty data
        assert_eq!(events(&[b": comment\n\ndata\n\n"]), [Vec::<u8>::new()]);
    }

    #[test]
    fn events_over_the_bound_are_skipped() {
        let long = [b'x'; 65];
        let seen = events(&[b"data: ", &long, b"\n\ndata: ok\n\n"]);
        assert_eq!(seen, [b"ok".to_vec()]);
        // a last event without its empty line is not dispatched
        assert!(events(&[b"data: cut"]).is_empty());
    }
}
