//! A real Postgres HA cluster: one etcd, three Patroni nodes (PostgreSQL 15) and
//! HAProxy, started from the reference deployment in `deploy/patroni/` and stopped when
//! the value is dropped.
//!
//! Patroni and HAProxy run the very files of `deploy/patroni/` ([`DEPLOY`]), with the
//! per-node values (names, ports, directories, etcd's address, passwords) in the
//! environment variables those files document. Each node runs in a network namespace
//! of its own with an address of its own ([`network`]), so that a test can cut it off;
//! etcd listens on the host's address there, HAProxy on loopback. Ports are free ones,
//! data and logs go to a fresh temp dir.
//!
//! # What the `postgres` user reads
//!
//! Patroni runs as `postgres`, which may not be able to enter the checkout (a clone
//! under `/root`, a home directory or a `mktemp -d` is mode 700), and Patroni 3.0.2
//! takes a config file it cannot read for a missing one: it exits with `KeyError:
//! 'scope'`, naming neither the file nor the permission. So, as
//! `deploy/patroni/README.md` tells operators, `patroni.yml` is copied into each node's
//! directory (owned by `postgres`, mode 700, in a temp dir it can traverse), and
//! `postgres` is made to read the copy before Patroni starts: a permission error stops
//! the start at once, saying which file and why.
//!
//! # Processes
//!
//! Each process runs in a process group of its own: etcd, HAProxy, and per node
//! `ip netns exec <node> runuser -u postgres -- patroni` (tests run as root, which
//! Postgres refuses). Patroni
//! starts each postmaster in a session of its own (the postmaster's pid is the first
//! line of `postmaster.pid`, its group is in `/proc`), and Postgres starts each backend
//! in a session of its own too. [`Drop`] sends SIGKILL to HAProxy's and Patroni's
//! groups — Patroni's before the postmasters', so none restarts them — then to each
//! postmaster's group and each of its children, then to etcd, and removes the temp dir
//! (kept, and named, if the test is panicking). A test process killed outright leaves
//! them running.
//!
//! # Settings for tests
//!
//! After bootstrap the cluster's dynamic configuration (`PATCH /config`) turns `fsync`
//! off, for speed on a machine of two cores, and `synchronous_mode` off if asked; the
//! rest is as `patroni.yml` says. Every log goes to `logs/<process>.log`.
//!
//! # Waits
//!
//! The waits are derived from Patroni's timing as `GET /config` reports it and from
//! this machine's pace ([`Timing`]), and go on while a node reports work under way. A
//! wait that runs out, or a process that exits unasked (found by every wait), panics
//! with what was awaited and last seen, the processes that exited, any permission error
//! in the logs, Patroni's view of the cluster (`GET /cluster`), and the tails of every
//! log: Patroni's (which hold its Postgres's output), Postgres's own if it keeps one,
//! etcd's, HAProxy's, and those of the gateways a test runs on the cluster
//! ([`HaCluster::watch`]).
//!
//! # Fault runs
//!
//! [`run`] is the run of faults `tests/tests/patroni.rs` judges: its writers
//! (`writers.rs`) and the summary of each fault (`summary.rs`).

mod faults;
mod gateway_login;
mod holder;
mod network;
mod probe;
mod process;
pub mod run;
mod summary;
mod timing;
mod writers;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use serde_json::{json, Value};
use tokio::process::Command;

use crate::cluster::BIN;
use crate::gateway::{Gateway, LogLines};
use crate::http::Client;
pub use holder::{Held, Holder};
use network::Network;
pub use probe::{longest_gap, Outage, Probe};
use process::{
    children, postgres_ids, process_group, readable_by_postgres, signal_group, signal_process,
    tail, Process, TAIL_LINES,
};
pub use timing::Timing;
use timing::{in_progress, PROGRESS_CAP};

/// The reference deployment: `patroni.yml` and `haproxy.cfg`.
pub const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/patroni");

