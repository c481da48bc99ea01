//! What a Postgres error means for the gateway, judged by SQLSTATE and never by
//! message: the server going away or aborting a statement is "unavailable", with what
//! is known of the write; anything else from the server is a bug or a schema changed
//! under the gateway.

use tokio_postgres::error::SqlState;

use crate::store::{StoreError, UnavailableReason};

/// The server is going away or refusing connections (with the whole of class 08,
/// connection exceptions): no statement on this connection can succeed now.
const SERVER_UNAVAILABLE: &[SqlState] = &[
    SqlState::ADMIN_SHUTDOWN,
    SqlState::CRASH_SHUTDOWN,
    SqlState::CANNOT_CONNECT_NOW,
    SqlState::TOO_MANY_CONNECTIONS,
    SqlState::IDLE_SESSION_TIMEOUT,
];

/// The server ended a gateway statement without applying it, for reasons of the moment
/// (cancelled, a serialization failure, a deadlock, or a write sent to a server in
/// recovery — a failover under way, or a proxy that routed to a node not yet promoted,
/// as HAProxy in front of Patroni does while a crashed primary restarts): the writer
/// may try again.
const STATEMENT_ABORTED: &[SqlState] = &[
    SqlState::QUERY_CANCELED,
    SqlState::T_R_SERIALIZATION_FAILURE,
    SqlState::T_R_DEADLOCK_DETECTED,
    SqlState::READ_ONLY_SQL_TRANSACTION,
];

/// Whether `code` says the server is going away or refusing connections.
pub(crate) fn server_unavailable(code: &SqlState) -> bool {
    SERVER_UNAVAILABLE.contains(code) || code.code().starts_with("08")
}

/// What had been sent on a connection when its statement failed: what losing the
/// connection then means for the write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    /// Nothing that commits by itself: a lost connection applied nothing.
    NoCommit,
    /// A statement that commits by itself (autocommit, or COMMIT): a lost connection
    /// leaves the outcome unknown.
    Commit,
}

impl Sent {
    /// What is known of the write once the connection is lost: not applied, or — a
    /// commit sent — unknown.
    pub(crate) fn applied_if_lost(self) -> Option<bool> {
        match self {
            Sent::NoCommit => Some(false),
            Sent::Commit => None,
        }
    }
}

/// Sorts a Postgres error into "unavailable" (with what is known of the write) or
/// "internal"; `sent` says whether losing the connection leaves the write's outcome
/// unknown.
pub(crate) fn classify(error: tokio_postgres::Error, sent: Sent) -> StoreError {
    if let Some(code) = error.code() {
        // The server answered with an error, so this statement did not commit.
        if *code == SqlState::LOCK_NOT_AVAILABLE {
            // Only the write lanes set a lock timeout (`group`): the statement waited too
            // long for a fence lock and did nothing.
            return StoreError::Unavailable {
                reason: UnavailableReason::LockTimeout,
                applied: Some(false),
            };
        }
        if server_unavailable(code) || STATEMENT_ABORTED.contains(code) {
            tracing::warn!(code = code.code(), %error, "the database aborted a statement");
            return StoreError::Unavailable {
                reason: UnavailableReason::ServerAborted,
                applied: Some(false),
            };
        }
        return StoreError::Internal(format!("database error: {}", error_text(&error)));
    }
    if error.is_closed()
        || std::error::Error::source(&error).is_some_and(|s| s.is::<std::io::Error>())
    {
        tracing::warn!(%error, "lost the database connection");
        return StoreError::Unavailable {
            reason: UnavailableReason::ConnectionLost,
            applied: sent.applied_if_lost(),
        };
    }
    StoreError::Internal(error_text(&error))
}

/// What went wrong, for a log line or a start-up error: the server's message and
/// SQLSTATE for an error the server sent (tokio-postgres prints only "db error" for
/// those), the error and its causes otherwise.
pub(crate) fn error_text(error: &tokio_postgres::Error) -> String {
    if let Some(db) = error.as_db_error() {
        return format!("{} (SQLSTATE {})", db.message(), db.code().code());
    }
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_sorted_by_what_they_mean_for_the_gateway() {
        for code in SERVER_UNAVAILABLE {
            assert!(server_unavailable(code), "{code:?}");
        }
        for code in ["08000", "08006", "08P01"] {
            assert!(server_unavailable(&SqlState::from_code(code)), "{code}");
        }
        for code in STATEMENT_ABORTED {
            assert!(
                !server_unavailable(code),
                "{code:?} is the statement's, not the server's"
            );
        }
        for code in [
            SqlState::UNIQUE_VIOLATION,
            SqlState::INSUFFICIENT_PRIVILEGE,
            SqlState::LOCK_NOT_AVAILABLE,
        ] {
            assert!(
                !server_unavailable(&code) && !STATEMENT_ABORTED.contains(&code),
                "{code:?}"
            );
        }
    }
}
