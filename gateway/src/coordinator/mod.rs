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

mod admit;
mod audit;
mod fence_cache;
mod issued;
pub(crate) mod issuers;
mod replication;
mod shares;
mod takeover;
mod txn;

pub use admit::Entry;
pub use shares::ClientKey;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

use fencegate_proto::headers::Fencing;
use fencegate_proto::{ErrorCode, ObjectKey, ResourceName, Token};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::auth::Authenticator;
use crate::config::Config;
use crate::dbfence::{Refusal, Reported};
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
    /// Large answers waiting for their clients (`--max-response-memory`).
    responses: Arc<crate::api::body::ResponseBudget>,
    /// Cancelled when shutdown begins: requests still receiving their body stop.
    shutdown: CancellationToken,
    stale_log: LogBudget,
    /// The issuers resources are bound to (`--issued-by`).
    issuers: Issuers,
    /// The last fence reset this gateway has applied to its cache.
    resets_followed: AtomicU64,
    /// The database connection failed since the last fence audit ([`audit`]).
    fences_suspect: AtomicBool,
    /// How long a raise waits for older terms before ending them (Postgres; zero:
    /// never); see [`takeover`].
    term_takeover: Duration,
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
    /// Most operations in one transaction (`--txn-max-operations`).
    pub txn_max_operations: usize,
    /// Largest transaction body (`--txn-max-bytes`, at most `--max-body`).
    pub txn_max_bytes: usize,
    /// `--require-synchronous-replication`.
    require_synchronous_replication: bool,
    /// `--patroni-url`.
    patroni_url: Option<String>,
    /// The last reading of the fence database's replication was synchronous
    /// ([`replication`]).
    synchronously_replicated: AtomicBool,
    /// The latest write probe of the store and when it ran; see [`Coordinator::writable`].
    write_probe: tokio::sync::Mutex<Option<(tokio::time::Instant, Result<(), NotWritable>)>>,
}

/// `percent` of `total`, at least 1.
fn share_of(total: usize, percent: u8) -> usize {
    (total.saturating_mul(usize::from(percent)) / 100).max(1)
}

/// How long a write probe's outcome answers readiness before the store is probed again.
const WRITE_PROBE_EVERY: Duration = Duration::from_secs(1);

/// How often a gateway looks for fence resets made through other replicas.
pub const RESET_POLL: Duration = Duration::from_secs(1);

/// Which front door — the HTTP API or the Postgres door — a rejected write came
/// through, for the log and the metrics. (Not `pgdoor::Door`, the Postgres
/// door itself.)
#[derive(Debug, Clone, Copy)]
pub enum FrontDoor {
    Http,
    Postgres,
}

impl FrontDoor {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FrontDoor::Http => "http",
            FrontDoor::Postgres => "pg",
        }
    }
}

/// A write's place under `--max-writes-in-flight` and its client's share of it.
pub struct WritePermit {
    _global: OwnedSemaphorePermit,
    _share: shares::Share,
}

/// Room for a request body under `--max-body-memory` and its client's share, claimed
/// as the body arrives and given back when dropped.
pub struct BodyMemory {
    global: Arc<Semaphore>,
    held: Option<OwnedSemaphorePermit>,
    share: shares::Share,
    bytes: usize,
}

impl BodyMemory {
    /// Claims room for `total` bytes in all, if not claimed yet.
    pub fn grow_to(&mut self, total: usize) -> Result<(), Overload> {
        let more = total.saturating_sub(self.bytes);
        if more == 0 {
            return Ok(());
        }
        let permits = u32::try_from(more).map_err(|_| Overload::BodyMemory)?;
        let permit = Arc::clone(&self.global)
            .try_acquire_many_owned(permits)
            .map_err(|_| Overload::BodyMemory)?;
        self.share.grow_body(more)?;
        match &mut self.held {
            Some(held) => held.merge(permit),
            None => self.held = Some(permit),
        }
        self.bytes = total;
        Ok(())
    }
}

