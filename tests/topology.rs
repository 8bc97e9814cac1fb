//! Smoke tests of the topology fixtures of `tests/common/` (cluster,
//! sentinel, TLS, fault proxy), with plain redis-rs: each comes up, and its
//! failures look to a client as the store's tests will rely on.
//!
//! Run with `--nocapture` to see how long each fixture takes to come up.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::{key_slot, Role, TestCluster};
use common::process::{connect, wait_for};
use common::proxy::FaultProxy;
use common::sentinel::TestSentinel;
use common::tls::{trusting, TestCerts, TestTls};
use common::TestRedis;
use redis::AsyncCommands;

/// A bound on any one client call in these tests.
const PATIENT: Duration = Duration::from_secs(20);

async fn bounded<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(PATIENT, call)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {PATIENT:?}"))
}

fn dbsize(conn: &mut redis::Connection) -> u64 {
    redis::cmd("DBSIZE").query(conn).expect("DBSIZE")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_spreads_keys_and_moves_a_slot_under_traffic() {
    let started = Instant::now();
    let cluster = Arc::new(
        tokio::task::spawn_blocking(TestCluster::start)
            .await
            .unwrap(),
    );
    eprintln!(
        "cluster (3 primaries, 3 replicas) up in {:?}",
        started.elapsed()
    );
    let primaries = cluster.primaries();
    assert_eq!(primaries.len(), 3, "{:?}", cluster.nodes());
    assert_eq!(cluster.replicas().len(), 3, "{:?}", cluster.nodes());
    for primary in &primaries {
        assert_eq!(cluster.replicas_of(*primary).len(), 1);
    }

    let client = cluster.client();
    let mut conn = bounded("cluster connection", client.get_async_connection())
        .await
        .expect("a cluster connection");
    for i in 0..300 {
        let _: () = bounded("SET", conn.set(format!("spread-{i}"), i))
            .await
            .expect("SET through the cluster client");
    }
    for primary in &primaries {
        let keys = dbsize(&mut cluster.connection(*primary));
        assert!(keys > 0, "primary {primary:?} holds no key of 300");
    }

    // The fixture's slot function agrees with Redis, hash tags included.
    let mut node = cluster.connection(primaries[0]);
    for key in [
        "spread-7",
        "{user1000}.following",
        "foo{}{bar}",
        "{}x",
        "a{b}c{d}",
    ] {
        let redis_slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut node)
            .expect("CLUSTER KEYSLOT");
        assert_eq!(key_slot(key), redis_slot, "slot of {key}");
    }

    // Move the slot of "spread-7" while a task increments keys in it.
    let key = "spread-7";
    let slot = key_slot(key);
    let from = cluster.primary_for_slot(slot);
    let to = *primaries.iter().find(|p| **p != from).unwrap();
    let counters: Vec<String> = (0..20).map(|i| format!("{{{key}}}:n{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let mut conn = conn.clone();
        let counters = counters.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            let (mut ok, mut failed) = (0u64, Vec::new());
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                let counter = &counters[i % counters.len()];
                match bounded("INCR", conn.incr::<_, _, i64>(counter, 1)).await {
                    Ok(_) => ok += 1,
                    Err(e) => failed.push(e.to_string()),
                }
                i += 1;
            }
            (ok, failed)
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    {
        // Step by step, one key at a time, so the traffic meets the slot
        // half moved (ASK redirections) for a while; then back and forth
        // again in one call.
        let cluster = cluster.clone();
        tokio::task::spawn_blocking(move || {
            cluster.begin_slot_migration(slot, from, to);
            while cluster.migrate_keys(slot, from, to, 1) > 0 {
                std::thread::sleep(Duration::from_millis(10));
            }
            cluster.finish_slot_migration(slot, from, to);
            cluster.migrate_slot(slot, to, from);
            cluster.migrate_slot(slot, from, to);
        })
        .await
        .unwrap();
    }
    eprintln!(
        "slot {slot} moved {from:?} -> {to:?} in {:?}",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::SeqCst);
    let (ok, failed) = traffic.await.unwrap();
    eprintln!("{ok} INCRs during the moves");
    assert!(
        failed.is_empty(),
        "{} INCRs failed during the move: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(ok > 0);

    assert_eq!(cluster.primary_for_slot(slot), to);
    let value: i64 = bounded("GET", conn.get(key))
        .await
        .expect("GET after the move");
    assert_eq!(value, 7);
    let mut total = 0;
    for counter in &counters {
        total += bounded("GET", conn.get::<_, Option<u64>>(counter))
            .await
            .expect("GET a counter")
            .unwrap_or(0);
    }
    assert_eq!(total, ok, "every acknowledged INCR counted once");
    // The keys live on the new primary now.
    let direct: i64 = redis::cmd("GET")
        .arg(key)
        .query(&mut cluster.connection(to))
        .expect("GET on the new primary");
    assert_eq!(direct, 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_promotes_a_replica_when_a_primary_dies() {
    let started = Instant::now();
    let cluster = Arc::new(
        tokio::task::spawn_blocking(TestCluster::start)
            .await
            .unwrap(),
    );
    eprintln!(
        "cluster (3 primaries, 3 replicas) up in {:?}",
        started.elapsed()
    );
    let client = cluster.client();
    let mut conn = bounded("cluster connection", client.get_async_connection())
        .await
        .expect("a cluster connection");
    let key = "survivor";
    let old = cluster.primary_for_key(key);
    let replicas = cluster.replicas_of(old);
    // Written and replicated before the crash.
    let mut direct = cluster.connection(old);
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("kept")
        .query(&mut direct)
        .unwrap();
    let acked: u64 = redis::cmd("WAIT")
        .arg(1)
        .arg(5000)
        .query(&mut direct)
        .unwrap();
    assert_eq!(acked, 1, "the replica acknowledged the write");
    let value: String = bounded("GET", conn.get(key)).await.unwrap();
    assert_eq!(value, "kept");

    cluster.kill(old);
    let started = Instant::now();
    let new = {
        let cluster = cluster.clone();
        tokio::task::spawn_blocking(move || cluster.wait_for_failover(old))
            .await
            .unwrap()
    };
    eprintln!("failover {old:?} -> {new:?} in {:?}", started.elapsed());
    assert!(
        replicas.contains(&new),
        "{new:?} was not a replica of {old:?}"
    );
    assert_eq!(cluster.primary_for_key(key), new);

    // The same cluster connection finds the new primary.
    let value: String = bounded("GET after failover", conn.get(key)).await.unwrap();
    assert_eq!(value, "kept");
    let _: () = bounded("SET after failover", conn.set(key, "again"))
        .await
        .unwrap();

    let started = Instant::now();
    {
        let cluster = cluster.clone();
        tokio::task::spawn_blocking(move || cluster.restart(old))
            .await
            .unwrap();
    }
    eprintln!("{old:?} rejoined in {:?}", started.elapsed());
    let info = cluster.nodes().into_iter().find(|n| n.node == old).unwrap();
    assert_eq!(
        info.role,
        Role::Replica,
        "the old primary rejoins as a replica"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_promotes_the_replica_when_the_master_dies() {
    let started = Instant::now();
    let sentinel = Arc::new(
        tokio::task::spawn_blocking(TestSentinel::start)
            .await
            .unwrap(),
    );
    eprintln!(
        "sentinel (master, replica, 3 sentinels) up in {:?}",
        started.elapsed()
    );
    let (ip, old) = sentinel.master_addr();
    assert_eq!(ip, "127.0.0.1");
    assert_eq!(old, sentinel.data_ports()[0]);

    let mut master = sentinel.connection(old);
    let _: () = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query(&mut master)
        .unwrap();
    let acked: u64 = redis::cmd("WAIT")
        .arg(1)
        .arg(5000)
        .query(&mut master)
        .unwrap();
    assert_eq!(acked, 1);

    // redis-rs's sentinel client finds the master.
    let mut client = redis::sentinel::SentinelClient::build(
        sentinel.sentinel_urls(),
        sentinel.master_name(),
        None,
        redis::sentinel::SentinelServerType::Master,
    )
    .expect("a sentinel client");
    let mut conn = bounded("sentinel connection", client.get_async_connection())
        .await
        .expect("a connection to the master through the sentinels");
    let value: String = bounded("GET", conn.get("k")).await.unwrap();
    assert_eq!(value, "v");

    assert_eq!(sentinel.kill_master(), old);
    let started = Instant::now();
    let new = {
        let sentinel = sentinel.clone();
        tokio::task::spawn_blocking(move || sentinel.wait_for_new_master(old))
            .await
            .unwrap()
    };
    eprintln!(
        "sentinel failover {old} -> {new} in {:?}",
        started.elapsed()
    );
    assert_eq!(new, sentinel.data_ports()[1]);
    assert_eq!(sentinel.master_addr().1, new);

    let mut conn = bounded("sentinel connection", client.get_async_connection())
        .await
        .expect("a connection to the new master through the sentinels");
    let value: String = bounded("GET", conn.get("k")).await.unwrap();
    assert_eq!(value, "v");
    let _: () = bounded("SET", conn.set("k", "w")).await.unwrap();
}

#[tokio::test]
async fn tls_trusts_the_generated_ca_and_nothing_else() {
    let started = Instant::now();
    let tls = tokio::task::spawn_blocking(TestTls::start).await.unwrap();
    eprintln!("TLS redis-server up in {:?}", started.elapsed());
    assert!(tls.ca_path().exists());
    assert!(std::str::from_utf8(tls.ca_pem())
        .unwrap()
        .starts_with("-----BEGIN CERTIFICATE-----"));

    for url in [tls.url(), tls.localhost_url()] {
        let client = tls.client(&url).expect("a client trusting the CA");
        let mut conn = bounded("TLS connection", client.get_multiplexed_async_connection())
            .await
            .unwrap_or_else(|e| panic!("TLS connection to {url}: {e}"));
        let pong: String = bounded("PING", redis::cmd("PING").query_async(&mut conn))
            .await
            .unwrap();
        assert_eq!(pong, "PONG");
    }

    // Another CA, and the system's roots: the certificate is not trusted.
    let stranger = TestCerts::generate();
    let client = trusting(&tls.url(), stranger.ca_cert_pem.as_bytes()).unwrap();
    let err = bounded(
        "TLS with another CA",
        client.get_multiplexed_async_connection(),
    )
    .await
    .expect_err("a server certificate from an unknown CA is refused");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "refused for another reason: {err}"
    );
    let client = redis::Client::open(tls.url()).unwrap();
    let err = bounded(
        "TLS with system roots",
        client.get_multiplexed_async_connection(),
    )
    .await
    .expect_err("the test CA is not among the system's roots");
    eprintln!("without the CA: {err}");
    // Plain TCP to the TLS port gets no Redis answer.
    assert!(connect(&format!("redis://127.0.0.1:{}/", tls.port))
        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
        .is_err());
}

#[test]
fn proxy_forwards_goes_silent_refuses_and_resets() {
    let redis = TestRedis::spawn();
    let started = Instant::now();
    let proxy = FaultProxy::to_port(redis.port);
    eprintln!("proxy up in {:?}", started.elapsed());
    let quick = |conn: &mut redis::Connection| {
        conn.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        redis::cmd("PING").query::<String>(conn)
    };

    let mut old = connect(&proxy.url()).expect("connect through the proxy");
    assert_eq!(quick(&mut old).unwrap(), "PONG");
    assert_eq!(proxy.accepted(), 1);
    assert_eq!(proxy.connections(), 1);

    proxy.go_silent();
    let err = quick(&mut old).expect_err("a silent connection answers nothing");
    assert!(err.is_timeout(), "not a timeout: {err}");
    let mut fresh = connect(&proxy.url()).expect("connect after go_silent");
    assert_eq!(quick(&mut fresh).unwrap(), "PONG");
    assert_eq!(proxy.connections(), 2, "the silent connection stays open");

    proxy.set_silent_all(true);
    // (redis-rs's connect already waits for an answer: CLIENT SETINFO.)
    let hushed = connect(&proxy.url()).and_then(|mut c| quick(&mut c));
    assert!(hushed.is_err(), "a new connection is silent too");
    assert!(
        quick(&mut fresh).is_err(),
        "set_silent_all silences open ones too"
    );
    proxy.set_silent_all(false);
    drop((old, fresh));
    wait_for(
        "the proxy to close the connections its clients closed",
        Duration::from_secs(10),
        || (proxy.connections() == 0).then_some(()),
        || format!("{} open", proxy.connections()),
    );

    proxy.refuse(true);
    let refused = connect(&proxy.url()).and_then(|mut c| quick(&mut c));
    assert!(refused.is_err(), "a refused connection answers nothing");
    proxy.refuse(false);

    let mut a = connect(&proxy.url()).unwrap();
    let mut b = connect(&proxy.url()).unwrap();
    assert_eq!(quick(&mut a).unwrap(), "PONG");
    assert_eq!(quick(&mut b).unwrap(), "PONG");
    proxy.kill_all();
    for conn in [&mut a, &mut b] {
        let err = quick(conn).expect_err("a reset connection");
        assert!(!err.is_timeout(), "a reset, not silence: {err}");
    }
    wait_for(
        "the proxy to forget the reset connections",
        Duration::from_secs(10),
        || (proxy.connections() == 0).then_some(()),
        || format!("{} open", proxy.connections()),
    );
    let mut after = connect(&proxy.url()).unwrap();
    assert_eq!(quick(&mut after).unwrap(), "PONG");
    assert_eq!(proxy.accepted(), 7);
}
