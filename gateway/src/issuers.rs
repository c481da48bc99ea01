//! Issued tokens only: resources bound to the issuer of their tokens.
//!
//! A resource bound by `--issued-by` accepts a token only if its issuer issued it —
//! the gateway's own leases ([`crate::store::leases`]) or the seed's `leader_lease`
//! table. Issuers only ever issue higher tokens, so "issued" is decided by comparing
//! with the latest token the issuer issued; what the gateway learned once stays true,
//! and is asked again only when a token is above it: a new term, or a forgery. A
//! term's steady writes are checked against memory.
//!
//! With authentication on, the issuer's latest token is also bound to its holder: the
//! identity that took the gateway lease (kept by the store after a release, so every
//! replica finds it), or the identity named like the `leader_lease` holder. Another
//! identity presenting it is refused. Tokens of earlier terms are left
//! to the fence, which rejects them once the newer term has written (gateway leases
//! raise the fence when they mint a token, so at once).

use std::sync::Arc;

use dashmap::DashMap;
use deadpool_postgres::Pool;
use fencegate_proto::{ResourceName, Token};

use crate::config::{Binding, IssuerArgs, IssuerKind};
use crate::store::postgres::{classify, new_pool};
use crate::store::{Store, StoreError};

/// The latest token an issuer issued for a resource, and to whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    pub token: Token,
    /// The identity the token is bound to; `None` if the issuer recorded none.
    pub holder: Option<Arc<str>>,
}

/// What the issuer check says of a presented token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Issued (or the resource is not bound).
    Issued,
    /// Above the issuer's latest, which is `None` if it issued none.
    NotIssued { issued: Option<Token> },
    /// The issuer's latest token, presented by another identity than its holder.
    HolderMismatch { holder: Arc<str> },
}

/// Above this many resources, what was learned is forgotten (and asked again).
const KNOWN_CAPACITY: usize = 100_000;

/// The bindings, and the latest tokens learned from their issuers.
pub struct Issuers {
    bindings: Vec<Binding>,
    leader_lease: Option<LeaderLease>,
    known: DashMap<Box<str>, Issued>,
}

impl Issuers {
    pub fn new(args: &IssuerArgs, database_url: Option<&str>) -> Result<Issuers, String> {
        let needs_table = args
            .bindings
            .iter()
            .any(|binding| binding.issuer == IssuerKind::LeaderLease);
        let leader_lease = match (
            needs_table,
            args.leader_lease_url.as_deref().or(database_url),
        ) {
            (true, Some(url)) => Some(LeaderLease::new(url, &args.leader_lease_table)?),
            (true, None) => return Err("leader_lease bindings need --leader-lease-url".into()),
            (false, _) => None,
        };
        Ok(Issuers {
            bindings: args.bindings.clone(),
            leader_lease,
            known: DashMap::new(),
        })
    }

    /// Issuers with no bindings: every token is accepted as far as issuers go.
    #[cfg(test)]
    pub fn none() -> Issuers {
        Issuers {
            bindings: Vec::new(),
            leader_lease: None,
            known: DashMap::new(),
        }
    }

    /// The `--issued-by` bindings, in order.
    pub fn bindings(&self) -> &[Binding] {
        &self.bindings
    }

    /// The issuer `resource` is bound to; the first binding that matches decides.
    pub fn issuer_of(&self, resource: &ResourceName) -> Option<IssuerKind> {
        self.bindings
            .iter()
            .find(|binding| binding.pattern.matches(resource.as_str()))
            .map(|binding| binding.issuer)
    }

    /// The latest token this gateway knows `resource`'s issuer issued.
    pub fn known(&self, resource: &ResourceName) -> Option<Issued> {
        self.known.get(resource.as_str()).map(|entry| entry.clone())
    }

    /// Forgets what was learned of `resource`: after a reset of its fence, which may
    /// follow the retirement of a forged issuer record.
    pub fn forget(&self, resource: &ResourceName) {
        self.known.remove(resource.as_str());
    }

    /// Checks, at start, that the `leader_lease` table of `leader_lease:` bindings
    /// exists and is guarded (`fencegate leader-lease guard`), so that its electors
    /// cannot forge the epochs this gateway takes as issued.
    pub async fn check_leader_lease_table(&self) -> Result<(), String> {
        let Some(table) = &self.leader_lease else {
            return Ok(());
        };
        let client = table
            .pool
            .get()
            .await
            .map_err(|error| format!("could not reach the leader_lease database: {error}"))?;
        let guarded = crate::store::PgStore::leader_lease_guarded(&client, &table.name)
            .await
            .map_err(|error| format!("could not look at table {}: {error}", table.name))?;
        match guarded {
            Some(true) => Ok(()),
            Some(false) => Err(format!(
                "table {} is not guarded: its electors could write any epoch, which this gateway \
                 would take as issued. Guard it as its owner: fencegate leader-lease guard \
                 --table {} --database-url <its database>",
                table.name, table.name
            )),
            None => Err(format!(
                "table {} does not exist in the leader_lease database (--leader-lease-url, \
                 --leader-lease-table)",
                table.name
            )),
        }
    }

