//! Cancel keys: the door's own key for each session, mapped to its upstream backend's
//! and to the host that backend runs on.
//!
//! A client cancels a query by opening a new connection and sending the key it got in
//! BackendKeyData. The door never hands out the upstream key — which would let a client
//! cancel any backend of the server that shares it — but a random key of its own, and
//! forwards a cancel with a matching key to that session's backend, on that session's
//! host (of the several `--database-url` may name). As Postgres does,
//! it sends no reply either way.

use std::sync::Arc;

use bytes::Bytes;
use dashmap::DashMap;

use super::wire::CancelKey;

/// The upstream key of each live session, by the door's process id.
#[derive(Default)]
pub(crate) struct CancelKeys {
    sessions: DashMap<i32, SessionKey>,
}

/// A live session's upstream key, behind the key the door issued it.
struct SessionKey {
    secret: Bytes,
    upstream: CancelKey,
    /// The index of the session's host among `--database-url`'s: where its cancel
    /// requests go.
    host: usize,
}

impl CancelKeys {
    /// Issues a new key for a session whose backend, on host `host`, has `upstream`, with a secret as
    /// long as the upstream's (so that the client reads it under the protocol version
    /// it negotiated). The key is forgotten when the returned guard is dropped.
    pub(crate) fn issue(
        self: &Arc<Self>,
        upstream: CancelKey,
        host: usize,
    ) -> (CancelKey, IssuedKey) {
        loop {
            // Positive, like a real process id: some clients print or compare it.
            let pid = rand::random::<i32>() & i32::MAX;
            let secret: Vec<u8> = (0..upstream.secret.len())
                .map(|_| rand::random::<u8>())
                .collect();
            let secret = Bytes::from(secret);
            if let dashmap::Entry::Vacant(slot) = self.sessions.entry(pid) {
                slot.insert(SessionKey {
                    secret: secret.clone(),
                    upstream,
                    host,
                });
                let issued = IssuedKey {
                    keys: Arc::clone(self),
                    pid,
                };
                return (CancelKey { pid, secret }, issued);
            }
        }
    }

    /// The upstream key, and its host, for a cancel request that presents `key`, if it
    /// is one the door issued to a live session.
    pub(crate) fn upstream(&self, key: &CancelKey) -> Option<(CancelKey, usize)> {
        let entry = self.sessions.get(&key.pid)?;
        constant_time_eq(&entry.secret, &key.secret).then(|| (entry.upstream.clone(), entry.host))
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.sessions.len()
    }
}

/// Holds a session's key in [`CancelKeys`]; dropping it forgets the key.
pub(crate) struct IssuedKey {
    keys: Arc<CancelKeys>,
    pid: i32,
}

impl Drop for IssuedKey {
    fn drop(&mut self) {
        self.keys.sessions.remove(&self.pid);
    }
}

/// Compares two secrets in time that depends only on their lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(pid: i32, secret: &[u8]) -> CancelKey {
        CancelKey {
            pid,
            secret: Bytes::copy_from_slice(secret),
        }
    }

    #[test]
    fn issued_keys_map_to_their_upstream_until_dropped() {
        let keys = Arc::new(CancelKeys::default());
        let upstream = key(77, &[9, 9, 9, 9]);
        let (issued, guard) = keys.issue(upstream.clone(), 2);
        assert_eq!(issued.secret.len(), 4);
        assert!(issued.pid >= 0);
        assert_eq!(keys.upstream(&issued), Some((upstream, 2)));
        let mut wrong = issued.clone();
        wrong.secret = Bytes::from(
            wrong
                .secret
                .iter()
                .map(|b| b.wrapping_add(1))
                .collect::<Vec<u8>>(),
        );
        assert_eq!(
            keys.upstream(&wrong),
            None,
            "a wrong secret cancels nothing"
        );
        drop(guard);
        assert_eq!(keys.upstream(&issued), None);
        assert_eq!(keys.len(), 0);
    }

    #[test]
    fn long_secrets_keep_their_length() {
        let keys = Arc::new(CancelKeys::default());
        let (issued, _guard) = keys.issue(key(1, &[7; 32]), 0);
        assert_eq!(issued.secret.len(), 32);
    }
}
