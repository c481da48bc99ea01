//! The embedded backend: fences and objects in one redb file, no database server.
//!
//! # Behavior
//!
//! - One writer thread owns every write transaction. Writes and advances queue to it;
//!   it takes the requests waiting (up to the group-commit size), applies them in
//!   arrival order inside one write transaction — each checked against its resource's
//!   fence as the writes before it left it — commits once, and only then answers each
//!   of them. A commit is durable when it returns (redb's default `Durability::Immediate`
//!   fsyncs), so an acknowledged write survives a crash, and a batch of N writes costs
//!   one fsync instead of N.
//! - A write rejected inside a batch changes nothing: every check of a write comes
//!   before its first change. If the commit fails, every write of the batch is
//!   answered with an error and none of them is applied.
//! - Reads run on the blocking pool in MVCC read transactions: they see committed
//!   state only, and never wait for the writer.
//! - redb locks the file: a second gateway on the same file fails to start.
//! - The store has an identity, in the file and next to it ([`identity`]): a file that
//!   went missing or was emptied is refused at start instead of replaced by an empty
//!   store, and so is another store's file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fencegate_proto::{ObjectKey, ResourceName, Token};
use redb::{Database, DatabaseError, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::{mpsc, oneshot};

use crate::store::leases::{
    Claimant, LeaseOp, LeaseOutcome, LeaseRecord, Reset, ResetOutcome, ResetRecord,
};
use crate::store::{
    AdvanceOutcome, NotWritable, StoreError, StoredObject, UnavailableReason, Write, WriteOutcome,
};

mod batch;
mod file;
pub mod identity;

use batch::{writer, Job, Responder};
use file::{initialise, probe_file, probe_store};
use identity::{FileState, Reconciled, Start, StoreId};

/// The file inside `--data-dir`.
pub const FILE_NAME: &str = "fencegate.redb";

/// resource -> highest accepted token.
const FENCES: TableDefinition<&str, u64> = TableDefinition::new("fences");
/// (token, version, born, value) of an object; value `None` is a tombstone that keeps
/// the version sequence, as in the Postgres backend.
type ObjectRow = (u64, u64, u64, Option<&'static [u8]>);
/// (resource, key) -> object.
const OBJECTS: TableDefinition<(&str, &str), ObjectRow> = TableDefinition::new("objects");
/// (holder, identity, last token, expiry in ms since the Unix epoch) of a hosted lease;
/// a released lease has no holder and expiry 0, and keeps the identity its last token
/// is bound to.
type LeaseRow = (Option<&'static str>, Option<&'static str>, u64, u64);
/// resource -> hosted lease.
const LEASES: TableDefinition<&str, LeaseRow> = TableDefinition::new("leases");
/// (resource, from, to, identity, reason, at in ms since the Unix epoch) of a reset.
type ResetRow = (
    &'static str,
    u64,
    u64,
    Option<&'static str>,
    &'static str,
    u64,
);
/// generation -> fence reset: the audit log.
const RESETS: TableDefinition<u64, ResetRow> = TableDefinition::new("fence_resets");
/// (resource, token) -> (path, at in ms since the Unix epoch): every raise of a fence,
/// the latest [`RAISES_KEPT`] per resource; a reset may go below none of these tokens
/// but the one it declares forged.
const RAISES: TableDefinition<(&str, u64), (&str, u64)> = TableDefinition::new("raises");
/// Raises kept per resource.
const RAISES_KEPT: usize = 32;
/// resource -> the highest raise the raise log let go of: a floor of every reset, so
/// that no number of raises pushes a term out of a reset's reach.
const RAISE_FLOORS: TableDefinition<&str, u64> = TableDefinition::new("raise_floors");
/// Set once the raise log holds every fence the store had before it existed.
const RAISES_SEEDED_KEY: &str = "raises_seeded";
/// Set once the usage of stored answers counts every answer the store had before it.
const USAGE_SEEDED_KEY: &str = "usage_seeded";
/// (fingerprint, expiry in ms since the Unix epoch, status, headers, body) of the answer
/// stored with a keyed write; see [`crate::store::txn`].
type IdempotencyRow = (&'static [u8], u64, u16, &'static str, &'static [u8]);
/// (identity, key) -> the answer of a keyed write.
const IDEMPOTENCY: TableDefinition<(&str, &str), IdempotencyRow> =
    TableDefinition::new("idempotency");
/// identity -> (records, bytes) of the answers stored under its keys, counted as
/// [`crate::store::txn::record_bytes`] counts them, in the transaction that stores or
/// removes each.
const IDEMPOTENCY_USAGE: TableDefinition<&str, (u64, u64)> =
    TableDefinition::new("idempotency_usage");
/// (expiry, identity, key): the keyed answers in the order they expire.
const IDEMPOTENCY_EXPIRY: TableDefinition<(u64, &str, &str), ()> =
    TableDefinition::new("idempotency_expiry");
/// Marks the file as a fencegate store and records its format.
const META: TableDefinition<&str, u64> = TableDefinition::new("fencegate_meta");
const FORMAT_KEY: &str = "format_version";
const FORMAT_VERSION: u64 = 1;
/// The readiness probe's key -> when it last wrote, in ms since the Unix epoch.
const READINESS: TableDefinition<&str, u64> = TableDefinition::new("fencegate_readiness");
/// The file the readiness probe writes and removes beside the store.
const PROBE_FILE_NAME: &str = "fencegate.probe";
/// What the readiness probe writes to that file: room for a commit of a few pages.
const PROBE_FILE_BYTES: usize = 64 * 1024;
/// The store's identity, as 32 hex digits; see [`identity`].
const IDENTITY: TableDefinition<&str, &str> = TableDefinition::new("fencegate_identity");
const STORE_ID_KEY: &str = "store_id";

/// Queued writes beyond which callers wait (and their backend timeout runs).
const QUEUE_DEPTH: usize = 4096;

/// Why the embedded store could not open.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedStartError {
    #[error("could not create the data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is in use by another fencegate process (the file is locked); stop it, or give this gateway another --data-dir")]
    Locked { path: PathBuf },
    #[error("{path} is not a fencegate store ({reason}); point --data-dir at an empty directory or a fencegate data directory")]
    NotAStore { path: PathBuf, reason: String },
    #[error("{path} has store format {found}, newer than this gateway's {supported}; upgrade the gateway")]
    FormatTooNew {
        path: PathBuf,
        found: u64,
        supported: u64,
    },
    #[error("could not open {path}: {source}")]
    Open { path: PathBuf, source: redb::Error },
    #[error("{path} {what}, but {id_file} says store {id} was kept here: starting an empty store would lose its fences, and writers of older terms could write again. Put the store's file back (from where it went, or a backup). To start an empty store deliberately, knowing its fences are lost, start once with --init-store")]
    Lost {
        path: PathBuf,
        what: &'static str,
        id_file: PathBuf,
        id: StoreId,
    },
    #[error("{path} is empty (zero bytes), which is never a fencegate store: its fences, if it had any, are lost. Put the store's file back (from a backup). To start an empty store deliberately, start once with --init-store")]
    EmptyFile { path: PathBuf },
    #[error("{path} is the file of store {found}, but this data directory belongs to store {expected} ({file}): it is another store's file. Put this directory's own file back, or point --data-dir at the directory of store {found}", file = identity::ID_FILE_NAME)]
    ForeignFile {
        path: PathBuf,
        found: StoreId,
        expected: StoreId,
    },
    #[error("{path} has no store identity, but this data directory belongs to store {expected} ({file}): it is not that store's file. Put this directory's own file back; to use this file instead, move {file} away first", file = identity::ID_FILE_NAME)]
    Unidentified { path: PathBuf, expected: StoreId },
    #[error("--init-store refuses to start: {path} exists and is not empty, and may hold fences that an empty store would lose. Move it away (or point --data-dir at an empty directory) before starting with --init-store, and start without --init-store once the store exists")]
    InitRefused { path: PathBuf },
    #[error("could not read or write the store identity file {path}: {source}")]
    IdentityFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the store identity file {path} does not hold a store identity (32 hex digits); restore it, or move it away if this directory's store file is the one to use")]
    BadIdentityFile { path: PathBuf },
}

/// Fences and objects in a local redb file.
pub struct EmbeddedStore {
    db: Arc<Database>,
    queue: mpsc::Sender<Job>,
    path: PathBuf,
    id: StoreId,
    timeout: Duration,
    /// Set by the writer when a commit fails, cleared by a write probe that succeeds.
    write_failed: Arc<AtomicBool>,
    /// Reads running on blocking threads at once ([`READS_AT_ONCE`]).
    reads: Arc<tokio::sync::Semaphore>,
}

/// The most reads run at once, each on a blocking thread. A read takes microseconds;
/// without a bound, a burst of reads (hundreds of clients asking for a large object at
/// once) starts a thread for each, and their start-up and copies crowd out every other
/// request on the machine's cores. With it, the burst waits its turn instead.
const READS_AT_ONCE: usize = 4;

impl EmbeddedStore {
    /// Opens (or creates) `<data_dir>/fencegate.redb` and starts the writer thread.
    /// `group_max` is the most writes committed together; 1 commits each on its own.
    /// `group_size` observes the size of every batch committed. `init_store`
    /// (`--init-store`) creates an empty store where a store's file is missing or empty;
    /// without it, such a directory is refused ([`identity`]).
    pub fn open(
        data_dir: &Path,
        init_store: bool,
        group_max: usize,
        timeout: Duration,
        group_size: prometheus::Histogram,
    ) -> Result<EmbeddedStore, EmbeddedStartError> {
        std::fs::create_dir_all(data_dir).map_err(|source| EmbeddedStartError::DataDir {
            path: data_dir.to_owned(),
            source,
        })?;
        let path = data_dir.join(FILE_NAME);
        let state = FileState::of(&path)?;
        let mut dir_id = identity::read_dir_id(data_dir)?;
        if identity::judge(&path, state, dir_id, init_store)? == Start::Create {
            // A new store gets a new identity, whatever the directory's said before.
            dir_id = None;
            if state == FileState::Empty {
                std::fs::remove_file(&path).map_err(|source| EmbeddedStartError::DataDir {
                    path: path.clone(),
                    source,
                })?;
            }
        }
        let existed = state == FileState::NonEmpty;
        let db = Database::create(&path).map_err(|error| match error {
            DatabaseError::DatabaseAlreadyOpen => EmbeddedStartError::Locked { path: path.clone() },
            DatabaseError::Storage(storage) if existed => EmbeddedStartError::NotAStore {
                path: path.clone(),
                reason: storage.to_string(),
            },
            other => EmbeddedStartError::Open {
                path: path.clone(),
                source: other.into(),
            },
        })?;
        let id = match initialise(&db, &path, existed, dir_id)? {
            Reconciled::Same(id) => id,
            Reconciled::WriteDirFile(id) => {
                identity::write_dir_id(data_dir, id)?;
                tracing::warn!(store_id = %id, path = %path.display(), "the store identity file was missing; written again from the store's file");
                id
            }
            Reconciled::Adopt(id) => {
                identity::write_dir_id(data_dir, id)?;
                match (existed, init_store) {
                    (true, _) => {
                        tracing::info!(store_id = %id, path = %path.display(), "the store had no identity (made by an older gateway); it has one now")
                    }
                    (false, true) => {
                        tracing::warn!(store_id = %id, path = %path.display(), "started a new, empty store deliberately (--init-store)")
                    }
                    (false, false) => {
                        tracing::info!(store_id = %id, path = %path.display(), "created a new store")
                    }
                }
                id
            }
        };
        let db = Arc::new(db);
        let (queue, jobs) = mpsc::channel(QUEUE_DEPTH);
        let writer_db = Arc::clone(&db);
        let write_failed = Arc::new(AtomicBool::new(false));
        let failed = Arc::clone(&write_failed);
        std::thread::Builder::new()
            .name("fencegate-store-writer".into())
            .spawn(move || writer(&writer_db, jobs, group_max.max(1), &group_size, &failed))
            .map_err(|source| EmbeddedStartError::DataDir {
                path: path.clone(),
                source,
            })?;
        Ok(EmbeddedStore {
            db,
            queue,
            path,
            id,
            timeout,
            write_failed,
            reads: Arc::new(tokio::sync::Semaphore::new(READS_AT_ONCE)),
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "embedded store at {} (store {})",
            self.path.display(),
            self.id
        )
    }

    pub async fn write(&self, write: &Write) -> Result<WriteOutcome, StoreError> {
        let write = write.clone();
        self.submit(|reply| Job::Write { write, reply }).await
    }

    pub async fn advance(
        &self,
        resource: &ResourceName,
        token: Token,
    ) -> Result<AdvanceOutcome, StoreError> {
        let resource = resource.clone();
        self.submit(|reply| Job::Advance {
            resource,
            token,
            reply,
        })
        .await
    }

    /// Applies a transaction, keyed or not; see [`crate::store::txn`]. A retry of a keyed
    /// write queues behind its first attempt and finds its answer: this store never
    /// answers `InFlight`.
    pub async fn txn(
        &self,
        txn: &crate::store::txn::Txn,
        keyed: Option<&crate::store::txn::Keyed>,
    ) -> Result<crate::store::txn::Answered, StoreError> {
        let (txn, keyed) = (txn.clone(), keyed.cloned());
        self.submit(|reply| Job::Txn { txn, keyed, reply }).await
    }

    /// Removes up to `limit` expired idempotency records; returns how many went.
    pub async fn expire_idempotency(&self, limit: u32) -> Result<u64, StoreError> {
        self.submit(|reply| Job::Expire { limit, reply }).await
    }

    /// The usage of stored answers; counted as they are stored and removed, so the
    /// store needs no report of them.
    pub async fn answer_usage(
        &self,
        bounds: crate::store::txn::IdentityBounds,
    ) -> Result<crate::store::txn::AnswerUsage, StoreError> {
        self.read(move |db| {
            let txn = db.begin_read()?;
            let table = txn.open_table(IDEMPOTENCY_USAGE)?;
            let mut usage = crate::store::txn::AnswerUsage::default();
            for entry in table.iter()? {
                let (identity, counts) = entry?;
                let (records, bytes) = counts.value();
                usage.records += records;
                usage.bytes += bytes;
                if records >= bounds.records || bytes >= bounds.bytes {
                    usage.full.push(identity.value().to_owned());
                }
            }
            Ok(usage)
        })
        .await
    }

    /// The unexpired answer stored under (`identity`, `key`), with the fingerprint of
    /// its request.
    pub async fn stored_answer(
        &self,
        identity: &str,
        key: &str,
    ) -> Result<Option<(Vec<u8>, crate::store::txn::StoredAnswer)>, StoreError> {
        let (identity, key) = (identity.to_owned(), key.to_owned());
        self.read(move |db| {
            let txn = db.begin_read()?;
            let table = txn.open_table(IDEMPOTENCY)?;
            let Some(entry) = table.get((identity.as_str(), key.as_str()))? else {
                return Ok(None);
            };
            let (fingerprint, expires, status, headers, body) = entry.value();
            if expires <= now_ms() {
                return Ok(None);
            }
            let answer = crate::store::txn::StoredAnswer {
                status,
                headers: crate::store::txn::StoredAnswer::parse_headers(headers),
                body: Bytes::copy_from_slice(body),
            };
            Ok(Some((fingerprint.to_vec(), answer)))
        })
        .await
    }

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
        let (resource, key) = (resource.clone(), key.clone());
        self.read(move |db| {
            let txn = db.begin_read()?;
            let objects = txn.open_table(OBJECTS)?;
            let Some(entry) = objects.get((resource.as_str(), key.as_str()))? else {
                return Ok(None);
            };
            let (token, version, _born, value) = entry.value();
            let Some(value) = value else { return Ok(None) };
            let token = Token::new(token)
                .map_err(|_| corrupt(format!("token {token} of {resource}/{key}")))?;
            let permit = match admit(value.len()) {
                Ok(permit) => permit,
                Err(refused) => return Ok(Some(Err(refused))),
            };
            let object = StoredObject {
                value: Bytes::copy_from_slice(value),
                version,
                token,
            };
            Ok(Some(Ok((object, permit))))
        })
        .await
    }

    pub async fn list(
        &self,
        resource: &ResourceName,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        let (resource, prefix) = (resource.clone(), prefix.to_owned());
        let after = after.map(str::to_owned);
        self.read(move |db| {
            let txn = db.begin_read()?;
            let objects = txn.open_table(OBJECTS)?;
            let start = match &after {
                Some(after) if after.as_str() >= prefix.as_str() => after.as_str(),
                _ => prefix.as_str(),
            };
            let mut found = Vec::new();
            for entry in objects.range((resource.as_str(), start)..)? {
                let (key, row) = entry?;
                let (owner, key) = key.value();
                if owner != resource.as_str() || !key.starts_with(prefix.as_str()) {
                    break;
                }
                if after.as_deref() == Some(key) {
                    continue;
                }
                let (_token, _version, _born, value) = row.value();
                if let Some(value) = value {
                    found.push((key.to_owned(), Bytes::copy_from_slice(value)));
                    if found.len() == limit {
                        break;
                    }
                }
            }
            Ok(found)
        })
        .await
    }

    pub async fn fence(&self, resource: &ResourceName) -> Result<Option<Token>, StoreError> {
        let resource = resource.clone();
        self.read(move |db| {
            let txn = db.begin_read()?;
            let fences = txn.open_table(FENCES)?;
            let highest = fences.get(resource.as_str())?.map(|entry| entry.value());
            highest
                .map(|h| Token::new(h).map_err(|_| corrupt(format!("highest {h} of {resource}"))))
                .transpose()
        })
        .await
    }

    pub async fn lease(
        &self,
        resource: &ResourceName,
        op: &LeaseOp,
        claimant: &Claimant,
        keyed: Option<&crate::store::txn::Keyed<LeaseOutcome>>,
    ) -> Result<crate::store::txn::Answered<LeaseOutcome>, StoreError> {
        let (resource, op, claimant) = (resource.clone(), op.clone(), claimant.clone());
        let keyed = keyed.cloned();
        self.submit(|reply| Job::Lease {
            resource,
            op,
            claimant,
            keyed,
            reply,
        })
        .await
    }

    pub async fn read_lease(&self, resource: &ResourceName) -> Result<LeaseRecord, StoreError> {
        let resource = resource.clone();
        self.read(move |db| {
            let txn = db.begin_read()?;
            let leases = txn.open_table(LEASES)?;
            let Some(entry) = leases.get(resource.as_str())? else {
                return Ok(LeaseRecord::default());
            };
            let (holder, identity, token, expires) = entry.value();
            Ok(lease_record(holder, identity, token, expires, now_ms()))
        })
        .await
    }

    pub async fn reset(&self, reset: &Reset) -> Result<ResetOutcome, StoreError> {
        let reset = reset.clone();
        self.submit(|reply| Job::Reset { reset, reply }).await
    }

    pub async fn resets_since(&self, generation: u64) -> Result<Vec<ResetRecord>, StoreError> {
        self.read(move |db| {
            let txn = db.begin_read()?;
            let resets = txn.open_table(RESETS)?;
            let mut records = Vec::new();
            for entry in resets.range(generation.saturating_add(1)..)? {
                let (generation, row) = entry?;
                let (resource, _, to, _, _, _) = row.value();
                records.push(ResetRecord {
                    generation: generation.value(),
                    resource: ResourceName::new(resource).map_err(|_| {
                        corrupt(format!("resource of reset {}", generation.value()))
                    })?,
                    to: Token::new(to)
                        .map_err(|_| corrupt(format!("token of reset {}", generation.value())))?,
                });
            }
            Ok(records)
        })
        .await
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        if self.queue.is_closed() {
            return Err(StoreError::Internal(
                "the store's writer thread has stopped".into(),
            ));
        }
        self.read(|db| db.begin_read().map(drop).map_err(Into::into))
            .await
    }

    /// The readiness write probe: room for a commit beside the store (a file written,
    /// fsynced and removed, which a full disk refuses even where redb would reuse its
    /// own pages), then a key of the store rewritten in a durable write transaction.
    pub async fn probe_write(&self) -> Result<Result<(), NotWritable>, StoreError> {
        let dir = self.path.parent().map(Path::to_owned).unwrap_or_default();
        let db = Arc::clone(&self.db);
        let probed = tokio::task::spawn_blocking(move || {
            probe_file(&dir.join(PROBE_FILE_NAME))?;
            probe_store(&db)
        });
        let outcome = tokio::time::timeout(self.timeout, probed)
            .await
            .map_err(|_| StoreError::Unavailable {
                reason: UnavailableReason::Timeout,
                applied: None,
            })?
            .map_err(|error| StoreError::Internal(format!("write probe failed: {error}")))?;
        if outcome.is_ok() {
            self.write_failed.store(false, Ordering::Release);
        }
        Ok(outcome)
    }

    pub fn write_failed_since_probe(&self) -> bool {
        self.write_failed.load(Ordering::Acquire)
    }

    /// Queues a job for the writer and waits for its answer, within the backend timeout.
    async fn submit<T>(&self, job: impl FnOnce(Responder<T>) -> Job) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        let exchange = async {
            self.queue.send(job(reply)).await.map_err(|_| {
                StoreError::Internal("the store's writer thread has stopped".into())
            })?;
            answer.await.map_err(|_| {
                StoreError::Internal("the store's writer thread dropped a write".into())
            })?
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .unwrap_or(Err(StoreError::Unavailable {
                reason: UnavailableReason::Timeout,
                applied: None,
            }))
    }

    async fn read<T: Send + 'static>(
        &self,
        read: impl FnOnce(&Database) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let db = Arc::clone(&self.db);
        let _turn = self
            .reads
            .acquire()
            .await
            .expect("the read semaphore is never closed");
        tokio::task::spawn_blocking(move || read(&db))
            .await
            .map_err(|error| StoreError::Internal(format!("read task failed: {error}")))?
    }
}

/// The gateway's wall clock, in ms since the Unix epoch: the clock of hosted leases.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// A stored lease as seen at `now` (ms since the Unix epoch).
fn lease_record(
    holder: Option<&str>,
    identity: Option<&str>,
    token: u64,
    expires: u64,
    now: u64,
) -> LeaseRecord {
    LeaseRecord {
        holder: holder.map(str::to_owned),
        identity: identity.map(str::to_owned),
        token: Token::new(token).ok(),
        remaining: Duration::from_millis(expires.saturating_sub(now)),
    }
}

fn corrupt(what: String) -> StoreError {
    StoreError::Internal(format!("invalid {what} in the embedded store"))
}

impl From<redb::Error> for StoreError {
    fn from(error: redb::Error) -> StoreError {
        tracing::error!(%error, "embedded store read failed");
        StoreError::Unavailable {
            reason: UnavailableReason::Storage,
            applied: Some(false),
        }
    }
}

macro_rules! redb_errors_into_store_errors {
    ($($error:ty),*) => {
        $(impl From<$error> for StoreError {
            fn from(error: $error) -> StoreError {
                redb::Error::from(error).into()
            }
        })*
    };
}
redb_errors_into_store_errors!(redb::TransactionError, redb::TableError, redb::StorageError);
