//! Names kept for the process's life, one copy each.

/// The one `&'static` copy of `text`, made on its first use: for strings
/// that come from configuration (limit names, a layer's `RateLimit-Policy`),
/// which a process keeps for its life so that every decision and response
/// can carry them without touching a reference count. Each distinct text is
/// kept once (a limit name is at most 64 bytes, plus the internal
/// `#keyless` variants).
pub(crate) fn intern(text: &str) -> &'static str {
    static TEXTS: std::sync::Mutex<Option<std::collections::HashSet<&'static str>>> =
        std::sync::Mutex::new(None);
    let mut texts = TEXTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let texts = texts.get_or_insert_with(Default::default);
    if let Some(&known) = texts.get(text) {
        return known;
    }
    let leaked: &'static str = Box::leak(text.to_owned().into_boxed_str());
    texts.insert(leaked);
    leaked
}
