//! The collector: removes the physical objects no mapping names — uploads refused at
//! their commit, objects whose mapping moved on (an overwrite, a delete), uploads of a
//! gateway that died before its commit — and the intents of uploads older than
//! `--s3-upload-max-age`.
//!
//! One sweep of a bucket's resource, in this order:
//!
//! 1. list the physical keys under `.fencegate/<resource>/` upstream;
//! 2. read the resource's intents: an intent older than the upload bound is deleted
//!    (a fenced delete at the resource's current token), and its multipart upload
//!    aborted; the others keep their physical keys;
//! 3. read the resource's mappings: each keeps its physical key;
//! 4. delete each listed key that nothing keeps and that is older than `--s3-gc-grace`.
//!
//! Why no mapping can ever name a deleted key: an object is uploaded only after its
//! intent was written, so a key listed in 1 had its intent in the store before 2 read
//! it; the intent is either still there in 2 (kept), or its commit replaced it by a
//! mapping atomically before 2, which 3 then reads — unless another write replaced
//! that mapping since, and then it is garbage, which only readers that resolved the
//! old mapping in the last `--s3-gc-grace` could still be reading. An intent the
//! collector deleted can no longer be committed: the commit requires it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use fencegate_proto::headers::{Fencing, Precondition};
use fencegate_proto::{ResourceName, Token};
use tokio_util::sync::CancellationToken;

use super::layout::{self, Intent, Mapping};
use super::upstream::Upstream;
use crate::coordinator::{Coordinator, FrontDoor};
use crate::store::{Write, WriteOp};

/// Store objects read per call.
const BATCH: usize = 1000;

/// How the collector runs (`--s3-gc-interval`, `--s3-gc-grace`, `--s3-upload-max-age`).
#[derive(Debug, Clone, Copy)]
pub struct CollectorOptions {
    pub interval: Duration,
    pub grace: Duration,
    pub upload_max_age: Duration,
}

/// What one sweep removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    pub objects: usize,
    pub intents: usize,
}

pub struct Collector {
    pub(super) coordinator: Arc<Coordinator>,
    pub(super) upstream: Upstream,
    /// Every (bucket, resource) whose physical objects the door may have written.
    pub(super) places: Vec<(String, ResourceName)>,
    pub(super) options: CollectorOptions,
}

/// Whether a listed physical object goes: nothing keeps it, and it was last modified
/// (an RFC 3339 time, as S3 lists it) more than `grace` before `now`. An object whose
/// time does not parse stays.
fn collectable(
    kept: bool,
    modified: &str,
    now: chrono::DateTime<chrono::Utc>,
    grace: chrono::TimeDelta,
) -> bool {
    let old = chrono::DateTime::parse_from_rfc3339(modified)
        .map(|at| now - at.with_timezone(&chrono::Utc) > grace)
        .unwrap_or(false);
    old && !kept
}

