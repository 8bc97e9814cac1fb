//! A Redis store with a calendar limit checks once that the server keeps
//! what it counts (persistence, no eviction), and warns once when not.

mod common;
mod events;

use std::time::{Duration, Instant};

use common::{command_calls, TestRedis};
use events::Events;
use tower_ratelimit::{Limit, Limiter, Quota, RedisStore};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// `CONFIG GET` calls the server has answered (`config|get` in Redis 7's
/// command statistics, `config` before).
fn config_calls(server: &TestRedis) -> u64 {
    let mut conn = common::process::connect(&server.url).expect("connect");
    command_calls(&mut conn, "config|get") + command_calls(&mut conn, "config")
}

fn monthly() -> Limit {
    Limit::new("api-monthly", Quota::per_month(10_000).fixed_window()).expect("limit")
}

/// Decides with `limiter` until the server has answered the check's four
/// `CONFIG GET`s (or 5 s), then lets the task log.
async fn decide_until_checked(limiter: &Limiter, server: &TestRedis, before: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    limiter.check("acme", 1).await.expect("decision");
    while config_calls(server) < before + 4 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
}

#[test]
fn a_forgetful_server_is_warned_about_once_per_store() {
    let events = Events::capture();
    let server = TestRedis::spawn_with("--maxmemory 64mb --maxmemory-policy allkeys-lru");
    runtime().block_on(async {
        let store = RedisStore::new(server.url.as_str()).expect("store");
        // no calendar limit: nothing asked
        let hourly = Limit::new("api-hourly", Quota::per_hour(100).fixed_window()).expect("limit");
        Limiter::new(store.clone(), hourly)
            .check("acme", 1)
            .await
            .expect("decision");
        assert_eq!(config_calls(&server), 0);
        let limiter = Limiter::new(store.clone(), monthly());
        decide_until_checked(&limiter, &server, 0).await;
        // another limiter over a clone of the store: not asked again
        let again = Limiter::new(store.clone(), monthly());
        for _ in 0..3 {
            again.check("acme", 1).await.expect("decision");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    });
    assert_eq!(config_calls(&server), 4);
    let warnings = events.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let warning = &warnings[0];
    for said in [
        "calendar",
        "allkeys-lru",
        "noeviction",
        "appendonly",
        "save",
    ] {
        assert!(warning.contains(said), "{said:?} not in {warning}");
    }
}

#[test]
fn a_durable_server_is_not_warned_about() {
    let events = Events::capture();
    // the append-only file in a folder of the test's own
    let dir = tempfile::tempdir().expect("a temporary folder");
    let server = TestRedis::spawn_with(&format!(
        "--maxmemory 64mb --maxmemory-policy noeviction --appendonly yes --dir '{}'",
        dir.path().display()
    ));
    runtime().block_on(async {
        let store = RedisStore::new(server.url.as_str()).expect("store");
        decide_until_checked(&Limiter::new(store, monthly()), &server, 0).await;
    });
    assert_eq!(config_calls(&server), 4);
    assert!(events.warnings().is_empty(), "{:?}", events.warnings());
}

#[test]
fn a_server_without_config_is_not_warned_about() {
    let events = Events::capture();
    let server = TestRedis::spawn_with(
        "--maxmemory 64mb --maxmemory-policy allkeys-lru --rename-command CONFIG ''",
    );
    runtime().block_on(async {
        let store = RedisStore::new(server.url.as_str()).expect("store");
        let limiter = Limiter::new(store, monthly());
        limiter.check("acme", 1).await.expect("decision");
        tokio::time::sleep(Duration::from_millis(300)).await;
        limiter.check("acme", 1).await.expect("decision");
    });
    assert!(events.warnings().is_empty(), "{:?}", events.warnings());
    let debug = events.ours();
    assert!(
        debug
            .iter()
            .any(|(_, text)| text.contains("could not read the Redis configuration")),
        "{debug:?}"
    );
}
