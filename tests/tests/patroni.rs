//! The gateway on a real Postgres HA cluster: Patroni with etcd, behind HAProxy
//! (`deploy/patroni/`), started by the test ([`HaCluster`]).
//!
//! Two gateways serve one cluster, one through HAProxy and one with a multi-host URL
//! (`target_session_attrs=read-write`). Writers take turns holding the gateway's hosted
//! lease of a resource and write with its token, through both gateways, while a fault
//! hits the cluster: kill -9 of the primary's postmaster, a switchover, the primary
//! frozen (SIGSTOP) until another node is promoted, a restart of etcd, the primary cut
//! off from the network until another node is promoted. Then every key is read once
//! more and the history is checked for
//! linearizability against a fenced register ([`history::check`]): every acknowledged
//! write is there, and no write of an older term got in after a newer term's.
//!
//! Acquires are sent with an `Idempotency-Key` and retried with it until answered, so
//! every term's token is known (an acquire raises the fence). Writes are not retried:
//! an answer that does not say whether a write was applied (`503` with
//! `write_applied: null`, a broken connection) is indeterminate in the history.
//!
//! Each fault prints one line: operations, acknowledged, indeterminate, violations, and
//! how long writes were unavailable (`cargo test -p fencegate-tests --test patroni --
//! --nocapture`). Synchronous mode must keep everything; asynchronous mode prints the
//! same and asserts only that no older term's write was applied after a newer term's
//! was acknowledged.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate_tests::faults::late_applied;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::ha::HaCluster;
use fencegate_tests::history::{self, Counts, Entry, Op, Outcome, Recorder};
use fencegate_tests::http::{kv_path, Client};
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
}

