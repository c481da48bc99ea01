//! Logging set-up: `tracing` events to stderr, as text or JSON.
//!
//! The connection pool warns once per pooled connection it drops (`deadpool.postgres`:
//! "Connection could not be recycled", "Connection error"), so a database switchover
//! writes one line per connection, all alike. Unless the filter names that target
//! itself, those lines are summarised instead: one warning when they start, then at
//! most one every [`SUMMARY_EVERY`], each with the count of the pool's warnings since
//! the one before (`warnings`) and the last of them (`last`).

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::LogFormat;

/// The target of the connection pool's warnings.
const POOL_TARGET: &str = "deadpool.postgres";

/// At most one summary line of the pool's warnings this often.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// Installs the global subscriber. Fails on an invalid filter.
pub fn init(format: LogFormat, filter: &str) -> Result<(), tracing_subscriber::filter::ParseError> {
    let summarise = !filter.contains("deadpool");
    let mut env_filter = EnvFilter::try_new(filter)?;
    if summarise {
        env_filter = env_filter.add_directive(format!("{POOL_TARGET}=off").parse()?);
    }
    let builder = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let printed: Box<dyn Layer<_> + Send + Sync> = match format {
        LogFormat::Text => Box::new(builder.with_filter(env_filter)),
        LogFormat::Json => Box::new(
            builder
                .json()
                .with_current_span(true)
                .with_span_list(false)
                .with_filter(env_filter),
        ),
    };
    let summary = summarise.then(|| {
        PoolWarnings::default().with_filter(Targets::new().with_target(POOL_TARGET, Level::WARN))
    });
    tracing_subscriber::registry()
        .with(printed)
        .with(summary)
        .init();
    Ok(())
}

/// Counts the pool's warnings and logs a summary of them.
#[derive(Default)]
struct PoolWarnings {
    /// When the last summary was logged, and how many warnings came since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl<S: Subscriber> Layer<S> for PoolWarnings {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let now = Instant::now();
        let count = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.1 += 1;
            if state
                .0
                .is_some_and(|last| now.duration_since(last) < SUMMARY_EVERY)
            {
                return;
            }
            let count = state.1;
            *state = (Some(now), 0);
            count
        };
        let mut message = Message::default();
        event.record(&mut message);
        tracing::warn!(
            warnings = count,
            last = %message.0,
            "the database connection pool dropped connections (one warning each, summarised: \
             at most one line every {} s)",
            SUMMARY_EVERY.as_secs()
        );
    }
}

/// The `message` field of an event.
#[derive(Default)]
struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}
