//! The answers of keyed writes, bounded, and the keyed writes that do not run.
//!
//! # Behavior
//!
//! - Stored answers are bounded per identity (`--idempotency-identity-max-records`,
//!   `--idempotency-identity-max-bytes`; every client is one identity without
//!   `--auth-file`, as they share one key space) and in total
//!   (`--idempotency-max-bytes`), by a count in the store: Postgres keeps it from what
//!   every gateway reports about once a second ([`Coordinator::follow_answers`]), so
//!   that keyed writes of one identity never wait on a counter; the embedded store
//!   counts as it stores. A bound may so be passed by about a second's writes.
//! - A keyed write that may not run — its identity or the store at a bound, or its
//!   token below a fence the cache knows committed — is answered without a
//!   transaction ([`Coordinator::keyed_gate`]): from the answer an earlier attempt
//!   stored under its key (a replay, or `422` for another request), read alone; else
//!   refused (`429 idempotency_quota_exceeded`, or `409 stale_token`, stored nowhere).
//!   A stale write's earlier attempt that committed did so before the newer term's
//!   raise, which waits for it, so its answer is visible to that read; one that has
//!   not committed will find the raised fence and store the same refusal.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Coordinator;
use crate::config::IdempotencyArgs;
use crate::error::ApiError;
use crate::store::txn::{record_bytes, replay, Answered, IdentityBounds, Keyed};

/// Which bound of stored answers a keyed write met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswersFull {
    /// The identity's own.
    Identity,
    /// The store's, over every identity.
    Store,
}

/// The bounds of stored answers and what the gateway knows of their use.
pub(super) struct AnswerBounds {
    /// How long keyed answers are kept (`--idempotency-ttl`).
    ttl: Duration,
    identity: IdentityBounds,
    total_bytes: u64,
    /// Answers stored since the last report to the store: identity -> (records, bytes).
    unreported: Mutex<HashMap<String, (u64, u64)>>,
    /// Identities at their bound, as the store last said.
    full: Mutex<HashSet<String>>,
    /// The store at its bound, as it last said.
    store_full: AtomicBool,
}

impl AnswerBounds {
    pub(super) fn new(args: &IdempotencyArgs) -> AnswerBounds {
        AnswerBounds {
            ttl: args.idempotency_ttl,
            identity: IdentityBounds {
                records: args.idempotency_identity_max_records,
                bytes: args.idempotency_identity_max_bytes as u64,
            },
            total_bytes: args.idempotency_max_bytes as u64,
            unreported: Mutex::new(HashMap::new()),
            full: Mutex::new(HashSet::new()),
            store_full: AtomicBool::new(false),
        }
    }

    /// The bound `identity` is at, if any.
    fn full(&self, identity: &str) -> Option<AnswersFull> {
        if self.store_full.load(Ordering::Acquire) {
            return Some(AnswersFull::Store);
        }
        let full = self.full.lock().unwrap_or_else(|p| p.into_inner());
        full.contains(identity).then_some(AnswersFull::Identity)
    }
}

/// What a keyed write does, decided before it runs.
pub enum Gate<O> {
    /// It runs.
    Run,
    /// It is answered from an earlier attempt's record.
    Answered(Answered<O>),
    /// It is stale by the fence cache and no earlier attempt stored an answer: the
    /// caller answers as to the same write without a key.
    Stale,
}

impl Coordinator {
    /// How long keyed answers are kept (`--idempotency-ttl`).
    pub fn idempotency_ttl(&self) -> Duration {
        self.answers.ttl
    }

    /// Decides whether a keyed write runs, `stale` if the fence cache knows its token
    /// is below a committed one; see the module doc.
    pub(super) async fn keyed_gate<O: Send + 'static>(
        self: &Arc<Self>,
        keyed: &Keyed<O>,
        stale: bool,
    ) -> Result<Gate<O>, ApiError> {
        let full = self.answers.full(&keyed.identity);
        if !stale && full.is_none() {
            return Ok(Gate::Run);
        }
        let this = Arc::clone(self);
        let (identity, key) = (keyed.identity.clone(), keyed.key.clone());
        let found = self
            .store_call(async move { this.store.stored_answer(&identity, &key).await })
            .await??;
        if let Some((fingerprint, answer)) = found {
            let answered = replay(&fingerprint, keyed, answer);
            self.metrics.idempotency(answered.key_outcome());
            return Ok(Gate::Answered(answered));
        }
        match full {
            Some(bound) if !stale => {
                self.metrics.idempotency("quota_exceeded");
                Err(ApiError::IdempotencyQuotaExceeded(bound))
            }
            _ => {
                self.metrics.idempotency("stale");
                Ok(Gate::Stale)
            }
        }
    }

    /// Counts what became of a keyed write that ran, and an answer it stored.
    pub(super) fn keyed_ran<O>(&self, keyed: &Keyed<O>, answered: &Answered<O>) {
        self.metrics.idempotency(answered.key_outcome());
        let Answered::Ran {
            stored: Some(answer),
            ..
        } = answered
        else {
            return;
        };
        if self.store.counts_answers() {
            return;
        }
        let bytes = record_bytes(&keyed.identity, &keyed.key, answer);
        let mut unreported = self
            .answers
            .unreported
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (records, total) = unreported.entry(keyed.identity.clone()).or_default();
        *records += 1;
        *total += bytes;
    }

    /// Reports the answers stored since the last report to the store, and reads back
    /// which bounds are met, every `every`, until shutdown.
    pub(super) async fn follow_answers(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.shutdown.cancelled() => return,
            }
            self.report_answers().await;
        }
    }

    /// One report of [`Coordinator::follow_answers`].
    pub(super) async fn report_answers(&self) {
        let stored: Vec<(String, u64, u64)> = {
            let mut unreported = self
                .answers
                .unreported
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            unreported
                .drain()
                .map(|(identity, (records, bytes))| (identity, records, bytes))
                .collect()
        };
        match self
            .store
            .answer_usage(&stored, self.answers.identity)
            .await
        {
            Ok(usage) => {
                self.metrics.stored_answers(usage.records, usage.bytes);
                let store_full = usage.bytes >= self.answers.total_bytes;
                if store_full && !self.answers.store_full.load(Ordering::Acquire) {
                    tracing::warn!(
                        bytes = usage.bytes,
                        "stored answers of keyed writes reached --idempotency-max-bytes: keyed writes with new keys are refused until answers expire"
                    );
                }
                self.answers.store_full.store(store_full, Ordering::Release);
                let full: HashSet<String> = usage.full.into_iter().collect();
                let mut known = self.answers.full.lock().unwrap_or_else(|p| p.into_inner());
                for identity in full.difference(&known) {
                    tracing::warn!(
                        identity = identity.as_str(),
                        "an identity's stored answers reached its bound: its keyed writes with new keys are refused until answers expire"
                    );
                }
                *known = full;
            }
            Err(error) => {
                tracing::debug!(%error, "could not report the stored answers");
                let mut unreported = self
                    .answers
                    .unreported
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                for (identity, records, bytes) in stored {
                    let (had_records, had_bytes) = unreported.entry(identity).or_default();
                    *had_records += records;
                    *had_bytes += bytes;
                }
            }
        }
    }
}
