//! Helpers for the fencegate-lease tests.
//!
//! - [`short_timing`], [`steady_timing`], [`process_timing`]: the lease timings the
//!   tests use (hundreds of milliseconds).
//! - [`via_proxy`]: a Postgres URL rewritten to go through a [`crate::proxy::Proxy`].
//! - [`next_transition`]: waits for an elector's next matching transition.
//! - [`Sweeper`]: spawns the `invoice-sweeper` example, a writer process that competes
//!   for a lease and writes through the gateway while it leads. It runs with
//!   `--log-format json`; every line is kept with the instant the harness read it, so
//!   tests can wait for events and order them.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use fencegate_lease::{Elector, LeaseConfig, LeaseStore, LossReason, Term, Transition};
use tokio_util::sync::CancellationToken;

/// The short timing of the failover tests: a 600 ms lease, renewed every 200 ms, given
/// up after 400 ms without a renewal; followers and failed renewals retry every 80 ms.
/// Store calls may take 150 ms (a loaded CI machine), which the arithmetic still allows.
pub fn short_timing() -> LeaseConfig {
    LeaseConfig {
        max_round_trip: Duration::from_millis(150),
        renew_deadline: Duration::from_millis(400),
        renew_retry_period: Duration::from_millis(80),
        ..LeaseConfig::with_lease(Duration::from_millis(600))
    }
}

/// For tests about something else than timing: quick renewals and retries, but a
/// generous deadline, so that a slow moment of a loaded machine does not end a term.
pub fn steady_timing() -> LeaseConfig {
    LeaseConfig {
        lease_duration: Duration::from_secs(10),
        renew_interval: Duration::from_millis(200),
        renew_deadline: Duration::from_secs(6),
        retry_period: Duration::from_millis(80),
        renew_retry_period: Duration::from_millis(80),
        max_round_trip: Duration::from_secs(1),
    }
}

/// The timing of the `invoice-sweeper` processes in tests: a 1 s lease, given up after
/// two thirds of it.
pub fn process_timing() -> LeaseConfig {
    LeaseConfig {
        max_round_trip: Duration::from_millis(150),
        renew_deadline: Duration::from_millis(666),
        ..LeaseConfig::with_lease(Duration::from_secs(1))
    }
}

/// [`process_timing`] as `invoice-sweeper` flags.
pub fn process_timing_args() -> Vec<String> {
    let config = process_timing();
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    [
        ("--lease-duration", config.lease_duration),
        ("--renew-interval", config.renew_interval),
        ("--renew-deadline", config.renew_deadline),
        ("--retry-period", config.retry_period),
        ("--renew-retry-period", config.renew_retry_period),
        ("--max-round-trip", config.max_round_trip),
    ]
    .into_iter()
    .flat_map(|(flag, value)| [flag.to_owned(), ms(value)])
    .collect()
}

/// How long a lease test waits for any one thing to happen.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// Runs an elector whose leading code waits for its term to end, and hands every term
/// it gets to the test.
pub fn spawn_elector<S: LeaseStore>(
    elector: Elector<S>,
    shutdown: &CancellationToken,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::mpsc::UnboundedReceiver<Term>,
) {
    let (terms_tx, terms) = tokio::sync::mpsc::unbounded_channel();
    let shutdown = shutdown.clone();
    let task = tokio::spawn(async move {
        elector
            .run(shutdown, |term: Term| {
                let _ = terms_tx.send(term.clone());
                async move { term.cancelled().await }
            })
            .await;
    });
    (task, terms)
}

/// The next term an elector hands out; panics after [`PATIENCE`].
pub async fn next_term(terms: &mut tokio::sync::mpsc::UnboundedReceiver<Term>) -> Term {
    tokio::time::timeout(PATIENCE, terms.recv())
        .await
        .expect("a term within the patience")
        .expect("the elector is running")
}

/// Waits until the elector loses its term, and says why; panics after [`PATIENCE`].
pub async fn lost(events: &mut tokio::sync::broadcast::Receiver<Transition>) -> LossReason {
    match next_transition(events, PATIENCE, |t| matches!(t, Transition::Lost { .. })).await {
        Transition::Lost { reason, .. } => reason,
        other => panic!("waited for a loss, got {other:?}"),
    }
}

/// The next transition that satisfies `wanted`; panics after `timeout`.
pub async fn next_transition(
    events: &mut tokio::sync::broadcast::Receiver<Transition>,
    timeout: Duration,
    wanted: impl Fn(&Transition) -> bool,
) -> Transition {
    tokio::time::timeout(timeout, async {
        loop {
            match events.recv().await {
                Ok(event) if wanted(&event) => return event,
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                    panic!("the elector has stopped")
                }
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no matching transition within {timeout:?}"))
}

/// The built example: `SWEEPER_BIN`, or `examples/invoice-sweeper` in this test's
/// target dir (built by `cargo build --workspace --examples`).
pub fn binary() -> PathBuf {
    crate::gateway::built(
        "SWEEPER_BIN",
        "examples/invoice-sweeper",
        "cargo build -p fencegate-lease --examples --features etcd,zookeeper",
    )
}

/// A log event and the instant the harness read it.
#[derive(Debug, Clone)]
pub struct Event {
    pub seen: Instant,
    pub json: Value,
}

impl Event {
    pub fn message(&self) -> Option<&str> {
        self.json["fields"]["message"].as_str()
    }

    pub fn field(&self, name: &str) -> &Value {
        &self.json["fields"][name]
    }
}

/// A running sweeper process. Killed when dropped.
pub struct Sweeper {
    pub node: String,
    child: Child,
    events: Arc<Mutex<Vec<Event>>>,
}

impl Sweeper {
    /// Starts `invoice-sweeper --node <node> <args...>` with JSON logs.
    pub fn spawn(node: &str, args: &[String]) -> Sweeper {
        let mut child = Command::new(binary())
            .args(["--node", node, "--log-format", "json"])
            .args(args)
            .env_clear()
            .env("RUST_LOG", "info,fencegate_lease=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the sweeper example can be executed");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&events);
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let seen = Instant::now();
                if let Ok(json) = serde_json::from_str(&line) {
                    sink.lock().unwrap().push(Event { seen, json });
                }
            }
        });
        Sweeper {
            node: node.to_owned(),
            child,
            events,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("the sweeper is running")
    }

    /// Sends a signal (`STOP`, `CONT`, `TERM`, `KILL`) with the system's `kill`.
    pub fn signal(&self, name: &str) {
        crate::gateway::signal(self.pid(), name);
    }

    /// Waits for the process to exit (10 s at most) and returns whether it succeeded.
    pub async fn wait(&mut self) -> bool {
        tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .expect("the sweeper exits within 10 s")
            .expect("waiting for the sweeper works")
            .success()
    }

    /// Every event so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }

    /// The events with this message so far.
    pub fn events_named(&self, message: &str) -> Vec<Event> {
        self.events()
            .into_iter()
            .filter(|e| e.message() == Some(message))
            .collect()
    }

    /// Waits for the first event with `message` that satisfies `matches`, among all
    /// events so far and to come; panics with the process's log after `timeout`.
    pub async fn wait_for(
        &self,
        message: &str,
        timeout: Duration,
        matches: impl Fn(&Event) -> bool,
    ) -> Event {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(event) = self.events_named(message).into_iter().find(|e| matches(e)) {
                return event;
            }
            if Instant::now() > deadline {
                let log: Vec<String> = self.events().iter().map(|e| e.json.to_string()).collect();
                panic!(
                    "{}: no {message:?} event within {timeout:?}; log:\n{}",
                    self.node,
                    log.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
