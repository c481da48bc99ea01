//! JSON bodies.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::error::ErrorCode;
use crate::names::{ObjectKey, ResourceName};
use crate::token::Token;

/// The answer to an accepted `PUT` or `DELETE` on `/v1/kv`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteAccepted {
    pub resource: ResourceName,
    pub key: ObjectKey,
    pub token: Token,
    /// The object's version after this write. Starts at 1 and rises by one per
    /// accepted write of the key; a delete is a write (it leaves a tombstone), so
    /// versions never repeat for a key and `If-Match` cannot be fooled by a
    /// delete-and-recreate. A delete of an object that does not exist changes no
    /// version and answers the current one (0 if the key was never written).
    pub version: u64,
}

/// The answer of `GET /v1/fences/{resource}` and of an accepted advance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceState {
    pub resource: ResourceName,
    /// `None` (JSON `null`) if the resource has never accepted a write.
    pub highest: Option<Token>,
}

/// Every error answer: a stable code, a sentence for humans, and the facts of the
/// rejection where there are some.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<ResourceName>,
    /// The token the rejected request presented (`stale_token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presented: Option<Token>,
    /// The highest accepted token of the resource (`stale_token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highest: Option<Token>,
    /// The object's current version, `null` if it does not exist (`version_mismatch`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub current: Option<Option<u64>>,
    /// Whether the write was applied (`backend_unavailable`): `false` when it
    /// certainly was not, `null` when the database went away after receiving it.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub write_applied: Option<Option<bool>>,
    /// The index of the SQL statement at fault, from 0 (`sql_error`, `invalid_param`,
    /// `statement_not_allowed`, `unsupported_type`); absent when a transaction failed
    /// at commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub statement: Option<usize>,
    /// The parameter at fault, `1` for `$1` (`invalid_param`, `unsupported_type`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameter: Option<usize>,
    /// The Postgres SQLSTATE of a failed statement (`sql_error`), e.g. `23505`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sqlstate: Option<String>,
    /// The holder of the lease (`lease_held`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// How long the lease has left, in milliseconds (`lease_held`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<u64>,
    /// The highest token the resource's issuer has issued (`token_not_issued`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issued: Option<Token>,
    /// Why the gateway is not ready (`backend_unavailable` from `/readyz`) although
    /// the store answers: `disk_full`, `read_only` or `write_failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Every stale resource of a refused `/v1/txn`, in the transaction's order; the
    /// first is also in `resource`, `presented` and `highest` (`stale_token`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stale: Vec<StaleResource>,
    /// The index of the `/v1/txn` operation at fault, from 0 (`version_mismatch`,
    /// `invalid_transaction`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<usize>,
}

/// A resource whose fence is above the token an operation presented.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StaleResource {
    pub resource: ResourceName,
    pub presented: Token,
    pub highest: Token,
}

impl ErrorBody {
    pub fn new(error: ErrorCode, message: impl Into<String>) -> ErrorBody {
        ErrorBody {
            error,
            message: message.into(),
            resource: None,
            presented: None,
            highest: None,
            current: None,
            write_applied: None,
            statement: None,
            parameter: None,
            sqlstate: None,
            holder: None,
            expires_in_ms: None,
            issued: None,
            reason: None,
            stale: Vec::new(),
            operation: None,
        }
    }
}

/// The body of `POST /v1/leases/{resource}/{acquire|renew|release}`. Acquire takes
/// `holder` and `ttl_ms`; renew `holder`, `token` and `ttl_ms`; release `holder` and
/// `token`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// Who holds the lease: a name unique among the running candidates.
    pub holder: String,
    /// The token of the term being renewed or released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<Token>,
    /// How long the lease lasts from now, on the gateway's clock.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "integral::option"
    )]
    pub ttl_ms: Option<u64>,
}

/// A hosted lease as the gateway sees it: the answer of `GET /v1/leases/{resource}`
/// and of an acquire, renew or release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseState {
    pub resource: ResourceName,
    /// Whether a holder holds the lease now (it has a holder and has not expired).
    pub held: bool,
    /// The latest holder; `null` if the lease was released or never taken.
    pub holder: Option<String>,
    /// The authenticated identity that took the lease's latest term, kept after a
    /// release (its token stays bound to it); `null` without authentication.
    pub identity: Option<String>,
    /// The latest token minted for the lease (the fence was raised to it at the same
    /// time); `null` if the lease was never taken.
    pub token: Option<Token>,
    /// How long the lease has left, in milliseconds; `0` once expired or released.
    pub expires_in_ms: u64,
}

/// The body of `POST /v1/fences/{resource}/reset`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FenceResetRequest {
    /// The highest token the resource keeps: at least every token its issuer issued
    /// (or, for a resource without an issuer, every token its objects were written with).
    pub to: Token,
    /// Why: kept in the audit record and the log.
    pub reason: String,
}

