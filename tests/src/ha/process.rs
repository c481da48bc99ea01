//! The processes of the cluster: spawned in process groups of their own with their
//! output in log files, signalled by group or by pid, and found in `/proc`.
//!
//! A process that exits without having been sent SIGTERM or SIGKILL by the test has
//! failed: [`Process::unexpected_exit`] says so, and the cluster's waits stop at once
//! with its exit status and its log instead of running out their time.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// Lines of each log a failure shows.
pub(super) const TAIL_LINES: usize = 40;

/// Lines naming a permission error a failure shows, over all logs.
const PERMISSION_LINES: usize = 10;

/// A process of the cluster, in a process group of its own, logging to a file.
pub(super) struct Process {
    name: String,
    /// Locked only to look at or reap the child, never across an `.await`.
    child: Mutex<Child>,
    log: PathBuf,
    /// Set once the test sent the process SIGTERM or SIGKILL: its exit is expected.
    stopped: AtomicBool,
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
            child: Mutex::new(child),
            log,
            stopped: AtomicBool::new(false),
        }
    }

    /// The process group: the pid of the process spawned, unless it has exited and
    /// was reaped.
    pub(super) fn group(&self) -> Option<u32> {
        self.child.lock().unwrap().id()
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`, `KILL`) to the whole group.
    pub(super) fn signal(&self, signal: &str) {
        if matches!(signal, "TERM" | "KILL") {
            self.stopped.store(true, Ordering::Relaxed);
        }
        if let Some(group) = self.group() {
            signal_group(group, signal);
        }
    }

    /// Whether the test sent the process SIGTERM or SIGKILL.
    pub(super) fn was_stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }

    /// The exit status, once the process has exited.
    pub(super) fn exit_status(&self) -> Option<ExitStatus> {
        self.child.lock().unwrap().try_wait().ok().flatten()
    }

    /// Waits up to `timeout` for the process to exit; whether it did.
    pub(super) async fn wait_exit(&self, timeout: Duration) -> bool {
        let started = Instant::now();
        while started.elapsed() < timeout {
            if self.exit_status().is_some() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// `<name> exited (<status>)` if the process exited although the test did not
    /// stop it.
    pub(super) fn unexpected_exit(&self) -> Option<String> {
        if self.was_stopped() {
            return None;
        }
        let status = self.exit_status()?;
        Some(format!(
            "{} exited ({status}); its log is {}",
            self.name,
            self.log.display()
        ))
    }

    /// The last lines of the log, under a header naming the process and the file.
    pub(super) fn tail(&self) -> String {
        format!(
            "--- {} ({}):\n{}",
            self.name,
            self.log.display(),
            tail(&self.log)
        )
    }

    /// The lines of the whole log that report a permission error, each prefixed with
    /// the process's name.
    pub(super) fn permission_errors(&self) -> Vec<String> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .filter(|line| line.to_ascii_lowercase().contains("permission denied"))
            .take(PERMISSION_LINES)
            .map(|line| format!("{}: {line}", self.name))
            .collect()
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

/// Checks that the `postgres` OS user can read `path` (and enter every directory
/// above it); else the error it gets, e.g. `Permission denied`.
pub(super) async fn readable_by_postgres(path: &Path) -> Result<(), String> {
    let output = Command::new("runuser")
        .args(["-u", "postgres", "--", "head", "-c", "0"])
        .arg(path)
        .output()
        .await
        .map_err(|e| format!("runuser: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).trim().to_owned())
    }
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
pub(super) fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
}
