//! Transactions and keyed writes through the coordinator: the store applies them
//! ([`crate::store::txn`]); the coordinator raises the fence cache from what committed,
//! counts and logs every stale resource, counts what became of each key, and removes
//! expired answers in the background.

use std::sync::Arc;
use std::time::Duration;

use fencegate_proto::headers::Fencing;

use super::Coordinator;
use crate::error::ApiError;
use crate::store::txn::{Answered, Hold, Keyed, Txn, TxnOutcome};

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
    ) -> Result<Answered, ApiError> {
        let this = Arc::clone(self);
        let seen = self.seen();
        let task_txn = Arc::clone(&txn);
        let was_keyed = keyed.is_some();
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
                if let (true, Ok(answered)) = (was_keyed, &answered) {
                    this.metrics.idempotency(answered.key_outcome());
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
                let key = txn
                    .ops()
                    .iter()
                    .find(|op| op.resource() == &member.resource)
                    .and_then(|op| op.object().map(|(key, _)| key));
                // The answer is rendered from the outcome; this counts and logs.
                self.count_stale(
                    &member.resource,
                    key,
                    &fencing,
                    identity,
                    member.highest,
                    seen,
                );
            }
        }
        Ok(answered)
    }

    /// Removes expired answers of keyed writes, every `every`, until shutdown. Touches
    /// no fence: a cleanup never holds a fence lock.
    pub async fn expire_idempotency(self: Arc<Self>, every: Duration) {
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