/// The answer of an applied fence reset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceResetDone {
    pub resource: ResourceName,
    /// The highest token before the reset.
    pub from: Token,
    pub to: Token,
    /// The number of the reset in the audit log; replicas forget what they cached of
    /// the resource once they see it.
    pub generation: u64,
}

/// The body of `POST /v1/sql/{resource}`: statements run in order, in one
/// transaction, after the resource's fence check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqlRequest {
    pub statements: Vec<SqlStatement>,
}

/// One statement: a single SQL command with `$1..$n` placeholders, and their values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqlStatement {
    pub sql: String,
    /// Bound to `$1..$n` by the types the database reports for them; `null` is SQL NULL.
    #[serde(default)]
    pub params: Vec<Value>,
}

/// The answer to a committed SQL transaction: one result per statement, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SqlAccepted {
    pub resource: ResourceName,
    pub token: Token,
    pub results: Vec<SqlResult>,
}

/// What one statement did and returned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SqlResult {
    /// Rows inserted, updated, deleted or selected, as Postgres reports them; counts
    /// every row, also those left out of `rows` by truncation.
    pub rows_affected: u64,
    /// The statement's result columns (empty for a write without `RETURNING`).
    pub columns: Vec<SqlColumn>,
    pub rows: Vec<Vec<Value>>,
    /// True if rows were left out because the answer reached `--sql-max-rows` or
    /// `--sql-max-response`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// Which bound left rows out, when `truncated`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated_by: Option<SqlBound>,
}

/// The bound of a `/v1/sql` answer that left rows out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SqlBound {
    /// `--sql-max-rows`.
    Rows,
    /// `--sql-max-response`: the answer's rows reached that many bytes of JSON.
    Bytes,
}

/// A result column: its name and its Postgres type name (`int8`, `text`, `uuid[]`...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SqlColumn {
    pub name: String,
    #[serde(rename = "type")]
    pub type_name: String,
}

/// The body of `POST /v1/txn`: operations on one or more resources, applied all or
/// none in one transaction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TxnRequest {
    pub operations: Vec<TxnOperation>,
}

/// One operation of a transaction. Every operation names its resource and the token of
/// the writer's term on it; all operations on one resource present the same token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum TxnOperation {
    /// Writes an object: `value` (UTF-8 text) or `value_base64` (any bytes), exactly one.
    Put {
        resource: ResourceName,
        key: ObjectKey,
        token: Token,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        value: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        value_base64: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        if_match: Option<IfMatch>,
    },
    /// Deletes an object (a tombstone, as `DELETE /v1/kv` leaves).
    Delete {
        resource: ResourceName,
        key: ObjectKey,
        token: Token,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        if_match: Option<IfMatch>,
    },
    /// Raises the resource's fence to the token, as `POST /v1/fences/{r}/advance`.
    Advance {
        resource: ResourceName,
        token: Token,
    },
    /// Requires, without writing, that the resource's fence is not above the token and,
    /// with `key`, that the object is at `version` (`0`: it does not exist). Held until
    /// the commit: no newer term can begin on the resource in between.
    Check {
        resource: ResourceName,
        token: Token,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<ObjectKey>,
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            deserialize_with = "integral::option"
        )]
        version: Option<u64>,
    },
}

impl TxnOperation {
    pub fn resource(&self) -> &ResourceName {
        match self {
            TxnOperation::Put { resource, .. }
            | TxnOperation::Delete { resource, .. }
            | TxnOperation::Advance { resource, .. }
            | TxnOperation::Check { resource, .. } => resource,
        }
    }

    pub fn token(&self) -> Token {
        match self {
            TxnOperation::Put { token, .. }
            | TxnOperation::Delete { token, .. }
            | TxnOperation::Advance { token, .. }
            | TxnOperation::Check { token, .. } => *token,
        }
    }
}

/// A transaction operation's precondition on its object: a version (`0`: the object
/// must not exist), or `"*"` (it must exist, at any version).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum IfMatch {
    Version(#[serde(deserialize_with = "integral::exact")] u64),
    Any(AnyVersion),
}

/// Integers in JSON bodies. JSON Schema counts `42.0` as the integer 42, so an integral
/// number written with a fraction is read as that integer — up to 2^53, above which
/// such a number may already stand for another integer (as [`Token`] reads tokens).
pub mod integral {
    use std::fmt;

    use serde::Deserializer;

    /// The largest integer every double below which is exact.
    const EXACT_IN_A_DOUBLE: f64 = 9_007_199_254_740_992.0;

    struct Visitor;

