//! A lease-holding writer as a process of its own (`fencegate-faults writer`), so that
//! a fault run can freeze it with SIGSTOP the way a GC pause freezes a leader.
//!
//! # Behavior
//!
//! The writer competes for the lease named after its resource in the seed's
//! `leader_lease` table ([`PostgresStore`]), or in an etcd or ZooKeeper election
//! (`--lease-source`). Holding it at epoch `t`, it first raises
//! the resource's fence to `t` through the gateway, then loops: check that it still
//! leads (on its own clock), renew when due, think for [`THINK`], then send `lanes`
//! operations at once — writes with token `t`, now and then a read — so that several
//! of a term's writes commit together. Requests go to the gateways in turn. A stale
//! rejection, a renewal the store refuses, or its renew deadline passing ends the term;
//! it then competes again. After [`TERM_LIMIT`] leases of leading, it hands the lease
//! back and waits a lease before competing again, so that leadership keeps changing
//! hands.
//!
//! A pause while thinking is the interesting case: the write was decided under the
//! old term and goes out when the process wakes, after a rival has taken over. A pause
//! from outside (SIGSTOP) lands wherever the process happens to be, often in the middle
//! of an exchange whose write the gateway applies at once; so the writer also pauses
//! itself on request: after SIGUSR1, it stops itself (SIGSTOP to its own process) as
//! soon as its next batch is decided, and sends that batch when it is continued.
//!
//! # Its clock
//!
//! Every duration the writer measures or waits for runs through [`Clock`] at `rate`
//! times real speed. A slow clock (`rate < 1`) renews late and believes it leads long
//! after its lease expired: a writer whose timer lies. A fast one steps down early.
//! The machine's clock is never touched.
//!
//! # Its output
//!
//! One JSON line per operation on stdout before the request is sent (its outcome
//! indeterminate), and one when its answer is known, both with the operation's
//! sequence number: a writer that dies in between leaves an indeterminate operation
//! in the history, never a missing one. It stops when its stdin closes, after the
//! operation in flight.
//!
//! # Fencing off
//!
//! With `--unfenced` (the control run), the writer records its term's token in the
//! history but presents token 1 to the gateway and never advances the fence: the
//! gateway then applies whatever arrives, as a database without a fence would.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate_lease::{EtcdStore, LeaseStore, PostgresStore, ZooKeeperStore};
use rand::Rng;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::signal::unix::SignalKind;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::history::{self, Entry, Op, Outcome};
use crate::replay::wire::{self, Request};

/// The lease table, in the lease database.
pub const LEASE_TABLE: &str = "leader_lease";

/// The work a writer does between deciding to write and sending the write.
pub const THINK: Duration = Duration::from_millis(20);

/// How many lease durations (on its own clock) a writer leads before handing over.
pub const TERM_LIMIT: u32 = 4;

/// How long a writer waits for any one answer before it counts as indeterminate.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// One in this many operations is a read.
const READ_EVERY: u32 = 8;

/// How many times a write or an advance is sent in all while its answer leaves it in
/// doubt (no answer, `503` with `write_applied: null`); every attempt carries the same
/// `Idempotency-Key`, so the attempts are one operation of the history.
const ATTEMPTS: u32 = 3;

/// The pause before a write in doubt is sent again.
const RETRY_AFTER: Duration = Duration::from_millis(100);

/// Where the writers' leases live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseSource {
    /// The seed's `leader_lease` table.
    Postgres,
    /// An etcd election; the token is the leading key's create revision.
    Etcd,
    /// A ZooKeeper election; the token is the leading node's czxid.
    Zookeeper,
}

impl LeaseSource {
    pub fn name(self) -> &'static str {
        match self {
            LeaseSource::Postgres => "postgres",
            LeaseSource::Etcd => "etcd",
            LeaseSource::Zookeeper => "zookeeper",
        }
    }
}

