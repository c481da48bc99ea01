//! Issued tokens only: resources bound to the issuer of their tokens.
//!
//! A resource bound by `--issued-by` accepts a token only if its issuer issued it —
//! the gateway's own leases ([`crate::store::leases`]), the seed's `leader_lease`
//! table, an etcd election (the create revision of its first-created key) or a
//! ZooKeeper election (the czxid of its lowest-sequence node; both read as the lease
//! client's stores elect, [`fencegate_lease::store`]). Issuers only ever issue higher
//! tokens, so "issued" is decided by comparing
//! with the latest token the issuer issued; what the gateway learned once stays true,
//! and is asked again only when a token is above it: a new term, or a forgery. A
//! term's steady writes are checked against memory.
//!
//! Only the latest token is a writer's: a token below it belongs to a term that has
//! ended — or, with etcd and ZooKeeper, whose tokens are sparse revisions, to no term
//! at all — and is refused as stale (`409 stale_token`, its `highest` the issuer's
//! latest) before the fence is asked, also while the newer term has not written yet.
//! With authentication on, the latest token is also bound to its holder: the identity
//! that took the gateway lease (kept by the store after a release, so every replica
//! finds it), the identity named like the `leader_lease` holder, or the holder etcd's
//! key or ZooKeeper's node holds. Another identity presenting it is refused.
//!
//! etcd and ZooKeeper are asked with a deadline (`--issuer-timeout`). An issuer that
//! does not answer vouches for nothing: a token above what this gateway knows is then
//! refused (`503 issuer_unavailable`, fail closed), while tokens it already knows keep
//! working.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use deadpool_postgres::Pool;
use fencegate_proto::{ResourceName, Token};

use fencegate_lease::store::{etcd, zookeeper};
use tokio::sync::OnceCell;

use crate::config::{Binding, IssuerArgs, IssuerKind};
use crate::store::postgres::{new_pool, read_row};
use crate::store::{Store, StoreError};

/// The latest token an issuer issued for a resource, and to whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedToken {
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
    /// Below the issuer's latest: a term that has ended, or a token that was never a
    /// term's (an election's tokens are sparse), so no writer's now.
    Earlier { current: Token },
}

/// Above this many resources, what was learned is forgotten (and asked again).
const KNOWN_CAPACITY: usize = 100_000;

/// Why an issuer could not say what it issued.
#[derive(Debug)]
pub enum AskError {
    /// The store (the gateway's leases, or the `leader_lease` database) failed.
    Store(StoreError),
    /// etcd or ZooKeeper did not answer in time, or failed.
    Unreachable { issuer: IssuerKind, detail: String },
}

impl From<StoreError> for AskError {
    fn from(error: StoreError) -> AskError {
        AskError::Store(error)
    }
}

