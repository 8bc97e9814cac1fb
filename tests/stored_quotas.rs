//! Stored quotas (`Limit::use_stored_quota`): set through one
//! limiter, in force for every other's next decision; per-key overrides;
//! removal falls back to the limit's own quota with the state carried over.
//! On both stores (the Redis one as two instances on one Redis).

mod common;
mod events;

use std::time::{Duration, Instant};

use common::{unique_prefix, T0};
use tower_ratelimit::{Error, Limit, Limiter, ManualClock, MemoryStore, Quota, RedisStore};

const HOUR: Duration = Duration::from_secs(3600);

fn reports(n: u64) -> Quota {
    Quota::rate(n, HOUR).fixed_window()
}

fn limit(name: &str, n: u64) -> Limit {
    Limit::new(name, reports(n))
        .expect("valid limit")
        .use_stored_quota()
}

use common::{limiter_of as limiter, two_instances as instances};

#[tokio::test]
async fn a_stored_quota_set_in_one_instance_decides_in_the_other() {
    for (store, a, b) in instances("stored-set", &[limit("reports", 2)]) {
        assert_eq!(
            a.admin().stored_quota("reports").await.expect("read"),
            None,
            "{store}"
        );
        let d = b.check("acme", 1).await.expect("decides");
        assert_eq!(
            (d.capacity(), d.remaining()),
            (2, 1),
            "{store}: its own quota"
        );

        a.admin()
            .set_stored_quota("reports", reports(5))
            .await
            .expect("set");
        assert_eq!(
            b.admin().stored_quota("reports").await.expect("read"),
            Some(reports(5))
        );
        let d = b.check("acme", 1).await.expect("decides");
        assert_eq!(
            (d.capacity(), d.remaining()),
            (5, 3),
            "{store}: the stored quota, 1 used"
        );
        for _ in 0..3 {
            assert!(b.check("acme", 1).await.expect("decides").is_allowed());
        }
        assert!(
            !a.check("acme", 1).await.expect("decides").is_allowed(),
            "{store}"
        );

        // removed: the own quota again, what was used still counts
        assert!(b
            .admin()
            .remove_stored_quota("reports")
            .await
            .expect("remove"));
        assert!(!b
            .admin()
            .remove_stored_quota("reports")
            .await
            .expect("remove"));
        let d = a.check("other", 1).await.expect("decides");
        assert_eq!((d.capacity(), d.remaining()), (2, 1), "{store}");
        assert!(
            !a.check("acme", 1).await.expect("decides").is_allowed(),
            "{store}"
        );
    }
}

#[tokio::test]
async fn set_if_absent_keeps_the_first() {
    for (store, a, b) in instances("stored-nx", &[limit("reports", 2)]) {
        assert!(a
            .admin()
            .set_stored_quota_if_absent("reports", reports(7))
            .await
            .expect("set"));
        assert!(!b
            .admin()
            .set_stored_quota_if_absent("reports", reports(9))
            .await
            .expect("set"));
        assert_eq!(
            b.admin().stored_quota("reports").await.expect("read"),
            Some(reports(7)),
            "{store}"
        );
        assert_eq!(
            b.check("k", 1).await.expect("decides").capacity(),
            7,
            "{store}"
        );
    }
}

#[tokio::test]
async fn an_override_applies_to_its_key_only_and_its_removal_carries_state() {
    for (store, a, b) in instances("stored-override", &[limit("sms", 3)]) {
        a.admin()
            .set_stored_quota("sms", reports(4))
            .await
            .expect("set");
        a.admin()
            .set_override("sms", "+15550100", reports(10), None)
            .await
            .expect("override");
        assert_eq!(
            b.admin()
                .stored_override("sms", "+15550100")
                .await
                .expect("read"),
            Some(reports(10))
        );
        assert_eq!(
            b.admin()
                .stored_override("sms", "+15550199")
                .await
                .expect("read"),
            None
        );
        let d = b.check("+15550100", 6).await.expect("decides");
        assert!(d.is_allowed() && d.capacity() == 10, "{store}: {d:?}");
        let d = b.check("+15550199", 1).await.expect("decides");
        assert_eq!(
            (d.capacity(), d.remaining()),
            (4, 3),
            "{store}: others keep the limit's"
        );

        assert!(a
            .admin()
            .remove_override("sms", "+15550100")
            .await
            .expect("remove"));
        assert!(!a
            .admin()
            .remove_override("sms", "+15550100")
            .await
            .expect("remove"));
        // back to 4, with 6 used: refused
        let d = b.check("+15550100", 1).await.expect("decides");
        assert!(!d.is_allowed() && d.capacity() == 4, "{store}: {d:?}");
    }
}

