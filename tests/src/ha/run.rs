//! A run of faults against the cluster, as `tests/tests/patroni.rs` runs them: two
//! gateways (one through HAProxy, one with a multi-host URL) and, in synchronous mode, a
//! third as `deploy/patroni/README.md` sets it up; writers (`writers.rs`), a lease
//! holder and a [`Probe`] per gateway; each [`Fault`] injected in turn, and each one's
//! [`Summary`] handed to the test to judge while the cluster still runs.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Method;
use serde_json::json;
use tokio_util::sync::CancellationToken;

pub use super::summary::Summary;
use super::summary::{
    acknowledged_after, longest_gap, lost, seconds_between, tokens_twice, OUTAGE,
};
use super::writers::{
    door_url, fenced_table, final_read, final_row, grant, try_grant, Door, Via, Writer, DOOR_KEYS,
    KEYS, WRITERS,
};
use super::{HaCluster, Holder, Probe};
use crate::faults::late_applied;
use crate::gateway::Gateway;
use crate::history::{self, Counts, Recorder};
use crate::http::Client;
use crate::prometheus::Prometheus;

/// How long writers write before the fault, and after the cluster has recovered.
const STEADY: Duration = Duration::from_secs(3);

/// How long a partition lasts after the harness saw a new primary: the old one's
/// Patroni has given up on etcd and demoted it well before (`retry_timeout`, 4 s, is
/// below `ttl`, 10 s); the sessions the gateways had with it hang meanwhile.
const PARTITION_AFTER_FAILOVER: Duration = Duration::from_secs(5);

/// The faults, in the order a run injects them.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// kill -9 of the primary's postmaster; Patroni starts it again.
    PostmasterKill,
    /// `POST /switchover`: the primary steps down, its synchronous standby takes over.
    Switchover,
    /// SIGSTOP of the primary's Patroni and Postgres until another node is promoted
    /// (the leader key expires after `ttl`), then SIGCONT: the old primary wakes with
    /// its sessions and writes in flight, and Patroni demotes it.
    PrimaryFreeze,
    /// etcd stopped and started again under the running cluster.
    EtcdRestart,
    /// The primary's node cut off from etcd, the other nodes, HAProxy and the gateways
    /// (packets dropped, no resets) until another node is promoted and a while more,
    /// then healed: the old primary, demoted when it lost etcd, rejoins as a replica.
    PrimaryPartition,
    /// kill -9 of the primary's Patroni and Postgres, as when its machine dies; the
    /// leader key expires after `ttl` and the synchronous standby is promoted. The node
    /// is started again once the fault's history is taken.
    NodeKill,
}

impl Fault {
    /// The faults of a run. Killing a whole node is timed in synchronous mode, where
    /// `--require-synchronous-replication` waits for the surviving replica to become
    /// the new primary's synchronous standby; asynchronous mode has the frozen and the
    /// cut-off primary for an expired leader key.
    fn all(synchronous: bool) -> Vec<Fault> {
        let mut faults = vec![
            Fault::PostmasterKill,
            Fault::Switchover,
            Fault::PrimaryFreeze,
            Fault::EtcdRestart,
            Fault::PrimaryPartition,
        ];
        if synchronous {
            faults.push(Fault::NodeKill);
        }
        faults
    }

    /// The ttl of the lease holders through the fault, and whether they must keep their
    /// terms: `deploy/patroni/README.md` promises that 15 s rides out a switchover and
    /// 30 s a dead node. It promises nothing of the others at these ttls (a crash of
    /// Postgres with `--require-synchronous-replication` took up to 7.3 s, a frozen or
    /// cut-off primary up to 17.1 s; etcd restarted was not measured).
    pub fn holder_ttl(self) -> (Duration, bool) {
        match self {
            Fault::Switchover => (Duration::from_secs(15), true),
            Fault::NodeKill => (Duration::from_secs(30), true),
            Fault::PostmasterKill | Fault::EtcdRestart => (Duration::from_secs(15), false),
            Fault::PrimaryFreeze | Fault::PrimaryPartition => (Duration::from_secs(30), false),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Fault::PostmasterKill => "postmaster-kill",
            Fault::Switchover => "switchover",
            Fault::PrimaryFreeze => "primary-freeze",
            Fault::EtcdRestart => "etcd-restart",
            Fault::PrimaryPartition => "primary-partition",
            Fault::NodeKill => "node-kill",
        }
    }