impl Fault {
    const ALL: [Fault; 5] = [
        Fault::PostmasterKill,
        Fault::Switchover,
        Fault::PrimaryFreeze,
        Fault::EtcdRestart,
        Fault::PrimaryPartition,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::PostmasterKill => "postmaster-kill",
            Fault::Switchover => "switchover",
            Fault::PrimaryFreeze => "primary-freeze",
            Fault::EtcdRestart => "etcd-restart",
            Fault::PrimaryPartition => "primary-partition",
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
    /// The longest time without an acknowledged write, from the fault on.
    unavailable: Duration,
    /// From the fault, and from the moment the harness saw a primary again (negative:
    /// writes resumed before it did), to the end of the longest gap — when it was an
    /// outage ([`OUTAGE`]).
    fault_to_write: Option<f64>,
    recovery_to_write: Option<f64>,
}

/// A gap between acknowledged writes at least this long is an outage; shorter ones are
/// the writers' own pace (lease turns, pauses).
const OUTAGE: Duration = Duration::from_millis(500);

impl Summary {
    fn line(&self, mode: &str) -> String {
        format!(
            "{mode:<12} {:<16} {:>5} operations {:>5} acknowledged {:>4} stale {:>4} indeterminate \
             ({:>3} of them 500) {:>2} violations {:>2} late applied {:>2} lost  \
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
            self.unavailable.as_secs_f64(),
            seconds(self.fault_to_write),
            seconds(self.recovery_to_write),
        )
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
        assert!(summary.counts.applied > 0, "{fault}");
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
        assert!(summary.counts.applied > 0, "{fault}");
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
    let via_haproxy = gateway(&cluster.haproxy_url()).await;
    let via_hosts = gateway(&cluster.multi_host_url()).await;
    for (name, gateway) in [("haproxy", &via_haproxy), ("multi-host", &via_hosts)] {
        serves(&gateway.client(), &format!("smoke-{name}")).await;
    }
    let clients = vec![via_haproxy.client(), via_hosts.client()];
    let mut logged = BTreeSet::new();
    for fault in Fault::ALL {
        let summary = run_fault(&mut cluster, &clients, fault).await;
        println!("{}", summary.line(mode));
        for (name, gateway) in [("haproxy", &via_haproxy), ("multi-host", &via_hosts)] {
            for error in logged_errors(gateway) {
                if logged.insert((name, error.clone())) {
                    println!("{mode} {}: the {name} gateway logged {error}", fault.name());
                }
            }
        }
        check(&summary);
        cluster.wait_until_streaming(RECOVERY_TIMEOUT).await;
        println!("{}: then {}", fault.name(), roles(&cluster).await);
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

/// A gateway on `url` with a backend deadline well below the writers' patience.
async fn gateway(url: &str) -> Gateway {
    Gateway::builder()
        .database(url)
        .args(&["--pg-listen", "off", "--backend-timeout", "2s"])
        .spawn()
        .await
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

/// Writers write while `fault` is injected; then the keys are read and the history
/// checked.
async fn run_fault(cluster: &mut HaCluster, clients: &[Client], fault: Fault) -> Summary {
    let resource = format!("ha-{}-{:08x}", fault.name(), rand::random::<u32>());
    let recorder = Recorder::new();
    let internal = Arc::new(AtomicUsize::new(0));
    let cancel = CancellationToken::new();
    let writers: Vec<_> = (0..WRITERS)
        .map(|client| {
            let writer = Writer {
                client,
                resource: resource.clone(),
                gateways: clients.to_vec(),
                recorder: recorder.clone(),
                internal: Arc::clone(&internal),
                cancel: cancel.clone(),
            };
            tokio::spawn(writer.run())
        })
        .collect();
    tokio::time::sleep(STEADY).await;

    let before = roles(cluster).await;
    let fault_at = history::now();
    let (what, primary_seen) = fault.inject(cluster).await;
    let recovered_at = primary_seen.unwrap_or_else(history::now);
    // Write on until some write after the recovery was acknowledged, and a while more.
    let deadline = Instant::now() + RECOVERY_TIMEOUT;
    while !acknowledged_after(&recorder.entries(), recovered_at) {
        if Instant::now() > deadline {
            cancel.cancel();
            cluster.fail(&format!(
                "{}: no write acknowledged within {RECOVERY_TIMEOUT:?} of the recovery ({what})",
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
    println!("{}: {before}; {what}", fault.name());

    let mut entries = recorder.entries();
    for (client, key) in KEYS.iter().enumerate() {
        entries.push(final_read(&clients[client % clients.len()], WRITERS, &resource, key).await);
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
        unavailable,
        fault_to_write: outage.then(|| seconds_between(fault_at, resumed)),
        recovery_to_write: outage.then(|| seconds_between(recovered_at, resumed)),
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
    gateways: Vec<Client>,
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
                let outcome = self.write(sent, KEYS[n % KEYS.len()], token).await;
                match outcome {
                    Outcome::Stale { .. } => break,
                    Outcome::Applied { .. } => {}
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            self.release(&holder, token).await;
            sent += 1;
            self.write(sent, KEYS[sent % KEYS.len()], token).await;
            let pause = rand::random::<u64>() % 30;
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
    }

    fn gateway(&self, n: usize) -> &Client {
        &self.gateways[(n + self.client as usize) % self.gateways.len()]
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

    /// `PUT key` with `token` and a value no other write has; records and returns the
    /// outcome.
    async fn write(&self, n: usize, key: &str, token: u64) -> Outcome {
        let value = format!("{}-{n}-t{token}", self.client);
        let op = Op::Write {
            key: key.to_owned(),
            token,
            value: value.clone(),
            if_version: None,
        };
        let token_text = token.to_string();
        let invoked = history::now();
        let reply = tokio::time::timeout(
            REQUEST_TIMEOUT,
            self.gateway(n).try_request(
                Method::PUT,
                &kv_path(&self.resource, key),
                &[("fencing-token", &token_text)],
                value,
            ),
        )
        .await;
        let completed = history::now();
        let outcome = match reply {
            Ok(Ok(reply)) => history::outcome_of(
                &op,
                reply.status,
                &String::from_utf8_lossy(&reply.body),
                None,
            )
            .unwrap_or_else(|e| panic!("a write: {e}")),
            Ok(Err(_)) | Err(_) => Outcome::Indeterminate,
        };
        self.recorder.record(Entry {
            client: self.client,
            resource: self.resource.clone(),
            op,
            invoked,
            completed,
            outcome: outcome.clone(),
        });
        outcome
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
    let mut answers: Vec<u64> = entries
        .iter()
        .filter(|entry| is_acknowledged_write(entry))
        .map(|entry| entry.completed)
        .collect();
    answers.sort_unstable();
    let first = answers
        .partition_point(|&at| at < fault_at)
        .saturating_sub(1);
    answers[first..]
        .windows(2)
        .map(|pair| (pair[1] - pair[0], pair[1]))
        .max()
        .map_or((Duration::ZERO, fault_at), |(gap, end)| {
            (Duration::from_nanos(gap), end)
        })
}

fn seconds_between(from: u64, to: u64) -> f64 {
    (to as f64 - from as f64) / 1e9
}

fn seconds(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |s| format!("{s:.2} s"))
}
