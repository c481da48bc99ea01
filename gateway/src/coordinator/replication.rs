//! Durability, made visible and enforceable (Postgres).
//!
//! At start and every [`REPLICATION_CHECK`] the gateway reads how the fence database
//! replicates the commits of its sessions ([`crate::store::postgres::replication`]),
//! and, with `--patroni-url`, Patroni's synchronous mode. It exports what it read
//! (`fencegate_backend_synchronous_standbys`, `fencegate_backend_synchronous_replication`,
//! `fencegate_backend_timeline`, `fencegate_backend_patroni_synchronous_mode`), logs
//! every change of "synchronously replicated", and — with
//! `--require-synchronous-replication` — refuses writes, fence raises and lease steps
//! with `503 not_synchronously_replicated` while the last reading was not synchronous,
//! or could not be taken.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::Coordinator;
use crate::config::ReplicationArgs;
use crate::error::ApiError;
use crate::store::postgres::replication::{patroni_config, PatroniConfig, Replication};
use crate::store::Store;

/// How often the replication of the fence database is read.
pub const REPLICATION_CHECK: Duration = Duration::from_secs(1);

/// How long Patroni's REST API may take to answer.
const PATRONI_TIMEOUT: Duration = Duration::from_secs(2);

/// The fence database's replication as last read, where to read Patroni's, and whether
/// writes require it synchronous.
pub(super) struct ReplicationWatch {
    /// `--require-synchronous-replication`.
    required: bool,
    /// Patroni's REST APIs (`--patroni-url`), read in order until one answers.
    patroni_urls: Vec<String>,
    /// Which of them answered last: the first one tried next time.
    patroni_answered: AtomicUsize,
    /// The last reading was synchronous.
    synchronous: AtomicBool,
}

impl ReplicationWatch {
    pub(super) fn new(args: &ReplicationArgs) -> ReplicationWatch {
        ReplicationWatch {
            required: args.require_synchronous_replication,
            patroni_urls: args.patroni_url.clone(),
            patroni_answered: AtomicUsize::new(0),
            synchronous: AtomicBool::new(false),
        }
    }
}

/// What one reading found, for the ready line.
#[derive(Debug, Clone)]
pub struct ReplicationReading {
    pub replication: Replication,
    pub timeline: i64,
    pub patroni: Option<PatroniConfig>,
}

impl ReplicationReading {
    /// The ready line's words for it.
    pub fn describe(&self) -> String {
        let r = &self.replication;
        let mut text = format!(
            "{} (synchronous_commit={}, synchronous_standby_names='{}', {} synchronous standby(s) streaming",
            if r.synchronous() {
                "synchronous"
            } else {
                "NOT synchronous"
            },
            r.synchronous_commit,
            r.synchronous_standby_names,
            r.synchronous_standbys
        );
        if r.hidden > 0 {
            text.push_str(&format!(
                ", {} standby(s) hidden from this role: grant it pg_monitor",
                r.hidden
            ));
        }
        if let Some(patroni) = self.patroni {
            text.push_str(&format!(
                ", Patroni synchronous_mode={} synchronous_mode_strict={}",
                patroni.synchronous_mode, patroni.synchronous_mode_strict
            ));
        }
        text.push(')');
        text
    }
}

impl Coordinator {
    /// Reads, records and returns how the fence database replicates; `None` for the
    /// embedded store, or when the database cannot be read (then nothing is
    /// synchronous).
    pub(super) async fn check_replication(&self) -> Option<ReplicationReading> {
        let Store::Postgres(store) = &self.store else {
            return None;
        };
        // Both at once: a Patroni node that does not answer delays nothing else.
        let (patroni, replication) = tokio::join!(self.read_patroni(), store.replication());
        self.metrics.patroni_synchronous_mode(
            patroni.map(|config| (config.synchronous_mode, config.synchronous_mode_strict)),
        );
        let reading = match replication {
            Ok((replication, server)) => ReplicationReading {
                replication,
                timeline: server.timeline,
                patroni,
            },
            Err(error) => {
                tracing::debug!(%error, "could not read the fence database's replication");
                self.replicated(false);
                return None;
            }
        };
        let r = &reading.replication;
        self.metrics
            .backend_replication(r.synchronous_standbys, r.synchronous(), reading.timeline);
        self.replicated(r.synchronous());
        Some(reading)
    }

    /// Patroni's configuration from the first of `--patroni-url` that answers, starting
    /// with the one that answered last; `None` without the flag, or if none does (then
    /// a warning with each one's error).
    async fn read_patroni(&self) -> Option<PatroniConfig> {
        let urls = &self.replication.patroni_urls;
        let first = self.replication.patroni_answered.load(Ordering::Relaxed);
        let mut errors = Vec::new();
        for at in (0..urls.len()).map(|n| (first + n) % urls.len()) {
            match patroni_config(&urls[at], PATRONI_TIMEOUT).await {
                Ok(config) => {
                    self.replication
                        .patroni_answered
                        .store(at, Ordering::Relaxed);
                    return Some(config);
                }
                Err(error) => errors.push(format!("{}: {error}", urls[at])),
            }
        }
        if !errors.is_empty() {
            tracing::warn!(
                errors = errors.join("; "),
                "could not read Patroni's configuration from any --patroni-url"
            );
        }
        None
    }

    /// Records whether the fence database is synchronously replicated, logging changes.
    fn replicated(&self, synchronous: bool) {
        let before = self
            .replication
            .synchronous
            .swap(synchronous, Ordering::AcqRel);
        if before && !synchronous {
            tracing::warn!(
                refusing = self.replication.required,
                "the fence database has no synchronous standby: a failover now may lose \
                 acknowledged writes and fence raises"
            );
        } else if !before && synchronous {
            tracing::info!("the fence database is synchronously replicated");
        }
    }

    /// Reads the replication every [`REPLICATION_CHECK`], until shutdown.
    pub(super) async fn watch_replication(self: Arc<Self>) {
        if !matches!(self.store, Store::Postgres(_)) {
            return;
        }
        let mut tick = tokio::time::interval(REPLICATION_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.shutdown.cancelled() => return,
            }
            self.check_replication().await;
        }
    }

    /// Whether the Postgres door may open a session now: the server the store reaches
    /// was audited (a session that writes with an older term must find the fences
    /// restored), and — with `--require-synchronous-replication` — the database is
    /// synchronously replicated.
    pub async fn door_admits(&self) -> Result<(), ApiError> {
        self.require_replication()?;
        if let Store::Postgres(store) = &self.store {
            store.audited().await.map_err(ApiError::Store)?;
        }
        Ok(())
    }

    /// Refuses a write, raise or lease step while the fence database is not known to be
    /// synchronously replicated, if `--require-synchronous-replication` asks for it.
    pub(super) fn require_replication(&self) -> Result<(), ApiError> {
        let watch = &self.replication;
        if watch.required && !watch.synchronous.load(Ordering::Acquire) {
            return Err(ApiError::NotSynchronouslyReplicated);
        }
        Ok(())
    }
}
