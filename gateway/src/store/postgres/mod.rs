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

mod connection;
mod group;
mod leases;
pub mod statements;
mod writes;

pub(crate) use connection::{
    classify, describe, error_text, server_unavailable, with_client_until,
};
pub use connection::{migrate, new_pool, PgPool, PgStartError, ServerWatch};

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Object;
use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName, Token};
use tokio::time::Instant;

use writes::{non_negative, read_fence, token_from_db, write_conditional, Attempt};

use super::leases::{
    Claimant, LeaseOp, LeaseOutcome, LeaseRecord, Reset, ResetOutcome, ResetRecord,
};
use super::{AdvanceOutcome, StoreError, StoredObject, Write, WriteOutcome};

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
    /// Observes the size of every group applied.
    pub group_size: prometheus::Histogram,
    /// Counts the writes of locked resources waiting off the write lanes.
    pub off_lanes: prometheus::IntGauge,
}

/// Fences and objects in a Postgres database, schema `fencegate`.
pub struct PgStore {
    pool: PgPool,
    timeout: Duration,
    group: group::GroupCommit,
    description: String,
    /// Which server the pools reach, for the fence audit after a failover.
    watch: Arc<ServerWatch>,
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
        let lane_settings = format!(
            "-c lock_timeout={} -c plan_cache_mode=force_generic_plan",
            lane_lock_timeout.as_millis().max(1)
        );
        lane_config.options(&match pg_config.get_options() {
            Some(theirs) => format!("{theirs} {lane_settings}"),
            None => lane_settings,
        });
        let watch = Arc::new(ServerWatch::default());
        let pool = PgPool::watched(pg_config, &tls, pool_size, Arc::clone(&watch));
        pool.check().await.map_err(PgStartError::Connect)?;
        let mut store = PgStore {
            group: group::GroupCommit::start(
                PgPool::watched(lane_config, &tls, write_lanes, Arc::clone(&watch)),
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
        };
        store
            .with_client(async |client| Ok(migrate(client).await))
            .await
            .map_err(PgStartError::Migrate)??;
        let used = store
            .with_client(async |client| connection::uses_tls(client).await)
            .await
            .map_err(PgStartError::Migrate)?;
        store.description = describe(&place, &tls, Some(used));
        Ok(store)
    }

    /// The name of the database the store is in.
    pub async fn database(&self) -> Result<String, StoreError> {
        self.with_client(async |client| {
            let row = client
                .query_one("SELECT current_database()::text", &[])
                .await
                .map_err(|e| classify(e, false))?;
            Ok(row.get(0))
        })
        .await
    }

    /// Lets `role` call `fencegate.fence()`: the privileges of a writer, and no more.
    pub async fn grant_fence(&self, role: &str) -> Result<(), StoreError> {
        self.with_client(async |client| {
            for grant in [
                "SELECT format('GRANT USAGE ON SCHEMA fencegate TO %I', $1::text)",
                "SELECT format('GRANT EXECUTE ON FUNCTION fencegate.fence(text, bigint) TO %I', $1::text)",
            ] {
                let statement: String = client
                    .query_one(grant, &[&role])
                    .await
                    .map_err(|e| classify(e, false))?
                    .get(0);
                client
                    .batch_execute(&statement)
                    .await
                    .map_err(|e| classify(e, false))?;
            }
            Ok(())
        })
        .await
    }

    pub fn describe(&self) -> String {
        self.description.clone()
    }

    /// The paths a write rarely takes — a precondition, a stale token — are boxed: the
    /// future of every write, moved into its task and out again, is then the size of
    /// the group path's, not of the largest.
    pub async fn write(&self, write: &Write) -> Result<WriteOutcome, StoreError> {
        let attempt = if write.precondition == Precondition::None {
            self.group.write(write.clone()).await?
        } else {
            Box::pin(self.with_client(async |client| write_conditional(client, write).await))
                .await?
        };
        Ok(match attempt {
            Attempt::Applied { version, created } => WriteOutcome::Applied { version, created },
            Attempt::PreconditionFailed { current } => WriteOutcome::PreconditionFailed { current },
            Attempt::Stale => WriteOutcome::Stale {
                highest: Box::pin(self.highest_above(&write.resource, write.token)).await?,
            },
        })
    }