/// The facts of a stale rejection, as logged.
#[derive(Clone, Copy)]
struct Rejected<'a> {
    resource: &'a ResourceName,
    key: Option<&'a ObjectKey>,
    fencing: &'a Fencing,
    /// The authenticated caller; `None` when authentication is off.
    identity: Option<&'a str>,
    highest: Token,
}

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
            .admin_key_file
            .as_deref()
            .map(crate::auth::AdminKey::load)
            .transpose()?;
        let responses = crate::api::body::ResponseBudget::new(
            config.max_response_memory,
            config.max_pending_answers,
            metrics.response_bytes(),
        );
        Ok(Coordinator {
            auth,
            store,
            sql,
            cache: FenceCache::new(config.cache_size),
            no_cache_rejections: config.no_cache_rejections,
            metrics,
            max_body: config.max_body,
            body_timeout: config.body_timeout,
            writes: Arc::new(Semaphore::new(config.max_writes_in_flight)),
            body_bytes: Arc::new(Semaphore::new(config.max_body_memory)),
            shares: shares::Shares::new(
                share_of(config.max_writes_in_flight, config.max_client_share),
                share_of(config.max_body_memory, config.max_client_share),
            ),
            body_first_byte: config.body_first_byte_timeout,
            responses,
            shutdown,
            stale_log: LogBudget::new(config.stale_log_limit),
            issuers,
            resets_followed: AtomicU64::new(0),
            fences_suspect: AtomicBool::new(false),
            term_takeover: config.term_takeover_timeout,
            takeovers_followed: AtomicI64::new(0),
            bindings_generation,
            bindings_replaced: AtomicBool::new(false),
            admin_key,
            idempotency_ttl: config.idempotency_ttl,
            txn_max_operations: config.txn_max_operations,
            txn_max_bytes: config.txn_max_bytes.min(config.max_body),
            require_synchronous_replication: config.require_synchronous_replication,
            patroni_url: config.patroni_url.clone(),
            synchronously_replicated: AtomicBool::new(false),
            write_probe: tokio::sync::Mutex::new(None),
        })
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

    /// What `/v1/sql` does on this gateway.
    pub fn sql(&self) -> &SqlEndpoint {
        &self.sql
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

    /// The budget of large answers waiting for their clients.
    pub fn responses(&self) -> &Arc<crate::api::body::ResponseBudget> {
        &self.responses
    }

    /// The client a request counts against, for its shares.
    pub fn client(&self, identity: Option<&str>, peer: std::net::IpAddr) -> ClientKey {
        self.shares.client(identity, peer)
    }

    /// A place for one more write in flight of `client`, held until the permit is
    /// dropped.
    /// Refused while the fence database is not synchronously replicated, if the gateway
    /// requires it ([`replication`]).
    pub fn write_permit(&self, client: ClientKey) -> Result<WritePermit, ApiError> {
        self.require_replication()?;
        let share = self.shares.write(client)?;
        let global = Arc::clone(&self.writes)
            .try_acquire_owned()
            .map_err(|_| Overload::Writes)?;
        Ok(WritePermit {
            _global: global,
            _share: share,
        })
    }

    /// An empty claim on body memory for `client`, grown as its body arrives.
    pub fn body_memory(&self, client: ClientKey) -> BodyMemory {
        BodyMemory {
            global: Arc::clone(&self.body_bytes),
            held: None,
            share: self.shares.body(client),
            bytes: 0,
        }
    }

    /// Counts a request turned away at one of the bounds.
    pub fn limit_rejected(&self, reason: Overload) {
        self.metrics.limit_rejected(reason.as_str());
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

    /// Logs, once a second while a stale flood lasts, how many "stale write rejected"
    /// lines `--stale-log-limit` left out; runs until shutdown.
    pub async fn summarise_unlogged_rejections(self: Arc<Self>) {
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

    /// The fast path: rejects `fencing` from memory if the cache already knows a higher
    /// committed token. `Ok` means only "not known to be stale": the backend decides.
    fn check_cached(
        &self,
        resource: &ResourceName,
        key: Option<&ObjectKey>,
        fencing: &Fencing,
        identity: Option<&str>,
    ) -> Result<(), ApiError> {
        if self.no_cache_rejections {
            return Ok(());
        }
        match self.cache.reject_below(resource, fencing.token) {
            Some((highest, rejections)) => {
                self.metrics.cache_rejection();
                let rejected = Rejected {
                    resource,
                    key,
                    fencing,
                    identity,
                    highest,
                };
                Err(self.rejected(&rejected, rejections))
            }
            None => Ok(()),
        }
    }

    /// The generation of the fence cache now, for a backend call about to start.
    pub fn seen(&self) -> Seen {
        self.cache.seen()
    }

    /// Runs a backend call in its own task, started at once; see the module doc.
    ///
    /// Not an `async fn`: that would hold `call` — a whole backend future — inside the
    /// request's own future until its first poll, and every request's future would be
    /// as large as the largest backend call, moved in memory with each request.
    pub fn detached<T: Send + 'static>(
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
    pub fn store_call<T: Send + 'static>(
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
        let raising = self.may_raise(&write.resource, write.token);
        let (write, outcome) = self
            .detached(async move {
                let outcome = match raising {
                    true => {
                        this.taking_over(&write.resource, write.token, this.store.write(&write))
                            .await
                    }
                    false => this.store.write(&write).await,
                };
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
                let outcome = this
                    .taking_over(
                        &task_resource,
                        token,
                        this.store.advance(&task_resource, token),
                    )
                    .await;
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
        match result? {
            None => Ok(None),
            Some(found) => Ok(Some(found?)),
        }
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
    pub fn committed(&self, resource: &ResourceName, token: Token, seen: Seen) {
        if self.cache.raise_seen(resource, token, seen).changed {
            self.metrics.highest_raised(resource, token);
        }
    }

    /// Counts and logs a stale rejection (within the `--stale-log-limit` budget), and
    /// returns the error to answer with. `highest` must be a committed token above the
    /// presented one.
    pub fn stale(
        &self,
        resource: &ResourceName,
        key: Option<&ObjectKey>,
        fencing: &Fencing,
        identity: Option<&str>,
        highest: Token,
        seen: Seen,
    ) -> ApiError {
        self.count_stale(resource, key, fencing, identity, highest, seen);
        ApiError::Stale {
            resource: resource.clone(),
            presented: fencing.token,
            highest,
        }
    }

    /// Counts and logs a stale rejection as [`Coordinator::stale`] does, for an answer
    /// built elsewhere (a transaction's, rendered from its outcome).
    pub fn count_stale(
        &self,
        resource: &ResourceName,
        key: Option<&ObjectKey>,
        fencing: &Fencing,
        identity: Option<&str>,
        highest: Token,
        seen: Seen,
    ) {
        let rejections = self.cache.count_rejection(resource, highest, seen);
        let rejected = Rejected {
            resource,
            key,
            fencing,
            identity,
            highest,
        };
        self.record_stale(&rejected, FrontDoor::Http, rejections);
    }

    /// Counts and logs `rejected`, the resource's `rejections`-th, and returns the error
    /// to answer with.
    fn rejected(&self, rejected: &Rejected<'_>, rejections: u64) -> ApiError {
        self.record_stale(rejected, FrontDoor::Http, rejections);
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
            Reported::Proven(Refusal::Stale(rejection)) => {
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
                };
                self.record_stale(&rejected, door, rejections);
            }
            Reported::Proven(Refusal::NotIssued(rejection)) => {
                self.not_issued_in_database(rejection, door)
            }
            Reported::Unproven { code } => {
                self.metrics.forged_refusal(door.as_str());
                if self.stale_log.admit().is_some() {
                    tracing::warn!(
                        sqlstate = *code,
                        door = door.as_str(),
                        "a fence error without the fence's proof: raised by SQL, not by the fence; not counted as a rejection"
                    );
                }
            }
        }
    }

    fn record_stale(&self, rejected: &Rejected<'_>, door: FrontDoor, rejections: u64) {
        let Rejected {
            resource,
            key,
            fencing,
            identity,
            highest,
        } = *rejected;
        self.metrics
            .stale_rejected(resource, fencing.token, highest);
        if let Some(unlogged) = self.stale_log.admit() {
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

    /// The metrics, for the Postgres door's own.
    /// The key of the in-database fence's proofs (the Postgres backend only).
    pub fn proof_key(&self) -> Option<&crate::dbfence::ProofKey> {
        match &self.store {
            Store::Postgres(pg) => Some(&pg.keys().proof),
            Store::Embedded(_) => None,
        }
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Keeps `fencegate_backend_errors_total` and `fencegate_backend_ready` current.
    pub fn backend_result<T>(&self, result: &Result<T, StoreError>) {
        match result {
            Ok(_) => self.backend_succeeded(),
            Err(error) => self.backend_failed(error),
        }
    }

    pub fn backend_succeeded(&self) {
        self.metrics.backend_ready(true);
    }

    pub fn backend_failed(&self, error: &StoreError) {
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