/// A writer process's settings (`fencegate-faults writer --help`).
#[derive(clap::Args, Debug, Clone)]
pub struct WriterArgs {
    /// Gateway addresses (`host:port`), used in turn.
    #[arg(long = "gateway", value_delimiter = ',', required = true)]
    pub gateways: Vec<SocketAddr>,
    /// Where the lease lives.
    #[arg(long, value_enum, default_value_t = LeaseSource::Postgres)]
    pub lease_source: LeaseSource,
    /// Postgres with the `leader_lease` table (source `postgres`); the lease's row must
    /// exist.
    #[arg(long, default_value = "")]
    pub lease_database_url: String,
    /// etcd (source `etcd`), `host:port`.
    #[arg(long, default_value = "")]
    pub etcd_endpoint: String,
    /// ZooKeeper (source `zookeeper`), `host:port`; the session timeout is `--ttl`.
    #[arg(long, default_value = "")]
    pub zookeeper_connect: String,
    /// The resource written, and the name of its lease.
    #[arg(long)]
    pub resource: String,
    /// This writer's lease holder identity.
    #[arg(long)]
    pub holder: String,
    /// This writer's client number in the history.
    #[arg(long)]
    pub client: u32,
    /// The lease's duration; renewed every third of it, given up after two thirds.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// How fast this writer's clock runs against the real one.
    #[arg(long, default_value_t = 1.0)]
    pub clock_rate: f64,
    /// Keys written, `k0`, `k1`, ...
    #[arg(long, default_value_t = 2)]
    pub keys: usize,
    /// Operations sent at once.
    #[arg(long, default_value_t = 1)]
    pub lanes: usize,
    /// Present token 1 instead of the term's token, and never advance the fence.
    #[arg(long)]
    pub unfenced: bool,
    /// Send writes without an Idempotency-Key, and never again once in doubt.
    #[arg(long)]
    pub unkeyed: bool,
}

impl WriterArgs {
    fn to_args(&self) -> Vec<String> {
        let gateways: Vec<String> = self.gateways.iter().map(ToString::to_string).collect();
        let mut args = vec![
            "writer".to_owned(),
            "--gateway".to_owned(),
            gateways.join(","),
            "--lease-source".to_owned(),
            self.lease_source.name().to_owned(),
            "--lease-database-url".to_owned(),
            self.lease_database_url.clone(),
            "--etcd-endpoint".to_owned(),
            self.etcd_endpoint.clone(),
            "--zookeeper-connect".to_owned(),
            self.zookeeper_connect.clone(),
            "--resource".to_owned(),
            self.resource.clone(),
            "--holder".to_owned(),
            self.holder.clone(),
            "--client".to_owned(),
            self.client.to_string(),
            "--ttl".to_owned(),
            format!("{}ms", self.ttl.as_millis()),
            "--clock-rate".to_owned(),
            self.clock_rate.to_string(),
            "--keys".to_owned(),
            self.keys.to_string(),
            "--lanes".to_owned(),
            self.lanes.to_string(),
        ];
        if self.unfenced {
            args.push("--unfenced".to_owned());
        }
        if self.unkeyed {
            args.push("--unkeyed".to_owned());
        }
        args
    }
}

/// A writer's clock, `rate` times real speed.
#[derive(Debug, Clone, Copy)]
struct Clock {
    rate: f64,
}

impl Clock {
    /// Time since `since`, as this clock tells it.
    fn elapsed(self, since: Instant) -> Duration {
        since.elapsed().mul_f64(self.rate)
    }

    /// Waits until this clock has counted `duration`.
    async fn sleep(self, duration: Duration) {
        tokio::time::sleep(duration.div_f64(self.rate)).await;
    }
}

/// One line of a writer's output.
#[derive(Serialize, Deserialize)]
struct Line {
    seq: u64,
    entry: Entry,
}