impl Collector {
    /// Sweeps every place once per interval until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.options.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = shutdown.cancelled() => return,
            }
            for (bucket, resource) in &self.places {
                let swept = self.sweep(bucket, resource).await;
                if let Ok(swept) = &swept {
                    let metrics = self.coordinator.metrics();
                    metrics.s3_collected("object", swept.objects);
                    metrics.s3_collected("intent", swept.intents);
                }
                match swept {
                    Ok(swept) if swept != Swept::default() => tracing::info!(
                        bucket = bucket.as_str(),
                        resource = resource.as_str(),
                        objects = swept.objects,
                        intents = swept.intents,
                        "S3 door: collected unreferenced uploads"
                    ),
                    Ok(_) => {}
                    Err(error) => tracing::warn!(
                        bucket = bucket.as_str(),
                        resource = resource.as_str(),
                        %error,
                        "S3 door: a collector sweep failed; the next one retries"
                    ),
                }
            }
        }
    }

    /// One sweep of `resource`'s physical objects in `bucket`.
    pub async fn sweep(&self, bucket: &str, resource: &ResourceName) -> Result<Swept, String> {
        let mut swept = Swept::default();
        let root = format!("{}{resource}/", layout::PHYSICAL_ROOT);
        let mut listed = Vec::new();
        let mut continuation = None;
        loop {
            let (page, next) = self
                .upstream
                .list(bucket, &root, continuation.as_deref())
                .await
                .map_err(|e| e.to_string())?;
            listed.extend(page);
            match next {
                Some(next) => continuation = Some(next),
                None => break,
            }
        }
        let mut kept: HashSet<String> = HashSet::new();
        let now = chrono::Utc::now();
        let max_age = chrono::Duration::from_std(self.options.upload_max_age)
            .unwrap_or(chrono::TimeDelta::MAX);
        for (key, value) in self.all(resource, "s3-intent/").await? {
            let intent = Intent::decode(&value, resource)?;
            let created =
                chrono::DateTime::from_timestamp_millis(intent.created_at_ms).unwrap_or(now);
            if now - created > max_age && self.drop_intent(resource, &key, &intent).await {
                swept.intents += 1;
            } else {
                kept.insert(intent.physical);
            }
        }
        for (_, value) in self.all(resource, &layout::mapping_root(bucket)).await? {
            kept.insert(Mapping::decode(&value, resource)?.physical);
        }
        let grace =
            chrono::Duration::from_std(self.options.grace).unwrap_or(chrono::TimeDelta::MAX);
        for (key, modified) in listed {
            if collectable(kept.contains(&key), &modified, now, grace) {
                self.upstream
                    .delete(bucket, &key)
                    .await
                    .map_err(|e| e.to_string())?;
                swept.objects += 1;
            }
        }
        Ok(swept)
    }

    /// Every live store object of `resource` under `prefix`.
    async fn all(
        &self,
        resource: &ResourceName,
        prefix: &str,
    ) -> Result<Vec<(String, bytes::Bytes)>, String> {
        let mut found = Vec::new();
        loop {
            let after = found
                .last()
                .map(|(key, _): &(String, bytes::Bytes)| key.clone());
            let page = self
                .coordinator
                .list(resource, prefix, after.as_deref(), BATCH)
                .await
                .map_err(|e| e.to_string())?;
            let more = page.len() == BATCH;
            found.extend(page);
            if !more {
                return Ok(found);
            }
        }
    }

    /// Deletes an abandoned upload's intent, so that it can never be committed, and
    /// aborts its multipart upload; false if the intent stays (a newer term raced the
    /// delete, or the store failed): the next sweep tries again.
    async fn drop_intent(&self, resource: &ResourceName, key: &str, intent: &Intent) -> bool {
        let Ok(key) = fencegate_proto::ObjectKey::new(key) else {
            return false;
        };
        let highest = match self.coordinator.fence(resource).await {
            Ok(highest) => highest,
            Err(_) => return false,
        };
        let Some(token) = highest.or_else(|| Token::new(intent.token).ok()) else {
            return false;
        };
        let fencing = Fencing {
            token,
            holder: Some("fencegate-s3-collector".into()),
        };
        let write = Write {
            resource: resource.clone(),
            key,
            token,
            precondition: Precondition::MustExist,
            op: WriteOp::Delete,
        };
        if self
            .coordinator
            .write(write, &fencing, None, FrontDoor::S3)
            .await
            .is_err()
        {
            return false;
        }
        if let Some(upload_id) = &intent.upload_id {
            let _ = self
                .upstream
                .abort_multipart(&intent.bucket, &intent.physical, upload_id)
                .await;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_old_objects_nothing_keeps_are_collected() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-12-07T12:00:00Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        let grace = chrono::TimeDelta::hours(1);
        let two_hours_ago = "2026-12-07T10:00:00.000Z";
        let a_minute_ago = "2026-12-07T11:59:00.000Z";
        assert!(collectable(false, two_hours_ago, now, grace));
        assert!(
            !collectable(true, two_hours_ago, now, grace),
            "a mapping keeps it"
        );
        assert!(
            !collectable(false, a_minute_ago, now, grace),
            "within the grace"
        );
        assert!(
            !collectable(false, "yesterday", now, grace),
            "an unreadable time"
        );
    }
}
