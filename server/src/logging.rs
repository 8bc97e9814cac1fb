//! The log: `tracing` events on standard error, at `LOG_LEVEL`, as text or
//! (`LOG_FORMAT=json`) one JSON object a line shaped as envoyproxy/ratelimit's
//! logrus writes it: `@timestamp` (RFC 3339, nanoseconds), `level` (logrus's
//! names: `warning`, not `warn`), `@message`, then the event's fields, so
//! that log pipelines parsing its lines keep working. `RUST_LOG`, when set,
//! takes precedence over `LOG_LEVEL` (per-module filters for debugging).

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

use crate::settings::{LogFormat, LogLevel};

/// Installs the global subscriber. Calling it again (an in-process test
/// starting a second server) leaves the first in place.
pub fn init(level: LogLevel, format: LogFormat) {
    let filter = EnvFilter::try_from_env("RUST_LOG")
        .unwrap_or_else(|_| EnvFilter::default().add_directive(level.as_filter().into()));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let _ = match format {
        LogFormat::Json => builder.event_format(LogrusJson).try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// logrus's `JSONFormatter` as envoyproxy/ratelimit configures it.
struct LogrusJson;

impl<S, N> FormatEvent<S, N> for LogrusJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        writeln!(writer, "{}", logrus_line(event))
    }
}

/// One event as logrus writes it.
fn logrus_line(event: &Event<'_>) -> Value {
    let mut fields = Fields::default();
    event.record(&mut fields);
    let mut line = Map::new();
    line.insert("@timestamp".into(), Value::String(now_rfc3339()));
    line.insert(
        "level".into(),
        Value::String(logrus_level(*event.metadata().level()).into()),
    );
    line.insert("@message".into(), Value::String(fields.message));
    for (k, v) in fields.others {
        line.entry(k).or_insert(v);
    }
    Value::Object(line)
}

/// logrus's level names.
fn logrus_level(level: Level) -> &'static str {
    match level {
        Level::ERROR => "error",
        Level::WARN => "warning",
        Level::INFO => "info",
        Level::DEBUG => "debug",
        Level::TRACE => "trace",
    }
}

/// The current time as RFC 3339 with nanoseconds, in UTC (Go's
/// `time.RFC3339Nano`: trailing zeros of the fraction dropped).
fn now_rfc3339() -> String {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    crate::json::rfc3339(&prost_types::Timestamp {
        seconds: i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(since.subsec_nanos()).unwrap_or(0),
    })
}

/// An event's message and fields.
#[derive(Default)]
struct Fields {
    message: String,
    others: Vec<(String, Value)>,
}

impl Fields {
    fn put(&mut self, field: &Field, value: Value) {
        if field.name() == "message" {
            self.message = match value {
                Value::String(s) => s,
                other => other.to_string(),
            };
        } else {
            self.others.push((field.name().to_owned(), value));
        }
    }
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, Value::String(format!("{value:?}")));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::String(value.to_owned()));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, Value::Bool(value));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, Value::from(value));
    }
}
