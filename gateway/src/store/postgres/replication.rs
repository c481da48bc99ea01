//! How the fence database is replicated, as its primary and (optionally) Patroni say.
//!
//! The gateway's promise holds as long as the database loses no commit. A commit is
//! kept through a failover only if a synchronous standby confirmed it before it was
//! acknowledged: the session's `synchronous_commit` waits for one (the gateway pins it
//! `on`), `synchronous_standby_names` names one, and one is streaming as `sync` (or
//! `quorum`) in `pg_stat_replication`. [`Replication::read`] reads all three on a store
//! connection; [`patroni_config`] reads Patroni's `synchronous_mode` and
//! `synchronous_mode_strict`, which decide whether Patroni keeps a synchronous standby
//! named and may promote only it.
//!
//! `pg_stat_replication` shows a standby's state only to superusers and members of
//! `pg_read_all_stats` (or `pg_monitor`): for other roles the standbys are counted as
//! [`Replication::hidden`], and none of them as synchronous.

use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;

use super::errors::{classify, Sent};
use crate::store::StoreError;

/// The settings and standbys of the primary, as one store connection reads them.
pub const REPLICATION: &str = "
    SELECT current_setting('synchronous_commit'),
           current_setting('synchronous_standby_names'),
           (SELECT count(*) FROM pg_stat_replication
             WHERE sync_state IN ('sync', 'quorum') AND state = 'streaming'),
           (SELECT count(*) FROM pg_stat_replication WHERE state IS NULL),
           pg_is_in_recovery()";

/// How the primary replicates the commits of the gateway's sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replication {
    /// The session's `synchronous_commit`.
    pub synchronous_commit: String,
    pub synchronous_standby_names: String,
    /// Standbys streaming as `sync` or `quorum`.
    pub synchronous_standbys: i64,
    /// Standbys whose state this role may not see.
    pub hidden: i64,
    /// The server is itself a standby (a URL that reaches any server).
    pub standby: bool,
}

impl Replication {
    pub async fn read(client: &tokio_postgres::Client) -> Result<Replication, StoreError> {
        let row = client
            .query_one(REPLICATION, &[])
            .await
            .map_err(|e| classify(e, Sent::NoCommit))?;
        Ok(Replication {
            synchronous_commit: row.get(0),
            synchronous_standby_names: row.get(1),
            synchronous_standbys: row.get(2),
            hidden: row.get(3),
            standby: row.get(4),
        })
    }

    /// Whether a commit of the gateway's sessions waits for a standby that is there:
    /// the one reading of "synchronously replicated" the gateway acts on.
    pub fn synchronous(&self) -> bool {
        let waits = matches!(
            self.synchronous_commit.as_str(),
            "on" | "remote_write" | "remote_apply"
        );
        waits && !self.synchronous_standby_names.trim().is_empty() && self.synchronous_standbys > 0
    }
}

/// What Patroni's dynamic configuration says of synchronous replication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
pub struct PatroniConfig {
    #[serde(default)]
    pub synchronous_mode: bool,
    #[serde(default)]
    pub synchronous_mode_strict: bool,
}

/// The largest `/config` answer read.
const PATRONI_MAX_BODY: usize = 1 << 20;

/// Reads `GET {base}/config` of Patroni's REST API, within `timeout`.
pub async fn patroni_config(base: &str, timeout: Duration) -> Result<PatroniConfig, String> {
    let uri: hyper::Uri = format!("{}/config", base.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("--patroni-url: {e}"))?;
    let client = HttpClient::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let request = hyper::Request::get(uri)
        .body(Empty::new())
        .map_err(|e| e.to_string())?;
    let read = async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("Patroni answered {}", response.status()));
        }
        let body = Limited::new(response.into_body(), PATRONI_MAX_BODY)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        serde_json::from_slice(&body).map_err(|e| format!("Patroni's /config: {e}"))
    };
    tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| "Patroni did not answer in time".to_owned())?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replication(commit: &str, names: &str, standbys: i64) -> Replication {
        Replication {
            synchronous_commit: commit.into(),
            synchronous_standby_names: names.into(),
            synchronous_standbys: standbys,
            hidden: 0,
            standby: false,
        }
    }

    #[test]
    fn synchronous_needs_a_waiting_commit_a_named_standby_and_one_streaming() {
        assert!(replication("on", "*", 1).synchronous());
        assert!(replication("remote_apply", "ANY 1 (a, b)", 2).synchronous());
        assert!(!replication("on", "*", 0).synchronous());
        assert!(!replication("on", "", 1).synchronous());
        assert!(!replication("local", "*", 1).synchronous());
        assert!(!replication("off", "*", 1).synchronous());
    }
}
