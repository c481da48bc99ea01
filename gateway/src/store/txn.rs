//! Transactions over several resources, and the idempotency record of keyed writes.
//!
//! # A transaction
//!
//! A [`Txn`] is a list of operations, each on a resource with the token of the writer's
//! term there. Every backend applies it all or nothing, in one database transaction:
//!
//! 1. the fence of every resource involved is locked and read, in byte order of the
//!    names (the order every transaction and every write group takes: no deadlock
//!    between them) — for update where the transaction writes or advances, for share
//!    where it only checks; a lock is held until the commit, so no newer term can begin
//!    on any of them in between (a checked resource is re-validated at commit by
//!    construction);
//! 2. every resource whose fence is above its token is stale: the transaction is
//!    refused, naming them all, and nothing is applied;
//! 3. every precondition is checked, in operation order: the first that fails refuses
//!    the transaction, and nothing is applied;
//! 4. only then are fences raised and objects written, and the transaction commits.
//!
//! [`Txn::new`] guarantees that each resource carries one token and each object is
//! written or checked at most once, so the order of the operations within a
//! transaction never changes its outcome.
//!
//! # The idempotency record
//!
//! A write sent with an `Idempotency-Key` ([`Keyed`]) is applied as a transaction that
//! also records its answer — status, headers and body, whatever the outcome, a refusal
//! included — under (identity, key), in the same database transaction as the write. A
//! retry finds the record and gets the same answer; the write is not applied again.
//! The record keeps a fingerprint of the request: the same key with another request is
//! refused. Records expire after their time to live and are removed in small batches
//! that never touch a fence.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName, Token};

/// One operation of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOp {
    Put {
        resource: ResourceName,
        key: ObjectKey,
        token: Token,
        value: Bytes,
        precondition: Precondition,
    },
    Delete {
        resource: ResourceName,
        key: ObjectKey,
        token: Token,
        precondition: Precondition,
    },
    Advance {
        resource: ResourceName,
        token: Token,
    },
    /// The fence must not be above `token`; with `object`, the object's version must
    /// satisfy the precondition. Nothing is written.
    Check {
        resource: ResourceName,
        token: Token,
        object: Option<(ObjectKey, Precondition)>,
    },
}

impl TxnOp {
    pub fn resource(&self) -> &ResourceName {
        match self {
            TxnOp::Put { resource, .. }
            | TxnOp::Delete { resource, .. }
            | TxnOp::Advance { resource, .. }
            | TxnOp::Check { resource, .. } => resource,
        }
    }

    pub fn token(&self) -> Token {
        match self {
            TxnOp::Put { token, .. }
            | TxnOp::Delete { token, .. }
            | TxnOp::Advance { token, .. }
            | TxnOp::Check { token, .. } => *token,
        }
    }

    /// The object the operation reads or writes, and what it requires of it.
    pub fn object(&self) -> Option<(&ObjectKey, Precondition)> {
        match self {
            TxnOp::Put {
                key, precondition, ..
            }
            | TxnOp::Delete {
                key, precondition, ..
            } => Some((key, *precondition)),
            TxnOp::Check { object, .. } => object.as_ref().map(|(key, p)| (key, *p)),
            TxnOp::Advance { .. } => None,
        }
    }

    /// Whether the operation raises its resource's fence.
    pub fn raises(&self) -> bool {
        !matches!(self, TxnOp::Check { .. })
    }
}

impl Txn {
    /// The transaction as a single write, if it is one put or delete.
    pub fn single_write(&self) -> Option<crate::store::Write> {
        let [op] = self.ops() else {
            return None;
        };
        let (resource, key, token, precondition, op) = match op {
            TxnOp::Put {
                resource,
                key,
                token,
                value,
                precondition,
            } => (
                resource,
                key,
                token,
                precondition,
                crate::store::WriteOp::Put(value.clone()),
            ),
            TxnOp::Delete {
                resource,
                key,
                token,
                precondition,
            } => (
                resource,
                key,
                token,
                precondition,
                crate::store::WriteOp::Delete,
            ),
            TxnOp::Advance { .. } | TxnOp::Check { .. } => return None,
        };
        Some(crate::store::Write {
            resource: resource.clone(),
            key: key.clone(),
            token: *token,
            precondition: *precondition,
            op,
        })
    }
}

/// How a transaction holds a resource's fence until its commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Locked for update and raised to the token: the transaction writes or advances.
    Raise,
    /// Locked for share and checked: the transaction only reads the resource.
    Check,
}

/// A resource a transaction involves, in lock order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Involved {
    pub resource: ResourceName,
    pub token: Token,
    pub hold: Hold,
}

/// A valid transaction: see the module doc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Txn {
    ops: Vec<TxnOp>,
    involved: Vec<Involved>,
}

/// Why a list of operations is not a transaction; `op` is the index at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("operation {op}: {reason}")]
pub struct InvalidTxn {
    pub op: usize,
    pub reason: String,
}

