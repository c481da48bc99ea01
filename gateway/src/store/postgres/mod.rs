//! The Postgres backend.
//!
//! # Behavior
//!
//! - A write without a precondition is one statement ([`statements::FENCED_PUT`],
//!   [`statements::FENCED_DELETE`]): atomic by construction. Concurrent ones are committed in
//!   groups, one transaction and one round trip per group (module `group`); a write that
//!   arrives alone is one autocommitted statement.
//! - A write with a precondition (`If-Match`) runs in an explicit transaction: raise the
//!   fence and read the object's version (pipelined), check the precondition, then write
//!   and commit — or roll back, so that a failed precondition leaves the fence as it was.
//! - A stale answer is followed by a read of the committed highest token, in a new
//!   statement: it sees the value that caused the rejection, or a later one.
//! - Every operation is bounded by the backend timeout. A connection that timed out is
//!   discarded, not returned to the pool — after a cancel request has stopped whatever
//!   it was still running in Postgres, so that nothing holds a lock on after the answer;
//!   a broken one is dropped by the pool's recycle check, and new connections are made
//!   as the database comes back.

pub mod bindings;
mod connection;
mod errors;
mod group;
mod leases;
pub mod replication;
mod server_watch;
pub(crate) mod session;
mod settings;
pub mod statements;
mod terms;
mod txn;
mod writes;

pub(crate) use connection::{committing, describe, read_row, with_client_until};
pub use connection::{migrate, new_pool, PgPool, PgStartError};
pub(crate) use errors::{classify, error_text, server_unavailable, Sent};
pub use server_watch::{OnNewServer, ServerAuditor, ServerId, ServerWatch};
pub use terms::{Takeover, Takeovers};
pub(crate) use txn::{stored_answer, IN_FLIGHT_WAIT};

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Object, RecyclingMethod};
use fencegate_proto::{ObjectKey, ResourceName, Token};
use tokio::time::Instant;

use session::Pins;
use writes::{non_negative, read_fence, token_from_db, write_conditional, Attempt};

use super::leases::{
    Claimant, LeaseOp, LeaseOutcome, LeaseRecord, Reset, ResetOutcome, ResetRecord,
};
use super::{
    AdvanceOutcome, NotWritable, NotWritableReason, StoreError, StoredObject, UnavailableReason,
    Write, WriteOutcome,
};
use tokio_postgres::error::SqlState;

/// A count as Postgres keeps it.
fn to_i64(count: u64) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

/// Reads the gateway's keys from `fencegate.keys`.
async fn read_keys(client: &mut Object) -> Result<GatewayKeys, StoreError> {
    let rows = client
        .query(statements::KEYS, &[])
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    let key = |name: &str| {
        rows.iter()
            .find(|row| row.get::<_, &str>(0) == name)
            .map(|row| row.get::<_, Vec<u8>>(1))
            .ok_or_else(|| StoreError::Internal(format!("fencegate.keys has no key {name:?}")))
    };
    Ok(GatewayKeys {
        sql: key("sql")?,
        proof: crate::dbfence::ProofKey::new(&key("proof")?),
    })
}

/// How the Postgres backend uses its connections.
pub struct PgOptions {
    /// Largest number of connections.
    pub pool_size: usize,
    /// Bound on every operation, including the wait for a connection.
    pub timeout: Duration,
    /// Write groups in flight at once (`--write-lanes`), at most `pool_size`.
    pub write_lanes: usize,
    /// Most writes in one group (`--group-commit-max`).
    pub group_commit_max: usize,
    /// How long a write lane waits for a fence lock (`--write-lock-timeout`).
    pub lane_lock_timeout: Duration,
    /// How long a call that may raise a fence waits for older terms before it ends
    /// their sessions (`--term-takeover-timeout`; zero: never); see `terms`.
    pub term_takeover: Duration,
    /// Observes the size of every group applied.
    pub group_size: prometheus::Histogram,
    /// Counts the writes of locked resources waiting off the write lanes.
    pub off_lanes: prometheus::IntGauge,
}

