//! The stale flood: `count` writes of an old term held in the network on a few
//! connections (pipelined), released at once, while another writer keeps writing.

use crate::replay::runner::{Observed, Run};
use crate::replay::scenario::{Expect, Outcome, Step};
use crate::replay::wire::{self, Request};

/// Connections the flood is spread over unless the step says otherwise.
const DEFAULT_CONNECTIONS: usize = 50;
/// Writes the `meanwhile` writer makes while the flood is released.
const MEANWHILE_WRITES: usize = 20;

pub(crate) async fn run(run: &mut Run<'_>, number: usize, step: &Step) -> Result<Observed, String> {
    let actor = step.actor.clone().unwrap_or_default();
    let token = run.token_for(step).ok_or("the actor holds no token")?;
    let count = step.count.unwrap_or(0);
    let connections = step
        .connections
        .unwrap_or(DEFAULT_CONNECTIONS)
        .clamp(1, count.max(1));
    let label = step.label.clone().unwrap_or_default();
    let resource = run.resource(step);
    let hop = &run.target.replicas[step.via.unwrap_or(1) - 1].hop;
    let addr = hop.addr();

    let mut tasks = Vec::new();
    for connection in 0..connections {
        let key = run.key(&format!("{label}-{connection}"));
        let requests: Vec<Request> = (connection..count)
            .step_by(connections)
            .map(|i| {
                let path = crate::http::kv_path(&resource, &format!("flood-{i}"));
                Request::put(&path, token, &actor, &key, "stale")
            })
            .collect();
        hop.hold_request(&key);
        let bytes = wire::encoded_len(&requests);
        tasks.push((
            key,
            bytes,
            tokio::spawn(async move { wire::send(addr, &requests).await }),
        ));
    }
    for (key, bytes, _) in &tasks {
        if !hop.wait_held(key, *bytes, wire::PATIENCE).await {
            return Err(format!("flood connection {key} was not held in full"));
        }
    }
    run.print(
        number,
        &actor,
        &format!("flood {label}: {count} writes"),
        "all held in the network",
    );

    // The current holder keeps writing while the flood is released.
    let meanwhile = match &step.meanwhile {
        Some(writer) => {
            let token = *run
                .tokens
                .get(writer)
                .ok_or("the meanwhile writer holds no token")?;
            let path = crate::http::kv_path(&resource, step.key.as_deref().unwrap_or("k"));
            let writer = writer.clone();
            let key = run.key(&format!("{label}-meanwhile"));
            Some(tokio::spawn(async move {
                let mut accepted = 0;
                for i in 0..MEANWHILE_WRITES {
                    let request =
                        Request::put(&path, token, &writer, &key, &format!("meanwhile {i}"));
                    let reply = wire::send_one(addr, &request).await;
                    accepted +=
                        usize::from(reply.is_ok_and(|r| r.status == 200 || r.status == 201));
                }
                accepted
            }))
        }
        None => None,
    };
    for (key, _, _) in &tasks {
        hop.release_request(key);
    }
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for (_, _, task) in tasks {
        match task.await.map_err(|e| e.to_string())? {
            Ok(replies) => {
                for reply in replies {
                    let name = crate::replay::runner::outcome_of(reply.status)
                        .map_or_else(|| reply.status.to_string(), |o| o.name().to_owned());
                    *counts.entry(name).or_default() += 1;
                }
            }
            Err(e) => return Err(format!("a flood connection failed: {e}")),
        }
    }
    let rejected = counts.get("rejected").copied().unwrap_or(0);
    let summary: Vec<String> = counts.iter().map(|(k, v)| format!("{v} {k}")).collect();
    let mut text = summary.join(", ");
    let mut outcome = (rejected == count).then_some(Outcome::Rejected);
    if let Some(meanwhile) = meanwhile {
        let accepted = meanwhile.await.map_err(|e| e.to_string())?;
        text.push_str(&format!(
            "; meanwhile {accepted}/{MEANWHILE_WRITES} accepted"
        ));
        if accepted != MEANWHILE_WRITES {
            outcome = None;
        }
    }
    Ok(Observed {
        text,
        facts: Expect {
            outcome,
            accepted: Some(counts.get("accepted").copied().unwrap_or(0)),
            ..Expect::default()
        },
    })
}
