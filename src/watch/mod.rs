//! A limits file followed while the process runs (feature `watch`):
//! [`LimitsFile`] reads a file of limits into [`LiveLimits`] and reads it
//! again whenever it changes.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use notify::Watcher;
use serde::Deserialize;

use crate::{ConfigError, Limit, LiveLimits};

mod reading;

use self::reading::{Last, Reading, Shared};

/// Why a limits file was not applied; the limits in force stay as they were.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WatchError {
    /// The file could not be read (or the watch's thread not started).
    #[error("limits file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a list of limits (the limit and the field are named).
    #[error("limits file {path}: {problem}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong, where.
        problem: String,
    },
    /// The limits cannot replace those in force (see [`LiveLimits::update`]).
    #[error("limits file {path}: {source}")]
    Limits {
        /// The file.
        path: PathBuf,
        /// Why.
        source: ConfigError,
    },
    /// The file's folder cannot be watched.
    #[error("limits file {path}: cannot watch its folder: {source}")]
    Watch {
        /// The file.
        path: PathBuf,
        /// Why.
        source: notify::Error,
    },
}

/// What a reading of the file did: the names of the limits it changed, or
/// why it was not applied.
pub type Reload = Result<Vec<&'static str>, WatchError>;

type OnReload = Box<dyn Fn(&Reload) + Send + Sync>;

/// A file of limits: a `limits` list of [limits as configuration files
/// write them](Limit), JSON when the name
/// ends in `.json`, TOML otherwise (`[[limits]]` tables); other top-level
/// keys are left alone.
///
/// [`watch`](Self::watch) applies it to a [`LiveLimits`] and reads it again
/// whenever it changes, until the returned [`FileWatch`] is dropped. The
/// file's folder is watched, not the file, and a change to the file's name
/// or to `..data` reads it again, so a file written in place, one that an
/// editor replaces by renaming another over it, and a Kubernetes ConfigMap
/// mount (`limits.toml -> ..data/limits.toml`, where a new `..data` symlink
/// is renamed over the old one) are all followed. A change is applied only
/// once the file has settled: no change seen for the
/// [`debounce`](Self::debounce), then the same text, length and
/// modification time at two readings the [`settle`](Self::settle) time
/// apart, so a file caught half-written (`limit = 5` of what will be
/// `limit = 500`) is not applied for a moment. A writer that pauses longer
/// than that mid-write can still be caught: write a new file and rename it
/// over the old one (atomic), as editors and ConfigMaps do. A text the same
/// as the last one read is left there. A file with a mistake changes
/// nothing: the limits in force stay, and the error is logged (`error`,
/// target `tower_ratelimit`), passed to [`on_reload`](Self::on_reload) and
/// kept as [`FileWatch::last_error`] until a reading is applied.
///
/// The crate does not take `SIGHUP` over (a library should not choose what
/// a process does with its signals): a server that wants it calls
/// [`FileWatch::reload`] from its own handler.
///
/// ```
/// use tower_ratelimit::watch::LimitsFile;
/// use tower_ratelimit::{Limit, LiveLimits, Quota};
///
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("limits.toml");
/// std::fs::write(&path, "[[limits]]\nname = \"per-ip\"\nalgorithm = \"gcra\"\nrate = 50\nper = \"1s\"\nburst = 50\n")?;
///
/// let limits = LiveLimits::new([Limit::new("per-ip", Quota::per_second(100).gcra())?])?;
/// let watch = LimitsFile::new(&path)
///     .on_reload(|reload| eprintln!("limits file read again: {reload:?}"))
///     .watch(&limits)?; // keep it: dropping it stops the watch
/// assert_eq!(limits.get("per-ip").expect("above").get().capacity(), 50);
///
/// std::fs::write(&path, "[[limits]]\nname = \"per-ip\"\nalgorithm = \"gcra\"\nrate = 0\nper = \"1s\"\nburst = 5\n")?;
/// assert!(watch.reload().is_err()); // a mistake: the limits stay
/// assert_eq!(limits.get("per-ip").expect("above").get().capacity(), 50);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct LimitsFile {
    path: PathBuf,
    debounce: Duration,
    settle: Duration,
    on_reload: Option<OnReload>,
}

impl std::fmt::Debug for LimitsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimitsFile")
            .field("path", &self.path)
            .field("debounce", &self.debounce)
            .field("settle", &self.settle)
            .finish_non_exhaustive()
    }
}

/// The default of [`LimitsFile::debounce`].
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(100);

/// The default of [`LimitsFile::settle`].
pub const DEFAULT_SETTLE: Duration = Duration::from_secs(1);

