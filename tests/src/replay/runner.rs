//! Runs a scenario against the gateway: one printed line per step (time, actor,
//! action, outcome), and the first step whose outcome differs from its `expect` ends
//! the run with the step, the expected and the observed outcome.
//!
//! # Ordering
//!
//! Steps run one after another; a step returns only when its effect is in place: a
//! held write returns once the proxy holds the whole request, a release once the
//! answer has arrived, a restart once the gateway is ready again. Writes that are
//! still in flight (held, delayed, or queued in a frozen writer process) are
//! *pending* under their label until a `release` or `await` step collects them. Every
//! step runs: a run that ends early is an error, never a pass.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

pub(crate) use crate::replay::observed::{check, outcome_of, Observed};
use crate::replay::observed::{read, renewal};
use crate::replay::scenario::{Action, Expect, Outcome, Scenario, Step};
use crate::replay::target::Target;
use crate::replay::wire::{self, Reply, Request};
use crate::replay::writer::Writer;
use crate::replay::RunError;

/// How long a held request may take to reach the proxy, or a gateway to recover.
const PATIENCE: Duration = Duration::from_secs(15);

/// A write that has been sent but not answered yet.
enum Pending {
    Network(JoinHandle<Result<Reply, String>>),
    Process(String),
}

/// One run of one scenario through the gateway.
pub struct Run<'a> {
    pub(crate) scenario: &'a Scenario,
    pub(crate) target: &'a Target,
    /// Suffix that makes this run's resources, lease and labels its own.
    pub(crate) id: String,
    pub(crate) started: Instant,
    pub(crate) tokens: HashMap<String, u64>,
    pending: HashMap<String, Pending>,
    writers: HashMap<String, Writer>,
    paused: HashSet<String>,
    baselines: HashMap<String, f64>,
    /// The printed timeline.
    pub lines: Vec<String>,
    pub(crate) echo: bool,
}

