//! The log: `tracing` events on standard error, at `LOG_LEVEL`, as text or
//! (`LOG_FORMAT=json`) one JSON object a line. `RUST_LOG`, when set, takes
//! precedence over `LOG_LEVEL` (per-module filters for debugging).

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
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
}