/// The bindings, and the latest tokens learned from their issuers.
pub struct Issuers {
    bindings: Vec<Binding>,
    leader_lease: Option<LeaderLease>,
    etcd: Option<EtcdElections>,
    zookeeper: Option<ZooKeeperElections>,
    known: DashMap<Box<str>, IssuedToken>,
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
        let bound = |kind| args.bindings.iter().any(|binding| binding.issuer == kind);
        let etcd = bound(IssuerKind::Etcd).then(|| EtcdElections {
            endpoints: args.etcd_endpoints.clone(),
            prefix: args.etcd_prefix.clone(),
            timeout: args.issuer_timeout,
            client: OnceCell::new(),
            highest_revision: AtomicI64::new(0),
        });
        let zookeeper = match (&args.zookeeper_connect, bound(IssuerKind::ZooKeeper)) {
            (Some(connect), true) => Some(ZooKeeperElections {
                connect: connect.clone(),
                prefix: args.zookeeper_prefix.clone(),
                timeout: args.issuer_timeout,
                session: Mutex::new(None),
            }),
            (None, true) => return Err("zookeeper bindings need --zookeeper-connect".into()),
            (_, false) => None,
        };
        Ok(Issuers {
            bindings: args.bindings.clone(),
            leader_lease,
            etcd,
            zookeeper,
            known: DashMap::new(),
        })
    }

    /// Issuers with no bindings: every token is accepted as far as issuers go.
    #[cfg(test)]
    pub fn none() -> Issuers {
        Issuers {
            bindings: Vec::new(),
            leader_lease: None,
            etcd: None,
            zookeeper: None,
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
    pub fn known(&self, resource: &ResourceName) -> Option<IssuedToken> {
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
    pub fn learn(&self, resource: &ResourceName, issued: IssuedToken) {
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
    ) -> Result<Option<IssuedToken>, AskError> {
        let issued = match issuer {
            IssuerKind::Gateway => {
                let lease = store.read_lease(resource).await?;
                lease.token.map(|token| IssuedToken {
                    token,
                    holder: lease.identity.map(Arc::from),
                })
            }
            IssuerKind::LeaderLease => match &self.leader_lease {
                Some(table) => table.latest(resource).await?,
                None => return Err(unconfigured(issuer)),
            },
            IssuerKind::Etcd => match &self.etcd {
                Some(etcd) => etcd.leader(resource).await?,
                None => return Err(unconfigured(issuer)),
            },
            IssuerKind::ZooKeeper => match &self.zookeeper {
                Some(zookeeper) => zookeeper.leader(resource).await?,
                None => return Err(unconfigured(issuer)),
            },
        };
        if let Some(issued) = &issued {
            self.learn(resource, issued.clone());
        }
        Ok(issued)
    }

    /// The etcd cluster's revision now, and the highest this gateway saw before, if
    /// resources are bound to etcd: a revision below the highest means the cluster went
    /// back (restored from a snapshot without `--bump-revision`).
    pub async fn etcd_revision(&self) -> Option<Result<(i64, i64), AskError>> {
        let etcd = self.etcd.as_ref()?;
        Some(etcd.revision().await)
    }
}

fn unconfigured(issuer: IssuerKind) -> AskError {
    AskError::Store(StoreError::Internal(format!(
        "an {} binding without its settings",
        issuer.as_str()
    )))
}

/// The etcd elections of `etcd:` bindings.
struct EtcdElections {
    endpoints: Vec<String>,
    prefix: String,
    timeout: Duration,
    client: OnceCell<etcd_client::Client>,
    /// The highest cluster revision any answer carried.
    highest_revision: AtomicI64,
}

impl EtcdElections {
    async fn client(&self) -> Result<&etcd_client::Client, fencegate_lease::StoreError> {
        self.client
            .get_or_try_init(|| etcd::connect(&self.endpoints))
            .await
    }

    async fn read(&self, election: &str) -> Result<etcd::Election, AskError> {
        let read = async { etcd::read_election(self.client().await?, election).await };
        within(IssuerKind::Etcd, self.timeout, read).await
    }

    async fn leader(&self, resource: &ResourceName) -> Result<Option<IssuedToken>, AskError> {
        let election = format!("{}{resource}/", self.prefix);
        let read = self.read(&election).await?;
        self.highest_revision
            .fetch_max(read.revision, Ordering::Relaxed);
        let Some(leader) = read.leader else {
            return Ok(None);
        };
        Ok(issued(leader.create_revision, &leader.holder))
    }

    async fn revision(&self) -> Result<(i64, i64), AskError> {
        // Any key does: the answer's header carries the cluster's revision.
        let read = async { etcd::revision(self.client().await?, &self.prefix).await };
        let now = within(IssuerKind::Etcd, self.timeout, read).await?;
        let before = self.highest_revision.fetch_max(now, Ordering::Relaxed);
        if now < before {
            // Counted once: the lower revision is the cluster's from now on.
            self.highest_revision.store(now, Ordering::Relaxed);
        }
        Ok((now, before))
    }
}

/// The ZooKeeper elections of `zookeeper:` bindings.
struct ZooKeeperElections {
    connect: String,
    prefix: String,
    timeout: Duration,
    session: Mutex<Option<zookeeper_client::Client>>,
}

impl ZooKeeperElections {
    async fn leader(&self, resource: &ResourceName) -> Result<Option<IssuedToken>, AskError> {
        let election = format!("{}/{resource}", self.prefix);
        let read = async {
            let open = self.session.lock().unwrap().clone();
            let client = match open {
                Some(client) if !client.state().is_terminated() => client,
                _ => {
                    let client = zookeeper::connect(&self.connect, SESSION_TIMEOUT).await?;
                    *self.session.lock().unwrap() = Some(client.clone());
                    client
                }
            };
            // A read on a server that lags the leader could miss the newest term: sync
            // it with the leader first.
            client.sync(&election).await.or_else(|error| match error {
                zookeeper_client::Error::NoNode => Ok(()),
                error => Err(fencegate_lease::StoreError::Unavailable(error.to_string())),
            })?;
            zookeeper::first_candidate(&client, &election).await
        };
        let leader = within(IssuerKind::ZooKeeper, self.timeout, read).await?;
        Ok(leader.and_then(|leader| issued(leader.czxid, &leader.holder)))
    }
}

/// `read`, a question to `issuer`, within `timeout`: no answer in time, or a failure,
/// makes the issuer unreachable.
async fn within<T>(
    issuer: IssuerKind,
    timeout: Duration,
    read: impl std::future::Future<Output = Result<T, fencegate_lease::StoreError>>,
) -> Result<T, AskError> {
    let unreachable = |detail: String| AskError::Unreachable { issuer, detail };
    tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| unreachable("no answer within --issuer-timeout".into()))?
        .map_err(|error| unreachable(error.to_string()))
}

/// The gateway's own ZooKeeper session's timeout; it only reads.
const SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// An election's leader as an issued token: its token, and the holder identity its key
/// or node holds (none if empty or not UTF-8).
fn issued(token: i64, holder: &[u8]) -> Option<IssuedToken> {
    let token = Token::new(u64::try_from(token).ok()?).ok()?;
    let holder = std::str::from_utf8(holder)
        .ok()
        .filter(|holder| !holder.is_empty())
        .map(Arc::from);
    Some(IssuedToken { token, holder })
}

/// Judges `token`, presented by `identity`, against what the issuer issued: only the
/// latest token, the current term's, is accepted, and with authentication only from
/// its holder.
pub fn judge(token: Token, identity: Option<&str>, issued: Option<&IssuedToken>) -> Verdict {
    let Some(issued) = issued else {
        return Verdict::NotIssued { issued: None };
    };
    if token > issued.token {
        return Verdict::NotIssued {
            issued: Some(issued.token),
        };
    }
    if token < issued.token {
        return Verdict::Earlier {
            current: issued.token,
        };
    }
    match (identity, &issued.holder) {
        (Some(identity), Some(holder)) if identity != &**holder => Verdict::HolderMismatch {
            holder: Arc::clone(holder),
        },
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

    async fn latest(&self, resource: &ResourceName) -> Result<Option<IssuedToken>, StoreError> {
        let client = self.pool.get().await.map_err(|error| {
            tracing::warn!(%error, "no connection to the leader_lease database");
            StoreError::Unavailable {
                reason: crate::store::UnavailableReason::Connect,
                applied: Some(false),
            }
        })?;
        let row = read_row(&client, &self.query, &[&resource.as_str()]).await?;
        Ok(row.and_then(|row| {
            let epoch: i64 = row.get(0);
            let holder: Option<String> = row.get(1);
            let token = Token::new(u64::try_from(epoch).ok()?).ok()?;
            Some(IssuedToken {
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
        let issued = IssuedToken {
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
        // An earlier term's token — or one no election ever issued, below the
        // leader's — is no writer's now, whoever presents it.
        for identity in [Some("mallory"), Some("node-a"), None] {
            assert_eq!(
                judge(tok(4), identity, Some(&issued)),
                Verdict::Earlier { current: tok(5) }
            );
        }
    }

    #[test]
    fn learning_never_goes_back() {
        let issuers = Issuers::none();
        let resource = ResourceName::new("r").unwrap();
        issuers.learn(
            &resource,
            IssuedToken {
                token: tok(7),
                holder: None,
            },
        );
        issuers.learn(
            &resource,
            IssuedToken {
                token: tok(3),
                holder: None,
            },
        );
        assert_eq!(issuers.known(&resource).unwrap().token, tok(7));
    }
}
