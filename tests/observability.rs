//! Metrics through the `metrics` facade and a tracing span per decision,
//! read back through the Prometheus exporter an application would install.

mod common;
mod events;

use std::time::Duration;

use events::Events;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tower_ratelimit::metrics::{
    Outcome, DECISIONS, LIMIT_CAPACITY, LIMIT_WINDOW, MEMORY_STORE_KEYS, NEAR_LIMIT, OVERSHOOT,
    STORE_DURATION, STORE_OUTAGE,
};
use tower_ratelimit::{HotKey, Limit, Limiter, LiveLimit, MemoryStore, Quota, RedisStore};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The value of the sample `name` whose labels include all of `labels`.
fn sample(handle: &PrometheusHandle, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let text = handle.render();
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| {
            let (series, _) = line.rsplit_once(' ').unwrap_or((line, ""));
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            metric == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|line| line.rsplit_once(' ')?.1.parse().ok())
}

fn two_limits(store: MemoryStore) -> Limiter {
    Limiter::builder(store)
        .limit(Limit::new("burst", Quota::per_minute(2).allow_burst(2).gcra()).expect("limit"))
        .limit(Limit::new("daily", Quota::per_day(1000).fixed_window()).expect("limit"))
        .build()
        .expect("limiter")
}

#[test]
fn decisions_are_counted_by_limit_and_outcome() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    runtime().block_on(async {
        let limiter = two_limits(MemoryStore::new());
        for _ in 0..3 {
            limiter.check("client", 1).await.expect("decision");
        }
        limiter.check("client", 5000).await.expect("decision");
        limiter.peek("client", 1).await.expect("a peek");
        // port 1 refuses connections: a store error
        let down = RedisStore::new("redis://127.0.0.1:1/").expect("store");
        let limit = Limit::new("remote", Quota::per_minute(1).sliding_log()).expect("limit");
        let failing = Limiter::new(down, limit);
        assert!(failing.check("client", 1).await.is_err());
    });
    let decisions = |limit: &str, outcome: Outcome| {
        sample(
            &handle,
            DECISIONS,
            &[("limit", limit), ("outcome", outcome.as_str())],
        )
    };
    assert_eq!(decisions("burst", Outcome::Allowed), Some(2.0));
    assert_eq!(decisions("daily", Outcome::Allowed), Some(2.0));
    // a refusal counts under the limit that refused, not under the others
    assert_eq!(decisions("burst", Outcome::Denied), Some(1.0));
    assert_eq!(decisions("daily", Outcome::Denied), None);
    // 5000 fits neither limit; the peek is not a decision
    assert_eq!(decisions("burst", Outcome::CostExceedsCapacity), Some(1.0));
    assert_eq!(decisions("daily", Outcome::CostExceedsCapacity), Some(1.0));
    assert_eq!(decisions("remote", Outcome::StoreError), Some(1.0));
    let calls = |store: &str| {
        sample(
            &handle,
            &format!("{STORE_DURATION}_count"),
            &[("store", store), ("operation", "decide")],
        )
    };
    assert_eq!(calls("memory"), Some(5.0), "4 checks and a peek");
    assert_eq!(calls("redis"), Some(1.0), "failures are measured too");
}

#[test]
fn the_memory_store_size_is_a_gauge_summed_over_stores() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let keys = || sample(&handle, MEMORY_STORE_KEYS, &[]);
    runtime().block_on(async {
        let a = two_limits(MemoryStore::new());
        let b = two_limits(MemoryStore::new());
        // the first decision on a store reports its size (one state per limit)
        a.check("one", 1).await.expect("decision");
        assert_eq!(keys(), Some(2.0));
        b.check("two", 1).await.expect("decision");
        assert_eq!(keys(), Some(4.0));
        drop(a);
        // a dropped store takes its share back
        assert_eq!(keys(), Some(2.0));
    });
}

#[test]
fn grants_near_the_limit_are_counted_and_the_quota_is_a_gauge() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let near = || sample(&handle, NEAR_LIMIT, &[("limit", "pages")]);
    let capacity = || sample(&handle, LIMIT_CAPACITY, &[("limit", "pages")]);
    let window = || sample(&handle, LIMIT_WINDOW, &[("limit", "pages")]);
    let pages = |n| Limit::new("pages", Quota::per_minute(n).sliding_log()).expect("limit");
    runtime().block_on(async {
        let live = LiveLimit::new(pages(10));
        let limiter = Limiter::new(MemoryStore::new(), live.clone());
        for _ in 0..8 {
            limiter.check("client", 1).await.expect("decision");
        }
        // 9 .. 2 left: none under a fifth of 10
        assert_eq!(near(), None);
        assert_eq!((capacity(), window()), (Some(10.0), Some(60.0)));
        for _ in 0..3 {
            limiter.check("client", 1).await.expect("decision");
        }
        // 1 and 0 left; the refusal is not a grant
        assert_eq!(near(), Some(2.0));
        // a live change shows from its first decision
        live.set(pages(50)).expect("a new quota");
        limiter.check("client", 1).await.expect("decision");
        assert_eq!(capacity(), Some(50.0));
        assert_eq!(near(), Some(2.0), "39 of 50 left");
    });
}