#[tokio::test]
async fn an_override_with_a_ttl_ends_by_itself() {
    for (store, a, b) in instances("stored-ttl", &[limit("sms", 1)]) {
        a.admin()
            .set_override("sms", "vip", reports(100), Some(Duration::from_millis(200)))
            .await
            .expect("override");
        assert_eq!(
            b.check("vip", 1).await.expect("decides").capacity(),
            100,
            "{store}"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let d = b.check("vip", 0).await.expect("decides");
            if d.capacity() == 1 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{store}: the override never ended"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            b.admin().stored_override("sms", "vip").await.expect("read"),
            None,
            "{store}"
        );
    }
}

#[tokio::test]
async fn several_limits_each_read_their_own_stored_quota() {
    let plain = Limit::new("plain", Quota::rate(50, HOUR).fixed_window()).expect("limit");
    let limits = [limit("first", 2), plain, limit("third", 3)];
    for (store, a, b) in instances("stored-many", &limits) {
        a.admin()
            .set_stored_quota("third", reports(30))
            .await
            .expect("set");
        let d = b.check("k", 1).await.expect("decides");
        let caps: Vec<u64> = d.statuses().iter().map(|s| s.capacity()).collect();
        assert_eq!(caps, [2, 50, 30], "{store}");
        a.admin()
            .set_override("first", "k", reports(20), None)
            .await
            .expect("override");
        let d = b.check("k", 1).await.expect("decides");
        let caps: Vec<u64> = d.statuses().iter().map(|s| s.capacity()).collect();
        assert_eq!(caps, [20, 50, 30], "{store}");
        let remaining: Vec<u64> = d.statuses().iter().map(|s| s.remaining()).collect();
        assert_eq!(remaining, [18, 48, 28], "{store}");
        // take and refund decide with the same quotas
        let taken = b.take_up_to("k", 100).await.expect("takes");
        assert_eq!(taken.granted_amount(), 18, "{store}");
        assert!(taken.refund().await.expect("refunds"), "{store}");
        assert_eq!(
            b.peek("k", 1).await.expect("looks").remaining(),
            18,
            "{store}"
        );
    }
}

#[tokio::test]
async fn a_stored_quota_of_another_algorithm_does_not_decide() {
    let prefix = unique_prefix("stored-other-algorithm");
    let window = limit("mixed", 2);
    let gcra = Limit::new("mixed", Quota::rate(100, HOUR).allow_burst(100).gcra())
        .expect("limit")
        .use_stored_quota();
    let windows = limiter(common::redis_store(&prefix), &[window]);
    let buckets = limiter(common::redis_store(&prefix), &[gcra]);
    buckets
        .admin()
        .set_stored_quota("mixed", Quota::rate(500, HOUR).allow_burst(500).gcra())
        .await
        .expect("set");
    assert_eq!(
        buckets.check("k", 1).await.expect("decides").capacity(),
        500
    );
    assert_eq!(windows.check("k", 1).await.expect("decides").capacity(), 2);
}

