//! The `fencegate` binary: parse the configuration, set up logging, bind, run.

use anyhow::Context;
use clap::Parser;
use fencegate_gateway::{config::Cli, telemetry};

fn main() -> anyhow::Result<()> {
    let config = Cli::parse().into_config();
    config.validate()?;
    telemetry::init(config.log_format, &config.log).context("invalid --log filter")?;
    let runtime = if config.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        if config.threads > 1 {
            builder.worker_threads(config.threads);
        }
        builder.enable_all().build()
    }
    .context("could not start the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("could not listen on {}", config.listen))?;
        let shutdown = shutdown_signal().context("could not install the signal handlers")?;
        fencegate_gateway::run(config, listener, shutdown).await?;
        Ok(())
    })
}

/// Installs the SIGTERM and SIGINT handlers now — before the gateway reports ready, so
/// that a signal sent right after "ready" shuts it down cleanly instead of killing it —
/// and returns a future that completes on the first of them.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM received"),
            _ = interrupt.recv() => tracing::info!("SIGINT received"),
        }
    })
}
