//! Shadow mode: a limit that decides and records but never refuses, on the
//! memory store and a real Redis; its would-be refusals reach the metrics
//! and the logs.

mod common;
mod events;

use events::Events;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tower_ratelimit::metrics::DECISIONS;
use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota, Store};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The value of the sample `name` whose labels include all of `labels`.
fn sample(handle: &PrometheusHandle, name: &str, labels: &[(&str, &str)]) -> f64 {
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
        .unwrap_or(0.0)
}

/// Makes a store of one kind, boxed.
type MakeStore = Box<dyn FnOnce() -> Box<dyn StoreBox>>;

fn stores(test: &str) -> Vec<(&'static str, MakeStore)> {
    let prefix = common::unique_prefix(test);
    vec![
        (
            "memory",
            Box::new(|| Box::new(MemoryStore::new()) as Box<dyn StoreBox>),
        ),
        (
            "redis",
            Box::new(move || Box::new(common::redis_store(&prefix)) as Box<dyn StoreBox>),
        ),
    ]
}

/// Builds a limiter over a boxed store of either kind.
trait StoreBox {
    fn limiter(self: Box<Self>, limits: Vec<Limit>) -> Limiter;
}

impl<S: Into<Store>> StoreBox for S {
    fn limiter(self: Box<Self>, limits: Vec<Limit>) -> Limiter {
        limits
            .into_iter()
            .fold(Limiter::builder(*self), |b, l| b.limit(l))
            .timeout(common::PATIENT)
            .build()
            .expect("limiter")
    }
}

#[test]
fn a_shadow_limit_never_refuses_and_reports_what_it_would_refuse() {
    let events = Events::capture();
    for (store, make) in stores("shadow-one") {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let _local = metrics::set_default_local_recorder(&recorder);
        let trial = Limit::new("trial", Quota::per_minute(1).sliding_log())
            .unwrap()
            .shadow();
        assert!(trial.is_shadow());
        let limiter = make().limiter(vec![trial]);
        let refusals_before = events
            .ours()
            .iter()
            .filter(|(_, text)| text.contains("would have refused"))
            .count();
        runtime().block_on(async {
            let mut would = Vec::new();
            for _ in 0..3 {
                let d = limiter.check("alice", 1).await.expect("decision");
                assert!(d.is_allowed(), "{store}: {d:?}");
                assert!(d.statuses()[0].is_shadow(), "{store}");
                assert!(!d.statuses()[0].is_violated(), "{store}");
                would.push(d.statuses()[0].would_refuse());
            }
            assert_eq!(would, [false, true, true], "{store}");
            // it records: the first request counted, the others took nothing
            let look = limiter.peek("alice", 0).await.expect("peek");
            assert_eq!(look.statuses()[0].remaining(), 0, "{store}");
            // a look says the same: it would pass, the limit would refuse
            let look = limiter.peek("alice", 1).await.expect("peek");
            assert!(
                look.is_allowed() && look.statuses()[0].would_refuse(),
                "{store}"
            );
        });
        let count = |outcome| {
            sample(
                &handle,
                DECISIONS,
                &[("limit", "trial"), ("outcome", outcome)],
            )
        };
        assert_eq!(count("allowed"), 1.0, "{store}: {}", handle.render());
        assert_eq!(count("shadow_denied"), 2.0, "{store}: {}", handle.render());
        assert_eq!(count("denied"), 0.0, "{store}: {}", handle.render());
        let refusals = events
            .ours()
            .iter()
            .filter(|(_, text)| text.contains("would have refused") && text.contains("trial"))
            .count();
        assert_eq!(
            refusals - refusals_before,
            2,
            "{store}: {:?}",
            events.ours()
        );
    }
}