/// The writer process's main loop; returns when stdin closes.
pub async fn run(args: WriterArgs) -> Result<(), String> {
    match args.lease_source {
        LeaseSource::Postgres => {
            let store = PostgresStore::new(&args.lease_database_url, LEASE_TABLE, false)
                .map_err(|e| e.to_string())?;
            run_on(store, args).await
        }
        LeaseSource::Etcd => {
            let prefix = fencegate_lease::store::etcd::DEFAULT_PREFIX;
            let store = EtcdStore::connect(std::slice::from_ref(&args.etcd_endpoint), prefix)
                .await
                .map_err(|e| e.to_string())?;
            run_on(store, args).await
        }
        LeaseSource::Zookeeper => {
            let prefix = fencegate_lease::store::zookeeper::DEFAULT_PREFIX;
            let store = ZooKeeperStore::new(&args.zookeeper_connect, prefix, args.ttl)
                .map_err(|e| e.to_string())?;
            run_on(store, args).await
        }
    }
}

async fn run_on<S: LeaseStore>(store: S, args: WriterArgs) -> Result<(), String> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    // Blocks a thread of its own until stdin closes.
    tokio::task::spawn_blocking(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        flag.store(true, Ordering::SeqCst);
    });
    let pause = Arc::new(AtomicBool::new(false));
    let mut requests = tokio::signal::unix::signal(SignalKind::user_defined1())
        .map_err(|e| format!("cannot listen for SIGUSR1: {e}"))?;
    let flag = Arc::clone(&pause);
    tokio::spawn(async move {
        while requests.recv().await.is_some() {
            flag.store(true, Ordering::SeqCst);
        }
    });
    let mut writer = Writer {
        clock: Clock {
            rate: args.clock_rate,
        },
        args,
        seq: 0,
        next_gateway: 0,
        stop,
        pause,
    };
    while !writer.stopped() {
        let sent = Instant::now();
        match store
            .acquire(&writer.args.resource, &writer.args.holder, writer.args.ttl)
            .await
        {
            Ok(Some(token)) => {
                writer.lead(&store, token.get(), sent).await;
                // A pause asked for near a term's end is not carried into the next.
                writer.pause.store(false, Ordering::SeqCst);
            }
            Ok(None) | Err(_) => writer.clock.sleep(writer.args.ttl / 4).await,
        }
    }
    Ok(())
}

struct Writer {
    args: WriterArgs,
    clock: Clock,
    seq: u64,
    next_gateway: usize,
    stop: Arc<AtomicBool>,
    /// Set by SIGUSR1: stop this process once the next batch is decided.
    pause: Arc<AtomicBool>,
}

impl Writer {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Leads the term of `token`, whose lease was granted by a call sent at `renewed`.
    async fn lead<S: LeaseStore>(&mut self, store: &S, token: u64, mut renewed: Instant) {
        let (renew_every, deadline) = (self.args.ttl / 3, self.args.ttl * 2 / 3);
        if !self.args.unfenced
            && !matches!(
                self.op(Op::Advance { token }).await,
                Outcome::Applied { .. }
            )
        {
            return;
        }
        let mut last_renewal = renewed;
        let began = renewed;
        // Operations until the next read.
        let mut until_read = READ_EVERY;
        while !self.stopped() {
            if self.clock.elapsed(renewed) >= deadline {
                return;
            }
            if self.clock.elapsed(began) >= self.args.ttl * TERM_LIMIT {
                let (lease, holder) = (&self.args.resource, &self.args.holder);
                let epoch = token.try_into().expect("the store's epochs are tokens");
                let _ = store.release(lease, holder, epoch).await;
                self.clock.sleep(self.args.ttl).await;
                return;
            }
            if self.clock.elapsed(last_renewal) >= renew_every {
                let sent = Instant::now();
                last_renewal = sent;
                let lease = (&self.args.resource, &self.args.holder);
                let epoch = token.try_into().expect("the store's epochs are tokens");
                match store.renew(lease.0, lease.1, epoch, self.args.ttl).await {
                    Ok(true) => renewed = sent,
                    Ok(false) => return,
                    Err(_) => {}
                }
                continue;
            }
            tokio::time::sleep(THINK).await;
            // The batch is decided here, under this term; each operation is invoked
            // (recorded) when it is sent.
            let mut decided = Vec::new();
            for _ in 0..self.args.lanes.max(1) {
                until_read -= 1;
                let key = format!("k{}", rand::rng().random_range(0..self.args.keys));
                let op = if until_read == 0 {
                    until_read = READ_EVERY;
                    Op::Read { key }
                } else {
                    // The sequence number `prepare` gives it, which makes it unique.
                    let seq = self.seq + decided.len() as u64;
                    let value = format!("{}-t{token}-{seq}", self.args.holder);
                    Op::Write {
                        key,
                        token,
                        value,
                        if_version: None,
                    }
                };
                decided.push(op);
            }
            if self.pause.swap(false, Ordering::SeqCst) {
                // Frozen with the batch decided, as a GC pause would.
                crate::gateway::signal(std::process::id(), "STOP");
            }
            let batch: Vec<Prepared> = decided.into_iter().map(|op| self.prepare(op)).collect();
            let outcomes = futures_util::future::join_all(batch.into_iter().map(exchange)).await;
            if outcomes
                .iter()
                .any(|outcome| matches!(outcome, Outcome::Stale { .. }))
            {
                return;
            }
        }
    }

