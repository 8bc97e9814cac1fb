//! The example server as a user runs it: the compiled `examples/server`
//! binary, alone in memory, and as two processes sharing one Redis.

mod common;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::TestRedis;

/// `target/<profile>/examples/server`, which `cargo test` builds with the tests.
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target profile directory");
    let path = dir
        .join("examples")
        .join(format!("server{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test`, which builds the examples",
        path.display()
    );
    path
}

/// The `INTERNAL_TOKEN` of the servers started here (unless a test sets its
/// own): `/metrics` is served only to a request that carries it.
const TOKEN: &str = "metrics-s3cret";

/// `GET /metrics` with the internal token: the status code and the body.
fn scrape(port: u16) -> (u16, String) {
    let authorization = format!("Authorization: Bearer {TOKEN}");
    let (code, response) = send_with(port, "GET", "/metrics", &[&authorization], "");
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    (code, body.to_owned())
}

struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(redis_url: Option<&str>) -> Server {
        Server::start_with(redis_url, None)
    }

    fn start_with(redis_url: Option<&str>, on_store_error: Option<&str>) -> Server {
        let mut env = vec![];
        if let Some(url) = redis_url {
            env.push(("REDIS_URL", url));
        }
        if let Some(policy) = on_store_error {
            env.push(("ON_STORE_ERROR", policy));
        }
        Server::start_env(&env)
    }

    /// The example binary with `PORT` set and the rest of its environment
    /// (`REDIS_URL`, `ON_STORE_ERROR`, `LIMITS_FILE`, ...) taken from `env` only.
    fn command(port: u16, env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(example_binary());
        cmd.env("PORT", port.to_string())
            .env("RUST_LOG", "warn")
            .env_remove("REDIS_URL")
            .env_remove("REDIS_CLUSTER_URLS")
            .env_remove("REDIS_SENTINEL_URLS")
            .env_remove("REDIS_SENTINEL_MASTER")
            .env_remove("REDIS_CA_FILE")
            .env_remove("ON_STORE_ERROR")
            .env_remove("LIMITS_FILE")
            .env("INTERNAL_TOKEN", TOKEN)
            .env_remove("API_KEYS")
            .env_remove("TRUSTED_PROXIES")
            .envs(env.iter().copied())
            .stdout(Stdio::null());
        cmd
    }

    fn start_env(env: &[(&str, &str)]) -> Server {
        let port = TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let child = Server::command(port, env)
            .spawn()
            .expect("start the example server");
        let server = Server { child, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the example server did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the example server as `command` says, expecting it to stop at once
/// (a setting it refuses): its exit status and standard error. A server
/// that is still running after 20 s (it took the setting) is killed, and
/// the test fails.
fn refused(mut command: Command) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    let mut child = command
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the example server");
    let mut pipe = child.stderr.take().expect("piped stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(exit) = child.try_wait().expect("wait for the example server") {
            break exit;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the example server took the setting and kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (exit, reader.join().expect("stderr reader"))
}

/// Sends one HTTP/1.1 request and returns the status code.
fn status(port: u16, method: &str, path: &str) -> u16 {
    send(port, method, path).0
}

/// Sends one HTTP/1.1 request and returns the status code and the body.
fn send(port: u16, method: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    write!(stream, "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {response:?}"));
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    (status, body.to_owned())
}

/// One request per server that reaches the store, so that connection setup
/// (a TLS handshake, a cluster's slot map) is not paid inside `exercise`,
/// whose GCRA figures assume its requests arrive within 100 ms.
#[cfg(any(feature = "cluster", feature = "sentinel", feature = "tls"))]
fn warm(ports: &[u16]) {
    for (i, port) in ports.iter().enumerate() {
        let phone = format!("/sms/+1555010{i}9");
        let deadline = Instant::now() + Duration::from_secs(10);
        // 503 while the first connection is made (the store connects in
        // the background; the request's 100 ms may run out first)
        while status(*port, "POST", &phone) != 202 {
            assert!(Instant::now() < deadline, "server {port} never decided");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Sends one HTTP/1.1 request with extra header lines and a body; returns
/// the status code and the whole response text.
fn send_with(port: u16, method: &str, path: &str, headers: &[&str], body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\n");
    for line in headers {
        head.push_str(line);
        head.push_str("\r\n");
    }
    write!(
        stream,
        "{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {response:?}"));
    (status, response)
}

fn login(port: u16, username: &str, password: &str) -> (u16, String) {
    let body = format!(r#"{{"username": "{username}", "password": "{password}"}}"#);
    send_with(
        port,
        "POST",
        "/login",
        &["Content-Type: application/json"],
        &body,
    )
}

/// Failed logins only count: successes never do, 50 concurrent wrong
/// guesses try exactly 5, then every attempt waits for the window.
fn exercise_login(ports: &[u16], user: &str) {
    for i in 0..6 {
        assert_eq!(login(ports[i % ports.len()], user, "correct horse").0, 200);
    }
    let guesses: Vec<_> = (0..50)
        .map(|i| {
            let (port, user) = (ports[i % ports.len()], user.to_owned());
            std::thread::spawn(move || login(port, &user, &format!("guess {i}")).0)
        })
        .collect();
    let statuses: Vec<u16> = guesses
        .into_iter()
        .map(|g| g.join().expect("thread"))
        .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 401).count(),
        5,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        45,
        "{statuses:?}"
    );
    let (code, response) = login(ports[0], user, "correct horse");
    assert_eq!(code, 429, "{response}");
    assert!(
        response.to_ascii_lowercase().contains("retry-after: "),
        "{response}"
    );
    // another username is unaffected
    assert_eq!(login(ports[0], &format!("{user}-other"), "wrong").0, 401);
    assert_eq!(
        login(ports[0], &format!("{user}-other"), "correct horse").0,
        200
    );
    // a body that is not credentials
    let (code, _) = send_with(ports[0], "POST", "/login", &[], "hello");
    assert_eq!(code, 400);
}

#[test]
fn failed_logins_are_limited_in_memory() {
    let server = Server::start(None);
    exercise_login(&[server.port], "ann");
}

#[test]
fn failed_logins_are_limited_across_servers_through_redis() {
    let redis = TestRedis::spawn();
    let a = Server::start(Some(&redis.url));
    let b = Server::start(Some(&redis.url));
    exercise_login(&[a.port, b.port], "bob");
}

/// A failed login from `ip` (the client address a trusted proxy forwards).
fn login_from(port: u16, ip: &str, username: &str, password: &str) -> u16 {
    let body = format!(r#"{{"username": "{username}", "password": "{password}"}}"#);
    let xff = format!("X-Forwarded-For: {ip}");
    let headers = ["Content-Type: application/json", xff.as_str()];
    send_with(port, "POST", "/login", &headers, &body).0
}

/// The server behind a trusted proxy (this test, on 127.0.0.1), so that each
/// request names its client address in `X-Forwarded-For`.
fn behind_a_proxy() -> Server {
    Server::start_env(&[("TRUSTED_PROXIES", "127.0.0.1/32")])
}

/// The `Retry-After` of a response, in seconds.
fn retry_after(response: &str) -> Option<u64> {
    response.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("retry-after")
            .then(|| value.trim().parse().ok())
            .flatten()
    })
}

/// Each attempt the per-(username, IP) limit refuses bans that address
/// from that username, longer each time (`LOGIN_BANS`, short here); other
/// addresses and usernames are untouched.
#[test]
fn refused_logins_ban_the_address_longer_each_time() {
    let server = Server::start_env(&[
        ("TRUSTED_PROXIES", "127.0.0.1/32"),
        ("LOGIN_BANS", "1s,3s,1h"),
    ]);
    let port = server.port;
    let attempt = |ip: &str, user: &str| {
        let body = format!(r#"{{"username": "{user}", "password": "guess"}}"#);
        let xff = format!("X-Forwarded-For: {ip}");
        let headers = ["Content-Type: application/json", xff.as_str()];
        send_with(port, "POST", "/login", &headers, &body)
    };
    let attacker = "203.0.113.77";
    for _ in 0..5 {
        assert_eq!(attempt(attacker, "cy").0, 401);
    }
    // the first offence: banned for 1 s
    let (code, response) = attempt(attacker, "cy");
    assert_eq!((code, retry_after(&response)), (429, Some(1)), "{response}");
    // banned: refused whatever the password, not counted again
    let (code, response) = attempt(attacker, "cy");
    assert_eq!(code, 429, "{response}");
    std::thread::sleep(Duration::from_millis(1100));
    // the ban is over, the 5 failures still count: a second offence, 3 s
    let (code, response) = attempt(attacker, "cy");
    assert_eq!((code, retry_after(&response)), (429, Some(3)), "{response}");
    // elsewhere, nothing changed
    assert_eq!(attempt("198.51.100.9", "cy").0, 401);
    assert_eq!(attempt(attacker, "dee").0, 401);
}

/// The deny-list: 403 on every route, without a decision.
#[test]
fn deny_listed_clients_are_forbidden_everywhere() {
    let server = Server::start(None);
    for (method, path) in [("GET", "/api/hello"), ("POST", "/sms/+15550100")] {
        let (code, response) = send_with(server.port, method, path, &["User-Agent: BadBot"], "");
        assert_eq!(code, 403, "{response}");
        assert!(response.contains("application/problem+json"), "{response}");
        assert!(
            !response.to_ascii_lowercase().contains("retry-after"),
            "{response}"
        );
    }
    let (code, _) = send_with(server.port, "GET", "/api/hello", &["User-Agent: curl"], "");
    assert_eq!(code, 200);
}

#[test]
fn an_attacker_on_one_address_does_not_lock_the_user_out_elsewhere() {
    let server = behind_a_proxy();
    let port = server.port;
    let attacker = "203.0.113.66";
    let guesses: Vec<u16> = (0..6)
        .map(|i| login_from(port, attacker, "ann", &format!("guess {i}")))
        .collect();
    assert_eq!(guesses, [401, 401, 401, 401, 401, 429]);
    // ann, from her own address, is not locked out
    assert_eq!(login_from(port, "198.51.100.7", "ann", "typo"), 401);
    assert_eq!(
        login_from(port, "198.51.100.7", "ann", "correct horse"),
        200
    );
    // the attacker's address is done with ann, whatever the spelling or password
    assert_eq!(login_from(port, attacker, "ann", "correct horse"), 429);
    assert_eq!(login_from(port, attacker, "Ann", "guess"), 429);
    assert_eq!(login_from(port, attacker, " ANN ", "guess"), 429);
    // ... but not with other users
    assert_eq!(login_from(port, attacker, "bea", "guess"), 401);
    // Many addresses guessing ann's password: 20 failures per username per
    // 15 minutes in all (5 from the attacker, 1 from ann so far), then every
    // address waits, ann's own included.
    let mut failures = 6;
    for bot in 1..=4 {
        let ip = format!("192.0.2.{bot}");
        for i in 0..5 {
            let code = login_from(port, &ip, "ann", &format!("guess {i}"));
            if failures < 20 {
                assert_eq!(code, 401, "failure {failures} from {ip}");
                failures += 1;
            } else {
                assert_eq!(code, 429, "beyond 20 failures, from {ip}");
            }
        }
    }
    assert_eq!(login_from(port, "192.0.2.99", "ann", "guess"), 429);
    assert_eq!(login_from(port, "198.51.100.7", "ann", "guess"), 429);
}

#[test]
fn one_address_guessing_across_usernames_is_limited() {
    let server = behind_a_proxy();
    let port = server.port;
    let sprayer = "203.0.113.77";
    // 30 failed logins per client address per hour, whatever the usernames
    for i in 0..30 {
        assert_eq!(
            login_from(port, sprayer, &format!("user{i}"), "123456"),
            401,
            "user{i}"
        );
    }
    assert_eq!(login_from(port, sprayer, "user30", "123456"), 429);
    assert_eq!(login_from(port, sprayer, "user31", "correct horse"), 429);
    // another address is not concerned
    assert_eq!(login_from(port, "198.51.100.8", "user30", "123456"), 401);
    assert_eq!(
        login_from(port, "198.51.100.8", "user30", "correct horse"),
        200
    );
}

#[test]
fn login_bodies_that_are_no_credentials_are_refused_within_the_per_ip_limit() {
    // the per-IP limit at 5 per minute
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("limits.toml");
    let text = std::fs::read_to_string(limits_toml()).expect("examples/limits.toml");
    let text = text.replacen(
        "rate = 100\nper = \"1s\"\nburst = 100",
        "rate = 5\nper = \"1m\"\nburst = 5",
        1,
    );
    std::fs::write(&path, &text).expect("write the limits file");
    let server = Server::start_env(&[
        ("TRUSTED_PROXIES", "127.0.0.1/32"),
        ("LIMITS_FILE", path.to_str().expect("utf-8 path")),
    ]);
    let port = server.port;
    let long = "a".repeat(65);
    for username in ["", "   ", long.as_str()] {
        assert_eq!(
            login_from(port, "203.0.113.5", username, "guess"),
            400,
            "{username:?}"
        );
    }
    // Bodies that are no credentials count in the per-IP limit: it is
    // decided before the body is read.
    let malformed = || {
        let xff = "X-Forwarded-For: 203.0.113.6";
        send_with(port, "POST", "/login", &[xff], "{").0
    };
    let codes: Vec<u16> = (0..6).map(|_| malformed()).collect();
    assert_eq!(codes, [400, 400, 400, 400, 400, 429]);
    assert_eq!(login_from(port, "203.0.113.6", "ann", "correct horse"), 429);
    assert_eq!(login_from(port, "203.0.113.7", "ann", "correct horse"), 200);
}

#[test]
fn the_report_quota_follows_the_authenticated_plan() {
    let server = Server::start_env(&[("API_KEYS", "k-pro-1=pro,k-free-1=free")]);
    let report = |headers: &[&str]| send_with(server.port, "GET", "/api/report", headers, "").0;
    assert_eq!(report(&[]), 200);
    assert_eq!(report(&["Authorization: Bearer k-free-1"]), 200);
    assert_eq!(report(&[]), 429);
    // a plan the client claims is no plan
    assert_eq!(report(&["X-Plan: pro"]), 429);
    assert_eq!(report(&["X-Plan: premium"]), 429);
    // nor is a key that is not one
    assert_eq!(report(&["Authorization: Bearer k-pro-2"]), 429);
    assert_eq!(report(&["Authorization: Bearer k-pro-1x"]), 429);
    assert_eq!(report(&["Authorization: k-pro-1"]), 429);
    // the same limit on the pro plan: 20 per minute, 2 of them used
    // (the scheme's name in any case)
    assert_eq!(report(&["Authorization: bearer k-pro-1"]), 200);
    let pro: Vec<u16> = (0..18)
        .map(|_| report(&["Authorization: Bearer k-pro-1", "X-Plan: free"]))
        .collect();
    assert_eq!(pro.iter().filter(|s| **s == 200).count(), 17, "{pro:?}");
    assert_eq!(pro[17], 429);
}

#[test]
fn a_bad_api_keys_setting_stops_the_server_without_showing_a_key() {
    for setting in ["k-pro-1=pro,sekrit-k=gold", "k-pro-1=pro,sekrit-k"] {
        let (exit, stderr) = refused(Server::command(0, &[("API_KEYS", setting)]));
        assert!(!exit.success(), "{stderr}");
        assert!(stderr.contains("API_KEYS: pair 2"), "{stderr}");
        assert!(!stderr.contains("sekrit"), "{stderr}");
    }
}

#[test]
fn a_phone_number_counts_once_however_it_is_written() {
    let server = Server::start(None);
    let sms = |path: &str| status(server.port, "POST", path);
    assert_eq!(sms("/sms/+15550100"), 202);
    assert_eq!(sms("/sms/+1%20555%200100"), 202);
    assert_eq!(sms("/sms/%2B1-555-0100"), 202);
    for spelling in ["/sms/+15550100", "/sms/+1(555)0100", "/sms/+1.555.0100"] {
        assert_eq!(sms(spelling), 429, "{spelling}");
    }
    // what is no phone number in international form is refused, not counted
    for path in [
        "/sms/15550100",
        "/sms/0015550100",
        "/sms/+1555",
        "/sms/+1555abc0100",
    ] {
        assert_eq!(sms(path), 400, "{path}");
    }
    assert_eq!(sms("/sms/+15550101"), 202, "another number");
}

#[test]
fn one_address_texting_many_numbers_is_limited() {
    let server = behind_a_proxy();
    let sms = |ip: &str, phone: &str| {
        let xff = format!("X-Forwarded-For: {ip}");
        send_with(
            server.port,
            "POST",
            &format!("/sms/{phone}"),
            &[xff.as_str()],
            "",
        )
        .0
    };
    // 10 texts per client IP per hour, whatever the numbers
    for i in 0..10 {
        assert_eq!(
            sms("203.0.113.88", &format!("+1555020{i:02}")),
            202,
            "text {i}"
        );
    }
    assert_eq!(sms("203.0.113.88", "+155502010"), 429);
    assert_eq!(sms("198.51.100.9", "+155502010"), 202, "another address");
}

#[test]
fn the_internal_token_is_exempt_from_every_limit() {
    let server = Server::start_env(&[("INTERNAL_TOKEN", "s3cret")]);
    let hello = |headers: &[&str]| send_with(server.port, "GET", "/api/hello", headers, "").0;
    for _ in 0..15 {
        assert_eq!(hello(&["X-Internal-Token: s3cret"]), 200);
    }
    let plain: Vec<u16> = (0..11).map(|_| hello(&[])).collect();
    assert_eq!(plain.iter().filter(|s| **s == 200).count(), 10, "{plain:?}");
    assert_eq!(hello(&["X-Internal-Token: guess"]), 429);
    // (compared whole: a prefix or an extension of the token is no token)
    assert_eq!(hello(&["X-Internal-Token: s3cre"]), 429);
    assert_eq!(hello(&["X-Internal-Token: s3cret0"]), 429);
    assert_eq!(hello(&["X-Internal-Token: S3CRET"]), 429);
    assert_eq!(hello(&["X-Internal-Token: s3cret"]), 200);
    for i in 0..8 {
        let (code, _) = send_with(
            server.port,
            "POST",
            "/login",
            &["X-Internal-Token: s3cret"],
            &format!(r#"{{"username": "ann", "password": "guess {i}"}}"#),
        );
        assert_eq!(code, 401, "exempt from the failed-login limit too");
    }
}

fn exercise(ports: &[u16]) {
    // /api/hello: 10 per second per IP, burst 10, across all instances.
    // The burst passes; beyond it, one more per 100 ms the requests took
    // (TLS handshakes in a debug build on a busy machine take that long).
    let started = std::time::Instant::now();
    let hello: Vec<u16> = (0..12)
        .map(|i| status(ports[i % ports.len()], "GET", "/api/hello"))
        .collect();
    let refills = usize::try_from(started.elapsed().as_millis() / 100).unwrap_or(usize::MAX);
    let granted = hello.iter().filter(|s| **s == 200).count();
    assert!(hello[..10].iter().all(|s| *s == 200), "{hello:?}");
    assert!(granted <= 10 + refills, "{hello:?}: {refills} refills");
    if refills == 0 {
        assert_eq!(hello[11], 429);
    }
    // /sms/{phone}: 3 per minute per number, 202 when accepted
    let sms: Vec<u16> = (0..4)
        .map(|i| status(ports[i % ports.len()], "POST", "/sms/+15550100"))
        .collect();
    assert_eq!(sms, [202, 202, 202, 429]);
    assert_eq!(
        status(ports[0], "POST", "/sms/+15550199"),
        202,
        "another number has its own limit"
    );
    // /healthz is never limited
    for i in 0..30 {
        assert_eq!(status(ports[i % ports.len()], "GET", "/healthz"), 200);
    }
}

#[test]
fn example_server_in_memory() {
    let server = Server::start(None);
    exercise(&[server.port]);
}

#[test]
fn two_example_servers_share_limits_through_redis() {
    let redis = TestRedis::spawn();
    let a = Server::start(Some(&redis.url));
    let b = Server::start(Some(&redis.url));
    exercise(&[a.port, b.port]);
}

#[cfg(feature = "cluster")]
#[test]
fn two_example_servers_share_limits_through_a_cluster() {
    let cluster = common::cluster::TestCluster::start();
    let seeds = cluster.seed_urls().join(",");
    let a = Server::start_env(&[("REDIS_CLUSTER_URLS", &seeds)]);
    let b = Server::start_env(&[("REDIS_CLUSTER_URLS", &seeds)]);
    // the SMS route's limits are keyed per IP and per phone: two slots
    warm(&[a.port, b.port]);
    exercise(&[a.port, b.port]);
}

#[cfg(feature = "sentinel")]
#[test]
fn two_example_servers_share_limits_through_sentinel() {
    let sentinel = common::sentinel::TestSentinel::start();
    let urls = sentinel.sentinel_urls().join(",");
    let env = [
        ("REDIS_SENTINEL_URLS", urls.as_str()),
        ("REDIS_SENTINEL_MASTER", sentinel.master_name()),
    ];
    let a = Server::start_env(&env);
    let b = Server::start_env(&env);
    warm(&[a.port, b.port]);
    exercise(&[a.port, b.port]);
}

#[cfg(feature = "tls")]
#[test]
fn two_example_servers_share_limits_over_tls() {
    let tls = common::tls::TestTls::start();
    let ca = tls.ca_path().to_str().expect("a UTF-8 path").to_owned();
    let env = [("REDIS_URL", tls.url()), ("REDIS_CA_FILE", ca)];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let a = Server::start_env(&env);
    let b = Server::start_env(&env);
    warm(&[a.port, b.port]);
    exercise(&[a.port, b.port]);
}

#[test]
fn example_servers_during_a_redis_outage() {
    let mut redis = TestRedis::spawn();
    let open = Server::start_with(Some(&redis.url), Some("open"));
    let memory = Server::start_with(Some(&redis.url), Some("memory"));
    let closed = Server::start_with(Some(&redis.url), None);
    assert_eq!(status(open.port, "GET", "/api/hello"), 200);
    redis.stop();
    // fail-open: the handler has no decision to read and still answers
    for _ in 0..3 {
        assert_eq!(status(open.port, "GET", "/api/hello"), 200);
    }
    // in-memory fallback: the per-phone limit still holds
    let sms: Vec<u16> = (0..4)
        .map(|_| status(memory.port, "POST", "/sms/+15550100"))
        .collect();
    assert_eq!(sms, [202, 202, 202, 429]);
    // fail-closed (the default): 503
    assert_eq!(status(closed.port, "GET", "/api/hello"), 503);
    assert_eq!(status(closed.port, "GET", "/healthz"), 200);
}

/// `examples/limits.toml`, the file form of the built-in limits.
fn limits_toml() -> String {
    format!("{}/examples/limits.toml", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_example_limits_file_holds_the_built_in_limits() {
    let path = limits_toml();
    let server = Server::start_env(&[("LIMITS_FILE", &path)]);
    exercise(&[server.port]);
}

#[test]
fn limits_come_from_the_file_in_limits_file() {
    let dir = std::env::temp_dir().join(format!("rl-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("limits.toml");
    let text = std::fs::read_to_string(limits_toml()).expect("examples/limits.toml");
    // hello: 2 per minute, bursts of 2, instead of 10 per second
    let text = text.replacen(
        "rate = 10\nper = \"1s\"\nburst = 10",
        "rate = 2\nper = \"1m\"\nburst = 2",
        1,
    );
    std::fs::write(&path, &text).expect("write the limits file");
    let server = Server::start_env(&[("LIMITS_FILE", path.to_str().expect("utf-8 path"))]);
    let hello: Vec<u16> = (0..3)
        .map(|_| status(server.port, "GET", "/api/hello"))
        .collect();
    assert_eq!(hello, [200, 200, 429]);

    // A mistake stops the server with an error naming the limit and the field.
    std::fs::write(
        &path,
        text.replacen("window = \"1m\"", "window = \"1 fortnight\"", 1),
    )
    .expect("write the limits file");
    let (exit, stderr) = refused(Server::command(
        0,
        &[("LIMITS_FILE", path.to_str().expect("utf-8 path"))],
    ));
    assert!(!exit.success(), "{stderr}");
    assert!(
        stderr.contains("sms") && stderr.contains("`window`"),
        "the error names the limit and the field: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The status of a text to one number, and the `sms` limit's entry in its
/// `RateLimit-Policy`.
fn sms_policy(port: u16) -> (u16, String) {
    let (code, response) = send_with(port, "POST", "/sms/+15550100", &[], "");
    let policy = response
        .lines()
        .find_map(|line| line.strip_prefix("ratelimit-policy: "))
        .and_then(|value| value.split(", ").find(|item| item.starts_with("\"sms\"")))
        .unwrap_or_default()
        .to_owned();
    (code, policy)
}

/// Waits (at most 20 s) until `done` holds; whether it did.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// `examples/limits.toml` with the `sms` limit at `n` a minute.
fn sms_limits(n: u32) -> String {
    let text = std::fs::read_to_string(limits_toml()).expect("examples/limits.toml");
    text.replacen("limit = 3\n", &format!("limit = {n}\n"), 1)
}

/// The example server on `LIMITS_FILE=path`, logging at `info`, and its log
/// as it grows; once it listens.
fn server_with_limits_file(path: &std::path::Path) -> (Server, Arc<Mutex<String>>) {
    use std::io::{BufRead, BufReader};
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let mut command = Server::command(port, &[("LIMITS_FILE", path.to_str().expect("utf-8 path"))]);
    // (the server logs to standard output)
    command.env("RUST_LOG", "info").stdout(Stdio::piped());
    let mut child = command.spawn().expect("start the example server");
    let log = Arc::new(Mutex::new(String::new()));
    let pipe = child.stdout.take().expect("piped stdout");
    let lines = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            let mut log = lines.lock().expect("log");
            log.push_str(&line);
            log.push('\n');
        }
    });
    let server = Server { child, port };
    assert!(
        eventually(|| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()),
        "the server never listened; the log:\n{}",
        log.lock().expect("log")
    );
    (server, log)
}

/// A Kubernetes ConfigMap mount: `limits.toml -> ..data/limits.toml`,
/// `..data -> ..<timestamp>`; the kubelet updates it by writing a new
/// timestamped folder, pointing a new symlink `..data_tmp` at it, renaming
/// that over `..data` and removing the old folder. No event names
/// `limits.toml`: the server still reads the new limits.
#[test]
fn a_limits_file_in_a_kubernetes_config_map_is_reloaded() {
    use std::os::unix::fs::symlink;
    let dir = std::env::temp_dir().join(format!("rl-configmap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let version = |name: &str, n: u32| {
        let folder = dir.join(name);
        std::fs::create_dir(&folder).expect("timestamped folder");
        std::fs::write(folder.join("limits.toml"), sms_limits(n)).expect("write");
    };
    let first = "..2026_11_27_12_00_00.000000001";
    version(first, 1);
    symlink(first, dir.join("..data")).expect("..data");
    symlink("..data/limits.toml", dir.join("limits.toml")).expect("limits.toml");
    let (server, log) = server_with_limits_file(&dir.join("limits.toml"));
    let port = server.port;
    assert_eq!(sms_policy(port), (202, "\"sms\";q=1;w=60".into()));

    // the kubelet's update, step for step
    let second = "..2026_11_27_12_05_00.000000002";
    version(second, 3);
    symlink(second, dir.join("..data_tmp")).expect("..data_tmp");
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).expect("rename over ..data");
    std::fs::remove_dir_all(dir.join(first)).expect("remove the old folder");
    assert!(
        eventually(|| log.lock().expect("log").contains("in force now for sms")),
        "the new limits were never read; the log:\n{}",
        log.lock().expect("log")
    );
    assert_eq!(sms_policy(port), (202, "\"sms\";q=3;w=60".into()));
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_changed_limits_file_takes_effect_without_a_restart() {
    let dir = std::env::temp_dir().join(format!("rl-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("limits.toml");
    let sms = sms_limits;
    std::fs::write(&path, sms(1)).expect("write the limits file");
    let (server, log) = server_with_limits_file(&path);
    let port = server.port;
    let logged = |text: &str| log.lock().expect("log").contains(text);
    let eventually = |what: &str, done: &mut dyn FnMut() -> bool| {
        let log = log.clone();
        assert!(
            eventually(done),
            "never: {what}; the log:\n{}",
            log.lock().expect("log")
        );
    };

    assert_eq!(sms_policy(port), (202, "\"sms\";q=1;w=60".into()));
    assert_eq!(sms_policy(port).0, 429);

    // raised to 3 a minute: the text sent still counts, 2 are left
    std::fs::write(&path, sms(3)).expect("write the limits file");
    eventually("the new file is in force", &mut || {
        logged("in force now for sms")
    });
    let codes: Vec<u16> = (0..3).map(|_| sms_policy(server.port).0).collect();
    assert_eq!(codes, [202, 202, 429]);
    assert_eq!(sms_policy(port).1, "\"sms\";q=3;w=60");

    // a mistake keeps the limits in force and says which limit and field
    std::fs::write(
        &path,
        sms(9).replacen("window = \"1m\"", "window = \"1 fortnight\"", 1),
    )
    .expect("write the limits file");
    eventually("the mistake is logged", &mut || {
        logged("not applied, the limits stay as they were") && logged("`window`")
    });
    assert!(logged("\"sms\""), "the log names the limit");
    assert_eq!(sms_policy(port), (429, "\"sms\";q=3;w=60".into()));

    // SIGHUP reads the file again (the watcher saw this write already)
    std::fs::write(&path, sms(3)).expect("write the limits file");
    eventually("the fixed file is read", &mut || {
        logged("read again, no change")
    });
    let before = log
        .lock()
        .expect("log")
        .matches("read again, no change")
        .count();
    let hup = Command::new("kill")
        .args(["-HUP", &server.child.id().to_string()])
        .status()
        .expect("kill -HUP");
    assert!(hup.success());
    eventually("SIGHUP reloads", &mut || {
        log.lock()
            .expect("log")
            .matches("read again, no change")
            .count()
            > before
    });
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn metrics_are_served_in_the_prometheus_format() {
    let server = Server::start(None);
    exercise(&[server.port]);
    let (code, body) = scrape(server.port);
    assert_eq!(code, 200);
    let sample = |limit: &str, outcome: &str| {
        body.lines().any(|line| {
            line.starts_with("tower_ratelimit_decisions_total{")
                && line.contains(&format!("limit=\"{limit}\""))
                && line.contains(&format!("outcome=\"{outcome}\""))
        })
    };
    assert!(
        sample("hello", "allowed") && sample("hello", "denied"),
        "{body}"
    );
    assert!(
        sample("sms", "denied") && sample("per-ip", "allowed"),
        "{body}"
    );
    assert!(body.contains("tower_ratelimit_memory_store_keys"), "{body}");
}

/// At the example's default log filter (no `RUST_LOG`), a refused request
/// writes no line: under a flood, a line per refusal filled the disk (570
/// MB in 80 s). What it logs is a few lines at start.
#[test]
fn refused_requests_are_not_logged_at_the_default_filter() {
    use std::io::Read;
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let mut command = Server::command(port, &[]);
    command.env_remove("RUST_LOG").stdout(Stdio::piped());
    let mut child = command.spawn().expect("start the example server");
    let mut pipe = child.stdout.take().expect("piped stdout");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    });
    let server = Server { child, port };
    assert!(
        eventually(|| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()),
        "the example server did not listen on {port}"
    );
    let refused = (0..40)
        .filter(|_| status(port, "GET", "/api/hello") == 429)
        .count();
    assert!(refused >= 20, "only {refused} of 40 refused");
    drop(server);
    let log = reader.join().expect("stdout reader");
    assert!(
        !log.contains("rate-limited") && !log.contains("rate_limit"),
        "refusals logged at the default filter:\n{log}"
    );
    assert!(
        log.lines().count() < 10,
        "{} lines:\n{log}",
        log.lines().count()
    );
}

/// `/metrics` is no public page: its outage gauge tells when fail-open lets
/// everything through. Served only to a request with the internal token
/// (as a bearer token or `X-Internal-Token`), 401 without it or with
/// another, 404 when the server has no token.
#[test]
fn metrics_are_served_only_with_the_internal_token() {
    let server = Server::start_env(&[("ON_STORE_ERROR", "open")]);
    let (code, response) = send_with(server.port, "GET", "/metrics", &[], "");
    assert_eq!(code, 401, "{response}");
    assert!(!response.contains("tower_ratelimit_"), "{response}");
    let wrong = send_with(
        server.port,
        "GET",
        "/metrics",
        &["Authorization: Bearer metrics-s3cres"],
        "",
    );
    assert_eq!(wrong.0, 401, "{}", wrong.1);
    let other = send_with(
        server.port,
        "GET",
        "/metrics",
        &["X-Internal-Token: nope"],
        "",
    );
    assert_eq!(other.0, 401, "{}", other.1);
    assert_eq!(scrape(server.port).0, 200);
    let header = format!("X-Internal-Token: {TOKEN}");
    assert_eq!(
        send_with(server.port, "GET", "/metrics", &[&header], "").0,
        200
    );

    let untokened = Server::start_env(&[("INTERNAL_TOKEN", "")]);
    assert_eq!(status(untokened.port, "GET", "/metrics"), 404);
    let header = format!("Authorization: Bearer {TOKEN}");
    assert_eq!(
        send_with(untokened.port, "GET", "/metrics", &[&header], "").0,
        404
    );
}

/// The metric names (`tower_ratelimit_...`) in `expr`.
fn metric_names(expr: &str, names: &mut std::collections::BTreeSet<String>) {
    for (at, _) in expr.match_indices("tower_ratelimit_") {
        let name: String = expr[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        names.insert(name);
    }
}

/// Every `expr` string anywhere in the dashboard's JSON.
fn dashboard_exprs(value: &serde_json::Value, exprs: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(fields) => {
            for (key, value) in fields {
                match (key.as_str(), value) {
                    ("expr", serde_json::Value::String(expr)) => exprs.push(expr.clone()),
                    _ => dashboard_exprs(value, exprs),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| dashboard_exprs(v, exprs)),
        _ => {}
    }
}

/// Every rule's `expr` in the alert rules: inline, or a block (`|`, `>`)
/// of the lines indented deeper than the key.
fn alert_exprs(yaml: &str) -> Vec<String> {
    let mut exprs = vec![];
    let mut lines = yaml.lines().peekable();
    while let Some(line) = lines.next() {
        let indent = line.len() - line.trim_start().len();
        let Some(rest) = line.trim_start().strip_prefix("expr:") else {
            continue;
        };
        let rest = rest.trim();
        if !rest.starts_with('|') && !rest.starts_with('>') {
            exprs.push(rest.to_owned());
            continue;
        }
        let mut block = String::new();
        while let Some(next) = lines.peek() {
            let deeper = next.len() - next.trim_start().len() > indent;
            if !deeper && !next.trim().is_empty() {
                break;
            }
            block.push_str(next.trim());
            block.push(' ');
            lines.next();
        }
        exprs.push(block);
    }
    exprs
}

/// The metric names the example dashboard and the alert rules query.
fn queried_metrics() -> std::collections::BTreeSet<String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");
    let json = std::fs::read_to_string(format!("{dir}/grafana-dashboard.json")).expect("dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&json).expect("the dashboard is JSON");
    let mut exprs = vec![];
    dashboard_exprs(&dashboard, &mut exprs);
    let yaml = std::fs::read_to_string(format!("{dir}/prometheus-alerts.yml")).expect("rules");
    let rules = alert_exprs(&yaml);
    assert!(exprs.len() >= 10 && rules.len() >= 5, "{exprs:?} {rules:?}");
    let mut names = std::collections::BTreeSet::new();
    for expr in exprs.iter().chain(&rules) {
        metric_names(expr, &mut names);
    }
    names
}

/// The queried metric names that `/metrics` text `body` does not export:
/// a name is exported when a sample of it is (a histogram's `_bucket`,
/// `_sum` and `_count` are its samples), a `_bucket` only by a histogram.
fn missing(queried: &std::collections::BTreeSet<String>, body: &str) -> Vec<String> {
    let samples: std::collections::BTreeSet<&str> = body
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split(['{', ' ']).next())
        .collect();
    queried
        .iter()
        .filter(|name| {
            let histogram = name
                .strip_suffix("_bucket")
                .is_none_or(|base| body.contains(&format!("# TYPE {base} histogram")));
            !samples.contains(name.as_str()) || !histogram
        })
        .cloned()
        .collect()
}

/// Traffic through every kind of metric the dashboard shows, once the
/// server decides (a new Redis connection may take a first request's
/// 100 ms): decisions allowed and refused, a burst of `/api/hello` (grants
/// near the limit), and a completion charged after its response.
fn drive_every_metric(port: u16) {
    assert!(
        eventually(|| status(port, "POST", "/sms/+15550177") == 202),
        "the server never decided"
    );
    for _ in 0..4 {
        status(port, "POST", "/sms/+15550100");
    }
    let (code, response) = send_with(port, "POST", "/api/complete", &[], "a short prompt");
    assert_eq!(code, 200, "{response}");
}

fn every_queried_metric_is_exported(port: u16) {
    let queried = queried_metrics();
    for name in [
        "tower_ratelimit_decisions_total",
        "tower_ratelimit_near_limit_total",
        "tower_ratelimit_store_outage",
        "tower_ratelimit_store_duration_seconds_bucket",
    ] {
        assert!(queried.contains(name), "{name} is not queried: {queried:?}");
    }
    drive_every_metric(port);
    // (the completion's charge lands on a task of its own, after the
    // response; a burst each round until one spends `/api/hello`)
    let mut body = String::new();
    let exported = eventually(|| {
        for _ in 0..12 {
            status(port, "GET", "/api/hello");
        }
        body = scrape(port).1;
        missing(&queried, &body).is_empty()
    });
    assert!(
        exported,
        "not exported: {:?}\n{body}",
        missing(&queried, &body)
    );
}

#[test]
fn the_dashboard_and_the_alerts_query_only_exported_metrics_in_memory() {
    let server = Server::start(None);
    every_queried_metric_is_exported(server.port);
}

#[test]
fn the_dashboard_and_the_alerts_query_only_exported_metrics_on_redis() {
    let redis = TestRedis::spawn();
    let server = Server::start(Some(&redis.url));
    every_queried_metric_is_exported(server.port);
}

/// The value of the sample of `name` with `label` in `/metrics`.
fn gauge(port: u16, name: &str, label: &str) -> Option<f64> {
    let body = scrape(port).1;
    body.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(label))
        .find_map(|line| line.rsplit_once(' ')?.1.parse().ok())
}

/// The outage gauge of the example server (failing closed): 0, 1 while
/// Redis is down, 0 once it answers again.
#[test]
fn the_store_outage_gauge_follows_a_redis_outage() {
    let mut redis = TestRedis::spawn();
    let server = Server::start(Some(&redis.url));
    let outage = || {
        gauge(
            server.port,
            "tower_ratelimit_store_outage",
            "store=\"redis\"",
        )
    };
    // (a first request may miss the 100 ms while the connection is made)
    assert!(
        eventually(|| status(server.port, "GET", "/api/hello") == 200),
        "the server never decided"
    );
    assert_eq!(outage(), Some(0.0));
    redis.stop();
    assert_eq!(status(server.port, "GET", "/api/hello"), 503);
    assert_eq!(outage(), Some(1.0));
    redis.restart();
    assert!(
        eventually(|| status(server.port, "GET", "/api/hello") == 200),
        "the server never decided again"
    );
    assert_eq!(outage(), Some(0.0));
}

/// Two exports at once per client, across two servers on one Redis: a third
/// is refused while both stream; the permits come back when they end.
#[test]
fn exports_run_at_most_two_at_once_per_client_across_servers() {
    let redis = TestRedis::spawn();
    let a = Server::start(Some(&redis.url));
    let b = Server::start(Some(&redis.url));
    let (port_a, port_b) = (a.port, b.port);
    let running: Vec<_> = [port_a, port_b]
        .into_iter()
        .map(|port| std::thread::spawn(move || send(port, "GET", "/api/export")))
        .collect();
    // both stream for about a second: a third is refused meanwhile
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(status(port_a, "GET", "/api/export"), 429);
    for export in running {
        let (code, body) = export.join().expect("export");
        assert_eq!(code, 200);
        assert!(body.contains("9,row 9"), "the whole export: {body:?}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let code = status(port_b, "GET", "/api/export");
        if code == 200 {
            break;
        }
        assert_eq!(code, 429);
        assert!(Instant::now() < deadline, "the permits never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A completion is charged the tokens its response reports: two prompts
/// of 900 bytes cost 1000 tokens each, the budget of 2000 per hour; the
/// third is refused.
#[test]
fn a_completion_is_charged_the_tokens_its_response_reports() {
    let redis = TestRedis::spawn();
    let a = Server::start(Some(&redis.url));
    let b = Server::start(Some(&redis.url));
    let prompt = "p".repeat(900);
    for port in [a.port, b.port] {
        let (code, response) = send_with(port, "POST", "/api/complete", &[], &prompt);
        assert_eq!(code, 200, "{response}");
        assert!(
            response
                .to_ascii_lowercase()
                .contains("x-tokens-used: 1000"),
            "{response}"
        );
        // the charge lands on a task of its own, after the response
        std::thread::sleep(Duration::from_millis(300));
    }
    let (code, response) = send_with(a.port, "POST", "/api/complete", &[], "hi");
    assert_eq!(code, 429, "{response}");
    assert!(
        response.to_ascii_lowercase().contains("retry-after"),
        "{response}"
    );
}
