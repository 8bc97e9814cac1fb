//! Overrides and stored quotas where a layer uses the limit: a rule's
//! tiers (`Rule::tier`) and the layer's own admin handle
//! (`RateLimitLayer::admin`). On both stores: two layers of one service
//! over one memory store (one process), and over two Redis stores on one
//! Redis and prefix (two processes).

mod common;

use std::convert::Infallible;
use std::time::Duration;

use common::{unique_prefix, PATIENT};
use http::{Request, Response, StatusCode};
use tower::{Layer, ServiceExt};
use tower_ratelimit::key::Header;
use tower_ratelimit::layer::{RateLimit, RateLimitLayer, Rule};
use tower_ratelimit::{
    ConfigError, Error, Limit, LimitSource, LiveLimit, MemoryStore, Penalty, Quota, Store,
};

const HOUR: Duration = Duration::from_secs(3600);

fn key() -> Header {
    Header::new(http::HeaderName::from_static("x-key"))
}

fn per_hour(n: u64) -> Quota {
    Quota::rate(n, HOUR).fixed_window()
}

/// "reports": 1 per hour per `x-key`, its tier "pro" (`x-plan: pro`) 2.
fn reports(limit: impl Into<LimitSource>) -> Rule {
    Rule::new(limit, key())
        .tier("pro", per_hour(2))
        .choose_tier(|r| {
            let pro = r.headers.get("x-plan").is_some_and(|p| p == "pro");
            pro.then_some("pro")
        })
}

fn stored(n: u64) -> Limit {
    Limit::new("reports", per_hour(n))
        .expect("limit")
        .use_stored_quota()
}

fn layer(store: impl Into<Store>, rule: Rule) -> RateLimitLayer {
    RateLimitLayer::builder()
        .store(store)
        .timeout(PATIENT)
        .rule(rule)
        .build()
        .expect("layer")
}

type Svc = RateLimit<
    tower::util::ServiceFn<
        fn(Request<String>) -> std::future::Ready<Result<Response<String>, Infallible>>,
    >,
>;

fn ok(_: Request<String>) -> std::future::Ready<Result<Response<String>, Infallible>> {
    std::future::ready(Ok(Response::new(String::new())))
}

fn service(layer: &RateLimitLayer) -> Svc {
    let handler: fn(Request<String>) -> _ = ok;
    layer.layer(tower::service_fn(handler))
}

/// The status of a request of `key` in `plan`.
async fn status(svc: &Svc, key: &str, plan: &str) -> StatusCode {
    let request = Request::get("/")
        .header("x-key", key)
        .header("x-plan", plan)
        .body(String::new())
        .expect("request");
    let response = svc.clone().oneshot(request).await.expect("infallible");
    response.status()
}

/// How many requests of `key` in `plan` are let through before the first
/// 429 (at most 20).
async fn admitted(svc: &Svc, key: &str, plan: &str) -> usize {
    for n in 0..20 {
        if status(svc, key, plan).await == StatusCode::TOO_MANY_REQUESTS {
            return n;
        }
    }
    20
}

/// Two layers of one service over each store, made by `make`.
fn instances(
    test: &str,
    make: impl Fn(Store) -> RateLimitLayer,
) -> Vec<(&'static str, [RateLimitLayer; 2])> {
    let memory = MemoryStore::new();
    let prefix = unique_prefix(test);
    vec![
        ("memory", [make(memory.clone().into()), make(memory.into())]),
        (
            "redis",
            [
                make(common::redis_store(&prefix).into()),
                make(common::redis_store(&prefix).into()),
            ],
        ),
    ]
}

#[tokio::test]
async fn an_override_applies_to_its_key_in_every_tier() {
    for (store, [a, b]) in instances("tier-override", |s| layer(s, reports(stored(1)))) {
        let (a_svc, b_svc) = (service(&a), service(&b));
        assert_eq!(
            admitted(&b_svc, "acme", "pro").await,
            2,
            "{store}: the tier's quota"
        );
        a.admin()
            .set_override("reports", "acme", per_hour(5), None)
            .await
            .expect("override");
        // in force for the other instance's next decision, in the tier
        // (what was used still counts) and in the default tier
        assert_eq!(
            admitted(&b_svc, "acme", "pro").await,
            3,
            "{store}: the override"
        );
        assert_eq!(
            admitted(&a_svc, "acme", "free").await,
            0,
            "{store}: one key, one state"
        );
        assert_eq!(
            admitted(&b_svc, "other", "pro").await,
            2,
            "{store}: its key only"
        );
        // removed: the tier's quota again, the state carried over
        assert!(b
            .admin()
            .remove_override("reports", "acme")
            .await
            .expect("remove"));
        b.admin().reset("acme").await.expect("reset");
        assert_eq!(
            admitted(&a_svc, "acme", "pro").await,
            2,
            "{store}: the tier's again"
        );
        // an override lower than the tier's quota lowers it too
        a.admin()
            .set_override("reports", "bob", per_hour(1), None)
            .await
            .expect("override");
        assert_eq!(admitted(&b_svc, "bob", "pro").await, 1, "{store}: lowered");
    }
}