impl LimitsFile {
    /// The limits file at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            debounce: DEFAULT_DEBOUNCE,
            settle: DEFAULT_SETTLE,
            on_reload: None,
        }
    }

    /// How long a change waits for more before the file is read:
    /// [`DEFAULT_DEBOUNCE`] unless set (an editor's save is several events).
    pub fn debounce(mut self, wait: Duration) -> Self {
        self.debounce = wait;
        self
    }

    /// How long the file must stay the same (text, length, modification
    /// time), after the [`debounce`](Self::debounce), before a change is
    /// applied: [`DEFAULT_SETTLE`] unless set. A change meanwhile starts
    /// the wait again.
    pub fn settle(mut self, wait: Duration) -> Self {
        self.settle = wait;
        self
    }

    /// Called with what each reading after the first did (the limits it
    /// changed, or why it was not applied), on the watch's own thread.
    pub fn on_reload(mut self, report: impl Fn(&Reload) + Send + Sync + 'static) -> Self {
        self.on_reload = Some(Box::new(report));
        self
    }

    /// The limits the file holds now, to make a [`LiveLimits`] of.
    pub fn read(&self) -> Result<Vec<Limit>, WatchError> {
        let text = std::fs::read_to_string(&self.path).map_err(|source| WatchError::Read {
            path: self.path.clone(),
            source,
        })?;
        self.parse(&text)
    }

    fn parse(&self, text: &str) -> Result<Vec<Limit>, WatchError> {
        #[derive(Deserialize)]
        struct File {
            limits: Vec<Limit>,
        }
        let json = self.path.extension().is_some_and(|e| e == "json");
        let file: Result<File, String> = if json {
            serde_json::from_str(text).map_err(|e| e.to_string())
        } else {
            toml::from_str(text).map_err(|e| e.to_string())
        };
        file.map(|file| file.limits)
            .map_err(|problem| WatchError::Parse {
                path: self.path.clone(),
                problem,
            })
    }

    /// Applies the file to `limits` now (an error if it cannot be: a
    /// process should not start on a file with a mistake), then reads it
    /// again whenever it changes, on a thread of its own, until the
    /// returned [`FileWatch`] is dropped.
    pub fn watch(self, limits: &LiveLimits) -> Result<FileWatch, WatchError> {
        let folder = match self.path.parent() {
            Some(folder) if !folder.as_os_str().is_empty() => folder.to_owned(),
            _ => PathBuf::from("."),
        };
        let name = self.path.file_name().map(ToOwned::to_owned);
        let shared = Arc::new(Shared {
            file: self,
            limits: limits.clone(),
            last: Mutex::new(Last::default()),
        });
        let (changed, changes) = mpsc::sync_channel::<()>(1);
        let concerns = move |path: &PathBuf| {
            let file = path.file_name();
            file.is_some_and(|file| file == "..data") || file == name.as_deref()
        };
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            // (events lost to an overflow, or an error: read it to be sure)
            let relevant = event.map_or(true, |event| {
                event.need_rescan()
                    || (!event.kind.is_access() && event.paths.iter().any(&concerns))
            });
            if relevant {
                // a reading already pending reads this change too
                let _ = changed.try_send(());
            }
        })
        .and_then(|mut watcher| {
            watcher.watch(&folder, notify::RecursiveMode::NonRecursive)?;
            Ok(watcher)
        })
        .map_err(|source| WatchError::Watch {
            path: shared.file.path.clone(),
            source,
        })?;
        // watched before the first reading: no change falls between them
        if let Some(Err(error)) = shared.apply(Reading::of(&shared.file.path).text, true) {
            return Err(error);
        }
        let follower = shared.clone();
        std::thread::Builder::new()
            .name("limits-file".into())
            .spawn(move || follower.follow(&changes))
            .map_err(|source| WatchError::Read {
                path: shared.file.path.clone(),
                source,
            })?;
        Ok(FileWatch {
            shared,
            _watcher: watcher,
        })
    }
}

/// A limits file being followed (see [`LimitsFile::watch`]); dropping it
/// stops the watch.
pub struct FileWatch {
    shared: Arc<Shared>,
    _watcher: notify::RecommendedWatcher,
}

impl std::fmt::Debug for FileWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileWatch")
            .field("file", &self.shared.file)
            .finish_non_exhaustive()
    }
}

impl FileWatch {
    /// Reads the file now, even if it seems unchanged (for a `SIGHUP`), and
    /// applies it; the limits in force stay when it has a mistake.
    pub fn reload(&self) -> Reload {
        let read = Reading::of(&self.shared.file.path).text;
        let reload = self
            .shared
            .apply(read, true)
            .unwrap_or_else(|| Ok(Vec::new()));
        self.shared.report(&reload);
        reload
    }

    /// Why the last reading was not applied, or `None` when it was.
    pub fn last_error(&self) -> Option<String> {
        crate::sync::lock(&self.shared.last).error.clone()
    }

    /// The file followed.
    pub fn path(&self) -> &Path {
        &self.shared.file.path
    }
}

/// The limits of a file, live and watched, in one step.
impl LimitsFile {
    /// Reads the file, makes [`LiveLimits`] of its limits and
    /// [watches](Self::watch) it: every layer and limiter built with one of
    /// them follows the file. Keep the [`FileWatch`] while the limits
    /// should follow it.
    ///
    /// ```no_run
    /// use tower_ratelimit::watch::LimitsFile;
    ///
    /// let (limits, _watch) = LimitsFile::new("limits.toml").live()?;
    /// let sms = limits.get("sms").expect("the file has it");
    /// # let _ = sms;
    /// # Ok::<(), tower_ratelimit::watch::WatchError>(())
    /// ```
    pub fn live(self) -> Result<(LiveLimits, FileWatch), WatchError> {
        let limits = self.read()?;
        let limits = LiveLimits::new(limits).map_err(|source| WatchError::Limits {
            path: self.path.clone(),
            source,
        })?;
        let watch = self.watch(&limits)?;
        Ok((limits, watch))
    }
}