impl Txn {
    /// Checks the rules a transaction keeps: at least one operation, one token per
    /// resource, each object at most once.
    pub fn new(ops: Vec<TxnOp>) -> Result<Txn, InvalidTxn> {
        if ops.is_empty() {
            return Err(InvalidTxn {
                op: 0,
                reason: "a transaction needs at least one operation".into(),
            });
        }
        let mut resources: BTreeMap<&ResourceName, (Token, Hold)> = BTreeMap::new();
        let mut objects = std::collections::BTreeSet::new();
        for (at, op) in ops.iter().enumerate() {
            let hold = if op.raises() {
                Hold::Raise
            } else {
                Hold::Check
            };
            match resources.get_mut(op.resource()) {
                Some((token, _)) if *token != op.token() => {
                    return Err(InvalidTxn {
                        op: at,
                        reason: format!(
                            "resource {} is given token {} here and {} before: one transaction writes each resource under one term",
                            op.resource(),
                            op.token(),
                            token
                        ),
                    })
                }
                Some((_, held)) => {
                    if hold == Hold::Raise {
                        *held = Hold::Raise;
                    }
                }
                None => {
                    resources.insert(op.resource(), (op.token(), hold));
                }
            }
            if let Some((key, _)) = op.object() {
                if !objects.insert((op.resource(), key)) {
                    return Err(InvalidTxn {
                        op: at,
                        reason: format!(
                            "object {}/{} appears twice: a transaction writes or checks each object once",
                            op.resource(),
                            key
                        ),
                    });
                }
            }
        }
        let involved = resources
            .into_iter()
            .map(|(resource, (token, hold))| Involved {
                resource: resource.clone(),
                token,
                hold,
            })
            .collect();
        Ok(Txn { ops, involved })
    }

    pub fn ops(&self) -> &[TxnOp] {
        &self.ops
    }

    /// Every resource involved, once, in lock order (byte order of the names).
    pub fn involved(&self) -> &[Involved] {
        &self.involved
    }
}

/// What an applied operation left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpDone {
    /// The object's version after the transaction (`None` for an advance or a check of
    /// the fence alone).
    pub version: Option<u64>,
    /// The object did not exist before (a put only).
    pub created: bool,
}

/// A resource whose fence is above the token presented for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleMember {
    pub resource: ResourceName,
    pub presented: Token,
    pub highest: Token,
}

/// What happened to a transaction. Every variant describes committed state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOutcome {
    /// Applied and committed; one entry per operation, in order.
    Applied(Vec<OpDone>),
    /// Refused: these resources (in lock order) are stale. Nothing was applied.
    Stale(Vec<StaleMember>),
    /// Refused: operation `op`'s precondition did not hold; `current` is its object's
    /// version (`None`: it does not exist). Nothing was applied.
    PreconditionFailed { op: usize, current: Option<u64> },
}

/// An answer as stored with a keyed write, and sent again to its retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAnswer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl StoredAnswer {
    /// The headers as stored: one `name: value` line each.
    pub fn headers_text(&self) -> String {
        let mut text = String::new();
        for (name, value) in &self.headers {
            text.push_str(name);
            text.push_str(": ");
            text.push_str(value);
            text.push('\n');
        }
        text
    }

    /// The headers of [`StoredAnswer::headers_text`].
    pub fn parse_headers(text: &str) -> Vec<(String, String)> {
        text.lines()
            .filter_map(|line| line.split_once(": "))
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect()
    }
}

/// Bytes a record takes besides its identity, key, headers and body: the fingerprint,
/// status, times and the row's own overhead, as every store counts it.
pub const RECORD_OVERHEAD: u64 = 96;

/// The bytes a record of `answer` under `identity` and `key` counts for, against the
/// bounds of stored answers; the Postgres store computes the same in SQL
/// (`statements::RECORD_BYTES`).
pub fn record_bytes(identity: &str, key: &str, answer: &StoredAnswer) -> u64 {
    (identity.len() + key.len() + answer.headers_text().len() + answer.body.len()) as u64
        + RECORD_OVERHEAD
}

/// Answers stored under keys, as the bounds on them see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AnswerUsage {
    /// Identities at a bound of their own.
    pub full: Vec<String>,
    /// Records and their bytes, over every identity.
    pub records: u64,
    pub bytes: u64,
}

/// The bounds of one identity's stored answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdentityBounds {
    pub records: u64,
    pub bytes: u64,
}

/// Builds the answer a keyed write stores from its outcome `O`, inside the transaction
/// that applies it: a pure function of the outcome and the request.
pub type Render<O = TxnOutcome> = Arc<dyn Fn(&O) -> StoredAnswer + Send + Sync>;

/// The idempotency key of a write whose outcome is an `O`, and how its answer is stored.
pub struct Keyed<O = TxnOutcome> {
    /// The authenticated caller; empty without authentication. Keys of different
    /// identities never meet.
    pub identity: String,
    pub key: String,
    /// A digest of the request: its method, path, fencing and precondition headers and
    /// body.
    pub fingerprint: [u8; 32],
    /// How long the record answers retries.
    pub ttl: Duration,
    pub render: Render<O>,
}

