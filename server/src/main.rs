//! `ratelimit`: Envoy's rate limit service, configured as
//! envoyproxy/ratelimit is (its environment variables and YAML files).
//! Exits 1 when the environment cannot be used (the message names the
//! variable), 0 after a graceful stop on SIGTERM, SIGINT or SIGHUP.

use tower_ratelimit_server::{logging, server, settings::Settings};

fn main() -> std::process::ExitCode {
    let settings = match Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ratelimit: invalid setting {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    logging::init(settings.log_level, settings.log_format);
    for (variable, why) in &settings.no_effect {
        tracing::warn!("{variable} has no effect here: {why}");
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ratelimit: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let mut running = match server::start(settings).await {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("cannot start: {e}");
                eprintln!("ratelimit: cannot start: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
        tokio::select! {
            signal = shutdown_signal() => {
                tracing::warn!("Received {signal}, initiating shutdown");
                running.stop().await;
                std::process::ExitCode::SUCCESS
            }
            () = running.wait_for_failure() => {
                tracing::error!("a listener failed; stopping");
                running.stop().await;
                std::process::ExitCode::FAILURE
            }
        }
    })
}

/// Resolves on SIGTERM, SIGINT or SIGHUP (as envoyproxy/ratelimit stops on
/// each) with the signal's name.
async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        // no signal handling: run until killed
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
        _ = hup.recv() => "SIGHUP",
    }
}
