//! The flags that bind resources to the issuers of their tokens.

use clap::Args;

use crate::auth::Pattern;

pub const DEFAULT_LEADER_LEASE_TABLE: &str = "leader_lease";
/// The election prefixes of the lease client's etcd and ZooKeeper stores.
pub const DEFAULT_ETCD_PREFIX: &str = "/fencegate/elections/";
pub const DEFAULT_ZOOKEEPER_PREFIX: &str = "/fencegate/elections";

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = super::heading::ISSUERS)]
pub struct IssuerArgs {
    /// Binds resources to the issuer of their tokens (repeatable).
    ///
    /// Binds resources to the issuer of their tokens, as ISSUER:PATTERN (repeatable):
    /// `gateway:orders` for the gateway's own leases (/v1/leases), `leader_lease:sweep-*`
    /// for the `leader_lease` table (see --leader-lease-url), `etcd:billing-*` for etcd
    /// elections (see --etcd-endpoints), `zookeeper:ledger` for ZooKeeper elections
    /// (see --zookeeper-connect). A token above what the
    /// issuer has issued is then refused (403 token_not_issued) without moving the
    /// fence; with --auth-file, so is the issuer's latest token presented by another
    /// identity than its holder (403 token_holder_mismatch). Checked when a token is
    /// above the latest one this gateway knows the issuer issued, so a term's steady
    /// writes cost nothing. Give every replica the same bindings.
    #[arg(long = "issued-by", env = "FENCEGATE_ISSUED_BY", value_delimiter = ',', value_parser = parse_binding, value_name = "ISSUER:PATTERN")]
    pub bindings: Vec<Binding>,

    /// Postgres database of the `leader_lease` table.
    ///
    /// Postgres database of the `leader_lease` table that `leader_lease:` bindings check
    /// (default: --database-url).
    #[arg(
        long,
        env = "FENCEGATE_LEADER_LEASE_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub leader_lease_url: Option<String>,

    /// The table of `leader_lease:` bindings.
    ///
    /// The table of `leader_lease:` bindings, optionally schema-qualified; its `name`
    /// column holds the resource, `epoch` the token and `holder` the holder. It must be
    /// guarded (`fencegate leader-lease guard`), so that electors cannot forge epochs.
    #[arg(long, env = "FENCEGATE_LEADER_LEASE_TABLE", default_value = DEFAULT_LEADER_LEASE_TABLE, value_parser = parse_table, value_name = "TABLE")]
    pub leader_lease_table: String,

    /// etcd endpoints of `etcd:` bindings.
    ///
    /// etcd endpoints of `etcd:` bindings (`host:port`, comma-separated). The election of
    /// resource R is every key under --etcd-prefix followed by `R/`; its first-created
    /// key leads, and that key's create revision is the current term's token.
    #[arg(
        long,
        env = "FENCEGATE_ETCD_ENDPOINTS",
        value_delimiter = ',',
        value_name = "HOST:PORT"
    )]
    pub etcd_endpoints: Vec<String>,

    /// Key prefix of the etcd elections.
    ///
    /// The key prefix of the etcd elections that `etcd:` bindings check.
    #[arg(long, env = "FENCEGATE_ETCD_PREFIX", default_value = DEFAULT_ETCD_PREFIX, value_name = "PREFIX")]
    pub etcd_prefix: String,

    /// ZooKeeper connect string of `zookeeper:` bindings.
    ///
    /// ZooKeeper connect string of `zookeeper:` bindings (`host:port,host:port`,
    /// optionally with a chroot). The election of resource R is the children of
    /// --zookeeper-prefix followed by `/R`; the child with the lowest sequence number
    /// leads, and its czxid is the current term's token.
    #[arg(long, env = "FENCEGATE_ZOOKEEPER_CONNECT", value_name = "HOSTS")]
    pub zookeeper_connect: Option<String>,

    /// Path of the ZooKeeper elections.
    ///
    /// The path under which the ZooKeeper elections of `zookeeper:` bindings live.
    #[arg(long, env = "FENCEGATE_ZOOKEEPER_PREFIX", default_value = DEFAULT_ZOOKEEPER_PREFIX, value_parser = parse_zookeeper_prefix, value_name = "PATH")]
    pub zookeeper_prefix: String,

    /// Longest wait for one answer of etcd or ZooKeeper.
    ///
    /// How long one question to etcd or ZooKeeper may take before the token it is about
    /// is refused (503 issuer_unavailable).
    #[arg(long, env = "FENCEGATE_ISSUER_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub issuer_timeout: std::time::Duration,

    /// Replace the bindings recorded in the database with --issued-by.
    ///
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
    /// An etcd election: the create revision of its first-created key.
    Etcd,
    /// A ZooKeeper election: the czxid of its lowest-sequence node.
    ZooKeeper,
}

impl IssuerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            IssuerKind::Gateway => "gateway",
            IssuerKind::LeaderLease => "leader_lease",
            IssuerKind::Etcd => "etcd",
            IssuerKind::ZooKeeper => "zookeeper",
        }
    }

    /// Whether the issuer's record lives in the gateway's own store.
    pub fn in_store(self) -> bool {
        self == IssuerKind::Gateway
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
        "etcd" => IssuerKind::Etcd,
        "zookeeper" => IssuerKind::ZooKeeper,
        other => {
            return Err(format!(
                "unknown issuer {other:?}: `gateway`, `leader_lease`, `etcd` or `zookeeper`"
            ))
        }
    };
    Ok(Binding {
        issuer,
        pattern: Pattern::parse(pattern)?,
    })
}

/// A ZooKeeper path: absolute, without a trailing `/`.
fn parse_zookeeper_prefix(text: &str) -> Result<String, String> {
    if text.starts_with('/') && !text.ends_with('/') && !text.contains("//") {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "{text:?}: an absolute ZooKeeper path without a trailing /, e.g. /fencegate/elections"
        ))
    }
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
        assert_eq!(
            parse_binding("etcd:billing-*").unwrap().issuer,
            IssuerKind::Etcd
        );
        assert_eq!(
            parse_binding("zookeeper:ledger").unwrap().issuer,
            IssuerKind::ZooKeeper
        );
        for bad in [
            "orders",
            "consul:orders",
            "kubernetes:orders",
            "gateway:",
            "gateway:a*b*",
            "gateway:a b",
        ] {
            assert!(parse_binding(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn zookeeper_prefixes() {
        assert!(parse_zookeeper_prefix("/fencegate/elections").is_ok());
        assert!(parse_zookeeper_prefix("/").is_err());
        for bad in ["", "elections", "/a/", "/a//b"] {
            assert!(parse_zookeeper_prefix(bad).is_err(), "{bad}");
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
