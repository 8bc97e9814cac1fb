//! A fleet during a Redis outage: with `OnStoreError::FallbackToMemory`,
//! each instance grants its share of every limit (the quota divided by the
//! instances its heartbeat counted), so the fleet as a whole stays within
//! the documented bound; and the heartbeat costs decisions nothing.

mod common;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use common::{unique_prefix, TestRedis};
use http::{HeaderName, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_ratelimit::key::Header;
use tower_ratelimit::layer::{OnStoreError, RateLimitInfo, RateLimitLayer};
use tower_ratelimit::{Clock, Limit, Quota, RedisStore, RedisStoreBuilder, SystemClock};

const PERIOD: Duration = Duration::from_millis(200);
const HOUR: Duration = Duration::from_secs(3600);

/// Says who decided: `redis` or `fallback`.
async fn who(info: RateLimitInfo) -> &'static str {
    if info.store_failed() {
        "fallback"
    } else {
        "redis"
    }
}

/// One instance, as a process of its own would build it: its own store
/// handle (its own fallback, its own heartbeat) over the shared Redis.
/// `/sms`: 3 per hour per phone (fixed window); `/api`: a token bucket of
/// 20, refilled 20 per hour, per phone.
fn instance(url: &str, prefix: &str, policy: OnStoreError) -> Router {
    instance_on(builder(url, prefix).build().expect("store"), policy)
}

/// The store builder of an instance: a heartbeat every [`PERIOD`].
fn builder(url: &str, prefix: &str) -> RedisStoreBuilder {
    RedisStore::builder(url)
        .prefix(prefix)
        .fleet_heartbeat(PERIOD)
}

/// An instance over `store` (see [`instance`]).
fn instance_on(store: RedisStore, policy: OnStoreError) -> Router {
    let phone = || Header::new(HeaderName::from_static("x-phone"));
    let layer = |limit: Limit| {
        RateLimitLayer::builder()
            .store(store.clone())
            .limit(limit, phone())
            .on_store_error(policy)
            .timeout(Duration::from_millis(200))
            .build()
            .expect("layer")
    };
    let sms = Limit::new("sms", Quota::rate(3, HOUR).fixed_window()).expect("limit");
    let api =
        Limit::new("api", Quota::rate(20, HOUR).allow_burst(20).token_bucket()).expect("limit");
    Router::new()
        .route("/sms", get(who).layer(layer(sms)))
        .route("/api", get(who).layer(layer(api)))
}