impl<O> Keyed<O> {
    /// The time to live in milliseconds, as the stores keep it.
    pub fn ttl_ms(&self) -> u64 {
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)
    }
}

impl<O> Clone for Keyed<O> {
    fn clone(&self) -> Keyed<O> {
        Keyed {
            identity: self.identity.clone(),
            key: self.key.clone(),
            fingerprint: self.fingerprint,
            ttl: self.ttl,
            render: Arc::clone(&self.render),
        }
    }
}

impl<O> std::fmt::Debug for Keyed<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyed")
            .field("identity", &self.identity)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// What a keyed write (or any transaction) came to; `O` is its outcome when it ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answered<O = TxnOutcome> {
    /// Run now; with a key, its answer was stored with it.
    Ran {
        outcome: O,
        stored: Option<StoredAnswer>,
    },
    /// An earlier attempt with the same key and request was applied (or refused): its
    /// answer, and nothing done now.
    Replayed(StoredAnswer),
    /// The key was used for another request; nothing done.
    KeyReused,
    /// An attempt with the same key is still running; nothing done.
    InFlight,
}

impl<O> Answered<O> {
    /// What became of the key, as the `outcome` label of
    /// `fencegate_idempotency_requests_total`.
    pub fn key_outcome(&self) -> &'static str {
        match self {
            Answered::Ran { .. } => "stored",
            Answered::Replayed(_) => "replayed",
            Answered::KeyReused => "key_reused",
            Answered::InFlight => "in_flight",
        }
    }
}

/// The answer to a retry that found a record under its key: the record's answer if the
/// request is the same, else the refusal.
pub fn replay<O>(found_fingerprint: &[u8], keyed: &Keyed<O>, answer: StoredAnswer) -> Answered<O> {
    if found_fingerprint == keyed.fingerprint {
        Answered::Replayed(answer)
    } else {
        Answered::KeyReused
    }
}

/// A stored answer as a store read it back; `status` is `None` only for a record that
/// never got its answer, which the stores never commit.
pub fn found_answer(
    status: Option<u16>,
    headers: &str,
    body: Bytes,
) -> Result<StoredAnswer, crate::store::StoreError> {
    let status = status.ok_or_else(|| {
        crate::store::StoreError::Internal("an idempotency record without its answer".into())
    })?;
    Ok(StoredAnswer {
        status,
        headers: StoredAnswer::parse_headers(headers),
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(n: &str) -> ResourceName {
        ResourceName::new(n).unwrap()
    }

    fn token(n: u64) -> Token {
        Token::new(n).unwrap()
    }

    fn put(resource: &str, key: &str, t: u64) -> TxnOp {
        TxnOp::Put {
            resource: name(resource),
            key: ObjectKey::new(key).unwrap(),
            token: token(t),
            value: Bytes::from_static(b"v"),
            precondition: Precondition::None,
        }
    }

    #[test]
    fn resources_are_locked_in_byte_order_and_held_for_what_they_do() {
        let txn = Txn::new(vec![
            put("b", "k", 2),
            TxnOp::Check {
                resource: name("a"),
                token: token(1),
                object: None,
            },
            TxnOp::Check {
                resource: name("b"),
                token: token(2),
                object: None,
            },
            TxnOp::Advance {
                resource: name("C"),
                token: token(3),
            },
        ])
        .unwrap();
        let involved: Vec<(&str, u64, Hold)> = txn
            .involved()
            .iter()
            .map(|i| (i.resource.as_str(), i.token.get(), i.hold))
            .collect();
        assert_eq!(
            involved,
            [
                ("C", 3, Hold::Raise),
                ("a", 1, Hold::Check),
                ("b", 2, Hold::Raise)
            ]
        );
    }

    #[test]
    fn one_token_per_resource_and_one_operation_per_object() {
        assert_eq!(Txn::new(vec![]).unwrap_err().op, 0);
        let two_tokens = Txn::new(vec![put("a", "k", 2), put("a", "j", 3)]).unwrap_err();
        assert_eq!(two_tokens.op, 1);
        let twice =
            Txn::new(vec![put("a", "k", 2), put("b", "k", 2), put("a", "k", 2)]).unwrap_err();
        assert_eq!(twice.op, 2);
        let checked_and_written = Txn::new(vec![
            put("a", "k", 2),
            TxnOp::Check {
                resource: name("a"),
                token: token(2),
                object: Some((ObjectKey::new("k").unwrap(), Precondition::Version(1))),
            },
        ]);
        assert_eq!(checked_and_written.unwrap_err().op, 1);
    }

    #[test]
    fn stored_headers_read_back() {
        let answer = StoredAnswer {
            status: 201,
            headers: vec![
                ("content-type".into(), "application/json".into()),
                ("etag".into(), "\"3\"".into()),
            ],
            body: Bytes::new(),
        };
        assert_eq!(
            StoredAnswer::parse_headers(&answer.headers_text()),
            answer.headers
        );
    }
}
