//! The in-database fence: the fence check as Postgres functions and triggers, for
//! writers that write their own tables — through `/v1/sql`, or over their own
//! connections.
//!
//! The SQL ([`SCHEMA_SQL`], schema version 2) installs, in schema `fencegate`:
//!
//! - `fencegate.fence(resource, token)`: checks or raises the resource's row in
//!   `fencegate.fences` — the row the HTTP API uses, so both paths always agree — and
//!   keeps it locked to the end of the transaction: `FOR SHARE` when the token equals
//!   the highest (writers of one term run side by side), exclusively when it raises it
//!   (a new term waits for the old term's open transactions). `SECURITY DEFINER` with a
//!   fixed `search_path`: writers need EXECUTE on it and no privilege on the tables.
//! - `fencegate.enforce()`: the statement-level `BEFORE INSERT OR UPDATE OR DELETE OR
//!   TRUNCATE` trigger of protected tables. It takes the token the transaction
//!   presented for the table's resource — recorded by a `fencegate.fence()` call, or
//!   the `fencegate.token` setting — and checks it the same way; without one the
//!   statement fails (fail closed).
//! - `fencegate.protect(table, resource)`, `unprotect(table)`, `audit()`: what the
//!   `fencegate protect`, `unprotect` and `check` commands run ([`admin`]).
//!
//! Rejections carry a SQLSTATE of class `ZF` ([`sqlstate`]) and a DETAIL of stable
//! `key=value` fields, which [`StaleRejection::from_db_error`] reads back.

pub mod admin;

use fencegate_proto::{ResourceName, Token};

/// Migration 2 of the `fencegate` schema.
pub const SCHEMA_SQL: &str = include_str!("schema.sql");
/// Migration 3: hosted leases, fence resets, and issued tokens only
/// (`fencegate.require_issued()`, asked by `fence_check()` for every new term).
pub const ISSUED_SQL: &str = include_str!("issued.sql");

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
}

/// A stale-token rejection read from a Postgres error: `ZF001` with its DETAIL
/// `resource=<r> presented=<n> highest=<n>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleRejection {
    pub resource: ResourceName,
    pub presented: Token,
    pub highest: Token,
}

impl StaleRejection {
    /// The stale rejection `error` reports, if it is one and its DETAIL reads as one.
    pub fn from_db_error(error: &tokio_postgres::error::DbError) -> Option<StaleRejection> {
        if error.code().code() != sqlstate::STALE_TOKEN {
            return None;
        }
        StaleRejection::from_detail(error.detail()?)
    }

    /// The stale rejection a ZF001 DETAIL (`resource=<r> presented=<n> highest=<n>`) names.
    pub fn from_detail(detail: &str) -> Option<StaleRejection> {
        let mut resource = None;
        let mut presented = None;
        let mut highest = None;
        for field in detail.split(' ') {
            let (name, value) = field.split_once('=')?;
            match name {
                "resource" => resource = ResourceName::new(value).ok(),
                "presented" => presented = value.parse::<Token>().ok(),
                "highest" => highest = value.parse::<Token>().ok(),
                _ => {}
            }
        }
        Some(StaleRejection {
            resource: resource?,
            presented: presented?,
            highest: highest?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_details_read_back() {
        let rejection =
            StaleRejection::from_detail("resource=orders.eu-1 presented=41 highest=42").unwrap();
        assert_eq!(rejection.resource.as_str(), "orders.eu-1");
        assert_eq!(
            (rejection.presented.get(), rejection.highest.get()),
            (41, 42)
        );
        for detail in [
            "",
            "resource=orders presented=41",
            "resource=orders presented=x highest=42",
            "resource=a%20b presented=1 highest=2",
            "resource=orders presented=0 highest=2",
            "garbage",
        ] {
            assert_eq!(StaleRejection::from_detail(detail), None, "{detail}");
        }
    }

    /// The SQL raises the codes this module names, and nothing else in class ZF.
    #[test]
    fn the_sql_raises_the_named_codes() {
        let raised: std::collections::BTreeSet<&str> = [SCHEMA_SQL, ISSUED_SQL]
            .into_iter()
            .flat_map(|sql| {
                sql.match_indices("ERRCODE = '")
                    .map(|(at, prefix)| &sql[at + prefix.len()..at + prefix.len() + 5])
            })
            .collect();
        let named = [
            sqlstate::STALE_TOKEN,
            sqlstate::MISSING_TOKEN,
            sqlstate::INVALID_TOKEN,
            sqlstate::INVALID_RESOURCE,
            sqlstate::NOT_ISSUED,
        ];
        assert_eq!(raised, named.into_iter().collect());
    }
}