impl PgOptions {
    /// The options of the store's flags, with `--term-takeover-timeout` (an issuers'
    /// flag) and the metrics the store reports to.
    pub fn new(
        store: &crate::config::StoreArgs,
        term_takeover: Duration,
        metrics: &crate::metrics::Metrics,
    ) -> PgOptions {
        PgOptions {
            pool_size: store.pool_size,
            timeout: store.backend_timeout,
            write_lanes: store.write_lanes,
            group_commit_max: store.group_commit_max,
            lane_lock_timeout: store.write_lock_timeout,
            term_takeover,
            group_size: metrics.commit_group_size(),
            off_lanes: metrics.writes_off_lanes(),
        }
    }
}

/// [`PgStore::restore_fences`] on `client`: for the audit of a new connection's server,
/// before the connection is used.
pub async fn restore_fences_on(
    client: &tokio_postgres::Client,
    seen: &[(ResourceName, Token)],
    resets_followed: u64,
) -> Result<Vec<super::Regression>, StoreError> {
    let resources: Vec<&str> = seen.iter().map(|(r, _)| r.as_str()).collect();
    let tokens: Vec<i64> = seen.iter().map(|(_, t)| t.as_i64()).collect();
    let followed = i64::try_from(resets_followed).unwrap_or(i64::MAX);
    // Autocommitted, and cancelled at its deadline like a statement: it only raises
    // fences, and the next audit raises what a cancelled one did not.
    let rows = client
        .query(
            statements::FENCES_RESTORE,
            &[&resources, &tokens, &followed],
        )
        .await
        .map_err(|e| classify(e, Sent::Commit))?;
    rows.iter()
        .map(|row| {
            let resource: String = row.get(0);
            let found: Option<i64> = row.get(2);
            Ok(super::Regression {
                resource: ResourceName::new(resource).map_err(|_| {
                    StoreError::Internal("invalid resource in fencegate.fences".into())
                })?,
                seen: token_from_db(row.get(1))?,
                found: found.map(token_from_db).transpose()?,
            })
        })
        .collect()
}

/// Fences and objects in a Postgres database, schema `fencegate`.
pub struct PgStore {
    pool: PgPool,
    timeout: Duration,
    group: group::GroupCommit,
    description: String,
    /// Which server the pools reach, for the fence audit after a failover.
    watch: Arc<ServerWatch>,
    /// `--term-takeover-timeout`; see [`terms`].
    term_takeover: Duration,
    /// The schema's keys, read once the schema is in place.
    keys: Option<Arc<GatewayKeys>>,
}

/// The secrets of schema `fencegate` that the gateway uses (`fencegate.keys`).
#[derive(Clone, Debug)]
pub struct GatewayKeys {
    /// Opens `fencegate.sql_fence()`, the fence step of `/v1/sql`.
    pub sql: Vec<u8>,
    /// Checks the proofs of the fence's refusals.
    pub proof: crate::dbfence::ProofKey,
}

