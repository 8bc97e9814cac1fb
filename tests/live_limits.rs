//! Limits changed while they are in use (`LiveLimit`, `LiveLimits`): the
//! next decision of every limiter and route follows, state carries over as
//! in a rolling deploy, a swap under load admits no more than the older or
//! the newer quota alone would, and a value a running layer could not use
//! is refused.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use axum::Router;
use common::{patient_limiter, redis_store_with_clock, unique_prefix, PATIENT, T0};
use tower::ServiceExt;
use tower_ratelimit::key::{Global, Header};
use tower_ratelimit::layer::{MissingKey, RateLimitLayer, Rule};
use tower_ratelimit::{
    ConfigError, Limit, Limiter, LiveLimit, LiveLimits, ManualClock, MemoryStore, Quota,
    RedisStore, Store,
};

const HOUR: Duration = Duration::from_secs(3600);

fn per_hour(name: &str, n: u64) -> Limit {
    Limit::new(name, Quota::rate(n, HOUR).fixed_window()).expect("valid limit")
}

fn log_per_hour(name: &str, n: u64) -> Limit {
    Limit::new(name, Quota::rate(n, HOUR).sliding_log()).expect("valid limit")
}

/// A store by name.
type Named = (&'static str, Arc<dyn StoreOf>);

/// The two stores on one test clock.
fn stores(test: &str) -> (ManualClock, Vec<Named>) {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix(test);
    let memory = MemoryStore::with_clock(clock.clone());
    let redis = redis_store_with_clock(&prefix, &clock);
    (
        clock,
        vec![("memory", Arc::new(memory)), ("redis", Arc::new(redis))],
    )
}

/// A store that can be given to another limiter (a clone of it).
trait StoreOf: Send + Sync {
    fn limiter(&self, limit: &LiveLimit) -> Limiter;
}

impl<S: Into<Store> + Clone + Send + Sync> StoreOf for S {
    fn limiter(&self, limit: &LiveLimit) -> Limiter {
        patient_limiter(self.clone(), limit.clone())
    }
}

#[tokio::test]
async fn a_new_value_decides_the_next_check_and_keeps_what_was_used() {
    let (_clock, stores) = stores("live-next");
    for (store, s) in stores {
        let live = LiveLimit::new(per_hour("exports", 2));
        // two limiters (two services of one process) share the handle
        let (a, b) = (s.limiter(&live), s.limiter(&live));
        assert!(a.check("acme", 2).await.expect("decides").is_allowed());
        assert!(!b.check("acme", 1).await.expect("decides").is_allowed());

        live.set(per_hour("exports", 5)).expect("same name");
        let d = b.check("acme", 1).await.expect("decides");
        assert!(d.is_allowed(), "{store}: raised to 5, 2 used");
        assert_eq!((d.capacity(), d.remaining()), (5, 2), "{store}");
        assert_eq!(a.limits()[0].capacity(), 5, "{store}");

        live.set(per_hour("exports", 3)).expect("same name");
        let d = a.check("acme", 1).await.expect("decides");
        assert!(!d.is_allowed(), "{store}: lowered to 3, 3 used");
        assert_eq!(d.capacity(), 3, "{store}");
    }
}

#[tokio::test]
async fn a_value_of_another_name_is_refused_and_changes_nothing() {
    let live = LiveLimit::new(per_hour("exports", 2));
    let limiter = Limiter::new(MemoryStore::new(), live.clone());
    assert!(matches!(
        live.set(per_hour("imports", 9)),
        Err(ConfigError::Live(_))
    ));
    assert_eq!(limiter.check("k", 3).await.expect("decides").capacity(), 2);
}

/// Quotas alternating between two values while tasks check one key: the
/// grants within one window never exceed the larger quota, the bound a
/// rolling deploy has, and reach it once the larger one stays.
async fn swapping_under_load_admits_at_most_the_larger(limiters: Vec<Limiter>, live: LiveLimit) {
    let (small, large) = (30, 50);
    let name = live.get().name().to_owned();
    let algorithm = live.get().quota().algorithm();
    let quota = move |n: u64| match algorithm {
        tower_ratelimit::Algorithm::SlidingLog => log_per_hour(&name, n),
        _ => per_hour(&name, n),
    };
    let granted = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (live, stop, quota) = (live.clone(), stop.clone(), quota.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Acquire) && n < 400 {
                let q = if n.is_multiple_of(2) { small } else { large };
                live.set(quota(q)).expect("same name");
                n += 1;
                tokio::time::sleep(Duration::from_micros(300)).await;
            }
        })
    };
    let mut tasks = Vec::new();
    let live_limiters = limiters.clone();
    for (i, limiter) in limiters.into_iter().enumerate() {
        for _ in 0..4 {
            let (limiter, granted) = (limiter.clone(), granted.clone());
            tasks.push(tokio::spawn(async move {
                let mut seen = Vec::new();
                for _ in 0..40 {
                    let d = limiter.check("k", 1).await.expect("decides");
                    if d.is_allowed() {
                        granted.fetch_add(1, Ordering::Relaxed);
                    }
                    seen.push(d.capacity());
                    if i % 2 == 0 {
                        tokio::time::sleep(Duration::from_micros(200)).await;
                    } else {
                        tokio::task::yield_now().await;
                    }
                }
                seen
            }));
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for task in tasks {
        seen.extend(task.await.expect("task"));
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        [small, large],
        "the decisions saw both quotas"
    );
    stop.store(true, Ordering::Release);
    swapper.await.expect("swapper");
    let during = granted.load(Ordering::Relaxed);
    assert!(
        during <= large,
        "{during} granted while the quota moved between {small} and {large}"
    );
    assert!(
        during >= small,
        "{during} granted: the smaller quota alone grants {small}"
    );
    // the larger quota, kept, fills up to exactly itself
    live.set(quota(large)).expect("same name");
    let mut more = 0;
    while limiters_check(&live_limiters, &mut more).await {}
    assert_eq!(during + more, large, "{during} + {more}");
}

/// Checks once on the first limiter: whether it granted (counted in `more`).
async fn limiters_check(limiters: &[Limiter], more: &mut u64) -> bool {
    let granted = limiters[0]
        .check("k", 1)
        .await
        .expect("decides")
        .is_allowed();
    if granted {
        *more += 1;
    }
    granted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_under_concurrent_load_never_over_admits() {
    for make in [per_hour as fn(&str, u64) -> Limit, log_per_hour] {
        // memory: two limiters over one store (two services of a process)
        let live = LiveLimit::new(make("swap", 30));
        let memory = MemoryStore::new();
        let limiters = vec![
            patient_limiter(memory.clone(), live.clone()),
            patient_limiter(memory.clone(), live.clone()),
        ];
        swapping_under_load_admits_at_most_the_larger(limiters, live).await;

        // redis: two stores (two instances), one handle each would be one
        // per process; one handle here swaps both at once
        let prefix = unique_prefix("live-swap");
        let live = LiveLimit::new(make("swap", 30));
        let limiters = vec![
            patient_limiter(common::redis_store(&prefix), live.clone()),
            patient_limiter(common::redis_store(&prefix), live.clone()),
        ];
        swapping_under_load_admits_at_most_the_larger(limiters, live).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_with_their_own_handles_stay_within_the_larger_quota() {
    // A fleet changing its limit one instance at a time: one instance on
    // the old quota, the other on the new, both deciding one key.
    let prefix = unique_prefix("live-fleet");
    let (old, new) = (
        LiveLimit::new(per_hour("f", 10)),
        LiveLimit::new(per_hour("f", 10)),
    );
    let a = patient_limiter(common::redis_store(&prefix), old.clone());
    let b = patient_limiter(common::redis_store(&prefix), new.clone());
    new.set(per_hour("f", 25)).expect("same name");
    let mut granted = 0;
    for i in 0..60 {
        let limiter = if i % 2 == 0 { &a } else { &b };
        if limiter.check("k", 1).await.expect("decides").is_allowed() {
            granted += 1;
        }
    }
    assert_eq!(
        granted, 25,
        "the newer quota bounds both once the older is full"
    );
    old.set(per_hour("f", 25)).expect("same name");
    assert!(!a.check("k", 1).await.expect("decides").is_allowed());
}

async fn get_status(app: &Router, path: &str, headers: &[(&str, &str)]) -> (StatusCode, String) {
    let mut request = Request::get(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).expect("request"))
        .await
        .expect("infallible");
    let policy = response
        .headers()
        .get("ratelimit-policy")
        .map(|v| v.to_str().expect("ascii").to_owned())
        .unwrap_or_default();
    (response.status(), policy)
}

#[tokio::test]
async fn every_route_that_uses_a_live_limit_follows_it() {
    let limits = LiveLimits::new([per_hour("api", 2), per_hour("reports", 1)]).expect("distinct");
    let api = limits.get("api").expect("api");
    let reports = limits.get("reports").expect("reports");
    let store = MemoryStore::new();
    let layer = |rules: Vec<Rule>| {
        rules
            .into_iter()
            .fold(RateLimitLayer::builder().store(store.clone()), |b, r| {
                b.rule(r)
            })
            .build()
            .expect("layer")
    };
    let app = Router::new()
        .route(
            "/a",
            get(|| async { "a" }).layer(layer(vec![Rule::new(&api, Global)])),
        )
        .route(
            "/b",
            get(|| async { "b" }).layer(layer(vec![
                Rule::new(&api, Global),
                Rule::new(&reports, Global),
            ])),
        );
    assert_eq!(
        get_status(&app, "/a", &[]).await,
        (StatusCode::OK, "\"api\";q=2;w=3600".into())
    );
    assert_eq!(get_status(&app, "/a", &[]).await.0, StatusCode::OK);
    assert_eq!(
        get_status(&app, "/b", &[]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );

    let changed = limits
        .update([per_hour("api", 4), per_hour("reports", 1)])
        .expect("a valid set");
    assert_eq!(changed, ["api"]);
    assert_eq!(
        get_status(&app, "/b", &[]).await,
        (
            StatusCode::OK,
            "\"api\";q=4;w=3600, \"reports\";q=1;w=3600".into()
        )
    );
    assert_eq!(
        get_status(&app, "/a", &[]).await,
        (StatusCode::OK, "\"api\";q=4;w=3600".into())
    );
    assert_eq!(
        get_status(&app, "/a", &[]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );

    // a set that misses a limit changes nothing
    assert!(limits.update([per_hour("api", 100)]).is_err());
    assert_eq!(
        get_status(&app, "/a", &[]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn a_value_a_running_layer_cannot_use_is_refused() {
    let live = LiveLimit::new(per_hour("bulk", 10));
    let _layer = RateLimitLayer::builder()
        .rule(Rule::new(&live, Global).cost(5))
        .build()
        .expect("10 holds a cost of 5");
    assert!(matches!(
        live.set(per_hour("bulk", 4)),
        Err(ConfigError::FixedCostExceedsCapacity { cost: 5, .. })
    ));
    assert_eq!(live.get().capacity(), 10);
    live.set(per_hour("bulk", 5)).expect("holds 5");

    // a rule with tiers keeps the algorithm of its tiers
    let tiered = LiveLimit::new(per_hour("plan", 10));
    let _layer = RateLimitLayer::builder()
        .rule(
            Rule::new(&tiered, Global)
                .tier("pro", Quota::rate(100, HOUR).fixed_window())
                .choose_tier(|_| None),
        )
        .build()
        .expect("tiers of the limit's algorithm");
    assert!(matches!(
        tiered.set(log_per_hour("plan", 10)),
        Err(ConfigError::Tiers(_))
    ));
    tiered.set(per_hour("plan", 20)).expect("same algorithm");
    // and a layer whose cost the current value cannot hold is not built
    assert!(RateLimitLayer::builder()
        .rule(Rule::new(&tiered, Global).cost(21))
        .build()
        .is_err());
}

#[tokio::test]
async fn keyless_requests_and_shadow_mode_follow_the_live_value() {
    let live = LiveLimit::new(per_hour("k", 1));
    let app = Router::new().route(
        "/",
        get(|| async { "ok" }).layer(
            RateLimitLayer::builder()
                .rule(
                    Rule::new(
                        &live,
                        Header::new(axum::http::HeaderName::from_static("x-key")),
                    )
                    .on_missing_key(MissingKey::Shared("anonymous".into())),
                )
                .build()
                .expect("layer"),
        ),
    );
    assert_eq!(get_status(&app, "/", &[]).await.0, StatusCode::OK);
    assert_eq!(
        get_status(&app, "/", &[]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    live.set(per_hour("k", 2)).expect("same name");
    // keyless requests share the new quota too
    assert_eq!(get_status(&app, "/", &[]).await.0, StatusCode::OK);
    assert_eq!(
        get_status(&app, "/", &[]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // a keyed client has its own
    assert_eq!(
        get_status(&app, "/", &[("x-key", "a")]).await.0,
        StatusCode::OK
    );
    assert_eq!(
        get_status(&app, "/", &[("x-key", "a")]).await.0,
        StatusCode::OK
    );
    assert_eq!(
        get_status(&app, "/", &[("x-key", "a")]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // shadow mode, switched on and off while the layer runs
    live.set(per_hour("k", 2).shadow()).expect("same name");
    assert_eq!(
        get_status(&app, "/", &[("x-key", "a")]).await.0,
        StatusCode::OK
    );
    live.set(per_hour("k", 2)).expect("same name");
    assert_eq!(
        get_status(&app, "/", &[("x-key", "a")]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn a_limiter_on_redis_follows_its_live_limit() {
    let prefix = unique_prefix("live-fallback");
    let store: RedisStore = common::redis_store(&prefix);
    let live = LiveLimit::new(per_hour("fb", 1));
    let limiter = Limiter::builder(store)
        .limit(&live)
        .timeout(PATIENT)
        .build()
        .expect("limiter");
    assert!(limiter.check("k", 1).await.expect("decides").is_allowed());
    live.set(per_hour("fb", 3)).expect("same name");
    let d = limiter.check("k", 1).await.expect("decides");
    assert!(d.is_allowed() && d.capacity() == 3 && d.remaining() == 1);
}

#[tokio::test]
async fn the_memory_fallback_of_a_layer_follows_its_live_limit() {
    use tower_ratelimit::layer::OnStoreError;
    let mut server = common::TestRedis::spawn();
    let store = RedisStore::builder(&server.url)
        .prefix("live-fallback")
        .build()
        .expect("store");
    let live = LiveLimit::new(per_hour("api", 1));
    let app = Router::new().route(
        "/",
        get(|| async { "ok" }).layer(
            RateLimitLayer::builder()
                .store(store)
                .limit(&live, Global)
                .on_store_error(OnStoreError::FallbackToMemory)
                .timeout(Duration::from_millis(200))
                .build()
                .expect("layer"),
        ),
    );
    server.stop();
    // Redis is down: the fallback decides, with the value in force
    assert_eq!(
        get_status(&app, "/", &[]).await,
        (StatusCode::OK, "\"api\";q=1;w=3600".into())
    );
    assert_eq!(
        get_status(&app, "/", &[]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    live.set(per_hour("api", 3)).expect("same name");
    assert_eq!(
        get_status(&app, "/", &[]).await,
        (StatusCode::OK, "\"api\";q=3;w=3600".into())
    );
    assert_eq!(get_status(&app, "/", &[]).await.0, StatusCode::OK);
    assert_eq!(
        get_status(&app, "/", &[]).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}
