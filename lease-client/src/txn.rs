//! Transactions through the gateway (`POST /v1/txn`): operations on one or more
//! resources, each under the term that fences its resource, applied all or none.
//!
//! A [`Term`] knows its lease, not the resources its lease fences, so every operation
//! names its resource beside its term; it presents the term's epoch as its token.
//!
//! # Behavior
//!
//! - A transaction is one logical write: one `Idempotency-Key`, resent like a single
//!   write (see [`crate::client`]). It is not sent, nor resent, once the term of any of
//!   its operations has ended: [`WriteError::TermOver`] names the first such term.
//! - All operations on one resource must be under the same term; otherwise the gateway
//!   refuses the transaction (`400 invalid_transaction`) and nothing is applied.
//! - `409 stale_token` ends, with [`LossReason::StaleRejection`], the terms of the
//!   operations on every resource the answer names in `stale`, and returns
//!   [`WriteError::Stale`] for the first of them; the others show in their terms'
//!   [`Term::loss_reason`]. Terms of resources that were not stale stay live.
//! - `403 token_not_issued` / `token_holder_mismatch` end the terms of the operations
//!   on the resource the answer names ([`LossReason::TokenRefused`]).
//! - `412 version_mismatch` is [`WriteError::Refused`]; the body's `operation` is the
//!   index of the operation at fault, in the order they were added. Nothing of the
//!   transaction was applied, and no term ends.
//!
//! [`LossReason::StaleRejection`]: crate::LossReason::StaleRejection
//! [`LossReason::TokenRefused`]: crate::LossReason::TokenRefused

use base64::Engine as _;
use bytes::Bytes;
use fencegate_proto::body::{
    AnyVersion, IfMatch, TxnAccepted, TxnOperation, TxnRequest, TxnResult,
};
use fencegate_proto::headers::Precondition;
use fencegate_proto::path::Target;
use fencegate_proto::{ErrorCode, ObjectKey, ResourceName};

use crate::client::{
    decode, end_refused, end_stale, refuses_the_token, FencedClient, Keyed, WriteError,
};
use crate::term::Term;

/// The operations of one transaction, gathered before [`TxnBuilder::send`]; from
/// [`FencedClient::txn`].
///
/// ```no_run
/// # async fn example(
/// #     gateway: fencegate_lease::FencedClient,
/// #     jobs_term: fencegate_lease::Term,
/// #     queue_term: fencegate_lease::Term,
/// # ) -> Result<(), fencegate_lease::WriteError> {
/// use fencegate_proto::headers::Precondition;
/// use fencegate_proto::{ObjectKey, ResourceName};
///
/// let (jobs, queue) = (ResourceName::new("jobs").unwrap(), ResourceName::new("queue").unwrap());
/// let key = ObjectKey::new("job-7").unwrap();
/// // Moves job-7 from the queue to the jobs, both or neither.
/// let results = gateway
///     .txn()
///     .delete(&queue_term, &queue, &key, Precondition::MustExist)
///     .put(&jobs_term, &jobs, &key, "running", Precondition::MustNotExist)
///     .send()
///     .await?;
/// assert_eq!(results[1].version, Some(1));
/// # Ok(()) }
/// ```
pub struct TxnBuilder {
    client: FencedClient,
    operations: Vec<TxnOperation>,
    /// The term of each operation, by index.
    terms: Vec<Term>,
}

impl TxnBuilder {
    pub(crate) fn new(client: FencedClient) -> TxnBuilder {
        TxnBuilder {
            client,
            operations: Vec::new(),
            terms: Vec::new(),
        }
    }

    /// Writes `value` to `key` of `resource` under `term`, if `precondition` holds.
    pub fn put(
        self,
        term: &Term,
        resource: &ResourceName,
        key: &ObjectKey,
        value: impl Into<Bytes>,
        precondition: Precondition,
    ) -> TxnBuilder {
        let value = value.into();
        // Text travels as text; other bytes as base64.
        let (value, value_base64) = match std::str::from_utf8(&value) {
            Ok(text) => (Some(text.to_owned()), None),
            Err(_) => (
                None,
                Some(base64::engine::general_purpose::STANDARD.encode(&value)),
            ),
        };
        let put = TxnOperation::Put {
            resource: resource.clone(),
            key: key.clone(),
            token: term.epoch(),
            value,
            value_base64,
            if_match: if_match(precondition),
        };
        self.push(term, put)
    }

