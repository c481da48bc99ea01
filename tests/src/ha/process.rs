//! The processes of the cluster: spawned in process groups of their own with their
//! output in log files, signalled by group or by pid, and found in `/proc`.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::process::{Child, Command};

/// Lines of each log a failure shows.
const TAIL_LINES: usize = 40;

/// A process of the cluster, in a process group of its own, logging to a file.
pub(super) struct Process {
    name: String,
    pub(super) child: Child,
    log: PathBuf,
}

impl Process {
    /// Spawns `command` in a new process group, its output appended to `log`.
    pub(super) fn spawn(name: &str, mut command: Command, log: PathBuf) -> Process {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let err = file.try_clone().expect("a log file can be duplicated");
        let child = command
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Process {
            name: name.to_owned(),
            child,
            log,
        }
    }

    /// The process group: the pid of the process spawned, unless it has exited.
    pub(super) fn group(&self) -> Option<u32> {
        self.child.id()
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`, `KILL`) to the whole group.
    pub(super) fn signal(&self, signal: &str) {
        if let Some(group) = self.group() {
            signal_group(group, signal);
        }
    }

    pub(super) fn tail(&self) -> String {
        format!(
            "--- {} ({}):\n{}",
            self.name,
            self.log.display(),
            tail(&self.log)
        )
    }
}

/// Sends `signal` to every process of group `group` (`kill -SIG -- -group`).
pub(super) fn signal_group(group: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .args([&format!("-{signal}"), "--", &format!("-{group}")])
        .stderr(Stdio::null())
        .status();
}

/// Sends `signal` to process `pid`, if it still runs.
pub(super) fn signal_process(pid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// The process group of `pid`, from `/proc/<pid>/stat`.
pub(super) fn process_group(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ppid pgrp ...; comm may hold spaces, so read after its ')'.
    text[text.rfind(')')? + 1..]
        .split_whitespace()
        .nth(2)?
        .parse()
        .ok()
}

/// The processes whose parent is `pid`.
pub(super) fn children(pid: u32) -> Vec<u32> {
    let parent = |child: u32| -> Option<u32> {
        let text = std::fs::read_to_string(format!("/proc/{child}/stat")).ok()?;
        text[text.rfind(')')? + 1..]
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| parent(*child) == Some(pid))
        .collect()
}

/// The uid and gid of the `postgres` OS user.
pub(super) async fn postgres_ids() -> (u32, u32) {
    let id = |flag: &'static str| async move {
        let output = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .await
            .expect("the id command runs");
        assert!(
            output.status.success(),
            "there is no `postgres` OS user (PostgreSQL 15's server package makes it)"
        );
        String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse::<u32>()
            .expect("id prints a number")
    };
    (id("-u").await, id("-g").await)
}

/// The last [`TAIL_LINES`] lines of `path`.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
}
