//! The cluster's network: each Patroni node in a network namespace of its own, joined
//! through a router namespace (the hub) to the host, where etcd, HAProxy, the gateways
//! and the test run. [`Network::partition`] cuts one node off from all of them.
//!
//! # Layout
//!
//! One `/28` per cluster, `10.a.b.c` with `a.b` from the process id and `c` from a
//! per-process count, so that test processes running side by side neither clash nor
//! share names; each link is a veth pair on a `/30`:
//!
//! ```text
//! host c+1 ---- c+2 hub c+4i+1 ---- c+4i+2 node i   (i = 1, 2, 3)
//! ```
//!
//! The host routes the `/28` via the hub, each node's default route is the hub, and the
//! hub forwards (its own `ip_forward`; the host's is left alone).
//!
//! # Partitions
//!
//! A blackhole route drops forwarded packets silently, but fails a local sender's
//! `connect` at once with `EINVAL`. So the drops happen in the hub, where every packet
//! between a node and anything else is forwarded: a route `blackhole <node>/32` for
//! packets to the node and a rule `iif <its link> blackhole` for packets from it. No
//! side sees an error or a reset: connections hang, and connects time out, as across
//! a dead switch. [`Network::heal`] removes both; TCP connections that survived
//! retransmit. Only `ip` (iproute2) is needed: this kernel has neither netem nor tc
//! classifiers, and there is no nft or iptables.
//!
//! # Cleanup
//!
//! [`Drop`] deletes the host's link and the namespaces, after the cluster's processes
//! were killed. A namespace goes once its last process has exited; the hub, where no
//! process runs, goes at once, and with it every veth pair (deleting one end of a pair
//! deletes both), the host's route and the partitions. A test process killed outright
//! leaves them; the next process with the same id deletes them before it starts.

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU8, Ordering};

use tokio::process::Command;

use crate::faults::inject::{ip, ip_output};

/// Clusters this process has made, for its names and its `/28`s (16 fit in the `/24`).
static CLUSTERS: AtomicU8 = AtomicU8::new(0);

/// Namespaces and links of one cluster; removed when dropped.
pub(super) struct Network {
    /// In every name: the process id and this cluster's count, in hex.
    tag: String,
    /// `10.a.b.c`, the first address of the cluster's `/28`.
    base: Ipv4Addr,
    nodes: usize,
    /// The nodes cut off, by index.
    partitioned: Vec<usize>,
}

impl Network {
    /// Creates the hub and one namespace per node (at most 3). Needs root and iproute2.
    pub(super) async fn create(nodes: usize) -> Result<Network, String> {
        assert!(nodes <= 3, "a /28 holds the hub and three nodes");
        let pid = std::process::id();
        let count = CLUSTERS.fetch_add(1, Ordering::Relaxed) % 16;
        let base = Ipv4Addr::new(
            10,
            100 + ((pid >> 8) % 100) as u8,
            (pid & 0xff) as u8,
            count * 16,
        );
        let network = Network {
            tag: format!("fg{pid:x}{count:x}"),
            base,
            nodes,
            partitioned: Vec::new(),
        };
        // Leftovers of a process with the same id, killed before it cleaned up.
        network.teardown();
        let prefix = format!("{base}/28");
        let taken = ip_output(&["route", "show", "root", &prefix]).await?;
        if !taken.trim().is_empty() {
            return Err(format!("{prefix} is routed on this host already: {taken}"));
        }

        let hub = network.hub();
        ip(&["netns", "add", &hub]).await?;
        ip(&["-n", &hub, "link", "set", "lo", "up"]).await?;
        let forward = Command::new("ip")
            .args(["netns", "exec", &hub, "sh", "-c"])
            .arg("echo 1 > /proc/sys/net/ipv4/ip_forward")
            .status()
            .await;
        if !forward.is_ok_and(|status| status.success()) {
            return Err("cannot enable forwarding in the hub".into());
        }
        let (host_link, hub_link) = (network.host_link(), network.hub_link(0));
        ip(&[
            "link", "add", &host_link, "type", "veth", "peer", "name", &hub_link, "netns", &hub,
        ])
        .await?;
        ip(&["addr", "add", &network.slash30(1), "dev", &host_link]).await?;
        ip(&["link", "set", &host_link, "up"]).await?;
        ip(&[
            "-n",
            &hub,
            "addr",
            "add",
            &network.slash30(2),
            "dev",
            &hub_link,
        ])
        .await?;
        ip(&["-n", &hub, "link", "set", &hub_link, "up"]).await?;
        let via = network.addr(2).to_string();
        ip(&["route", "add", &prefix, "via", &via]).await?;

        for node in 0..nodes {
            let (namespace, outer) = (network.namespace(node), network.hub_link(node + 1));
            let offset = 4 * (node as u8 + 1);
            ip(&["netns", "add", &namespace]).await?;
            ip(&["-n", &namespace, "link", "set", "lo", "up"]).await?;
            ip(&[
                "-n", &hub, "link", "add", &outer, "type", "veth", "peer", "name", "eth0", "netns",
                &namespace,
            ])
            .await?;
            ip(&[
                "-n",
                &hub,
                "addr",
                "add",
                &network.slash30(offset + 1),
                "dev",
                &outer,
            ])
            .await?;
            ip(&["-n", &hub, "link", "set", &outer, "up"]).await?;
            let inside = network.slash30(offset + 2);
            ip(&["-n", &namespace, "addr", "add", &inside, "dev", "eth0"]).await?;
            ip(&["-n", &namespace, "link", "set", "eth0", "up"]).await?;
            let gateway = network.addr(offset + 1).to_string();
            ip(&["-n", &namespace, "route", "add", "default", "via", &gateway]).await?;
        }
        Ok(network)
    }