/// The node names, as `haproxy.cfg` names its servers.
const NODES: [&str; 3] = ["node1", "node2", "node3"];

/// How long one REST call to Patroni, or an etcd health check, may take: a stopped node
/// never answers.
const REST_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a `/primary` probe may take: a stopped node never answers, and the
/// harness should see a new primary soon after it is promoted.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// One Patroni node and its Postgres.
pub struct Node {
    pub name: String,
    /// Its network namespace's index, from 0.
    index: usize,
    /// Its address in its namespace, for Postgres and the REST API.
    pub addr: Ipv4Addr,
    pub pg_port: u16,
    pub rest_port: u16,
    /// The node's directory, owned by `postgres`: `patroni.yml` (a copy of
    /// [`DEPLOY`]'s), `data/`, `pgpass`.
    dir: PathBuf,
    patroni: Process,
}

impl Node {
    /// Its Patroni's REST API, e.g. `http://10.100.1.6:8008`.
    pub fn rest_url(&self) -> String {
        format!("http://{}:{}", self.addr, self.rest_port)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The running postmaster's pid: the first line of `postmaster.pid`.
    pub fn postmaster_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data_dir().join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    /// SIGKILL of the postmaster's process group and of each of its children: each
    /// backend leads a process group of its own, and may be stopped (SIGKILL reaches
    /// stopped processes).
    fn kill_postgres(&self) {
        if let Some(postmaster) = self.postmaster_pid() {
            let children = children(postmaster);
            if let Some(group) = process_group(postmaster) {
                signal_group(group, "KILL");
            }
            for child in children {
                signal_process(child, "KILL");
            }
        }
    }

    fn rest(&self) -> Client {
        Client::new(self.rest_url())
    }

    /// `method path` on this node's REST API: status and body, or `None` if it did not
    /// answer within [`REST_TIMEOUT`].
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Option<(u16, Value)> {
        self.call_within(REST_TIMEOUT, method, path, body).await
    }

    /// As [`Node::call`], waiting up to `timeout`.
    async fn call_within(
        &self,
        timeout: Duration,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Option<(u16, Value)> {
        let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
        let headers = [("content-type", "application/json")];
        let reply = tokio::time::timeout(
            timeout,
            self.rest().try_request(method, path, &headers, body),
        )
        .await
        .ok()?
        .ok()?;
        let json = serde_json::from_slice(&reply.body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&reply.body).into_owned()));
        Some((reply.status, json))
    }
}

/// A member of the cluster as Patroni's `GET /cluster` lists it.
#[derive(Debug, Clone)]
pub struct Member {
    pub name: String,
    /// `leader`, `sync_standby` or `replica`.
    pub role: String,
    /// `running`, `starting`, `stopped`, `crashed`, ...
    pub state: String,
    /// Bytes behind the leader; `None` for the leader and when unknown.
    pub lag: Option<u64>,
    pub timeline: Option<u64>,
}

/// etcd, three Patroni nodes and HAProxy; everything is killed when dropped.
pub struct HaCluster {
    /// The temp dir: `logs/`, `etcd/`, one directory per node.
    dir: PathBuf,
    password: String,
    etcd_client_port: u16,
    etcd_peer_port: u16,
    etcd: Option<Process>,
    nodes: Vec<Node>,
    haproxy_port: u16,
    haproxy: Option<Process>,
    /// Whether commits wait for a synchronous standby (`synchronous_mode`).
    synchronous: bool,
    /// Patroni's timing and this machine's pace, which the waits are derived from.
    timing: Timing,
    /// The gateways a test runs on the cluster, by label: their logs go into a
    /// failure's report.
    gateways: Mutex<Vec<(String, LogLines)>>,
    /// Removed when dropped, after the fields above: after every process was killed.
    network: Network,
}

