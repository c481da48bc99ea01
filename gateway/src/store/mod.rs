//! Backends: where fences and objects are kept.
//!
//! Every backend upholds the same contract, which is the whole point of the gateway:
//!
//! 1. A write is applied only if, at commit, its token is >= the durable highest token
//!    of its resource, and the durable highest becomes `max(highest, token)` in the same
//!    transaction as the write.
//! 2. A rejected, failed or rolled-back write changes nothing: neither object nor fence.
//! 3. Tokens never go down for a resource, across restarts and across gateway replicas.
//!
//! Operations report what was committed; callers update the fence cache only from
//! those reports.

use bytes::Bytes;
use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName, Token};
use leases::{Claimant, LeaseOp, LeaseOutcome, LeaseRecord, Reset, ResetOutcome, ResetRecord};

pub mod embedded;
pub mod leases;
pub mod postgres;
pub mod txn;

pub use embedded::EmbeddedStore;
pub use postgres::PgStore;

/// The configured backend. An enum rather than a trait object: there are few
/// backends, and static dispatch keeps their async methods plain.
pub enum Store {
    Postgres(PgStore),
    Embedded(EmbeddedStore),
}

/// A fenced write of one object.
#[derive(Debug, Clone)]
pub struct Write {
    pub resource: ResourceName,
    pub key: ObjectKey,
    pub token: Token,
    pub precondition: Precondition,
    pub op: WriteOp,
}

#[derive(Debug, Clone)]
pub enum WriteOp {
    Put(Bytes),
    Delete,
}

/// What happened to a write. Every variant describes committed state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Applied and committed. `version` is the object's version after the write;
    /// `created` is true if the object did not exist before (a put only).
    Applied { version: u64, created: bool },
    /// Rejected: the resource's committed highest token is above the presented one.
    Stale { highest: Token },
    /// Rejected: the precondition did not hold; `current` is the object's version
    /// (`None` if it does not exist).
    PreconditionFailed { current: Option<u64> },
}

/// What happened to a fence advance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdvanceOutcome {
    Applied,
    Stale { highest: Token },
}

/// A fence found below a token this gateway saw committed, and raised back to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Regression {
    pub resource: ResourceName,
    /// The highest token this gateway saw committed.
    pub seen: Token,
    /// What the database had instead (`None`: no fence at all).
    pub found: Option<Token>,
}

/// A stored object, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredObject {
    pub value: Bytes,
    pub version: u64,
    pub token: Token,
}

/// Why a backend operation failed. Messages never contain connection strings or SQL.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The backend could not be reached or went away. `applied` is `Some(false)` when
    /// the write certainly did not commit, `None` when it may have.
    #[error("the database is unavailable ({reason})")]
    Unavailable {
        reason: UnavailableReason,
        applied: Option<bool>,
    },
    /// The backend answered something this gateway does not expect: a bug, or a schema
    /// changed under it. Details go to the log, not to the client.
    #[error("unexpected backend error: {0}")]
    Internal(String),
}

/// Why a store that answers cannot take writes, as its write probe found
/// ([`Store::probe_write`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotWritable {
    pub reason: NotWritableReason,
    /// What failed, for the log and the readiness answer (no SQL, no addresses).
    pub detail: String,
}

/// The closed set of reasons a store cannot write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotWritableReason {
    /// No space left where the store writes.
    DiskFull,
    /// The database or the file system takes no writes (a standby, a read-only mount).
    ReadOnly,
    /// Any other failure of the write.
    WriteFailed,
}

impl NotWritableReason {
    pub fn as_str(self) -> &'static str {
        match self {
            NotWritableReason::DiskFull => "disk_full",
            NotWritableReason::ReadOnly => "read_only",
            NotWritableReason::WriteFailed => "write_failed",
        }
    }

    /// The reason of a failed file write.
    pub fn of_io(error: &std::io::Error) -> NotWritableReason {
        match error.kind() {
            std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => {
                NotWritableReason::DiskFull
            }
            std::io::ErrorKind::ReadOnlyFilesystem => NotWritableReason::ReadOnly,
            _ => NotWritableReason::WriteFailed,
        }
    }
}

/// Why the backend is unavailable; doubles as the `kind` label of
/// `fencegate_backend_errors_total`, so the set is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnavailableReason {
    /// No connection could be made or none became free in time.
    Connect,
    /// The operation did not finish within the backend timeout.
    Timeout,
    /// The connection broke during the operation.
    ConnectionLost,
    /// The server refused or cancelled the statement (shutting down, statement timeout).
    ServerAborted,
    /// The embedded store's file could not be read or written.
    Storage,
    /// A write lane gave up waiting for a fence lock; the write is retried off the
    /// lanes, so clients do not see this one.
    LockTimeout,
}

impl UnavailableReason {
    pub fn as_str(self) -> &'static str {
        match self {
            UnavailableReason::Connect => "connect",
            UnavailableReason::Timeout => "timeout",
            UnavailableReason::ConnectionLost => "connection_lost",
            UnavailableReason::ServerAborted => "server_aborted",
            UnavailableReason::Storage => "storage",
            UnavailableReason::LockTimeout => "lock_timeout",
        }
    }
}

