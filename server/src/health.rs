//! Health, as envoyproxy/ratelimit keeps it (`src/server/health.go`):
//! healthy when every component is — the store (once a first probe reached
//! it), the configuration (only with
//! `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`: once a configuration with a
//! domain is loaded) and the process (until SIGTERM). `GET /healthcheck`
//! answers `OK` or 500, and `grpc.health.v1` reports the service
//! `ratelimit` SERVING or NOT_SERVING accordingly (the overall service `""`
//! stays SERVING until shutdown, as grpc-go's health server leaves it).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// The gRPC health service name envoyproxy/ratelimit reports.
pub const SERVICE_NAME: &str = "ratelimit";

/// A component of health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Component {
    /// The store: healthy once reached.
    Store,
    /// The configuration (with `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`).
    Config,
    /// The process: unhealthy from SIGTERM on.
    Sigterm,
}

/// The health of the server.
#[derive(Debug)]
pub struct Health {
    components: tokio::sync::Mutex<BTreeMap<Component, bool>>,
    ok: AtomicBool,
    reporter: HealthReporter,
}

impl Health {
    /// Health with its components at their starting state: the store
    /// unhealthy until [`set`](Self::set) says otherwise (`store_ready`
    /// true: healthy from the start, as the in-memory store is), the
    /// configuration unhealthy when it is a component at all.
    pub async fn new(reporter: HealthReporter, store_ready: bool, config_component: bool) -> Self {
        let mut components = BTreeMap::new();
        components.insert(Component::Store, store_ready);
        if config_component {
            components.insert(Component::Config, false);
        }
        components.insert(Component::Sigterm, true);
        let ok = components.values().all(|v| *v);
        reporter
            .set_service_status("", ServingStatus::Serving)
            .await;
        reporter.set_service_status(SERVICE_NAME, status(ok)).await;
        Health {
            components: tokio::sync::Mutex::new(components),
            ok: AtomicBool::new(ok),
            reporter,
        }
    }

    /// Whether every component is healthy (`/healthcheck`).
    pub fn is_ok(&self) -> bool {
        self.ok.load(Ordering::Acquire)
    }

    /// Sets a component's health; a component that health does not track
    /// (the configuration without `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`)
    /// is left out.
    pub async fn set(&self, component: Component, healthy: bool) {
        let mut components = self.components.lock().await;
        let Some(slot) = components.get_mut(&component) else {
            return;
        };
        *slot = healthy;
        let ok = components.values().all(|v| *v);
        if ok != self.ok.swap(ok, Ordering::AcqRel) {
            tracing::info!(healthy = ok, ?component, "health changed");
        }
        self.reporter
            .set_service_status(SERVICE_NAME, status(ok))
            .await;
    }

    /// Shutting down: every service NOT_SERVING.
    pub async fn shutting_down(&self) {
        self.set(Component::Sigterm, false).await;
        self.reporter
            .set_service_status("", ServingStatus::NotServing)
            .await;
    }
}

fn status(ok: bool) -> ServingStatus {
    if ok {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}
