//! The in-database fence: the fence check as Postgres functions and triggers, for
//! writers that write their own tables — through `/v1/sql`, the Postgres door, or over
//! their own connections.
//!
//! The SQL installs, in schema `fencegate` (the migrations [`M2_SQL`], [`M3_SQL`],
//! [`M4_SQL`] create the tables once; [`FUNCTIONS_SQL`], the one home of every
//! function body, is applied again whenever it changes):
//!
//! - `fencegate.fence(resource, token)`: checks or raises the resource's row in
//!   `fencegate.fences` — the row the HTTP API uses, so both paths always agree — and
//!   keeps it locked to the end of the transaction: `FOR SHARE` when the token equals
//!   the highest (writers of one term run side by side), exclusively when it raises it
//!   (a new term waits for the old term's open transactions, and after
//!   `--term-takeover-timeout` ends them). Only for a role that holds the resource.
//! - `fencegate.enforce()`: the `BEFORE` trigger of protected tables (statement-level,
//!   and row-level where a write through an unfenced ancestor reaches the table). The
//!   table's resource comes from `fencegate.protected_tables`, which only `protect`
//!   writes; the token from a `fencegate.fence()` call or the `fencegate.token`
//!   setting; the authority from the writing role, or from the gateway's fence step of
//!   a `/v1/sql` transaction (`fencegate.sql_fence`, which only the gateway's key opens).
//! - `fencegate.protect(table, resource)`, `unprotect(table)`, `audit()`: what the
//!   `fencegate protect`, `unprotect` and `check` commands run ([`crate::admin`]), and
//!   `fencegate.guard_leader_lease()`, the trigger that keeps electors of a seed
//!   `leader_lease` table from forging epochs.
//!
//! # Authority
//!
//! A role presents or raises only the fences of resources granted to it, or to a role
//! it can act as, in `fencegate.authority` (`fencegate grant`); the schema's owner and
//! superusers hold every resource. Anything else fails closed with `ZF006`.
//!
//! # Refusals and their proof
//!
//! Refusals carry a SQLSTATE of class `ZF` ([`sqlstate`]) and a DETAIL of stable
//! `key=value` fields. The DETAIL of a stale or unissued token ends with `proof=<hex>`:
//! an HMAC-SHA256 of the fields before it under a key that only the gateway and the
//! schema's functions read. Anyone who can run SQL can `RAISE` a `ZF001`; only the
//! fence can prove one. [`Reported::read`] tells them apart, once, for every front door.

use fencegate_proto::{ResourceName, Token};

/// Migration 2: the in-database fence (privileges; its functions are in
/// [`FUNCTIONS_SQL`]).
pub const M2_SQL: &str = include_str!("m2_fenced_tables.sql");
/// Migration 3: hosted leases, fence resets, issuer bindings.
pub const M3_SQL: &str = include_str!("m3_leases.sql");
/// Migration 4: authority, the registry of protected tables, the raise log, keys.
pub const M4_SQL: &str = include_str!("m4_authority.sql");
/// Migration 5: the row the readiness probe writes.
pub const M5_SQL: &str = include_str!("m5_readiness.sql");
/// Every function, view and trigger of the schema, applied whenever it changes.
pub const FUNCTIONS_SQL: &str = include_str!("functions.sql");

/// The SQLSTATEs of the in-database fence: class `ZF`, which no driver or ORM retries
/// on its own (unlike `40001`), and which says more than the generic `P0001`.
pub mod sqlstate {
    /// The token is below the resource's highest.
    pub const STALE_TOKEN: &str = "ZF001";
    /// A protected table was written without a token for its resource.
    pub const MISSING_TOKEN: &str = "ZF002";
    /// The presented token is not a decimal integer in `1..=i64::MAX`.
    pub const INVALID_TOKEN: &str = "ZF003";
    /// The resource name is not one the API accepts.
    pub const INVALID_RESOURCE: &str = "ZF004";
    /// The resource is bound to the gateway's leases, which did not issue the token.
    pub const NOT_ISSUED: &str = "ZF005";
    /// The role does not hold the resource (`fencegate grant`), or a `/v1/sql`
    /// transaction reached beyond the resource of its fence step.
    pub const NOT_AUTHORIZED: &str = "ZF006";
    /// A fence trigger on a table that `fencegate protect` did not fence.
    pub const NOT_REGISTERED: &str = "ZF007";
    /// A change of a guarded `leader_lease` table that its guard refuses.
    pub const LEASE_RULE: &str = "ZF008";
}