#[tokio::test]
async fn bad_requests_change_nothing() {
    for (store, a, _) in instances("stored-bad", &[limit("reports", 2)]) {
        let other = a
            .admin()
            .set_stored_quota("reports", Quota::rate(5, HOUR).sliding_log())
            .await;
        assert!(matches!(other, Err(Error::Config(_))), "{store}: {other:?}");
        let unknown = a.admin().set_stored_quota("nope", reports(5)).await;
        assert!(matches!(unknown, Err(Error::Config(_))), "{store}");
        let zero = a
            .admin()
            .set_override("reports", "k", reports(0), None)
            .await;
        assert!(matches!(zero, Err(Error::Config(_))), "{store}");
        assert_eq!(
            a.admin().stored_quota("reports").await.expect("read"),
            None,
            "{store}"
        );
        assert_eq!(
            a.check("k", 1).await.expect("decides").capacity(),
            2,
            "{store}"
        );
    }
    // a limit that does not take its quota from the store has none to set
    let fixed = Limit::new("fixed", reports(2)).expect("limit");
    let plain = limiter(MemoryStore::new(), &[fixed]);
    assert!(matches!(
        plain.admin().set_stored_quota("fixed", reports(3)).await,
        Err(Error::Config(_))
    ));
}

#[tokio::test]
async fn the_headers_of_a_layer_follow_the_stored_quota() {
    use axum::body::Body;
    use axum::http::Request;
    use axum::routing::get;
    use axum::Router;
    use tower::ServiceExt;
    use tower_ratelimit::key::Global;
    use tower_ratelimit::layer::RateLimitLayer;

    let prefix = unique_prefix("stored-layer");
    let store: RedisStore = common::redis_store(&prefix);
    let api = limit("api", 2);
    let app = Router::new().route(
        "/",
        get(|| async { "ok" }).layer(
            RateLimitLayer::builder()
                .store(store.clone())
                .limit(api.clone(), Global)
                .build()
                .expect("layer"),
        ),
    );
    let policy = |app: Router| async move {
        let response = app
            .oneshot(Request::get("/").body(Body::empty()).expect("request"))
            .await
            .expect("infallible");
        let policy = response.headers().get("ratelimit-policy").cloned();
        (
            response.status().as_u16(),
            policy.map(|v| v.to_str().expect("ascii").to_owned()),
        )
    };
    assert_eq!(
        policy(app.clone()).await,
        (200, Some("\"api\";q=2;w=3600".into()))
    );
    limiter(store, &[api])
        .admin()
        .set_stored_quota("api", reports(9))
        .await
        .expect("set");
    assert_eq!(
        policy(app.clone()).await,
        (200, Some("\"api\";q=9;w=3600".into()))
    );
}

