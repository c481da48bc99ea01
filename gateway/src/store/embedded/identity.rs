//! The store's identity: a random 128-bit id, kept inside the redb file and in a file
//! next to it, so that a store file that went missing or was emptied is never taken
//! for a new, empty store.
//!
//! # Behavior
//!
//! - A new store gets its id in the redb file (table `fencegate_identity`) in the
//!   transaction that creates its tables, then in `fencegate.store-id` next to it,
//!   written atomically (a temporary file, fsync, rename, fsync of the directory).
//! - At start, [`judge`] decides from what is on disk *before* the redb file is opened
//!   or created: a directory whose identity file names a store, with the redb file
//!   missing or empty, is refused; so is an empty redb file on its own. Nothing is
//!   written before the file's lock is taken, so a second gateway on the same directory
//!   changes nothing.
//! - After opening, [`reconcile`] compares the two ids: different ids are refused (the
//!   file of another store); a file without an id (made by an older gateway) is adopted
//!   when the directory has no identity file either; a file whose identity file is
//!   missing gets it written again.
//! - `--init-store` starts an empty store deliberately, and only where no store file
//!   with content exists: it can never erase fences.

use std::io::Write as _;
use std::path::Path;

use super::EmbeddedStartError;

/// The identity file inside `--data-dir`.
pub const ID_FILE_NAME: &str = "fencegate.store-id";

/// A store's identity: 128 random bits, written as 32 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreId(u128);

impl StoreId {
    pub fn random() -> StoreId {
        StoreId(rand::random())
    }

    pub fn parse(text: &str) -> Option<StoreId> {
        let text = text.trim();
        if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u128::from_str_radix(text, 16).ok().map(StoreId)
    }
}

impl std::fmt::Display for StoreId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// What the redb file is on disk before it is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileState {
    Missing,
    Empty,
    NonEmpty,
}

impl FileState {
    pub fn of(path: &Path) -> Result<FileState, EmbeddedStartError> {
        match std::fs::metadata(path) {
            Ok(meta) if meta.len() == 0 => Ok(FileState::Empty),
            Ok(_) => Ok(FileState::NonEmpty),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(FileState::Missing),
            Err(source) => Err(EmbeddedStartError::DataDir {
                path: path.to_owned(),
                source,
            }),
        }
    }
}

/// The identity recorded in `data_dir`, if any.
pub fn read_dir_id(data_dir: &Path) -> Result<Option<StoreId>, EmbeddedStartError> {
    let path = data_dir.join(ID_FILE_NAME);
    match std::fs::read_to_string(&path) {
        Ok(text) => StoreId::parse(&text)
            .map(Some)
            .ok_or(EmbeddedStartError::BadIdentityFile { path }),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(EmbeddedStartError::IdentityFile { path, source }),
    }
}

/// Writes `id` into `data_dir`'s identity file so that it is either the old content or
/// the new, never a torn one, and durable when this returns.
pub fn write_dir_id(data_dir: &Path, id: StoreId) -> Result<(), EmbeddedStartError> {
    let path = data_dir.join(ID_FILE_NAME);
    let temporary = data_dir.join(format!("{ID_FILE_NAME}.tmp"));
    let failed = |source| EmbeddedStartError::IdentityFile {
        path: path.clone(),
        source,
    };
    let mut file = std::fs::File::create(&temporary).map_err(failed)?;
    file.write_all(format!("{id}\n").as_bytes())
        .map_err(failed)?;
    file.sync_all().map_err(failed)?;
    drop(file);
    std::fs::rename(&temporary, &path).map_err(failed)?;
    // The rename, and a redb file created just before, are durable once the directory is.
    std::fs::File::open(data_dir)
        .and_then(|dir| dir.sync_all())
        .map_err(failed)
}

/// What to do with the redb file, decided before opening it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Open the existing store.
    Open,
    /// Create a new store (removing an empty file first, with `--init-store`).
    Create,
}