    /// Deletes `key` of `resource` under `term`, if `precondition` holds.
    pub fn delete(
        self,
        term: &Term,
        resource: &ResourceName,
        key: &ObjectKey,
        precondition: Precondition,
    ) -> TxnBuilder {
        let delete = TxnOperation::Delete {
            resource: resource.clone(),
            key: key.clone(),
            token: term.epoch(),
            if_match: if_match(precondition),
        };
        self.push(term, delete)
    }

    /// Raises the fence of `resource` to the epoch of `term`.
    pub fn advance(self, term: &Term, resource: &ResourceName) -> TxnBuilder {
        let advance = TxnOperation::Advance {
            resource: resource.clone(),
            token: term.epoch(),
        };
        self.push(term, advance)
    }

    /// Requires, without writing, that `term` is not stale on `resource`, until the
    /// commit: no newer term can begin on it in between.
    pub fn check(self, term: &Term, resource: &ResourceName) -> TxnBuilder {
        let check = TxnOperation::Check {
            resource: resource.clone(),
            token: term.epoch(),
            key: None,
            version: None,
        };
        self.push(term, check)
    }

    /// As [`TxnBuilder::check`], and that `key` of `resource` is at `version` (`0`: it
    /// does not exist).
    pub fn check_version(
        self,
        term: &Term,
        resource: &ResourceName,
        key: &ObjectKey,
        version: u64,
    ) -> TxnBuilder {
        let check = TxnOperation::Check {
            resource: resource.clone(),
            token: term.epoch(),
            key: Some(key.clone()),
            version: Some(version),
        };
        self.push(term, check)
    }

    fn push(mut self, term: &Term, operation: TxnOperation) -> TxnBuilder {
        self.operations.push(operation);
        self.terms.push(term.clone());
        self
    }

    /// Sends the transaction; on success, one result per operation, in order. See the
    /// module's "Behavior" for what ends which term.
    pub async fn send(self) -> Result<Vec<TxnResult>, WriteError> {
        let request = TxnRequest {
            operations: self.operations,
        };
        let write = Keyed::json(&self.client, &Target::Txn.path(), &request)?;
        let terms: Vec<&Term> = self.terms.iter().collect();
        match self.client.send_keyed(&terms, &write).await {
            Ok(body) => Ok(decode::<TxnAccepted>(&body)?.results),
            Err(error) => Err(ended_by(&request.operations, &self.terms, error)),
        }
    }
}

/// Ends the terms that `error` says are over, and turns a stale answer into
/// [`WriteError::Stale`] for its first stale resource.
fn ended_by(operations: &[TxnOperation], terms: &[Term], error: WriteError) -> WriteError {
    let WriteError::Refused { status, body } = error else {
        return error;
    };
    let terms_on = |resource: &ResourceName| {
        let resource = resource.clone();
        operations
            .iter()
            .zip(terms)
            .filter(move |(operation, _)| *operation.resource() == resource)
            .map(|(_, term)| term)
    };
    if body.error == ErrorCode::StaleToken {
        for member in &body.stale {
            for term in terms_on(&member.resource) {
                end_stale(
                    term,
                    &member.resource,
                    member.presented,
                    Some(member.highest),
                );
            }
        }
        return match body.stale.into_iter().next() {
            Some(first) => WriteError::Stale {
                resource: first.resource,
                presented: first.presented,
                highest: Some(first.highest),
            },
            None => WriteError::Protocol(
                "a stale transaction whose answer names no stale resource".into(),
            ),
        };
    }
    if refuses_the_token(body.error) {
        if let Some(resource) = &body.resource {
            for term in terms_on(resource) {
                end_refused(term, resource, body.error);
            }
        }
    }
    WriteError::Refused { status, body }
}

fn if_match(precondition: Precondition) -> Option<IfMatch> {
    match precondition {
        Precondition::None => None,
        Precondition::MustNotExist => Some(IfMatch::Version(0)),
        Precondition::MustExist => Some(IfMatch::Any(AnyVersion::Any)),
        Precondition::Version(version) => Some(IfMatch::Version(version)),
    }
}
