//! The writers of a fault run ([`super::run`]): each takes turns holding the hosted lease
//! of a resource and writes with its token, through the gateways' HTTP APIs or, to a
//! fenced table, through their Postgres doors (tokio-postgres or `psql`); every acquire,
//! write and final read goes into the run's history.
//!
//! Acquires are sent with an `Idempotency-Key` and retried with it until answered, so
//! every term's token is known (an acquire raises the fence). Writes are not retried:
//! an answer that does not say whether a write was applied (`503` with
//! `write_applied: null`, a broken connection) is indeterminate in the history.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Method;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::gateway::Gateway;
use crate::history::{self, Entry, Op, Outcome, Recorder};
use crate::http::{kv_path, Client};

/// Writer tasks per fault.
pub(super) const WRITERS: u32 = 4;

/// Writes a writer sends in each term before it releases the lease.
const WRITES_PER_TERM: usize = 6;

/// The keys of each resource.
pub(super) const KEYS: [&str; 2] = ["k0", "k1"];
/// The keys of the door writers' resource: rows of its fenced table.
pub(super) const DOOR_KEYS: [&str; 2] = ["d0", "d1"];
/// How long a `psql` write may take, connection included.
const PSQL_TIMEOUT: Duration = Duration::from_secs(10);

/// The hosted lease's time to live: a writer that lost its gateway mid-term holds it up
/// for this long at most.
const LEASE_TTL_MS: u64 = 3_000;

/// How long one request may take: well above the gateways' backend deadline.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A writer: takes the resource's lease when it is free, writes a few times with its
/// token through the gateways in turn, releases it, and sends one more write with the
/// released token, as a delayed request of the old term would arrive.
pub(super) struct Writer {
    pub(super) client: u32,
    pub(super) resource: String,
    /// The gateways' HTTP APIs: leases are taken there whatever `via` writes through.
    pub(super) gateways: Vec<Client>,
    pub(super) via: Via,
    pub(super) recorder: Recorder,
    /// Answers `500 internal` this run's writers had.
    pub(super) internal: Arc<AtomicUsize>,
    pub(super) cancel: CancellationToken,
    /// How long an acquire is retried (with its idempotency key) until it has an answer.
    pub(super) patience: Duration,
}

impl Writer {
    pub(super) async fn run(self) {
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
        while started.elapsed() < self.patience {
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
        panic!(
            "an acquire had no answer within {:?}: {last}",
            self.patience
        );
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
pub(super) async fn final_read(
    gateway: &Client,
    client: u32,
    resource: &str,
    key: &str,
    patience: Duration,
) -> Entry {
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
            started.elapsed() < patience,
            "{key} is not readable after the fault"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How a writer writes.
pub(super) enum Via {
    /// `PUT /v1/kv/...` on the gateways' HTTP APIs.
    Http,
    /// Rows of a fenced table, through the gateways' Postgres doors.
    Door(Door),
}

/// A fenced table written through the doors.
pub(super) struct Door {
    /// The doors' URLs, taken in turn.
    pub(super) urls: Vec<String>,
    pub(super) table: String,
    /// Each write a `psql` process of its own; else a tokio-postgres session.
    pub(super) psql: bool,
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
pub(super) fn door_url(superuser_url: &str, gateway: &Gateway) -> String {
    let rest = superuser_url
        .strip_prefix("postgres://")
        .expect("a postgres:// URL");
    let (userinfo, after) = rest.split_once('@').expect("a user and password");
    let database = after.split_once('/').map_or("postgres", |(_, db)| db);
    format!("postgres://{userinfo}@{}/{database}", gateway.pg_addr())
}

/// A fenced table of `resource` with a row for each of [`DOOR_KEYS`] at version 0.
pub(super) async fn fenced_table(superuser_url: &str, resource: &str) -> String {
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
pub(super) async fn final_row(
    superuser_url: &str,
    table: &str,
    resource: &str,
    key: &str,
    patience: Duration,
) -> Entry {
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
            started.elapsed() < patience,
            "{key} of {table} is not readable after the fault"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A hosted lease granted to `holder`, retried until granted: its token.
pub(super) async fn grant(
    client: &Client,
    resource: &str,
    holder: &str,
    patience: Duration,
) -> u64 {
    let started = Instant::now();
    loop {
        if let Some(token) = try_grant(client, resource, holder).await {
            return token;
        }
        assert!(
            started.elapsed() < patience,
            "{holder} was never granted {resource}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(super) async fn try_grant(client: &Client, resource: &str, holder: &str) -> Option<u64> {
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
