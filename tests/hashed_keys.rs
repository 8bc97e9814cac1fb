//! `key::Hashed`: a secret used as a key never reaches the store; its
//! Redis key names hold a digest of it.

mod common;

use std::convert::Infallible;

use common::{connection, redis_store, unique_prefix, PATIENT};
use http::{HeaderName, Request, Response, StatusCode};
use tower::{service_fn, Layer, ServiceExt};
use tower_ratelimit::key::{Header, KeyExtractor};
use tower_ratelimit::layer::RateLimitLayer;
use tower_ratelimit::{Limit, Penalty, Quota};

const SECRET: &str = "sk-live-Zq8mV3xR7tP2wK9n";

/// Every Redis key name under `prefix`, by `SCAN`.
fn key_names(prefix: &str) -> Vec<String> {
    let mut conn = connection();
    let mut cursor = 0_u64;
    let mut names = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query(&mut conn)
            .expect("SCAN");
        names.extend(batch);
        if next == 0 {
            return names;
        }
        cursor = next;
    }
}

/// Each limit's keys (a log, a bucket, a penalty state, one with its
/// secret's digest) name a digest of the API key, and no piece of it.
#[tokio::test]
async fn redis_key_names_hold_no_trace_of_the_secret() {
    let prefix = unique_prefix("hashed");
    let api_key = || Header::new(HeaderName::from_static("x-api-key")).hashed();
    let minute = std::time::Duration::from_secs(60);
    let penalty = Penalty::new(1, minute, [minute]);
    let layer = RateLimitLayer::builder()
        .store(redis_store(&prefix))
        .timeout(PATIENT)
        .limit(
            Limit::new("per-key-log", Quota::per_minute(2).sliding_log()).expect("limit"),
            api_key(),
        )
        .limit(
            Limit::new(
                "per-key-bucket",
                Quota::per_second(10).allow_burst(10).token_bucket(),
            )
            .expect("limit")
            .with_penalty(penalty.expect("penalty")),
            api_key(),
        )
        .build()
        .expect("layer");
    let service = layer.layer(service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let request = Request::get("/v1/chat")
            .header("x-api-key", SECRET)
            .body(String::new())
            .expect("request");
        let response = service.clone().oneshot(request).await.expect("infallible");
        statuses.push(response.status());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let names = key_names(&prefix);
    assert!(names.len() >= 2, "{names:?}");
    let (parts, ()) = Request::get("/")
        .header("x-api-key", SECRET)
        .body(())
        .expect("request")
        .into_parts();
    let digest = String::from_utf8(api_key().extract(&parts).expect("a key")).expect("hex");
    assert_eq!(digest.len(), 32);
    for name in &names {
        assert!(name.contains(&digest), "{name} does not name the digest");
        let name_lower = name.to_ascii_lowercase();
        // any 6 characters in a row of the secret, as sent or percent-encoded
        for piece in SECRET.as_bytes().windows(6) {
            let piece = std::str::from_utf8(piece)
                .expect("ascii")
                .to_ascii_lowercase();
            assert!(!name_lower.contains(&piece), "{name} holds {piece:?}");
        }
    }
}