/// The key of the fence's proofs (`fencegate.keys`, `proof`).
#[derive(Clone)]
pub struct ProofKey(ring::hmac::Key);

impl ProofKey {
    pub fn new(secret: &[u8]) -> ProofKey {
        ProofKey(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret))
    }

    /// Whether `proof` (hex) is the HMAC of `message`.
    fn verifies(&self, message: &str, proof: &str) -> bool {
        let Some(tag) = decode_hex(proof) else {
            return false;
        };
        ring::hmac::verify(&self.0, message.as_bytes(), &tag).is_ok()
    }

    /// The proof the fence would attach to `message`: for tests that check the
    /// verification against the SQL.
    pub fn sign(&self, message: &str) -> String {
        ring::hmac::sign(&self.0, message.as_bytes())
            .as_ref()
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect()
    }
}

impl std::fmt::Debug for ProofKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProofKey(..)")
    }
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(text.get(at..at + 2)?, 16).ok())
        .collect()
}

/// A stale-token rejection of the in-database fence: `ZF001`, DETAIL
/// `resource=<r> presented=<n> highest=<n>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleRejection {
    pub resource: ResourceName,
    pub presented: Token,
    pub highest: Token,
}

/// A token refused as never issued: `ZF005`, DETAIL `resource=<r> presented=<n>
/// issued=<n>` (`issued` 0: the lease issued none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotIssuedRejection {
    pub resource: ResourceName,
    pub presented: Token,
    pub issued: Option<Token>,
}

/// What the in-database fence refused a token with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceRejection {
    Stale(StaleRejection),
    NotIssued(NotIssuedRejection),
}

/// A `ZF001` or `ZF005` error, as a front door read it: the fence's own refusal, or an
/// error that anyone's SQL raised with the same SQLSTATE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reported {
    /// Its proof holds: the fence made this refusal.
    Proven(FenceRejection),
    /// No proof, a wrong one, or an unreadable DETAIL: not the fence's. Counted apart,
    /// and never taken for a rejection. `code` is the SQLSTATE it claimed.
    Unproven { code: &'static str },
}

impl Reported {
    /// Reads an error's SQLSTATE and DETAIL; `None` unless the SQLSTATE is `ZF001` or
    /// `ZF005`.
    pub fn read(code: &[u8], detail: Option<&str>, key: &ProofKey) -> Option<Reported> {
        let code = match code {
            c if c == sqlstate::STALE_TOKEN.as_bytes() => sqlstate::STALE_TOKEN,
            c if c == sqlstate::NOT_ISSUED.as_bytes() => sqlstate::NOT_ISSUED,
            _ => return None,
        };
        let unproven = Reported::Unproven { code };
        let Some((message, proof)) = detail.and_then(|detail| detail.rsplit_once(" proof=")) else {
            return Some(unproven);
        };
        if !key.verifies(message, proof) {
            return Some(unproven);
        }
        let refusal = match code {
            sqlstate::STALE_TOKEN => {
                fields(message, "highest").and_then(|(resource, presented, highest)| {
                    Some(FenceRejection::Stale(StaleRejection {
                        resource,
                        presented,
                        highest: Token::new(highest).ok()?,
                    }))
                })
            }
            _ => fields(message, "issued").map(|(resource, presented, issued)| {
                FenceRejection::NotIssued(NotIssuedRejection {
                    resource,
                    presented,
                    issued: Token::new(issued).ok(),
                })
            }),
        };
        Some(refusal.map_or(unproven, Reported::Proven))
    }

    /// [`Reported::read`] of a database error.
    pub fn from_db_error(
        error: &tokio_postgres::error::DbError,
        key: &ProofKey,
    ) -> Option<Reported> {
        Reported::read(error.code().code().as_bytes(), error.detail(), key)
    }
}