impl PgStore {
    /// Connects, creates or migrates the `fencegate` schema, and returns the store.
    pub async fn connect(url: &str, options: PgOptions) -> Result<PgStore, PgStartError> {
        let PgOptions {
            pool_size,
            timeout,
            write_lanes,
            group_commit_max,
            lane_lock_timeout,
            term_takeover,
            group_size,
            off_lanes,
        } = options;
        let crate::pgtls::PgUrl {
            config: mut pg_config,
            tls,
        } = crate::pgtls::parse(url).map_err(PgStartError::InvalidUrl)?;
        if pg_config.get_application_name().is_none() {
            pg_config.application_name("fencegate");
        }
        pg_config.connect_timeout(timeout);
        pg_config.keepalives_idle(Duration::from_secs(30));
        let place = pg_config.clone();
        // The write lanes' own connections give up on a fence lock after a moment, so
        // that one locked resource cannot hold a lane (see `group`). They run only the
        // write statements, whose plans are index lookups whatever the parameters:
        // planned once, not again for every group.
        let mut lane_config = pg_config.clone();
        let pins = Pins::store(Duration::ZERO, timeout);
        let lane_pins = Pins::store(lane_lock_timeout.max(Duration::from_millis(1)), timeout)
            .set("plan_cache_mode", "force_generic_plan");
        pins.apply(&mut pg_config);
        lane_pins.apply(&mut lane_config);
        let watch = Arc::new(ServerWatch::default());
        // Both pools open all their connections now and keep them, so that other
        // clients of the server (the Postgres door's among them) cannot take the slots
        // they need later.
        let audits = || (Arc::clone(&watch), OnNewServer::Audits);
        let pool = PgPool::watched(pg_config, &tls, pool_size, RecyclingMethod::Fast, audits());
        pool.warm(pool_size, "--pool-size")
            .await
            .map_err(PgStartError::Connect)?;
        let lanes = PgPool::watched(
            lane_config,
            &tls,
            write_lanes,
            RecyclingMethod::Fast,
            audits(),
        );
        lanes
            .warm(write_lanes, "--write-lanes")
            .await
            .map_err(PgStartError::Connect)?;
        pool.check_pins(&pins, "connections").await?;
        lanes.check_pins(&lane_pins, "write lanes").await?;
        let mut store = PgStore {
            group: group::GroupCommit::start(
                lanes,
                pool.clone(),
                write_lanes,
                group_commit_max,
                timeout,
                group_size,
                off_lanes,
            ),
            pool,
            timeout,
            description: String::new(),
            watch,
            term_takeover,
            keys: None,
        };
        store
            .with_client(async |client| Ok(migrate(client).await))
            .await
            .map_err(PgStartError::Migrate)??;
        store.keys = Some(Arc::new(
            store
                .with_client(async |client| read_keys(client).await)
                .await
                .map_err(PgStartError::Migrate)?,
        ));
        let used = store
            .with_client(async |client| connection::uses_tls(client).await)
            .await
            .map_err(PgStartError::Migrate)?;
        store.description = describe(&place, &tls, Some(used));
        Ok(store)
    }

    pub fn describe(&self) -> String {
        self.description.clone()
    }

    /// The schema's keys.
    pub fn keys(&self) -> &GatewayKeys {
        self.keys.as_ref().expect("read when the store connected")
    }

    /// The paths a write rarely takes — a precondition, a stale token — are boxed: the
    /// future of every write, moved into its task and out again, is then the size of
    /// the group path's, not of the largest.
    pub async fn write(&self, write: &Write) -> Result<WriteOutcome, StoreError> {
        let raises = || vec![(write.resource.clone(), write.token)];
        let attempt = match self
            .taking_over(raises, self.group.write(write.clone(), None))
            .await?
        {
            group::Settled::Attempt(attempt) => attempt,
            group::Settled::Alone => {
                let conditional =
                    self.with_client(async |client| write_conditional(client, write).await);
                Box::pin(self.taking_over(raises, conditional)).await?
            }
            group::Settled::Answered(_) => {
                return Err(StoreError::Internal(
                    "a write without a key was answered as a keyed one".into(),
                ))
            }
        };
        Ok(match attempt {
            Attempt::Applied { version, created } => WriteOutcome::Applied { version, created },
            Attempt::PreconditionFailed { current } => WriteOutcome::PreconditionFailed { current },
            Attempt::Stale => WriteOutcome::Stale {
                highest: Box::pin(self.highest_above(&write.resource, write.token)).await?,
            },
        })
    }

