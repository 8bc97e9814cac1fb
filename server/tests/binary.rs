//! The `ratelimit` binary itself, started as its users start it: from the
//! environment, on a temporary RUNTIME_ROOT, on the in-memory store and on a
//! real `redis-server` this test starts on a free port. Ports are chosen by
//! the system (`PORT=0` etc.) and read back from the binary's log lines.
//! Every wait is bounded: a server that does not answer fails the test.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower_ratelimit_server::proto::rate_limit_descriptor::Entry;
use tower_ratelimit_server::proto::rate_limit_response::Code;
use tower_ratelimit_server::proto::{
    RateLimitDescriptor, RateLimitRequest, RateLimitServiceClient,
};

/// How long anything may take before the test gives up.
const PATIENCE: Duration = Duration::from_secs(30);

const CONFIG: &str = "\
domain: rl-test
descriptors:
  - key: user
    rate_limit:
      unit: hour
      requests_per_unit: 2
";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

/// A `redis-server` on a free port, stopped on drop (under an `sh` wrapper
/// that kills it when its stdin closes, so none outlives the test).
struct TestRedis {
    port: u16,
    child: Child,
    cli: Vec<String>,
}

impl TestRedis {
    fn start() -> TestRedis {
        Self::start_with("", &[])
    }

    /// A server with extra options (shell words): `listen` is the port
    /// option (`--port P`, or `--port 0 --tls-port P`), `cli` what
    /// `redis-cli` needs to reach it.
    fn start_with(options: &str, cli: &[&str]) -> TestRedis {
        let port = free_port();
        let options = options.replace("--tls-port P", "");
        let listen = if options.contains("--tls-") {
            format!("--port 0 --tls-port {port}")
        } else {
            format!("--port {port}")
        };
        Self::run(
            &format!(
                "redis-server {listen} --bind 127.0.0.1 --save '' --appendonly no \
                 --loglevel warning {options}"
            ),
            port,
            cli,
        )
    }

