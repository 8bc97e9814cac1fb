//! The configuration files of `RUNTIME_ROOT`, read and followed as
//! envoyproxy/ratelimit follows them (its file provider over lyft/goruntime).
//!
//! The files are every file under
//! `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY` (`config` by
//! default), read recursively in name order, following symlinked files
//! (not symlinked folders), without the dot files when
//! `RUNTIME_IGNOREDOTFILES=true` (a Kubernetes ConfigMap's `..data` and
//! `..2024_...` entries). Like goruntime, a file's name is its path from the
//! folder it loads (`config.basic.yaml` when watching the root,
//! `basic.yaml` when watching the config folder), with `/` made `.`.
//!
//! Changes are applied live: with `RUNTIME_WATCH_ROOT=true` (the default)
//! the folder holding `RUNTIME_ROOT` is watched, so that swapping the
//! `RUNTIME_ROOT` symlink to a new version is seen, and the config folder
//! too; with `RUNTIME_WATCH_ROOT=false` the config folder itself is watched
//! (as Istio's sample sets it: a ConfigMap mounted there swaps its `..data`
//! symlink inside it). Bursts of events are gathered (a debounce) before one
//! reading. A set of files that fails to load keeps the configuration in
//! force, is logged and counts a `config_load_error`; one that loads counts
//! a `config_load_success` and replaces it. A reading identical to the last
//! one is not loaded again.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::watch;

use crate::config::{ConfigError, RateLimitConfig};

/// Where the configuration files are and how they are followed: the
/// environment variables of envoyproxy/ratelimit (`settings.go`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeSettings {
    /// `RUNTIME_ROOT` (default `/srv/runtime_data/current`).
    pub root: PathBuf,
    /// `RUNTIME_SUBDIRECTORY` (default empty).
    pub subdirectory: String,
    /// `RUNTIME_APPDIRECTORY` (default `config`).
    pub app_directory: String,
    /// `RUNTIME_IGNOREDOTFILES` (default false).
    pub ignore_dot_files: bool,
    /// `RUNTIME_WATCH_ROOT` (default true).
    pub watch_root: bool,
    /// `MERGE_DOMAIN_CONFIG` (default false): a domain in several files is
    /// merged rather than refused.
    pub merge_domains: bool,
    /// How long the files must be quiet after a change before they are
    /// read (default 100 ms); a stream of changes is read at least every
    /// 20 debounces.
    pub debounce: Duration,
}

impl Default for RuntimeSettings {
    fn default() -> Self {
        RuntimeSettings {
            root: PathBuf::from("/srv/runtime_data/current"),
            subdirectory: String::new(),
            app_directory: "config".to_string(),
            ignore_dot_files: false,
            watch_root: true,
            merge_domains: false,
            debounce: Duration::from_millis(100),
        }
    }
}

impl RuntimeSettings {
    /// The settings of the process environment.
    pub fn from_env() -> Result<Self, RuntimeError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The settings of `var` (a variable's value by name, `None` when unset;
    /// an empty value is the default, as Go's envconfig takes it).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, RuntimeError> {
        let mut s = RuntimeSettings::default();
        let get = |name: &str| var(name).filter(|v| !v.is_empty());
        if let Some(root) = get("RUNTIME_ROOT") {
            s.root = PathBuf::from(root);
        }
        if let Some(sub) = get("RUNTIME_SUBDIRECTORY") {
            s.subdirectory = sub;
        }
        if let Some(app) = get("RUNTIME_APPDIRECTORY") {
            s.app_directory = app;
        }
        let flag = |name: &str, default: bool| match get(name) {
            None => Ok(default),
            Some(v) => parse_bool(&v).ok_or_else(|| {
                RuntimeError::Settings(format!(
                    "{name}={v:?} is not a boolean (true, false, 1, 0, t, f)"
                ))
            }),
        };
        s.ignore_dot_files = flag("RUNTIME_IGNOREDOTFILES", false)?;
        s.watch_root = flag("RUNTIME_WATCH_ROOT", true)?;
        s.merge_domains = flag("MERGE_DOMAIN_CONFIG", false)?;
        Ok(s)
    }

    /// The folder the files are read from.
    pub fn config_dir(&self) -> PathBuf {
        self.root.join(&self.subdirectory).join(&self.app_directory)
    }