impl HaCluster {
    /// Starts etcd, three Patroni nodes and HAProxy, and waits until a primary serves
    /// through HAProxy and both replicas stream from it. With `synchronous`, commits wait
    /// for a synchronous standby (`synchronous_mode`, as `patroni.yml` bootstraps);
    /// without, replication is asynchronous. Panics with the logs if anything does not
    /// start.
    pub async fn start(synchronous: bool) -> HaCluster {
        let dir = std::env::temp_dir().join(format!(
            "fencegate-ha-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(dir.join("logs")).expect("the temp dir can be created");
        // Whatever the umask: `postgres` must pass through to its nodes' directories.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o711))
            .expect("chmod 0711 of the temp dir");
        let deployed = Path::new(DEPLOY).join("patroni.yml");
        let timing = std::fs::read_to_string(&deployed)
            .map_err(|e| e.to_string())
            .and_then(|text| Timing::deployed(&text))
            .unwrap_or_else(|e| panic!("{}: {e}", deployed.display()));
        let network = Network::create(NODES.len())
            .await
            .unwrap_or_else(|e| panic!("the nodes' namespaces cannot be made: {e}"));
        let mut cluster = HaCluster {
            dir,
            password: format!("pw{:016x}", rand::random::<u64>()),
            etcd_client_port: crate::free_port(),
            etcd_peer_port: crate::free_port(),
            etcd: None,
            nodes: Vec::new(),
            haproxy_port: crate::free_port(),
            haproxy: None,
            synchronous,
            timing,
            gateways: Mutex::new(Vec::new()),
            network,
        };
        cluster.start_etcd().await;
        let (uid, gid) = postgres_ids().await;
        let nodes_started = Instant::now();
        for (index, name) in NODES.into_iter().enumerate() {
            let node_dir = cluster.dir.join(name);
            std::fs::create_dir(&node_dir).expect("a node's directory can be created");
            let config = node_dir.join("patroni.yml");
            std::fs::copy(Path::new(DEPLOY).join("patroni.yml"), &config)
                .unwrap_or_else(|e| panic!("{DEPLOY}/patroni.yml cannot be copied: {e}"));
            for (path, mode) in [(&node_dir, 0o700), (&config, 0o600)] {
                std::os::unix::fs::chown(path, Some(uid), Some(gid))
                    .unwrap_or_else(|e| panic!("chown postgres {}: {e}", path.display()));
                std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))
                    .unwrap_or_else(|e| panic!("chmod {mode:o} {}: {e}", path.display()));
            }
            if let Err(error) = readable_by_postgres(&config).await {
                cluster.fail(&format!(
                    "the postgres user cannot read {} ({error}): it must be able to \
                     enter every directory above it (set TMPDIR to one it can)",
                    config.display()
                ));
            }
            let node = cluster.start_node(index, name, node_dir);
            cluster.nodes.push(node);
        }
        let (leader, _) = cluster.wait_for_primary().await;
        let bootstrap = nodes_started.elapsed();
        let settings = json!({
            "synchronous_mode": synchronous,
            "postgresql": {"parameters": {"fsync": "off"}},
        });
        let patched = cluster
            .node(&leader)
            .call(Method::PATCH, "/config", Some(settings))
            .await;
        if !matches!(patched, Some((200, _))) {
            cluster.fail(&format!("PATCH /config answered {patched:?}"));
        }
        let config = cluster
            .node(&leader)
            .call(Method::GET, "/config", None)
            .await;
        cluster.timing = match &config {
            Some((200, config)) => {
                Timing::reported(config, bootstrap).unwrap_or_else(|e| cluster.fail(&e))
            }
            _ => cluster.fail(&format!("GET /config answered {config:?}")),
        };
        cluster.start_haproxy();
        cluster.wait_until_streaming().await;
        cluster.wait_for_writes(&cluster.haproxy_url()).await;
        cluster
    }

