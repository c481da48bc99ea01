//! How long the cluster's waits may take: derived from Patroni's own timing as it
//! reports it (`GET /config`: `ttl`, `loop_wait`, `retry_timeout`), and from how long
//! this machine took to bring up the first primary — so that a slow machine makes a
//! slow test, not a red one.
//!
//! A wait also goes on while Patroni says a node is busy on its way to a primary or a
//! replica (initdb, a base backup, Postgres starting: [`in_progress`]), and fails once
//! nothing is: a bed that cannot work (a data dir `postgres` cannot read, a crashed
//! Postgres) fails as soon as Patroni gives up, with its logs.

use std::time::Duration;

use serde_json::Value;

/// Patroni's timing, and this machine's pace.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// How long the leader key lives unless renewed.
    pub ttl: Duration,
    /// The time between two runs of Patroni's loop (health check, key renewal).
    pub loop_wait: Duration,
    /// How long Patroni retries etcd and Postgres operations before it gives up.
    pub retry_timeout: Duration,
    /// How long the first primary took to run once the nodes' Patroni started: initdb
    /// and a first start of Postgres on this machine, the pace of a promotion or a
    /// restart here. Zero until the cluster is up.
    pub bootstrap: Duration,
}

impl Timing {
    /// The bootstrap settings of `patroni.yml` (`ttl:`, `loop_wait:` and
    /// `retry_timeout:` under `dcs:`), for the waits before the cluster answers
    /// `GET /config`.
    pub(super) fn deployed(patroni_yml: &str) -> Result<Timing, String> {
        let seconds = |key: &str| {
            patroni_yml
                .lines()
                .find_map(|line| line.trim().strip_prefix(key)?.trim().parse::<u64>().ok())
                .map(Duration::from_secs)
                .ok_or_else(|| format!("patroni.yml sets no `{key}` in seconds"))
        };
        Ok(Timing {
            ttl: seconds("ttl:")?,
            loop_wait: seconds("loop_wait:")?,
            retry_timeout: seconds("retry_timeout:")?,
            bootstrap: Duration::ZERO,
        })
    }

    /// The settings of Patroni's answer to `GET /config`, with this machine's pace.
    pub(super) fn reported(config: &Value, bootstrap: Duration) -> Result<Timing, String> {
        let seconds = |key: &str| {
            config[key]
                .as_u64()
                .map(Duration::from_secs)
                .ok_or_else(|| format!("GET /config has no `{key}`: {config}"))
        };
        Ok(Timing {
            ttl: seconds("ttl")?,
            loop_wait: seconds("loop_wait")?,
            retry_timeout: seconds("retry_timeout")?,
            bootstrap,
        })
    }

    /// The longest Patroni's own rules let the cluster go without a leader: the old
    /// leader's key lives `ttl` after its last renewal, a replica's loop notices within
    /// `loop_wait`, and each of its etcd calls may be retried for `retry_timeout`.
    pub fn leaderless(&self) -> Duration {
        self.ttl + self.loop_wait + 2 * self.retry_timeout
    }

    /// How long a fault may leave the cluster without a primary, its replicas without
    /// streaming, or the gateways without a write: twice [`Timing::leaderless`], for a
    /// machine busy with other work, and a start of Postgres at this machine's pace.
    pub fn recovery(&self) -> Duration {
        2 * self.leaderless() + self.bootstrap
    }
}

/// Whether a node's Patroni reports work under way (its REST API's `state`) that ends in
/// a running Postgres: a wait for it goes on.
pub(super) fn in_progress(status: &Value) -> bool {
    matches!(
        status["state"].as_str(),
        Some(
            "initializing new cluster"
                | "running custom bootstrap script"
                | "creating replica"
                | "starting"
                | "restarting"
        )
    )
}

/// The most a wait goes on while nodes report work under way: `times` its deadline.
pub(super) const PROGRESS_CAP: u32 = 5;