    /// The folder the files are named from (see the module).
    fn names_from(&self) -> PathBuf {
        if self.watch_root {
            self.root.join(&self.subdirectory)
        } else {
            self.config_dir()
        }
    }
}

/// Go's `strconv.ParseBool`.
fn parse_bool(text: &str) -> Option<bool> {
    match text {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// Why the runtime could not start.
#[derive(Debug)]
#[non_exhaustive]
pub enum RuntimeError {
    /// A setting is invalid.
    Settings(String),
    /// A folder could not be watched.
    Watch {
        /// The folder.
        path: PathBuf,
        /// Why.
        source: notify::Error,
    },
    /// The watching thread could not be started.
    Thread(std::io::Error),
}

impl std::fmt::Display for RuntimeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RuntimeError::Settings(m) => write!(f, "runtime settings: {m}"),
            RuntimeError::Watch { path, source } => {
                write!(f, "cannot watch {}: {source}", path.display())
            }
            RuntimeError::Thread(e) => write!(f, "cannot start the runtime watch: {e}"),
        }
    }
}

impl std::error::Error for RuntimeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RuntimeError::Settings(_) => None,
            RuntimeError::Watch { source, .. } => Some(source),
            RuntimeError::Thread(e) => Some(e),
        }
    }
}

/// The counts of configuration loads, for the service's metrics
/// (envoyproxy's `config_load_success` and `config_load_error`).
#[derive(Debug, Default)]
pub struct LoadStats {
    success: AtomicU64,
    error: AtomicU64,
    last_error: Mutex<Option<ConfigError>>,
}

impl LoadStats {
    /// Loads that replaced the configuration (the first one included).
    pub fn successes(&self) -> u64 {
        self.success.load(Ordering::Relaxed)
    }

    /// Loads that failed (the configuration in force was kept).
    pub fn errors(&self) -> u64 {
        self.error.load(Ordering::Relaxed)
    }

    /// Whether a configuration was ever loaded (else the one in force is
    /// the empty one the runtime started with).
    pub fn loaded(&self) -> bool {
        self.successes() > 0
    }

    /// The error of the last load that failed, if the last load failed.
    pub fn last_error(&self) -> Option<ConfigError> {
        self.last_error.lock().ok().and_then(|e| e.clone())
    }
}

/// What a load did, for a callback (see [`Runtime::start_with`]).
pub type LoadOutcome = Result<Arc<RateLimitConfig>, ConfigError>;

type OnLoad = Box<dyn Fn(&LoadOutcome) + Send + Sync>;

/// Reads the configuration files now: `(name, contents)` pairs in name
/// order, ready for [`RateLimitConfig::from_files`]. A missing folder is no
/// file (goruntime's walk finds none); a file that cannot be read is left
/// out with a warning, as goruntime leaves it out; a file that is not
/// UTF-8 is an error naming it (as YAML refuses it).
pub fn read_files(settings: &RuntimeSettings) -> Reading {
    let mut files = Vec::new();
    let dir = settings.config_dir();
    walk(settings, &settings.names_from(), &dir, 0, &mut files);
    files
        .into_iter()
        .map(|(name, bytes)| match String::from_utf8(bytes) {
            Ok(text) => Ok((name, text)),
            Err(e) => Err(ConfigError {
                file: name,
                message: format!(
                    "error loading config file: yaml: invalid UTF-8 at byte {}",
                    e.utf8_error().valid_up_to()
                ),
            }),
        })
        .collect()
}

fn walk(
    settings: &RuntimeSettings,
    base: &Path,
    dir: &Path,
    depth: usize,
    out: &mut Vec<(String, Vec<u8>)>,
) {
    // Deeper than this is a loop or a mistake; goruntime has no bound, but
    // real folders of configuration are one or two levels deep.
    if depth > 16 {
        tracing::warn!(path = %dir.display(), "runtime: folders nested too deep, not read");
        return;
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            if depth > 0 || e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %dir.display(), error = %e, "runtime: cannot read folder");
            }
            return;
        }
    };
    let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = entry.file_name();
        if settings.ignore_dot_files && name.to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            walk(settings, base, &path, depth + 1, out);
            continue;
        }
        // A file, or a symlink: read through it (a symlink to a folder
        // fails to read and is left out, as goruntime leaves it).
        match std::fs::read(&path) {
            Ok(bytes) => {
                let rel = path.strip_prefix(base).unwrap_or(&path);
                let key = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join(".");
                out.push((key, bytes));
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "runtime: cannot read file");
            }
        }
    }
}