    /// Records what the issuer said; never goes back to an older token.
    pub fn learn(&self, resource: &ResourceName, issued: Issued) {
        if self.known.len() >= KNOWN_CAPACITY {
            self.known.clear();
        }
        self.known
            .entry(resource.as_str().into())
            .and_modify(|known| {
                if issued.token >= known.token {
                    *known = issued.clone();
                }
            })
            .or_insert(issued);
    }

    /// Asks `issuer` for the latest token it issued for `resource`.
    pub async fn ask(
        &self,
        issuer: IssuerKind,
        store: &Store,
        resource: &ResourceName,
    ) -> Result<Option<Issued>, StoreError> {
        let issued = match issuer {
            IssuerKind::Gateway => {
                let lease = store.read_lease(resource).await?;
                lease.token.map(|token| Issued {
                    token,
                    holder: lease.identity.map(Arc::from),
                })
            }
            IssuerKind::LeaderLease => match &self.leader_lease {
                Some(table) => table.latest(resource).await?,
                None => {
                    return Err(StoreError::Internal(
                        "a leader_lease binding without its database".into(),
                    ))
                }
            },
        };
        if let Some(issued) = &issued {
            self.learn(resource, issued.clone());
        }
        Ok(issued)
    }
}

/// Judges `token`, presented by `identity`, against what the issuer issued.
pub fn judge(token: Token, identity: Option<&str>, issued: Option<&Issued>) -> Verdict {
    let Some(issued) = issued else {
        return Verdict::NotIssued { issued: None };
    };
    if token > issued.token {
        return Verdict::NotIssued {
            issued: Some(issued.token),
        };
    }
    match (identity, &issued.holder) {
        (Some(identity), Some(holder)) if token == issued.token && identity != &**holder => {
            Verdict::HolderMismatch {
                holder: Arc::clone(holder),
            }
        }
        _ => Verdict::Issued,
    }
}

/// The `leader_lease` table of the seed: `name`, `holder`, `epoch`.
struct LeaderLease {
    pool: Pool,
    query: String,
    /// The table, as --leader-lease-table names it.
    name: String,
}

impl LeaderLease {
    fn new(url: &str, table: &str) -> Result<LeaderLease, String> {
        let url = crate::pgtls::parse(url).map_err(|e| format!("--leader-lease-url: {e}"))?;
        let quoted: Vec<String> = table.split('.').map(|part| format!("\"{part}\"")).collect();
        Ok(LeaderLease {
            pool: new_pool(url.config, &url.tls, 4).into_inner(),
            name: table.to_owned(),
            query: format!(
                "SELECT epoch, holder FROM {} WHERE name = $1",
                quoted.join(".")
            ),
        })
    }

    async fn latest(&self, resource: &ResourceName) -> Result<Option<Issued>, StoreError> {
        let client = self.pool.get().await.map_err(|error| {
            tracing::warn!(%error, "no connection to the leader_lease database");
            StoreError::Unavailable {
                reason: crate::store::UnavailableReason::Connect,
                applied: Some(false),
            }
        })?;
        let statement = client
            .prepare_cached(&self.query)
            .await
            .map_err(|e| classify(e, false))?;
        let row = client
            .query_opt(&statement, &[&resource.as_str()])
            .await
            .map_err(|e| classify(e, false))?;
        Ok(row.and_then(|row| {
            let epoch: i64 = row.get(0);
            let holder: Option<String> = row.get(1);
            let token = Token::new(u64::try_from(epoch).ok()?).ok()?;
            Some(Issued {
                token,
                holder: holder.map(Arc::from),
            })
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(value: u64) -> Token {
        Token::new(value).unwrap()
    }

    #[test]
    fn judged_against_the_latest_issued() {
        let issued = Issued {
            token: tok(5),
            holder: Some(Arc::from("node-a")),
        };
        assert_eq!(
            judge(tok(5), None, None),
            Verdict::NotIssued { issued: None }
        );
        assert_eq!(
            judge(tok(6), Some("node-a"), Some(&issued)),
            Verdict::NotIssued {
                issued: Some(tok(5))
            }
        );
        assert_eq!(
            judge(tok(5), Some("node-a"), Some(&issued)),
            Verdict::Issued
        );
        assert_eq!(judge(tok(5), None, Some(&issued)), Verdict::Issued);
        assert_eq!(
            judge(tok(5), Some("mallory"), Some(&issued)),
            Verdict::HolderMismatch {
                holder: Arc::from("node-a")
            }
        );
        // An earlier term's token is the fence's to judge.
        assert_eq!(
            judge(tok(4), Some("mallory"), Some(&issued)),
            Verdict::Issued
        );
    }

    #[test]
    fn learning_never_goes_back() {
        let issuers = Issuers::none();
        let resource = ResourceName::new("r").unwrap();
        issuers.learn(
            &resource,
            Issued {
                token: tok(7),
                holder: None,
            },
        );
        issuers.learn(
            &resource,
            Issued {
                token: tok(3),
                holder: None,
            },
        );
        assert_eq!(issuers.known(&resource).unwrap().token, tok(7));
    }
}
