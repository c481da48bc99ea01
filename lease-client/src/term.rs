//! One term of leadership: its fencing token, and the signal that ends it.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, OnceLock};

use fencegate_proto::Token;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// Why a term ended. The strings are metric label values: a closed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LossReason {
    /// A renewal matched nothing: another holder took the lease (or it expired and
    /// was taken) while this one believed it led.
    Replaced,
    /// No renewal succeeded within `renew_deadline` on the holder's own clock.
    RenewDeadline,
    /// The store ended the term by itself before a renewal found out: an etcd lease
    /// expired or was revoked, a ZooKeeper session expired, the election key or node
    /// was deleted.
    SessionLost,
    /// The gateway rejected a write of this term as stale: a newer term has written.
    StaleRejection,
    /// The gateway refused a token of this term as not issued by the resource's issuer,
    /// or issued to another identity: the term cannot write.
    TokenRefused,
    /// The leading code finished; the lease was handed back.
    Released,
    /// The elector was asked to stop; the lease was handed back.
    Shutdown,
}

impl LossReason {
    pub const ALL: [LossReason; 7] = [
        LossReason::Replaced,
        LossReason::RenewDeadline,
        LossReason::SessionLost,
        LossReason::StaleRejection,
        LossReason::TokenRefused,
        LossReason::Released,
        LossReason::Shutdown,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            LossReason::Replaced => "replaced",
            LossReason::RenewDeadline => "renew_deadline",
            LossReason::SessionLost => "session_lost",
            LossReason::StaleRejection => "stale_rejection",
            LossReason::TokenRefused => "token_refused",
            LossReason::Released => "released",
            LossReason::Shutdown => "shutdown",
        }
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The leading code's view of its term. Cheap to clone; every clone sees the same end.
///
/// # Invariant
///
/// A term ends once: the first [`LossReason`] recorded is the one reported, and the
/// cancellation token is cancelled right after it is recorded and never reset. A new
/// acquisition is a new `Term` with a new, higher epoch.
#[derive(Clone)]
pub struct Term {
    inner: Arc<Inner>,
}

struct Inner {
    lease: String,
    holder: String,
    epoch: Token,
    cancel: CancellationToken,
    reason: OnceLock<LossReason>,
}

/// The term ended before the future passed to [`Term::run_until_lost`] finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("leadership lost ({reason}) at epoch {epoch}")]
pub struct Lost {
    pub epoch: Token,
    pub reason: LossReason,
}

impl Term {
    pub(crate) fn new(lease: &str, holder: &str, epoch: Token) -> Term {
        Term {
            inner: Arc::new(Inner {
                lease: lease.to_owned(),
                holder: holder.to_owned(),
                epoch,
                cancel: CancellationToken::new(),
                reason: OnceLock::new(),
            }),
        }
    }

    /// The fencing token of this term: send it with every write.
    pub fn epoch(&self) -> Token {
        self.inner.epoch
    }

    /// The identity this process holds the lease under.
    pub fn holder(&self) -> &str {
        &self.inner.holder
    }

    /// The lease's name.
    pub fn lease(&self) -> &str {
        &self.inner.lease
    }

    /// Whether the term still holds authority, as far as this process knows.
    pub fn is_live(&self) -> bool {
        !self.inner.cancel.is_cancelled()
    }

    /// Completes the moment authority is lost.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.inner.cancel.cancelled()
    }

    /// A token cancelled when authority is lost, for code that takes one.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.inner.cancel.clone()
    }

    /// Why the term ended, once it has.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.inner.reason.get().copied()
    }

    /// Runs `work` until it finishes or the term ends, whichever is first; the work is
    /// dropped at its next await point when the term ends. The easy way to honour the
    /// signal.
    pub async fn run_until_lost<F: Future>(&self, work: F) -> Result<F::Output, Lost> {
        tokio::select! {
            biased;
            () = self.cancelled() => Err(self.lost()),
            output = work => Ok(output),
        }
    }

    /// Ends the term with `reason` unless it has already ended; returns whether this
    /// call ended it.
    pub(crate) fn end(&self, reason: LossReason) -> bool {
        let first = self.inner.reason.set(reason).is_ok();
        self.inner.cancel.cancel();
        first
    }

    fn lost(&self) -> Lost {
        Lost {
            epoch: self.epoch(),
            reason: self.loss_reason().unwrap_or(LossReason::Shutdown),
        }
    }
}

impl fmt::Debug for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Term")
            .field("lease", &self.inner.lease)
            .field("holder", &self.inner.holder)
            .field("epoch", &self.inner.epoch)
            .field("live", &self.is_live())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_reason_wins_and_cancels() {
        let term = Term::new("l", "h", Token::new(3).unwrap());
        assert!(term.is_live());
        assert!(term.end(LossReason::StaleRejection));
        assert!(!term.end(LossReason::RenewDeadline));
        assert!(!term.is_live());
        assert_eq!(term.loss_reason(), Some(LossReason::StaleRejection));
    }

    #[tokio::test]
    async fn run_until_lost_stops_the_work() {
        let term = Term::new("l", "h", Token::new(3).unwrap());
        let ender = term.clone();
        tokio::spawn(async move { ender.end(LossReason::Replaced) });
        let result = term.run_until_lost(std::future::pending::<()>()).await;
        assert_eq!(
            result,
            Err(Lost {
                epoch: Token::new(3).unwrap(),
                reason: LossReason::Replaced
            })
        );
    }
}
