//! Randomised timelines: several writers, random acquisitions (each a new, higher
//! token), fence advances, writes held in the network and released later in any
//! order (a paused writer's writes are such held writes), and gateway restarts — then
//! the invariants, from the gateway's answers and the database's final state:
//!
//! 1. No write was accepted after a higher token had been accepted for its resource:
//!    an accepted write was never *sent* after an answer accepting a higher token.
//! 2. The durable highest equals the maximum accepted token.
//! 3. Every object's version counts its accepted writes, and its token and value are
//!    those of the accepted write that got that version.
//! 4. The run's history — every write and advance with its invocation, answer and
//!    outcome, and a read of every key after the last answer — is linearizable
//!    against the model of a fenced register ([`crate::history`]).
//!
//! A run is a pure function of its seed (the timeline; the interleaving of released
//! writes is the real one), so a failing seed can be replayed.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::history::{self, Entry, Op};
use crate::replay::target::Target;
use crate::replay::wire::{self, Reply, Request};

const WRITERS: usize = 3;
const KEYS: usize = 2;

/// One write or advance and what became of it.
struct Attempt {
    /// The proxy label of a write.
    label: Option<String>,
    /// The writer, for the history.
    client: u32,
    token: u64,
    key: Option<String>,
    value: String,
    sent: Instant,
    /// The wall-clock instant of the send, for the history.
    invoked: u64,
    answer: JoinHandle<(Result<Reply, String>, Instant, u64)>,
}

/// Counts of one run, for the summary.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub requests: usize,
    pub accepted: usize,
    pub rejected: usize,
    pub restarts: usize,
}

/// Runs the timeline of `seed` against `target` (local: it may restart gateway 1);
/// `Err` names the broken invariant.
pub async fn run_one(target: &Target, seed: u64) -> Result<Stats, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let resource = format!("rnd-{seed:016x}-{:04x}", rand::random::<u16>());
    let mut next_token = rng.random_range(1..5u64);
    let mut tokens: Vec<Option<u64>> = vec![None; WRITERS];
    let mut held: Vec<(String, usize)> = Vec::new();
    let mut attempts: Vec<Attempt> = Vec::new();
    let mut stats = Stats::default();
    let steps = rng.random_range(6..16);
    let replicas = target.replicas.len();
    for i in 0..steps {
        let writer = rng.random_range(0..WRITERS);
        let roll = rng.random_range(0..100);
        if roll < 25 || tokens[writer].is_none() {
            tokens[writer] = Some(next_token);
            next_token += rng.random_range(1..3);
            if rng.random_bool(0.3) {
                let token = tokens[writer].unwrap_or(1);
                let request = Request {
                    method: "POST".into(),
                    path: crate::http::advance_path(&resource),
                    headers: vec![("fencing-token".into(), token.to_string())],
                    body: String::new(),
                };
                let addr = target.replicas[rng.random_range(0..replicas)].hop.addr();
                attempts.push(send(addr, request, writer, token, None, String::new()));
            }
        } else if roll < 80 {
            let token = tokens[writer].unwrap_or(1);
            let key = format!("k{}", rng.random_range(0..KEYS));
            let value = format!("w{writer}-{i}");
            let label = format!("{resource}-{i}");
            let path = crate::http::kv_path(&resource, &key);
            let request = Request::put(&path, token, &format!("w{writer}"), &label, &value);
            let replica = rng.random_range(0..replicas);
            let hop = &target.replicas[replica].hop;
            let hold = rng.random_bool(0.4);
            if hold {
                hop.hold_request(&label);
            }
            attempts.push(send(hop.addr(), request, writer, token, Some(key), value));
            if hold {
                if !hop.wait_held(&label, 0, wire::PATIENCE).await {
                    return Err(format!("seed {seed}: a held write did not reach the proxy"));
                }
                held.push((label, replica));
            }
        } else if roll < 97 && !held.is_empty() {
            let (label, replica) = held.remove(rng.random_range(0..held.len()));
            target.replicas[replica].hop.release_request(&label);
        } else if roll >= 97 && target.is_local() {
            if let Some(process) = &target.replicas[0].process {
                // Restarts fall between requests: what is in flight to the gateway is
                // answered first (held writes wait in the proxy, not at the gateway).
                quiesce(&attempts, &held).await?;
                let mut gateway = process.lock().await;
                gateway.restart().await;
                // The gateway installs its SIGTERM handler only once it serves (see
                // `answered`); a restart right after a restart must not beat it.
                answered(gateway.addr()).await?;
                stats.restarts += 1;
            }
        }
    }
    for (label, replica) in held {
        target.replicas[replica].hop.release_request(&label);
    }
    check(target, seed, &resource, attempts, stats).await
}