    /// Injects the fault and waits until the cluster has a primary again: what happened,
    /// and when the harness saw that primary if the fault went on after it (a partition
    /// is healed later).
    async fn inject(self, cluster: &mut HaCluster) -> (String, Option<u64>) {
        let what = match self {
            Fault::PostmasterKill => {
                let (node, pid) = cluster.kill_primary_postmaster().await;
                let (primary, took) = cluster.wait_for_primary_after_kill(&node, pid).await;
                format!("killed {node}'s postmaster; {primary} primary after {took:.1?}")
            }
            Fault::Switchover => {
                let (old, new, took) = cluster.switchover().await;
                format!("switched over from {old} to {new} in {took:.1?}")
            }
            Fault::PrimaryFreeze => {
                let stopped = cluster.stop_primary().await;
                let (primary, took) = cluster.wait_for_new_primary(&stopped.node).await;
                cluster.cont(&stopped);
                format!(
                    "froze {}; {primary} primary after {took:.1?}; {} continued",
                    stopped.node, stopped.node
                )
            }
            Fault::NodeKill => {
                let old = cluster.kill_primary_node().await;
                let (primary, took) = cluster.wait_for_new_primary(&old).await;
                format!("killed {old}'s Patroni and Postgres; {primary} primary after {took:.1?}")
            }
            Fault::EtcdRestart => {
                let started = Instant::now();
                cluster.restart_etcd().await;
                let (primary, _) = cluster.wait_for_primary().await;
                format!(
                    "restarted etcd; {primary} primary after {:.1?}",
                    started.elapsed()
                )
            }
            Fault::PrimaryPartition => {
                let old = cluster.partition_primary().await;
                let (primary, took) = cluster.wait_for_new_primary(&old).await;
                let seen = history::now();
                tokio::time::sleep(PARTITION_AFTER_FAILOVER).await;
                cluster.heal().await;
                let what = format!(
                    "cut {old} off; {primary} primary after {took:.1?}; healed \
                     {PARTITION_AFTER_FAILOVER:?} later"
                );
                return (what, Some(seen));
            }
        };
        (what, None)
    }
}

/// Starts a cluster, checks that both gateways serve, and runs every fault in turn,
/// each one's summary checked by `check` while the cluster still runs (a failure keeps
/// its files, logs included).
pub async fn run(synchronous: bool, check: impl Fn(&Summary)) {
    let mode = if synchronous {
        "synchronous"
    } else {
        "asynchronous"
    };
    let started = Instant::now();
    let mut cluster = HaCluster::start(synchronous).await;
    let recovery = cluster.timing().recovery();
    println!(
        "{mode}: cluster up in {:.1?}; {:?}, so a recovery may take {recovery:.1?}",
        started.elapsed(),
        cluster.timing()
    );
    let patroni = cluster.node("node1").rest_url();
    let via_haproxy = gateway(&cluster.haproxy_url(), &patroni).await;
    cluster.watch("haproxy", &via_haproxy);
    let via_hosts = gateway(&cluster.multi_host_url(), &patroni).await;
    cluster.watch("multi-host", &via_hosts);
    for (name, gateway) in [("haproxy", &via_haproxy), ("multi-host", &via_hosts)] {
        serves(&gateway.client(), &format!("smoke-{name}")).await;
    }
    // Synchronous mode is how patroni.yml bootstraps the cluster: the README's gateway
    // runs there, and must say that it is synchronously replicated.
    let as_documented = if synchronous {
        let gateway = documented_gateway(&cluster).await;
        cluster.watch("haproxy --require-synchronous-replication", &gateway);
        reports_synchronous_at_start(&gateway, recovery).await;
        serves(&gateway.client(), "smoke-documented").await;
        Some(gateway)
    } else {
        None
    };
    let mut gateways = vec![("haproxy", &via_haproxy), ("multi-host", &via_hosts)];
    gateways.extend(
        as_documented
            .iter()
            .map(|gateway| ("haproxy --require-synchronous-replication", gateway)),
    );
    let probes: Vec<Probe> = gateways
        .iter()
        .map(|(label, gateway)| Probe::start(label, gateway.client()))
        .collect();
    let clients = vec![via_haproxy.client(), via_hosts.client()];
    // The doors, logged in to as the cluster's superuser (the fence's triggers hold for
    // every role).
    let doors: Vec<String> = [&via_haproxy, &via_hosts]
        .iter()
        .map(|gateway| door_url(&cluster.haproxy_url(), gateway))
        .collect();
    let mut logged = BTreeSet::new();
    for fault in Fault::all(synchronous) {
        let summary = run_fault(&mut cluster, &clients, &doors, &probes, &gateways, fault).await;
        println!("{}", summary.line(mode));
        println!("{}", summary.outages_line(mode));
        println!("{}", summary.holders_line(mode));
        for (name, gateway) in &gateways {
            for error in logged_errors(gateway) {
                if logged.insert((*name, error.clone())) {
                    println!("{mode} {}: the {name} gateway logged {error}", fault.name());
                }
            }
        }
        check(&summary);
        for node in cluster.restart_killed_nodes() {
            println!("{}: started {node} again", fault.name());
        }
        cluster.wait_until_streaming().await;
        println!("{}: then {}", fault.name(), roles(&cluster).await);
    }
    for probe in probes {
        probe.stop().await;
    }
    // What the gateways read of the cluster's replication is what it is.
    let mut readers = clients.clone();
    readers.extend(as_documented.iter().map(Gateway::client));
    reports_replication(&readers, synchronous, recovery).await;
    if !synchronous {
        lost_grant(&cluster, &via_haproxy, &via_hosts).await;
    }
    println!("{mode}: done in {:.1?}", started.elapsed());
}

