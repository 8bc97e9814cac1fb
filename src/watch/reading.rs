//! Reading the file and applying it: the state a watch shares with its
//! watcher's thread, and one reading of the file.

use std::path::Path;
use std::sync::{mpsc, Mutex};
use std::time::SystemTime;

use super::{LimitsFile, Reload, WatchError};
use crate::LiveLimits;

/// What a watch shares with its watcher: the file, the limits it feeds and
/// the last reading.
pub(super) struct Shared {
    pub(super) file: LimitsFile,
    pub(super) limits: LiveLimits,
    pub(super) last: Mutex<Last>,
}

/// The last reading of the file.
#[derive(Default)]
pub(super) struct Last {
    /// Its text, `None` when the file could not be read.
    pub(super) text: Option<String>,
    /// Why it was not applied, `None` when it was.
    pub(super) error: Option<String>,
}

/// The file as one reading found it.
pub(super) struct Reading {
    pub(super) text: std::io::Result<String>,
    pub(super) len: Option<u64>,
    pub(super) modified: Option<SystemTime>,
}

impl Reading {
    pub(super) fn of(path: &Path) -> Reading {
        let metadata = std::fs::metadata(path).ok();
        Reading {
            text: std::fs::read_to_string(path),
            len: metadata.as_ref().map(std::fs::Metadata::len),
            modified: metadata.and_then(|m| m.modified().ok()),
        }
    }

    /// Whether `other` found the file as this one did.
    pub(super) fn same(&self, other: &Reading) -> bool {
        let text = match (&self.text, &other.text) {
            (Ok(a), Ok(b)) => a == b,
            (Err(a), Err(b)) => a.kind() == b.kind(),
            _ => false,
        };
        text && self.len == other.len && self.modified == other.modified
    }
}

impl Shared {
    /// Applies `read`, the file's text; `None` when it is the text last
    /// read and not `always`.
    pub(super) fn apply(&self, read: std::io::Result<String>, always: bool) -> Option<Reload> {
        let mut last = crate::sync::lock(&self.last);
        let reload = match read {
            Ok(text) if !always && last.text.as_ref() == Some(&text) => return None,
            Ok(text) => {
                let applied = self.file.parse(&text).and_then(|limits| {
                    self.limits
                        .update(limits)
                        .map_err(|source| WatchError::Limits {
                            path: self.file.path.clone(),
                            source,
                        })
                });
                *last = Last {
                    text: Some(text),
                    error: applied.as_ref().err().map(ToString::to_string),
                };
                applied
            }
            Err(source) => {
                let error = WatchError::Read {
                    path: self.file.path.clone(),
                    source,
                };
                // (the file back as it was is applied again, clearing this)
                *last = Last {
                    text: None,
                    error: Some(error.to_string()),
                };
                Err(error)
            }
        };
        Some(reload)
    }

    /// Logs what a reading after the first did, and tells the callback.
    pub(super) fn report(&self, reload: &Reload) {
        let path = self.file.path.display();
        match reload {
            Ok(changed) if changed.is_empty() => {
                tracing::info!(target: "tower_ratelimit", "limits file {path}: read again, no change")
            }
            Ok(changed) => tracing::info!(
                target: "tower_ratelimit",
                "limits file {path}: in force now for {}",
                changed.join(", ")
            ),
            Err(e) => tracing::error!(
                target: "tower_ratelimit",
                "{e} (not applied, the limits stay as they were)"
            ),
        }
        if let Some(report) = &self.file.on_reload {
            report(reload);
        }
    }

    /// Reads the file after each change settles, until the watcher is gone.
    pub(super) fn follow(&self, changes: &mpsc::Receiver<()>) {
        while changes.recv().is_ok() {
            let Some(reading) = self.settled(changes) else {
                return;
            };
            if let Some(reload) = self.apply(reading.text, false) {
                self.report(&reload);
            }
        }
    }

    /// Waits until no change is seen for the debounce, then until two
    /// readings of the file the settle time apart, with no change seen
    /// between them, agree; the second. `None` when the watcher is gone.
    pub(super) fn settled(&self, changes: &mpsc::Receiver<()>) -> Option<Reading> {
        loop {
            loop {
                match changes.recv_timeout(self.file.debounce) {
                    Ok(()) => continue,
                    Err(mpsc::RecvTimeoutError::Timeout) => break,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                }
            }
            let first = Reading::of(&self.file.path);
            match changes.recv_timeout(self.file.settle) {
                // changed again: wait for it to settle
                Ok(()) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            let second = Reading::of(&self.file.path);
            if first.same(&second) {
                return Some(second);
            }
        }
    }
}
