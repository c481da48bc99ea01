//! The scenario file format: TOML, one `[[step]]` table per step.
//!
//! Every field of a step is optional in the file; [`Scenario::validate`] checks that
//! each action has what it needs, so a typo fails at load time with the step number,
//! never halfway through a run.

use std::path::Path;
use std::time::Duration;

use crate::faults::writer::LeaseSource;
use serde::Deserialize;

/// One scenario file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The resource that writes go to unless a step names another.
    #[serde(default = "default_resource")]
    pub resource: String,
    #[serde(default)]
    pub lease: LeaseSettings,
    #[serde(default)]
    pub gateway: GatewaySettings,
    /// Actors that are separate writer processes (they can be paused).
    #[serde(default)]
    pub processes: Vec<String>,
    #[serde(default)]
    pub control: Control,
    #[serde(rename = "step", default)]
    pub steps: Vec<Step>,
}

/// The lease the actors compete for.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseSettings {
    #[serde(default = "default_lease")]
    pub name: String,
    /// How long an acquisition holds, e.g. `"15s"`, `"1500ms"`.
    #[serde(default = "default_ttl", deserialize_with = "duration")]
    pub ttl: Duration,
    /// The epoch stored before the first acquisition (the first token is one more);
    /// `postgres` only.
    #[serde(default)]
    pub start_epoch: u64,
    /// Where the lease lives: `postgres` (the seed's table), `etcd` or `zookeeper` (a
    /// server of the run's own; the gateways then check tokens against the election,
    /// and tokens are revisions or zxids, so steps expect outcomes, not numbers).
    #[serde(default = "default_source")]
    pub source: LeaseSource,
}

fn default_source() -> LeaseSource {
    LeaseSource::Postgres
}

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            name: default_lease(),
            ttl: default_ttl(),
            start_epoch: 0,
            source: default_source(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewaySettings {
    /// Gateway replicas sharing one database (local runs start them; external runs
    /// need as many `--gateway` URLs).
    #[serde(default = "one")]
    pub replicas: usize,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        GatewaySettings { replicas: 1 }
    }
}

/// What the control run (writes straight to the database, no fencing) must show.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Control {
    /// Labels of writes that land without fencing although the gateway rejects them.
    #[serde(default)]
    pub wrong: Vec<String>,
    /// Values stored at the end of the control run.
    #[serde(default)]
    pub stored: Vec<Stored>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stored {
    #[serde(default)]
    pub resource: Option<String>,
    pub key: String,
    pub value: String,
}

/// What a step does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// The actor acquires the lease (a new token) through the lease client's store.
    Acquire,
    /// The actor renews the lease at its current token.
    Renew,
    /// Forces the lease's expiry, as the seed does.
    Expire,
    /// Waits `duration` (e.g. for a lease to expire by itself).
    Wait,
    /// A labelled PUT with the actor's token; `hold`/`delay` keep it in the network.
    Write,
    /// Raises the fence to the actor's token.
    Advance,
    /// Sends `ops` as one `POST /v1/txn`, each operation with the token of its own
    /// `actor` (or the step's) unless it names a `token`; labelled as a write is, and
    /// `hold`/`delay` keep it in the network.
    Txn,
    /// Forwards held writes (`label` or `labels`, at once) and checks their answers.
    Release,
    /// Waits for the answer of a delayed write or of a paused process's write.
    Await,
    /// Closes a held write's connection: nothing reaches the gateway.
    Drop,
    /// Delivers a held write twice.
    Duplicate,
    /// Forwards held writes in the order of `labels` (answers: `await`).
    Reorder,
    /// SIGSTOP to the actor's writer process.
    Pause,
    /// SIGCONT to the actor's writer process.
    Resume,
    /// Restarts gateway replica `via` (SIGTERM, start again on the same address).
    RestartGateway,
    /// Cuts the gateways' connections to the database.
    CutDatabase,
    /// Lets the gateways reach the database again and waits until they are ready.
    RestoreDatabase,
    /// Holds the database's answers to the gateways (statements still run and
    /// commit): a commit whose reply is late.
    HoldDatabaseReplies,
    /// Forwards the held database answers.
    ReleaseDatabaseReplies,
    /// Reads an object through the gateway.
    Read,
    /// Reads a resource's fence through the gateway.
    Fence,
    /// Checks how much a metric rose since the scenario started.
    Metric,
    /// Holds `count` writes of the actor, releases them at once, while `meanwhile`
    /// keeps writing.
    Flood,
}