/// The distinct messages (and errors) of a gateway's error events.
fn logged_errors(gateway: &Gateway) -> BTreeSet<String> {
    gateway
        .logs()
        .iter()
        .filter(|event| event["level"] == "ERROR")
        .map(|event| {
            let fields = &event["fields"];
            format!("{} {}", fields["message"], fields["error"])
        })
        .collect()
}

/// A gateway on `url`, with its Postgres door, reading Patroni's configuration from
/// `patroni`, and a backend deadline well below the writers' patience.
async fn gateway(url: &str, patroni: &str) -> Gateway {
    Gateway::builder()
        .database(url)
        .args(&["--backend-timeout", "2s", "--patroni-url", patroni])
        .spawn()
        .await
}

/// The gateway as `deploy/patroni/README.md` runs it: its login and database made by
/// the README's SQL, through HAProxy, with the README's flags (every node's REST API).
async fn documented_gateway(cluster: &HaCluster) -> Gateway {
    let url = cluster.create_gateway_login().await;
    Gateway::builder()
        .database(&url)
        .args(&[
            "--backend-timeout",
            "2s",
            "--patroni-url",
            &cluster.patroni_urls(),
            "--require-synchronous-replication",
        ])
        .spawn()
        .await
}

/// Checks that `gateway`'s ready line says the cluster is synchronously replicated,
/// with no standby hidden from its login, and waits until its metrics say so too
/// (`patience` at most).
async fn reports_synchronous_at_start(gateway: &Gateway, patience: Duration) {
    let ready = gateway.events("fencegate ready");
    let replication = ready
        .first()
        .and_then(|event| event["fields"]["replication"].as_str())
        .unwrap_or_default()
        .to_owned();
    assert!(
        replication.starts_with("synchronous (") && !replication.contains("hidden"),
        "the documented gateway's ready line says replication={replication:?}"
    );
    let client = gateway.client();
    let started = Instant::now();
    loop {
        let synchronous = client
            .metric("fencegate_backend_synchronous_replication")
            .await;
        let standbys = client
            .metric("fencegate_backend_synchronous_standbys")
            .await;
        if synchronous == Some(1.0) && standbys.is_some_and(|n| n >= 1.0) {
            println!("the documented gateway: replication={replication:?}");
            return;
        }
        assert!(
            started.elapsed() < patience,
            "the documented gateway reports synchronous replication {synchronous:?}, \
             {standbys:?} synchronous standbys"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until each gateway reports the cluster's replication as `synchronous` says,
/// Patroni's synchronous mode likewise, and a timeline past the first (the faults
/// promoted nodes); `patience` at most for each.
async fn reports_replication(clients: &[Client], synchronous: bool, patience: Duration) {
    let expected = f64::from(u8::from(synchronous));
    for client in clients {
        let started = Instant::now();
        loop {
            let replication = client
                .metric("fencegate_backend_synchronous_replication")
                .await;
            let patroni = client
                .metric("fencegate_backend_patroni_synchronous_mode")
                .await;
            let timeline = client.metric("fencegate_backend_timeline").await;
            if replication == Some(expected)
                && patroni == Some(expected)
                && timeline.is_some_and(|t| t > 1.0)
            {
                break;
            }
            assert!(
                started.elapsed() < patience,
                "replication {replication:?}, Patroni's mode {patroni:?}, timeline \
                 {timeline:?}; expected synchronous = {synchronous}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A lease taken, a write with its token, and the write read back.
async fn serves(client: &Client, resource: &str) {
    let acquired = client
        .request(
            Method::POST,
            &format!("/v1/leases/{resource}/acquire"),
            &[("content-type", "application/json")],
            json!({"holder": "smoke", "ttl_ms": 10_000}).to_string(),
        )
        .await;
    assert_eq!(acquired.status, 200, "{:?}", acquired.json());
    let token = acquired.json()["token"].as_u64().expect("a token");
    let written = client.put(resource, "k", token, "served").await;
    assert_eq!(written.status, 201, "{:?}", written.json());
    let (value, read_token, _) = client.read_object(resource, "k").await.expect("written");
    assert_eq!((value.as_slice(), read_token), (&b"served"[..], token));
}

/// Writers write, and a lease holder per gateway holds its lease, while `fault` is
/// injected; then the keys are read and the history checked.
async fn run_fault(
    cluster: &mut HaCluster,
    clients: &[Client],
    doors: &[String],
    probes: &[Probe],
    gateways: &[(&str, &Gateway)],
    fault: Fault,
) -> Summary {
    let suffix = format!("{}-{:08x}", fault.name(), rand::random::<u32>());
    let resource = format!("ha-{suffix}");
    let door_resource = format!("ha-door-{suffix}");
    let (ttl, _) = fault.holder_ttl();
    let recovery = cluster.timing().recovery();
    let mut holders = Vec::new();
    for (n, (label, gateway)) in gateways.iter().enumerate() {
        let lease = format!("ha-holder-{suffix}-{n}");
        holders.push(Holder::start(label, &gateway.url(), &lease, ttl, recovery).await);
    }
    let table = fenced_table(&cluster.haproxy_url(), &door_resource).await;
    let recorder = Recorder::new();
    let internal = Arc::new(AtomicUsize::new(0));
    let cancel = CancellationToken::new();
    let writer = |client: u32, resource: &str, via: Via| Writer {
        client,
        resource: resource.to_owned(),
        gateways: clients.to_vec(),
        via,
        recorder: recorder.clone(),
        internal: Arc::clone(&internal),
        cancel: cancel.clone(),
        patience: recovery,
    };
    let mut writers: Vec<Writer> = (0..WRITERS)
        .map(|client| writer(client, &resource, Via::Http))
        .collect();
    for (n, psql) in [false, true].into_iter().enumerate() {
        let door = Door {
            urls: doors.to_vec(),
            table: table.clone(),
            psql,
        };
        writers.push(writer(WRITERS + n as u32, &door_resource, Via::Door(door)));
    }
    let writers: Vec<_> = writers
        .into_iter()
        .map(|writer| tokio::spawn(writer.run()))
        .collect();
    tokio::time::sleep(STEADY).await;

    let before = roles(cluster).await;
    let fault_at = history::now();
    let (what, primary_seen) = fault.inject(cluster).await;
    let recovered_at = primary_seen.unwrap_or_else(history::now);
    // Write on until some write after the recovery was acknowledged, through every
    // gateway, and every holder renewed its term after it or lost it; and a while more.
    let deadline = Instant::now() + recovery;
    while !acknowledged_after(&recorder.entries(), recovered_at)
        || probes
            .iter()
            .any(|probe| !probe.acknowledged_after(recovered_at))
        || holders
            .iter()
            .any(|holder| !holder.settled_after(recovered_at))
    {
        if Instant::now() > deadline {
            cancel.cancel();
            let waiting: Vec<&str> = probes
                .iter()
                .filter(|probe| !probe.acknowledged_after(recovered_at))
                .map(|probe| probe.label.as_str())
                .collect();
            let unrenewed: Vec<&str> = holders
                .iter()
                .filter(|holder| !holder.settled_after(recovered_at))
                .map(|holder| holder.label.as_str())
                .collect();
            cluster.fail(&format!(
                "{}: no write acknowledged within {recovery:.1?} of the recovery ({what}); \
                 gateways without one: {waiting:?}; lease holders neither renewed nor lost: \
                 {unrenewed:?}",
                fault.name()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(STEADY).await;
    cancel.cancel();
    for writer in writers {
        writer.await.expect("a writer finished without panicking");
    }
    let mut held = Vec::new();
    for holder in holders {
        held.push(holder.stop(fault_at, recovered_at).await);
    }
    println!("{}: {before}; {what}", fault.name());

    let mut entries = recorder.entries();
    for (client, key) in KEYS.iter().enumerate() {
        let gateway = &clients[client % clients.len()];
        entries.push(final_read(gateway, WRITERS, &resource, key, recovery).await);
    }
    for key in DOOR_KEYS {
        let url = cluster.haproxy_url();
        entries.push(final_row(&url, &table, &door_resource, key, recovery).await);
    }
    let (unavailable, resumed) = longest_gap(&entries, fault_at);
    let outage = unavailable >= OUTAGE;
    Summary {
        fault,
        counts: Counts::of(&entries),
        violations: history::check(&entries),
        late_applied: late_applied(&entries),
        internal: internal.load(Ordering::Relaxed),
        lost: lost(&entries),
        tokens_twice: tokens_twice(&entries),
        unavailable,
        fault_to_write: outage.then(|| seconds_between(fault_at, resumed)),
        recovery_to_write: outage.then(|| seconds_between(recovered_at, resumed)),
        outages: probes
            .iter()
            .map(|probe| (probe.label.clone(), probe.outage(fault_at)))
            .collect(),
        holders: held,
    }
}

/// The members' roles, e.g. `node1 leader, node2 sync_standby, node3 replica`.
async fn roles(cluster: &HaCluster) -> String {
    let members = cluster.members().await.unwrap_or_default();
    let roles: Vec<String> = members
        .iter()
        .map(|m| format!("{} {} ({})", m.name, m.role, m.state))
        .collect();
    roles.join(", ")
}

/// The alert rules, as deployed.
const ALERTS: &str = include_str!("../../../dashboards/alerts.yml");

/// Asynchronous mode: a lease grant that only the primary had is lost with it. The
/// primary's WAL senders are stopped while gateway `a` grants the lease, then the
/// primary is frozen until a replica is promoted. `a` saw the grant: before it answers
/// on the new primary it restores the fence, and counts it; the
/// `FencegateFenceRegressed` alert fires on a live Prometheus; and the next grant,
/// through `b`, which never saw the lost one, is above it.
async fn lost_grant(cluster: &HaCluster, a: &Gateway, b: &Gateway) {
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         rule_files:\n  - alerts.yml\n\
         scrape_configs:\n  - job_name: fencegate\n    static_configs:\n      \
         - targets: ['{}', '{}']\n",
        a.addr(),
        b.addr()
    );
    let prometheus = Prometheus::start(&config, &[("alerts.yml", ALERTS)]).await;
    prometheus.wait_for_scrapes("fencegate", 4).await;
    let counted_before = a
        .client()
        .metric("fencegate_fence_regressions_total")
        .await
        .unwrap_or(0.0);
    let resource = format!("ha-lost-{:08x}", rand::random::<u32>());
    let recovery = cluster.timing().recovery();
    let (primary, _) = cluster.wait_for_primary().await;
    let replication = cluster.stop_replication(&primary);
    let lost = grant(&a.client(), &resource, "lost", recovery).await;
    // Frozen whole, its WAL senders with it: they send nothing until it continues.
    let frozen = cluster.stop_primary().await;
    let (promoted, took) = cluster.wait_for_new_primary(&frozen.node).await;
    let since = Instant::now();
    // Gateway a's first answered write on the new primary.
    let started = Instant::now();
    while a
        .client()
        .put("ha-lost-elsewhere", "k", 1, "after")
        .await
        .status
        / 100
        != 2
    {
        assert!(
            started.elapsed() < recovery,
            "gateway a never wrote on {promoted}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let counted = a
        .client()
        .metric("fencegate_fence_regressions_total")
        .await
        .unwrap_or(0.0);
    let (fence_client, connection) =
        tokio_postgres::connect(&cluster.node_url(&promoted), tokio_postgres::NoTls)
            .await
            .expect("the new primary answers");
    tokio::spawn(connection);
    let fence: Option<i64> = fence_client
        .query_opt(
            "SELECT highest FROM fencegate.fences WHERE resource = $1",
            &[&resource],
        )
        .await
        .expect("the fence can be read")
        .map(|row| row.get(0));
    cluster.cont(&frozen);
    cluster.cont_replication(&replication);
    assert!(
        counted > counted_before,
        "the lost grant was not counted as a regression ({counted_before} -> {counted})"
    );
    assert_eq!(
        fence,
        Some(lost as i64),
        "the fence of the lost grant is restored on {promoted} before gateway a answers"
    );
    let alert = prometheus
        .wait_for_firing("FencegateFenceRegressed", None, since)
        .await;
    let next = loop {
        match try_grant(&b.client(), &resource, "next").await {
            Some(token) => break token,
            None => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    assert!(next > lost, "token {next} granted after the lost {lost}");
    println!(
        "asynchronous lost-grant: token {lost} lost with {}; {promoted} primary after \
         {took:.1?}; restored and counted by the gateway that saw it; \
         FencegateFenceRegressed firing after {:.1?}; next token {next}",
        frozen.node, alert.firing
    );
    prometheus.stop().await;
    cluster.wait_until_streaming().await;
}
