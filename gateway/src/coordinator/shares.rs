//! Each client's share of the process's bounds.
//!
//! `--max-writes-in-flight` and `--max-body-memory` bound the whole process. Without
//! shares, one client that opens many writes and sends their bodies slowly (or never)
//! holds all of both, and every other client's write is refused `503 overloaded`. So
//! each client may hold at most its share of each (`--max-client-share`); past it, that
//! client's writes are refused (`writes_share`, `body_share`) while the others' go on.
//!
//! A client is its authenticated identity when the gateway authenticates — one key
//! used from many addresses is one client — and its peer address otherwise.

use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::Arc;

use dashmap::DashMap;

use crate::error::Overload;

/// Who holds a share: an identity (by a keyed hash of its name), or an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientKey {
    Identity(u64),
    Peer(IpAddr),
}

/// What one client holds now.
#[derive(Debug, Default, Clone, Copy)]
struct ClientHolds {
    writes: usize,
    body_bytes: usize,
}

/// The shares of every client holding something; see the module doc.
pub struct Shares {
    max_writes: usize,
    max_body_bytes: usize,
    /// Keys the hash of identity names, so that names cannot be chosen to collide.
    hasher: std::collections::hash_map::RandomState,
    held: DashMap<ClientKey, ClientHolds>,
}

impl Shares {
    pub fn new(max_writes: usize, max_body_bytes: usize) -> Arc<Shares> {
        Arc::new(Shares {
            max_writes: max_writes.max(1),
            max_body_bytes: max_body_bytes.max(1),
            hasher: std::collections::hash_map::RandomState::new(),
            held: DashMap::new(),
        })
    }

    /// The client a request counts against.
    pub fn client(&self, identity: Option<&str>, peer: IpAddr) -> ClientKey {
        match identity {
            Some(name) => ClientKey::Identity(self.hasher.hash_one(name)),
            None => ClientKey::Peer(peer),
        }
    }

    /// One more write in flight for `client`, if its share has room.
    pub fn write(self: &Arc<Self>, client: ClientKey) -> Result<Share, Overload> {
        self.take(client, 1, 0).map_err(|()| Overload::WritesShare)
    }

    /// An empty claim on `client`'s share of body memory, grown as bytes arrive.
    pub fn body(self: &Arc<Self>, client: ClientKey) -> Share {
        Share {
            shares: Arc::clone(self),
            client,
            writes: 0,
            body_bytes: 0,
        }
    }

    fn take(self: &Arc<Self>, client: ClientKey, writes: usize, bytes: usize) -> Result<Share, ()> {
        self.add(client, writes, bytes)?;
        Ok(Share {
            shares: Arc::clone(self),
            client,
            writes,
            body_bytes: bytes,
        })
    }

    fn add(&self, client: ClientKey, writes: usize, bytes: usize) -> Result<(), ()> {
        let mut held = self.held.entry(client).or_default();
        let fits = held.writes + writes <= self.max_writes
            && held.body_bytes + bytes <= self.max_body_bytes;
        if !fits {
            let empty = held.writes == 0 && held.body_bytes == 0;
            drop(held);
            if empty {
                self.held
                    .remove_if(&client, |_, h| h.writes == 0 && h.body_bytes == 0);
            }
            return Err(());
        }
        held.writes += writes;
        held.body_bytes += bytes;
        Ok(())
    }

    fn release(&self, client: ClientKey, writes: usize, bytes: usize) {
        if writes == 0 && bytes == 0 {
            return;
        }
        if let Some(mut held) = self.held.get_mut(&client) {
            held.writes -= writes;
            held.body_bytes -= bytes;
        }
        self.held
            .remove_if(&client, |_, h| h.writes == 0 && h.body_bytes == 0);
    }

    /// How many clients hold something now.
    #[cfg(test)]
    fn clients(&self) -> usize {
        self.held.len()
    }
}

/// A client's claim on its share, given back when dropped.
pub struct Share {
    shares: Arc<Shares>,
    client: ClientKey,
    writes: usize,
    body_bytes: usize,
}

impl Share {
    /// Claims `bytes` more of the client's body memory.
    pub fn grow_body(&mut self, bytes: usize) -> Result<(), Overload> {
        self.shares
            .add(self.client, 0, bytes)
            .map_err(|()| Overload::BodyShare)?;
        self.body_bytes += bytes;
        Ok(())
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.shares
            .release(self.client, self.writes, self.body_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(last: u8) -> ClientKey {
        ClientKey::Peer(IpAddr::from([127, 0, 0, last]))
    }

    #[test]
    fn a_client_past_its_share_is_refused_while_others_go_on() {
        let shares = Shares::new(2, 100);
        let first = shares.write(peer(1)).unwrap();
        let _second = shares.write(peer(1)).unwrap();
        assert_eq!(shares.write(peer(1)).err(), Some(Overload::WritesShare));
        let _other = shares.write(peer(2)).unwrap();
        drop(first);
        let _again = shares.write(peer(1)).unwrap();
    }

    #[test]
    fn body_bytes_are_claimed_as_they_grow_and_given_back() {
        let shares = Shares::new(10, 100);
        let mut body = shares.body(peer(1));
        body.grow_body(60).unwrap();
        assert_eq!(body.grow_body(41), Err(Overload::BodyShare));
        body.grow_body(40).unwrap();
        let mut other = shares.body(peer(2));
        other.grow_body(100).unwrap();
        drop(body);
        shares.body(peer(1)).grow_body(100).unwrap();
    }

    #[test]
    fn clients_that_hold_nothing_are_forgotten() {
        let shares = Shares::new(1, 10);
        let write = shares.write(peer(1)).unwrap();
        assert!(shares.write(peer(1)).is_err());
        let mut body = shares.body(peer(3));
        assert!(body.grow_body(11).is_err());
        assert_eq!(shares.clients(), 1);
        drop(write);
        drop(body);
        assert_eq!(shares.clients(), 0);
    }

    #[test]
    fn an_identity_is_one_client_from_every_address() {
        let shares = Shares::new(1, 10);
        let a = shares.client(Some("writer"), IpAddr::from([127, 0, 0, 1]));
        let b = shares.client(Some("writer"), IpAddr::from([10, 0, 0, 9]));
        assert_eq!(a, b);
        assert_ne!(
            a,
            shares.client(Some("other"), IpAddr::from([127, 0, 0, 1]))
        );
        assert_ne!(
            shares.client(None, IpAddr::from([127, 0, 0, 1])),
            shares.client(None, IpAddr::from([127, 0, 0, 2]))
        );
    }
}