/// One step.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    #[serde(default)]
    pub actor: Option<String>,
    pub action: Action,
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default)]
    pub labels: Vec<String>,
    #[serde(default)]
    pub resource: Option<String>,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub value: Option<String>,
    /// A token to present instead of the actor's lease token.
    #[serde(default)]
    pub token: Option<u64>,
    #[serde(default)]
    pub hold: bool,
    #[serde(default, deserialize_with = "opt_duration")]
    pub delay: Option<Duration>,
    #[serde(default, deserialize_with = "opt_duration")]
    pub duration: Option<Duration>,
    /// `If-Match` version, e.g. `"1"` (`"0"`: must not exist).
    #[serde(default)]
    pub if_match: Option<String>,
    /// `Idempotency-Key` of a write, advance or transaction: the same on a retry.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// The operations of a `txn` step.
    #[serde(default)]
    pub ops: Vec<TxnStepOp>,
    /// Gateway replica, 1-based.
    #[serde(default)]
    pub via: Option<usize>,
    #[serde(default)]
    pub series: Option<String>,
    #[serde(default)]
    pub count: Option<usize>,
    #[serde(default)]
    pub connections: Option<usize>,
    #[serde(default)]
    pub meanwhile: Option<String>,
    #[serde(default)]
    pub expect: Option<Expect>,
}

/// One operation of a `txn` step: `op` is `put`, `delete`, `advance` or `check`; the
/// resource defaults to the scenario's, the key to `k`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TxnStepOp {
    pub op: String,
    #[serde(default)]
    pub actor: Option<String>,
    #[serde(default)]
    pub resource: Option<String>,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub value: Option<String>,
    #[serde(default)]
    pub token: Option<u64>,
}

/// What a step must observe. Only the fields given are checked.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    pub outcome: Option<Outcome>,
    pub status: Option<u16>,
    pub presented: Option<u64>,
    pub highest: Option<u64>,
    pub version: Option<u64>,
    pub token: Option<u64>,
    pub value: Option<String>,
    /// Metric steps: the rise since the scenario started.
    pub delta: Option<f64>,
    /// Releases of several labels: how many were accepted.
    pub accepted: Option<usize>,
    /// Duplicate steps: the outcome of the second delivery.
    pub duplicate: Option<Outcome>,
    /// 503 answers: `write_applied` as `"no"` (false) or `"unknown"` (null).
    pub applied: Option<String>,
    /// Whether the answer was replayed from an earlier attempt with the same
    /// `Idempotency-Key` (header `Idempotency-Replayed: true`).
    pub replayed: Option<bool>,
}

/// The kinds of answer a step can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// 200 or 201.
    Accepted,
    /// 409 `stale_token`.
    Rejected,
    /// 412 `version_mismatch`.
    PreconditionFailed,
    /// 503 `backend_unavailable`.
    Unavailable,
    /// No answer: the connection was closed.
    Dropped,
    /// Acquire: the lease was taken; renew: extended.
    Granted,
    /// Acquire: someone else holds it; renew: replaced.
    Refused,
    /// Read: no such object.
    Absent,
}

impl Outcome {
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Accepted => "accepted",
            Outcome::Rejected => "rejected",
            Outcome::PreconditionFailed => "precondition_failed",
            Outcome::Unavailable => "unavailable",
            Outcome::Dropped => "dropped",
            Outcome::Granted => "granted",
            Outcome::Refused => "refused",
            Outcome::Absent => "absent",
        }
    }
}

/// A scenario file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("{path}: {message}")]
    Read { path: String, message: String },
    #[error("{name}: step {step} ({action:?}): {message}")]
    Invalid {
        name: String,
        step: usize,
        action: Action,
        message: String,
    },
}

impl Scenario {
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let error = |message: String| ScenarioError::Read {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
        let scenario: Scenario = toml::from_str(&text).map_err(|e| error(e.to_string()))?;
        scenario.validate()?;
        Ok(scenario)
    }