#[test]
fn a_quota_kept_in_the_store_is_the_gauge_when_it_decides() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let capacity = || sample(&handle, LIMIT_CAPACITY, &[("limit", "reports")]);
    let window = || sample(&handle, LIMIT_WINDOW, &[("limit", "reports")]);
    runtime().block_on(async {
        let hour = Duration::from_secs(3600);
        let limit = Limit::new("reports", Quota::rate(5, hour).fixed_window())
            .expect("limit")
            .use_stored_quota();
        let limiter = Limiter::new(MemoryStore::new(), limit);
        limiter.check("acme", 1).await.expect("decision");
        assert_eq!((capacity(), window()), (Some(5.0), Some(3600.0)));
        let kept = Quota::per_minute(100).fixed_window();
        limiter
            .admin()
            .set_stored_quota("reports", kept)
            .await
            .expect("kept");
        limiter.check("acme", 1).await.expect("decision");
        assert_eq!((capacity(), window()), (Some(100.0), Some(60.0)));
    });
}

#[test]
fn charges_after_the_fact_record_what_they_may_overshoot() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let overshoot = |suffix: &str| {
        let name = format!("{OVERSHOOT}{suffix}");
        sample(&handle, &name, &[("limit", "tokens"), ("source", "charge")])
    };
    runtime().block_on(async {
        let tokens = Limit::new("tokens", Quota::per_hour(100).sliding_window()).expect("limit");
        let limiter = Limiter::new(MemoryStore::new(), tokens);
        limiter.charge("acme", 30).await.expect("charged");
        // at most the capacity per charge
        limiter.charge("acme", 500).await.expect("charged");
    });
    assert_eq!(overshoot("_count"), Some(2.0));
    assert_eq!(overshoot("_sum"), Some(130.0));
}

#[test]
fn a_hot_keys_batch_records_what_it_may_overshoot() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let overshoot = |suffix: &str| {
        let name = format!("{OVERSHOOT}{suffix}");
        sample(
            &handle,
            &name,
            &[("limit", "global"), ("source", "hot_batch")],
        )
    };
    let redis = common::TestRedis::spawn();
    runtime().block_on(async {
        let store = RedisStore::new(redis.url.as_str()).expect("store");
        let hot = HotKey::new(25, Duration::from_secs(60)).expect("hot key");
        let global = Limit::new("global", Quota::per_minute(100).sliding_window())
            .and_then(|limit| limit.with_hot_key(hot))
            .expect("limit");
        let limiter = Limiter::new(store, global);
        // the first takes a batch of 25, the next 24 are granted from it
        for _ in 0..25 {
            assert!(limiter
                .check("all", 1)
                .await
                .expect("decision")
                .is_allowed());
        }
    });
    assert_eq!(overshoot("_count"), Some(1.0));
    assert_eq!(overshoot("_sum"), Some(25.0));
}