#[tokio::test]
async fn the_stored_quota_is_the_default_tiers() {
    for (store, [a, b]) in instances("tier-stored", |s| layer(s, reports(stored(1)))) {
        a.admin()
            .set_stored_quota("reports", per_hour(4))
            .await
            .expect("set");
        let svc = service(&b);
        assert_eq!(
            admitted(&svc, "acme", "free").await,
            4,
            "{store}: the stored quota"
        );
        assert_eq!(
            admitted(&svc, "bob", "pro").await,
            2,
            "{store}: the tier keeps its own"
        );
        // an override still wins over both
        b.admin()
            .set_override("reports", "carol", per_hour(6), None)
            .await
            .expect("override");
        assert_eq!(admitted(&svc, "carol", "pro").await, 6, "{store}");
        assert_eq!(
            a.admin().stored_quota("reports").await.expect("read"),
            Some(per_hour(4)),
            "{store}"
        );
    }
}

#[tokio::test]
async fn the_layers_admin_refuses_what_would_not_apply() {
    // tiers of a limit that uses no stored quota: nothing to override
    let plain = Limit::new("reports", per_hour(1)).expect("limit");
    let layer = layer(MemoryStore::new(), reports(plain));
    let admin = layer.admin();
    let refused = admin
        .set_override("reports", "acme", per_hour(5), None)
        .await;
    assert!(
        matches!(refused, Err(Error::Config(ConfigError::StoredQuota(_)))),
        "{refused:?}"
    );
    let refused = admin.set_stored_quota("reports", per_hour(5)).await;
    assert!(
        matches!(refused, Err(Error::Config(ConfigError::StoredQuota(_)))),
        "{refused:?}"
    );
    // a limit the layer does not have
    let refused = admin.set_stored_quota("other", per_hour(5)).await;
    assert!(matches!(refused, Err(Error::Config(_))), "{refused:?}");
    // and nothing was applied
    assert_eq!(admitted(&service(&layer), "acme", "pro").await, 2);
}

#[tokio::test]
async fn a_live_limit_with_tiers_keeps_whether_it_uses_a_stored_quota() {
    let live = LiveLimit::new(stored(1));
    let layer = layer(MemoryStore::new(), reports(live.clone()));
    let without = Limit::new("reports", per_hour(3)).expect("limit");
    // its tiers read overrides: a value without them would leave an
    // override the admin accepted applied in the tiers only
    assert!(matches!(live.set(without), Err(ConfigError::Tiers(_))));
    live.set(stored(3)).expect("a value that keeps it");
    layer
        .admin()
        .set_override("reports", "acme", per_hour(5), None)
        .await
        .expect("override");
    let svc = service(&layer);
    assert_eq!(admitted(&svc, "acme", "pro").await, 5);
    assert_eq!(admitted(&svc, "bob", "free").await, 3);

    // and the reverse: tiers built without, a value with one is refused
    let live = LiveLimit::new(Limit::new("plain", per_hour(1)).expect("limit"));
    let _layer = layer_of_plain(live.clone());
    let with = Limit::new("plain", per_hour(1))
        .expect("limit")
        .use_stored_quota();
    assert!(matches!(live.set(with), Err(ConfigError::Tiers(_))));
}

fn layer_of_plain(live: LiveLimit) -> RateLimitLayer {
    let rule = Rule::new(live, key())
        .tier("pro", per_hour(2))
        .choose_tier(|_| Some("pro"));
    layer(MemoryStore::new(), rule)
}

