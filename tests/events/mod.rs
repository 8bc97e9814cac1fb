//! Test support: every tracing event and span of this test binary, with the
//! thread that emitted it, so each test reads its own.
//!
//! One global subscriber, filtered per test by thread: a thread-local one
//! (`set_default`) misses callsites whose interest another test thread had
//! cached as "never". Tests that read events run their runtime on their own
//! thread (a current-thread runtime).
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;

use tracing::span::{Attributes, Id, Record};
use tracing::Level;
use tracing_subscriber::layer::{Context, SubscriberExt};

#[derive(Default)]
struct Recorded {
    /// (thread, level, target, rendered fields)
    events: Vec<(ThreadId, Level, String, String)>,
    /// (thread, name, rendered fields, those recorded later included)
    spans: Vec<(ThreadId, String, String)>,
    /// Span id (reused once a span closes) -> its index in `spans`.
    live: HashMap<u64, usize>,
}

/// The recorder; see the module docs.
#[derive(Clone, Default)]
pub struct Events(Arc<Mutex<Recorded>>);

impl Events {
    /// The global recorder, installed on first use.
    pub fn capture() -> Events {
        static EVENTS: OnceLock<Events> = OnceLock::new();
        EVENTS
            .get_or_init(|| {
                let events = Events::default();
                tracing::subscriber::set_global_default(
                    tracing_subscriber::registry().with(events.clone()),
                )
                .expect("no other global subscriber in this test binary");
                events
            })
            .clone()
    }

    /// This thread's events of target `tower_ratelimit`: level and fields.
    pub fn ours(&self) -> Vec<(Level, String)> {
        let me = std::thread::current().id();
        self.0
            .lock()
            .unwrap()
            .events
            .iter()
            .filter(|(thread, _, target, _)| *thread == me && target == "tower_ratelimit")
            .map(|(_, level, _, text)| (*level, text.clone()))
            .collect()
    }

    /// This thread's `warn` lines of target `tower_ratelimit`.
    pub fn warnings(&self) -> Vec<String> {
        self.ours()
            .into_iter()
            .filter(|(level, _)| *level == Level::WARN)
            .map(|(_, text)| text)
            .collect()
    }

    /// This thread's spans named `name`, with their fields, oldest first.
    pub fn spans(&self, name: &str) -> Vec<String> {
        let me = std::thread::current().id();
        let recorded = self.0.lock().unwrap();
        recorded
            .spans
            .iter()
            .filter(|(thread, span, _)| *thread == me && span == name)
            .map(|(_, _, text)| text.clone())
            .collect()
    }
}

struct Render<'a>(&'a mut String);

impl tracing::field::Visit for Render<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!(" {}={value:?}", field.name()));
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.push_str(&format!(" {}={value}", field.name()));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        let mut text = String::new();
        event.record(&mut Render(&mut text));
        self.0.lock().unwrap().events.push((
            std::thread::current().id(),
            *meta.level(),
            meta.target().to_owned(),
            text,
        ));
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        let mut text = String::new();
        attrs.record(&mut Render(&mut text));
        let mut recorded = self.0.lock().unwrap();
        let index = recorded.spans.len();
        recorded.spans.push((
            std::thread::current().id(),
            attrs.metadata().name().to_owned(),
            text,
        ));
        recorded.live.insert(id.into_u64(), index);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut recorded = self.0.lock().unwrap();
        if let Some(&index) = recorded.live.get(&id.into_u64()) {
            values.record(&mut Render(&mut recorded.spans[index].2));
        }
    }
}