/// The status and body of `GET path` with `x-phone: phone`.
async fn send(app: &Router, path: &str, phone: &str) -> (StatusCode, String) {
    let request = Request::get(path)
        .header("x-phone", phone)
        .body(Body::empty())
        .expect("request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let body = response.into_body().collect().await.expect("body");
    (
        status,
        String::from_utf8_lossy(&body.to_bytes()).into_owned(),
    )
}

/// Sends `rounds` requests for `phone` to `path` through every instance in
/// turn; how many each admitted, each decided by `by`.
async fn admitted(apps: &[Router], path: &str, phone: &str, rounds: usize, by: &str) -> Vec<usize> {
    let mut admitted = vec![0; apps.len()];
    for _ in 0..rounds {
        for (i, app) in apps.iter().enumerate() {
            let (status, body) = send(app, path, phone).await;
            match status {
                StatusCode::OK => {
                    assert_eq!(body, by, "instance {i}, {path} for {phone}");
                    admitted[i] += 1;
                }
                StatusCode::TOO_MANY_REQUESTS => {}
                other => panic!("instance {i}: {other} for {path}"),
            }
        }
    }
    admitted
}

fn redis(url: &str) -> redis::Connection {
    redis::Client::open(url)
        .expect("client")
        .get_connection()
        .expect("connection")
}

/// How many instances the fleet set holds now.
fn fleet_size(url: &str, prefix: &str) -> usize {
    redis::cmd("ZCARD")
        .arg(format!("{prefix}:fleet"))
        .query(&mut redis(url))
        .expect("ZCARD")
}

/// Waits until the fleet set holds `n`, then for every instance to have
/// read it (one more heartbeat each, with room to spare).
async fn wait_for_fleet(url: &str, prefix: &str, n: usize) {
    let until = Instant::now() + Duration::from_secs(20);
    while fleet_size(url, prefix) != n {
        assert!(Instant::now() < until, "the fleet never reached {n}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(PERIOD * 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_grants_about_one_quota_during_an_outage_and_returns_to_redis() {
    let mut server = TestRedis::spawn();
    let prefix = unique_prefix("fleet");
    let fleet: Vec<Router> = (0..4)
        .map(|_| instance(&server.url, &prefix, OnStoreError::FallbackToMemory))
        .collect();
    // while Redis is up, the limits are the fleet's: 3 per phone in all
    let shared = admitted(&fleet, "/sms", "+100", 3, "redis").await;
    assert_eq!(shared.iter().sum::<usize>(), 3, "{shared:?}");
    wait_for_fleet(&server.url, &prefix, 4).await;

    server.stop();
    // the fields count what this instance still grants: 5 of 20, 1 taken
    let request = Request::get("/api")
        .header("x-phone", "+4")
        .body(Body::empty())
        .expect("request");
    let response = fleet[0].clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["ratelimit"], "\"api\";r=4;t=720");
    let phones = ["+1", "+2", "+3"];
    let mut report = Vec::new();
    for phone in phones {
        // 3 per phone, 4 instances: each grants at least one (the floor),
        // so the fleet grants 4, not 12
        let sms = admitted(&fleet, "/sms", phone, 5, "fallback").await;
        assert_eq!(sms, [1, 1, 1, 1], "sms for {phone}");
        // 20 per phone, 4 instances: 5 each, 20 in all, not 80
        let api = admitted(&fleet, "/api", phone, 25, "fallback").await;
        assert_eq!(api, [5, 5, 5, 5], "api for {phone}");
        report.push(format!("{phone}: sms {sms:?} api {api:?}"));
    }
    // an instance that starts during the outage learned no count: it
    // grants the full quota
    let joiner = instance(&server.url, &prefix, OnStoreError::FallbackToMemory);
    let late = admitted(std::slice::from_ref(&joiner), "/sms", "+1", 5, "fallback").await;
    assert_eq!(late, [3], "a joiner without a count");
    let late_api = admitted(std::slice::from_ref(&joiner), "/api", "+1", 25, "fallback").await;
    assert_eq!(late_api, [20], "a joiner without a count");
    eprintln!("outage, 4 instances: {}", report.join("; "));
    eprintln!("outage, joiner on +1: sms {late:?} api {late_api:?}");

    server.restart();
    let mut everyone = fleet.clone();
    everyone.push(joiner);
    // every instance decides in Redis again, without a restart
    let until = Instant::now() + Duration::from_secs(20);
    for (i, app) in everyone.iter().enumerate() {
        loop {
            let (status, body) = send(app, "/api", &format!("probe-{i}")).await;
            if status == StatusCode::OK && body == "redis" {
                break;
            }
            assert!(
                Instant::now() < until,
                "instance {i} never went back to Redis"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // one limit for the fleet again (the restarted Redis kept nothing)
    let back = admitted(&everyone, "/sms", "+9", 3, "redis").await;
    assert_eq!(back.iter().sum::<usize>(), 3, "{back:?}");
    eprintln!("after the restart, +9 through 5 instances: {back:?}");
    // and the heartbeats count everyone, the joiner included
    let until = Instant::now() + Duration::from_secs(20);
    while fleet_size(&server.url, &prefix) != 5 {
        assert!(Instant::now() < until, "the heartbeats did not resume");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_one_grants_the_whole_quota() {
    let mut server = TestRedis::spawn();
    let prefix = unique_prefix("fleet-one");
    let app = instance(&server.url, &prefix, OnStoreError::FallbackToMemory);
    assert_eq!(send(&app, "/sms", "+1").await.1, "redis");
    wait_for_fleet(&server.url, &prefix, 1).await;
    server.stop();
    let sms = admitted(std::slice::from_ref(&app), "/sms", "+2", 5, "fallback").await;
    assert_eq!(sms, [3]);
}

/// The fleet set's key.
fn fleet_key(prefix: &str) -> String {
    format!("{prefix}:fleet")
}

/// The server's `TIME`, in ms.
fn server_ms(url: &str) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query(&mut redis(url)).expect("TIME");
    s * 1000 + us / 1000
}

/// Waits until `n` instances have beaten since the server's clock read
/// `since` ms (each beat scores its id three periods past the server's
/// clock), polling often: the moment the last of them has, the first has
/// not beaten again yet (most of a period is left).
async fn wait_for_beats_since(url: &str, prefix: &str, since: u64, n: usize) {
    let floor = since + u64::try_from((PERIOD * 3).as_millis()).expect("ms");
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let beaten: usize = redis::cmd("ZCOUNT")
            .arg(fleet_key(prefix))
            .arg(floor)
            .arg("+inf")
            .query(&mut redis(url))
            .expect("ZCOUNT");
        if beaten == n {
            return;
        }
        assert!(Instant::now() < until, "{beaten} of {n} beat again");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// What `fleet` grants during an outage, per instance, summed over three
/// phones: `/sms` (3 per phone) and `/api` (a bucket of 20 per phone).
async fn granted_in_outage(fleet: &[Router]) -> (Vec<usize>, Vec<usize>) {
    let (mut sms, mut api) = (vec![0; fleet.len()], vec![0; fleet.len()]);
    for phone in ["+1", "+2", "+3"] {
        let one = admitted(fleet, "/sms", phone, 5, "fallback").await;
        let other = admitted(fleet, "/api", phone, 25, "fallback").await;
        for i in 0..fleet.len() {
            sms[i] += one[i];
            api[i] += other[i];
        }
    }
    (sms, api)
}

/// Four instances that have counted each other; `disturb` does to the
/// fleet set what an operator or the server may do, and Redis stops the
/// moment every instance has beaten once since (the window where the
/// heartbeats counted 1, 2, 3 and 4 in turn): the fleet still grants one
/// quota per phone (the bound of BOUNDS.md: max(3, 4) = 4 of `/sms`, 20
/// of `/api`), not twice that.
async fn an_outage_right_after(what: &str, disturb: impl FnOnce(&str, &str)) {
    let mut server = TestRedis::spawn();
    let prefix = unique_prefix("fleet-fall");
    let fleet: Vec<Router> = (0..4)
        .map(|_| instance(&server.url, &prefix, OnStoreError::FallbackToMemory))
        .collect();
    wait_for_fleet(&server.url, &prefix, 4).await;
    let since = server_ms(&server.url);
    disturb(&server.url, &prefix);
    wait_for_beats_since(&server.url, &prefix, since, 4).await;
    server.stop();
    let (sms, api) = granted_in_outage(&fleet).await;
    eprintln!("{what}, then an outage: sms {sms:?} api {api:?} over 3 phones");
    assert_eq!(sms, [3, 3, 3, 3], "{what}: sms");
    assert_eq!(api, [15, 15, 15, 15], "{what}: api");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_fleet_key_does_not_lower_the_count() {
    an_outage_right_after("DEL of the fleet key", |url, prefix| {
        let _: () = redis::cmd("DEL")
            .arg(fleet_key(prefix))
            .query(&mut redis(url))
            .expect("DEL");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushdb_does_not_lower_the_count() {
    an_outage_right_after("FLUSHDB", |url, _| {
        let _: () = redis::cmd("FLUSHDB")
            .query(&mut redis(url))
            .expect("FLUSHDB");
    })
    .await;
}

/// Redis' `TIME` cannot be stepped here (no hook in the server, no
/// libfaketime): the step is made in the set instead. A step of the
/// server's clock by `d` forward is, to the heartbeat (which compares each
/// score with `TIME`), every score moved `d` back, here an hour. (Redis
/// would expire the set as well, past its last score: that is the `DEL`
/// above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_step_of_the_redis_clock_does_not_lower_the_count() {
    an_outage_right_after("the Redis clock an hour ahead", |url, prefix| {
        let _: () = redis::cmd("EVAL")
            .arg(
                "local m = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES') \
                 for i = 1, #m, 2 do \
                   redis.call('ZADD', KEYS[1], 'XX', tonumber(m[i + 1]) - 3600000, m[i]) \
                 end",
            )
            .arg(1)
            .arg(fleet_key(prefix))
            .query(&mut redis(url))
            .expect("EVAL");
    })
    .await;
}

/// The system clock, `ahead` in front.
struct Ahead {
    clock: SystemClock,
    ahead: i64,
}

impl Clock for Ahead {
    fn now_micros(&self) -> i64 {
        self.clock.now_micros() + self.ahead
    }
}

/// One instance's store decides on a clock of its own, an hour ahead of
/// the others' (Redis `TIME`): its heartbeats are stamped with `TIME` all
/// the same, so they drop nobody, and the fleet grants one quota during an
/// outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_clock_runs_ahead_does_not_lower_the_count() {
    let mut server = TestRedis::spawn();
    let prefix = unique_prefix("fleet-ahead");
    let ahead = builder(&server.url, &prefix)
        .clock(Ahead {
            clock: SystemClock::new(),
            ahead: 3_600_000_000,
        })
        .build()
        .expect("store");
    let mut fleet = vec![instance_on(ahead, OnStoreError::FallbackToMemory)];
    fleet.extend((0..3).map(|_| instance(&server.url, &prefix, OnStoreError::FallbackToMemory)));
    wait_for_fleet(&server.url, &prefix, 4).await;
    // every instance beat again since, and counted all four
    let since = server_ms(&server.url);
    wait_for_beats_since(&server.url, &prefix, since, 4).await;
    server.stop();
    let (sms, api) = granted_in_outage(&fleet).await;
    eprintln!("one instance an hour ahead, then an outage: sms {sms:?} api {api:?}");
    assert_eq!(sms, [3, 3, 3, 3], "sms");
    assert_eq!(api, [15, 15, 15, 15], "api");
}

/// The count is not kept for ever: once two of four instances are gone,
/// the set stops counting them within three periods, and the others' count
/// falls to two within a window of heartbeats more; an outage then grants
/// each of the two half of each quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_count_falls_once_instances_are_gone() {
    let mut server = TestRedis::spawn();
    let prefix = unique_prefix("fleet-gone");
    let mut fleet: Vec<Router> = (0..4)
        .map(|_| instance(&server.url, &prefix, OnStoreError::FallbackToMemory))
        .collect();
    wait_for_fleet(&server.url, &prefix, 4).await;
    // (a store's heartbeat ends with its last handle)
    fleet.truncate(2);
    wait_for_fleet(&server.url, &prefix, 2).await;
    // (waited 5 periods more: a whole window of heartbeats that count
    // two), with room to spare
    tokio::time::sleep(PERIOD * 2).await;
    server.stop();
    let (sms, api) = granted_in_outage(&fleet).await;
    eprintln!("two of four gone, then an outage: sms {sms:?} api {api:?}");
    // sms: a share of 2 of 3 leaves one grant per instance and phone
    assert_eq!(sms, [3, 3], "sms");
    assert_eq!(api, [30, 30], "api");
}

/// The calls of each command since the last `CONFIG RESETSTAT`.
fn command_calls(url: &str) -> Vec<(String, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis(url))
        .expect("INFO");
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats.strip_prefix("calls=")?.split(',').next()?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

/// The commands Redis ran for `decisions` decisions through `app`, one
/// at a time (each its own call: nothing to coalesce), each key fresh
/// (`tag` makes them new), and how long they took.
async fn commands_of(
    url: &str,
    app: &Router,
    tag: &str,
    decisions: u64,
) -> (Vec<(String, u64)>, Duration) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut redis(url))
        .expect("RESETSTAT");
    let started = Instant::now();
    for i in 0..decisions {
        let (status, body) = send(app, "/api", &format!("{tag}{}", i % 50)).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "redis"));
    }
    let elapsed = started.elapsed();
    let mut calls = command_calls(url);
    calls.retain(|(name, _)| !name.starts_with("config"));
    calls.sort();
    (calls, elapsed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_adds_no_command_to_a_decision() {
    let server = TestRedis::spawn();
    let decisions = 400;
    // the same decisions without a fallback (no heartbeat yet), then with
    // one, its heartbeat beating
    let without = instance(
        &server.url,
        &unique_prefix("plain"),
        OnStoreError::default(),
    );
    assert_eq!(send(&without, "/api", "warm").await.1, "redis");
    // (the first run reads more, once: its keys' limit is new to the
    // function; the second is the baseline)
    let _ = commands_of(&server.url, &without, "a", decisions).await;
    let (plain, _) = commands_of(&server.url, &without, "c", decisions).await;
    let prefix = unique_prefix("fleet-cost");
    let with = instance(&server.url, &prefix, OnStoreError::FallbackToMemory);
    assert_eq!(send(&with, "/api", "warm").await.1, "redis");
    wait_for_fleet(&server.url, &prefix, 1).await;
    let (fleet, elapsed) = commands_of(&server.url, &with, "b", decisions).await;
    eprintln!("{decisions} decisions without a heartbeat: {plain:?}");
    eprintln!("{decisions} decisions with a heartbeat every {PERIOD:?}, in {elapsed:?}: {fleet:?}");
    let of = |calls: &[(String, u64)], name: &str| {
        calls.iter().find(|(n, _)| n == name).map_or(0, |(_, c)| *c)
    };
    // the heartbeat's own: one call of the library per period, whatever
    // the decisions (its commands, run once per beat, count the beats),
    // and what it runs (the decisions' function reads `TIME` once each)
    let beats = of(&fleet, "zadd");
    let most = elapsed.as_millis() / PERIOD.as_millis() + 2;
    assert!(
        beats > 0 && u128::from(beats) <= most,
        "{beats} heartbeats in {elapsed:?}"
    );
    // one call per decision, with the heartbeat as without it
    assert_eq!(of(&plain, "fcall") + of(&plain, "evalsha"), decisions);
    assert_eq!(
        of(&fleet, "fcall") + of(&fleet, "evalsha"),
        decisions + beats
    );
    assert_eq!((of(&plain, "eval"), of(&fleet, "eval")), (0, 0));
    assert_eq!(of(&fleet, "time") - of(&plain, "time"), beats);
    for name in ["zadd", "zremrangebyscore", "zrange", "pexpireat", "zcard"] {
        assert_eq!((of(&plain, name), of(&fleet, name)), (0, beats), "{name}");
    }
    // what the decisions run is the same (within what varies with their
    // timing: a quota read again once a second)
    for (name, _) in &fleet {
        let known = plain.iter().any(|(n, _)| n == name);
        assert!(known || of(&fleet, name) == beats, "{name}");
    }
    for name in ["get", "set"] {
        assert!(of(&fleet, name).abs_diff(of(&plain, name)) <= 2, "{name}");
    }
}

/// The memory fallback decides on the store's clock, when it has one: a
/// store driven by a `ManualClock` (a test's, or an application clock a
/// deployment trusts) keeps its time during an outage. (Before, the
/// fallback's store read the system clock: the manual clock moved a window
/// on, and the fallback still refused.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fallback_decides_on_the_stores_clock() {
    let mut server = TestRedis::spawn();
    let clock = tower_ratelimit::ManualClock::new(common::T0);
    let store = builder(&server.url, &unique_prefix("fleet-clock"))
        .clock(clock.clone())
        .build()
        .expect("store");
    let app = instance_on(store, OnStoreError::FallbackToMemory);
    assert_eq!(send(&app, "/sms", "clock").await.1, "redis");
    server.stop();
    // 3 per hour: the fallback grants 3, then refuses until the hour ends
    // on the store's clock, an hour after the system clock's
    let statuses = |answers: Vec<(StatusCode, String)>| -> Vec<StatusCode> {
        answers.into_iter().map(|(status, _)| status).collect()
    };
    let mut first = Vec::new();
    for _ in 0..4 {
        first.push(send(&app, "/sms", "clock").await);
    }
    assert_eq!(first[0].1, "fallback");
    let ok = StatusCode::OK;
    let refused = StatusCode::TOO_MANY_REQUESTS;
    assert_eq!(statuses(first), [ok, ok, ok, refused]);
    clock.advance(HOUR);
    let (status, by) = send(&app, "/sms", "clock").await;
    assert_eq!(
        (status, by.as_str()),
        (ok, "fallback"),
        "a new hour on the store's clock"
    );
}
