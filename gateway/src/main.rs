//! The `fencegate` binary: parse the configuration, set up logging, bind, run.

use anyhow::Context;
use clap::Parser;
use fencegate_gateway::{config::Cli, telemetry};

fn main() -> anyhow::Result<()> {
    let config = Cli::parse().into_config();
    config.validate()?;
    telemetry::init(config.log_format, &config.log).context("invalid --log filter")?;
    let runtime = tokio::runtime::Runtime::new().context("could not start the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("could not listen on {}", config.listen))?;
        fencegate_gateway::run(config, listener, shutdown_signal()).await?;
        Ok(())
    })
}

/// Completes on the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut terminate = signal(SignalKind::terminate()).expect("can install a SIGTERM handler");
    let mut interrupt = signal(SignalKind::interrupt()).expect("can install a SIGINT handler");
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM received"),
        _ = interrupt.recv() => tracing::info!("SIGINT received"),
    }
}
