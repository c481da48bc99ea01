//! The request coordinator: what every handler goes through to reach the backend.
//!
//! # Behavior
//!
//! - Every backend call — a write, an advance, a SQL transaction, a read, a readiness
//!   probe — runs through [`Coordinator::detached`], in a task of its own: a client that
//!   disconnects cannot cancel a call between its commit and the fence cache's update,
//!   nor leave a connection half-used. The call records what it committed itself.
//! - The fence cache is raised only from committed results ([`Coordinator::committed`]),
//!   so it never holds a token above the durable one, and a rejection from it
//!   ([`Coordinator::check_cached`]) is always correct.
//! - Every stale rejection, wherever it was decided, goes through
//!   [`Coordinator::stale`]: counted, logged within the `--stale-log-limit` budget, and
//!   turned into the one `409 stale_token` answer.
//! - The bounds of the process (writes in flight, request bodies in memory) are handed
//!   out as permits that the request holds until it is answered.
//!
//! # Parts
//!
//! - `admit`: the checks before a write, in their one order, each in a file of its own:
//!   `cache_check` (the fence cache), `permits` (the bounds, with `shares`, each
//!   client's share of them), `issuer_check` (the token's issuer).
//! - `fence_cache`: the highest committed token per resource, for early rejections.
//! - `rejections`: stale and unissued tokens refused, counted and logged, from either
//!   front door.
//! - `issuers`: the lease stores whose tokens the gateway checks.
//! - `leases`, `txn`, `sql`, `answers`: hosted leases, multi-resource transactions,
//!   fenced SQL transactions, and the keyed answers of all three.
//! - `resets`, `audit`, `authority`: fence resets applied and followed; the fence audit
//!   of a new server; the older-term sessions that new terms ended (the store ends
//!   them) and the issuer bindings, followed.
//! - `replication`, `readiness`: the replication watch; the store's readiness.

mod admit;
mod answers;
mod audit;
mod authority;
mod cache_check;
mod fence_cache;
mod issuer_check;
pub(crate) mod issuers;
mod leases;
mod permits;
mod readiness;
mod rejections;
mod replication;
mod resets;
mod shares;
mod sql;
mod txn;

pub use admit::FencedRequest;
pub use answers::{AnswersFull, Gate};
pub use permits::{BodyMemory, WritePermit};
pub use rejections::FrontDoor;
pub use shares::ClientKey;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use fencegate_proto::headers::Fencing;
use fencegate_proto::{ErrorCode, ObjectKey, ResourceName, Token};
use tokio_util::sync::CancellationToken;

use crate::auth::Authenticator;
use crate::config::{AuthArgs, Config};
use crate::error::{ApiError, Overload};
use crate::log_budget::LogBudget;
use crate::metrics::Metrics;
use crate::sql::SqlEndpoint;
use crate::store::{AdvanceOutcome, Store, StoreError, StoredObject, Write, WriteOutcome};
use fence_cache::{CacheGeneration, FenceCache};
use issuers::Issuers;
use rejections::Rejected;

/// The shared state of a running gateway, and the steps of every backend call. Each
/// part of the state is owned by the file that reads it, and built from its flags'
/// group.
pub struct Coordinator {
    /// Who may do what.
    access: Access,
    store: Store,
    /// Fenced SQL transactions (`/v1/sql`), if this gateway runs them.
    sql: SqlEndpoint,
    /// Highest committed token per resource; see its module for the invariant.
    cache: FenceCache,
    /// Test-only (`--no-cache-rejections`): the cache never rejects; the store decides.
    no_cache_rejections: bool,
    metrics: Metrics,
    /// The permits of writes and bodies, and the sizes and times of requests.
    bounds: permits::Bounds,
    /// Cancelled when shutdown begins: requests still receiving their body stop.
    shutdown: CancellationToken,
    stale_log: LogBudget,
    /// The issuers resources are bound to (`--issued-by`).
    issuers: Issuers,
    /// How far the reset log has been followed.
    resets: resets::ResetsFollowed,
    /// Whether the fences are due for an audit.
    audit: audit::AuditDue,
    /// The takeover log and the issuer bindings, followed.
    authority: authority::Authority,
    /// The bounds of keyed answers, and what the store says of them.
    answers: answers::AnswerBounds,
    /// The fence database's replication, as last read, and whether it is required.
    replication: replication::ReplicationWatch,
    /// The latest write probe of the store.
    write_probe: readiness::WriteProbe,
}

