//! A limits file followed by `watch::LimitsFile`: written in place, replaced
//! by a rename as editors do, swapped as a Kubernetes ConfigMap mount is,
//! in TOML or JSON; a file with a mistake keeps the limits in force and
//! reports why. Decisions on both stores follow it.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{patient_limiter, redis_store, unique_prefix};
use tower_ratelimit::watch::{LimitsFile, Reload};
use tower_ratelimit::{Limit, LiveLimits, MemoryStore, Quota, Store};

/// A TOML limits file: `sms` at `n` per minute.
fn toml(n: u64) -> String {
    format!(
        "[[limits]]\nname = \"sms\"\nalgorithm = \"sliding-log\"\nlimit = {n}\nwindow = \"1m\"\n"
    )
}

fn limits() -> LiveLimits {
    let sms = Limit::new("sms", Quota::per_minute(100).sliding_log()).expect("valid");
    LiveLimits::new([sms]).expect("one limit")
}

fn capacity(limits: &LiveLimits) -> u64 {
    limits.get("sms").expect("sms").get().capacity()
}

/// Waits (at most 20 s) until `done` holds; whether it did.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// Waits until the `sms` limit holds `n`, failing the test after 20 s.
fn until_capacity(limits: &LiveLimits, n: u64, what: &str) {
    assert!(
        eventually(|| capacity(limits) == n),
        "{what}: the capacity stayed {}, never {n}",
        capacity(limits)
    );
}

#[test]
fn a_file_written_in_place_is_read_at_start_and_again_when_it_changes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, toml(3)).expect("write");
    let limits = limits();
    let watch = LimitsFile::new(&path).watch(&limits).expect("a good file");
    assert_eq!(capacity(&limits), 3, "applied at start");
    std::fs::write(&path, toml(7)).expect("write");
    until_capacity(&limits, 7, "written in place");
    assert_eq!(watch.last_error(), None);
}

#[test]
fn a_file_an_editor_replaces_by_a_rename_is_read_again() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, toml(3)).expect("write");
    let limits = limits();
    let _watch = LimitsFile::new(&path).watch(&limits).expect("a good file");
    // as vim and most config managers save: a new file renamed over the old
    let swap = dir.path().join(".limits.toml.swp");
    std::fs::write(&swap, toml(5)).expect("write");
    std::fs::rename(&swap, &path).expect("rename over");
    until_capacity(&limits, 5, "renamed over");
    // the folder's watch outlives the file it watched
    std::fs::write(&swap, toml(6)).expect("write");
    std::fs::rename(&swap, &path).expect("rename over");
    until_capacity(&limits, 6, "renamed over again");
}

/// A Kubernetes ConfigMap mount: `limits.toml -> ..data/limits.toml`,
/// `..data -> ..<timestamp>`; the kubelet writes a new timestamped folder,
/// points a new symlink `..data_tmp` at it and renames that over `..data`.
/// No event names `limits.toml`.
#[cfg(unix)]
#[test]
fn a_config_map_symlink_swap_is_read_again() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().expect("temp dir");
    let version = |name: &str, n: u64| {
        let folder = dir.path().join(name);
        std::fs::create_dir(&folder).expect("timestamped folder");
        std::fs::write(folder.join("limits.toml"), toml(n)).expect("write");
    };
    let first = "..2026_11_27_12_00_00.000000001";
    version(first, 2);
    symlink(first, dir.path().join("..data")).expect("..data");
    symlink("..data/limits.toml", dir.path().join("limits.toml")).expect("limits.toml");
    let limits = limits();
    let _watch = LimitsFile::new(dir.path().join("limits.toml"))
        .watch(&limits)
        .expect("a good file");
    assert_eq!(capacity(&limits), 2);

    let second = "..2026_11_27_12_05_00.000000002";
    version(second, 4);
    symlink(second, dir.path().join("..data_tmp")).expect("..data_tmp");
    std::fs::rename(dir.path().join("..data_tmp"), dir.path().join("..data")).expect("swap");
    std::fs::remove_dir_all(dir.path().join(first)).expect("remove the old folder");
    until_capacity(&limits, 4, "the ConfigMap swapped");
}

/// What one reading did, as text: the limits changed, or the error.
type Report = Result<Vec<String>, String>;

#[test]
fn a_file_with_a_mistake_keeps_the_limits_and_reports_why() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, toml(3)).expect("write");
    let limits = limits();
    let reports: Arc<Mutex<Vec<Report>>> = Arc::default();
    let seen = reports.clone();
    let watch = LimitsFile::new(&path)
        .on_reload(move |reload: &Reload| {
            let report = match reload {
                Ok(changed) => Ok(changed.iter().map(|s| s.to_string()).collect()),
                Err(e) => Err(e.to_string()),
            };
            seen.lock().expect("reports").push(report);
        })
        .watch(&limits)
        .expect("a good file");

    let bad = toml(9).replace("window = \"1m\"", "window = \"1 fortnight\"");
    std::fs::write(&path, &bad).expect("write");
    // (a reading between the truncation and the write of the file may
    // report an empty file first: wait for the report of the mistake)
    let reported = || {
        let reports = reports.lock().expect("reports");
        let mut errors = reports.iter().filter_map(|r| r.as_ref().err());
        errors.any(|e| e.contains("sms") && e.contains("`window`"))
    };
    assert!(eventually(reported), "the mistake was never reported");
    assert_eq!(capacity(&limits), 3, "the limits in force stay");
    assert!(eventually(|| watch
        .last_error()
        .is_some_and(|e| e.contains("`window`"))));
    // a limit the set does not have is refused too
    let extra = format!("{}{}", toml(3), toml(4).replace("\"sms\"", "\"mms\""));
    std::fs::write(&path, extra).expect("write");
    assert!(eventually(|| watch
        .last_error()
        .is_some_and(|e| e.contains("mms"))));
    assert_eq!(capacity(&limits), 3);

    std::fs::write(&path, toml(8)).expect("write");
    until_capacity(&limits, 8, "the mistake fixed");
    assert!(eventually(|| watch.last_error().is_none()));
    // (reported just after the limits are set)
    let fixed = Ok(vec!["sms".to_owned()]);
    assert!(eventually(|| reports
        .lock()
        .expect("reports")
        .contains(&fixed)));
    // read on demand (SIGHUP) even if unchanged
    assert_eq!(watch.reload().expect("a good file"), Vec::<&str>::new());
}

