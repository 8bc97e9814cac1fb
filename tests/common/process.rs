//! The processes of the topology fixtures (cluster, sentinel, TLS): each
//! `redis-server` runs under an `sh` wrapper, like `TestRedis`, that stops it
//! when our end of the wrapper's stdin closes, so no server outlives the test
//! process, however it ends. A line written to that stdin names the signal
//! (`KILL` for a crash); end of file means `TERM`.

use std::collections::HashSet;
use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a fixture waits for a topology to come up (or recover) before it
/// panics: generous, for a loaded 2-core machine.
pub const TOPOLOGY_DEADLINE: Duration = Duration::from_secs(40);

/// How often fixtures poll while they wait.
pub const POLL: Duration = Duration::from_millis(25);

/// Ports handed out by this process: never twice, even after their listener
/// is closed (two fixtures starting at once must not pick the same one).
static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

fn claim(port: u16) -> bool {
    let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    handed.get_or_insert_with(HashSet::new).insert(port)
}

fn bindable(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A free port on 127.0.0.1 that this process has not handed out before.
pub fn free_port() -> u16 {
    for _ in 0..1000 {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind an ephemeral port on 127.0.0.1")
            .port();
        if claim(port) {
            return port;
        }
    }
    panic!("found no free port on 127.0.0.1 in 1000 tries");
}

/// A free port whose `port + 10000` (a cluster node's bus port) is free too.
pub fn free_cluster_port() -> u16 {
    for _ in 0..1000 {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind an ephemeral port on 127.0.0.1")
            .port();
        if port < 55536
            && bindable(port)
            && bindable(port + 10000)
            && claim(port)
            && claim(port + 10000)
        {
            return port;
        }
    }
    panic!("found no free port pair (P, P+10000) on 127.0.0.1 in 1000 tries");
}

/// Polls `probe` every [`POLL`] until it returns `Some`, for at most
/// `within`; then panics with `what` and the last state `explain` gives.
pub fn wait_for<T>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> Option<T>,
    explain: impl Fn() -> String,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = probe() {
            return value;
        }
        if Instant::now() >= deadline {
            panic!("{what}: not within {within:?}\n{}", explain());
        }
        std::thread::sleep(POLL);
    }
}

/// A blocking connection with bounded connect, read and write times, so a
/// fixture never hangs on a frozen node.
pub fn connect(url: &str) -> redis::RedisResult<redis::Connection> {
    let client = redis::Client::open(url)?;
    connect_client(&client)
}

/// As [`connect`], for a client already built (e.g. with TLS roots).
pub fn connect_client(client: &redis::Client) -> redis::RedisResult<redis::Connection> {
    let conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    Ok(conn)
}

/// `INFO <section>` as `field -> value` pairs.
pub fn info(
    conn: &mut redis::Connection,
    section: &str,
) -> redis::RedisResult<Vec<(String, String)>> {
    let text: String = redis::cmd("INFO").arg(section).query(conn)?;
    Ok(fields(&text))
}

/// `field:value` lines (as `INFO` and `CLUSTER INFO` write them) as pairs.
pub fn fields(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let (k, v) = line.trim().split_once(':')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect()
}

/// The value of `field` among `pairs`.
pub fn field<'a>(pairs: &'a [(String, String)], field: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == field)
        .map(|(_, v)| v.as_str())
}

/// The server binary the tests start: `TEST_REDIS_SERVER` when set (a path
/// to `valkey-server`, say: CI runs the standalone suites on Valkey too),
/// else `redis-server` from the `PATH`.
pub fn server_binary() -> String {
    std::env::var("TEST_REDIS_SERVER")
        .ok()
        .filter(|path| !path.is_empty() && !path.contains('\''))
        .unwrap_or_else(|| "redis-server".to_owned())
}

/// One `redis-server` (data node or sentinel) under its `sh` wrapper.
pub struct RedisProcess {
    child: Option<Child>,
    /// The file the server logs to (read into panic messages).
    pub log: PathBuf,
}

impl RedisProcess {
    /// Runs `redis-server <args>` (shell words), logging to `log`. It does
    /// not wait for the server: the fixture knows what "ready" means.
    pub fn spawn(args: &str, log: &Path) -> RedisProcess {
        let _ = fs::remove_file(log);
        let script = format!(
            "'{}' {args} --daemonize no --logfile '{}' & pid=$!; \
             read sig; kill -\"${{sig:-TERM}}\" $pid 2>/dev/null; wait $pid",
            server_binary(),
            log.display()
        );
        let child = Command::new("sh")
            .arg("-c")
            .arg(&script)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("could not run sh to start redis-server (is redis-server installed?)");
        RedisProcess {
            child: Some(child),
            log: log.to_path_buf(),
        }
    }

    /// Whether the process is still ours to stop (not killed or stopped).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Whether the server gave up binding its port (another process took
    /// it between our probe and its start).
    pub fn failed_to_bind(&self) -> bool {
        fs::read_to_string(&self.log)
            .map(|log| {
                log.contains("Address already in use") || log.contains("Failed listening on port")
            })
            .unwrap_or(false)
    }

    /// The last `lines` lines of the log, for panic messages.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }

    /// SIGKILL, as in a crash, and waits for the process to end.
    pub fn kill(&mut self) {
        self.signal("KILL");
    }

    /// SIGTERM (a clean shutdown) and waits for the process to end.
    pub fn stop(&mut self) {
        self.signal("TERM");
    }

    fn signal(&mut self, sig: &str) {
        if let Some(mut child) = self.child.take() {
            if let Some(mut stdin) = child.stdin.take() {
                let _ = writeln!(stdin, "{sig}");
            }
            let _ = child.wait();
        }
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last `lines` lines of a file (or why it could not be read).
pub fn log_tail(path: &Path, lines: usize) -> String {
    match fs::read_to_string(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            let from = all.len().saturating_sub(lines);
            format!("--- {} ---\n{}", path.display(), all[from..].join("\n"))
        }
        Err(e) => format!("--- {}: {e} ---", path.display()),
    }
}

/// Runs a short command (such as `redis-cli --cluster create`) to completion
/// within `within`, its output captured in `dir`; panics with the output if
/// it fails or overruns.
pub fn run_bounded(command: &mut Command, dir: &Path, within: Duration) -> String {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let out_path = dir.join(format!("cmd-{}.out", RUNS.fetch_add(1, Ordering::Relaxed)));
    let out = fs::File::create(&out_path).expect("create a command output file");
    let err = out.try_clone().expect("clone the output file");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("could not run {command:?}: {e}"));
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for a command") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{command:?} did not finish within {within:?}\n{}",
                log_tail(&out_path, 40)
            );
        }
        std::thread::sleep(POLL);
    };
    let output = fs::read_to_string(&out_path).unwrap_or_default();
    assert!(status.success(), "{command:?} failed ({status})\n{output}");
    output
}
