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
//! - `admit`: the checks before a write, in their one order.
//! - `bounds`, `shares`: the permits, and each client's share of them.
//! - `fence_cache`: the highest committed token per resource, for early rejections.
//! - `rejections`: stale and unissued tokens refused, counted and logged, from either
//!   front door.
//! - `issuers`, `issued`: the lease stores whose tokens the gateway checks, and the
//!   checks.
//! - `takeover`, `audit`, `replication`, `txn`: the older-term sessions that new terms
//!   ended (the store ends them) and the issuer bindings, followed; the fence audit of a
//!   new server, the replication watch, multi-resource transactions.

mod admit;
mod answers;
mod audit;
mod bounds;
mod fence_cache;
mod issued;
pub(crate) mod issuers;
mod rejections;
mod replication;
mod shares;
mod sql;
mod takeover;
mod txn;

pub use admit::Entry;
pub use answers::{AnswersFull, Gate};
pub use bounds::{BodyMemory, WritePermit};
pub use rejections::FrontDoor;
pub use shares::ClientKey;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

use fencegate_proto::headers::Fencing;
use fencegate_proto::{ErrorCode, ObjectKey, ResourceName, Token};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::auth::Authenticator;
use crate::config::Config;
use crate::error::{ApiError, Overload};
use crate::log_budget::LogBudget;
use crate::metrics::Metrics;
use crate::sql::SqlEndpoint;
use crate::store::{
    AdvanceOutcome, NotWritable, Store, StoreError, StoredObject, Write, WriteOutcome,
};
use fence_cache::{FenceCache, Seen};
use issuers::Issuers;

/// The shared state of a running gateway, and the steps of every backend call.
pub struct Coordinator {
    /// Who may do what (`--auth-file`); `None` when authentication is off.
    auth: Option<Arc<Authenticator>>,
    store: Store,
    /// Fenced SQL transactions (`/v1/sql`), if this gateway runs them.
    sql: SqlEndpoint,
    /// Highest committed token per resource; see its module for the invariant.
    cache: FenceCache,
    /// Test-only (`--no-cache-rejections`): the cache never rejects; the store decides.
    no_cache_rejections: bool,
    metrics: Metrics,
    max_body: usize,
    body_timeout: Duration,
    /// Writes being processed (`--max-writes-in-flight`).
    writes: Arc<Semaphore>,
    /// Request-body bytes held in memory (`--max-body-memory`), one permit a byte.
    body_bytes: Arc<Semaphore>,
    /// Each client's share of `writes` and `body_bytes` (`--max-client-share`).
    shares: Arc<shares::Shares>,
    /// How long a request body may take to send its first byte.
    body_first_byte: Duration,
    /// Cancelled when shutdown begins: requests still receiving their body stop.
    shutdown: CancellationToken,
    stale_log: LogBudget,
    /// The issuers resources are bound to (`--issued-by`).
    issuers: Issuers,
    /// The last fence reset this gateway has applied to its cache.
    resets_followed: AtomicU64,
    /// The database connection failed since the last fence audit ([`audit`]).
    fences_suspect: AtomicBool,
    /// The last entry of the takeover log this gateway has counted.
    takeovers_followed: AtomicI64,
    /// The generation of the issuer bindings this gateway adopted (Postgres).
    bindings_generation: Option<i64>,
    /// Another gateway replaced the bindings (logged once).
    bindings_replaced: AtomicBool,
    /// The administrator's key of a gateway without --auth-file (`--admin-key-file`).
    admin_key: Option<crate::auth::AdminKey>,
    /// How long keyed answers are kept (`--idempotency-ttl`).
    pub idempotency_ttl: Duration,
    /// The bounds of keyed answers, and what the store says of them ([`answers`]).
    answers: answers::Answers,
    /// Most operations in one transaction (`--txn-max-operations`).
    pub txn_max_operations: usize,
    /// Largest transaction body (`--txn-max-bytes`, at most `--max-body`).
    pub txn_max_bytes: usize,
    /// `--require-synchronous-replication`.
    require_synchronous_replication: bool,
    /// `--patroni-url`.
    /// Patroni's REST APIs (`--patroni-url`), read in order until one answers.
    patroni_urls: Vec<String>,
    /// Which of them answered last: the first one tried next time.
    patroni_answered: std::sync::atomic::AtomicUsize,
    /// The last reading of the fence database's replication was synchronous
    /// ([`replication`]).
    synchronously_replicated: AtomicBool,
    /// The latest write probe of the store and when it ran; see [`Coordinator::writable`].
    write_probe: tokio::sync::Mutex<Option<(tokio::time::Instant, Result<(), NotWritable>)>>,
}

/// How long a write probe's outcome answers readiness before the store is probed again.
const WRITE_PROBE_EVERY: Duration = Duration::from_secs(1);

/// How often a gateway looks for fence resets made through other replicas.
pub const RESET_POLL: Duration = Duration::from_secs(1);

/// How often a gateway reports the answers it stored and reads which of their bounds
/// are met ([`answers`]).
pub const ANSWERS_REPORT: Duration = Duration::from_secs(1);