    /// A scenario from TOML text (`origin` names it in errors).
    pub fn from_toml(text: &str, origin: &str) -> Result<Scenario, ScenarioError> {
        let scenario: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Read {
            path: origin.to_owned(),
            message: e.to_string(),
        })?;
        scenario.validate()?;
        Ok(scenario)
    }

    /// The `*.toml` files of a directory (sorted), or the one file named.
    pub fn load_all(path: &Path) -> Result<Vec<Scenario>, ScenarioError> {
        if !path.is_dir() {
            return Ok(vec![Scenario::load(path)?]);
        }
        let entries = std::fs::read_dir(path).map_err(|e| ScenarioError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let mut files: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|ext| ext == "toml"))
            .collect();
        files.sort();
        files.iter().map(|p| Scenario::load(p)).collect()
    }

    /// Checks that every step has the fields its action needs.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        let mut labels = std::collections::HashSet::new();
        for (index, step) in self.steps.iter().enumerate() {
            let fail = |message: &str| ScenarioError::Invalid {
                name: self.name.clone(),
                step: index + 1,
                action: step.action,
                message: message.to_owned(),
            };
            let needs_actor = matches!(
                step.action,
                Action::Acquire
                    | Action::Renew
                    | Action::Advance
                    | Action::Pause
                    | Action::Resume
                    | Action::Flood
            ) || (step.action == Action::Write && step.token.is_none());
            if needs_actor && step.actor.is_none() {
                return Err(fail("needs `actor`"));
            }
            let needs_label = matches!(
                step.action,
                Action::Await | Action::Drop | Action::Duplicate | Action::Flood
            ) || (step.action == Action::Write
                && (step.hold || step.delay.is_some()));
            if needs_label && step.label.is_none() {
                return Err(fail("needs `label`"));
            }
            if step.action == Action::Write {
                if step.value.is_none() {
                    return Err(fail("needs `value`"));
                }
                if let Some(label) = &step.label {
                    if !labels.insert(label.clone()) {
                        return Err(fail("labels must be unique within a scenario"));
                    }
                }
                if step.hold && step.delay.is_some() {
                    return Err(fail("`hold` and `delay` exclude each other"));
                }
            }
            if step.action == Action::Txn {
                if step.ops.is_empty() {
                    return Err(fail("needs `ops`"));
                }
                for op in &step.ops {
                    if !["put", "delete", "advance", "check"].contains(&op.op.as_str()) {
                        return Err(fail("an op is `put`, `delete`, `advance` or `check`"));
                    }
                    if op.token.is_none() && op.actor.is_none() && step.actor.is_none() {
                        return Err(fail(
                            "each op needs a `token`, or an `actor` (its own or the step's)",
                        ));
                    }
                    if op.op == "put" && op.value.is_none() {
                        return Err(fail("a put op needs `value`"));
                    }
                }
                if (step.hold || step.delay.is_some()) && step.label.is_none() {
                    return Err(fail("needs `label`"));
                }
            }
            if step.action == Action::Release && step.label.is_none() && step.labels.is_empty() {
                return Err(fail("needs `label` or `labels`"));
            }
            if step.action == Action::Reorder && step.labels.len() < 2 {
                return Err(fail("needs at least two `labels`"));
            }
            if step.action == Action::Wait && step.duration.is_none() {
                return Err(fail("needs `duration`"));
            }
            if step.action == Action::Metric
                && (step.series.is_none() || step.expect.as_ref().and_then(|e| e.delta).is_none())
            {
                return Err(fail("needs `series` and `expect.delta`"));
            }
            if step.action == Action::Flood && step.count.is_none() {
                return Err(fail("needs `count`"));
            }
            if matches!(step.action, Action::Pause | Action::Resume)
                && !self
                    .processes
                    .iter()
                    .any(|p| Some(p) == step.actor.as_ref())
            {
                return Err(fail("the actor must be listed in `processes`"));
            }
            if step
                .via
                .is_some_and(|v| v == 0 || v > self.gateway.replicas)
            {
                return Err(fail("`via` names a replica the scenario does not have"));
            }
        }
        if self.steps.is_empty() {
            return Err(ScenarioError::Read {
                path: self.name.clone(),
                message: "a scenario needs at least one [[step]]".into(),
            });
        }
        Ok(())
    }

    /// Steps that need process control of a local gateway or database, with why:
    /// an external deployment cannot run them.
    pub fn needs_local(&self) -> Option<(usize, &'static str)> {
        self.steps.iter().enumerate().find_map(|(i, step)| {
            let why = match step.action {
                Action::RestartGateway => "restarting the gateway needs its process",
                Action::CutDatabase
                | Action::RestoreDatabase
                | Action::HoldDatabaseReplies
                | Action::ReleaseDatabaseReplies => {
                    "cutting or delaying the database needs the gateway's database connection to run through the harness"
                }
                _ => return None,
            };
            Some((i + 1, why))
        })
    }
}

fn default_resource() -> String {
    "orders".into()
}

fn default_lease() -> String {
    "leader".into()
}

fn default_ttl() -> Duration {
    Duration::from_secs(15)
}

fn one() -> usize {
    1
}

/// A humantime duration such as `"1500ms"` or `"15s"`.
fn duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(serde::de::Error::custom)
}

fn opt_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration(d).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mistakes in a file fail at load time, naming the step.
    #[test]
    fn invalid_files_are_refused_before_running() {
        let unlabelled_hold = r#"
            name = "x"
            [[step]]
            actor = "A"
            action = "write"
            token = 1
            value = "v"
            hold = true
        "#;
        let error = Scenario::from_toml(unlabelled_hold, "inline").unwrap_err();
        assert!(
            error.to_string().contains("step 1 (Write): needs `label`"),
            "{error}"
        );

        let typo = "name = \"x\"\n[[step]]\naction = \"expire\"\nexpcet = {}\n";
        let error = Scenario::from_toml(typo, "inline").unwrap_err();
        assert!(error.to_string().contains("expcet"), "{error}");

        let not_a_process = "name = \"x\"\n[[step]]\nactor = \"A\"\naction = \"pause\"\n";
        let error = Scenario::from_toml(not_a_process, "inline").unwrap_err();
        assert!(error.to_string().contains("`processes`"), "{error}");

        let local =
            "name = \"x\"\n[[step]]\naction = \"expire\"\n[[step]]\naction = \"restart_gateway\"\n";
        let scenario = Scenario::from_toml(local, "inline").unwrap();
        assert_eq!(scenario.needs_local().map(|(step, _)| step), Some(2));
    }
}