    /// Applies a transaction, keyed or not; see [`crate::store::txn`].
    pub async fn txn(
        &self,
        txn: &crate::store::txn::Txn,
        keyed: Option<&crate::store::txn::Keyed>,
    ) -> Result<crate::store::txn::Answered, StoreError> {
        let raises = || {
            txn.involved()
                .iter()
                .filter(|involved| involved.hold == crate::store::txn::Hold::Raise)
                .map(|involved| (involved.resource.clone(), involved.token))
                .collect()
        };
        // Transactions ride the write groups: a keyed write of one object as a write, any
        // other as a transaction.
        let grouped = async {
            match (
                txn.single_write(),
                keyed.map(|keyed| Arc::new(keyed.clone())),
            ) {
                (Some(write), Some(keyed)) => self.group.write(write, Some(keyed)).await,
                (_, keyed) => self.group.txn(Arc::new(txn.clone()), keyed).await,
            }
        };
        match Box::pin(self.taking_over(raises, grouped)).await? {
            group::Settled::Answered(answered) => return Ok(answered),
            group::Settled::Alone => {}
            group::Settled::Attempt(_) => {
                return Err(StoreError::Internal(
                    "a transaction was answered as a write without a key".into(),
                ))
            }
        }
        let run = self.with_client(async |client| txn::run(client, txn, keyed).await);
        Box::pin(self.taking_over(raises, run)).await
    }

    /// Removes up to `limit` expired idempotency records; returns how many went.
    pub async fn expire_idempotency(&self, limit: i64) -> Result<u64, StoreError> {
        self.with_client(async |client| {
            let removed: i64 = client
                .query_one(statements::IDEMPOTENCY_EXPIRE, &[&limit])
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?
                .get(0);
            Ok(u64::try_from(removed).unwrap_or(0))
        })
        .await
    }

    /// Adds `stored` — answers this gateway stored since it last called, as (identity,
    /// records, bytes) — to the usage of their identities, and reads the usage back.
    pub async fn answer_usage(
        &self,
        stored: &[(String, u64, u64)],
        bounds: crate::store::txn::IdentityBounds,
    ) -> Result<crate::store::txn::AnswerUsage, StoreError> {
        let mut stored = stored.to_vec();
        stored.sort();
        let identities: Vec<&str> = stored.iter().map(|(i, _, _)| i.as_str()).collect();
        let records: Vec<i64> = stored.iter().map(|(_, r, _)| to_i64(*r)).collect();
        let bytes: Vec<i64> = stored.iter().map(|(_, _, b)| to_i64(*b)).collect();
        let bound = (to_i64(bounds.records), to_i64(bounds.bytes));
        self.with_client(async |client| {
            if !identities.is_empty() {
                client
                    .execute(statements::USAGE_ADD, &[&identities, &records, &bytes])
                    .await
                    .map_err(|e| classify(e, Sent::NoCommit))?;
            }
            let rows = client
                .query(statements::USAGE_READ, &[&bound.0, &bound.1])
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            let mut usage = crate::store::txn::AnswerUsage::default();
            for row in rows {
                let (records, bytes): (i64, i64) = (row.get(1), row.get(2));
                match row.get::<_, Option<String>>(0) {
                    Some(identity) => usage.full.push(identity),
                    None => {
                        usage.records = u64::try_from(records).unwrap_or(0);
                        usage.bytes = u64::try_from(bytes).unwrap_or(0);
                    }
                }
            }
            Ok(usage)
        })
        .await
    }