#[tokio::test]
async fn the_layers_admin_blocks_unblocks_resets_and_sets_stored_quotas() {
    let penalty = Penalty::new(100, HOUR, [HOUR]).expect("penalty");
    let make = |s: Store| {
        let api = Limit::new("api", per_hour(2))
            .expect("limit")
            .use_stored_quota()
            .with_penalty(penalty.clone());
        layer(s, Rule::new(api, key()))
    };
    for (store, [a, b]) in instances("layer-admin", make) {
        let svc = service(&b);
        // a block by hand, through one instance's layer, refuses in the other
        a.admin()
            .block("api", "mallory", HOUR)
            .await
            .expect("block");
        assert_eq!(
            status(&svc, "mallory", "free").await,
            StatusCode::TOO_MANY_REQUESTS,
            "{store}"
        );
        let seen = b.admin().inspect("api", "mallory").await.expect("inspect");
        assert!(seen.blocked_for.is_some(), "{store}");
        assert!(
            b.admin().unblock("api", "mallory").await.expect("unblock"),
            "{store}"
        );
        assert_eq!(admitted(&svc, "mallory", "free").await, 2, "{store}");
        // a reset through the layer forgets the key in every limit
        b.admin().reset("mallory").await.expect("reset");
        assert_eq!(admitted(&svc, "mallory", "free").await, 2, "{store}: reset");
        // a stored quota through the layer
        a.admin()
            .set_stored_quota("api", per_hour(3))
            .await
            .expect("set");
        assert_eq!(admitted(&svc, "eve", "free").await, 3, "{store}: stored");
        // the service gives the same handle
        assert_eq!(
            svc.admin().stored_quota("api").await.expect("read"),
            Some(per_hour(3)),
            "{store}"
        );
    }
}

/// Answers with the response header `x-used` the request's `x-use`.
fn tells_use(request: Request<String>) -> std::future::Ready<Result<Response<String>, Infallible>> {
    let mut response = Response::new(String::new());
    if let Some(used) = request.headers().get("x-use") {
        response.headers_mut().insert("x-used", used.clone());
    }
    std::future::ready(Ok(response))
}

/// Waits (at most `PATIENT`) until `limiter` has `remaining` left for
/// `key`: a charge over Redis lands on a task of its own.
async fn settles_to(limiter: &tower_ratelimit::Limiter, key: &str, remaining: u64, store: &str) {
    let until = std::time::Instant::now() + PATIENT;
    loop {
        let now = limiter.peek(key, 1).await.expect("peek").remaining();
        if now == remaining {
            return;
        }
        assert!(
            std::time::Instant::now() < until,
            "{store}: {key} has {now} left, not {remaining}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_charge_after_the_response_is_bounded_by_the_quota_that_decides() {
    let tokens = |n| {
        Limit::new("tokens", per_hour(n))
            .expect("limit")
            .use_stored_quota()
    };
    let prefix = unique_prefix("tier-charge");
    let stores: [(&str, Store); 2] = [
        ("memory", MemoryStore::new().into()),
        ("redis", common::redis_store(&prefix).into()),
    ];
    for (store, on) in stores {
        let rule = Rule::new(tokens(10), key())
            .tier("pro", per_hour(20))
            .choose_tier(|r| {
                let pro = r.headers.get("x-plan").is_some_and(|p| p == "pro");
                pro.then_some("pro")
            })
            .cost_from_response_header(http::HeaderName::from_static("x-used"));
        let layer = layer(on.clone(), rule);
        let handler: fn(Request<String>) -> _ = tells_use;
        let svc = layer.layer(tower::service_fn(handler));
        let peeks = common::limiter_of(on, &[tokens(10)]);
        let used = |key: &'static str, plan: &'static str, used: u64| {
            let request = Request::get("/")
                .header("x-key", key)
                .header("x-plan", plan)
                .header("x-use", used.to_string())
                .body(String::new())
                .expect("request");
            svc.clone().oneshot(request)
        };
        // an override of 1000 in the tier "pro" (20): a response that
        // tells 500 is charged 500, not at most the tier's 20
        let admin = layer.admin();
        admin
            .set_override("tokens", "acme", per_hour(1000), None)
            .await
            .expect("override");
        let response = used("acme", "pro", 500).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::OK, "{store}");
        settles_to(&peeks, "acme", 500, store).await;
        // a stored quota of 1000 in the default tier (10): the same
        admin
            .set_stored_quota("tokens", per_hour(1000))
            .await
            .expect("stored");
        let response = used("globex", "free", 300).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::OK, "{store}");
        settles_to(&peeks, "globex", 700, store).await;
        // an override lowered to 3: spent (a charge is at most one quota)
        admin
            .set_override("tokens", "initech", per_hour(3), None)
            .await
            .expect("override");
        let response = used("initech", "pro", 500).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::OK, "{store}");
        settles_to(&peeks, "initech", 0, store).await;
    }
}
