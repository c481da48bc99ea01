//! The flags that bind resources to the issuers of their tokens.

use clap::Args;

use crate::auth::Pattern;

pub const DEFAULT_LEADER_LEASE_TABLE: &str = "leader_lease";

#[derive(Debug, Clone, Args)]
pub struct IssuerArgs {
    /// Binds resources to the issuer of their tokens, as ISSUER:PATTERN (repeatable):
    /// `gateway:orders` for the gateway's own leases (/v1/leases), `leader_lease:sweep-*`
    /// for the `leader_lease` table (see --leader-lease-url). A token above what the
    /// issuer has issued is then refused (403 token_not_issued) without moving the
    /// fence; with --auth-file, so is the issuer's latest token presented by another
    /// identity than its holder (403 token_holder_mismatch). Checked when a token is
    /// above the latest one this gateway knows the issuer issued, so a term's steady
    /// writes cost nothing. Give every replica the same bindings.
    #[arg(long = "issued-by", env = "FENCEGATE_ISSUED_BY", value_delimiter = ',', value_parser = parse_binding)]
    pub bindings: Vec<Binding>,

    /// Postgres database of the `leader_lease` table that `leader_lease:` bindings check
    /// (default: --database-url).
    #[arg(long, env = "FENCEGATE_LEADER_LEASE_URL", hide_env_values = true)]
    pub leader_lease_url: Option<String>,

    /// The table of `leader_lease:` bindings, optionally schema-qualified; its `name`
    /// column holds the resource, `epoch` the token and `holder` the holder. It must be
    /// guarded (`fencegate leader-lease guard`), so that electors cannot forge epochs.
    #[arg(long, env = "FENCEGATE_LEADER_LEASE_TABLE", default_value = DEFAULT_LEADER_LEASE_TABLE, value_parser = parse_table)]
    pub leader_lease_table: String,

    /// Replace the issuer bindings recorded in the database (which every replica and
    /// the in-database fence follow) with this gateway's --issued-by flags. Without it,
    /// a gateway whose flags differ from the recorded ones refuses to start, so that one
    /// replica started with other flags cannot weaken the others' bindings.
    #[arg(long, env = "FENCEGATE_REPLACE_ISSUER_BINDINGS")]
    pub replace_issuer_bindings: bool,
}

/// Who issues a bound resource's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IssuerKind {
    /// The gateway's own leases (`/v1/leases/{resource}`).
    Gateway,
    /// The seed's `leader_lease` table: `epoch` of the row named like the resource.
    LeaderLease,
}

impl IssuerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            IssuerKind::Gateway => "gateway",
            IssuerKind::LeaderLease => "leader_lease",
        }
    }
}

/// One `--issued-by` binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub issuer: IssuerKind,
    pub pattern: Pattern,
}

fn parse_binding(text: &str) -> Result<Binding, String> {
    let (issuer, pattern) = text
        .split_once(':')
        .ok_or_else(|| format!("{text:?}: expected ISSUER:PATTERN, e.g. gateway:orders"))?;
    let issuer = match issuer {
        "gateway" => IssuerKind::Gateway,
        "leader_lease" => IssuerKind::LeaderLease,
        other => {
            return Err(format!(
                "unknown issuer {other:?}: `gateway` or `leader_lease`"
            ))
        }
    };
    Ok(Binding {
        issuer,
        pattern: Pattern::parse(pattern)?,
    })
}

/// A table name: one or two identifiers of letters, digits and `_`, separated by `.`.
pub(crate) fn parse_table(text: &str) -> Result<String, String> {
    let valid = |part: &str| {
        part.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && part.len() <= 63
            && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let parts: Vec<&str> = text.split('.').collect();
    if parts.len() <= 2 && parts.iter().all(|part| valid(part)) {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "{text:?}: a table name, optionally schema-qualified, of letters, digits and `_`"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings() {
        let binding = parse_binding("gateway:orders").unwrap();
        assert_eq!(binding.issuer, IssuerKind::Gateway);
        assert!(binding.pattern.matches("orders"));
        assert!(!binding.pattern.matches("orders2"));
        let binding = parse_binding("leader_lease:sweep-*").unwrap();
        assert_eq!(binding.issuer, IssuerKind::LeaderLease);
        assert!(binding.pattern.matches("sweep-eu"));
        for bad in [
            "orders",
            "etcd:orders",
            "gateway:",
            "gateway:a*b*",
            "gateway:a b",
        ] {
            assert!(parse_binding(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tables() {
        assert!(parse_table("leader_lease").is_ok());
        assert!(parse_table("ops.leader_lease").is_ok());
        for bad in ["", "a.b.c", "1x", "x;drop", "x\"y", "a."] {
            assert!(parse_table(bad).is_err(), "{bad}");
        }
    }
}