impl std::fmt::Display for UnavailableReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            UnavailableReason::Connect => "no connection could be made in time",
            UnavailableReason::Timeout => "it did not answer in time",
            UnavailableReason::ConnectionLost => "the connection was lost",
            UnavailableReason::ServerAborted => "the server aborted the statement",
            UnavailableReason::Storage => "the store's file could not be read or written",
            UnavailableReason::LockTimeout => "a lock was not granted in time",
        })
    }
}

impl StoreError {
    /// Every value of the `kind` label.
    pub const KINDS: &'static [&'static str] = &[
        "connect",
        "timeout",
        "connection_lost",
        "server_aborted",
        "storage",
        "lock_timeout",
        "internal",
    ];

    /// The `kind` label of `fencegate_backend_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Unavailable { reason, .. } => reason.as_str(),
            StoreError::Internal(_) => "internal",
        }
    }
}

/// Whether `precondition` holds for an object whose current version is `current`
/// (`None` if it does not exist or was deleted). Shared by every backend.
pub fn precondition_holds(precondition: Precondition, current: Option<u64>) -> bool {
    match precondition {
        Precondition::None => true,
        Precondition::MustNotExist => current.is_none(),
        Precondition::MustExist => current.is_some(),
        Precondition::Version(version) => current == Some(version),
    }
}

impl Store {
    pub async fn write(&self, write: &Write) -> Result<WriteOutcome, StoreError> {
        match self {
            Store::Postgres(store) => store.write(write).await,
            Store::Embedded(store) => store.write(write).await,
        }
    }

    /// Applies a transaction of several operations all or nothing, storing its answer
    /// under its key if it has one; see [`txn`].
    pub async fn txn(
        &self,
        txn: &txn::Txn,
        keyed: Option<&txn::Keyed>,
    ) -> Result<txn::Answered, StoreError> {
        match self {
            Store::Postgres(store) => store.txn(txn, keyed).await,
            Store::Embedded(store) => store.txn(txn, keyed).await,
        }
    }

    /// Removes up to `limit` expired idempotency records; returns how many went.
    pub async fn expire_idempotency(&self, limit: u32) -> Result<u64, StoreError> {
        match self {
            Store::Postgres(store) => store.expire_idempotency(i64::from(limit)).await,
            Store::Embedded(store) => store.expire_idempotency(limit).await,
        }
    }

    /// The usage of stored answers, with the identities at `bounds`. `stored` is what
    /// this gateway stored since its last call, as (identity, records, bytes), for a
    /// store that does not count answers as it stores them (Postgres, where a counter
    /// in each keyed write's transaction would make one identity's writes wait on each
    /// other).
    pub async fn answer_usage(
        &self,
        stored: &[(String, u64, u64)],
        bounds: txn::IdentityBounds,
    ) -> Result<txn::AnswerUsage, StoreError> {
        match self {
            Store::Postgres(store) => store.answer_usage(stored, bounds).await,
            Store::Embedded(store) => store.answer_usage(bounds).await,
        }
    }

    /// Whether the store counts answers itself as it stores them.
    pub fn counts_answers(&self) -> bool {
        matches!(self, Store::Embedded(_))
    }

    /// The unexpired answer stored under (`identity`, `key`), with its request's
    /// fingerprint; read without a transaction of its own (see [`txn`]).
    pub async fn stored_answer(
        &self,
        identity: &str,
        key: &str,
    ) -> Result<Option<(Vec<u8>, txn::StoredAnswer)>, StoreError> {
        match self {
            Store::Postgres(store) => store.stored_answer(identity, key).await,
            Store::Embedded(store) => store.stored_answer(identity, key).await,
        }
    }

    pub async fn advance(
        &self,
        resource: &ResourceName,
        token: Token,
    ) -> Result<AdvanceOutcome, StoreError> {
        match self {
            Store::Postgres(store) => store.advance(resource, token).await,
            Store::Embedded(store) => store.advance(resource, token).await,
        }
    }

    /// Reads an object. `admit` is asked, with the value's length, before the value is
    /// copied into memory: what it returns is kept with the object, and its refusal is
    /// returned instead of the object (nothing copied).
    pub async fn get<P, E>(
        &self,
        resource: &ResourceName,
        key: &ObjectKey,
        admit: impl FnOnce(usize) -> Result<P, E> + Send + 'static,
    ) -> Result<Option<Result<(StoredObject, P), E>>, StoreError>
    where
        P: Send + 'static,
        E: Send + 'static,
    {
        match self {
            Store::Postgres(store) => store.get(resource, key, admit).await,
            Store::Embedded(store) => store.get(resource, key, admit).await,
        }
    }

    /// The live objects of `resource` whose keys start with `prefix` and sort after
    /// `after` (byte order, as S3 lists), at most `limit` of them, in key order.
    pub async fn list(
        &self,
        resource: &ResourceName,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        match self {
            Store::Postgres(store) => store.list(resource, prefix, after, limit).await,
            Store::Embedded(store) => store.list(resource, prefix, after, limit).await,
        }
    }