/// Waits until the gateway at `addr` has answered a request.
async fn answered(addr: std::net::SocketAddr) -> Result<(), String> {
    wire::send_one(addr, &Request::get("/healthz"))
        .await
        .map(drop)
        .map_err(|e| format!("the restarted gateway does not answer: {e}"))
}

/// Waits until every attempt that is not held in a proxy has its answer.
async fn quiesce(attempts: &[Attempt], held: &[(String, usize)]) -> Result<(), String> {
    let deadline = Instant::now() + wire::PATIENCE;
    for attempt in attempts {
        let is_held = held
            .iter()
            .any(|(label, _)| Some(label) == attempt.label.as_ref());
        while !is_held && !attempt.answer.is_finished() {
            if Instant::now() > deadline {
                return Err("a request in flight got no answer before a restart".into());
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }
    Ok(())
}

fn send(
    addr: std::net::SocketAddr,
    request: Request,
    writer: usize,
    token: u64,
    key: Option<String>,
    value: String,
) -> Attempt {
    let label = request
        .headers
        .iter()
        .find(|(name, _)| name == crate::proxy::LABEL_HEADER)
        .map(|(_, value)| value.clone());
    let sent = Instant::now();
    let invoked = history::now();
    let answer = tokio::spawn(async move {
        let reply = wire::send_one(addr, &request).await;
        (reply, Instant::now(), history::now())
    });
    Attempt {
        label,
        client: writer as u32,
        token,
        key,
        value,
        sent,
        invoked,
        answer,
    }
}

/// An answered attempt.
struct Done {
    token: u64,
    key: Option<String>,
    value: String,
    sent: Instant,
    answered: Instant,
    accepted: bool,
    version: Option<u64>,
}

async fn check(
    target: &Target,
    seed: u64,
    resource: &str,
    attempts: Vec<Attempt>,
    mut stats: Stats,
) -> Result<Stats, String> {
    let fail = |what: String| Err(format!("seed {seed} (resource {resource}): {what}"));
    let mut done = Vec::new();
    let mut entries = Vec::new();
    for attempt in attempts {
        let (reply, answered, completed) = attempt.answer.await.map_err(|e| e.to_string())?;
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => return fail(format!("a request got no answer: {e}")),
        };
        let op = match &attempt.key {
            Some(key) => Op::Write {
                key: key.clone(),
                token: attempt.token,
                value: attempt.value.clone(),
                if_version: None,
            },
            None => Op::Advance {
                token: attempt.token,
            },
        };
        let outcome = history::outcome_of(&op, reply.status, &reply.body, None);
        entries.push(Entry {
            client: attempt.client,
            resource: resource.to_owned(),
            op,
            invoked: attempt.invoked,
            completed,
            outcome: outcome.map_err(|e| format!("seed {seed} (resource {resource}): {e}"))?,
        });
        let accepted = matches!(reply.status, 200 | 201);
        if !accepted && reply.status != 409 {
            return fail(format!("unexpected answer {} {}", reply.status, reply.body));
        }
        stats.requests += 1;
        stats.accepted += usize::from(accepted);
        stats.rejected += usize::from(!accepted);
        done.push(Done {
            token: attempt.token,
            key: attempt.key,
            value: attempt.value,
            sent: attempt.sent,
            answered,
            accepted,
            version: reply.field("version"),
        });
    }
    // 4. The history, with a read of every key, is linearizable.
    for key in 0..KEYS {
        entries.push(
            read(target, resource, &format!("k{key}"))
                .await
                .map_err(|e| format!("seed {seed} (resource {resource}): {e}"))?,
        );
    }
    if let Some(violation) = history::check(&entries).first() {
        return fail(format!("the history is not linearizable: {violation}"));
    }
    // 1. Never accepted after a higher token's acceptance was answered.
    if let Err(what) = no_acceptance_after_a_higher_token(&done) {
        return fail(what);
    }
    // 2. The durable highest is the maximum accepted token.
    let db = target
        .control
        .as_ref()
        .ok_or("the random replay needs the database")?;
    let highest: Option<i64> = db
        .client
        .query_opt(
            "SELECT highest FROM fencegate.fences WHERE resource = $1",
            &[&resource],
        )
        .await
        .map_err(|e| e.to_string())?
        .map(|row| row.get(0));
    let max_accepted = done
        .iter()
        .filter(|d| d.accepted)
        .map(|d| d.token as i64)
        .max();
    if highest != max_accepted {
        return fail(format!(
            "durable highest {highest:?}, maximum accepted token {max_accepted:?}"
        ));
    }
    // 3. Objects agree with the accepted history.
    let mut by_key: HashMap<&str, Vec<&Done>> = HashMap::new();
    for write in done.iter().filter(|d| d.accepted) {
        if let Some(key) = &write.key {
            by_key.entry(key).or_default().push(write);
        }
    }
    for (key, writes) in by_key {
        let row = db
            .client
            .query_opt(
                "SELECT value, token, version FROM fencegate.objects WHERE resource = $1 AND key = $2",
                &[&resource, &key],
            )
            .await
            .map_err(|e| e.to_string())?;
        let Some(row) = row else {
            return fail(format!("{key}: accepted writes but no object"));
        };
        let (value, token, version): (Vec<u8>, i64, i64) = (row.get(0), row.get(1), row.get(2));
        let mut versions: Vec<u64> = writes.iter().filter_map(|w| w.version).collect();
        versions.sort_unstable();
        if versions != (1..=writes.len() as u64).collect::<Vec<_>>()
            || version as usize != writes.len()
        {
            return fail(format!(
                "{key}: versions {versions:?} of {} accepted writes, stored version {version}",
                writes.len()
            ));
        }
        let last = writes
            .iter()
            .find(|w| w.version == Some(version as u64))
            .expect("checked above");
        if last.token as i64 != token || last.value.as_bytes() != value.as_slice() {
            return fail(format!(
                "{key}: stored token {token} value {:?}, the write with version {version} had token {} value {:?}",
                String::from_utf8_lossy(&value), last.token, last.value
            ));
        }
        // Versions follow tokens: a later version never carries a lower token.
        let mut ordered = writes.clone();
        ordered.sort_by_key(|w| w.version);
        if ordered.windows(2).any(|pair| pair[1].token < pair[0].token) {
            return fail(format!("{key}: a later version carries a lower token"));
        }
    }
    Ok(stats)
}

/// A read of `key` through the first gateway, as a history entry of a client of its
/// own.
async fn read(target: &Target, resource: &str, key: &str) -> Result<Entry, String> {
    let op = Op::Read {
        key: key.to_owned(),
    };
    let invoked = history::now();
    let reply = wire::send_one(
        target.replicas[0].addr,
        &Request::get(&crate::http::kv_path(resource, key)),
    )
    .await?;
    let completed = history::now();
    let outcome = history::outcome_of(&op, reply.status, &reply.body, reply.etag.as_deref())?;
    Ok(Entry {
        client: WRITERS as u32,
        resource: resource.to_owned(),
        op,
        invoked,
        completed,
        outcome,
    })
}

/// Invariant 1 on a history: no write was accepted if it was sent after an answer that
/// accepted a higher token.
fn no_acceptance_after_a_higher_token(done: &[Done]) -> Result<(), String> {
    for late in done.iter().filter(|d| d.accepted) {
        if let Some(earlier) = done
            .iter()
            .find(|e| e.accepted && e.token > late.token && e.answered < late.sent)
        {
            return Err(format!(
                "token {} was accepted although token {} had been accepted before it was sent",
                late.token, earlier.token
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn done(token: u64, sent_ms: u64, answered_ms: u64, accepted: bool) -> Done {
        let zero = Instant::now();
        Done {
            token,
            key: Some("k".into()),
            value: String::new(),
            sent: zero + Duration::from_millis(sent_ms),
            answered: zero + Duration::from_millis(answered_ms),
            accepted,
            version: None,
        }
    }

    /// The check is live: a stale write accepted after the newer term's accepted
    /// answer is caught; the same write rejected, or overlapping in time, is fine.
    #[test]
    fn a_stale_acceptance_is_caught() {
        let stale = [done(8, 0, 5, true), done(7, 10, 12, true)];
        let error = no_acceptance_after_a_higher_token(&stale).unwrap_err();
        assert!(error.contains("token 7 was accepted"), "{error}");

        let rejected = [done(8, 0, 5, true), done(7, 10, 12, false)];
        assert!(no_acceptance_after_a_higher_token(&rejected).is_ok());
        // Sent before the higher token's answer: concurrent, either order is allowed.
        let concurrent = [done(8, 0, 5, true), done(7, 3, 6, true)];
        assert!(no_acceptance_after_a_higher_token(&concurrent).is_ok());
    }
}