/// The fields `resource=<r> presented=<n> <last>=<n>` of a DETAIL, in that order and
/// nothing else: the fence writes exactly these.
fn fields(message: &str, last: &str) -> Option<(ResourceName, Token, u64)> {
    let mut parts = message.split(' ');
    let mut field = |name: &str| {
        let (key, value) = parts.next()?.split_once('=')?;
        (key == name).then_some(value)
    };
    let resource = ResourceName::new(field("resource")?).ok()?;
    let presented = field("presented")?.parse::<Token>().ok()?;
    let value = field(last)?.parse::<u64>().ok()?;
    parts
        .next()
        .is_none()
        .then_some((resource, presented, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> ProofKey {
        ProofKey::new(b"a key of the fence")
    }

    fn detail(message: &str) -> String {
        format!("{message} proof={}", key().sign(message))
    }

    #[test]
    fn proven_refusals_read_back() {
        let stale = detail("resource=orders.eu-1 presented=41 highest=42");
        assert_eq!(
            Reported::read(b"ZF001", Some(&stale), &key()),
            Some(Reported::Proven(FenceRejection::Stale(StaleRejection {
                resource: ResourceName::new("orders.eu-1").unwrap(),
                presented: Token::new(41).unwrap(),
                highest: Token::new(42).unwrap(),
            })))
        );
        let not_issued = detail("resource=orders presented=9 issued=0");
        assert_eq!(
            Reported::read(b"ZF005", Some(&not_issued), &key()),
            Some(Reported::Proven(FenceRejection::NotIssued(
                NotIssuedRejection {
                    resource: ResourceName::new("orders").unwrap(),
                    presented: Token::new(9).unwrap(),
                    issued: None,
                }
            )))
        );
        assert_eq!(Reported::read(b"ZF002", Some(&stale), &key()), None);
        assert_eq!(Reported::read(b"23505", None, &key()), None);
    }

    #[test]
    fn anything_the_fence_did_not_sign_is_unproven() {
        let unproven = Some(Reported::Unproven { code: "ZF001" });
        let genuine = "resource=orders presented=41 highest=42";
        let forged_fields = format!(
            "resource=victim presented=41 highest=42 proof={}",
            key().sign(genuine)
        );
        let other_key = format!("{genuine} proof={}", ProofKey::new(b"other").sign(genuine));
        for detail in [
            None,
            Some(genuine.to_owned()),
            Some(format!("{genuine} proof=")),
            Some(format!("{genuine} proof=zz")),
            Some(forged_fields),
            Some(other_key),
        ] {
            assert_eq!(
                Reported::read(b"ZF001", detail.as_deref(), &key()),
                unproven,
                "{detail:?}"
            );
        }
        // Signed, but not fields the fence writes.
        for message in [
            "resource=orders presented=41",
            "resource=orders presented=x highest=42",
            "resource=a%20b presented=1 highest=2",
            "resource=orders presented=0 highest=2",
            "resource=orders presented=1 highest=2 extra=3",
            "presented=1 resource=orders highest=2",
        ] {
            assert_eq!(
                Reported::read(b"ZF001", Some(&detail(message)), &key()),
                unproven,
                "{message}"
            );
        }
    }

    /// The key never shows in a log line or a panic message.
    #[test]
    fn a_proof_key_debugs_without_its_secret() {
        assert_eq!(format!("{:?}", key()), "ProofKey(..)");
    }

    /// The SQL raises the codes this module names, and nothing else in class ZF.
    #[test]
    fn the_sql_raises_the_named_codes() {
        let raised: std::collections::BTreeSet<&str> = [M2_SQL, M3_SQL, M4_SQL, FUNCTIONS_SQL]
            .into_iter()
            .flat_map(|sql| {
                sql.match_indices("ERRCODE = '")
                    .map(|(at, prefix)| &sql[at + prefix.len()..at + prefix.len() + 5])
            })
            .filter(|code| code.starts_with("ZF"))
            .collect();
        let named = [
            sqlstate::STALE_TOKEN,
            sqlstate::MISSING_TOKEN,
            sqlstate::INVALID_TOKEN,
            sqlstate::INVALID_RESOURCE,
            sqlstate::NOT_ISSUED,
            sqlstate::NOT_AUTHORIZED,
            sqlstate::NOT_REGISTERED,
            sqlstate::LEASE_RULE,
        ];
        assert_eq!(raised, named.into_iter().collect());
    }

    /// No function body is written twice: each is defined in functions.sql only.
    #[test]
    fn functions_have_one_home() {
        for migration in [M2_SQL, M3_SQL, M4_SQL, M5_SQL] {
            assert!(!migration.contains("CREATE FUNCTION"), "{migration}");
            assert!(!migration.contains("CREATE OR REPLACE FUNCTION"));
        }
        let mut defined = std::collections::BTreeSet::new();
        for (at, _) in FUNCTIONS_SQL.match_indices("CREATE OR REPLACE FUNCTION fencegate.") {
            let name = FUNCTIONS_SQL[at + "CREATE OR REPLACE FUNCTION fencegate.".len()..]
                .split('(')
                .next()
                .unwrap();
            assert!(defined.insert(name), "fencegate.{name} is defined twice");
        }
        assert!(defined.contains("fence") && defined.contains("enforce"));
    }
}