impl<'a> Run<'a> {
    pub fn new(scenario: &'a Scenario, target: &'a Target, echo: bool) -> Run<'a> {
        Run {
            scenario,
            target,
            id: format!("{:08x}", rand::random::<u32>()),
            started: Instant::now(),
            tokens: HashMap::new(),
            pending: HashMap::new(),
            writers: HashMap::new(),
            paused: HashSet::new(),
            baselines: HashMap::new(),
            lines: Vec::new(),
            echo,
        }
    }

    /// The run's own name for a resource of the scenario.
    pub(crate) fn resource(&self, step: &Step) -> String {
        let name = step.resource.as_deref().unwrap_or(&self.scenario.resource);
        format!("{name}-{}", self.id)
    }

    pub(crate) fn lease(&self) -> String {
        format!("{}-{}", self.scenario.lease.name, self.id)
    }

    pub(crate) fn series(&self, step: &Step) -> String {
        let resource = format!("{}-{}", self.scenario.resource, self.id);
        step.series
            .clone()
            .unwrap_or_default()
            .replace("{resource}", &resource)
    }

    pub(crate) fn print(&mut self, step: usize, actor: &str, action: &str, outcome: &str) {
        let elapsed = self.started.elapsed().as_secs_f64();
        let line = format!("{elapsed:>8.3}s  #{step:<3} {actor:<8} {action:<44} -> {outcome}");
        if self.echo {
            println!("{line}");
        }
        self.lines.push(line);
    }

    /// Runs every step; refuses up front what this target cannot do.
    pub async fn run(mut self) -> Result<Vec<String>, RunError> {
        let name = self.scenario.name.clone();
        if !self.target.is_local() {
            if let Some((step, why)) = self.scenario.needs_local() {
                return Err(RunError::Refused {
                    scenario: name,
                    step,
                    reason: why.into(),
                });
            }
        }
        let source = self.scenario.lease.source;
        if self.target.leases.source() != source {
            return Err(RunError::Refused {
                scenario: name,
                step: 0,
                reason: format!(
                    "its lease lives in {}, and this target's leases do not: run it with \
                     `cargo test -p fencegate-tests --test it replay_scenarios::`, which starts it",
                    source.name()
                ),
            });
        }
        if self.scenario.gateway.replicas > self.target.replicas.len() {
            return Err(RunError::Refused {
                scenario: name,
                step: 0,
                reason: format!(
                    "needs {} gateway replicas, the target has {}",
                    self.scenario.gateway.replicas,
                    self.target.replicas.len()
                ),
            });
        }
        if !self.scenario.processes.is_empty() && self.target.writer.is_none() {
            return Err(RunError::Refused {
                scenario: name,
                step: 0,
                reason: "needs writer processes, but no writer binary was given".into(),
            });
        }
        let setup = |message: String| RunError::Harness {
            scenario: name.clone(),
            step: 0,
            message,
        };
        let lease = self.lease();
        let start = self.scenario.lease.start_epoch;
        self.target
            .leases
            .create(&lease, start)
            .await
            .map_err(setup)?;
        for step in self
            .scenario
            .steps
            .iter()
            .filter(|s| s.action == Action::Metric)
        {
            let series = self.series(step);
            let value = self.metric_sum(&series).await.map_err(setup)?;
            self.baselines.insert(series, value);
        }
        let steps = self.scenario.steps.clone();
        for (index, step) in steps.iter().enumerate() {
            let number = index + 1;
            let observed = self
                .step(number, step)
                .await
                .map_err(|message| RunError::Harness {
                    scenario: name.clone(),
                    step: number,
                    message,
                })?;
            let actor = step.actor.clone().unwrap_or_else(|| "-".into());
            let action = self.describe(step);
            self.print(number, &actor, &action, &observed.text);
            if let Some(expect) = &step.expect {
                if let Err((expected, observed)) = check(expect, &observed) {
                    return Err(RunError::Mismatch {
                        scenario: name,
                        step: number,
                        line: self.lines.last().cloned().unwrap_or_default(),
                        expected,
                        observed,
                    });
                }
            }
        }
        if let Some(label) = self.pending.keys().next() {
            return Err(RunError::Harness {
                scenario: name,
                step: steps.len(),
                message: format!(
                    "write {label:?} is still pending at the end: release or await it"
                ),
            });
        }
        Ok(self.lines)
    }

    pub(crate) fn describe(&self, step: &Step) -> String {
        let mut text = snake_case(&format!("{:?}", step.action));
        if let Some(label) = &step.label {
            let _ = write!(text, " {label}");
        }
        if !step.labels.is_empty() {
            let _ = write!(text, " {}", step.labels.join(","));
        }
        if matches!(
            step.action,
            Action::Write | Action::Read | Action::Fence | Action::Flood
        ) {
            let resource = step.resource.as_deref().unwrap_or(&self.scenario.resource);
            let _ = write!(text, " {resource}");
            if step.action != Action::Fence {
                let _ = write!(text, "/{}", step.key.as_deref().unwrap_or("k"));
            }
        }
        if let Some(token) = self.token_for(step) {
            if matches!(step.action, Action::Write | Action::Advance | Action::Flood) {
                let _ = write!(text, " token={token}");
            }
        }
        if let Some(value) = &step.value {
            let _ = write!(text, " {value:?}");
        }
        if let Some(version) = &step.if_match {
            let _ = write!(text, " if-match={version}");
        }
        if step.hold {
            text.push_str(" (held)");
        }
        if let Some(delay) = step.delay.or(step.duration) {
            let _ = write!(text, " {}", humantime::format_duration(delay));
        }
        if let Some(via) = step.via {
            let _ = write!(text, " via gateway {via}");
        }
        text
    }

    pub(crate) fn token_for(&self, step: &Step) -> Option<u64> {
        step.token
            .or_else(|| self.tokens.get(step.actor.as_deref()?).copied())
    }

    fn replica(&self, step: &Step) -> &crate::replay::target::Replica {
        &self.target.replicas[step.via.unwrap_or(1) - 1]
    }

    async fn metric_sum(&self, series: &str) -> Result<f64, String> {
        let mut total = 0.0;
        for replica in &self.target.replicas[..self.scenario.gateway.replicas] {
            total += crate::http::Client::new(format!("http://{}", replica.addr))
                .try_metric(series)
                .await?
                .unwrap_or(0.0);
        }
        Ok(total)
    }

    /// Runs one step: `Err` only when the harness itself fails.
    async fn step(&mut self, number: usize, step: &Step) -> Result<Observed, String> {
        let actor = step.actor.clone().unwrap_or_default();
        let ttl = self.scenario.lease.ttl;
        match step.action {
            Action::Acquire => {
                let got = self
                    .target
                    .leases
                    .acquire(&self.lease(), &actor, ttl)
                    .await?;
                Ok(self.acquired(&actor, got))
            }
            Action::Renew => {
                let token = self
                    .tokens
                    .get(&actor)
                    .copied()
                    .ok_or("the actor holds no token")?;
                let renewed = self
                    .target
                    .leases
                    .renew(&self.lease(), &actor, token, ttl)
                    .await?;
                Ok(renewal(renewed, token))
            }
            Action::Expire => {
                self.target.leases.expire(&self.lease()).await?;
                Ok(Observed::text("expired (expires_at = now() - 1 s)"))
            }
            Action::Wait => {
                tokio::time::sleep(step.duration.unwrap_or_default()).await;
                Ok(Observed::text("waited"))
            }
            Action::Write => self.write(number, step).await,
            Action::Txn => self.txn(number, step).await,
            Action::Advance => {
                let token = self.token_for(step).ok_or("the actor holds no token")?;
                let path = crate::http::advance_path(&self.resource(step));
                let request = Request {
                    method: "POST".into(),
                    path,
                    headers: vec![("fencing-token".into(), token.to_string())],
                    body: String::new(),
                };
                let reply = wire::send_one(self.replica(step).hop.addr(), &request).await;
                Ok(Observed::reply(&reply))
            }
            Action::Release => {
                let labels = match &step.label {
                    Some(label) => vec![label.clone()],
                    None => step.labels.clone(),
                };
                for label in &labels {
                    let key = self.key(label);
                    for replica in &self.target.replicas {
                        if replica.hop.request_state(&key).is_some() {
                            replica.hop.release_request(&key);
                        }
                    }
                }
                self.collect(&labels).await
            }
            Action::Await => {
                self.collect(std::slice::from_ref(step.label.as_ref().unwrap()))
                    .await
            }
            Action::Drop => {
                let label = step.label.clone().unwrap_or_default();
                self.replica(step).hop.drop_request(&self.key(&label));
                self.collect(&[label]).await
            }
            Action::Duplicate => {
                let label = step.label.clone().unwrap_or_default();
                let key = self.key(&label);
                self.replica(step).hop.duplicate_request(&key);
                let mut observed = self.collect(&[label]).await?;
                let copy = self.replica(step).hop.duplicate_reply(&key, PATIENCE).await;
                let copy = Observed::reply(
                    &copy
                        .map(|(status, body)| Reply {
                            status,
                            etag: None,
                            token: None,
                            replayed: false,
                            body: String::from_utf8_lossy(&body).into_owned(),
                        })
                        .ok_or_else(String::new),
                );
                observed.facts.duplicate = copy.facts.outcome;
                observed.text = format!("{}; copy: {}", observed.text, copy.text);
                Ok(observed)
            }
            Action::Reorder => {
                let keys: Vec<String> = step.labels.iter().map(|l| self.key(l)).collect();
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                if !self.replica(step).hop.reorder(&keys, PATIENCE).await {
                    return Err("a reordered request was not forwarded".into());
                }
                Ok(Observed::text(format!(
                    "forwarded and answered in the order {}",
                    step.labels.join(", ")
                )))
            }
            Action::Pause => {
                self.writer(&actor)?.signal("STOP");
                self.paused.insert(actor);
                Ok(Observed::text("SIGSTOP: frozen"))
            }
            Action::Resume => {
                self.writer(&actor)?.signal("CONT");
                self.paused.remove(&actor);
                Ok(Observed::text("SIGCONT: running"))
            }
            Action::RestartGateway => {
                let replica = self.replica(step);
                let process = replica.process.as_ref().ok_or("not a local gateway")?;
                process.lock().await.restart().await;
                Ok(Observed::text("restarted, ready"))
            }
            Action::CutDatabase => {
                let link = self.target.database_link.lock().await;
                link.as_ref().ok_or("no database link")?.cut();
                Ok(Observed::text("gateway-to-database connections cut"))
            }
            Action::RestoreDatabase => {
                let mut link = self.target.database_link.lock().await;
                let proxy = link.take().ok_or("no database link")?;
                *link = Some(proxy.restore().await);
                drop(link);
                for replica in &self.target.replicas {
                    self.ready(replica.addr).await?;
                }
                Ok(Observed::text("restored; gateways ready"))
            }
            Action::HoldDatabaseReplies => {
                let link = self.target.database_link.lock().await;
                link.as_ref().ok_or("no database link")?.hold_replies();
                Ok(Observed::text("database answers held"))
            }
            Action::ReleaseDatabaseReplies => {
                let link = self.target.database_link.lock().await;
                let link = link.as_ref().ok_or("no database link")?;
                let held = link.held_reply_bytes();
                link.release_replies();
                Ok(Observed::text(format!(
                    "{held} bytes of database answers released"
                )))
            }
            Action::Read => {
                let path =
                    crate::http::kv_path(&self.resource(step), step.key.as_deref().unwrap_or("k"));
                let reply = wire::send_one(self.replica(step).addr, &Request::get(&path)).await?;
                Ok(read(&reply))
            }
            Action::Fence => {
                let path = crate::http::fence_path(&self.resource(step));
                let reply = wire::send_one(self.replica(step).addr, &Request::get(&path)).await?;
                let highest = reply.field("highest");
                Ok(Observed {
                    text: format!(
                        "highest={}",
                        highest.map_or("null".into(), |h| h.to_string())
                    ),
                    facts: Expect {
                        highest,
                        ..Expect::default()
                    },
                })
            }
            Action::Metric => {
                let series = self.series(step);
                let now = self.metric_sum(&series).await?;
                let delta = now - self.baselines.get(&series).copied().unwrap_or(0.0);
                Ok(Observed {
                    text: format!("{series} rose by {delta}"),
                    facts: Expect {
                        delta: Some(delta),
                        ..Expect::default()
                    },
                })
            }
            Action::Flood => crate::replay::flood::run(self, number, step).await,
        }
    }

    pub(crate) fn acquired(&mut self, actor: &str, got: Option<u64>) -> Observed {
        match got {
            Some(token) => {
                self.tokens.insert(actor.to_owned(), token);
                Observed {
                    text: format!("granted token {token}"),
                    facts: Expect {
                        outcome: Some(Outcome::Granted),
                        token: Some(token),
                        ..Expect::default()
                    },
                }
            }
            None => Observed {
                text: "refused: held by another".into(),
                facts: Expect {
                    outcome: Some(Outcome::Refused),
                    ..Expect::default()
                },
            },
        }
    }

    /// The proxy's name for a label of this run.
    pub(crate) fn key(&self, label: &str) -> String {
        format!("{label}@{}", self.id)
    }

    async fn write(&mut self, number: usize, step: &Step) -> Result<Observed, String> {
        let actor = step.actor.clone().unwrap_or_else(|| "-".into());
        let token = self.token_for(step).ok_or("the actor holds no token")?;
        let label = step
            .label
            .clone()
            .unwrap_or_else(|| format!("step-{number}"));
        let key = self.key(&label);
        let path = crate::http::kv_path(&self.resource(step), step.key.as_deref().unwrap_or("k"));
        let value = step.value.clone().unwrap_or_default();
        let mut request = Request::put(&path, token, &actor, &key, &value);
        if let Some(version) = &step.if_match {
            request = request.header("if-match", &format!("\"{version}\""));
        }
        if let Some(idempotency) = &step.idempotency_key {
            request = request.header("idempotency-key", idempotency);
        }
        self.send_labelled(step, actor, label, key, request).await
    }

    /// A `POST /v1/txn` of the step's operations, labelled as a write is.
    async fn txn(&mut self, number: usize, step: &Step) -> Result<Observed, String> {
        let actor = step.actor.clone().unwrap_or_else(|| "-".into());
        let label = step
            .label
            .clone()
            .unwrap_or_else(|| format!("step-{number}"));
        let key = self.key(&label);
        let mut operations = Vec::with_capacity(step.ops.len());
        for op in &step.ops {
            let token = op
                .token
                .or_else(|| {
                    let actor = op.actor.as_deref().or(step.actor.as_deref())?;
                    self.tokens.get(actor).copied()
                })
                .ok_or("an op's actor holds no token")?;
            let name = op.resource.as_deref().unwrap_or(&self.scenario.resource);
            let mut operation = serde_json::json!({
                "op": op.op,
                "resource": format!("{name}-{}", self.id),
                "token": token,
            });
            if matches!(op.op.as_str(), "put" | "delete") {
                operation["key"] = op.key.as_deref().unwrap_or("k").into();
            }
            if let Some(value) = &op.value {
                operation["value"] = value.as_str().into();
            }
            operations.push(operation);
        }
        let body = serde_json::json!({ "operations": operations }).to_string();
        let mut request = Request {
            method: "POST".into(),
            path: "/v1/txn".into(),
            headers: vec![
                ("content-type".into(), "application/json".into()),
                (crate::proxy::LABEL_HEADER.into(), key.clone()),
            ],
            body,
        };
        if let Some(idempotency) = &step.idempotency_key {
            request = request.header("idempotency-key", idempotency);
        }
        self.send_labelled(step, actor, label, key, request).await
    }

    /// Sends a labelled request through the step's replica: at once, held or delayed
    /// in the network, or by the actor's writer process.
    async fn send_labelled(
        &mut self,
        step: &Step,
        actor: String,
        label: String,
        key: String,
        request: Request,
    ) -> Result<Observed, String> {
        let hop = &self.replica(step).hop;
        let addr = hop.addr();
        if self.scenario.processes.contains(&actor) {
            let paused = self.paused.contains(&actor);
            let writer = self.writer(&actor)?;
            writer.order(addr, request).await?;
            if paused {
                self.pending.insert(label, Pending::Process(actor));
                return Ok(Observed::text("queued in the frozen process (pending)"));
            }
            let reply = self.writer(&actor)?.answer().await;
            return Ok(Observed::reply(&reply));
        }
        if !step.hold && step.delay.is_none() {
            return Ok(Observed::reply(&wire::send_one(addr, &request).await));
        }
        match step.delay {
            Some(delay) => hop.delay_request(&key, delay),
            None => hop.hold_request(&key),
        }
        let task = tokio::spawn(async move { wire::send_one(addr, &request).await });
        if !hop.wait_held(&key, 0, PATIENCE).await {
            return Err(format!("write {label} did not reach the network"));
        }
        self.pending.insert(label, Pending::Network(task));
        Ok(Observed::text(match step.delay {
            Some(_) => "in the network, delayed (pending)",
            None => "held in the network (pending)",
        }))
    }

    /// Waits for the answers of pending writes; one label reports its answer, several
    /// report how many were accepted.
    async fn collect(&mut self, labels: &[String]) -> Result<Observed, String> {
        let mut replies = Vec::new();
        for label in labels {
            let pending = self
                .pending
                .remove(label)
                .ok_or_else(|| format!("no pending write is labelled {label:?}"))?;
            let reply = match pending {
                Pending::Network(task) => task.await.map_err(|e| e.to_string())?,
                Pending::Process(actor) => self.writer(&actor)?.answer().await,
            };
            replies.push(reply);
        }
        if let [reply] = replies.as_slice() {
            return Ok(Observed::reply(reply));
        }
        let seen: Vec<Observed> = replies.iter().map(Observed::reply).collect();
        let accepted = seen
            .iter()
            .filter(|o| o.facts.outcome == Some(Outcome::Accepted))
            .count();
        let texts: Vec<&str> = seen.iter().map(|o| o.text.as_str()).collect();
        Ok(Observed {
            text: format!(
                "{accepted} of {} accepted: {}",
                seen.len(),
                texts.join("; ")
            ),
            facts: Expect {
                accepted: Some(accepted),
                ..Expect::default()
            },
        })
    }

    fn writer(&mut self, actor: &str) -> Result<&mut Writer, String> {
        if !self.writers.contains_key(actor) {
            let binary = self.target.writer.as_ref().ok_or("no writer binary")?;
            self.writers
                .insert(actor.to_owned(), Writer::spawn(binary)?);
        }
        Ok(self.writers.get_mut(actor).expect("inserted above"))
    }

    async fn ready(&self, addr: std::net::SocketAddr) -> Result<(), String> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let reply = wire::send_one(addr, &Request::get("/readyz")).await;
            if reply.is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("gateway {addr} not ready within {PATIENCE:?}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `RestartGateway` -> `restart_gateway`, as actions are written in scenario files.
fn snake_case(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}