#[test]
fn the_store_outage_is_a_gauge_while_redis_is_down() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let outage = || sample(&handle, STORE_OUTAGE, &[("store", "redis")]);
    let mut redis = common::TestRedis::spawn();
    runtime().block_on(async {
        let store = RedisStore::new(redis.url.as_str()).expect("store");
        let limit = Limit::new("outage", Quota::per_minute(100).sliding_log()).expect("limit");
        let limiter = Limiter::new(store, limit);
        limiter.check("client", 1).await.expect("decision");
        assert_eq!(outage(), Some(0.0));
        redis.stop();
        assert!(limiter.check("client", 1).await.is_err());
        assert_eq!(outage(), Some(1.0));
        redis.restart();
        // (the connection comes back within a few tries)
        let mut answered = false;
        for _ in 0..100 {
            if limiter.check("client", 1).await.is_ok() {
                answered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(answered, "Redis never answered again");
        assert_eq!(outage(), Some(0.0));
    });
}

#[test]
fn every_decision_runs_in_a_span_with_its_limits_and_outcome() {
    let events = Events::capture();
    runtime().block_on(async {
        let limiter = two_limits(MemoryStore::new());
        for _ in 0..3 {
            limiter.check("client", 1).await.expect("decision");
        }
        let down = RedisStore::builder("redis://127.0.0.1:1/")
            .build()
            .expect("store");
        let limit = Limit::new("remote", Quota::per_minute(1).sliding_log()).expect("limit");
        let timeout = Duration::from_secs(5);
        let failing = Limiter::builder(down)
            .limit(limit)
            .timeout(timeout)
            .build()
            .expect("limiter");
        assert!(failing.check("client", 1).await.is_err());
    });
    let spans = events.spans("rate_limit");
    assert_eq!(
        spans,
        [
            " limits=burst,daily outcome=allowed",
            " limits=burst,daily outcome=allowed",
            " limits=burst,daily outcome=denied",
            " limits=remote outcome=store_error",
        ]
    );
}

/// A layer's refusal of an estimate over its share counts
/// `estimate_too_large` under that limit (with the layer's own 400 or a
/// custom handler's answer), and nothing else: no decision was made.
#[test]
fn an_estimate_too_large_has_its_own_outcome() {
    use http::{HeaderName, Request, Response, StatusCode};
    use tower::{service_fn, Layer, ServiceExt};
    use tower_ratelimit::key::Global;
    use tower_ratelimit::layer::{RateLimitLayer, Rejection, Rule};

    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let layer = |custom: bool| {
        let limit = Limit::new("llm-tokens", Quota::per_hour(1000).fixed_window()).expect("limit");
        let used = HeaderName::from_static("x-tokens-used");
        let builder = RateLimitLayer::builder().rule(
            Rule::new(limit, Global)
                .cost_from_request_header(HeaderName::from_static("x-max-tokens"))
                .cost_from_response_header(used)
                .settle_estimates(0.1),
        );
        let builder = if custom {
            builder.on_rejection(|why| {
                let status = match why {
                    Rejection::EstimateTooLarge { .. } => StatusCode::UNPROCESSABLE_ENTITY,
                    _ => StatusCode::TOO_MANY_REQUESTS,
                };
                let mut response = Response::new(String::new());
                *response.status_mut() = status;
                response
            })
        } else {
            builder
        };
        builder.build().expect("layer")
    };
    let status = |layer: RateLimitLayer, estimate: u64| async move {
        let service = layer.layer(service_fn(|_: Request<String>| async {
            Ok::<_, std::convert::Infallible>(Response::new(String::new()))
        }));
        let request = Request::get("/")
            .header("x-max-tokens", estimate.to_string())
            .body(String::new())
            .expect("request");
        service.oneshot(request).await.expect("infallible").status()
    };
    runtime().block_on(async {
        assert_eq!(status(layer(false), 101).await, StatusCode::BAD_REQUEST);
        assert_eq!(status(layer(false), 100).await, StatusCode::OK);
        assert_eq!(
            status(layer(true), 500).await,
            StatusCode::UNPROCESSABLE_ENTITY
        );
    });
    let decisions = |outcome: Outcome| {
        sample(
            &handle,
            DECISIONS,
            &[("limit", "llm-tokens"), ("outcome", outcome.as_str())],
        )
    };
    assert_eq!(decisions(Outcome::EstimateTooLarge), Some(2.0));
    assert_eq!(decisions(Outcome::Allowed), Some(1.0));
    assert_eq!(decisions(Outcome::Denied), None);
}

/// An estimate the layer cannot read counts `estimate_unreadable` under its
/// limit (400, nothing decided); an answer that tells no cost keeps the
/// estimate, counted `result="estimate_kept"` under the charges.
#[test]
fn an_unreadable_estimate_and_a_kept_one_are_counted() {
    use http::{HeaderName, Request, Response, StatusCode};
    use tower::{service_fn, Layer, ServiceExt};
    use tower_ratelimit::key::Global;
    use tower_ratelimit::layer::{RateLimitLayer, Rule};
    use tower_ratelimit::metrics::CHARGES;

    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let limit = Limit::new("llm-budget", Quota::per_hour(1000).fixed_window()).expect("limit");
    let layer = RateLimitLayer::builder()
        .rule(
            Rule::new(limit, Global)
                .cost_from_request_header(HeaderName::from_static("x-max-tokens"))
                .cost_from_response_header(HeaderName::from_static("x-tokens-used"))
                .settle_estimates(0.1),
        )
        .build()
        .expect("layer");
    let service = layer.layer(service_fn(|_: Request<String>| async {
        Ok::<_, std::convert::Infallible>(Response::new(String::new()))
    }));
    let status = |estimate: &'static str| {
        let service = service.clone();
        async move {
            let request = Request::get("/")
                .header("x-max-tokens", estimate)
                .body(String::new())
                .expect("request");
            service.oneshot(request).await.expect("infallible").status()
        }
    };
    runtime().block_on(async {
        assert_eq!(status("1.5").await, StatusCode::BAD_REQUEST);
        assert_eq!(status("\"10\"").await, StatusCode::BAD_REQUEST);
        assert_eq!(status("10").await, StatusCode::OK);
    });
    let decisions = |outcome: Outcome| {
        sample(
            &handle,
            DECISIONS,
            &[("limit", "llm-budget"), ("outcome", outcome.as_str())],
        )
    };
    assert_eq!(decisions(Outcome::EstimateUnreadable), Some(2.0));
    assert_eq!(decisions(Outcome::Allowed), Some(1.0));
    assert_eq!(
        sample(&handle, CHARGES, &[("result", "estimate_kept")]),
        Some(1.0)
    );
}