#[tokio::test]
async fn a_reset_forgets_the_state_and_keeps_the_override() {
    for (store, a, b) in instances("stored-reset", &[limit("sms", 1)]) {
        a.admin()
            .set_override("sms", "vip", reports(3), None)
            .await
            .expect("override");
        assert!(
            b.check("vip", 3).await.expect("decides").is_allowed(),
            "{store}"
        );
        b.reset("vip").await.expect("reset");
        let d = a.check("vip", 3).await.expect("decides");
        assert!(d.is_allowed() && d.capacity() == 3, "{store}: {d:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_the_stored_quota_under_load_admits_at_most_the_larger() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    for (store, a, b) in instances("stored-load", &[limit("swap", 30)]) {
        let granted = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let changer = {
            let (a, stop) = (a.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Acquire) && n < 200 {
                    let quota = reports(if n.is_multiple_of(2) { 50 } else { 30 });
                    a.admin()
                        .set_stored_quota("swap", quota)
                        .await
                        .expect("set");
                    n += 1;
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
            })
        };
        let mut tasks = Vec::new();
        for limiter in [a.clone(), b.clone()] {
            for _ in 0..4 {
                let (limiter, granted) = (limiter.clone(), granted.clone());
                tasks.push(tokio::spawn(async move {
                    let mut seen = std::collections::BTreeSet::new();
                    for _ in 0..40 {
                        let d = limiter.check("k", 1).await.expect("decides");
                        if d.is_allowed() {
                            granted.fetch_add(1, Ordering::Relaxed);
                        }
                        seen.insert(d.capacity());
                        tokio::time::sleep(Duration::from_micros(200)).await;
                    }
                    seen
                }));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for task in tasks {
            seen.extend(task.await.expect("task"));
        }
        stop.store(true, Ordering::Release);
        changer.await.expect("changer");
        let granted = granted.load(Ordering::Relaxed);
        assert!(
            granted <= 50,
            "{store}: {granted} granted between quotas of 30 and 50"
        );
        assert!(granted >= 30, "{store}: {granted} granted");
        assert_eq!(
            seen.into_iter().collect::<Vec<_>>(),
            [30, 50],
            "{store}: both quotas decided"
        );
    }
}

/// Decides `key` (cost 0) with `limiter` until its limit reads `want`,
/// for at most ten seconds: a change made behind the library's back is
/// in force within a second of the store's clock (see
/// `Limit::use_stored_quota`), which a loaded machine may stretch in real
/// time; nothing here times it.
async fn poll_limit(limiter: &Limiter, key: &str, want: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let d = limiter.check(key, 0).await.expect("decides");
        if d.capacity() == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still {} after 10 s, not {want}",
            d.capacity()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The hash of the quotas kept for `name` under `prefix` (one Redis).
fn quota_hash(prefix: &str, name: &str) -> String {
    format!("{prefix}:q:{name}")
}

#[tokio::test]
async fn a_hash_deleted_behind_the_library_gives_way_to_the_own_quota() {
    let prefix = unique_prefix("stored-deleted");
    let limits = [limit("reports", 2)];
    let a = limiter(common::redis_store(&prefix), &limits);
    let b = limiter(common::redis_store(&prefix), &limits);
    a.admin()
        .set_stored_quota("reports", reports(5))
        .await
        .expect("set");
    a.admin()
        .set_override("reports", "vip", reports(40), None)
        .await
        .expect("override");
    assert_eq!(b.check("acme", 1).await.expect("decides").capacity(), 5);
    assert_eq!(b.check("vip", 1).await.expect("decides").capacity(), 40);

    // evicted, flushed: gone without the library's knowing
    let mut conn = common::connection();
    let _: i64 = redis::cmd("DEL")
        .arg(quota_hash(&prefix, "reports"))
        .query(&mut conn)
        .expect("DEL");
    poll_limit(&b, "acme", 2, "the limit's quota").await;
    poll_limit(&b, "vip", 2, "the override").await;
    assert_eq!(a.admin().stored_quota("reports").await.expect("read"), None);
    assert_eq!(a.check("other", 1).await.expect("decides").capacity(), 2);

    // and through the library again: at once
    a.admin()
        .set_stored_quota("reports", reports(6))
        .await
        .expect("set");
    assert_eq!(b.check("acme", 0).await.expect("decides").capacity(), 6);
}

#[tokio::test]
async fn a_hash_edited_by_hand_is_picked_up() {
    let prefix = unique_prefix("stored-by-hand");
    let limits = [limit("reports", 2)];
    let a = limiter(common::redis_store(&prefix), &limits);
    let b = limiter(common::redis_store(&prefix), &limits);
    let hash = quota_hash(&prefix, "reports");
    let mut conn = common::connection();
    // the stored forms of two quotas, as the library writes them
    let form = |conn: &mut redis::Connection, field: &str| -> String {
        redis::cmd("HGET")
            .arg(&hash)
            .arg(field)
            .query(conn)
            .expect("HGET")
    };
    a.admin()
        .set_stored_quota("reports", reports(9))
        .await
        .expect("set");
    let nine = form(&mut conn, "");
    a.admin()
        .set_stored_quota("reports", reports(5))
        .await
        .expect("set");
    a.admin()
        .set_override("reports", "vip", reports(30), None)
        .await
        .expect("override");
    let vip = format!("{prefix}:{{vip}}:reports:fw");
    let thirty = form(&mut conn, &vip);
    assert_eq!(b.check("acme", 1).await.expect("decides").capacity(), 5);
    assert_eq!(b.check("vip", 1).await.expect("decides").capacity(), 30);

    // the limit's quota, set by hand
    let _: i64 = redis::cmd("HSET")
        .arg(&hash)
        .arg("")
        .arg(&nine)
        .query(&mut conn)
        .expect("HSET");
    poll_limit(&b, "acme", 9, "the limit's quota set by hand").await;
    // an override, by hand: one for another key, one removed
    let other = format!("{prefix}:{{acme}}:reports:fw");
    let _: i64 = redis::cmd("HSET")
        .arg(&hash)
        .arg(&other)
        .arg(&thirty)
        .query(&mut conn)
        .expect("HSET");
    let _: i64 = redis::cmd("HDEL")
        .arg(&hash)
        .arg(&vip)
        .query(&mut conn)
        .expect("HDEL");
    poll_limit(&b, "acme", 30, "an override set by hand").await;
    poll_limit(&b, "vip", 9, "an override removed by hand").await;
    assert_eq!(
        a.admin()
            .stored_override("reports", "acme")
            .await
            .expect("read"),
        Some(reports(30))
    );
}

#[tokio::test]
async fn a_fresh_library_reads_the_kept_quotas() {
    // a server of its own: FUNCTION FLUSH drops every library on it
    let server = common::TestRedis::spawn();
    let prefix = unique_prefix("stored-fresh-vm");
    let store = || {
        RedisStore::builder(server.url.as_str())
            .prefix(&prefix)
            .build()
            .expect("store")
    };
    let limits = [limit("reports", 2)];
    let (a, b) = (limiter(store(), &limits), limiter(store(), &limits));
    a.admin()
        .set_stored_quota("reports", reports(5))
        .await
        .expect("set");
    a.admin()
        .set_override("reports", "vip", reports(40), None)
        .await
        .expect("override");
    assert_eq!(b.check("acme", 1).await.expect("decides").capacity(), 5);

    let mut conn = redis::Client::open(server.url.as_str())
        .expect("client")
        .get_connection()
        .expect("connect");
    let flush = |conn: &mut redis::Connection| {
        let _: () = redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query(conn)
            .expect("FUNCTION FLUSH");
    };
    // a decision first: it loads the library again, whose VM has read nothing
    flush(&mut conn);
    let d = b.check("acme", 1).await.expect("decides");
    assert_eq!((d.capacity(), d.remaining()), (5, 3));
    assert_eq!(b.check("vip", 1).await.expect("decides").capacity(), 40);
    // a change first: it loads the library, the next decision reads it
    flush(&mut conn);
    a.admin()
        .set_stored_quota("reports", reports(7))
        .await
        .expect("set");
    assert_eq!(b.check("acme", 1).await.expect("decides").capacity(), 7);
    assert!(a
        .admin()
        .remove_override("reports", "vip")
        .await
        .expect("remove"));
    assert_eq!(b.check("vip", 0).await.expect("decides").capacity(), 7);
}

/// Kept values no limit has, written by hand into a limit's hash (`HSET
/// <prefix>:q:<limit> "" 3:1:0:0:0:`, a zero denominator, which failed
/// every call it was in with "table index is NaN"; a zero burst; numbers
/// beyond 2^53; a rate not in lowest terms; a window over ten years...),
/// as the limit's quota and as a key's override: each is ignored, the
/// limit's own quota decides, and 100 concurrent decisions of that limit
/// and 100 of another limit of the same store, coalesced together, all
/// succeed. Valid values at the edges decide. The library and
/// `stored_quota` (Rust's reading) agree on every value.
#[tokio::test]
async fn a_kept_value_that_is_not_valid_is_ignored_and_fails_no_decision() {
    let prefix = unique_prefix("stored-not-valid");
    let store = common::redis_store(&prefix);
    // GCRA, 60 an hour with a burst of 20: capacity 20
    let own = Quota::rate(60, HOUR).allow_burst(20).gcra();
    let bad = Limit::new("bad", own).expect("limit").use_stored_quota();
    let good = Limit::new("good", own).expect("limit");
    let a = limiter(store.clone(), std::slice::from_ref(&bad));
    let other = limiter(store, &[good]);
    let hash = quota_hash(&prefix, "bad");
    let mut conn = common::connection();
    // (value, the capacity it decides with when valid)
    let cases: &[(&str, Option<u64>)] = &[
        ("3:1:0:0:0:", None),
        ("3:0:0:0:0:", None),
        ("3:0:1:1000000:0:", None),
        ("3:99999999999999999999:1:1:0:", None),
        ("3:9007199254740992:1:1:0:", None),
        ("3:1:1:9007199254740993:0:", None),
        ("3:100000000:1:100000000:0:", None), // burst times period over 2^53
        ("3:5:2:4:0:", None),                 // rate and period not in lowest terms
        ("3:5:1:1000000:7:", None),           // an unused field not 0
        ("3:5:1:316224000000001:0:", None),   // a period over ten years
        ("3:5:1:1000000:0", None),            // no trailing ':'
        ("3:5:1:1000000:0:9", None),          // a cost, or an end without '@'
        ("3:5:1:1000000:0:@", None),
        ("3:5:1:1000000:0:@x", None),
        ("3:5:1:1000000:0:@99999999999999999999", None),
        ("3:+5:1:1000000:0:", None),
        ("03:5:1:1000000:0:", None),
        ("9:5:1:1000000:0:", None),
        ("0:5:1:1000000:0:", None),
        ("", None),
        ("garbage", None),
        ("4:5:3600000000:0:0:", None), // another algorithm (a fixed window)
        // valid, at the edges
        ("3:5:1:1000000:0:", Some(5)),
        ("3:7:3:4:0:", Some(7)),
        ("3:9:1:316224000000000:0:", Some(9)),
        ("3:11:1:1000000:0:@9007199254740991", Some(11)),
        ("3:0013:1:1000000:0:", Some(13)),
    ];
    for (case, &(value, decides)) in cases.iter().enumerate() {
        // through the library, which drops the hash's mirror, then by hand:
        // the next decision reads the hash as written
        a.admin().remove_stored_quota("bad").await.expect("remove");
        let _: i64 = redis::cmd("HSET")
            .arg(&hash)
            .arg("")
            .arg(value)
            .query(&mut conn)
            .expect("HSET");
        let capacity = decides.unwrap_or(20);
        let bad_ones = (0..100).map(|i| {
            let a = &a;
            async move { a.check(format!("k{case}-{i}"), 1).await }
        });
        let good_ones = (0..100).map(|i| {
            let other = &other;
            async move { other.check(format!("k{case}-{i}"), 1).await }
        });
        let (bad_ones, good_ones) = tokio::join!(
            futures::future::join_all(bad_ones),
            futures::future::join_all(good_ones)
        );
        for d in bad_ones {
            let d = d.unwrap_or_else(|e| panic!("{value:?}: the limit's decision failed: {e}"));
            assert_eq!(d.capacity(), capacity, "{value:?}");
        }
        for d in good_ones {
            let d = d.unwrap_or_else(|e| panic!("{value:?}: another limit's decision failed: {e}"));
            assert!(d.is_allowed(), "{value:?}");
        }
        // (one of another algorithm reads as what it is)
        let other_algorithm = value.starts_with("4:");
        let read = a.admin().stored_quota("bad").await.expect("read");
        if !other_algorithm {
            assert_eq!(read.is_some(), decides.is_some(), "{value:?}: {read:?}");
        }
        let _: i64 = redis::cmd("DEL").arg(&hash).query(&mut conn).expect("DEL");

        // as a key's override, in force over a valid quota of the limit
        a.admin()
            .set_stored_quota("bad", Quota::rate(60, HOUR).allow_burst(3).gcra())
            .await
            .expect("set");
        let vip = format!("vip{case}");
        let field = format!("{prefix}:{{{vip}}}:bad:gcra");
        let _: i64 = redis::cmd("HSET")
            .arg(&hash)
            .arg(&field)
            .arg(value)
            .query(&mut conn)
            .expect("HSET");
        let d = a
            .check(&vip, 1)
            .await
            .unwrap_or_else(|e| panic!("{value:?}: {e}"));
        assert_eq!(
            d.capacity(),
            decides.unwrap_or(3),
            "{value:?} as an override"
        );
        let read = a.admin().stored_override("bad", &vip).await.expect("read");
        if !other_algorithm {
            assert_eq!(read.is_some(), decides.is_some(), "{value:?}: {read:?}");
        }
        let _: i64 = redis::cmd("DEL").arg(&hash).query(&mut conn).expect("DEL");
    }
}

/// A kept value that is not valid is logged once per limit (a `warn` of
/// target `tower_ratelimit` naming it), however many decisions it is
/// ignored in, as the limit's quota or as an override.
#[tokio::test]
async fn a_kept_value_that_is_not_valid_is_logged_once() {
    let events = events::Events::capture();
    let prefix = unique_prefix("stored-logged");
    let own = Quota::rate(60, HOUR).allow_burst(20).gcra();
    let warned = Limit::new("warned", own).expect("limit").use_stored_quota();
    let a = limiter(common::redis_store(&prefix), &[warned]);
    let hash = quota_hash(&prefix, "warned");
    let mut conn = common::connection();
    a.admin()
        .remove_stored_quota("warned")
        .await
        .expect("remove");
    for (field, value) in [
        (String::new(), "3:1:0:0:0:"),
        (format!("{prefix}:{{vip}}:warned:gcra"), "3:0:0:0:0:"),
    ] {
        let _: i64 = redis::cmd("HSET")
            .arg(&hash)
            .arg(field)
            .arg(value)
            .query(&mut conn)
            .expect("HSET");
    }
    for key in ["a", "b", "vip", "vip", "c"] {
        let d = a.check(key, 1).await.expect("decides");
        assert_eq!(d.capacity(), 20, "{key}: the limit's own quota");
    }
    let warnings: Vec<String> = events
        .warnings()
        .into_iter()
        .filter(|w| w.contains("limit=warned") && w.contains("not valid"))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
}

/// An override that has ended is removed from its hash: by the first
/// decision of its key after its end, or, for a key that comes no more, by
/// the next read of the hash (a second later). (The memory store drops them
/// the same way, and by its sweep: see `store::memory::kept`'s tests.)
#[tokio::test]
async fn ended_overrides_are_removed_from_the_hash() {
    let clock = ManualClock::new(T0);
    let prefix = unique_prefix("stored-ended");
    let limits = [limit("reports", 2)];
    let a = limiter(common::redis_store_with_clock(&prefix, &clock), &limits);
    let mut conn = common::connection();
    let mut fields = || -> i64 {
        redis::cmd("HLEN")
            .arg(quota_hash(&prefix, "reports"))
            .query(&mut conn)
            .expect("HLEN")
    };
    let short = Some(Duration::from_millis(500));
    for (key, ttl) in [("vip", short), ("gone", short), ("lasting", None)] {
        a.admin()
            .set_override("reports", key, reports(40), ttl)
            .await
            .expect("override");
    }
    assert_eq!(fields(), 3);
    // decided while it lasts (the hash read into the script's mirror)
    assert_eq!(a.check("vip", 1).await.expect("decides").capacity(), 40);
    clock.advance(Duration::from_millis(600));
    assert_eq!(a.check("vip", 1).await.expect("decides").capacity(), 2);
    assert_eq!(fields(), 2, "the ended override of the key decided is gone");
    clock.advance(Duration::from_secs(1));
    assert_eq!(a.check("acme", 1).await.expect("decides").capacity(), 2);
    assert_eq!(fields(), 1, "the other ended one is gone at the next read");
    assert_eq!(
        a.admin()
            .stored_override("reports", "lasting")
            .await
            .expect("read"),
        Some(reports(40))
    );
    assert_eq!(a.check("lasting", 1).await.expect("decides").capacity(), 40);

    // a hash too large to mirror (each decision reads its key's override):
    // removed by the first decision of its key after its end
    let big = limiter(
        common::redis_store_with_clock(&prefix, &clock),
        &[limit("big", 2)],
    );
    for i in 0..300 {
        big.admin()
            .set_override("big", format!("k{i}"), reports(40), None)
            .await
            .expect("override");
    }
    big.admin()
        .set_override("big", "vip", reports(40), short)
        .await
        .expect("override");
    let mut conn = common::connection();
    let mut fields = || -> i64 {
        redis::cmd("HLEN")
            .arg(quota_hash(&prefix, "big"))
            .query(&mut conn)
            .expect("HLEN")
    };
    assert_eq!(fields(), 301);
    assert_eq!(big.check("vip", 1).await.expect("decides").capacity(), 40);
    clock.advance(Duration::from_millis(600));
    assert_eq!(big.check("vip", 1).await.expect("decides").capacity(), 2);
    assert_eq!(fields(), 300);
}