    /// The committed, unexpired answer stored under (`identity`, `key`), with the
    /// fingerprint of its request.
    pub async fn stored_answer(
        &self,
        identity: &str,
        key: &str,
    ) -> Result<Option<(Vec<u8>, crate::store::txn::StoredAnswer)>, StoreError> {
        self.with_client(async |client| {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&identity, &key];
            match connection::read_row(client, statements::IDEMPOTENCY_ANSWER, &params).await? {
                Some(row) => Ok(Some(stored_answer(&row, 0)?)),
                None => Ok(None),
            }
        })
        .await
    }

    pub async fn advance(
        &self,
        resource: &ResourceName,
        token: Token,
    ) -> Result<AdvanceOutcome, StoreError> {
        let raises = || vec![(resource.clone(), token)];
        let advance = self.with_client(async |client| {
            let statement = client
                .prepare_cached(statements::FENCE_ADVANCE)
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
                [&resource.as_str(), &token.as_i64()];
            let row = connection::in_own_transaction(client, client.query_opt(&statement, &params))
                .await?;
            Ok(row.is_some())
        });
        let raised = self.taking_over(raises, advance).await?;
        if raised {
            Ok(AdvanceOutcome::Applied)
        } else {
            Ok(AdvanceOutcome::Stale {
                highest: self.highest_above(resource, token).await?,
            })
        }
    }

    pub async fn get<P, E>(
        &self,
        resource: &ResourceName,
        key: &ObjectKey,
        admit: impl FnOnce(usize) -> Result<P, E> + Send + 'static,
    ) -> Result<Option<Result<(StoredObject, P), E>>, StoreError>
    where
        P: Send + 'static,
        E: Send + 'static,
    {
        self.with_client(async |client| {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
                [&resource.as_str(), &key.as_str()];
            let row = connection::read_row(client, statements::GET_OBJECT, &params).await?;
            let Some(row) = row else { return Ok(None) };
            let value: &[u8] = row.get(0);
            let permit = match admit(value.len()) {
                Ok(permit) => permit,
                Err(refused) => return Ok(Some(Err(refused))),
            };
            let object = StoredObject {
                value: bytes::Bytes::copy_from_slice(value),
                version: non_negative(row.get(1))?,
                token: token_from_db(row.get(2))?,
            };
            Ok(Some(Ok((object, permit))))
        })
        .await
    }

    pub async fn list(
        &self,
        resource: &ResourceName,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, bytes::Bytes)>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let after = after.unwrap_or("");
        self.with_client(async |client| {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                [&resource.as_str(), &prefix, &after, &limit];
            let rows = connection::read_rows(client, statements::LIST_OBJECTS, &params).await?;
            Ok(rows
                .iter()
                .map(|row| {
                    let value: &[u8] = row.get(1);
                    (row.get(0), bytes::Bytes::copy_from_slice(value))
                })
                .collect())
        })
        .await
    }

    pub async fn fence(&self, resource: &ResourceName) -> Result<Option<Token>, StoreError> {
        self.with_client(async |client| read_fence(client, resource).await)
            .await
    }

    pub async fn lease(
        &self,
        resource: &ResourceName,
        op: &LeaseOp,
        claimant: &Claimant,
        keyed: Option<&crate::store::txn::Keyed<LeaseOutcome>>,
    ) -> Result<crate::store::txn::Answered<LeaseOutcome>, StoreError> {
        let step = self
            .with_client(async |client| leases::step(client, resource, op, claimant, keyed).await);
        match op {
            // A new term's token is above every token of the fence.
            LeaseOp::Acquire { .. } => {
                self.taking_over(|| vec![(resource.clone(), Token::MAX)], step)
                    .await
            }
            LeaseOp::Renew { .. } | LeaseOp::Release { .. } => step.await,
        }
    }

    /// Adopts the recorded issuer bindings, or writes `bindings`; see [`bindings`].
    pub async fn adopt_bindings(
        &self,
        bindings: &[crate::config::Binding],
        replace: bool,
    ) -> Result<bindings::Adopted, StoreError> {
        self.with_client(async |client| bindings::adopt(client, bindings, replace).await)
            .await
    }

    /// Compares the recorded issuer bindings with `bindings` at `generation`, and
    /// restores them if they drifted; see [`bindings`].
    pub async fn follow_bindings(
        &self,
        bindings: &[crate::config::Binding],
        generation: i64,
    ) -> Result<bindings::Drift, StoreError> {
        self.with_client(async |client| bindings::follow(client, bindings, generation).await)
            .await
    }

    /// Whether `table` (in the database of `client`) is guarded
    /// (`fencegate leader-lease guard`): `None` if there is no such table.
    pub async fn leader_lease_guarded(
        client: &tokio_postgres::Client,
        table: &str,
    ) -> Result<Option<bool>, tokio_postgres::Error> {
        let quoted: Vec<String> = table.split('.').map(|part| format!("\"{part}\"")).collect();
        let row = client
            .query_one(statements::LEASE_TABLE_GUARDED, &[&quoted.join(".")])
            .await?;
        Ok(row.get(0))
    }

    /// Raises fences that are below tokens seen committed; see [`super::Store::restore_fences`].
    pub async fn restore_fences(
        &self,
        seen: &[(ResourceName, Token)],
        resets_followed: u64,
    ) -> Result<Vec<super::Regression>, StoreError> {
        self.with_client(async |client| restore_fences_on(client, seen, resets_followed).await)
            .await
    }

    /// How the server replicates the commits of the store's sessions, and which server
    /// it is.
    pub async fn replication(&self) -> Result<(replication::Replication, ServerId), StoreError> {
        self.with_client(async |client| {
            let replication = replication::Replication::read(client).await?;
            Ok((replication, ServerId::read(client).await?))
        })
        .await
    }

    /// Succeeds once the server the store's connections reach was audited: a
    /// connection is taken (the first to a new server runs its audit), and the server
    /// it reached must be audited or a standby.
    pub async fn audited(&self) -> Result<(), StoreError> {
        self.ping().await?;
        match self.watch.current() {
            Some(server) if !server.standby && !self.watch.audited(&server) => {
                Err(StoreError::Unavailable {
                    reason: UnavailableReason::Connect,
                    applied: Some(false),
                })
            }
            _ => Ok(()),
        }
    }

    /// Which server the store's connections reach, and whether it was audited.
    pub fn watch(&self) -> &Arc<ServerWatch> {
        &self.watch
    }

    /// Whether the database server changed since the last call (failover, restart).
    pub fn server_changed(&self) -> bool {
        self.watch.take_changed()
    }

    pub async fn read_lease(&self, resource: &ResourceName) -> Result<LeaseRecord, StoreError> {
        self.with_client(async |client| leases::read(client, resource).await)
            .await
    }

    pub async fn reset(&self, reset: &Reset) -> Result<ResetOutcome, StoreError> {
        self.with_client(async |client| leases::reset(client, reset).await)
            .await
    }

    pub async fn resets_since(&self, generation: u64) -> Result<Vec<ResetRecord>, StoreError> {
        self.with_client(async |client| leases::resets_since(client, generation).await)
            .await
    }

    /// The readiness write probe: one row of `fencegate.readiness` rewritten and
    /// committed, durably (`synchronous_commit` is pinned on). A server that refuses
    /// writes (a standby, a read-only transaction) or has no room says so here.
    pub async fn probe_write(&self) -> Result<Result<(), NotWritable>, StoreError> {
        self.with_client(async |client| {
            // Autocommitted, and cancelled at its deadline like a statement: what it
            // writes is the probe's own row.
            let error = match client.execute(statements::READINESS_PROBE, &[]).await {
                Ok(_) => return Ok(Ok(())),
                Err(error) => error,
            };
            let reason = match error.code() {
                Some(code) if *code == SqlState::READ_ONLY_SQL_TRANSACTION => {
                    NotWritableReason::ReadOnly
                }
                Some(code) if *code == SqlState::DISK_FULL => NotWritableReason::DiskFull,
                Some(code) if !server_unavailable(code) => NotWritableReason::WriteFailed,
                _ => return Err(classify(error, Sent::Commit)),
            };
            Ok(Err(NotWritable {
                reason,
                detail: error_text(&error),
            }))
        })
        .await
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.with_client(async |client| {
            client
                .simple_query(statements::PING)
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            Ok(())
        })
        .await
    }

    /// The committed highest token of a resource that just rejected `token`.
    async fn highest_above(
        &self,
        resource: &ResourceName,
        token: Token,
    ) -> Result<Token, StoreError> {
        match self.fence(resource).await? {
            Some(highest) if highest > token => Ok(highest),
            other => Err(StoreError::Internal(format!(
                "resource {resource} rejected token {token} but its committed highest is {other:?}"
            ))),
        }
    }

    /// Runs `op` on a pooled connection, all within the backend timeout.
    ///
    /// On timeout the connection is taken out of the pool and closed: it may still be
    /// waiting on a statement, and must not be handed to the next request.
    async fn with_client<T>(
        &self,
        op: impl AsyncFnOnce(&mut Object) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        with_client_until(&self.pool, Instant::now() + self.timeout, op).await
    }
}