#[test]
fn enforced_limits_still_count_and_refuse_beside_a_shadow_limit() {
    for (store, make) in stores("shadow-two") {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let _local = metrics::set_default_local_recorder(&recorder);
        let limiter = make().limiter(vec![
            Limit::new("enforced", Quota::per_minute(3).sliding_log()).unwrap(),
            Limit::new("trial", Quota::per_minute(1).sliding_log())
                .unwrap()
                .shadow(),
        ]);
        runtime().block_on(async {
            for i in 0..3 {
                let grant = limiter
                    .refundable()
                    .check("bob", 1)
                    .await
                    .expect("decision");
                let d = grant.decision();
                assert!(d.is_allowed(), "{store}, request {i}: {d:?}");
                assert_eq!(d.statuses().len(), 2);
                assert_eq!(d.statuses()[1].would_refuse(), i > 0, "{store}: {d:?}");
                // the binding limit is the enforced one
                assert_eq!(d.binding().unwrap().name(), "enforced", "{store}");
                assert_eq!(d.remaining(), 2 - i, "{store}: {d:?}");
                if i == 2 {
                    // a refund gives back what was taken: not from the trial
                    assert!(grant.refund().await.unwrap());
                    let look = limiter.peek("bob", 0).await.unwrap();
                    assert_eq!(look.statuses()[0].remaining(), 1, "{store}: {look:?}");
                    assert_eq!(look.statuses()[1].remaining(), 0, "{store}: {look:?}");
                    assert!(limiter.check("bob", 1).await.unwrap().is_allowed());
                }
            }
            // the enforced limit is spent: it refuses
            let d = limiter.check("bob", 1).await.expect("decision");
            assert!(!d.is_allowed(), "{store}: {d:?}");
            assert_eq!(
                d.violated_limits().map(|s| s.name()).collect::<Vec<_>>(),
                ["enforced"],
                "{store}"
            );
        });
        let count = |limit, outcome| {
            sample(
                &handle,
                DECISIONS,
                &[("limit", limit), ("outcome", outcome)],
            )
        };
        assert_eq!(
            count("enforced", "allowed"),
            4.0,
            "{store}: {}",
            handle.render()
        );
        assert_eq!(
            count("enforced", "denied"),
            1.0,
            "{store}: {}",
            handle.render()
        );
        assert_eq!(
            count("trial", "shadow_denied"),
            4.0,
            "{store}: {}",
            handle.render()
        );
        assert_eq!(
            count("trial", "denied"),
            0.0,
            "{store}: {}",
            handle.render()
        );
    }
}

/// A shadow limit never changes what happens to a request: its wait neither
/// delays a grant (`acquire`, the layer's delay mode) nor charges the
/// enforced limits later, and a refusal's retry is the enforced limits'.
#[test]
fn a_shadow_limit_never_delays_a_request_nor_lengthens_its_retry() {
    let minute = std::time::Duration::from_secs(60);
    for (store, make) in stores("shadow-delay") {
        let enforced = Limit::new("paid", Quota::per_minute(2).allow_burst(2).gcra()).unwrap();
        // one per 45 s: its second grant would wait 45 s, within max_wait
        let trial = Limit::new(
            "trial",
            Quota::rate(1, std::time::Duration::from_secs(45))
                .allow_burst(1)
                .gcra(),
        )
        .unwrap()
        .shadow();
        let limiter = make().limiter(vec![enforced, trial]);
        runtime().block_on(async {
            let first = limiter.acquire("u", 1, minute).await.expect("first");
            assert!(first.is_allowed() && first.delay().is_zero(), "{store}");
            let second = tokio::time::timeout(
                std::time::Duration::from_secs(5),
                limiter.acquire("u", 1, minute),
            )
            .await
            .unwrap_or_else(|_| panic!("{store}: acquire slept for the shadow limit"))
            .expect("second");
            assert!(second.is_allowed(), "{store}: {second:?}");
            assert!(
                second.delay().is_zero(),
                "{store}: the shadow limit delayed the grant by {:?}",
                second.delay()
            );
            assert!(
                second.statuses()[1].would_refuse(),
                "{store}: the shadow limit's delay is reported"
            );
            // the enforced limit was charged now, not in the future: it is
            // empty now and refuses, with its own retry (30 s for a permit
            // at 2 per minute), not the shadow limit's
            let third = limiter.check("u", 1).await.expect("third");
            let retry = third.retry_after().expect("refused by the enforced limit");
            assert!(
                retry <= std::time::Duration::from_secs(30),
                "{store}: retry {retry:?}"
            );
        });
    }
}
