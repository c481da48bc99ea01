//! Transactions and keyed writes through the coordinator: the store applies them
//! ([`crate::store::txn`]); the coordinator raises the fence cache from what committed,
//! counts and logs every stale resource, counts what became of each key, and removes
//! expired answers in the background.

use std::sync::Arc;
use std::time::Duration;

use fencegate_proto::headers::Fencing;

use fencegate_proto::{ObjectKey, ResourceName};

use super::rejections::Rejected;
use super::{Coordinator, FrontDoor, Gate};
use crate::error::ApiError;
use crate::store::txn::{Answered, Hold, Keyed, StaleMember, Txn, TxnOutcome};

/// The object `txn` writes or checks on `resource`, if any (for the log of a stale
/// rejection).
fn object_key<'a>(txn: &'a Txn, resource: &ResourceName) -> Option<&'a ObjectKey> {
    txn.ops()
        .iter()
        .find(|op| op.resource() == resource)
        .and_then(|op| op.object().map(|(key, _)| key))
}

/// Expired answers removed per statement of the cleanup.
const EXPIRE_BATCH: u32 = 1000;

impl Coordinator {
    /// Applies `txn`, keyed or not. `holder` is the writer's `Fencing-Holder`, for the
    /// log of stale rejections.
    pub async fn txn(
        self: &Arc<Self>,
        txn: Arc<Txn>,
        keyed: Option<Keyed>,
        holder: Option<&str>,
        identity: Option<&str>,
        door: FrontDoor,
    ) -> Result<Answered, ApiError> {
        let seen = self.seen();
        // A transaction the fence cache knows stale is refused without one (a keyed
        // one unless an earlier attempt stored an answer; see `answers`).
        let stale = self.stale_members_by_cache(&txn);
        let gate = match &keyed {
            Some(keyed) => self.keyed_gate(keyed, !stale.is_empty()).await?,
            None if stale.is_empty() => Gate::Run,
            None => Gate::Stale,
        };
        match gate {
            Gate::Run => {}
            Gate::Answered(answered) => return Ok(answered),
            Gate::Stale => {
                for member in &stale {
                    self.metrics.cache_rejection();
                    let fencing = Fencing {
                        token: member.presented,
                        holder: holder.map(str::to_owned),
                    };
                    let key = object_key(&txn, &member.resource);
                    let rejected = Rejected {
                        resource: &member.resource,
                        key,
                        fencing: &fencing,
                        identity,
                        highest: member.highest,
                        door,
                    };
                    self.count_stale(&rejected, seen);
                }
                return Ok(Answered::Ran {
                    outcome: TxnOutcome::Stale(stale),
                    stored: None,
                });
            }
        }
        let this = Arc::clone(self);
        let task_txn = Arc::clone(&txn);
        self.metrics.txn_operations(txn.ops().len());
        let answered = self
            .detached(async move {
                let answered = this.store.txn(&task_txn, keyed.as_ref()).await;
                if let Ok(Answered::Ran {
                    outcome: TxnOutcome::Applied(_),
                    ..
                }) = &answered
                {
                    for involved in task_txn.involved() {
                        if involved.hold == Hold::Raise {
                            this.committed(&involved.resource, involved.token, seen);
                        }
                    }
                }
                this.backend_result(&answered);
                // Counted here, not after: a client that left must not hide its key.
                if let (Some(keyed), Ok(answered)) = (&keyed, &answered) {
                    this.keyed_ran(keyed, answered);
                }
                answered
            })
            .await??;
        if let Answered::Ran {
            outcome: TxnOutcome::Stale(members),
            ..
        } = &answered
        {
            for member in members {
                let fencing = Fencing {
                    token: member.presented,
                    holder: holder.map(str::to_owned),
                };
                let key = object_key(&txn, &member.resource);
                // The answer is rendered from the outcome; this counts and logs.
                let rejected = Rejected {
                    resource: &member.resource,
                    key,
                    fencing: &fencing,
                    identity,
                    highest: member.highest,
                    door,
                };
                self.count_stale(&rejected, seen);
            }
        }
        Ok(answered)
    }

    /// The resources of `txn` whose token is below a fence the cache knows committed.
    fn stale_members_by_cache(&self, txn: &Txn) -> Vec<StaleMember> {
        txn.involved()
            .iter()
            .filter_map(|involved| {
                let highest = self.cached_above(&involved.resource, involved.token)?;
                Some(StaleMember {
                    resource: involved.resource.clone(),
                    presented: involved.token,
                    highest,
                })
            })
            .collect()
    }

    /// Removes expired answers of keyed writes, every `every`, until shutdown. Touches
    /// no fence: a cleanup never holds a fence lock.
    pub(super) async fn expire_idempotency(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.shutdown.cancelled() => return,
            }
            loop {
                match self.store.expire_idempotency(EXPIRE_BATCH).await {
                    Ok(removed) => {
                        self.metrics.idempotency_expired(removed);
                        if removed < u64::from(EXPIRE_BATCH) {
                            break;
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "could not remove expired idempotency records; retrying later");
                        break;
                    }
                }
            }
        }
    }
}
