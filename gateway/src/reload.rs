//! Files the gateway reads again when they change: the auth file, the TLS certificate,
//! key and client CA.
//!
//! Each file's modification time and size are checked every [`INTERVAL`]; any change
//! (including a file that appears, disappears, or is replaced by a rename, as
//! Kubernetes does with mounted secrets) calls the owner's reload, which parses the
//! files anew and keeps what is in force when they do not parse. Polling, rather than
//! inotify, sees renames through symlinked secret volumes and costs one `stat` per file
//! a second.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// How often the files are checked.
pub(crate) const INTERVAL: Duration = Duration::from_secs(1);

/// Calls `reload` whenever the modification time or size of one of `paths` changes;
/// runs until the process ends.
pub(crate) async fn on_change(paths: Vec<PathBuf>, mut reload: impl FnMut()) {
    let stamps = || paths.iter().map(|path| stamp(path)).collect::<Vec<_>>();
    let mut seen = stamps();
    let mut tick = tokio::time::interval(INTERVAL);
    loop {
        tick.tick().await;
        let now = stamps();
        if now != seen {
            seen = now;
            reload();
        }
    }
}

/// What tells a file's versions apart: its modification time and size; `None` if it
/// cannot be read.
fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()))
}
