//! The faults a test injects into the cluster: kill -9 of the primary's postmaster, or
//! of its whole node, the primary frozen whole, the primary cut off from the network, a
//! switchover, etcd restarted.

use std::time::{Duration, Instant};

use http::Method;
use serde_json::json;

use super::process::{children, signal_group, signal_process};
use super::HaCluster;

/// A node stopped with SIGSTOP by [`HaCluster::stop_primary`].
#[derive(Debug, Clone)]
pub struct Stopped {
    pub node: String,
    /// Patroni's process group.
    patroni: Option<u32>,
    /// The postmaster and its children.
    postgres: Vec<u32>,
}

impl HaCluster {
    /// kill -9 of the primary's postmaster alone (its backends notice and exit; Patroni
    /// starts it again). The node and the pid killed.
    pub async fn kill_primary_postmaster(&self) -> (String, u32) {
        let (name, _) = self.wait_for_primary().await;
        let pid = self
            .node(&name)
            .postmaster_pid()
            .unwrap_or_else(|| self.fail(&format!("{name} is primary without a postmaster.pid")));
        crate::gateway::signal(pid, "KILL");
        (name, pid)
    }

    /// kill -9 of the primary's whole node, as when its machine dies: its Patroni
    /// first, so that nothing starts Postgres again, then the postmaster and every
    /// child. The node stays down until [`HaCluster::restart_killed_nodes`]; its leader key
    /// expires after `ttl`. The node killed.
    pub async fn kill_primary_node(&self) -> String {
        let (name, _) = self.wait_for_primary().await;
        let node = self.node(&name);
        node.patroni.signal("KILL");
        node.kill_postgres();
        name
    }

    /// Starts again the Patroni of every node that [`HaCluster::kill_primary_node`]
    /// killed: each recovers its Postgres and rejoins as a replica (rewound if need
    /// be). The nodes restarted.
    pub fn restart_killed_nodes(&mut self) -> Vec<String> {
        let mut restarted = Vec::new();
        for index in 0..self.nodes.len() {
            let node = &self.nodes[index];
            if !node.patroni.was_stopped() {
                continue;
            }
            let patroni = self.spawn_patroni(
                node.index,
                &node.name,
                (node.addr, node.pg_port, node.rest_port),
                &node.dir,
            );
            restarted.push(node.name.clone());
            self.nodes[index].patroni = patroni;
        }
        restarted
    }

    /// SIGSTOP of the primary's Patroni and of all its Postgres processes — the
    /// postmaster, then each of its children (every backend leads a process group of
    /// its own) — as when a VM is paused: the node holds its sessions and its leader key
    /// until that expires, until [`HaCluster::cont`].
    pub async fn stop_primary(&self) -> Stopped {
        let (name, _) = self.wait_for_primary().await;
        let node = self.node(&name);
        let patroni = node.patroni.group();
        if let Some(group) = patroni {
            signal_group(group, "STOP");
        }
        let mut postgres = Vec::new();
        if let Some(postmaster) = node.postmaster_pid() {
            // The postmaster first, so that it forks no child after the others stop.
            signal_process(postmaster, "STOP");
            postgres.push(postmaster);
            for child in children(postmaster) {
                signal_process(child, "STOP");
                postgres.push(child);
            }
        }
        Stopped {
            node: name,
            patroni,
            postgres,
        }
    }

    /// SIGCONT of what [`HaCluster::stop_primary`] stopped, Postgres first.
    pub fn cont(&self, stopped: &Stopped) {
        for pid in &stopped.postgres {
            signal_process(*pid, "CONT");
        }
        if let Some(group) = stopped.patroni {
            signal_group(group, "CONT");
        }
    }

    /// Cuts the primary's node (its Patroni and its Postgres) off from everything else —
    /// etcd, the other nodes, HAProxy, the gateways — every packet silently dropped,
    /// until [`HaCluster::heal`]. The node cut off.
    pub async fn partition_primary(&mut self) -> String {
        let (name, _) = self.wait_for_primary().await;
        let index = self
            .nodes
            .iter()
            .position(|node| node.name == name)
            .expect("the primary is a node");
        if let Err(error) = self.network.partition(index).await {
            self.fail(&format!("cannot partition {name}: {error}"));
        }
        name
    }

    /// Ends every partition.
    pub async fn heal(&mut self) {
        if let Err(error) = self.network.heal().await {
            self.fail(&format!("cannot heal the partition: {error}"));
        }
    }

    /// A switchover (`POST /switchover` to the primary's Patroni, which answers once it
    /// is done): the old primary, the new one, and how long the call took.
    pub async fn switchover(&self) -> (String, String, Duration) {
        let (old, _) = self.wait_for_primary().await;
        let started = Instant::now();
        // Patroni answers once the new primary runs.
        let answer = self
            .node(&old)
            .call_within(
                self.timing.recovery(),
                Method::POST,
                "/switchover",
                Some(json!({"leader": old})),
            )
            .await;
        if !matches!(answer, Some((200, _))) {
            self.fail(&format!("POST /switchover answered {answer:?}"));
        }
        let (new, _) = self.wait_for_new_primary(&old).await;
        (old, new, started.elapsed())
    }

    /// Stops etcd (SIGTERM, waiting until it exits) and starts it again on its data.
    pub async fn restart_etcd(&mut self) {
        if let Some(etcd) = self.etcd.take() {
            etcd.signal("TERM");
            if !etcd.wait_exit(Duration::from_secs(30)).await {
                self.etcd = Some(etcd);
                self.fail("etcd did not exit within 30 s of SIGTERM");
            }
        }
        self.start_etcd().await;
    }
}

/// WAL senders stopped with SIGSTOP by [`HaCluster::stop_replication`].
#[derive(Debug)]
pub struct ReplicationStopped {
    senders: Vec<u32>,
}

impl HaCluster {
    /// SIGSTOP of the WAL senders of `primary`: it goes on committing (asynchronous
    /// mode) what no replica receives — nothing more is sent, not even into a socket's
    /// buffer — until [`HaCluster::cont_replication`], or until the node is frozen and
    /// continued whole ([`HaCluster::stop_primary`] stops them too).
    pub fn stop_replication(&self, primary: &str) -> ReplicationStopped {
        let Some(postmaster) = self.node(primary).postmaster_pid() else {
            self.fail(&format!("primary {primary} has no postmaster.pid"));
        };
        let mut senders = Vec::new();
        for child in children(postmaster) {
            let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains("walsender") {
                signal_process(child, "STOP");
                senders.push(child);
            }
        }
        if senders.is_empty() {
            self.fail(&format!("{primary} has no WAL sender to stop"));
        }
        ReplicationStopped { senders }
    }

    /// SIGCONT of what [`HaCluster::stop_replication`] stopped.
    pub fn cont_replication(&self, stopped: &ReplicationStopped) {
        for pid in &stopped.senders {
            signal_process(*pid, "CONT");
        }
    }
}
