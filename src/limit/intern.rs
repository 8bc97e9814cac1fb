//! Names kept for the process's life, one copy each; a limit's name with
//! what the process records under it.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::sync::lock;

/// The one `&'static` copy of `text`, made on its first use: for strings
/// that come from configuration (limit names, a layer's `RateLimit-Policy`),
/// which a process keeps for its life so that every decision and response
/// can carry them without touching a reference count. Each distinct text is
/// kept once (a limit name is at most 64 bytes, plus the internal
/// `#keyless` variants).
pub(crate) fn intern(text: &str) -> &'static str {
    static TEXTS: Mutex<Option<std::collections::HashSet<&'static str>>> = Mutex::new(None);
    let mut texts = lock(&TEXTS);
    let texts = texts.get_or_insert_with(Default::default);
    if let Some(&known) = texts.get(text) {
        return known;
    }
    let leaked: &'static str = Box::leak(text.to_owned().into_boxed_str());
    texts.insert(leaked);
    leaked
}

/// A limit's name as the process keeps it, one per distinct name: its text
/// and, with the `metrics` feature, the metric keys of its series (one set
/// per name, as a Prometheus series is one per `limit` label), so that a
/// [`Limit`](crate::Limit) is configuration only and a decision reaches its
/// keys without a lookup.
pub(crate) struct Name {
    pub(crate) text: &'static str,
    #[cfg(feature = "metrics")]
    pub(crate) keys: crate::metrics::LimitKeys,
}

impl std::fmt::Debug for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.text, f)
    }
}

impl Name {
    /// Counts one decision of the limit named `limit` with `outcome`, for
    /// a caller that has the name and not the [`Limit`](crate::Limit) (a
    /// layer's rejection): the name's keys are looked up under a lock, so
    /// this is for answers that are not on the common path (without
    /// metrics: nothing).
    #[cfg_attr(not(feature = "metrics"), inline(always), allow(unused_variables))]
    pub(crate) fn count(limit: &str, outcome: crate::metrics::Outcome) {
        #[cfg(feature = "metrics")]
        Name::of(limit).keys.increment(outcome);
    }

    /// The one `Name` of `text`, made on its first use.
    pub(crate) fn of(text: &str) -> &'static Name {
        static NAMES: Mutex<Option<HashMap<&'static str, &'static Name>>> = Mutex::new(None);
        let mut names = lock(&NAMES);
        let names = names.get_or_insert_with(Default::default);
        if let Some(&known) = names.get(text) {
            return known;
        }
        let text = intern(text);
        let name: &'static Name = Box::leak(Box::new(Name {
            text,
            #[cfg(feature = "metrics")]
            keys: crate::metrics::LimitKeys::new(text),
        }));
        names.insert(text, name);
        name
    }
}