    pub async fn fence(&self, resource: &ResourceName) -> Result<Option<Token>, StoreError> {
        match self {
            Store::Postgres(store) => store.fence(resource).await,
            Store::Embedded(store) => store.fence(resource).await,
        }
    }

    /// Applies one step of a hosted lease, storing its answer under its key if it has
    /// one; see [`leases`] and [`txn`].
    pub async fn lease(
        &self,
        resource: &ResourceName,
        op: &LeaseOp,
        claimant: &Claimant,
        keyed: Option<&txn::Keyed<LeaseOutcome>>,
    ) -> Result<txn::Answered<LeaseOutcome>, StoreError> {
        match self {
            Store::Postgres(store) => store.lease(resource, op, claimant, keyed).await,
            Store::Embedded(store) => store.lease(resource, op, claimant, keyed).await,
        }
    }

    /// A hosted lease as it stands.
    pub async fn read_lease(&self, resource: &ResourceName) -> Result<LeaseRecord, StoreError> {
        match self {
            Store::Postgres(store) => store.read_lease(resource).await,
            Store::Embedded(store) => store.read_lease(resource).await,
        }
    }

    /// Lowers a fence, within its floors, and records the reset; see [`leases`].
    pub async fn reset(&self, reset: &Reset) -> Result<ResetOutcome, StoreError> {
        match self {
            Store::Postgres(store) => store.reset(reset).await,
            Store::Embedded(store) => store.reset(reset).await,
        }
    }

    /// The resets recorded after `generation`, in order.
    pub async fn resets_since(&self, generation: u64) -> Result<Vec<ResetRecord>, StoreError> {
        match self {
            Store::Postgres(store) => store.resets_since(generation).await,
            Store::Embedded(store) => store.resets_since(generation).await,
        }
    }

    /// Raises every fence that is below the token this gateway saw committed for it
    /// (`seen`), and returns those it raised. A fence can only be behind after the
    /// database lost committed transactions (a failover to an asynchronous standby, a
    /// restore from backup); restoring it keeps the older terms out. Resources reset
    /// after `resets_followed` are left as they are. The embedded store has no standby
    /// and finds nothing.
    pub async fn restore_fences(
        &self,
        seen: &[(ResourceName, Token)],
        resets_followed: u64,
    ) -> Result<Vec<Regression>, StoreError> {
        match self {
            Store::Postgres(store) => store.restore_fences(seen, resets_followed).await,
            Store::Embedded(_) => Ok(Vec::new()),
        }
    }

    /// Whether the database server changed since the last call (a failover or a
    /// restart): time to audit the fences. Never for the embedded store.
    pub fn server_changed(&self) -> bool {
        match self {
            Store::Postgres(store) => store.server_changed(),
            Store::Embedded(_) => false,
        }
    }

    /// Writes something small and durable, as a write would: `Ok(Err(..))` if the
    /// store answers but cannot take writes (a full disk, a read-only database).
    pub async fn probe_write(&self) -> Result<Result<(), NotWritable>, StoreError> {
        match self {
            Store::Postgres(store) => store.probe_write().await,
            Store::Embedded(store) => store.probe_write().await,
        }
    }

    /// Whether a write failed for want of storage since the last write probe, which
    /// then must not be taken from a cache.
    pub fn write_failed_since_probe(&self) -> bool {
        match self {
            Store::Postgres(_) => false,
            Store::Embedded(store) => store.write_failed_since_probe(),
        }
    }

    /// Succeeds if the backend can serve requests now.
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self {
            Store::Postgres(store) => store.ping().await,
            Store::Embedded(store) => store.ping().await,
        }
    }

    /// One line for the start-up log: which backend, and where (no secrets).
    pub fn describe(&self) -> String {
        match self {
            Store::Postgres(store) => store.describe(),
            Store::Embedded(store) => store.describe(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_listed() {
        use UnavailableReason::*;
        for reason in [
            Connect,
            Timeout,
            ConnectionLost,
            ServerAborted,
            Storage,
            LockTimeout,
        ] {
            let error = StoreError::Unavailable {
                reason,
                applied: None,
            };
            assert!(StoreError::KINDS.contains(&error.kind()), "{reason:?}");
        }
        assert!(StoreError::KINDS.contains(&StoreError::Internal(String::new()).kind()));
    }

    #[test]
    fn preconditions() {
        use Precondition::*;
        let cases = [
            (None, Option::<u64>::None, true),
            (None, Some(3), true),
            (MustNotExist, Option::None, true),
            (MustNotExist, Some(3), false),
            (MustExist, Option::None, false),
            (MustExist, Some(3), true),
            (Version(3), Some(3), true),
            (Version(3), Some(4), false),
            (Version(3), Option::None, false),
        ];
        for (precondition, current, holds) in cases {
            assert_eq!(
                precondition_holds(precondition, current),
                holds,
                "{precondition:?} on {current:?}"
            );
        }
    }
}
