//! The store on a real Redis Cluster of three primaries and three replicas,
//! started by the tests: keys spread over every primary, decisions across
//! slots all or nothing, resharding and a primary's failover under load.
//!
//! The conformance tables run on a cluster too (tests/conformance.rs).
//! Deadlines detect hangs and are generous; measured figures are printed.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderName, Request, StatusCode};
use axum::routing::post;
use axum::Router;
use common::cluster::{key_slot, TestCluster};
use common::{decides, unique_prefix, PATIENT};
use tower::ServiceExt;
use tower_ratelimit::key::Header;
use tower_ratelimit::layer::RateLimitLayer;
use tower_ratelimit::{Limit, Limiter, Quota, RedisStore};

/// The tests with a cluster and load of their own run one at a time: two
/// at once on a small machine would measure the machine.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn store(cluster: &TestCluster, prefix: &str) -> RedisStore {
    RedisStore::cluster_builder(cluster.seed_urls())
        .prefix(prefix)
        .build()
        .expect("a cluster store")
}

fn per_minute(name: &str, n: u64) -> Limit {
    Limit::new(name, Quota::per_minute(n).sliding_log()).expect("limit")
}

/// Two keys whose state lives in different slots.
fn keys_in_two_slots(a: &str) -> (String, String) {
    let slot = key_slot(format!("{{{a}}}"));
    let other = (0..)
        .map(|i| format!("phone-{i}"))
        .find(|k| key_slot(format!("{{{k}}}")) != slot)
        .expect("another slot");
    (a.to_owned(), other)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_spread_over_every_primary_and_decide_as_on_one_server() {
    let cluster = common::cluster::shared();
    let prefix = unique_prefix("spread");
    let limiter = Limiter::builder(store(cluster, &prefix))
        .limit(per_minute("l", 2))
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter");
    for i in 0..300 {
        let key = format!("user-{i}");
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
        assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
    }
    for primary in cluster.primaries() {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query(&mut cluster.connection(primary))
            .expect("KEYS");
        assert!(
            keys.len() > 50,
            "{primary:?} holds {} of the 300 users' keys",
            keys.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_across_slots_is_all_or_nothing() {
    let cluster = common::cluster::shared();
    let prefix = unique_prefix("across");
    let (ip, phone) = keys_in_two_slots("198.51.100.7");
    let limits = [per_minute("per-ip", 100), per_minute("per-phone", 3)];
    let limiter = Limiter::builder(store(cluster, &prefix))
        .limit(limits[0].clone())
        .limit(limits[1].clone())
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter");
    // 50 at once: exactly 3 pass (the phone's limit) ...
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (limiter, ip, phone) = (limiter.clone(), ip.clone(), phone.clone());
            tokio::spawn(async move {
                limiter
                    .decide(&[ip, phone], 1, Duration::ZERO)
                    .await
                    .expect("a decision")
                    .is_allowed()
            })
        })
        .collect();
    let mut granted = 0;
    for task in tasks {
        granted += usize::from(task.await.expect("task"));
    }
    assert_eq!(granted, 3);
    // ... and the refused ones gave back what the IP's slot granted them
    let ip_alone = Limiter::builder(store(cluster, &prefix))
        .limit(limits[0].clone())
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter");
    let peek = ip_alone.peek(&ip, 1).await.expect("peek");
    assert_eq!(peek.remaining(), 97, "the IP counted only the 3 grants");
    // a refusal reports the refused limit, and the other one as it stands
    let refused = limiter
        .decide(&[ip.as_str(), phone.as_str()], 1, Duration::ZERO)
        .await
        .expect("decision");
    assert!(!refused.is_allowed());
    let statuses = refused.statuses();
    assert!(!statuses[0].is_violated() && statuses[1].is_violated());
    assert_eq!(statuses[0].remaining(), 97);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_decides_limits_keyed_in_different_slots_together() {
    let cluster = common::cluster::shared();
    let prefix = unique_prefix("layer");
    let layer = RateLimitLayer::builder()
        .store(store(cluster, &prefix))
        .limit(
            per_minute("per-client", 100),
            Header::new(HeaderName::from_static("x-client")),
        )
        .limit(
            per_minute("per-phone", 3),
            Header::new(HeaderName::from_static("x-phone")),
        )
        .timeout(PATIENT)
        .build()
        .expect("layer");
    let app = Router::new()
        .route("/sms", post(|| async { StatusCode::ACCEPTED }))
        .layer(layer);
    let (client, phone) = keys_in_two_slots("client-1");
    let send = |client: &str, phone: &str| {
        let request = Request::post("/sms")
            .header("x-client", client)
            .header("x-phone", phone)
            .body(Body::empty())
            .expect("request");
        let app = app.clone();
        async move { app.oneshot(request).await.expect("response").status() }
    };
    for _ in 0..3 {
        assert_eq!(send(&client, &phone).await, StatusCode::ACCEPTED);
    }
    for _ in 0..5 {
        assert_eq!(send(&client, &phone).await, StatusCode::TOO_MANY_REQUESTS);
    }
    // the client's own budget lost nothing to the refusals
    let (_, other_phone) = keys_in_two_slots(&phone);
    let other_phone = format!("{other_phone}-b");
    for _ in 0..3 {
        assert_eq!(send(&client, &other_phone).await, StatusCode::ACCEPTED);
    }
    let ip_alone = Limiter::builder(store(cluster, &prefix))
        .limit(per_minute("per-client", 100))
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter");
    assert_eq!(ip_alone.peek(&client, 1).await.unwrap().remaining(), 94);
}

/// Requests on `keys` from a few tasks until stopped: (granted, refused,
/// errors, slowest call).
struct Traffic {
    stop: Arc<AtomicBool>,
    granted: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    slowest_us: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Traffic {
    fn start(limiter: &Limiter, keys: Vec<String>, tasks: usize) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let counters: [Arc<AtomicU64>; 4] = Default::default();
        let started = Instant::now();
        let handles = (0..tasks)
            .map(|t| {
                let limiter = limiter.clone();
                let keys = keys.clone();
                let stop = stop.clone();
                let [granted, refused, errors, slowest] = counters.clone();
                tokio::spawn(async move {
                    let mut n = t;
                    while !stop.load(Ordering::Relaxed)
                        && started.elapsed() < Duration::from_secs(60)
                    {
                        n += 1;
                        let at = Instant::now();
                        let result = limiter.check(&keys[n % keys.len()], 1).await;
                        slowest.fetch_max(at.elapsed().as_micros() as u64, Ordering::Relaxed);
                        match &result {
                            Ok(d) if d.is_allowed() => {
                                granted.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(_) => {
                                refused.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                if errors.fetch_add(1, Ordering::Relaxed) % 50 == 0 {
                                    eprintln!("error: {e}");
                                }
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                })
            })
            .collect();
        let [granted, refused, errors, slowest_us] = counters;
        Traffic {
            stop,
            granted,
            refused,
            errors,
            slowest_us,
            tasks: handles,
        }
    }

    async fn stop(self) -> (u64, u64, u64, Duration) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("traffic task");
        }
        (
            self.granted.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            Duration::from_micros(self.slowest_us.load(Ordering::Relaxed)),
        )
    }
}

fn load_limiter(cluster: &TestCluster, prefix: &str, limit: Limit) -> Limiter {
    Limiter::builder(store(cluster, prefix))
        .limit(limit)
        // the production default
        .timeout(Duration::from_millis(100))
        .cache_denials(false)
        .build()
        .expect("limiter")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_resharded_under_load_keeps_its_state_and_its_decisions() {
    let _alone = HEAVY.lock().await;
    let cluster = Arc::new(TestCluster::start());
    let prefix = unique_prefix("reshard");
    // a tight limit on one key, and traffic on keys of every primary
    let limit = Limit::new("l", Quota::per_minute(400).sliding_log()).unwrap();
    let limiter = load_limiter(&cluster, &prefix, limit);
    let hot = "hot-key".to_owned();
    let mut keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
    keys.push(hot.clone());
    decides(&limiter, &hot, Duration::from_secs(10)).await;
    let traffic = Traffic::start(&limiter, keys, 6);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let slot = key_slot(format!("{{{hot}}}"));
    let from = cluster.primary_for_slot(slot);
    let to = cluster
        .primaries()
        .into_iter()
        .find(|p| *p != from)
        .expect("another primary");
    let moving = cluster.clone();
    tokio::task::spawn_blocking(move || moving.migrate_slot(slot, from, to))
        .await
        .expect("migration");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (granted, refused, errors, slowest) = traffic.stop().await;
    eprintln!(
        "resharding: {granted} granted, {refused} refused, {errors} errors, slowest {slowest:?}"
    );
    assert!(
        slowest < Duration::from_millis(1100),
        "a call hung: {slowest:?}"
    );
    assert_eq!(cluster.primary_for_slot(slot), to);
    // the state moved with the slot: the hot key's log continues there
    let patient = Limiter::builder(store(&cluster, &prefix))
        .limit(Limit::new("l", Quota::per_minute(400).sliding_log()).unwrap())
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .unwrap();
    let left = patient.peek(&hot, 1).await.expect("peek").remaining();
    assert!(
        left < 400,
        "the hot key's grants survived the move ({left} left)"
    );
    let mut on_target: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:{{{hot}}}:*"))
        .query(&mut cluster.connection(to))
        .expect("KEYS");
    on_target.sort();
    assert!(!on_target.is_empty(), "the hot key's state lives on {to:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_under_load_recovers_after_the_promotion() {
    let _alone = HEAVY.lock().await;
    let cluster = Arc::new(TestCluster::start());
    let prefix = unique_prefix("failover");
    let limit = Limit::new(
        "l",
        Quota::per_minute(1_000_000).allow_burst(1_000_000).gcra(),
    )
    .unwrap();
    let limiter = load_limiter(&cluster, &prefix, limit);
    let victim_key = "victim".to_owned();
    let keys: Vec<String> = (0..30)
        .map(|i| format!("k{i}"))
        .chain([victim_key.clone()])
        .collect();
    decides(&limiter, &victim_key, Duration::from_secs(10)).await;
    let traffic = Traffic::start(&limiter, keys, 6);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let victim = cluster.primary_for_key(format!("{{{victim_key}}}"));
    cluster.kill(victim);
    let watching = cluster.clone();
    let promoted = tokio::task::spawn_blocking(move || watching.wait_for_failover(victim))
        .await
        .expect("failover");
    let promoted_at = Instant::now();
    let recovered = decides(&limiter, &victim_key, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (granted, refused, errors, slowest) = traffic.stop().await;
    eprintln!(
        "failover to {promoted:?}: decisions for the victim's slot {recovered:?} after the \
         promotion was seen ({:?} since); {granted} granted, {refused} refused, {errors} errors, \
         slowest {slowest:?}",
        promoted_at.elapsed()
    );
    assert!(
        slowest < Duration::from_millis(1100),
        "a call hung: {slowest:?}"
    );
    assert!(
        errors > 0,
        "the dead primary's slots failed until the promotion"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_without_the_library_gets_it_loaded_again() {
    let cluster = common::cluster::shared();
    let prefix = unique_prefix("flushed");
    let limiter = Limiter::builder(store(cluster, &prefix))
        .limit(per_minute("l", 1000))
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter");
    let keys: Vec<String> = (0..60).map(|i| format!("user-{i}")).collect();
    for key in &keys {
        assert!(limiter.check(key, 1).await.unwrap().is_allowed());
    }
    // as on a new primary, or one whose functions an operator flushed
    for primary in cluster.primaries() {
        let _: () = redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query(&mut cluster.connection(primary))
            .expect("FUNCTION FLUSH");
    }
    for key in &keys {
        let decision = limiter
            .check(key, 1)
            .await
            .expect("decides after the flush");
        assert_eq!(decision.remaining(), 998, "{key}: the state survived");
    }
    for primary in cluster.primaries() {
        let libraries: Vec<redis::Value> = redis::cmd("FUNCTION")
            .arg("LIST")
            .query(&mut cluster.connection(primary))
            .expect("FUNCTION LIST");
        assert_eq!(libraries.len(), 1, "{primary:?} has the library again");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_quota_reaches_every_slot_and_an_override_its_key() {
    let cluster = common::cluster::shared();
    let prefix = unique_prefix("stored");
    let limit = Limit::new("reports", Quota::per_hour(2).fixed_window())
        .expect("limit")
        .use_stored_quota();
    let instance = || {
        Limiter::builder(store(cluster, &prefix))
            .limit(limit.clone())
            .timeout(PATIENT)
            .build()
            .expect("limiter")
    };
    let (a, b) = (instance(), instance());
    a.admin()
        .set_stored_quota("reports", Quota::per_hour(5).fixed_window())
        .await
        .expect("copied to every slot");
    // keys spread over every primary, each read in its own slot
    let mut slots = std::collections::BTreeSet::new();
    for i in 0..200 {
        let key = format!("tenant-{i}");
        slots.insert(key_slot(format!("{{{key}}}")));
        let d = b.check(&key, 1).await.expect("decides");
        assert_eq!((d.capacity(), d.remaining()), (5, 4), "{key}");
    }
    assert!(slots.len() > 150, "keys in {} slots", slots.len());
    // a decision over two slots reads each slot's copy
    let (x, y) = keys_in_two_slots("pair");
    let both = Limiter::builder(store(cluster, &prefix))
        .limit(limit.clone())
        .limit(
            Limit::new("reports-b", Quota::per_hour(3).fixed_window())
                .expect("limit")
                .use_stored_quota(),
        )
        .timeout(PATIENT)
        .build()
        .expect("limiter");
    let d = both
        .decide(&[&x, &y], 1, Duration::ZERO)
        .await
        .expect("decides");
    let caps: Vec<u64> = d.statuses().iter().map(|s| s.capacity()).collect();
    assert_eq!(caps, [5, 3]);

    b.admin()
        .set_override(
            "reports",
            "tenant-7",
            Quota::per_hour(50).fixed_window(),
            None,
        )
        .await
        .expect("override");
    assert_eq!(
        a.check("tenant-7", 1).await.expect("decides").capacity(),
        50
    );
    assert_eq!(a.check("tenant-8", 1).await.expect("decides").capacity(), 5);
    assert!(a
        .admin()
        .remove_stored_quota("reports")
        .await
        .expect("removed everywhere"));
    for i in 0..50 {
        let d = b.check(format!("tenant-{i}"), 0).await.expect("decides");
        assert_eq!(d.capacity(), if i == 7 { 50 } else { 2 }, "tenant-{i}");
    }
}

/// A concurrency limit keyed by user and a token budget keyed by tenant,
/// in different slots: leases exact and renewed on every primary, the
/// permit held until the response ends and given back in its own slot, the
/// tokens of the response charged in theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_and_charges_across_slots() {
    let cluster = common::cluster::shared();
    let prefix = unique_prefix("leases");
    let running = Limit::concurrency("running", 2, Duration::from_millis(600)).expect("limit");
    let tokens = Limit::new("tokens", Quota::per_hour(10).fixed_window()).expect("limit");
    let instance = || {
        Limiter::builder(store(cluster, &prefix))
            .limit(running.clone())
            .timeout(PATIENT)
            .build()
            .expect("limiter")
    };
    let (a, b) = (instance(), instance());
    let mut slots = std::collections::BTreeSet::new();
    let mut held = Vec::new();
    for i in 0..30 {
        let key = format!("user-{i}");
        slots.insert(key_slot(format!("{{{key}}}")));
        held.push(a.acquire_lease(&key).await.expect("acquire"));
        held.push(b.acquire_lease(&key).await.expect("acquire"));
        assert!(
            !a.acquire_lease(&key).await.expect("acquire").is_held(),
            "{key}"
        );
    }
    assert!(slots.len() > 20, "keys in {} slots", slots.len());
    assert!(held.iter().all(|l| l.is_held()));
    // held past two lease times: renewed on every primary
    tokio::time::sleep(Duration::from_millis(1300)).await;
    for i in 0..30 {
        let key = format!("user-{i}");
        assert!(
            !b.acquire_lease(&key).await.expect("acquire").is_held(),
            "{key}"
        );
    }
    assert!(held.iter().all(|l| l.is_held() && !l.is_lost()));
    for lease in held {
        assert!(lease.release().await.expect("release"));
    }
    assert!(a.acquire_lease("user-3").await.expect("acquire").is_held());

    // the layer: two rules in two slots
    let (user, tenant) = keys_in_two_slots("user-x");
    let layer = RateLimitLayer::builder()
        .store(store(cluster, &prefix))
        .rule(tower_ratelimit::layer::Rule::new(
            running.clone(),
            Header::new(HeaderName::from_static("x-user")),
        ))
        .rule(
            tower_ratelimit::layer::Rule::new(
                tokens.clone(),
                Header::new(HeaderName::from_static("x-tenant")),
            )
            .cost_from_response_header(HeaderName::from_static("x-tokens-used")),
        )
        .timeout(PATIENT)
        .build()
        .expect("layer");
    let app = Router::new()
        .route(
            "/complete",
            post(|| async { ([("x-tokens-used", "4")], "done") }),
        )
        .layer(layer);
    let send = |user: &str, tenant: &str| {
        let request = Request::post("/complete")
            .header("x-user", user)
            .header("x-tenant", tenant)
            .body(Body::empty())
            .expect("request");
        let app = app.clone();
        async move {
            let response = app.oneshot(request).await.expect("response");
            let status = response.status();
            drop(response); // the body ends: the permit goes back, the tokens are charged
            status
        }
    };
    let budget = Limiter::builder(store(cluster, &prefix))
        .limit(tokens.clone())
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter");
    for left in [6, 2] {
        assert_eq!(send(&user, &tenant).await, StatusCode::OK);
        let until = Instant::now() + PATIENT;
        while budget.peek(&tenant, 1).await.expect("peek").remaining() != left {
            assert!(Instant::now() < until, "the tokens were not charged");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // the user's permits came back each time (each on a task of its own):
    // two fit at once, not three
    let x = common::wait_until_held(&a, &user).await;
    let y = common::wait_until_held(&b, &user).await;
    assert!(x.is_held() && y.is_held());
    assert!(!a.acquire_lease(&user).await.expect("acquire").is_held());
}

/// A hot key on a cluster: 1000 decisions at once on one key, coalesced in
/// its slot into fewer calls than decisions, exactly the quota granted;
/// keys in other slots decided beside it, each exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_keys_decisions_coalesce_in_its_slot_and_stay_exact() {
    let cluster = common::cluster::shared();
    let prefix = unique_prefix("hot");
    let limiter = Limiter::builder(store(cluster, &prefix))
        .limit(Limit::new("hot", Quota::per_hour(300).fixed_window()).expect("limit"))
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter");
    let fcalls = || -> u64 {
        cluster
            .all_nodes()
            .into_iter()
            .map(|node| common::command_calls(&mut cluster.connection(node), "fcall"))
            .sum()
    };
    for key in ["warm-a", "warm-b"] {
        limiter.peek(key, 1).await.expect("the library is loaded");
    }
    let before = fcalls();
    let (hot, other) = keys_in_two_slots("hot-key");
    let tasks: Vec<_> = (0..1000)
        .map(|i| {
            let limiter = limiter.clone();
            let key = if i % 10 == 0 {
                other.clone()
            } else {
                hot.clone()
            };
            tokio::spawn(async move {
                let decision = limiter.check(&key, 1).await;
                (key, decision)
            })
        })
        .collect();
    let (mut hot_granted, mut other_granted) = (0, 0);
    for task in tasks {
        let (key, decision) = task.await.expect("task");
        if decision.expect("decided").is_allowed() {
            if key == hot {
                hot_granted += 1;
            } else {
                other_granted += 1;
            }
        }
    }
    assert_eq!(
        (hot_granted, other_granted),
        (300, 100),
        "exact in each slot"
    );
    let calls = fcalls() - before;
    assert!(
        calls < 1000,
        "{calls} calls for 1000 decisions: none coalesced"
    );
    println!("1000 decisions on two slots in {calls} calls");
}

/// A hot key marked so (`Limit::with_hot_key`) on a cluster: two instances serve it
/// from batches, exactly the quota granted, and once the batches' holds
/// end the key's slot counts exactly what was granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_in_batches_on_a_cluster_grants_the_quota_and_gives_back_the_rest() {
    let cluster = common::cluster::shared();
    let prefix = unique_prefix("hot-batches");
    let hot = Limit::new("global", Quota::per_hour(500).fixed_window())
        .and_then(|l| {
            l.with_hot_key(tower_ratelimit::HotKey::new(
                40,
                Duration::from_millis(300),
            )?)
        })
        .expect("a hot limit");
    let instance = || {
        Limiter::builder(store(cluster, &prefix))
            .limit(hot.clone())
            .timeout(PATIENT)
            .build()
            .expect("limiter")
    };
    let (a, b) = (instance(), instance());
    let mut granted = 0;
    for i in 0..300 {
        let limiter = if i % 2 == 0 { &a } else { &b };
        granted += u64::from(limiter.check("all", 1).await.expect("decided").is_allowed());
    }
    assert_eq!(granted, 300);
    let observer = instance();
    let deadline = Instant::now() + PATIENT;
    while observer.peek("all", 1).await.expect("a look").remaining() != 200 {
        assert!(Instant::now() < deadline, "unused permits never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..400 {
        granted += u64::from(a.check("all", 1).await.expect("decided").is_allowed());
    }
    assert_eq!(granted, 500, "the quota, no more");
}

/// An empty key never reaches the cluster: `check("")` is
/// `Error::EmptyKey` at once, and the decisions of a key in the slot the
/// store took an empty key's for, made at the same time (coalesced per
/// slot), are all decided. Before, the empty key's two sliding-log keys
/// (`{}` is no hash tag) went out in the slot's batch and failed it with
/// `CROSSSLOT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_key_never_reaches_the_cluster() {
    let cluster = common::cluster::shared();
    let prefix = unique_prefix("empty-key");
    let limiter = Limiter::builder(store(cluster, &prefix))
        .limit(per_minute("l", 1000))
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter");
    // a key in slot 0: the store took an empty key's `{}` for a tag of
    // nothing (CRC 0), where Redis hashes each whole key
    let slot = 0;
    let key = (0..)
        .map(|i| format!("k-{i}"))
        .find(|k| key_slot(format!("{{{k}}}")) == slot)
        .expect("a key in that slot");
    let keyed = (0..100).map(|_| limiter.check(&key, 1));
    let empty = (0..5).map(|_| limiter.check("", 1));
    let (keyed, empty) = tokio::join!(
        futures::future::join_all(keyed),
        futures::future::join_all(empty)
    );
    for decision in keyed {
        assert!(decision.expect("decided").is_allowed());
    }
    for decision in empty {
        assert!(
            matches!(decision, Err(tower_ratelimit::Error::EmptyKey)),
            "{decision:?}"
        );
    }
}
