//! A drop-in replacement for envoyproxy/ratelimit: Envoy's rate limit service
//! (`envoy.service.ratelimit.v3`), its YAML configuration and environment,
//! decided by tower-ratelimit on Redis or in memory.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod config;
pub mod health;
pub mod json;
pub mod logging;
pub mod metrics;
pub mod proto;
pub mod runtime;
pub mod server;
pub mod service;
pub mod settings;
pub mod stats;
mod sync;