/// The metric names a query of `text` reads: the `tower_ratelimit_...`
/// words in it.
fn metric_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("tower_ratelimit_") {
        let word: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + word.len()..];
        if !names.contains(&word) {
            names.push(word);
        }
    }
    names
}

/// The queries of the example dashboard (every panel target's `expr`) and
/// of the example alert rules (`expr:` lines and the blocks they open, and
/// the queries in annotation templates: the whole file).
fn example_queries() -> Vec<String> {
    let root = env!("CARGO_MANIFEST_DIR");
    let dashboard = std::fs::read_to_string(format!("{root}/examples/grafana-dashboard.json"))
        .expect("the example dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&dashboard).expect("JSON");
    fn exprs(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("expr", serde_json::Value::String(expr)) => out.push(expr.clone()),
                        _ => exprs(value, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|item| exprs(item, out)),
            _ => {}
        }
    }
    let mut queries = Vec::new();
    exprs(&dashboard, &mut queries);
    assert!(queries.len() >= 10, "{queries:?}");
    let alerts = std::fs::read_to_string(format!("{root}/examples/prometheus-alerts.yml"))
        .expect("the example alert rules");
    assert!(alerts.matches("expr:").count() >= 6);
    queries.push(alerts);
    queries
}

/// With the exporter given `metrics::buckets()`, every series the example
/// dashboard and alert rules query exists once the limiter has worked:
/// the `_bucket` series of the histograms among them (without the buckets
/// the exporter renders summaries, and those panels and the latency alert
/// would have nothing to read).
#[test]
fn every_series_the_dashboard_and_alerts_query_is_rendered() {
    use metrics_exporter_prometheus::Matcher;

    let mut builder = PrometheusBuilder::new();
    for (name, bounds) in tower_ratelimit::metrics::buckets() {
        builder = builder
            .set_buckets_for_metric(Matcher::Full(name.to_owned()), bounds)
            .expect("bounds");
    }
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    runtime().block_on(async {
        // names of this test's own: the quota gauges are set when the
        // quota of a name changes, which other tests' limits would have done
        let limit = Limit::new(
            "dashboard-burst",
            Quota::per_minute(2).allow_burst(2).gcra(),
        );
        let limiter = Limiter::new(MemoryStore::new(), limit.expect("limit"));
        // granted, near the limit, then refused
        for _ in 0..3 {
            limiter.check("client", 1).await.expect("decision");
        }
        let tokens = Quota::per_hour(100).sliding_window();
        let tokens = Limit::new("dashboard-tokens", tokens).expect("limit");
        Limiter::new(MemoryStore::new(), tokens)
            .charge("acme", 30)
            .await
            .expect("charged");
    });
    let rendered = handle.render();
    let series: Vec<&str> = rendered
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split(['{', ' ']).next())
        .collect();
    let mut names = Vec::new();
    for query in example_queries() {
        names.extend(metric_names(&query));
    }
    assert!(
        names.iter().any(|name| name.ends_with("_bucket")),
        "{names:?}"
    );
    for name in &names {
        assert!(
            series.contains(&name.as_str()),
            "{name} is queried by the examples but not rendered:\n{rendered}"
        );
    }
    // and without the buckets, none of the `_bucket` series exists
    let plain = PrometheusBuilder::new().build_recorder();
    let plain_handle = plain.handle();
    {
        let _local = metrics::set_default_local_recorder(&plain);
        runtime().block_on(async {
            let limiter = two_limits(MemoryStore::new());
            limiter.check("client", 1).await.expect("decision");
        });
    }
    assert!(!plain_handle.render().contains("_bucket"));
}