#[test]
fn a_json_file_is_read_as_json_and_a_bad_first_file_is_an_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("limits.json");
    let json = |n: u64| {
        format!(
            r#"{{"limits": [{{"name": "sms", "algorithm": "sliding-log", "limit": {n}, "window": "1m"}}]}}"#
        )
    };
    std::fs::write(&path, json(2)).expect("write");
    let limits = limits();
    let watch = LimitsFile::new(&path).watch(&limits).expect("a good file");
    assert_eq!(capacity(&limits), 2);
    std::fs::write(&path, json(6)).expect("write");
    until_capacity(&limits, 6, "JSON rewritten");
    drop(watch);

    std::fs::write(&path, "{").expect("write");
    assert!(LimitsFile::new(&path).watch(&limits).is_err());
    assert!(LimitsFile::new(dir.path().join("none.toml"))
        .watch(&limits)
        .is_err());
    assert_eq!(capacity(&limits), 6);
}

/// A limiter on `store` keyed `sms`, with the live limit of `limits`.
async fn texts_allowed(store: impl Into<Store>, limits: &LiveLimits, key: &str) -> u64 {
    let limiter = patient_limiter(store, limits.get("sms").expect("sms"));
    let mut allowed = 0;
    for _ in 0..10 {
        allowed += u64::from(limiter.check(key, 1).await.expect("decided").is_allowed());
    }
    allowed
}

#[tokio::test]
async fn decisions_on_both_stores_follow_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, toml(2)).expect("write");
    let limits = limits();
    let _watch = LimitsFile::new(&path).watch(&limits).expect("a good file");
    let redis = redis_store(&unique_prefix("watch"));
    assert_eq!(texts_allowed(MemoryStore::new(), &limits, "a").await, 2);
    assert_eq!(texts_allowed(redis.clone(), &limits, "a").await, 2);
    write_and_wait(&path, &limits, 5);
    assert_eq!(texts_allowed(MemoryStore::new(), &limits, "b").await, 5);
    assert_eq!(texts_allowed(redis, &limits, "b").await, 5);
}

fn write_and_wait(path: &Path, limits: &LiveLimits, n: u64) {
    std::fs::write(path, toml(n)).expect("write");
    until_capacity(limits, n, "rewritten");
}

/// A file being written, paused mid-way in a state that parses (`limit =
/// 5` of what will be `limit = 500`), longer than the debounce: the
/// reading waits for the file to settle, and never applies the half.
#[test]
fn a_file_half_written_is_not_applied() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("limits.toml");
    let head = "[[limits]]\nname = \"sms\"\nalgorithm = \"sliding-log\"\nwindow = \"1m\"\nlimit = ";
    std::fs::write(&path, format!("{head}100\n")).expect("write");
    let limits = limits();
    let applied: Arc<Mutex<Vec<u64>>> = Arc::default();
    let seen = (applied.clone(), limits.clone());
    let _watch = LimitsFile::new(&path)
        .on_reload(move |_: &Reload| seen.0.lock().expect("applied").push(capacity(&seen.1)))
        .watch(&limits)
        .expect("a good file");
    assert_eq!(capacity(&limits), 100);

    let mut file = std::fs::File::create(&path).expect("truncate");
    file.write_all(format!("{head}5").as_bytes())
        .expect("write");
    file.sync_data().expect("sync");
    // longer than the debounce (100 ms), shorter than the settle time (1 s)
    std::thread::sleep(Duration::from_millis(300));
    file.write_all(b"00\n").expect("write");
    drop(file);

    until_capacity(&limits, 500, "the whole file");
    let applied = applied.lock().expect("applied").clone();
    assert!(
        !applied.contains(&5),
        "the half-written file was applied: capacities {applied:?}"
    );
}

/// A file that could not be read, then is back as it was: the error is
/// cleared (the limits in force are the file's again).
#[test]
fn a_file_back_after_an_error_clears_the_last_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, toml(3)).expect("write");
    let limits = limits();
    let watch = LimitsFile::new(&path).watch(&limits).expect("a good file");
    std::fs::remove_file(&path).expect("remove");
    assert!(
        eventually(|| watch.last_error().is_some()),
        "the missing file was never reported"
    );
    std::fs::write(&path, toml(3)).expect("write");
    assert!(
        eventually(|| watch.last_error().is_none()),
        "the last error stayed after the file came back: {:?}",
        watch.last_error()
    );
    assert_eq!(capacity(&limits), 3);
}
