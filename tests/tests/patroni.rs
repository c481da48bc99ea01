//! The gateway on a real Postgres HA cluster: Patroni with etcd, behind HAProxy
//! (`deploy/patroni/`), started by the test ([`HaCluster`]).
//!
//! Two gateways serve one cluster, one through HAProxy and one with a multi-host URL
//! (`target_session_attrs=read-write`). Writers take turns holding the gateway's hosted
//! lease of a resource and write with its token, through both gateways, while a fault
//! hits the cluster: kill -9 of the primary's postmaster, a switchover, the primary
//! frozen (SIGSTOP) until another node is promoted, a restart of etcd, the primary cut
//! off from the network until another node is promoted, and in synchronous mode kill -9
//! of the primary's whole node (Patroni and Postgres; started again afterwards). Then
//! every key is read once more and the history is checked for
//! linearizability against a fenced register ([`history::check`]): every acknowledged
//! write is there, and no write of an older term got in after a newer term's.
//!
//! Writers of a second resource write through the gateways' Postgres doors instead, to
//! a fenced table (`fencegate.protect`): one with tokio-postgres, one with `psql`, each
//! in a transaction that presents its term's token with `fencegate.fence()` first. Their
//! histories are checked the same way, with the table's `version` column as the
//! object's version.
//!
//! Acquires are sent with an `Idempotency-Key` and retried with it until answered, so
//! every term's token is known (an acquire raises the fence). Writes are not retried:
//! an answer that does not say whether a write was applied (`503` with
//! `write_applied: null`, a broken connection) is indeterminate in the history.
//!
//! In synchronous mode a third gateway runs as `deploy/patroni/README.md` sets it up:
//! its own login and database made by the README's SQL (a member of `pg_monitor`, not a
//! superuser), through HAProxy, with `--patroni-url` naming every node and
//! `--require-synchronous-replication`. It must report the cluster as synchronously
//! replicated, in its ready line and its metrics, at the start and after the faults.
//!
//! Through each fault, one lease holder per gateway — the Rust client's elector on a
//! hosted lease of its own, default timing — holds its lease, as an application would.
//! `deploy/patroni/README.md` promises that a 15 s ttl rides out a switchover and a
//! 30 s ttl a dead node: there each holder must keep its term, the same token renewed
//! after the recovery. The other faults run with 15 s (a crash of Postgres, etcd
//! restarted) or 30 s (a frozen or cut-off primary), and how the holders fared is
//! printed only ([`Fault::holder_ttl`]).
//!
//! Each fault prints one line: operations, acknowledged, indeterminate, violations, and
//! how long writes were unavailable (`cargo test -p fencegate-tests --test patroni --
//! --nocapture`); and one more with each gateway's outage, timed by [`Probe`]s that
//! write through it on their own: from the fault (the switchover request, the kill) to
//! the first write it accepted again; and one with how each lease holder fared.
//! Synchronous mode must keep everything;
//! asynchronous mode prints the same and asserts only that no older term's write was
//! applied after a newer term's was acknowledged.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate_tests::faults::late_applied;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::ha::{HaCluster, Held, Holder, Outage, Probe};
use fencegate_tests::history::{self, Counts, Entry, Op, Outcome, Recorder};
use fencegate_tests::http::{kv_path, Client};
use fencegate_tests::prometheus::Prometheus;
use http::Method;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// One cluster at a time: the machine has few cores, and each cluster is seven processes.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Writer tasks per fault.
const WRITERS: u32 = 4;

/// Writes a writer sends in each term before it releases the lease.
const WRITES_PER_TERM: usize = 6;

/// The keys of each resource.
const KEYS: [&str; 2] = ["k0", "k1"];
/// The keys of the door writers' resource: rows of its fenced table.
const DOOR_KEYS: [&str; 2] = ["d0", "d1"];
/// How long a `psql` write may take, connection included.
const PSQL_TIMEOUT: Duration = Duration::from_secs(10);

/// The hosted lease's time to live: a writer that lost its gateway mid-term holds it up
/// for this long at most.
const LEASE_TTL_MS: u64 = 3_000;