    /// Runs `command` (shell words) under the wrapper and waits until
    /// `port` answers PING.
    fn run(command: &str, port: u16, cli: &[&str]) -> TestRedis {
        let script = format!("{command} & pid=$!; read _; kill $pid; wait $pid");
        let child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("sh to start redis-server");
        let redis = TestRedis {
            port,
            child,
            cli: cli.iter().map(|s| s.to_string()).collect(),
        };
        let deadline = Instant::now() + PATIENCE;
        while redis.cli(&["PING"]).as_deref() != Some("PONG") {
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on port {port} (is it installed?)"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
        redis
    }

    fn cli(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(&self.cli)
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// A RUNTIME_ROOT with `config/` holding one file.
struct Runtime {
    dir: tempfile::TempDir,
}

impl Runtime {
    fn new(yaml: &str) -> Runtime {
        let dir = tempfile::tempdir().expect("a temporary directory");
        std::fs::create_dir(dir.path().join("config")).expect("config/");
        let runtime = Runtime { dir };
        runtime.write(yaml);
        runtime
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    fn file(&self) -> PathBuf {
        self.root().join("config").join("limits.yaml")
    }

    /// Replaces the file by a rename, as editors and tools do.
    fn write(&self, yaml: &str) {
        let tmp = self.root().join("limits.yaml.tmp");
        std::fs::write(&tmp, yaml).expect("write the config");
        std::fs::rename(&tmp, self.file()).expect("rename the config");
    }
}

/// The binary, running; killed on drop.
struct Server {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
    http: String,
    grpc: String,
    debug: String,
    prometheus: Option<String>,
}

/// The base environment: every port chosen by the system, on 127.0.0.1.
fn base_env(runtime: &Runtime) -> Vec<(String, String)> {
    [
        ("HOST", "127.0.0.1"),
        ("PORT", "0"),
        ("GRPC_HOST", "127.0.0.1"),
        ("GRPC_PORT", "0"),
        ("DEBUG_HOST", "127.0.0.1"),
        ("DEBUG_PORT", "0"),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", "127.0.0.1:0"),
        ("LOG_LEVEL", "info"),
        ("RUNTIME_WATCH_ROOT", "false"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .chain([(
        "RUNTIME_ROOT".to_owned(),
        runtime.root().display().to_string(),
    )])
    .collect()
}

fn command(env: &[(String, String)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratelimit"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

/// The address in `... Listening for {what} on '{addr}'` or `... sink on {addr}/`.
fn find_addr(log: &[String], marker: &str, end: char) -> Option<String> {
    log.iter().find_map(|line| {
        let start = line.find(marker)? + marker.len();
        let rest = &line[start..];
        Some(rest[..rest.find(end)?].to_owned())
    })
}

impl Server {
    fn start(env: &[(String, String)]) -> Server {
        let mut child = command(env).spawn().expect("start the ratelimit binary");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr piped");
        {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    log.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                }
            });
        }
        let deadline = Instant::now() + PATIENCE;
        let prometheus = env
            .iter()
            .any(|(k, v)| k == "USE_PROMETHEUS" && v == "true");
        loop {
            let lines = log.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let http = find_addr(&lines, "Listening for HTTP on '", '\'');
            let grpc = find_addr(&lines, "Listening for gRPC on '", '\'');
            let debug = find_addr(&lines, "Listening for debug on '", '\'');
            let prom = find_addr(&lines, "Starting prometheus sink on ", '/');
            if let (Some(http), Some(grpc), Some(debug)) = (&http, &grpc, &debug) {
                if !prometheus || prom.is_some() {
                    return Server {
                        child,
                        log,
                        http: http.clone(),
                        grpc: grpc.clone(),
                        debug: debug.clone(),
                        prometheus: prom,
                    };
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "ratelimit exited at start ({status}):\n{}",
                    lines.join("\n")
                );
            }
            assert!(
                Instant::now() < deadline,
                "ratelimit did not listen within {PATIENCE:?}:\n{}",
                lines.join("\n")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    async fn client(&self) -> RateLimitServiceClient<tonic::transport::Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect to the gRPC port")
    }

    /// Sends SIGTERM and waits for the exit status.
    fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -TERM {pid}");
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "ratelimit did not stop on SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("ratelimit's log:\n{}", self.log().join("\n"));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP/1 request: the status and the body.
async fn http(method: &str, url: &str, body: &str) -> (u16, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<bytes::Bytes>>();
    let request = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body.to_owned())))
        .expect("a request");
    let response = tokio::time::timeout(PATIENCE, client.request(request))
        .await
        .expect("an answer in time")
        .expect("an HTTP answer");
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("the body")
        .to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Polls `f` until it is true, at most [`PATIENCE`].
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + PATIENCE;
    while !f().await {
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn request(domain: &str, key: &str, value: &str) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: key.into(),
                value: value.into(),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

/// Calls until the first OVER_LIMIT; returns how many calls were OK before
/// it. The limit's window is an hour: should it roll over between two
/// calls, the count starts again, so the sequence is tried twice, on fresh
/// keys, before the test fails.
async fn oks_before_over_limit(
    client: &mut RateLimitServiceClient<tonic::transport::Channel>,
    value: &str,
    most: u32,
) -> u32 {
    let mut seen = Vec::new();
    for attempt in 0..2 {
        let key = format!("{value}-{attempt}");
        let mut oks = 0;
        for _ in 0..=most {
            let answer = client
                .should_rate_limit(request("rl-test", "user", &key))
                .await
                .expect("ShouldRateLimit answers")
                .into_inner();
            if answer.overall_code == Code::OverLimit as i32 {
                return oks;
            }
            assert_eq!(answer.overall_code, Code::Ok as i32, "{answer:?}");
            oks += 1;
        }
        seen.push(oks);
    }
    panic!("never OVER_LIMIT within {most} calls: {seen:?}");
}

async fn grpc_health(server: &Server, service: &str) -> Option<i32> {
    let channel = tonic::transport::Endpoint::new(format!("http://{}", server.grpc))
        .ok()?
        .connect()
        .await
        .ok()?;
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    let answer = client
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await
        .ok()?;
    Some(answer.into_inner().status)
}

const SERVING: i32 = 1;

/// The checks every backend passes: health on both ports, a decision over
/// gRPC reaching OVER_LIMIT, `/json`, `/rlconfig`, the Prometheus names,
/// and a graceful stop.
async fn serves(server: Server) {
    let healthcheck = format!("http://{}/healthcheck", server.http);
    eventually("/healthcheck OK", || async {
        http("GET", &healthcheck, "").await == (200, "OK".into())
    })
    .await;
    eventually("gRPC health SERVING", || async {
        grpc_health(&server, "ratelimit").await == Some(SERVING)
    })
    .await;
    assert_eq!(grpc_health(&server, "").await, Some(SERVING));

    let mut client = server.client().await;
    assert_eq!(oks_before_over_limit(&mut client, "alice", 5).await, 2);

    // an empty domain is refused as envoyproxy/ratelimit refuses it
    let refused = client
        .should_rate_limit(RateLimitRequest::default())
        .await
        .expect_err("an empty request is refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");

    // POST /json: the JSON mapping, 200 then 429
    let json = format!("http://{}/json", server.http);
    let body =
        r#"{"domain":"rl-test","descriptors":[{"entries":[{"key":"user","value":"json"}]}]}"#;
    let (status, first) = http("POST", &json, body).await;
    assert_eq!(status, 200, "{first}");
    let first: serde_json::Value = serde_json::from_str(&first).expect("a JSON answer");
    assert_eq!(first["overallCode"], "OK");
    assert_eq!(first["statuses"][0]["currentLimit"]["requestsPerUnit"], 2);
    assert_eq!(first["statuses"][0]["currentLimit"]["unit"], "HOUR");
    assert_eq!(first["statuses"][0]["limitRemaining"], 1);
    let mut last = (0, String::new());
    for _ in 0..3 {
        last = http("POST", &json, body).await;
        if last.0 == 429 {
            break;
        }
    }
    assert_eq!(last.0, 429, "{}", last.1);
    assert!(last.1.contains("\"OVER_LIMIT\""), "{}", last.1);
    let (status, _) = http("POST", &json, "{\"domian\":1}").await;
    assert_eq!(status, 400);

    // the debug port
    let (status, dump) = http("GET", &format!("http://{}/rlconfig", server.debug), "").await;
    assert_eq!(status, 200);
    assert!(dump.contains("rl-test.user"), "{dump}");
    let (status, stats) = http("GET", &format!("http://{}/stats", server.debug), "").await;
    assert_eq!(status, 200);
    assert!(
        stats.contains("ratelimit.service.rate_limit.rl-test.user.over_limit: "),
        "{stats}"
    );

    // Prometheus, under envoyproxy/ratelimit's mapped names
    let prometheus = server.prometheus.clone().expect("USE_PROMETHEUS is on");
    let (status, metrics) = http("GET", &format!("http://{prometheus}/metrics"), "").await;
    assert_eq!(status, 200);
    for family in [
        "ratelimit_service_rate_limit_over_limit{domain=\"rl-test\",key1=\"user\"} ",
        "ratelimit_service_rate_limit_total_hits{domain=\"rl-test\",key1=\"user\"} ",
        "ratelimit_service_rate_limit_within_limit{domain=\"rl-test\",key1=\"user\"} ",
        "ratelimit_service_config_load_success ",
        "ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"} ",
        "ratelimit_service_response_time_seconds_bucket{grpc_method=\"ShouldRateLimit\",le=\"+Inf\"} ",
    ] {
        assert!(metrics.contains(family), "{family} missing from:\n{metrics}");
    }
    let over: u64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "ratelimit_service_rate_limit_over_limit{domain=\"rl-test\",key1=\"user\"} ",
            )
        })
        .and_then(|v| v.trim().parse().ok())
        .expect("an over_limit count");
    assert!(over >= 2, "{metrics}");

    let status = server.terminate();
    assert!(
        status.success(),
        "SIGTERM ends the server cleanly: {status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_on_memory() {
    let runtime = Runtime::new(CONFIG);
    serves(Server::start(&base_env(&runtime))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_on_redis() {
    let redis = TestRedis::start();
    let runtime = Runtime::new(CONFIG);
    let mut env = base_env(&runtime);
    env.push(("REDIS_SOCKET_TYPE".into(), "tcp".into()));
    env.push(("REDIS_URL".into(), format!("127.0.0.1:{}", redis.port)));
    env.push(("CACHE_KEY_PREFIX".into(), "binary-test".into()));
    serves(Server::start(&env)).await;
    // the decisions were Redis's: its keys carry the prefix
    let keys = redis
        .cli(&["--scan", "--pattern", "*binary-test*"])
        .unwrap_or_default();
    assert!(!keys.is_empty(), "no key under the prefix in Redis");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unreachable_is_unhealthy_and_unavailable() {
    let runtime = Runtime::new(CONFIG);
    let mut env = base_env(&runtime);
    // a port nothing listens on
    env.push(("REDIS_URL".into(), format!("127.0.0.1:{}", free_port())));
    env.push(("REDIS_TIMEOUT".into(), "200ms".into()));
    let server = Server::start(&env);
    let (status, _) = http("GET", &format!("http://{}/healthcheck", server.http), "").await;
    assert_eq!(status, 500);
    let mut client = server.client().await;
    let refused = client
        .should_rate_limit(request("rl-test", "user", "x"))
        .await
        .expect_err("no store, no decision");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    let prometheus = server.prometheus.clone().expect("USE_PROMETHEUS is on");
    let (_, metrics) = http("GET", &format!("http://{prometheus}/metrics"), "").await;
    assert!(
        metrics.contains("ratelimit_service_should_rate_limit_error{err_type=\"redis_error\"} 1\n"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applies_a_config_change_live() {
    let runtime = Runtime::new(CONFIG);
    let server = Server::start(&base_env(&runtime));
    let mut client = server.client().await;
    assert_eq!(oks_before_over_limit(&mut client, "before", 5).await, 2);

    runtime.write(&CONFIG.replace("requests_per_unit: 2", "requests_per_unit: 4"));
    let dump_url = format!("http://{}/rlconfig", server.debug);
    eventually("the new limit in /rlconfig", || async {
        let (_, dump) = http("GET", &dump_url, "").await;
        dump.contains("requests_per_unit=4")
    })
    .await;
    assert_eq!(oks_before_over_limit(&mut client, "after", 8).await, 4);

    // a broken file keeps the last good configuration
    runtime.write("domain: rl-test\ndescriptors:\n  - key: user\n    bogus: 1\n");
    let metrics_url = format!(
        "http://{}/metrics",
        server.prometheus.clone().unwrap_or_default()
    );
    eventually("config_load_error counted", || async {
        let (_, metrics) = http("GET", &metrics_url, "").await;
        metrics.contains("ratelimit_service_config_load_error 1")
    })
    .await;
    assert_eq!(oks_before_over_limit(&mut client, "kept", 8).await, 4);
}

#[test]
fn a_bad_variable_stops_the_start_and_is_named() {
    let runtime = Runtime::new(CONFIG);
    for (var, value) in [
        ("PORT", "eighty"),
        ("SHADOW_MODE", "maybe"),
        ("REDIS_TYPE", "ring"),
        ("LOG_LEVEL", "loud"),
    ] {
        let mut env = base_env(&runtime);
        env.push((var.into(), value.into()));
        if var == "REDIS_TYPE" {
            env.push(("REDIS_URL".into(), "127.0.0.1:1".into()));
        }
        let out = command(&env)
            .stderr(Stdio::piped())
            .output()
            .expect("run the binary");
        assert!(!out.status.success(), "{var}={value} must not start");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(var), "{var} not named in: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn a_port_in_use_is_named() {
    let runtime = Runtime::new(CONFIG);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
    let port = taken.local_addr().expect("its address").port();
    let mut env = base_env(&runtime);
    env.push(("DEBUG_PORT".into(), port.to_string()));
    let out = command(&env).output().expect("run the binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("DEBUG_PORT"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setting_without_effect_is_said_once() {
    let runtime = Runtime::new(CONFIG);
    let mut env = base_env(&runtime);
    env.push(("REDIS_PIPELINE_WINDOW".into(), "150us".into()));
    env.push(("LOG_FORMAT".into(), "json".into()));
    let server = Server::start(&env);
    // the server serves meanwhile: a decision, then the log is read
    let mut client = server.client().await;
    client
        .should_rate_limit(request("rl-test", "user", "once"))
        .await
        .expect("a decision");
    let log = server.log();
    let said: Vec<&String> = log
        .iter()
        .filter(|l| l.contains("REDIS_PIPELINE_WINDOW"))
        .collect();
    assert_eq!(said.len(), 1, "{log:#?}");
    assert!(said[0].contains("has no effect here"), "{}", said[0]);
    // LOG_FORMAT=json: every line is a JSON object shaped as logrus's
    for line in &log {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        assert!(v["@timestamp"].is_string(), "{line}");
        assert!(v["@message"].is_string(), "{line}");
        assert!(v["level"].is_string(), "{line}");
    }
    let said: serde_json::Value = serde_json::from_str(said[0]).expect("a JSON line");
    assert_eq!(said["level"], "warning");
    assert!(said["@message"]
        .as_str()
        .is_some_and(|m| m.starts_with("REDIS_PIPELINE_WINDOW has no effect here")));
}

/// A CA and a certificate for `localhost` signed by it (PEM), made by the
/// test.
fn certificates() -> (String, String, String) {
    certificates_for(&["localhost"])
}

/// A CA and a certificate for `names` signed by it (PEM).
fn certificates_for(names: &[&str]) -> (String, String, String) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    // OpenSSL (redis-server, redis-cli) wants names on both certificates
    ca.distinguished_name
        .push(DnType::CommonName, "ratelimit test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().expect("CA key");
    let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca, ca_key);
    let server_key = KeyPair::generate().expect("server key");
    let server_cert =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .expect("server parameters")
            .signed_by(&server_key, &issuer)
            .expect("server certificate");
    (ca_cert.pem(), server_cert.pem(), server_key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_grpc_over_tls() {
    let runtime = Runtime::new(CONFIG);
    let (ca, cert, key) = certificates();
    let files = tempfile::tempdir().expect("a temporary directory");
    let cert_path = files.path().join("cert.pem");
    let key_path = files.path().join("key.pem");
    std::fs::write(&cert_path, cert).expect("write the certificate");
    std::fs::write(&key_path, key).expect("write the key");
    let mut env = base_env(&runtime);
    env.push(("GRPC_SERVER_USE_TLS".into(), "true".into()));
    env.push((
        "GRPC_SERVER_TLS_CERT".into(),
        cert_path.display().to_string(),
    ));
    env.push(("GRPC_SERVER_TLS_KEY".into(), key_path.display().to_string()));
    let server = Server::start(&env);

    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
        .domain_name("localhost");
    let channel = tonic::transport::Endpoint::new(format!("https://{}", server.grpc))
        .expect("an endpoint")
        .tls_config(tls)
        .expect("a TLS configuration")
        .connect()
        .await
        .expect("a TLS connection to the gRPC port");
    let mut client = RateLimitServiceClient::new(channel);
    let answer = client
        .should_rate_limit(request("rl-test", "user", "tls"))
        .await
        .expect("a decision over TLS")
        .into_inner();
    assert_eq!(answer.overall_code, Code::Ok as i32);

    // a client without TLS gets no answer
    let plain = RateLimitServiceClient::connect(format!("http://{}", server.grpc)).await;
    if let Ok(mut plain) = plain {
        assert!(plain
            .should_rate_limit(request("rl-test", "user", "plain"))
            .await
            .is_err());
    }

    // a missing key file stops the start, naming the variable
    let mut env = base_env(&runtime);
    env.push(("GRPC_SERVER_USE_TLS".into(), "true".into()));
    env.push((
        "GRPC_SERVER_TLS_CERT".into(),
        cert_path.display().to_string(),
    ));
    env.push((
        "GRPC_SERVER_TLS_KEY".into(),
        files.path().join("none.pem").display().to_string(),
    ));
    let out = command(&env).output().expect("run the binary");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("GRPC_SERVER_TLS_KEY"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_symlink_swap_of_the_root() {
    // RUNTIME_ROOT is a symlink to a version folder, swapped atomically to
    // the next version (as a deployment or a ConfigMap does)
    let top = tempfile::tempdir().expect("a temporary directory");
    let version = |name: &str, yaml: &str| {
        let dir = top.path().join(name).join("config");
        std::fs::create_dir_all(&dir).expect("a version folder");
        std::fs::write(dir.join("limits.yaml"), yaml).expect("write the config");
    };
    version("v1", CONFIG);
    version(
        "v2",
        &CONFIG.replace("requests_per_unit: 2", "requests_per_unit: 3"),
    );
    let current = top.path().join("current");
    std::os::unix::fs::symlink(top.path().join("v1"), &current).expect("the current link");

    let runtime = Runtime::new(CONFIG);
    let mut env: Vec<(String, String)> = base_env(&runtime)
        .into_iter()
        .filter(|(k, _)| k != "RUNTIME_ROOT" && k != "RUNTIME_WATCH_ROOT")
        .collect();
    env.push(("RUNTIME_ROOT".into(), current.display().to_string()));
    let server = Server::start(&env);
    let mut client = server.client().await;
    assert_eq!(oks_before_over_limit(&mut client, "v1", 5).await, 2);

    let next = top.path().join("next");
    std::os::unix::fs::symlink(top.path().join("v2"), &next).expect("the next link");
    std::fs::rename(&next, &current).expect("swap the link");
    let dump_url = format!("http://{}/rlconfig", server.debug);
    eventually("the swapped configuration in /rlconfig", || async {
        let (_, dump) = http("GET", &dump_url, "").await;
        dump.contains("requests_per_unit=3")
    })
    .await;
    assert_eq!(oks_before_over_limit(&mut client, "v2", 6).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_once_a_config_is_loaded_when_asked() {
    let runtime = Runtime::new("");
    std::fs::remove_file(runtime.file()).expect("no config file");
    let mut env = base_env(&runtime);
    env.push((
        "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED".into(),
        "true".into(),
    ));
    let server = Server::start(&env);
    let healthcheck = format!("http://{}/healthcheck", server.http);
    assert_eq!(http("GET", &healthcheck, "").await.0, 500);
    assert_eq!(
        grpc_health(&server, "ratelimit").await,
        Some(2),
        "NOT_SERVING"
    );
    runtime.write(CONFIG);
    eventually("/healthcheck OK once a domain is loaded", || async {
        http("GET", &healthcheck, "").await.0 == 200
    })
    .await;
    assert_eq!(grpc_health(&server, "ratelimit").await, Some(SERVING));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_settings_reach_the_service() {
    let runtime = Runtime::new(CONFIG);
    let mut env = base_env(&runtime);
    env.push(("SHADOW_MODE".into(), "true".into()));
    env.push(("LIMIT_RESPONSE_HEADERS_ENABLED".into(), "true".into()));
    env.push(("LIMIT_REMAINING_HEADER".into(), "X-Left".into()));
    let server = Server::start(&env);
    let json = format!("http://{}/json", server.http);
    let body =
        r#"{"domain":"rl-test","descriptors":[{"entries":[{"key":"user","value":"shadow"}]}]}"#;
    for _ in 0..4 {
        // SHADOW_MODE: past the limit of 2, still OK
        let (status, answer) = http("POST", &json, body).await;
        assert_eq!(status, 200, "{answer}");
        let answer: serde_json::Value = serde_json::from_str(&answer).expect("JSON");
        assert_eq!(answer["overallCode"], "OK");
        let headers = answer["responseHeadersToAdd"]
            .as_array()
            .expect("response headers");
        assert!(headers.iter().any(|h| h["key"] == "X-Left"), "{headers:?}");
    }
    let prometheus = server.prometheus.clone().expect("USE_PROMETHEUS is on");
    let (_, metrics) = http("GET", &format!("http://{prometheus}/metrics"), "").await;
    assert!(
        !metrics.contains("ratelimit_service_global_shadow_mode 0\n"),
        "the global shadow mode let requests through: {metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_auth_as_envoyproxy_reads_it() {
    let redis = TestRedis::start_with(
        "--requirepass s3cret --user limiter on '>pw' '~*' '&*' '+@all'",
        &["--no-auth-warning", "-a", "s3cret"],
    );
    let runtime = Runtime::new(CONFIG);
    for (auth, works) in [
        // a password alone; one holding a colon is a user and a password
        ("s3cret", true),
        ("limiter:pw", true),
        ("wrong", false),
    ] {
        let mut env = base_env(&runtime);
        env.push(("REDIS_URL".into(), format!("127.0.0.1:{}", redis.port)));
        env.push(("REDIS_AUTH".into(), auth.into()));
        let server = Server::start(&env);
        let mut client = server.client().await;
        let answer = client
            .should_rate_limit(request("rl-test", "user", auth))
            .await;
        assert_eq!(answer.is_ok(), works, "REDIS_AUTH={auth}: {answer:?}");
        assert!(
            !server.log().join("\n").contains("pw@") && !server.log().join("\n").contains("s3cret"),
            "the password is in the log"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_tls_trusting_a_ca() {
    let files = tempfile::tempdir().expect("a temporary directory");
    let (ca, cert, key) = certificates_for(&["127.0.0.1", "localhost"]);
    let path = |name: &str| files.path().join(name).display().to_string();
    std::fs::write(path("ca.pem"), &ca).expect("write the CA");
    std::fs::write(path("cert.pem"), &cert).expect("write the certificate");
    std::fs::write(path("key.pem"), &key).expect("write the key");
    let redis = TestRedis::start_with(
        &format!(
            "--tls-port P --tls-cert-file '{}' --tls-key-file '{}' --tls-ca-cert-file '{}' \
             --tls-auth-clients no",
            path("cert.pem"),
            path("key.pem"),
            path("ca.pem")
        ),
        &["--tls", "--cacert", &path("ca.pem")],
    );
    let runtime = Runtime::new(CONFIG);
    let mut env = base_env(&runtime);
    env.push(("REDIS_URL".into(), format!("127.0.0.1:{}", redis.port)));
    env.push(("REDIS_TLS".into(), "true".into()));
    env.push(("REDIS_TLS_CACERT".into(), path("ca.pem")));
    let server = Server::start(&env);
    let mut client = server.client().await;
    assert_eq!(oks_before_over_limit(&mut client, "tls", 5).await, 2);
    assert!(!redis.cli(&["--scan"]).unwrap_or_default().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_tls_with_a_client_certificate() {
    let files = tempfile::tempdir().expect("a temporary directory");
    // one certificate the CA signed serves the server and the client
    let (ca, cert, key) = certificates_for(&["127.0.0.1", "localhost"]);
    let path = |name: &str| files.path().join(name).display().to_string();
    std::fs::write(path("ca.pem"), &ca).expect("write the CA");
    std::fs::write(path("cert.pem"), &cert).expect("write the certificate");
    std::fs::write(path("key.pem"), &key).expect("write the key");
    let redis = TestRedis::start_with(
        &format!(
            "--tls-port P --tls-cert-file '{}' --tls-key-file '{}' --tls-ca-cert-file '{}' \
             --tls-auth-clients yes",
            path("cert.pem"),
            path("key.pem"),
            path("ca.pem")
        ),
        &[
            "--tls",
            "--cacert",
            &path("ca.pem"),
            "--cert",
            &path("cert.pem"),
            "--key",
            &path("key.pem"),
        ],
    );
    let runtime = Runtime::new(CONFIG);
    let mut env = base_env(&runtime);
    env.push(("REDIS_URL".into(), format!("127.0.0.1:{}", redis.port)));
    env.push(("REDIS_TLS".into(), "true".into()));
    env.push(("REDIS_TLS_CACERT".into(), path("ca.pem")));
    {
        // without a client certificate, Redis refuses the connection
        let server = Server::start(&env);
        let mut client = server.client().await;
        let refused = client
            .should_rate_limit(request("rl-test", "user", "anonymous"))
            .await
            .expect_err("no client certificate, no store");
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    }
    env.push(("REDIS_TLS_CLIENT_CERT".into(), path("cert.pem")));
    env.push(("REDIS_TLS_CLIENT_KEY".into(), path("key.pem")));
    let server = Server::start(&env);
    let mut client = server.client().await;
    assert_eq!(oks_before_over_limit(&mut client, "mtls", 5).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_grpc_on_a_unix_socket() {
    let runtime = Runtime::new(CONFIG);
    let socket_dir = tempfile::tempdir().expect("a temporary directory");
    let socket = socket_dir.path().join("ratelimit.sock");
    let mut env = base_env(&runtime);
    env.push(("GRPC_UDS".into(), socket.display().to_string()));
    let server = Server::start(&env);
    assert_eq!(server.grpc, socket.display().to_string());
    let path = socket.clone();
    let channel = tonic::transport::Endpoint::from_static("http://ratelimit.local")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .expect("a connection over the socket");
    let mut client = RateLimitServiceClient::new(channel);
    assert_eq!(oks_before_over_limit(&mut client, "uds", 5).await, 2);

    // a file that is not a socket is left alone: the start stops instead
    let file = socket_dir.path().join("not-a-socket");
    std::fs::write(&file, "keep me").expect("write a file");
    let mut env = base_env(&runtime);
    env.push(("GRPC_UDS".into(), file.display().to_string()));
    let out = command(&env).output().expect("run the binary");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("GRPC_UDS"));
    assert_eq!(
        std::fs::read_to_string(&file).ok().as_deref(),
        Some("keep me")
    );
}

/// Polls `f` (blocking) until it is true, at most [`PATIENCE`].
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A free port whose cluster bus port (+10000) is free too.
fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_on_a_redis_cluster() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let nodes: Vec<TestRedis> = (0..3)
        .map(|_| {
            let port = free_cluster_port();
            TestRedis::run(
                &format!(
                    "redis-server --port {port} --bind 127.0.0.1 --save '' --appendonly no \
                     --loglevel warning --cluster-enabled yes --dir '{}' \
                     --cluster-config-file nodes-{port}.conf",
                    dir.path().display()
                ),
                port,
                &[],
            )
        })
        .collect();
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let created = Command::new("redis-cli")
        .arg("--cluster")
        .arg("create")
        .args(&addrs)
        .arg("--cluster-yes")
        .stdout(Stdio::null())
        .status()
        .expect("redis-cli --cluster create");
    assert!(created.success(), "the cluster was not created");
    wait_until("cluster_state:ok on every node", || {
        nodes.iter().all(|n| {
            n.cli(&["CLUSTER", "INFO"])
                .is_some_and(|info| info.contains("cluster_state:ok"))
        })
    });

    let runtime = Runtime::new(CONFIG);
    let mut env = base_env(&runtime);
    env.push(("REDIS_TYPE".into(), "cluster".into()));
    env.push(("REDIS_URL".into(), addrs.join(",")));
    let server = Server::start(&env);
    let mut client = server.client().await;
    assert_eq!(oks_before_over_limit(&mut client, "cluster", 5).await, 2);
    let keys: usize = nodes
        .iter()
        .map(|n| n.cli(&["DBSIZE"]).and_then(|v| v.parse().ok()).unwrap_or(0))
        .sum();
    assert!(keys > 0, "no key in the cluster");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_on_the_master_a_sentinel_names() {
    let master = TestRedis::start();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let conf = dir.path().join("sentinel.conf");
    std::fs::write(
        &conf,
        format!("sentinel monitor mymaster 127.0.0.1 {} 1\n", master.port),
    )
    .expect("write sentinel.conf");
    let port = free_port();
    let sentinel = TestRedis::run(
        &format!(
            "redis-server '{}' --sentinel --port {port} --bind 127.0.0.1 --loglevel warning",
            conf.display()
        ),
        port,
        &[],
    );
    wait_until("the sentinel names the master", || {
        sentinel
            .cli(&["SENTINEL", "get-master-addr-by-name", "mymaster"])
            .is_some_and(|a| a.contains(&master.port.to_string()))
    });

    let runtime = Runtime::new(CONFIG);
    let mut env = base_env(&runtime);
    env.push(("REDIS_TYPE".into(), "sentinel".into()));
    env.push(("REDIS_URL".into(), format!("mymaster,127.0.0.1:{port}")));
    let server = Server::start(&env);
    let mut client = server.client().await;
    assert_eq!(oks_before_over_limit(&mut client, "sentinel", 5).await, 2);
    let keys: usize = master
        .cli(&["DBSIZE"])
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(keys > 0, "no key on the master");
}

#[test]
fn gives_up_on_redis_after_the_startup_time() {
    let runtime = Runtime::new(CONFIG);
    let mut env = base_env(&runtime);
    env.push(("REDIS_URL".into(), format!("127.0.0.1:{}", free_port())));
    env.push(("REDIS_TIMEOUT".into(), "100ms".into()));
    env.push(("REDIS_STARTUP_INITIAL_INTERVAL".into(), "50ms".into()));
    env.push(("REDIS_STARTUP_MAX_ELAPSED_TIME".into(), "2s".into()));
    let mut server = Server::start(&env);
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        if let Ok(Some(status)) = server.child.try_wait() {
            break status;
        }
        assert!(Instant::now() < deadline, "still waiting for Redis");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "{status}");
    assert!(
        server
            .log()
            .iter()
            .any(|l| l.contains("timed out waiting for Redis")),
        "{:#?}",
        server.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_a_client_certificate() {
    use rcgen::{CertificateParams, DnType, Issuer, KeyPair};
    let runtime = Runtime::new(CONFIG);
    let (ca, cert, key) = certificates();
    // a client CA and a client certificate it signs
    let mut client_ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    client_ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    client_ca
        .distinguished_name
        .push(DnType::CommonName, "client CA");
    let client_ca_key = KeyPair::generate().expect("client CA key");
    let client_ca_cert = client_ca.self_signed(&client_ca_key).expect("client CA");
    let issuer = Issuer::new(client_ca, client_ca_key);
    let client_key = KeyPair::generate().expect("client key");
    let mut client_params =
        CertificateParams::new(vec!["envoy".to_owned()]).expect("client parameters");
    client_params
        .distinguished_name
        .push(DnType::CommonName, "envoy");
    let client_cert = client_params
        .signed_by(&client_key, &issuer)
        .expect("client certificate");

    let files = tempfile::tempdir().expect("a temporary directory");
    let path = |name: &str| files.path().join(name).display().to_string();
    std::fs::write(path("cert.pem"), cert).expect("write");
    std::fs::write(path("key.pem"), key).expect("write");
    std::fs::write(path("client-ca.pem"), client_ca_cert.pem()).expect("write");
    let mut env = base_env(&runtime);
    env.push(("GRPC_SERVER_USE_TLS".into(), "true".into()));
    env.push(("GRPC_SERVER_TLS_CERT".into(), path("cert.pem")));
    env.push(("GRPC_SERVER_TLS_KEY".into(), path("key.pem")));
    env.push(("GRPC_CLIENT_TLS_CACERT".into(), path("client-ca.pem")));
    let server = Server::start(&env);

    let call = |identity: Option<tonic::transport::Identity>| {
        let mut tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&ca))
            .domain_name("localhost");
        if let Some(identity) = identity {
            tls = tls.identity(identity);
        }
        let url = format!("https://{}", server.grpc);
        async move {
            let channel = tonic::transport::Endpoint::new(url)
                .ok()?
                .tls_config(tls)
                .ok()?
                .connect()
                .await
                .ok()?;
            RateLimitServiceClient::new(channel)
                .should_rate_limit(request("rl-test", "user", "mtls"))
                .await
                .ok()
        }
    };
    assert!(
        call(None).await.is_none(),
        "no client certificate, no answer"
    );
    let identity =
        tonic::transport::Identity::from_pem(client_cert.pem(), client_key.serialize_pem());
    assert!(
        call(Some(identity)).await.is_some(),
        "a certificate of the client CA is answered"
    );
}