    impl serde::de::Visitor<'_> for Visitor {
        type Value = u64;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a non-negative integer")
        }

        fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<u64, E> {
            Ok(value)
        }

        fn visit_i64<E: serde::de::Error>(self, value: i64) -> Result<u64, E> {
            u64::try_from(value).map_err(|_| E::custom("a non-negative integer is expected"))
        }

        fn visit_f64<E: serde::de::Error>(self, value: f64) -> Result<u64, E> {
            if value.fract() != 0.0 || !(0.0..=EXACT_IN_A_DOUBLE).contains(&value) {
                return Err(E::custom(
                    "a non-negative integer is expected (written without a fraction above 2^53)",
                ));
            }
            Ok(value as u64)
        }
    }

    pub fn exact<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        // `any`: inside a tagged enum the number arrives buffered, and only `any` passes
        // a buffered float on to `visit_f64`.
        deserializer.deserialize_any(Visitor)
    }

    pub fn option<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
        exact(deserializer).map(Some)
    }
}

/// The `"*"` of [`IfMatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AnyVersion {
    #[serde(rename = "*")]
    Any,
}

/// What a transaction operation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TxnOpKind {
    Put,
    Delete,
    Advance,
    Check,
}

/// The answer to a committed transaction: one result per operation, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxnAccepted {
    pub results: Vec<TxnResult>,
}

/// One operation's result: the resource's token, and for an object its version after
/// the transaction (for `check`: the version it was found at).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxnResult {
    pub op: TxnOpKind,
    pub resource: ResourceName,
    pub token: Token,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<ObjectKey>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    /// The object did not exist before (a put only).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub created: bool,
}

/// Distinguishes a field that is present but `null` from one that is absent.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_and_absent_fields_differ() {
        let mut body = ErrorBody::new(ErrorCode::VersionMismatch, "x");
        body.current = Some(None);
        let json = serde_json::to_value(&body).unwrap();
        assert_eq!(json["current"], serde_json::Value::Null);
        assert!(json.as_object().unwrap().contains_key("current"));
        assert!(!json.as_object().unwrap().contains_key("presented"));
        assert_eq!(serde_json::from_value::<ErrorBody>(json).unwrap(), body);
    }

    #[test]
    fn transaction_operations_read_as_documented() {
        let request: TxnRequest = serde_json::from_str(
            r#"{"operations": [
                {"op": "put", "resource": "a", "key": "k", "token": 3, "value": "v", "if_match": 2},
                {"op": "put", "resource": "a", "key": "n", "token": 3, "value_base64": "AAE=", "if_match": "*"},
                {"op": "delete", "resource": "b", "key": "k", "token": 4},
                {"op": "advance", "resource": "c", "token": 5},
                {"op": "check", "resource": "d", "token": 6, "key": "k", "version": 0}
            ]}"#,
        )
        .unwrap();
        assert_eq!(request.operations.len(), 5);
        assert!(matches!(
            request.operations[0],
            TxnOperation::Put {
                if_match: Some(IfMatch::Version(2)),
                ..
            }
        ));
        assert!(matches!(
            request.operations[1],
            TxnOperation::Put {
                if_match: Some(IfMatch::Any(AnyVersion::Any)),
                ..
            }
        ));
        assert_eq!(request.operations[4].token().get(), 6);
        let integral: TxnRequest = serde_json::from_str(
            r#"{"operations": [{"op": "check", "resource": "d", "token": 6.0, "key": "k", "version": 2.0},
                              {"op": "put", "resource": "e", "key": "k", "token": 1, "value": "v", "if_match": 3.0}]}"#,
        )
        .unwrap();
        assert!(matches!(
            integral.operations[0],
            TxnOperation::Check {
                version: Some(2),
                ..
            }
        ));
        assert!(matches!(
            integral.operations[1],
            TxnOperation::Put {
                if_match: Some(IfMatch::Version(3)),
                ..
            }
        ));
        let lease: LeaseRequest =
            serde_json::from_str(r#"{"holder": "a", "ttl_ms": 6671.0}"#).unwrap();
        assert_eq!(lease.ttl_ms, Some(6671));
        for bad in [
            r#"{"operations": [{"op": "move", "resource": "a", "token": 1}]}"#,
            r#"{"operations": [{"op": "advance", "resource": "a", "token": 1, "key": "k"}]}"#,
            r#"{"operations": [{"op": "advance", "resource": "a", "token": 0}]}"#,
            r#"{"operations": [{"op": "put", "resource": "a", "key": "k", "token": 1, "if_match": "x"}]}"#,
            r#"{"operations": [{"op": "put", "resource": "a", "key": "k", "token": 1, "if_match": 1.5}]}"#,
            r#"{"operations": [{"op": "check", "resource": "a", "token": 1, "key": "k", "version": -1}]}"#,
            r#"{"operations": [], "extra": 1}"#,
        ] {
            assert!(serde_json::from_str::<TxnRequest>(bad).is_err(), "{bad}");
        }
    }
}
