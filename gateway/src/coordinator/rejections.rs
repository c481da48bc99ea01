//! Stale and unissued tokens refused: from the fence cache before any work
//! ([`super::cache_check`]), by the store, or by the in-database fence through either
//! front door — each counted in the metrics and logged within the `--stale-log-limit`
//! budget, whichever way it came.

use std::sync::Arc;
use std::time::Duration;

use fencegate_proto::headers::Fencing;
use fencegate_proto::{ObjectKey, ResourceName, Token};

use super::fence_cache::CacheGeneration;
use super::Coordinator;
use crate::dbfence::{FenceRejection, Reported};
use crate::error::ApiError;

/// Which front door — the HTTP API or the Postgres door — a rejected write came
/// through, for the log and the metrics. (Not `pgdoor::Door`, the Postgres
/// door itself.)
#[derive(Debug, Clone, Copy)]
pub enum FrontDoor {
    Http,
    Postgres,
    S3,
}

impl FrontDoor {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FrontDoor::Http => "http",
            FrontDoor::Postgres => "pg",
            FrontDoor::S3 => "s3",
        }
    }
}

/// The facts of a stale rejection, as logged.
#[derive(Clone, Copy)]
pub(super) struct Rejected<'a> {
    pub(super) resource: &'a ResourceName,
    pub(super) key: Option<&'a ObjectKey>,
    pub(super) fencing: &'a Fencing,
    /// The authenticated caller; `None` when authentication is off.
    pub(super) identity: Option<&'a str>,
    pub(super) highest: Token,
    pub(super) door: FrontDoor,
}

impl Coordinator {
    /// Logs, once a second while a stale flood lasts, how many "stale write rejected"
    /// lines `--stale-log-limit` left out; runs until shutdown.
    pub(super) async fn summarise_unlogged_rejections(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.shutdown.cancelled() => return,
            }
            let unlogged = self.stale_log.take_refused();
            if unlogged > 0 {
                tracing::warn!(
                    unlogged,
                    limit = self.stale_log.limit,
                    "stale write rejections not logged (--stale-log-limit); metrics count every one"
                );
            }
        }
    }

    /// Counts and logs a stale rejection (within the `--stale-log-limit` budget), and
    /// returns the error to answer with. `rejected.highest` must be a committed token
    /// above the presented one.
    pub(super) fn stale(&self, rejected: &Rejected<'_>, seen: CacheGeneration) -> ApiError {
        self.count_stale(rejected, seen);
        ApiError::Stale {
            resource: rejected.resource.clone(),
            presented: rejected.fencing.token,
            highest: rejected.highest,
        }
    }

    /// Counts and logs a stale rejection as [`Coordinator::stale`] does, for an answer
    /// built elsewhere (a transaction's, rendered from its outcome).
    pub(super) fn count_stale(&self, rejected: &Rejected<'_>, seen: CacheGeneration) {
        let rejections = self
            .cache
            .count_rejection(rejected.resource, rejected.highest, seen);
        self.record_stale(rejected, rejections);
    }

    /// Counts and logs `rejected`, the resource's `rejections`-th, and returns the error
    /// to answer with.
    pub(super) fn rejected(&self, rejected: &Rejected<'_>, rejections: u64) -> ApiError {
        self.record_stale(rejected, rejections);
        ApiError::Stale {
            resource: rejected.resource.clone(),
            presented: rejected.fencing.token,
            highest: rejected.highest,
        }
    }

    /// Counts and logs what the in-database fence reported to `/v1/sql` or to a client of
    /// the Postgres door: a refusal the fence proved — a stale token, counted and logged
    /// as every stale rejection, or a token its issuer never issued — or a `ZF001`/`ZF005`
    /// that anyone's SQL raised, which is counted apart and changes no rejection count.
    /// The fence cache never learns from either: the database reports from inside the
    /// failed transaction, which may itself have raised the fence — and that raise is
    /// rolled back with it.
    pub fn db_refusal(&self, reported: &Reported, holder: Option<String>, door: FrontDoor) {
        match reported {
            Reported::Proven(FenceRejection::Stale(rejection)) => {
                let fencing = Fencing {
                    token: rejection.presented,
                    holder,
                };
                let resource = &rejection.resource;
                let rejections = self.cache.count_reported_rejection(resource);
                let rejected = Rejected {
                    resource,
                    key: None,
                    fencing: &fencing,
                    identity: None,
                    highest: rejection.highest,
                    door,
                };
                self.record_stale(&rejected, rejections);
            }
            Reported::Proven(FenceRejection::NotIssued(rejection)) => {
                self.not_issued_in_database(rejection, door)
            }
            Reported::Unproven { code } => {
                self.metrics.forged_refusal(door.as_str());
                if self.stale_log.take_line().is_some() {
                    tracing::warn!(
                        sqlstate = *code,
                        door = door.as_str(),
                        "a fence error without the fence's proof: raised by SQL, not by the fence; not counted as a rejection"
                    );
                }
            }
        }
    }

    fn record_stale(&self, rejected: &Rejected<'_>, rejections: u64) {
        let Rejected {
            resource,
            key,
            fencing,
            identity,
            highest,
            door,
        } = *rejected;
        self.metrics
            .stale_rejected(resource, fencing.token, highest);
        self.metrics.door_stale_rejected(door.as_str());
        if let Some(unlogged) = self.stale_log.take_line() {
            tracing::warn!(
                resource = resource.as_str(),
                key = key.map(ObjectKey::as_str),
                presented = fencing.token.get(),
                highest = highest.get(),
                holder = fencing.holder.as_deref(),
                identity,
                outcome = "stale_token",
                door = door.as_str(),
                rejections,
                // Only present when the cap left lines out.
                unlogged = (unlogged > 0).then_some(unlogged),
                "stale write rejected"
            );
        }
    }
}
