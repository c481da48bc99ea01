//! Authority that outlives a term, followed: the sessions of older terms that new
//! terms ended, and the issuer bindings every replica follows.
//!
//! # Behavior
//!
//! - The store ends the sessions of older terms that hold a fence a new term raises,
//!   on every path that raises one (`store::postgres::terms`).
//! - Every second the gateway reads the sessions ended since it last looked (by any
//!   replica or by the in-database fence), counts them
//!   (`fencegate_term_takeovers_total`) and logs each; and compares the issuer bindings
//!   in the database with its own flags ([`crate::store::postgres::bindings`]).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use super::Coordinator;
use crate::store::postgres::bindings::{describe, Drift};
use crate::store::Store;

/// How far this gateway has followed the takeover log, and the issuer bindings it
/// adopted.
pub(super) struct Authority {
    /// The last entry of the takeover log this gateway has counted.
    takeovers_followed: AtomicI64,
    /// The generation of the issuer bindings this gateway adopted (Postgres).
    bindings_generation: Option<i64>,
    /// Another gateway replaced the bindings (logged once).
    bindings_replaced: AtomicBool,
}

impl Authority {
    pub(super) fn new(bindings_generation: Option<i64>) -> Authority {
        Authority {
            takeovers_followed: AtomicI64::new(0),
            bindings_generation,
            bindings_replaced: AtomicBool::new(false),
        }
    }
}

impl Coordinator {
    /// Starts following the takeover log from its end.
    pub(super) async fn start_following_takeovers(&self) {
        if let Store::Postgres(pg) = &self.store {
            match pg.last_takeover().await {
                Ok(last) => self
                    .authority
                    .takeovers_followed
                    .store(last, Ordering::Release),
                Err(error) => tracing::warn!(%error, "could not read the takeover log"),
            }
        }
    }

    /// Counts and logs the older-term sessions ended since the last look, and compares
    /// the issuer bindings with this gateway's flags.
    pub(super) async fn follow_authority(&self) {
        let Store::Postgres(pg) = &self.store else {
            return;
        };
        let after = self.authority.takeovers_followed.load(Ordering::Acquire);
        match pg.takeovers_since(after).await {
            Ok(ended) => {
                for takeover in &ended.records {
                    let (resource, token) = (takeover.resource.as_str(), takeover.token);
                    let (pid, role) = (takeover.pid, takeover.role.as_str());
                    match takeover.ended_by.as_str() {
                        "key_holder" => tracing::warn!(
                            resource,
                            token,
                            pid,
                            role,
                            "the fence ended a session that held a resource's takeover key exclusively, which keeps writers from being found by a new term"
                        ),
                        ended_by => tracing::warn!(
                            resource,
                            token,
                            pid,
                            role,
                            ended_by,
                            "a new term ended a session of an older term that held its fence"
                        ),
                    }
                }
                let issued = u64::try_from(ended.last_id - after).unwrap_or(0);
                let unrecorded = issued.saturating_sub(ended.records.len() as u64);
                if unrecorded > 0 {
                    tracing::warn!(
                        ended = unrecorded,
                        "sessions were ended whose records are not in the takeover log: their raise failed and rolled the record back, or had not committed yet"
                    );
                }
                if issued > 0 {
                    self.authority
                        .takeovers_followed
                        .store(ended.last_id, Ordering::Release);
                    self.metrics.terms_taken_over(issued);
                }
            }
            Err(error) => tracing::debug!(%error, "could not read the takeover log"),
        }
        let Some(generation) = self.authority.bindings_generation else {
            return;
        };
        match pg
            .follow_bindings(self.issuers.bindings(), generation)
            .await
        {
            Ok(Drift::None) => self.metrics.issuer_bindings_drift(false),
            Ok(Drift::Restored { found }) => {
                self.metrics.issuer_bindings_restored();
                self.metrics.issuer_bindings_drift(false);
                tracing::error!(
                    found = describe(&found),
                    generation,
                    "the issuer bindings in the database were changed without --replace-issuer-bindings; this gateway restored its own"
                );
            }
            Ok(Drift::Replaced { generation: newer }) => {
                self.metrics.issuer_bindings_drift(true);
                if !self
                    .authority
                    .bindings_replaced
                    .swap(true, Ordering::AcqRel)
                {
                    tracing::error!(
                        generation,
                        newer,
                        "another gateway replaced the issuer bindings (--replace-issuer-bindings): this replica's --issued-by flags differ from what the in-database fence and the other replicas follow; restart it with the new flags"
                    );
                }
            }
            Err(error) => tracing::debug!(%error, "could not read the issuer bindings"),
        }
    }
}
