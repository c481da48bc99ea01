//! The control run: the same timeline with fencing switched off. Every write goes
//! straight to a table in Postgres (`replay_control.objects`) with an unconditional
//! upsert; held and delayed writes are applied when they would have arrived (their
//! release, their await, or their frozen process's resume). The run then asserts that
//! each write the scenario declares in `[control] wrong` *did* land, and the stored
//! values of `[[control.stored]]`: the harm the gateway prevents.

use std::collections::{HashMap, HashSet};

use crate::replay::runner::Run;
use crate::replay::scenario::{Action, Scenario, Step};
use crate::replay::target::Target;
use crate::replay::RunError;

const SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS replay_control;
    CREATE TABLE IF NOT EXISTS replay_control.objects (
        resource text NOT NULL, key text NOT NULL, value text NOT NULL, token bigint NOT NULL,
        PRIMARY KEY (resource, key))";

/// A write waiting to be applied.
struct Queued {
    resource: String,
    key: String,
    value: String,
    token: u64,
    actor: String,
}

pub async fn run(
    scenario: &Scenario,
    target: &Target,
    echo: bool,
) -> Result<Vec<String>, RunError> {
    let name = scenario.name.clone();
    let harness = |step: usize| {
        let name = name.clone();
        move |message: String| RunError::Harness {
            scenario: name,
            step,
            message,
        }
    };
    let db = target
        .control
        .as_ref()
        .ok_or_else(|| harness(0)("a control run needs a control database".into()))?;
    db.client
        .batch_execute(SCHEMA)
        .await
        .map_err(|e| harness(0)(e.to_string()))?;
    let mut run = Run::new(scenario, target, echo);
    run.target
        .leases
        .create(&run.lease(), scenario.lease.start_epoch)
        .await
        .map_err(harness(0))?;
    let mut queued: HashMap<String, Queued> = HashMap::new();
    // The puts of transactions held in the network, by label: they land together.
    let mut queued_txns: HashMap<String, Vec<Queued>> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut paused: HashSet<String> = HashSet::new();
    let mut landed: HashSet<String> = HashSet::new();
    for (index, step) in scenario.steps.iter().enumerate() {
        let number = index + 1;
        let actor = step.actor.clone().unwrap_or_default();
        let apply = |write: Queued| async move {
            db.client
                .execute(
                    "INSERT INTO replay_control.objects (resource, key, value, token)
                     VALUES ($1, $2, $3, $4)
                     ON CONFLICT (resource, key) DO UPDATE SET value = excluded.value, token = excluded.token",
                    &[&write.resource, &write.key, &write.value, &(write.token as i64)],
                )
                .await
                .map(|rows| rows == 1)
                .map_err(|e| e.to_string())
        };
        let mut due: Vec<String> = Vec::new();
        let text = match step.action {
            Action::Acquire | Action::Renew | Action::Expire | Action::Wait => {
                let observed = lease_step(&mut run, step).await.map_err(harness(number))?;
                observed
            }
            Action::Write => {
                let token = run
                    .token_for(step)
                    .ok_or_else(|| harness(number)("no token".into()))?;
                let label = step
                    .label
                    .clone()
                    .unwrap_or_else(|| format!("step-{number}"));
                let write = Queued {
                    resource: run.resource(step),
                    key: step.key.clone().unwrap_or_else(|| "k".into()),
                    value: step.value.clone().unwrap_or_default(),
                    token,
                    actor: actor.clone(),
                };
                if step.hold || step.delay.is_some() || paused.contains(&actor) {
                    queued.insert(label.clone(), write);
                    order.push(label);
                    "queued (in the network or a frozen process)".to_owned()
                } else {
                    let ok = apply(write).await.map_err(harness(number))?;
                    if ok {
                        landed.insert(label);
                    }
                    format!("applied unconditionally: {ok}")
                }
            }
            Action::Txn => {
                // Without a fence, each put of the transaction lands as it comes.
                let mut puts = Vec::new();
                for op in step.ops.iter().filter(|op| op.op == "put") {
                    let token = op
                        .token
                        .or_else(|| {
                            run.tokens
                                .get(op.actor.as_deref().unwrap_or(&actor))
                                .copied()
                        })
                        .ok_or_else(|| harness(number)("no token".into()))?;
                    let name = op.resource.as_deref().unwrap_or(&scenario.resource);
                    puts.push(Queued {
                        resource: format!("{name}-{}", run.id),
                        key: op.key.clone().unwrap_or_else(|| "k".into()),
                        value: op.value.clone().unwrap_or_default(),
                        token,
                        actor: actor.clone(),
                    });
                }
                if step.hold || step.delay.is_some() {
                    let label = step.label.clone().unwrap_or_default();
                    queued_txns.insert(label, puts);
                    "queued in the network".to_owned()
                } else {
                    let mut applied = 0;
                    for write in puts {
                        if apply(write).await.map_err(harness(number))? {
                            applied += 1;
                        }
                    }
                    format!("{applied} puts applied unconditionally")
                }
            }
            Action::Release | Action::Await | Action::Reorder => {
                due.extend(step.label.iter().cloned());
                due.extend(step.labels.iter().cloned());
                String::new()
            }
            Action::Duplicate => {
                let label = step.label.clone().unwrap_or_default();
                if let Some(write) = queued.get(&label) {
                    let copy = Queued {
                        resource: write.resource.clone(),
                        key: write.key.clone(),
                        value: write.value.clone(),
                        token: write.token,
                        actor: write.actor.clone(),
                    };
                    apply(copy).await.map_err(harness(number))?;
                }
                due.push(label);
                String::new()
            }
            Action::Drop => {
                queued.remove(step.label.as_deref().unwrap_or_default());
                "dropped".to_owned()
            }
            Action::Pause => {
                paused.insert(actor.clone());
                "frozen".to_owned()
            }
            Action::Resume => {
                paused.remove(&actor);
                due.extend(
                    order
                        .iter()
                        .filter(|l| queued.get(*l).is_some_and(|w| w.actor == actor))
                        .cloned(),
                );
                String::new()
            }
            Action::Flood => {
                // One statement for the whole flood (10,000 round trips would only
                // measure the network); every row is still an unconditional upsert.
                let token = run.token_for(step).unwrap_or_default() as i64;
                let count = step.count.unwrap_or(0) as i64;
                let applied = db
                    .client
                    .execute(
                        "INSERT INTO replay_control.objects (resource, key, value, token)
                         SELECT $1, 'flood-' || i, 'stale', $2 FROM generate_series(0::bigint, $3::bigint - 1) AS i
                         ON CONFLICT (resource, key) DO UPDATE
                         SET value = excluded.value, token = excluded.token",
                        &[&run.resource(step), &token, &count],
                    )
                    .await
                    .map_err(|e| harness(number)(e.to_string()))?;
                if applied as i64 == count {
                    landed.insert(step.label.clone().unwrap_or_default());
                }
                format!("{applied} stale writes applied unconditionally")
            }
            _ => "not applicable without the gateway".to_owned(),
        };
        let mut text = text;
        for label in due {
            if let Some(puts) = queued_txns.remove(&label) {
                for write in puts {
                    apply(write).await.map_err(harness(number))?;
                }
                landed.insert(label.clone());
                text.push_str(&format!("{label}'s puts applied unconditionally; "));
            }
            if let Some(write) = queued.remove(&label) {
                let ok = apply(write).await.map_err(harness(number))?;
                if ok {
                    landed.insert(label.clone());
                }
                text.push_str(&format!("{label} applied unconditionally: {ok}; "));
            }
        }
        let action = run.describe(step);
        run.print(
            number,
            if actor.is_empty() { "-" } else { &actor },
            &action,
            text.trim_end_matches("; "),
        );
    }
    for label in &scenario.control.wrong {
        if !landed.contains(label) {
            return Err(RunError::Mismatch {
                scenario: name.clone(),
                step: 0,
                line: format!("control run: write {label}"),
                expected: format!("{label} lands without fencing"),
                observed: format!("{label} did not land"),
            });
        }
    }
    for stored in &scenario.control.stored {
        let resource = format!(
            "{}-{}",
            stored.resource.as_deref().unwrap_or(&scenario.resource),
            run.id
        );
        let row = db
            .client
            .query_opt(
                "SELECT value FROM replay_control.objects WHERE resource = $1 AND key = $2",
                &[&resource, &stored.key],
            )
            .await
            .map_err(|e| harness(0)(e.to_string()))?;
        let value: Option<String> = row.map(|r| r.get(0));
        if value.as_deref() != Some(stored.value.as_str()) {
            return Err(RunError::Mismatch {
                scenario: name.clone(),
                step: 0,
                line: format!(
                    "control run: stored {}/{}",
                    stored.resource.as_deref().unwrap_or(&scenario.resource),
                    stored.key
                ),
                expected: format!("value {:?}", stored.value),
                observed: format!("value {value:?}"),
            });
        }
    }
    let summary = format!(
        "control run: {} wrong write(s) landed without fencing: {}",
        scenario.control.wrong.len(),
        scenario.control.wrong.join(", ")
    );
    if echo {
        println!("{summary}");
    }
    run.lines.push(summary);
    Ok(run.lines)
}

async fn lease_step(run: &mut Run<'_>, step: &Step) -> Result<String, String> {
    let actor = step.actor.clone().unwrap_or_default();
    let ttl = run.scenario.lease.ttl;
    let lease = run.lease();
    Ok(match step.action {
        Action::Acquire => {
            let got = run.target.leases.acquire(&lease, &actor, ttl).await?;
            run.acquired(&actor, got).text
        }
        Action::Renew => {
            let token = run.tokens.get(&actor).copied().unwrap_or_default();
            let renewed = run.target.leases.renew(&lease, &actor, token, ttl).await?;
            format!("renewed: {renewed}")
        }
        Action::Expire => {
            run.target.leases.expire(&lease).await?;
            "expired".to_owned()
        }
        _ => {
            tokio::time::sleep(step.duration.unwrap_or_default()).await;
            "waited".to_owned()
        }
    })
}