    fn addr(&self, offset: u8) -> Ipv4Addr {
        let [a, b, c, d] = self.base.octets();
        Ipv4Addr::new(a, b, c, d + offset)
    }

    fn slash30(&self, offset: u8) -> String {
        format!("{}/30", self.addr(offset))
    }

    fn hub(&self) -> String {
        format!("{}hub", self.tag)
    }

    fn host_link(&self) -> String {
        format!("{}h0", self.tag)
    }

    /// The hub's end of the link to the host (0) or to node `n - 1`.
    fn hub_link(&self, n: usize) -> String {
        format!("{}u{n}", self.tag)
    }

    /// The host's address, reachable from every node: where etcd listens.
    pub(super) fn host_addr(&self) -> Ipv4Addr {
        self.addr(1)
    }

    /// Node `node`'s address (from 0): where its Postgres and its REST API listen.
    pub(super) fn node_addr(&self, node: usize) -> Ipv4Addr {
        self.addr(4 * (node as u8 + 1) + 2)
    }

    /// The namespace of node `node` (from 0), for `ip netns exec`.
    pub(super) fn namespace(&self, node: usize) -> String {
        format!("{}n{}", self.tag, node + 1)
    }

    /// Cuts node `node` off: the hub drops every packet to it and from it.
    pub(super) async fn partition(&mut self, node: usize) -> Result<(), String> {
        if !self.partitioned.contains(&node) {
            self.blackhole("add", node).await?;
            self.partitioned.push(node);
        }
        Ok(())
    }

    /// Lets every node's packets through again.
    pub(super) async fn heal(&mut self) -> Result<(), String> {
        while let Some(&node) = self.partitioned.last() {
            self.blackhole("del", node).await?;
            self.partitioned.pop();
        }
        Ok(())
    }

    async fn blackhole(&self, verb: &str, node: usize) -> Result<(), String> {
        let hub = self.hub();
        let to = format!("{}/32", self.node_addr(node));
        ip(&["-n", &hub, "route", verb, "blackhole", &to]).await?;
        let from = self.hub_link(node + 1);
        ip(&["-n", &hub, "rule", verb, "iif", &from, "blackhole"]).await
    }

    /// Deletes what [`Network::create`] made, whatever of it exists.
    fn teardown(&self) {
        let ip = |args: &[&str]| {
            let _ = std::process::Command::new("ip").args(args).output();
        };
        ip(&["link", "del", &self.host_link()]);
        for node in 0..self.nodes {
            ip(&["netns", "del", &self.namespace(node)]);
        }
        ip(&["netns", "del", &self.hub()]);
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        self.teardown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a connect to a port nobody listens on met.
    #[derive(Debug, PartialEq)]
    enum Met {
        /// A reset: the peer's kernel answered.
        Refused,
        /// Nothing within a second.
        Silence,
        /// Anything else, e.g. a local error.
        Other(String),
    }

    /// Connects from `namespace` (or the host) to `addr:port` with bash's `/dev/tcp`.
    async fn connect(namespace: Option<&str>, addr: Ipv4Addr, port: u16) -> Met {
        let script = format!("exec 3<>/dev/tcp/{addr}/{port}");
        let mut command = Command::new("timeout");
        if let Some(namespace) = namespace {
            command = Command::new("ip");
            command.args(["netns", "exec", namespace, "timeout"]);
        }
        let output = command
            .args(["1", "bash", "-c", &script])
            .output()
            .await
            .expect("bash runs");
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        match output.status.code() {
            Some(124) => Met::Silence,
            _ if stderr.contains("Connection refused") => Met::Refused,
            _ => Met::Other(format!("{:?}: {stderr}", output.status)),
        }
    }

    /// A closed port answers with a reset across a working link; across a partition,
    /// in either direction, nothing answers — no reset, and no local error either (a
    /// blackhole on the host itself would fail the host's connect with `EINVAL`).
    #[tokio::test]
    async fn a_partition_drops_every_packet_of_one_node_without_a_reset() {
        let mut network = Network::create(2)
            .await
            .expect("the namespaces can be made");
        // Nothing listens on this port, anywhere.
        let port = crate::free_port();
        let (one, two) = (network.namespace(0), network.namespace(1));
        let (host, one_addr, two_addr) = (
            network.host_addr(),
            network.node_addr(0),
            network.node_addr(1),
        );
        let paths = [
            (None, one_addr),
            (Some(one.as_str()), host),
            (Some(one.as_str()), two_addr),
            (Some(two.as_str()), one_addr),
        ];
        for (from, to) in paths {
            assert_eq!(
                connect(from, to, port).await,
                Met::Refused,
                "{from:?} -> {to}"
            );
        }

        network.partition(0).await.expect("a partition");
        for (from, to) in paths {
            assert_eq!(
                connect(from, to, port).await,
                Met::Silence,
                "{from:?} -> {to}"
            );
        }
        // The other node still reaches the host.
        assert_eq!(connect(Some(&two), host, port).await, Met::Refused);

        network.heal().await.expect("a heal");
        for (from, to) in paths {
            assert_eq!(
                connect(from, to, port).await,
                Met::Refused,
                "{from:?} -> {to}"
            );
        }
        let tag = network.tag.clone();
        drop(network);
        let left = ip_output(&["-o", "link"]).await.expect("ip link");
        assert!(!left.contains(&tag), "links left: {left}");
        let left = ip_output(&["netns", "list"]).await.expect("ip netns");
        assert!(!left.contains(&tag), "namespaces left: {left}");
    }
}