    pub async fn advance(
        &self,
        resource: &ResourceName,
        token: Token,
    ) -> Result<AdvanceOutcome, StoreError> {
        let raised = self
            .with_client(async |client| {
                let statement = client
                    .prepare_cached(statements::FENCE_RAISE)
                    .await
                    .map_err(|e| classify(e, false))?;
                let row = client
                    .query_opt(&statement, &[&resource.as_str(), &token.as_i64()])
                    .await
                    .map_err(|e| classify(e, true))?;
                Ok(row.is_some())
            })
            .await?;
        if raised {
            Ok(AdvanceOutcome::Applied)
        } else {
            Ok(AdvanceOutcome::Stale {
                highest: self.highest_above(resource, token).await?,
            })
        }
    }

    pub async fn get(
        &self,
        resource: &ResourceName,
        key: &ObjectKey,
    ) -> Result<Option<StoredObject>, StoreError> {
        self.with_client(async |client| {
            let statement = client
                .prepare_cached(statements::GET_OBJECT)
                .await
                .map_err(|e| classify(e, false))?;
            let row = client
                .query_opt(&statement, &[&resource.as_str(), &key.as_str()])
                .await
                .map_err(|e| classify(e, false))?;
            row.map(|row| {
                Ok(StoredObject {
                    value: bytes::Bytes::from(row.get::<_, Vec<u8>>(0)),
                    version: non_negative(row.get(1))?,
                    token: token_from_db(row.get(2))?,
                })
            })
            .transpose()
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
    ) -> Result<LeaseOutcome, StoreError> {
        self.with_client(async |client| leases::step(client, resource, op, claimant).await)
            .await
    }

    /// Replaces the `--issued-by` bindings the in-database fence checks
    /// (`fencegate.issuer_bindings`) with `bindings`, in one transaction.
    pub async fn write_bindings(
        &self,
        bindings: &[crate::config::Binding],
    ) -> Result<(), StoreError> {
        self.with_client(async |client| {
            let tx = client.transaction().await.map_err(|e| classify(e, false))?;
            tx.execute("DELETE FROM fencegate.issuer_bindings", &[])
                .await
                .map_err(|e| classify(e, false))?;
            for (position, binding) in (0i32..).zip(bindings) {
                let (pattern, prefix) = binding.pattern.parts();
                tx.execute(
                    "INSERT INTO fencegate.issuer_bindings (position, pattern, prefix, issuer)
                     VALUES ($1, $2, $3, $4)",
                    &[&position, &pattern, &prefix, &binding.issuer.as_str()],
                )
                .await
                .map_err(|e| classify(e, false))?;
            }
            tx.commit().await.map_err(|e| classify(e, true))
        })
        .await
    }

    /// Raises fences that are below tokens seen committed; see [`super::Store::restore_fences`].
    pub async fn restore_fences(
        &self,
        seen: &[(ResourceName, Token)],
        resets_followed: u64,
    ) -> Result<Vec<super::Regression>, StoreError> {
        let resources: Vec<&str> = seen.iter().map(|(r, _)| r.as_str()).collect();
        let tokens: Vec<i64> = seen.iter().map(|(_, t)| t.as_i64()).collect();
        let followed = i64::try_from(resets_followed).unwrap_or(i64::MAX);
        self.with_client(async |client| {
            let rows = client
                .query(
                    statements::FENCES_RESTORE,
                    &[&resources, &tokens, &followed],
                )
                .await
                .map_err(|e| classify(e, true))?;
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
        })
        .await
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

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.with_client(async |client| {
            client
                .simple_query(statements::PING)
                .await
                .map_err(|e| classify(e, false))?;
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