    /// Sends one operation to the next gateway, recording it before and after.
    async fn op(&mut self, op: Op) -> Outcome {
        exchange(self.prepare(op)).await
    }

    /// Records one operation as invoked, and picks its gateway.
    fn prepare(&mut self, op: Op) -> Prepared {
        let resource = &self.args.resource;
        let entry = Entry {
            client: self.args.client,
            resource: resource.clone(),
            op,
            invoked: history::now(),
            completed: 0,
            outcome: Outcome::Indeterminate,
        };
        let seq = self.seq;
        self.seq += 1;
        emit(seq, &entry);
        let presented = |token: u64| if self.args.unfenced { 1 } else { token };
        let request = match &entry.op {
            Op::Write {
                key, token, value, ..
            } => Request::put(
                &crate::http::kv_path(resource, key),
                presented(*token),
                &self.args.holder,
                &format!("{}-{seq}", self.args.holder),
                value,
            ),
            Op::Read { key } => Request::get(&crate::http::kv_path(resource, key)),
            Op::Advance { token } => Request {
                method: "POST".into(),
                path: crate::http::advance_path(resource),
                headers: vec![("fencing-token".into(), presented(*token).to_string())],
                body: String::new(),
            },
            Op::Delete { .. } => unreachable!("the writer does not delete"),
        };
        let addr = self.args.gateways[self.next_gateway % self.args.gateways.len()];
        self.next_gateway += 1;
        let keyed = !self.args.unkeyed && !matches!(entry.op, Op::Read { .. });
        let (request, attempts) = match keyed {
            true => {
                let key = format!("{}-{}-{seq}", self.args.holder, std::process::id());
                (request.header("idempotency-key", &key), ATTEMPTS)
            }
            false => (request, 1),
        };
        Prepared {
            seq,
            entry,
            addr,
            request,
            attempts,
        }
    }
}

/// An operation recorded as invoked, about to be sent.
struct Prepared {
    seq: u64,
    entry: Entry,
    addr: SocketAddr,
    request: Request,
    /// How many times it is sent in all while its answer leaves it in doubt.
    attempts: u32,
}

/// Sends a prepared operation — again, with the same key, while it is in doubt and it
/// has attempts left — and records its outcome: one operation, from its first sending
/// to its last answer.
async fn exchange(prepared: Prepared) -> Outcome {
    let Prepared {
        seq,
        mut entry,
        addr,
        request,
        attempts,
    } = prepared;
    let mut in_doubt = false;
    for attempt in 1..=attempts {
        match attempt_once(&entry, addr, &request).await {
            Outcome::Indeterminate => in_doubt = true,
            // A later attempt refused says nothing of an earlier one in doubt.
            Outcome::NotApplied if in_doubt => {}
            definite => {
                entry.outcome = definite;
                in_doubt = false;
                break;
            }
        }
        if attempt < attempts {
            tokio::time::sleep(RETRY_AFTER).await;
        }
    }
    if in_doubt {
        entry.outcome = Outcome::Indeterminate;
    }
    entry.completed = history::now();
    emit(seq, &entry);
    entry.outcome
}

