//! What the two listeners — HTTP ([`crate::server`]) and the Postgres door
//! ([`crate::pgdoor`]) — do alike: take the next connection until the one shutdown of
//! the gateway begins, back off when accepting fails, and give the connections still
//! open a grace period to finish.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// How long a listener waits after a failed accept (typically EMFILE: no file
/// descriptor left) before it tries again, rather than spinning on the error.
const ACCEPT_BACK_OFF: Duration = Duration::from_millis(50);

/// The next connection on `listener` (`name` in the log), with Nagle off — both
/// listeners carry small request/answer exchanges; `None` once `shutdown` is cancelled.
pub(crate) async fn next(
    listener: &TcpListener,
    shutdown: &CancellationToken,
    name: &'static str,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        let failed = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    return Some((stream, peer));
                }
                Err(error) => error,
            },
            () = shutdown.cancelled() => return None,
        };
        tracing::warn!(listener = name, error = %failed, "accept failed");
        tokio::select! {
            () = tokio::time::sleep(ACCEPT_BACK_OFF) => {}
            () = shutdown.cancelled() => return None,
        }
    }
}

/// Waits for `finished` for at most `grace`; false (and a warning naming `what` is
/// left) if the grace period ran out first.
pub(crate) async fn drain(grace: Duration, finished: impl Future<Output = ()>, what: &str) -> bool {
    let drained = tokio::time::timeout(grace, finished).await.is_ok();
    if !drained {
        tracing::warn!(
            ?grace,
            "shutdown grace period elapsed with {what} still open; closing them"
        );
    }
    drained
}