/// A reading of the files: `(name, contents)` pairs, or why not.
pub type Reading = Result<Vec<(String, String)>, ConfigError>;

struct Inner {
    settings: RuntimeSettings,
    stats: Arc<LoadStats>,
    sender: watch::Sender<Arc<RateLimitConfig>>,
    /// The last reading of the files (loaded or not).
    last: Mutex<Option<Reading>>,
    on_load: OnLoad,
}

impl Inner {
    /// Reads and loads the files; `force`: even when unchanged.
    fn reload(&self, force: bool) -> Option<LoadOutcome> {
        let files = read_files(&self.settings);
        {
            let Ok(mut last) = self.last.lock() else {
                return None;
            };
            if !force && last.as_ref() == Some(&files) {
                return None;
            }
            *last = Some(files.clone());
        }
        let outcome = files.and_then(|files| {
            RateLimitConfig::from_files(&files, self.settings.merge_domains)
                .map(|config| (files.len(), Arc::new(config)))
        });
        let outcome = outcome.map(|(count, config)| {
            tracing::info!(
                files = count,
                rules = config.rules().len(),
                "runtime: configuration loaded"
            );
            config
        });
        match &outcome {
            Ok(config) => {
                self.stats.success.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut e) = self.stats.last_error.lock() {
                    *e = None;
                }
                self.sender.send_replace(Arc::clone(config));
            }
            Err(error) => {
                self.stats.error.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut e) = self.stats.last_error.lock() {
                    *e = Some(error.clone());
                }
                tracing::error!(
                    %error,
                    "runtime: error loading new configuration; the one in force is kept"
                );
            }
        }
        (self.on_load)(&outcome);
        Some(outcome)
    }
}

/// The configuration files followed while the process runs.
pub struct Runtime;

impl Runtime {
    /// Reads the files, then follows them: the receiver always holds the
    /// configuration in force. When the first reading fails to load, it
    /// holds an empty configuration (no domain) until a reading loads, and
    /// [`LoadStats::loaded`] says so.
    pub fn start(
        settings: RuntimeSettings,
    ) -> Result<(watch::Receiver<Arc<RateLimitConfig>>, RuntimeHandle), RuntimeError> {
        Self::start_with(settings, |_| {})
    }

    /// As [`start`](Self::start), calling `on_load` after each load
    /// (success or error): the first from this call, the others from the
    /// watching thread (or from [`RuntimeHandle::reload`]'s caller).
    pub fn start_with(
        settings: RuntimeSettings,
        on_load: impl Fn(&LoadOutcome) + Send + Sync + 'static,
    ) -> Result<(watch::Receiver<Arc<RateLimitConfig>>, RuntimeHandle), RuntimeError> {
        let (sender, receiver) = watch::channel(Arc::new(RateLimitConfig::default()));
        let inner = Arc::new(Inner {
            settings,
            stats: Arc::new(LoadStats::default()),
            sender,
            last: Mutex::new(None),
            on_load: Box::new(on_load),
        });
        let (tx, rx) = mpsc::channel::<Msg>();
        let events = tx.clone();
        let watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
                Ok(event) if relevant(&event.kind) => {
                    let _ = events.send(Msg::Changed);
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "runtime: watch error"),
            })
            .map_err(|source| RuntimeError::Watch {
                path: inner.settings.config_dir(),
                source,
            })?;
        let mut watch = Watch {
            watcher,
            config_dir: None,
        };
        watch.arm_fixed(&inner.settings)?;
        watch.arm_config_dir(&inner.settings);
        inner.reload(true);

        let thread_inner = Arc::clone(&inner);
        let thread = std::thread::Builder::new()
            .name("ratelimit-runtime".to_string())
            .spawn(move || follow(&thread_inner, watch, &rx))
            .map_err(RuntimeError::Thread)?;
        Ok((
            receiver,
            RuntimeHandle {
                inner,
                stop: tx,
                thread: Some(thread),
            },
        ))
    }
}

enum Msg {
    Changed,
    Stop,
}