/// A write that was applied and committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
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
        let admin_key = config
            .auth
            .admin_key_file
            .as_deref()
            .map(crate::auth::AdminKey::load)
            .transpose()?;
        Ok(Coordinator {
            auth,
            store,
            sql,
            cache: FenceCache::new(config.store.cache_size),
            no_cache_rejections: config.store.no_cache_rejections,
            metrics,
            max_body: config.limits.max_body,
            body_timeout: config.http.body_timeout,
            writes: Arc::new(Semaphore::new(config.limits.max_writes_in_flight)),
            body_bytes: Arc::new(Semaphore::new(config.limits.max_body_memory)),
            shares: shares::Shares::new(
                bounds::share_of(
                    config.limits.max_writes_in_flight,
                    config.limits.max_client_share,
                ),
                bounds::share_of(
                    config.limits.max_body_memory,
                    config.limits.max_client_share,
                ),
            ),
            body_first_byte: config.http.body_first_byte_timeout,
            shutdown,
            stale_log: LogBudget::new(config.logging.stale_log_limit),
            issuers,
            resets_followed: AtomicU64::new(0),
            fences_suspect: AtomicBool::new(false),
            takeovers_followed: AtomicI64::new(0),
            bindings_generation,
            bindings_replaced: AtomicBool::new(false),
            admin_key,
            idempotency_ttl: config.idempotency.idempotency_ttl,
            answers: answers::Answers::new(config),
            txn_max_operations: config.limits.txn_max_operations,
            txn_max_bytes: config.limits.txn_max_bytes.min(config.limits.max_body),
            require_synchronous_replication: config.replication.require_synchronous_replication,
            patroni_urls: config.replication.patroni_url.clone(),
            patroni_answered: std::sync::atomic::AtomicUsize::new(0),
            synchronously_replicated: AtomicBool::new(false),
            write_probe: tokio::sync::Mutex::new(None),
        })
    }

    /// Starts the coordinator's background tasks, which run until shutdown — the
    /// auth file's reloads, the summary of unlogged rejections, the expiry and the
    /// reports of keyed answers, the resets and takeovers followed with the fence audit,
    /// the replication and issuer watches — after the first write probe and the first
    /// reading of the replication, which it returns for the ready line.
    pub async fn start(self: &Arc<Self>) -> Option<replication::ReplicationReading> {
        if let Some(auth) = &self.auth {
            tokio::spawn(Arc::clone(auth).watch());
        }
        Coordinator::audit_new_servers(self);
        tokio::spawn(Arc::clone(self).summarise_unlogged_rejections());
        let expire_every = (self.idempotency_ttl / 4).min(Duration::from_secs(60));
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
        self.admin_key.as_ref()
    }

    /// The identities and grants requests are checked against, if authentication is on.
    pub fn authenticator(&self) -> Option<&Authenticator> {
        self.auth.as_deref()
    }

    /// The largest request body (`--max-body`).
    pub fn max_body(&self) -> usize {
        self.max_body
    }

    /// The longest time a request body may take to arrive (`--body-timeout`).
    pub fn body_timeout(&self) -> Duration {
        self.body_timeout
    }

    /// One line for the start-up log: which backend, and where (no secrets).
    pub fn describe_backend(&self) -> String {
        self.store.describe()
    }

    /// How long a request body may take to send its first byte
    /// (`--body-first-byte-timeout`).
    pub fn body_first_byte(&self) -> Duration {
        self.body_first_byte
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
    pub(super) fn seen(&self) -> Seen {
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
    ) -> Result<Applied, ApiError> {
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
            WriteOutcome::Applied { version, created } => Ok(Applied { version, created }),
            WriteOutcome::Stale { highest } => {
                let key = Some(&write.key);
                Err(self.stale(&write.resource, key, fencing, identity, highest, seen))
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
                Err(self.stale(resource, None, fencing, identity, highest, seen))
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

    /// Succeeds if the backend can serve requests now.
    pub async fn ping(self: &Arc<Self>) -> Result<(), ApiError> {
        let this = Arc::clone(self);
        let result = self
            .store_call(async move { this.store.ping().await })
            .await?;
        Ok(result?)
    }

    /// Whether the store can take writes, by a real write ([`Store::probe_write`]) at
    /// most every [`WRITE_PROBE_EVERY`], or at once after a write failed in storage.
    /// Readiness callers wait for one probe rather than each run their own.
    pub async fn writable(self: &Arc<Self>) -> Result<Result<(), NotWritable>, ApiError> {
        let mut last = self.write_probe.lock().await;
        if let Some((at, outcome)) = &*last {
            if at.elapsed() < WRITE_PROBE_EVERY && !self.store.write_failed_since_probe() {
                return Ok(outcome.clone());
            }
        }
        let this = Arc::clone(self);
        let result = self
            .store_call(async move { this.store.probe_write().await })
            .await?;
        let outcome = result?;
        self.metrics.store_writable(outcome.is_ok());
        let was_writable = last.as_ref().is_none_or(|(_, before)| before.is_ok());
        match &outcome {
            Err(not) => tracing::warn!(
                reason = not.reason.as_str(),
                detail = %not.detail,
                "the store cannot take writes: not ready"
            ),
            Ok(()) if !was_writable => tracing::info!("the store takes writes again"),
            Ok(()) => {}
        }
        *last = Some((tokio::time::Instant::now(), outcome.clone()));
        Ok(outcome)
    }

    /// Records that `token` is committed for `resource`, by a backend call that started
    /// at `seen`.
    pub(super) fn committed(&self, resource: &ResourceName, token: Token, seen: Seen) {
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
