//! The `fencegate` binary: parse the command line, set up logging, then serve or run
//! one of the fenced-table commands.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use fencegate_gateway::admin;
use fencegate_gateway::auth;
use fencegate_gateway::config::{AdminCommand, Cli, Command, Config, KeyCommand, LogFormat};
use fencegate_gateway::telemetry;

/// Exit status of a configuration or start-up error (clap's own usage errors exit 2).
const ERROR_EXIT: u8 = 1;

fn main() -> ExitCode {
    let outcome = match Cli::parse().into_command() {
        Command::Serve(config) => serve(*config).map(|()| ExitCode::SUCCESS),
        Command::Admin(command) => admin(command),
        Command::Key(command) => key(command).map(|()| ExitCode::SUCCESS),
    };
    // Printed here rather than by returning the error from `main`: that prints its
    // Debug form, which adds a stack backtrace whenever RUST_BACKTRACE is set, and a
    // backtrace of where a bad flag was noticed only hides the message. Panics keep
    // theirs.
    outcome.unwrap_or_else(|error| {
        eprintln!("error: {}", message(&error));
        ExitCode::from(ERROR_EXIT)
    })
}

/// The error and its causes on one line, joined by colons; a cause whose text the
/// message already holds (an error that prints its source too) is not repeated.
fn message(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

/// `fencegate key new` and `fencegate key hash`.
fn key(command: KeyCommand) -> anyhow::Result<()> {
    match command {
        KeyCommand::New => {
            let key = auth::new_key();
            println!("key:  {key}");
            println!("hash: {}", auth::stored_hash(&key));
        }
        KeyCommand::Hash => {
            let mut key = String::new();
            std::io::stdin()
                .read_line(&mut key)
                .context("could not read the key from standard input")?;
            println!("{}", auth::stored_hash(key.trim()));
        }
    }
    Ok(())
}

fn serve(config: Config) -> anyhow::Result<()> {
    config.validate()?;
    telemetry::init(config.logging.log_format, &config.logging.log)
        .context("invalid --log filter")?;
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let runtime = match config.serving_threads(cores) {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        threads => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build(),
    }
    .context("could not start the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(config.http.listen)
            .await
            .with_context(|| format!("could not listen on {}", config.http.listen))?;
        let shutdown = shutdown_signal().context("could not install the signal handlers")?;
        fencegate_gateway::run(config, listener, shutdown).await?;
        Ok(())
    })
}

/// Runs an operator's command on a database on a single-threaded runtime; exit status 1
/// if `check` found a problem.
fn admin(command: AdminCommand) -> anyhow::Result<ExitCode> {
    telemetry::init(LogFormat::Text, "warn").context("could not set up logging")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("could not start the async runtime")?;
    let clean = runtime.block_on(admin::run(command))?;
    Ok(if clean {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
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

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("could not open the store: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[test]
    fn a_message_names_each_cause_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let error = anyhow::Error::new(Repeats(io())).context("could not start");
        assert_eq!(
            message(&error),
            "could not start: could not open the store: no such file"
        );
        let error = anyhow::Error::new(io()).context("could not read the key");
        assert_eq!(message(&error), "could not read the key: no such file");
    }
}