/// Whether an event may change what the files say (opening and reading
/// them, ours included, does not).
fn relevant(kind: &EventKind) -> bool {
    match kind {
        EventKind::Access(notify::event::AccessKind::Close(notify::event::AccessMode::Write)) => {
            true
        }
        EventKind::Access(_) => false,
        _ => true,
    }
}

/// The watches: the fixed one(s), and the config folder's, armed again
/// after each change (a symlink swap may have made it another folder).
struct Watch {
    watcher: notify::RecommendedWatcher,
    config_dir: Option<PathBuf>,
}

impl Watch {
    fn arm_fixed(&mut self, settings: &RuntimeSettings) -> Result<(), RuntimeError> {
        let path = if settings.watch_root {
            // The folder the root symlink is in (goruntime's SymlinkRefresher).
            match settings.root.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            }
        } else {
            // goruntime's DirectoryRefresher: the config folder must exist.
            settings.config_dir()
        };
        self.watcher
            .watch(&path, RecursiveMode::NonRecursive)
            .map_err(|source| RuntimeError::Watch { path, source })?;
        // Beyond goruntime: the folder holding the config folder, so that a
        // config folder removed and made again is seen (best effort).
        let config_dir = settings.config_dir();
        if let Some(parent) = config_dir.parent().filter(|p| p.is_dir()) {
            if let Err(e) = self.watcher.watch(parent, RecursiveMode::NonRecursive) {
                tracing::debug!(path = %parent.display(), error = %e, "runtime: cannot watch");
            }
        }
        Ok(())
    }

    fn arm_config_dir(&mut self, settings: &RuntimeSettings) {
        let dir = settings.config_dir();
        if let Some(old) = self.config_dir.take() {
            let _ = self.watcher.unwatch(&old);
        }
        if !settings.watch_root {
            // Watched by `arm_fixed` already; arm it again (recursively)
            // in case it was replaced.
            let _ = self.watcher.unwatch(&dir);
        }
        if dir.is_dir() {
            match self.watcher.watch(&dir, RecursiveMode::Recursive) {
                Ok(()) => self.config_dir = Some(dir),
                Err(e) => {
                    tracing::warn!(path = %dir.display(), error = %e, "runtime: cannot watch")
                }
            }
        } else if !settings.watch_root {
            tracing::warn!(path = %dir.display(), "runtime: the config folder is gone");
        }
    }
}

/// The watching thread: waits for a change, lets the burst settle, reads.
fn follow(inner: &Inner, mut watch: Watch, rx: &mpsc::Receiver<Msg>) {
    let debounce = inner.settings.debounce;
    loop {
        match rx.recv() {
            Ok(Msg::Changed) => {}
            Ok(Msg::Stop) | Err(_) => return,
        }
        let started = Instant::now();
        loop {
            match rx.recv_timeout(debounce) {
                Ok(Msg::Changed) if started.elapsed() < debounce * 20 => continue,
                Ok(Msg::Changed) | Err(mpsc::RecvTimeoutError::Timeout) => break,
                Ok(Msg::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
        watch.arm_config_dir(&inner.settings);
        inner.reload(false);
    }
}

/// Keeps the files followed; dropping it stops following them (the
/// receivers keep the last configuration).
pub struct RuntimeHandle {
    inner: Arc<Inner>,
    stop: mpsc::Sender<Msg>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for RuntimeHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeHandle")
            .field("settings", &self.inner.settings)
            .field("stats", &self.inner.stats)
            .finish()
    }
}

impl RuntimeHandle {
    /// The load counts.
    pub fn stats(&self) -> &Arc<LoadStats> {
        &self.inner.stats
    }

    /// The settings followed.
    pub fn settings(&self) -> &RuntimeSettings {
        &self.inner.settings
    }

    /// Reads and loads the files now, even if unchanged; on success the
    /// receivers see the new configuration.
    pub fn reload(&self) -> LoadOutcome {
        match self.inner.reload(true) {
            Some(outcome) => outcome,
            // Only a poisoned lock (a panic elsewhere) gets here.
            None => Err(ConfigError {
                file: String::new(),
                message: "the runtime is stopped".to_string(),
            }),
        }
    }

    /// A new receiver of the configuration in force.
    pub fn subscribe(&self) -> watch::Receiver<Arc<RateLimitConfig>> {
        self.inner.sender.subscribe()
    }
}

impl Drop for RuntimeHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(Msg::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