    /// Patroni's timing as the cluster reports it, and this machine's pace: what the
    /// cluster's waits, and a test's, are derived from.
    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// Adds `gateway`'s log, under `label`, to the report of a failure.
    pub fn watch(&self, label: &str, gateway: &Gateway) {
        self.gateways
            .lock()
            .unwrap()
            .push((label.to_owned(), gateway.log_lines()));
    }

    /// The superuser's URL of database `postgres` through HAProxy's primary frontend.
    pub fn haproxy_url(&self) -> String {
        format!(
            "postgres://postgres:{}@127.0.0.1:{}/postgres",
            self.password, self.haproxy_port
        )
    }

    /// The superuser's URL naming all three nodes, the writable one chosen
    /// (`target_session_attrs=read-write`).
    pub fn multi_host_url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|node| format!("{}:{}", node.addr, node.pg_port))
            .collect();
        format!(
            "postgres://postgres:{}@{}/postgres?target_session_attrs=read-write",
            self.password,
            hosts.join(",")
        )
    }

    /// The superuser's URL of one node, whatever its role.
    pub fn node_url(&self, name: &str) -> String {
        format!(
            "postgres://postgres:{}@{}:{}/postgres",
            self.password,
            self.node(name).addr,
            self.node(name).pg_port
        )
    }

    pub fn node(&self, name: &str) -> &Node {
        self.nodes
            .iter()
            .find(|node| node.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// Every node's REST API, comma-separated, as `--patroni-url` takes them.
    pub fn patroni_urls(&self) -> String {
        let urls: Vec<String> = self.nodes.iter().map(Node::rest_url).collect();
        urls.join(",")
    }

    /// The node whose Patroni answers `GET /primary` with 200 — what HAProxy routes to —
    /// and whose Postgres runs as a primary (Patroni 3.0.2 answers 200 on the node that
    /// holds the leader key, also while its Postgres restarts in recovery), if any.
    pub async fn primary(&self) -> Option<String> {
        self.primary_of(&self.probe_primary().await)
    }

    /// Each node's answer to `GET /primary`, in [`NODES`]' order.
    async fn probe_primary(&self) -> Vec<Option<(u16, Value)>> {
        let probes = self
            .nodes
            .iter()
            .map(|node| node.call_within(PROBE_TIMEOUT, Method::GET, "/primary", None));
        futures_util::future::join_all(probes).await
    }

    /// The primary, as [`HaCluster::primary`] tells it, by the nodes' `answers`.
    fn primary_of(&self, answers: &[Option<(u16, Value)>]) -> Option<String> {
        self.nodes
            .iter()
            .zip(answers)
            .find(|(_, answer)| match answer {
                Some((200, status)) => {
                    matches!(status["role"].as_str(), Some("master" | "primary"))
                        && status["state"] == "running"
                }
                _ => false,
            })
            .map(|(node, _)| node.name.clone())
    }

    /// Waits until some node is the primary; its name and how long that took.
    pub async fn wait_for_primary(&self) -> (String, Duration) {
        self.wait_for_primary_where("a primary", |_| true).await
    }

    /// Waits until a node other than `old` is the primary; its name and how long that
    /// took.
    pub async fn wait_for_new_primary(&self, old: &str) -> (String, Duration) {
        self.wait_for_primary_where(&format!("a primary other than {old}"), |name| name != old)
            .await
    }

    /// Waits until a primary runs a postmaster other than `pid` of `node` (killed): the
    /// same node after Patroni restarted it, or another; its name and how long that
    /// took.
    pub async fn wait_for_primary_after_kill(&self, node: &str, pid: u32) -> (String, Duration) {
        self.wait_for_primary_where(
            &format!("a primary after {node}'s postmaster {pid} was killed"),
            |name| name != node || self.node(node).postmaster_pid().is_some_and(|p| p != pid),
        )
        .await
    }

    /// Waits, [`Timing::recovery`] and longer while a node reports work under way
    /// ([`Wait`]), until a primary that `accept`s runs.
    async fn wait_for_primary_where(
        &self,
        what: &str,
        accept: impl Fn(&str) -> bool,
    ) -> (String, Duration) {
        let mut wait = Wait::new(self.timing.recovery());
        loop {
            let answers = self.probe_primary().await;
            if let Some(name) = self.primary_of(&answers) {
                if accept(&name) {
                    return (name, wait.started.elapsed());
                }
            }
            self.check_processes(&format!("waiting for {what}"));
            let busy = answers
                .iter()
                .flatten()
                .any(|(_, status)| in_progress(status));
            if let Some(waited) = wait.expired(busy) {
                self.fail(&format!(
                    "waited {waited} for {what}, in vain; GET /primary answers: {}",
                    self.describe(&answers)
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The nodes' `answers` to `GET /primary`, for a failure's message:
    /// `node1: 503 replica running; node2: no answer; ...`.
    fn describe(&self, answers: &[Option<(u16, Value)>]) -> String {
        let answers: Vec<String> = self
            .nodes
            .iter()
            .zip(answers)
            .map(|(node, answer)| match answer {
                Some((status, body)) => format!(
                    "{}: {status} {} {}",
                    node.name,
                    body["role"].as_str().unwrap_or("-"),
                    body["state"].as_str().unwrap_or("-")
                ),
                None => format!("{}: no answer", node.name),
            })
            .collect();
        answers.join("; ")
    }

    /// The members as `GET /cluster` of the first node that answers lists them.
    pub async fn members(&self) -> Option<Vec<Member>> {
        for node in &self.nodes {
            if let Some((200, cluster)) = node.call(Method::GET, "/cluster", None).await {
                let members = cluster["members"].as_array()?;
                return Some(
                    members
                        .iter()
                        .map(|m| Member {
                            name: m["name"].as_str().unwrap_or_default().to_owned(),
                            role: m["role"].as_str().unwrap_or_default().to_owned(),
                            state: m["state"].as_str().unwrap_or_default().to_owned(),
                            lag: m["lag"].as_u64(),
                            timeline: m["timeline"].as_u64(),
                        })
                        .collect(),
                );
            }
        }
        None
    }

    /// Waits until there is a leader and both other nodes run as replicas with no lag
    /// (and, in synchronous mode, one of them is the synchronous standby):
    /// [`Timing::recovery`], and longer while the members' roles, states and lags
    /// change or one reports work under way.
    pub async fn wait_until_streaming(&self) {
        let mut wait = Wait::new(self.timing.recovery());
        let mut last = String::new();
        loop {
            let members = self.members().await;
            if let Some(members) = &members {
                let leader = members
                    .iter()
                    .filter(|m| m.role == "leader" && m.state == "running")
                    .count();
                let replicas = members
                    .iter()
                    .filter(|m| m.role != "leader")
                    .filter(|m| matches!(m.state.as_str(), "running" | "streaming"))
                    .filter(|m| m.lag == Some(0))
                    .count();
                // Patroni's synchronous mode (not strict) runs without a synchronous
                // standby while none is streaming, e.g. just after a switchover:
                // commits are then acknowledged by the primary alone.
                let synchronous = members.iter().any(|m| m.role == "sync_standby");
                if members.len() == NODES.len()
                    && leader == 1
                    && replicas == NODES.len() - 1
                    && (synchronous || !self.synchronous)
                {
                    return;
                }
            }
            self.check_processes("waiting for the replicas to stream");
            let now = format!("{members:?}");
            let busy = now != last
                || members.iter().flatten().any(|m| {
                    matches!(
                        m.state.as_str(),
                        "creating replica" | "starting" | "restarting"
                    )
                });
            last = now;
            if let Some(waited) = wait.expired(busy) {
                self.fail(&format!(
                    "the replicas are not streaming after {waited}: {members:#?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until `url` takes a write: a connection that is not in recovery.
    async fn wait_for_writes(&self, url: &str) {
        let timeout = self.timing.recovery();
        let started = Instant::now();
        let mut last = String::new();
        while started.elapsed() < timeout {
            match writable(url).await {
                Ok(true) => return,
                Ok(false) => last = "in recovery".to_owned(),
                Err(error) => last = error,
            }
            self.check_processes("waiting for writes through HAProxy");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.fail(&format!(
            "{} takes no writes after {timeout:?}: {last}",
            url.replace(&self.password, "***")
        ));
    }

    /// Each node's Patroni, HAProxy, etcd: those started, Patroni's first, whose logs
    /// say most when the cluster does not come up.
    fn processes(&self) -> Vec<&Process> {
        let mut processes: Vec<&Process> = Vec::new();
        processes.extend(self.nodes.iter().map(|node| &node.patroni));
        processes.extend(&self.haproxy);
        processes.extend(&self.etcd);
        processes
    }

    /// What the logs say of the cluster's processes: those that exited unasked, the
    /// lines of any log that report a permission error, and the tail of every log.
    pub fn logs(&self) -> String {
        let processes = self.processes();
        let mut text = String::new();
        let exited: Vec<String> = processes
            .iter()
            .filter_map(|process| process.unexpected_exit())
            .collect();
        if !exited.is_empty() {
            text.push_str(&format!("exited: {}\n", exited.join("; ")));
        }
        let denied: Vec<String> = processes
            .iter()
            .flat_map(|process| process.permission_errors())
            .collect();
        if !denied.is_empty() {
            text.push_str(&format!("permission errors:\n{}\n", denied.join("\n")));
        }
        text.push_str(&self.patroni_view());
        text.push('\n');
        for process in processes {
            text.push_str(&process.tail());
            text.push('\n');
        }
        for node in &self.nodes {
            if let Some(tail) = postgres_log(&node.data_dir()) {
                text.push_str(&format!("--- postgres {} ({tail}\n", node.name));
            }
        }
        for (label, lines) in self.gateways.lock().unwrap().iter() {
            text.push_str(&format!(
                "--- gateway {label}:\n{}\n",
                lines.tail(TAIL_LINES)
            ));
        }
        text
    }

    /// Patroni's view of the cluster for a failure's report: the members as `GET
    /// /cluster` of the first node that answers lists them, one a line. Read without
    /// the runtime: [`HaCluster::fail`] is not async.
    fn patroni_view(&self) -> String {
        for node in &self.nodes {
            let addr = SocketAddr::from((node.addr, node.rest_port));
            let Some(body) = blocking_get(addr, "/cluster") else {
                continue;
            };
            let cluster: Value = serde_json::from_str(&body).unwrap_or(Value::String(body));
            let members: Vec<String> = cluster["members"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| {
                    format!(
                        "  {} {} {} timeline {} lag {}",
                        m["name"].as_str().unwrap_or("-"),
                        m["role"].as_str().unwrap_or("-"),
                        m["state"].as_str().unwrap_or("-"),
                        m["timeline"],
                        m["lag"]
                    )
                })
                .collect();
            return format!(
                "--- Patroni's view (GET /cluster of {}):\n{}",
                node.name,
                members.join("\n")
            );
        }
        "--- Patroni's view: no node answered GET /cluster".to_owned()
    }

    /// Panics with `message` and [`HaCluster::logs`].
    pub fn fail(&self, message: &str) -> ! {
        panic!("{message}\n{}", self.logs())
    }

    /// Fails at once, `while_doing` what, if a process exited that the test did not
    /// stop: no wait can end well then.
    fn check_processes(&self, while_doing: &str) {
        if let Some(exited) = self
            .processes()
            .iter()
            .find_map(|process| process.unexpected_exit())
        {
            self.fail(&format!("{exited}, {while_doing}"));
        }
    }

    /// etcd's client address as the nodes reach it.
    fn etcd_addr(&self) -> String {
        format!("{}:{}", self.network.host_addr(), self.etcd_client_port)
    }

    async fn start_etcd(&mut self) {
        let local = format!("http://127.0.0.1:{}", self.etcd_client_port);
        let client = format!("http://{}", self.etcd_addr());
        let peer = format!("http://127.0.0.1:{}", self.etcd_peer_port);
        let mut command = Command::new("etcd");
        command
            .args(["--name", "etcd0", "--logger", "zap", "--data-dir"])
            .arg(self.dir.join("etcd"))
            .args(["--listen-client-urls", &format!("{local},{client}")])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("etcd0={peer}")])
            .args(["--initial-cluster-state", "new"])
            // Patroni 3.0.2 talks the v2 API (deploy/patroni/patroni.yml says why).
            .arg("--enable-v2")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default());
        self.etcd = Some(Process::spawn(
            "etcd",
            command,
            self.dir.join("logs/etcd.log"),
        ));
        let health = Client::new(local);
        let started = Instant::now();
        loop {
            let answer = tokio::time::timeout(
                REST_TIMEOUT,
                health.try_request(Method::GET, "/health", &[], ""),
            )
            .await;
            if let Ok(Ok(reply)) = answer {
                if reply.status == 200 && reply.json()["health"] == "true" {
                    return;
                }
            }
            self.check_processes("waiting for etcd to be healthy");
            if started.elapsed() > Duration::from_secs(30) {
                self.fail("etcd is not healthy after 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts node `index` (from 0) in its namespace, in `dir`, where its copy of
    /// `patroni.yml` is.
    fn start_node(&self, index: usize, name: &str, dir: PathBuf) -> Node {
        let addr = self.network.node_addr(index);
        // Free in the node's namespace too, where nothing else listens.
        let (pg_port, rest_port) = (crate::free_port(), crate::free_port());
        let patroni = self.spawn_patroni(index, name, (addr, pg_port, rest_port), &dir);
        Node {
            name: name.to_owned(),
            index,
            addr,
            pg_port,
            rest_port,
            dir,
            patroni,
        }
    }

    /// Starts the Patroni of node `index`, `name`, at `addr` with its Postgres and REST
    /// ports, reading `dir/patroni.yml`; its output is appended to `logs/<name>.log`.
    fn spawn_patroni(
        &self,
        index: usize,
        name: &str,
        (addr, pg_port, rest_port): (Ipv4Addr, u16, u16),
        dir: &Path,
    ) -> Process {
        let pg = format!("{addr}:{pg_port}");
        let rest = format!("{addr}:{rest_port}");
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.network.namespace(index)])
            .args(["runuser", "-u", "postgres", "--", "patroni"])
            .arg(dir.join("patroni.yml"))
            .current_dir(dir)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("LANG", "C.UTF-8")
            .env("PATRONI_NAME", name)
            .env("PATRONI_RESTAPI_LISTEN", &rest)
            .env("PATRONI_RESTAPI_CONNECT_ADDRESS", &rest)
            .env("PATRONI_POSTGRESQL_LISTEN", &pg)
            .env("PATRONI_POSTGRESQL_CONNECT_ADDRESS", &pg)
            .env("PATRONI_POSTGRESQL_DATA_DIR", dir.join("data"))
            .env("PATRONI_POSTGRESQL_PGPASS", dir.join("pgpass"))
            .env("PATRONI_POSTGRESQL_BIN_DIR", BIN)
            .env("PATRONI_ETCD_HOSTS", self.etcd_addr())
            .env("PATRONI_SUPERUSER_PASSWORD", &self.password)
            .env("PATRONI_REPLICATION_PASSWORD", &self.password);
        let log = self.dir.join(format!("logs/{name}.log"));
        Process::spawn(&format!("patroni {name}"), command, log)
    }

    fn start_haproxy(&mut self) {
        let mut command = Command::new("haproxy");
        command
            .arg("-db")
            .arg("-f")
            .arg(Path::new(DEPLOY).join("haproxy.cfg"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env(
                "HAPROXY_PRIMARY_BIND",
                format!("127.0.0.1:{}", self.haproxy_port),
            );
        for (i, node) in self.nodes.iter().enumerate() {
            command
                .env(
                    format!("NODE{}_POSTGRES", i + 1),
                    format!("{}:{}", node.addr, node.pg_port),
                )
                .env(
                    format!("NODE{}_REST_PORT", i + 1),
                    node.rest_port.to_string(),
                );
        }
        self.haproxy = Some(Process::spawn(
            "haproxy",
            command,
            self.dir.join("logs/haproxy.log"),
        ));
    }
}

impl Drop for HaCluster {
    fn drop(&mut self) {
        // HAProxy and Patroni first, so that no Patroni restarts a postmaster.
        if let Some(haproxy) = &self.haproxy {
            haproxy.signal("KILL");
        }
        for node in &self.nodes {
            node.patroni.signal("CONT");
            node.patroni.signal("KILL");
        }
        for node in &self.nodes {
            node.kill_postgres();
        }
        if let Some(etcd) = &self.etcd {
            etcd.signal("KILL");
        }
        if std::thread::panicking() {
            eprintln!("the HA cluster's files are kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A wait that runs out `timeout` after the last time the system reported work under
/// way, and at most [`PROGRESS_CAP`] times `timeout` after it began.
struct Wait {
    started: Instant,
    busy: Instant,
    timeout: Duration,
}

impl Wait {
    fn new(timeout: Duration) -> Wait {
        let now = Instant::now();
        Wait {
            started: now,
            busy: now,
            timeout,
        }
    }

    /// Notes whether the system is `busy` now; once the wait has run out, how long it
    /// waited and why it stopped, for a failure's message.
    fn expired(&mut self, busy: bool) -> Option<String> {
        let now = Instant::now();
        if busy {
            self.busy = now;
        }
        let waited = now - self.started;
        if now - self.busy > self.timeout {
            Some(format!(
                "{waited:.1?} ({:?} without work under way, from Patroni's timing and \
                 this machine's pace)",
                self.timeout
            ))
        } else if waited > PROGRESS_CAP * self.timeout {
            Some(format!(
                "{waited:.1?} ({PROGRESS_CAP} times {:?}, work still under way)",
                self.timeout
            ))
        } else {
            None
        }
    }
}

/// `GET path` of the HTTP server at `addr`, blocking: the body of a 200 answer.
fn blocking_get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(&addr, REST_TIMEOUT).ok()?;
    stream.set_read_timeout(Some(REST_TIMEOUT)).ok()?;
    stream.set_write_timeout(Some(REST_TIMEOUT)).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).ok()?;
    let (head, body) = reply.split_once("\r\n\r\n")?;
    head.split_whitespace()
        .nth(1)
        .is_some_and(|status| status == "200")
        .then(|| body.to_owned())
}

/// The tail of the newest file of Postgres's own log directory (`<data>/log`), when
/// its logging collector writes one: `<file>):\n<lines>`. Without it, Postgres logs
/// to Patroni's output.
fn postgres_log(data_dir: &Path) -> Option<String> {
    let newest = std::fs::read_dir(data_dir.join("log"))
        .ok()?
        .flatten()
        .max_by_key(|entry| entry.metadata().and_then(|m| m.modified()).ok())?
        .path();
    Some(format!("{}):\n{}", newest.display(), tail(&newest)))
}

/// Whether `url` connects to a server that takes writes.
async fn writable(url: &str) -> Result<bool, String> {
    let connect = tokio_postgres::connect(url, tokio_postgres::NoTls);
    let (client, connection) = tokio::time::timeout(REST_TIMEOUT, connect)
        .await
        .map_err(|_| "connecting timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let row = client
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .map_err(|e| e.to_string())?;
    Ok(!row.get::<_, bool>(0))
}