/// Who may do what: the identities of `--auth-file` (`None` when authentication is
/// off), or the administrator's key of a gateway without one (`--admin-key-file`).
struct Access {
    auth: Option<Arc<Authenticator>>,
    admin_key: Option<crate::auth::AdminKey>,
}

impl Access {
    fn new(
        args: &AuthArgs,
        auth: Option<Arc<Authenticator>>,
    ) -> Result<Access, crate::auth::AuthFileError> {
        let admin_key = (args.admin_key_file.as_deref())
            .map(crate::auth::AdminKey::load)
            .transpose()?;
        Ok(Access { auth, admin_key })
    }
}

/// How often a gateway looks for fence resets made through other replicas.
pub const RESET_POLL: Duration = Duration::from_secs(1);

/// How often a gateway reports the answers it stored and reads which of their bounds
/// are met ([`answers`]).
pub const ANSWERS_REPORT: Duration = Duration::from_secs(1);

/// A write that was applied and committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppliedWrite {
    /// The object's version after the write.
    pub version: u64,
    /// The object did not exist before (a put only).
    pub created: bool,
}

/// What the gateway starts before its coordinator, which takes them over.
pub struct Parts {
    /// The gateway's one shutdown, which both listeners follow too.
    pub shutdown: CancellationToken,
    pub store: Store,
    pub sql: SqlEndpoint,
    pub metrics: Metrics,
    pub auth: Option<Arc<Authenticator>>,
    pub issuers: Issuers,
    /// The generation of the issuer bindings recorded in the database, if it has them.
    pub bindings_generation: Option<i64>,
}

impl Coordinator {
    pub fn new(config: &Config, parts: Parts) -> Result<Coordinator, crate::auth::AuthFileError> {
        let Parts {
            shutdown,
            store,
            sql,
            metrics,
            auth,
            issuers,
            bindings_generation,
        } = parts;
        Ok(Coordinator {
            access: Access::new(&config.auth, auth)?,
            store,
            sql,
            cache: FenceCache::new(config.store.cache_size),
            no_cache_rejections: config.store.no_cache_rejections,
            metrics,
            bounds: permits::Bounds::new(&config.limits, &config.http),
            shutdown,
            stale_log: LogBudget::new(config.logging.stale_log_limit),
            issuers,
            resets: resets::ResetsFollowed::default(),
            audit: audit::AuditDue::default(),
            authority: authority::Authority::new(bindings_generation),
            answers: answers::AnswerBounds::new(&config.idempotency),
            replication: replication::ReplicationWatch::new(&config.replication),
            write_probe: readiness::WriteProbe::default(),
        })
    }

    /// Starts the coordinator's background tasks, which run until shutdown — the
    /// auth file's reloads, the summary of unlogged rejections, the expiry and the
    /// reports of keyed answers, the resets and takeovers followed with the fence audit,
    /// the replication and issuer watches — after the first write probe and the first
    /// reading of the replication, which it returns for the ready line.
    pub async fn start(self: &Arc<Self>) -> Option<replication::ReplicationReading> {
        if let Some(auth) = &self.access.auth {
            tokio::spawn(Arc::clone(auth).watch());
        }
        Coordinator::audit_new_servers(self);
        tokio::spawn(Arc::clone(self).summarise_unlogged_rejections());
        let expire_every = (self.idempotency_ttl() / 4).min(Duration::from_secs(60));
        tokio::spawn(Arc::clone(self).expire_idempotency(expire_every));
        tokio::spawn(Arc::clone(self).follow_answers(ANSWERS_REPORT));
        self.start_following_resets().await;
        tokio::spawn(Arc::clone(self).follow_resets());
        // One write probe before the first /readyz, so that fencegate_store_writable says
        // from the start whether the store takes writes (a failure is logged by the probe).
        if let Err(error) = self.writable().await {
            tracing::warn!(%error, "the store could not be probed for writes at start");
        }
        let replication = self.check_replication().await;
        tokio::spawn(Arc::clone(self).watch_replication());
        tokio::spawn(Arc::clone(self).watch_issuers());
        replication
    }

