//! The store's file: marked as a fencegate store when new and checked when it is not,
//! its raise log seeded once, and the write probes that readiness runs.

use std::path::Path;

use redb::{Database, ReadableTable, TableHandle};

use super::identity::{self, Reconciled, StoreId};
use super::{
    now_ms, EmbeddedStartError, FENCES, FORMAT_KEY, FORMAT_VERSION, IDEMPOTENCY,
    IDEMPOTENCY_EXPIRY, IDEMPOTENCY_USAGE, IDENTITY, LEASES, META, OBJECTS, PROBE_FILE_BYTES,
    RAISES, RAISES_SEEDED_KEY, RAISE_FLOORS, READINESS, RESETS, STORE_ID_KEY, USAGE_SEEDED_KEY,
};
use crate::store::NotWritable;

/// Counts the answers of a store written before their usage was kept, once.
fn seed_usage(txn: &redb::WriteTransaction) -> Result<(), redb::Error> {
    let mut meta = txn.open_table(META)?;
    if meta.get(USAGE_SEEDED_KEY)?.is_some() {
        return Ok(());
    }
    let answers = txn.open_table(IDEMPOTENCY)?;
    let mut usage = txn.open_table(IDEMPOTENCY_USAGE)?;
    for entry in answers.iter()? {
        let (id, row) = entry?;
        let (identity, key) = id.value();
        let (_, _, status, headers, body) = row.value();
        let answer = crate::store::txn::StoredAnswer {
            status,
            headers: crate::store::txn::StoredAnswer::parse_headers(headers),
            body: bytes::Bytes::copy_from_slice(body),
        };
        let bytes = crate::store::txn::record_bytes(identity, key, &answer);
        let (records, total) = usage.get(identity)?.map_or((0, 0), |u| u.value());
        usage.insert(identity, (records + 1, total + bytes))?;
    }
    meta.insert(USAGE_SEEDED_KEY, 1)?;
    Ok(())
}

/// Records the fences of a store written before the raise log, once.
fn seed_raises(txn: &redb::WriteTransaction) -> Result<(), redb::Error> {
    let mut meta = txn.open_table(META)?;
    if meta.get(RAISES_SEEDED_KEY)?.is_some() {
        return Ok(());
    }
    let fences = txn.open_table(FENCES)?;
    let mut raises = txn.open_table(RAISES)?;
    for entry in fences.iter()? {
        let (resource, highest) = entry?;
        raises.insert((resource.value(), highest.value()), ("unknown", now_ms()))?;
    }
    meta.insert(RAISES_SEEDED_KEY, 1)?;
    Ok(())
}

/// Marks a new file as a fencegate store, or checks that an existing one is one.
/// Compares its identity with the directory's (`dir_id`), giving it one if it
/// has none, and returns what was found.
pub(super) fn initialise(
    db: &Database,
    path: &Path,
    existed: bool,
    dir_id: Option<StoreId>,
) -> Result<Reconciled, EmbeddedStartError> {
    let open_error = |source: redb::Error| EmbeddedStartError::Open {
        path: path.to_owned(),
        source,
    };
    let txn = db.begin_write().map_err(|e| open_error(e.into()))?;
    let reconciled;
    {
        let marked = {
            let meta = txn.open_table(META).map_err(|e| open_error(e.into()))?;
            let found = meta
                .get(FORMAT_KEY)
                .map_err(|e| open_error(e.into()))?
                .map(|v| v.value());
            found
        };
        match marked {
            Some(found) if found > FORMAT_VERSION => {
                return Err(EmbeddedStartError::FormatTooNew {
                    path: path.to_owned(),
                    found,
                    supported: FORMAT_VERSION,
                })
            }
            Some(_) => {}
            None if existed && has_foreign_tables(&txn) => {
                return Err(EmbeddedStartError::NotAStore {
                    path: path.to_owned(),
                    reason: "it is a redb database without fencegate's marker".into(),
                })
            }
            None => {
                let mut meta = txn.open_table(META).map_err(|e| open_error(e.into()))?;
                meta.insert(FORMAT_KEY, FORMAT_VERSION)
                    .map_err(|e| open_error(e.into()))?;
            }
        }
        // Create the tables, so that readers never find them missing.
        txn.open_table(FENCES).map_err(|e| open_error(e.into()))?;
        txn.open_table(OBJECTS).map_err(|e| open_error(e.into()))?;
        txn.open_table(LEASES).map_err(|e| open_error(e.into()))?;
        txn.open_table(RESETS).map_err(|e| open_error(e.into()))?;
        txn.open_table(RAISE_FLOORS)
            .map_err(|e| open_error(e.into()))?;
        txn.open_table(READINESS)
            .map_err(|e| open_error(e.into()))?;
        txn.open_table(IDEMPOTENCY)
            .map_err(|e| open_error(e.into()))?;
        txn.open_table(IDEMPOTENCY_EXPIRY)
            .map_err(|e| open_error(e.into()))?;
        seed_usage(&txn).map_err(open_error)?;
        seed_raises(&txn).map_err(open_error)?;
        let mut table = txn.open_table(IDENTITY).map_err(|e| open_error(e.into()))?;
        let file_id =
            match table.get(STORE_ID_KEY).map_err(|e| open_error(e.into()))? {
                Some(text) => Some(StoreId::parse(text.value()).ok_or_else(|| {
                    EmbeddedStartError::NotAStore {
                        path: path.to_owned(),
                        reason: "its store identity is not 32 hex digits".into(),
                    }
                })?),
                None => None,
            };
        reconciled = identity::reconcile(path, file_id, dir_id)?;
        if let Reconciled::Adopt(id) = reconciled {
            table
                .insert(STORE_ID_KEY, id.to_string().as_str())
                .map_err(|e| open_error(e.into()))?;
        }
    }
    txn.commit().map_err(|e| open_error(e.into()))?;
    Ok(reconciled)
}

fn has_foreign_tables(txn: &redb::WriteTransaction) -> bool {
    txn.list_tables()
        .map(|tables| tables.into_iter().any(|table| table.name() != META.name()))
        .unwrap_or(true)
}

/// Writes `PROBE_FILE_BYTES` to `path`, fsyncs and removes it.
pub(super) fn probe_file(path: &Path) -> Result<(), NotWritable> {
    use std::io::Write as _;
    let failed = |error: std::io::Error| NotWritable {
        reason: crate::store::NotWritableReason::of_io(&error),
        detail: format!("could not write {}: {error}", path.display()),
    };
    let written = std::fs::File::create(path).and_then(|mut file| {
        file.write_all(&[0; PROBE_FILE_BYTES])?;
        file.sync_all()
    });
    let removed = std::fs::remove_file(path);
    written.map_err(failed)?;
    removed.map_err(failed)
}

/// Rewrites the readiness key in a durable write transaction.
pub(super) fn probe_store(db: &Database) -> Result<(), NotWritable> {
    let written = (|| -> Result<(), redb::Error> {
        let txn = db.begin_write()?;
        txn.open_table(READINESS)?.insert("probe", now_ms())?;
        txn.commit()?;
        Ok(())
    })();
    written.map_err(|error| NotWritable {
        reason: match &error {
            redb::Error::Io(io) => crate::store::NotWritableReason::of_io(io),
            _ => crate::store::NotWritableReason::WriteFailed,
        },
        detail: format!("the store's file could not be written: {error}"),
    })
}
