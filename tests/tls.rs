//! `rediss://`: a `redis-server` that speaks only TLS, with a CA and a server
//! certificate the test makes.

mod common;

use std::time::Duration;

use common::tls::TestTls;
use common::{unique_prefix, PATIENT};
use tower_ratelimit::{Limit, Limiter, Quota, RedisStore};

fn limiter(store: RedisStore) -> Limiter {
    Limiter::builder(store)
        .limit(Limit::new("l", Quota::per_minute(2).sliding_log()).unwrap())
        .timeout(PATIENT)
        .cache_denials(false)
        .build()
        .expect("limiter")
}

#[tokio::test]
async fn decisions_over_tls_with_a_private_ca() {
    let server = TestTls::start();
    for url in [server.url(), server.localhost_url()] {
        let store = RedisStore::builder(&url)
            .prefix(unique_prefix("tls"))
            .tls_root_certificate(server.ca_pem())
            .build()
            .expect("a TLS store");
        let limiter = limiter(store);
        assert!(limiter.check("k", 1).await.unwrap().is_allowed(), "{url}");
        assert!(limiter.check("k", 1).await.unwrap().is_allowed(), "{url}");
        assert!(!limiter.check("k", 1).await.unwrap().is_allowed(), "{url}");
    }
}

#[tokio::test]
async fn a_certificate_no_trusted_ca_signed_is_refused() {
    let server = TestTls::start();
    // the system's roots only: the test CA is not among them
    let store = RedisStore::builder(server.url())
        .prefix(unique_prefix("untrusted"))
        .build()
        .expect("store");
    let limiter = Limiter::builder(store)
        .limit(Limit::new("l", Quota::per_minute(2).sliding_log()).unwrap())
        .timeout(Duration::from_secs(2))
        .build()
        .expect("limiter");
    assert!(limiter.check("k", 1).await.is_err());
    // nor does plain TCP reach a TLS port
    let plain = RedisStore::builder(server.url().replace("rediss://", "redis://"))
        .prefix(unique_prefix("plain"))
        .build()
        .expect("store");
    let limiter = Limiter::builder(plain)
        .limit(Limit::new("l", Quota::per_minute(2).sliding_log()).unwrap())
        .timeout(Duration::from_secs(2))
        .build()
        .expect("limiter");
    assert!(limiter.check("k", 1).await.is_err());
}