/// One sending of an operation, and what its answer says.
async fn attempt_once(entry: &Entry, addr: SocketAddr, request: &Request) -> Outcome {
    let answer = tokio::time::timeout(REQUEST_TIMEOUT, wire::send_one(addr, request)).await;
    match answer {
        Ok(Ok(reply)) => {
            history::outcome_of(&entry.op, reply.status, &reply.body, reply.etag.as_deref())
                .unwrap_or_else(|unexpected| {
                    eprintln!("writer of {}: {unexpected}", entry.resource);
                    Outcome::Indeterminate
                })
        }
        // Refused before anything was sent: certainly not applied.
        Ok(Err(error)) if error.starts_with("connect ") => Outcome::NotApplied,
        Ok(Err(_)) | Err(_) => match entry.op {
            Op::Read { .. } => Outcome::NotApplied,
            _ => Outcome::Indeterminate,
        },
    }
}

fn emit(seq: u64, entry: &Entry) {
    use std::io::Write;
    let line = serde_json::to_string(&Line {
        seq,
        entry: entry.clone(),
    })
    .expect("entries serialise");
    let mut stdout = std::io::stdout().lock();
    // A parent that stopped reading has stopped the run.
    let _ = writeln!(stdout, "{line}").and_then(|()| stdout.flush());
}

/// The parent's handle on a writer process.
pub struct WriterProcess {
    pub holder: String,
    child: Child,
    /// The latest line of each operation, by sequence number.
    entries: Arc<Mutex<BTreeMap<u64, Entry>>>,
    reader: JoinHandle<()>,
}

impl WriterProcess {
    /// Starts `binary writer <args>`.
    pub fn spawn(binary: &Path, args: &WriterArgs) -> Result<WriterProcess, String> {
        let mut child = Command::new(binary)
            .args(args.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the writer {}: {e}", binary.display()))?;
        let mut lines = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
        let entries = Arc::new(Mutex::new(BTreeMap::new()));
        let sink = Arc::clone(&entries);
        let reader = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(Line { seq, entry }) = serde_json::from_str(&line) {
                    sink.lock().unwrap().insert(seq, entry);
                }
            }
        });
        Ok(WriterProcess {
            holder: args.holder.clone(),
            child,
            entries,
            reader,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    pub fn signal(&self, name: &str) {
        crate::gateway::signal(self.pid(), name);
    }

    /// Asks the writer to stop itself once its next batch is decided (SIGUSR1), and
    /// waits until it has (`patience` at most); whether it did.
    pub async fn pause_when_decided(&self, patience: Duration) -> bool {
        self.signal("USR1");
        let deadline = Instant::now() + patience;
        while Instant::now() < deadline {
            if self.is_stopped() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.is_stopped()
    }

    /// Whether the process is stopped by a signal (state `T` in `/proc/PID/stat`).
    pub fn is_stopped(&self) -> bool {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()));
        // The state follows the command name, which is in parentheses.
        stat.ok()
            .and_then(|stat| Some(stat[stat.rfind(')')? + 1..].trim_start().starts_with('T')))
            .unwrap_or(false)
    }

    /// Closes its stdin, waits for it to finish its operation in flight and exit, and
    /// returns its history. A writer that stopped itself (see
    /// [`WriterProcess::pause_when_decided`]) is continued while it is waited for.
    pub async fn stop(mut self) -> Result<Vec<Entry>, String> {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + wire::PATIENCE;
        let status = loop {
            self.signal("CONT");
            match tokio::time::timeout(Duration::from_millis(200), self.child.wait()).await {
                Ok(status) => break status.map_err(|e| e.to_string())?,
                Err(_) if Instant::now() < deadline => {}
                Err(_) => return Err(format!("writer {} did not stop", self.holder)),
            }
        };
        let _ = self.reader.await;
        if !status.success() {
            return Err(format!("writer {} exited with {status}", self.holder));
        }
        let entries = self.entries.lock().unwrap();
        Ok(entries.values().cloned().collect())
    }
}