/// How long writers write before the fault, and after the cluster has recovered.
const STEADY: Duration = Duration::from_secs(3);

/// How long one request may take: well above the gateways' backend deadline.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an acquire is retried (with its idempotency key) until it has an answer.
const ACQUIRE_PATIENCE: Duration = Duration::from_secs(60);

/// How long the cluster may take to have a primary again after a fault.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a partition lasts after the harness saw a new primary: the old one's
/// Patroni has given up on etcd and demoted it well before (`retry_timeout`, 4 s, is
/// below `ttl`, 10 s); the sessions the gateways had with it hang meanwhile.
const PARTITION_AFTER_FAILOVER: Duration = Duration::from_secs(5);

/// The faults, in the order a run injects them.
#[derive(Debug, Clone, Copy)]
enum Fault {
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
    fn holder_ttl(self) -> (Duration, bool) {
        match self {
            Fault::Switchover => (Duration::from_secs(15), true),
            Fault::NodeKill => (Duration::from_secs(30), true),
            Fault::PostmasterKill | Fault::EtcdRestart => (Duration::from_secs(15), false),
            Fault::PrimaryFreeze | Fault::PrimaryPartition => (Duration::from_secs(30), false),
        }
    }

    fn name(self) -> &'static str {
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
                let (primary, took) = cluster
                    .wait_for_primary_after_kill(&node, pid, RECOVERY_TIMEOUT)
                    .await;
                format!("killed {node}'s postmaster; {primary} primary after {took:.1?}")
            }
            Fault::Switchover => {
                let (old, new, took) = cluster.switchover().await;
                format!("switched over from {old} to {new} in {took:.1?}")
            }
            Fault::PrimaryFreeze => {
                let stopped = cluster.stop_primary().await;
                let (primary, took) = cluster
                    .wait_for_new_primary(&stopped.node, RECOVERY_TIMEOUT)
                    .await;
                cluster.cont(&stopped);
                format!(
                    "froze {}; {primary} primary after {took:.1?}; {} continued",
                    stopped.node, stopped.node
                )
            }
            Fault::NodeKill => {
                let old = cluster.kill_primary_node().await;
                let (primary, took) = cluster.wait_for_new_primary(&old, RECOVERY_TIMEOUT).await;
                format!("killed {old}'s Patroni and Postgres; {primary} primary after {took:.1?}")
            }
            Fault::EtcdRestart => {
                let started = Instant::now();
                cluster.restart_etcd().await;
                let (primary, _) = cluster.wait_for_primary(RECOVERY_TIMEOUT).await;
                format!(
                    "restarted etcd; {primary} primary after {:.1?}",
                    started.elapsed()
                )
            }
            Fault::PrimaryPartition => {
                let old = cluster.partition_primary().await;
                let (primary, took) = cluster.wait_for_new_primary(&old, RECOVERY_TIMEOUT).await;
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

/// What one fault's run found.
struct Summary {
    fault: Fault,
    counts: Counts,
    violations: Vec<history::Violation>,
    late_applied: usize,
    /// Answers `500 internal` (to acquires and writes): the gateway did not classify
    /// the database's error as unavailability. (A write that reached a node still in
    /// recovery was one, until `25006` was counted as an aborted statement.)
    internal: usize,
    /// Acknowledged writes whose key's final version is below theirs.
    lost: Vec<String>,
    /// Lease grants whose token an earlier grant of the same resource had too.
    tokens_twice: usize,
    /// The longest time without an acknowledged write, from the fault on.
    unavailable: Duration,
    /// From the fault, and from the moment the harness saw a primary again (negative:
    /// writes resumed before it did), to the end of the longest gap — when it was an
    /// outage ([`OUTAGE`]).
    fault_to_write: Option<f64>,
    recovery_to_write: Option<f64>,
    /// Each gateway's outage as its probe saw it, by the probe's label.
    outages: Vec<(String, Outage)>,
    /// How each gateway's lease holder fared.
    holders: Vec<Held>,
}

/// A gap between acknowledged writes at least this long is an outage; shorter ones are
/// the writers' own pace (lease turns, pauses).
const OUTAGE: Duration = Duration::from_millis(500);

impl Summary {
    fn line(&self, mode: &str) -> String {
        format!(
            "{mode:<12} {:<16} {:>5} operations {:>5} acknowledged {:>4} stale {:>4} indeterminate \
             ({:>3} of them 500) {:>2} violations {:>2} late applied {:>2} lost {:>2} tokens twice  \
             unavailable {:>5.2} s (fault -> write {}, primary seen -> write {})",
            self.fault.name(),
            self.counts.operations,
            self.counts.applied,
            self.counts.stale,
            self.counts.indeterminate,
            self.internal,
            self.violations.len(),
            self.late_applied,
            self.lost.len(),
            self.tokens_twice,
            self.unavailable.as_secs_f64(),
            seconds(self.fault_to_write),
            seconds(self.recovery_to_write),
        )
    }

    /// Each gateway's outage: from the fault to its first accepted write after the
    /// longest gap, or the longest gap alone when it was too short to be one.
    fn outages_line(&self, mode: &str) -> String {
        let outages: Vec<String> = self
            .outages
            .iter()
            .map(|(label, outage)| {
                if outage.longest_gap >= OUTAGE {
                    format!("{label} {:.2} s", outage.fault_to_write.as_secs_f64())
                } else {
                    format!(
                        "{label} none (longest gap {:.2} s)",
                        outage.longest_gap.as_secs_f64()
                    )
                }
            })
            .collect();
        format!(
            "{mode:<12} {:<16} fault -> first accepted write: {}",
            self.fault.name(),
            outages.join(", ")
        )
    }

    /// How each gateway's lease holder fared, and whether that is checked.
    fn holders_line(&self, mode: &str) -> String {
        let (ttl, checked) = self.fault.holder_ttl();
        let holders: Vec<String> = self.holders.iter().map(Held::describe).collect();
        format!(
            "{mode:<12} {:<16} lease holders, ttl {ttl:?} ({}): {}",
            self.fault.name(),
            if checked {
                "must keep their terms"
            } else {
                "not checked"
            },
            holders.join(", ")
        )
    }

    /// Where the README promises it, every holder kept its term.
    fn assert_holders_kept(&self) {
        let (ttl, checked) = self.fault.holder_ttl();
        if !checked {
            return;
        }
        for held in &self.holders {
            assert!(
                held.kept(),
                "{}: a holder of a {ttl:?} lease did not keep its term: {}\n{}",
                self.fault.name(),
                held.describe(),
                self.outages_line("outages")
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_mode_keeps_every_acknowledged_write_through_faults() {
    let _serial = SERIAL.lock().await;
    run(true, |summary| {
        let fault = summary.fault.name();
        assert!(
            summary.violations.is_empty() && summary.lost.is_empty(),
            "{fault}: {:#?}\nlost: {:#?}",
            summary.violations,
            summary.lost
        );
        assert_eq!(summary.late_applied, 0, "{fault}");
        assert_eq!(summary.internal, 0, "{fault}");
        assert_eq!(summary.tokens_twice, 0, "{fault}");
        assert!(summary.counts.applied > 0, "{fault}");
        summary.assert_holders_kept();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_mode_lets_no_older_term_in_through_faults() {
    let _serial = SERIAL.lock().await;
    run(false, |summary| {
        let fault = summary.fault.name();
        for violation in &summary.violations {
            println!("asynchronous {fault}: {violation}");
        }
        for write in &summary.lost {
            println!("asynchronous {fault}: lost {write}");
        }
        assert_eq!(summary.late_applied, 0, "{fault}");
        assert_eq!(summary.internal, 0, "{fault}");
        assert_eq!(summary.tokens_twice, 0, "{fault}");
        assert!(summary.counts.applied > 0, "{fault}");
        summary.assert_holders_kept();
    })
    .await;
}

/// Starts a cluster, checks that both gateways serve, and runs every fault in turn,
/// each one's summary checked by `check` while the cluster still runs (a failure keeps
/// its files, logs included).
async fn run(synchronous: bool, check: impl Fn(&Summary)) {
    let mode = if synchronous {
        "synchronous"
    } else {
        "asynchronous"
    };
    let started = Instant::now();
    let mut cluster = HaCluster::start(synchronous).await;
    println!("{mode}: cluster up in {:.1?}", started.elapsed());
    let patroni = cluster.node("node1").rest_url();
    let via_haproxy = gateway(&cluster.haproxy_url(), &patroni).await;
    let via_hosts = gateway(&cluster.multi_host_url(), &patroni).await;
    for (name, gateway) in [("haproxy", &via_haproxy), ("multi-host", &via_hosts)] {
        serves(&gateway.client(), &format!("smoke-{name}")).await;
    }
    // Synchronous mode is how patroni.yml bootstraps the cluster: the README's gateway
    // runs there, and must say that it is synchronously replicated.
    let as_documented = if synchronous {
        let gateway = documented_gateway(&cluster).await;
        reports_synchronous_at_start(&gateway).await;
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
        cluster.wait_until_streaming(RECOVERY_TIMEOUT).await;
        println!("{}: then {}", fault.name(), roles(&cluster).await);
    }
    for probe in probes {
        probe.stop().await;
    }
    // What the gateways read of the cluster's replication is what it is.
    let mut readers = clients.clone();
    readers.extend(as_documented.iter().map(Gateway::client));
    reports_replication(&readers, synchronous).await;
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
/// with no standby hidden from its login, and waits until its metrics say so too.
async fn reports_synchronous_at_start(gateway: &Gateway) {
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
            started.elapsed() < RECOVERY_TIMEOUT,
            "the documented gateway reports synchronous replication {synchronous:?}, \
             {standbys:?} synchronous standbys"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until each gateway reports the cluster's replication as `synchronous` says,
/// Patroni's synchronous mode likewise, and a timeline past the first (the faults
/// promoted nodes).
async fn reports_replication(clients: &[Client], synchronous: bool) {
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
                started.elapsed() < RECOVERY_TIMEOUT,
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
    let mut holders = Vec::new();
    for (n, (label, gateway)) in gateways.iter().enumerate() {
        let lease = format!("ha-holder-{suffix}-{n}");
        holders.push(Holder::start(label, &gateway.url(), &lease, ttl).await);
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
    let deadline = Instant::now() + RECOVERY_TIMEOUT;
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
                "{}: no write acknowledged within {RECOVERY_TIMEOUT:?} of the recovery ({what}); \
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
        entries.push(final_read(&clients[client % clients.len()], WRITERS, &resource, key).await);
    }
    for key in DOOR_KEYS {
        entries.push(final_row(&cluster.haproxy_url(), &table, &door_resource, key).await);
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

/// A writer: takes the resource's lease when it is free, writes a few times with its
/// token through the gateways in turn, releases it, and sends one more write with the
/// released token, as a delayed request of the old term would arrive.
struct Writer {
    client: u32,
    resource: String,
    /// The gateways' HTTP APIs: leases are taken there whatever `via` writes through.
    gateways: Vec<Client>,
    via: Via,
    recorder: Recorder,
    /// Answers `500 internal` this run's writers had.
    internal: Arc<AtomicUsize>,
    cancel: CancellationToken,
}

impl Writer {
    async fn run(self) {
        let holder = format!("writer-{}", self.client);
        let mut sent = 0usize;
        while !self.cancel.is_cancelled() {
            let Some(token) = self.acquire(&holder).await else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            for n in 0..WRITES_PER_TERM {
                if self.cancel.is_cancelled() {
                    break;
                }
                sent += 1;
                let outcome = self.write(sent, self.key(n), token).await;
                match outcome {
                    Outcome::Stale { .. } => break,
                    Outcome::Applied { .. } => {}
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            self.release(&holder, token).await;
            sent += 1;
            self.write(sent, self.key(sent), token).await;
            let pause = rand::random::<u64>() % 30;
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
    }

    fn gateway(&self, n: usize) -> &Client {
        &self.gateways[(n + self.client as usize) % self.gateways.len()]
    }

    /// The key of the `n`th write.
    fn key(&self, n: usize) -> &'static str {
        let keys: &[&'static str] = match self.via {
            Via::Http => &KEYS,
            Via::Door(_) => &DOOR_KEYS,
        };
        keys[n % keys.len()]
    }

    /// Acquires the lease, retrying with one idempotency key until the answer is known:
    /// the token, or `None` if another writer holds it. Recorded as an advance of the
    /// fence to the token, from the first attempt to the answer.
    async fn acquire(&self, holder: &str) -> Option<u64> {
        let key = format!("acquire-{holder}-{:016x}", rand::random::<u64>());
        let path = format!("/v1/leases/{}/acquire", self.resource);
        let body = json!({"holder": holder, "ttl_ms": LEASE_TTL_MS}).to_string();
        let headers = [
            ("content-type", "application/json"),
            ("idempotency-key", key.as_str()),
        ];
        let invoked = history::now();
        let started = Instant::now();
        let mut attempt = 0;
        let mut last = String::new();
        while started.elapsed() < ACQUIRE_PATIENCE {
            attempt += 1;
            let reply = tokio::time::timeout(
                REQUEST_TIMEOUT,
                self.gateway(attempt)
                    .try_request(Method::POST, &path, &headers, body.clone()),
            )
            .await;
            match reply {
                Ok(Ok(reply)) if reply.status == 200 => {
                    let token = reply.json()["token"].as_u64().expect("a granted token");
                    self.recorder.record(Entry {
                        client: self.client,
                        resource: self.resource.clone(),
                        op: Op::Advance { token },
                        invoked,
                        completed: history::now(),
                        outcome: Outcome::Applied { version: None },
                    });
                    return Some(token);
                }
                Ok(Ok(reply)) if reply.status == 409 && reply.error_code() == "lease_held" => {
                    return None;
                }
                Ok(Ok(reply))
                    if reply.status == 503 && reply.json()["write_applied"] == json!(false) =>
                {
                    if self.cancel.is_cancelled() {
                        return None;
                    }
                    last = format!("{} {:?}", reply.status, reply.body);
                }
                Ok(Ok(reply)) if matches!(reply.status, 409 | 500 | 503) => {
                    // Unknown (or still in flight): ask again with the same key.
                    if reply.status == 500 {
                        self.internal.fetch_add(1, Ordering::Relaxed);
                    }
                    last = format!("{} {:?}", reply.status, reply.body);
                }
                Ok(Ok(reply)) => panic!("acquire answered {} {:?}", reply.status, reply.body),
                Ok(Err(error)) => last = error,
                Err(_) => last = format!("no answer within {REQUEST_TIMEOUT:?}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("an acquire had no answer within {ACQUIRE_PATIENCE:?}: {last}");
    }

    /// Writes `key` with `token` and a value no other write has, through the HTTP API
    /// or a door; records and returns the outcome.
    async fn write(&self, n: usize, key: &str, token: u64) -> Outcome {
        let value = format!("{}-{n}-t{token}", self.client);
        let op = Op::Write {
            key: key.to_owned(),
            token,
            value: value.clone(),
            if_version: None,
        };
        let invoked = history::now();
        let outcome = match &self.via {
            Via::Http => self.put(n, &op).await,
            Via::Door(door) => {
                let url = &door.urls[(n + self.client as usize) % door.urls.len()];
                door.write(url, &self.resource, key, token, &value).await
            }
        };
        self.recorder.record(Entry {
            client: self.client,
            resource: self.resource.clone(),
            op,
            invoked,
            completed: history::now(),
            outcome: outcome.clone(),
        });
        outcome
    }

    /// `PUT key` through the HTTP API.
    async fn put(&self, n: usize, op: &Op) -> Outcome {
        let Op::Write {
            key, token, value, ..
        } = op
        else {
            unreachable!("a writer writes");
        };
        let token_text = token.to_string();
        let reply = tokio::time::timeout(
            REQUEST_TIMEOUT,
            self.gateway(n).try_request(
                Method::PUT,
                &kv_path(&self.resource, key),
                &[("fencing-token", &token_text)],
                value.clone(),
            ),
        )
        .await;
        match reply {
            Ok(Ok(reply)) => {
                if reply.status == 500 {
                    self.internal.fetch_add(1, Ordering::Relaxed);
                }
                history::outcome_of(
                    op,
                    reply.status,
                    &String::from_utf8_lossy(&reply.body),
                    None,
                )
                .unwrap_or_else(|e| panic!("a write: {e}"))
            }
            Ok(Err(_)) | Err(_) => Outcome::Indeterminate,
        }
    }

    /// Releases the lease, once; if that fails, the lease expires.
    async fn release(&self, holder: &str, token: u64) {
        let path = format!("/v1/leases/{}/release", self.resource);
        let body = json!({"holder": holder, "token": token}).to_string();
        let _ = tokio::time::timeout(
            REQUEST_TIMEOUT,
            self.gateway(0).try_request(
                Method::POST,
                &path,
                &[("content-type", "application/json")],
                body,
            ),
        )
        .await;
    }
}

/// A read of `key` once the writers are done, retried until the gateway answers it.
async fn final_read(gateway: &Client, client: u32, resource: &str, key: &str) -> Entry {
    let op = Op::Read {
        key: key.to_owned(),
    };
    let started = Instant::now();
    loop {
        let invoked = history::now();
        let reply = gateway
            .try_request(Method::GET, &kv_path(resource, key), &[], "")
            .await;
        if let Ok(reply) = reply {
            let outcome = history::outcome_of(
                &op,
                reply.status,
                &String::from_utf8_lossy(&reply.body),
                reply.header("etag"),
            )
            .unwrap_or_else(|e| panic!("the final read of {key}: {e}"));
            if let Outcome::Read { .. } = outcome {
                return Entry {
                    client,
                    resource: resource.to_owned(),
                    op,
                    invoked,
                    completed: history::now(),
                    outcome,
                };
            }
        }
        assert!(
            started.elapsed() < RECOVERY_TIMEOUT,
            "{key} is not readable after the fault"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Grants (acquires answered with a token) of a resource whose token was granted
/// before: a token issued twice.
fn tokens_twice(entries: &[Entry]) -> usize {
    let mut granted = BTreeSet::new();
    entries
        .iter()
        .filter_map(|entry| match (&entry.op, &entry.outcome) {
            (Op::Advance { token }, Outcome::Applied { .. }) => Some((&entry.resource, *token)),
            _ => None,
        })
        .filter(|grant| !granted.insert(*grant))
        .count()
}

fn is_acknowledged_write(entry: &Entry) -> bool {
    matches!(entry.op, Op::Write { .. }) && matches!(entry.outcome, Outcome::Applied { .. })
}

fn acknowledged_after(entries: &[Entry], instant: u64) -> bool {
    entries
        .iter()
        .any(|entry| is_acknowledged_write(entry) && entry.invoked >= instant)
}

/// Acknowledged writes whose version is above the final read of their key: writes the
/// cluster lost. (The checker finds these too; this names them plainly.)
fn lost(entries: &[Entry]) -> Vec<String> {
    let final_version = |key: &str| {
        entries
            .iter()
            .rev()
            .find_map(|entry| match (&entry.op, &entry.outcome) {
                (Op::Read { key: read }, Outcome::Read { version, .. }) if read == key => {
                    Some(version.unwrap_or(0))
                }
                _ => None,
            })
    };
    entries
        .iter()
        .filter(|entry| is_acknowledged_write(entry))
        .filter(|entry| {
            let (Op::Write { key, .. }, Outcome::Applied { version }) = (&entry.op, &entry.outcome)
            else {
                return false;
            };
            version.unwrap_or(0) > final_version(key).unwrap_or(0)
        })
        .map(Entry::describe)
        .collect()
}

/// The longest time between two acknowledged writes' answers, counted from `fault_at`
/// (the last answer before it opens the first gap), and when that gap closed.
fn longest_gap(entries: &[Entry], fault_at: u64) -> (Duration, u64) {
    let answers = entries
        .iter()
        .filter(|entry| is_acknowledged_write(entry))
        .map(|entry| entry.completed)
        .collect();
    fencegate_tests::ha::longest_gap(answers, fault_at)
}

fn seconds_between(from: u64, to: u64) -> f64 {
    (to as f64 - from as f64) / 1e9
}

fn seconds(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |s| format!("{s:.2} s"))
}

/// How a writer writes.
enum Via {
    /// `PUT /v1/kv/...` on the gateways' HTTP APIs.
    Http,
    /// Rows of a fenced table, through the gateways' Postgres doors.
    Door(Door),
}

/// A fenced table written through the doors.
struct Door {
    /// The doors' URLs, taken in turn.
    urls: Vec<String>,
    table: String,
    /// Each write a `psql` process of its own; else a tokio-postgres session.
    psql: bool,
}

/// The transaction of one write: the token first, then the row, its new version
/// returned.
fn door_transaction(table: &str, resource: &str, key: &str, token: u64, value: &str) -> String {
    format!(
        "BEGIN; SELECT fencegate.fence('{resource}', {token}); \
         UPDATE {table} SET value = '{value}', version = version + 1 WHERE key = '{key}' \
         RETURNING version; COMMIT;"
    )
}

impl Door {
    async fn write(
        &self,
        url: &str,
        resource: &str,
        key: &str,
        token: u64,
        value: &str,
    ) -> Outcome {
        let sql = door_transaction(&self.table, resource, key, token, value);
        if self.psql {
            return psql_write(url, &sql).await;
        }
        let connected = tokio::time::timeout(
            REQUEST_TIMEOUT,
            tokio_postgres::connect(url, tokio_postgres::NoTls),
        )
        .await;
        let Ok(Ok((session, connection))) = connected else {
            // No session: nothing was sent.
            return Outcome::NotApplied;
        };
        tokio::spawn(connection);
        match tokio::time::timeout(REQUEST_TIMEOUT, session.simple_query(&sql)).await {
            Ok(Ok(messages)) => {
                // The last row is the UPDATE's (the first, fence()'s).
                let version = messages.iter().rev().find_map(|message| match message {
                    tokio_postgres::SimpleQueryMessage::Row(row) => {
                        row.get(0).and_then(|v| v.parse::<u64>().ok())
                    }
                    _ => None,
                });
                match version {
                    Some(version) => Outcome::Applied {
                        version: Some(version),
                    },
                    None => panic!("the door's write of {key} returned no version"),
                }
            }
            Ok(Err(error)) => match error.code() {
                Some(code) if code.code() == "ZF001" => Outcome::Stale { highest: None },
                // The server refused a statement: the transaction rolled back.
                Some(_) => Outcome::NotApplied,
                // The session broke: COMMIT may have been sent.
                None => Outcome::Indeterminate,
            },
            Err(_) => Outcome::Indeterminate,
        }
    }
}

/// One write by `psql`: its exit status and SQLSTATE say what happened (2: the
/// connection failed or broke, and the transaction may have committed).
async fn psql_write(url: &str, sql: &str) -> Outcome {
    let run = tokio::process::Command::new("psql")
        .args([
            url,
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-v",
            "VERBOSITY=verbose",
            "-c",
            sql,
        ])
        .env("PGCONNECT_TIMEOUT", "5")
        .kill_on_drop(true)
        .output();
    let Ok(Ok(output)) = tokio::time::timeout(PSQL_TIMEOUT, run).await else {
        return Outcome::Indeterminate;
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    match output.status.code() {
        Some(0) => {
            let version = stdout
                .lines()
                .rev()
                .find_map(|line| line.trim().parse::<u64>().ok())
                .unwrap_or_else(|| panic!("psql's write returned no version: {stdout}"));
            Outcome::Applied {
                version: Some(version),
            }
        }
        Some(1) | Some(3) if stderr.contains("ERROR:  ZF001") => Outcome::Stale { highest: None },
        // The server refused a statement: the transaction rolled back.
        Some(1) | Some(3) => Outcome::NotApplied,
        _ => Outcome::Indeterminate,
    }
}

/// The door's URL of `gateway`: the superuser of `superuser_url` at its door.
fn door_url(superuser_url: &str, gateway: &Gateway) -> String {
    let rest = superuser_url
        .strip_prefix("postgres://")
        .expect("a postgres:// URL");
    let (userinfo, after) = rest.split_once('@').expect("a user and password");
    let database = after.split_once('/').map_or("postgres", |(_, db)| db);
    format!("postgres://{userinfo}@{}/{database}", gateway.pg_addr())
}

/// A fenced table of `resource` with a row for each of [`DOOR_KEYS`] at version 0.
async fn fenced_table(superuser_url: &str, resource: &str) -> String {
    let table = format!("door_{:08x}", rand::random::<u32>());
    let (admin, connection) = tokio_postgres::connect(superuser_url, tokio_postgres::NoTls)
        .await
        .expect("the superuser connects through HAProxy");
    tokio::spawn(connection);
    admin
        .batch_execute(&format!(
            "CREATE TABLE {table} (key text PRIMARY KEY, value text, version bigint NOT NULL);
             INSERT INTO {table} VALUES ('{}', NULL, 0), ('{}', NULL, 0);",
            DOOR_KEYS[0], DOOR_KEYS[1]
        ))
        .await
        .expect("the door's table is created");
    fencegate_gateway::admin::protect(&admin, &table, resource)
        .await
        .expect("the door's table is protected");
    table
}

/// The row of `key` once the writers are done, read directly through HAProxy until the
/// primary answers.
async fn final_row(superuser_url: &str, table: &str, resource: &str, key: &str) -> Entry {
    let started = Instant::now();
    loop {
        let invoked = history::now();
        if let Ok(Ok((client, connection))) = tokio::time::timeout(
            REQUEST_TIMEOUT,
            tokio_postgres::connect(superuser_url, tokio_postgres::NoTls),
        )
        .await
        {
            tokio::spawn(connection);
            let row = client
                .query_one(
                    &format!("SELECT value, version FROM {table} WHERE key = $1"),
                    &[&key],
                )
                .await;
            if let Ok(row) = row {
                let version: i64 = row.get(1);
                let value: Option<String> = row.get(0);
                let outcome = if version == 0 {
                    Outcome::Read {
                        value: None,
                        version: None,
                    }
                } else {
                    Outcome::Read {
                        value,
                        version: Some(version as u64),
                    }
                };
                return Entry {
                    client: WRITERS + 2,
                    resource: resource.to_owned(),
                    op: Op::Read {
                        key: key.to_owned(),
                    },
                    invoked,
                    completed: history::now(),
                    outcome,
                };
            }
        }
        assert!(
            started.elapsed() < RECOVERY_TIMEOUT,
            "{key} of {table} is not readable after the fault"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The alert rules, as deployed.
const ALERTS: &str = include_str!("../../dashboards/alerts.yml");

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
    let (primary, _) = cluster.wait_for_primary(RECOVERY_TIMEOUT).await;
    let replication = cluster.stop_replication(&primary);
    let lost = grant(&a.client(), &resource, "lost").await;
    // Frozen whole, its WAL senders with it: they send nothing until it continues.
    let frozen = cluster.stop_primary().await;
    let (promoted, took) = cluster
        .wait_for_new_primary(&frozen.node, RECOVERY_TIMEOUT)
        .await;
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
            started.elapsed() < RECOVERY_TIMEOUT,
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
    cluster.wait_until_streaming(RECOVERY_TIMEOUT).await;
}

/// A hosted lease granted to `holder`, retried until granted: its token.
async fn grant(client: &Client, resource: &str, holder: &str) -> u64 {
    let started = Instant::now();
    loop {
        if let Some(token) = try_grant(client, resource, holder).await {
            return token;
        }
        assert!(
            started.elapsed() < RECOVERY_TIMEOUT,
            "{holder} was never granted {resource}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn try_grant(client: &Client, resource: &str, holder: &str) -> Option<u64> {
    let reply = client
        .try_request(
            Method::POST,
            &format!("/v1/leases/{resource}/acquire"),
            &[("content-type", "application/json")],
            json!({"holder": holder, "ttl_ms": LEASE_TTL_MS}).to_string(),
        )
        .await
        .ok()?;
    (reply.status == 200).then(|| reply.json()["token"].as_u64().expect("a token"))
}