/// Decides, from the redb file's state and the directory's identity, whether the store
/// may start, before anything is written; see the module doc.
pub fn judge(
    path: &Path,
    state: FileState,
    dir_id: Option<StoreId>,
    init_store: bool,
) -> Result<Start, EmbeddedStartError> {
    let id_file = || path.with_file_name(ID_FILE_NAME);
    match (state, dir_id, init_store) {
        (FileState::NonEmpty, _, true) => Err(EmbeddedStartError::InitRefused {
            path: path.to_owned(),
        }),
        (FileState::NonEmpty, _, false) => Ok(Start::Open),
        (_, _, true) | (FileState::Missing, None, false) => Ok(Start::Create),
        (FileState::Missing, Some(id), false) => Err(EmbeddedStartError::Lost {
            path: path.to_owned(),
            what: "is missing",
            id_file: id_file(),
            id,
        }),
        (FileState::Empty, Some(id), false) => Err(EmbeddedStartError::Lost {
            path: path.to_owned(),
            what: "is empty (zero bytes)",
            id_file: id_file(),
            id,
        }),
        (FileState::Empty, None, false) => Err(EmbeddedStartError::EmptyFile {
            path: path.to_owned(),
        }),
    }
}

/// The outcome of comparing the file's identity with the directory's, after opening.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reconciled {
    /// Both agree.
    Same(StoreId),
    /// The directory's identity file was missing: write it.
    WriteDirFile(StoreId),
    /// Neither has an identity (a store of an older gateway, or a new one): give the
    /// file `id`, then the directory.
    Adopt(StoreId),
}

/// Compares the redb file's identity (`file_id`) with the directory's (`dir_id`).
pub fn reconcile(
    path: &Path,
    file_id: Option<StoreId>,
    dir_id: Option<StoreId>,
) -> Result<Reconciled, EmbeddedStartError> {
    match (file_id, dir_id) {
        (Some(found), Some(expected)) if found == expected => Ok(Reconciled::Same(found)),
        (Some(found), Some(expected)) => Err(EmbeddedStartError::ForeignFile {
            path: path.to_owned(),
            found,
            expected,
        }),
        (Some(found), None) => Ok(Reconciled::WriteDirFile(found)),
        (None, Some(expected)) => Err(EmbeddedStartError::Unidentified {
            path: path.to_owned(),
            expected,
        }),
        (None, None) => Ok(Reconciled::Adopt(StoreId::random())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_as_hex() {
        let id = StoreId::random();
        let text = id.to_string();
        assert_eq!(text.len(), 32);
        assert_eq!(StoreId::parse(&format!("{text}\n")), Some(id));
        assert_eq!(StoreId::parse("xyz"), None);
        assert_eq!(StoreId::parse(&"g".repeat(32)), None);
        assert_ne!(StoreId::random(), StoreId::random());
    }

    #[test]
    fn a_store_that_was_here_is_never_started_empty() {
        let path = Path::new("/data/fencegate.redb");
        let id = Some(StoreId::random());
        use FileState::*;
        let refused = |state, dir_id, init| judge(path, state, dir_id, init).is_err();
        assert_eq!(judge(path, Missing, None, false).unwrap(), Start::Create);
        assert_eq!(judge(path, NonEmpty, id, false).unwrap(), Start::Open);
        assert_eq!(judge(path, NonEmpty, None, false).unwrap(), Start::Open);
        assert!(refused(Missing, id, false));
        assert!(refused(Empty, id, false));
        assert!(refused(Empty, None, false));
        // --init-store starts afresh only where no file has content.
        assert_eq!(judge(path, Missing, id, true).unwrap(), Start::Create);
        assert_eq!(judge(path, Empty, id, true).unwrap(), Start::Create);
        assert_eq!(judge(path, Empty, None, true).unwrap(), Start::Create);
        assert!(refused(NonEmpty, id, true));
        assert!(refused(NonEmpty, None, true));
    }

    #[test]
    fn identities_must_agree() {
        let path = Path::new("/data/fencegate.redb");
        let (a, b) = (StoreId::random(), StoreId::random());
        assert_eq!(
            reconcile(path, Some(a), Some(a)).unwrap(),
            Reconciled::Same(a)
        );
        assert_eq!(
            reconcile(path, Some(a), None).unwrap(),
            Reconciled::WriteDirFile(a)
        );
        assert!(reconcile(path, Some(a), Some(b)).is_err());
        assert!(reconcile(path, None, Some(b)).is_err());
        assert!(matches!(
            reconcile(path, None, None).unwrap(),
            Reconciled::Adopt(_)
        ));
    }
}