    /// The administrator's key of a gateway without --auth-file, if it has one.
    pub fn admin_key(&self) -> Option<&crate::auth::AdminKey> {
        self.access.admin_key.as_ref()
    }

    /// The identities and grants requests are checked against, if authentication is on.
    pub fn authenticator(&self) -> Option<&Authenticator> {
        self.access.auth.as_deref()
    }

    /// One line for the start-up log: which backend, and where (no secrets).
    pub fn describe_backend(&self) -> String {
        self.store.describe()
    }

    /// Cancelled once shutdown has begun.
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// Records a request's answer in the request metrics.
    pub fn answered(&self, route: &str, outcome: Option<ErrorCode>, elapsed: Duration) {
        self.metrics.answered(route, outcome, elapsed);
    }

    /// The metrics, in Prometheus's text format.
    pub fn encode_metrics(&self) -> Vec<u8> {
        self.metrics.set_cache_entries(self.cache.len());
        self.metrics.encode()
    }

    /// The generation of the fence cache now, for a backend call about to start.
    pub(super) fn seen(&self) -> CacheGeneration {
        self.cache.seen()
    }

    /// Runs a backend call in its own task, started at once; see the module doc.
    ///
    /// Not an `async fn`: that would hold `call` — a whole backend future — inside the
    /// request's own future until its first poll, and every request's future would be
    /// as large as the largest backend call, moved in memory with each request.
    pub(super) fn detached<T: Send + 'static>(
        &self,
        call: impl Future<Output = T> + Send + 'static,
    ) -> impl Future<Output = Result<T, ApiError>> + Send + 'static {
        let task = tokio::spawn(call);
        async move {
            task.await.map_err(|error| {
                StoreError::Internal(format!("backend task failed: {error}")).into()
            })
        }
    }

    /// A store call run detached ([`Coordinator::detached`]) whose result the task
    /// itself records in the backend's readiness and error metrics
    /// ([`Coordinator::backend_result`]): a client that leaves does not hide a store
    /// failure.
    pub(super) fn store_call<T: Send + 'static>(
        self: &Arc<Self>,
        call: impl Future<Output = Result<T, StoreError>> + Send + 'static,
    ) -> impl Future<Output = Result<Result<T, StoreError>, ApiError>> + Send + 'static {
        let this = Arc::clone(self);
        self.detached(async move {
            let result = call.await;
            this.backend_result(&result);
            result
        })
    }

    /// Applies a fenced write.
    pub async fn write(
        self: &Arc<Self>,
        write: Write,
        fencing: &Fencing,
        identity: Option<&str>,
        door: FrontDoor,
    ) -> Result<AppliedWrite, ApiError> {
        let this = Arc::clone(self);
        let seen = self.seen();
        let (write, outcome) = self
            .detached(async move {
                let outcome = this.store.write(&write).await;
                if let Ok(WriteOutcome::Applied { .. }) = outcome {
                    this.committed(&write.resource, write.token, seen);
                }
                this.backend_result(&outcome);
                (write, outcome)
            })
            .await?;
        match outcome? {
            WriteOutcome::Applied { version, created } => Ok(AppliedWrite { version, created }),
            WriteOutcome::Stale { highest } => {
                let key = Some(&write.key);
                let rejected = Rejected {
                    resource: &write.resource,
                    key,
                    fencing,
                    identity,
                    highest,
                    door,
                };
                Err(self.stale(&rejected, seen))
            }
            WriteOutcome::PreconditionFailed { current } => {
                Err(ApiError::VersionMismatch { current })
            }
        }
    }

    /// Raises a resource's fence without writing an object.
    pub async fn advance(
        self: &Arc<Self>,
        resource: &ResourceName,
        fencing: &Fencing,
        identity: Option<&str>,
    ) -> Result<(), ApiError> {
        let this = Arc::clone(self);
        let (task_resource, token) = (resource.clone(), fencing.token);
        let seen = self.seen();
        let outcome = self
            .store_call(async move {
                let outcome = this.store.advance(&task_resource, token).await;
                if let Ok(AdvanceOutcome::Applied) = outcome {
                    this.committed(&task_resource, token, seen);
                }
                outcome
            })
            .await?;
        match outcome? {
            AdvanceOutcome::Applied => Ok(()),
            AdvanceOutcome::Stale { highest } => {
                let door = FrontDoor::Http;
                let rejected = Rejected {
                    resource,
                    key: None,
                    fencing,
                    identity,
                    highest,
                    door,
                };
                Err(self.stale(&rejected, seen))
            }
        }
    }

    /// Reads an object; `None` if it does not exist. `admit` is asked, with the
    /// value's length, before the value is copied into memory (the HTTP API admits it
    /// under the response budget, [`crate::api::body`]): values read but not admitted
    /// never pile up.
    pub async fn get<P: Send + 'static>(
        self: &Arc<Self>,
        resource: &ResourceName,
        key: &ObjectKey,
        admit: impl FnOnce(usize) -> Result<P, Overload> + Send + 'static,
    ) -> Result<Option<(StoredObject, P)>, ApiError> {
        let (this, resource, key) = (Arc::clone(self), resource.clone(), key.clone());
        let result = self
            .store_call(async move { this.store.get(&resource, &key, admit).await })
            .await?;
        Ok(result?.transpose()?)
    }

    /// Lists live objects of `resource` under a key prefix ([`Store::list`]).
    pub async fn list(
        self: &Arc<Self>,
        resource: &ResourceName,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, bytes::Bytes)>, ApiError> {
        let (this, resource) = (Arc::clone(self), resource.clone());
        let (prefix, after) = (prefix.to_owned(), after.map(str::to_owned));
        let result = self
            .store_call(async move {
                this.store
                    .list(&resource, &prefix, after.as_deref(), limit)
                    .await
            })
            .await?;
        Ok(result?)
    }

    /// Reads a resource's committed highest token, and caches it.
    pub async fn fence(
        self: &Arc<Self>,
        resource: &ResourceName,
    ) -> Result<Option<Token>, ApiError> {
        let (this, resource) = (Arc::clone(self), resource.clone());
        let seen = self.seen();
        let result = self
            .store_call(async move {
                let result = this.store.fence(&resource).await;
                if let Ok(Some(highest)) = result {
                    this.committed(&resource, highest, seen);
                }
                result
            })
            .await?;
        Ok(result?)
    }

    /// Records that `token` is committed for `resource`, by a backend call that started
    /// at `seen`.
    pub(super) fn committed(&self, resource: &ResourceName, token: Token, seen: CacheGeneration) {
        if self.cache.raise_seen(resource, token, seen).changed {
            self.metrics.highest_raised(resource, token);
        }
    }

    /// The key of the in-database fence's proofs (the Postgres backend only).
    pub fn proof_key(&self) -> Option<&crate::dbfence::ProofKey> {
        match &self.store {
            Store::Postgres(pg) => Some(&pg.keys().proof),
            Store::Embedded(_) => None,
        }
    }

    /// The metrics, for the Postgres door's own.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Keeps `fencegate_backend_errors_total` and `fencegate_backend_ready` current.
    pub(super) fn backend_result<T>(&self, result: &Result<T, StoreError>) {
        match result {
            Ok(_) => self.backend_succeeded(),
            Err(error) => self.backend_failed(error),
        }
    }

    /// The backend answered: it is ready.
    pub(super) fn backend_succeeded(&self) {
        self.metrics.backend_ready(true);
    }

    /// The backend failed: counted, and if it could not be reached, not ready and the
    /// fences suspect ([`audit`]).
    pub(super) fn backend_failed(&self, error: &StoreError) {
        self.metrics.backend_error(error.kind());
        if let StoreError::Unavailable { reason, .. } = error {
            self.metrics.backend_ready(false);
            if !matches!(reason, crate::store::UnavailableReason::LockTimeout) {
                self.suspect_fences();
            }
        } else {
            tracing::error!(%error, "backend error");
        }
    }
}
