//! The door's log lines about clients: at most one a [`WINDOW_SECS`] window per kind.
//!
//! Anyone who can reach the door can make these happen — cancel requests with made-up
//! keys, broken start-up packets, wrong passwords, refusals — as fast as they can open
//! connections. One line per kind and window shows that it happens; the metrics count
//! every one; and a summary line per kind says how many more there were
//! ([`DoorLogs::summarise`], run every window by the door).

use crate::log_budget::LogBudget;

/// The length of a window, in seconds.
pub(crate) const WINDOW_SECS: u64 = 10;

/// A kind of line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LineKind {
    UnknownCancel,
    ProtocolError,
    LoginFailed,
    Refused,
}

impl LineKind {
    const ALL: [LineKind; 4] = [
        LineKind::UnknownCancel,
        LineKind::ProtocolError,
        LineKind::LoginFailed,
        LineKind::Refused,
    ];

    /// What the summary line counts.
    fn plural(self) -> &'static str {
        match self {
            LineKind::UnknownCancel => "cancel requests with unknown keys",
            LineKind::ProtocolError => "Postgres protocol errors",
            LineKind::LoginFailed => "failed Postgres door logins",
            LineKind::Refused => "Postgres door refusals",
        }
    }
}

/// One budget per kind.
pub(crate) struct DoorLogs {
    budgets: [LogBudget; 4],
}

impl Default for DoorLogs {
    fn default() -> DoorLogs {
        DoorLogs {
            budgets: LineKind::ALL.map(|_| LogBudget::per_window(1, WINDOW_SECS)),
        }
    }
}

impl DoorLogs {
    fn budget(&self, kind: LineKind) -> &LogBudget {
        &self.budgets[LineKind::ALL.iter().position(|k| *k == kind).unwrap_or(0)]
    }

    /// `Some(lines left out before this one)` if a line of `kind` may be logged now.
    pub(crate) fn take_line(&self, kind: LineKind) -> Option<u64> {
        self.budget(kind).take_line()
    }

    /// Logs, for each kind, how many lines were left out since the last line or
    /// summary.
    pub(crate) fn summarise(&self) {
        for kind in LineKind::ALL {
            let more = self.budget(kind).take_refused();
            if more > 0 {
                tracing::info!(
                    count = more,
                    "{more} more {} in the last {WINDOW_SECS}s",
                    kind.plural()
                );
            }
        }
    }
}
