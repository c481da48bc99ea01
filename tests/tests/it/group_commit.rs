//! Group commit on Postgres: writes that queue while the write lanes are busy are
//! applied together in one transaction, each still checked against its own fence.
//!
//! To make a group form for certain, a test holds the fence row of a `blocker`
//! resource locked from its own connection and sends one write to it: the gateway's
//! only lane (`--write-lanes 1`) waits on that lock, the writes sent next queue behind
//! it, and releasing the lock lets the lane take them all as one group. (The lane's
//! lock timeout is raised for this, `--write-lock-timeout 60s`; with the default the
//! blocked write would leave the lane after 200 ms — which the last test shows.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::{Client, Reply};
use tokio::task::JoinSet;

/// Writes queued behind the blocker in each test.
const QUEUED: usize = 40;

/// Starts a gateway with one write lane on a new database.
async fn one_lane() -> (TestDb, Gateway) {
    on_new_database(&["--write-lanes", "1", "--write-lock-timeout", "60s"]).await
}

/// Starts a gateway with `flags` on a new database.
async fn on_new_database(flags: &[&str]) -> (TestDb, Gateway) {
    let db = TestDb::create().await;
    let gateway = Gateway::builder()
        .database(&db.url())
        .args(flags)
        .spawn()
        .await;
    (db, gateway)
}

/// Holds the `blocker` fence row locked until the returned transaction's connection
/// commits, and returns the blocked write that occupies the only lane meanwhile.
struct Blocker {
    db: tokio_postgres::Client,
    write: tokio::task::JoinHandle<Reply>,
}

impl Blocker {
    async fn start(db: &TestDb, client: &Client) -> Blocker {
        assert_eq!(client.put("blocker", "k", 1, "first").await.status, 201);
        let connection = db.lock_fence("blocker").await;
        let blocked = client.clone();
        let write = tokio::spawn(async move { blocked.put("blocker", "k", 2, "second").await });
        // The blocked write must be the one in the lane before the others queue.
        wait_for_lock_waiter(db).await;
        Blocker {
            db: connection,
            write,
        }
    }

    async fn release(self) {
        self.db.batch_execute("COMMIT").await.unwrap();
        assert_eq!(self.write.await.unwrap().status, 200);
    }
}

/// Waits until some session waits for a lock (the lane's write on the blocker row).
async fn wait_for_lock_waiter(db: &TestDb) {
    fencegate_tests::eventually(
        Duration::from_secs(5),
        "the write to the blocker waits for its lock",
        || async { db.lock_waiters().await > 0 },
    )
    .await;
}

/// Sends `writes` while the only lane is held up by the blocker, so that they queue,
/// then releases it: the lane applies them as one group. Returns the replies in order.
async fn send_as_one_group(
    db: &TestDb,
    client: &Client,
    writes: Vec<(String, String, u64)>,
) -> Vec<Reply> {
    let blocker = Blocker::start(db, client).await;
    let sent = tokio::spawn({
        let client = client.clone();
        async move { send_all(&client, writes).await }
    });
    // Give the writes time to queue behind the blocked lane.
    tokio::time::sleep(Duration::from_millis(300)).await;
    blocker.release().await;
    let replies = sent.await.unwrap();
    assert!(
        largest_group(client).await >= 16.0,
        "the queued writes were not applied as a group"
    );
    replies
}

/// Sends `writes` all at once, and returns their replies in order.
async fn send_all(client: &Client, writes: Vec<(String, String, u64)>) -> Vec<Reply> {
    let mut set = JoinSet::new();
    for (i, (resource, key, token)) in writes.into_iter().enumerate() {
        let client = client.clone();
        set.spawn(async move {
            let value = format!("{resource}/{key}@{token}#{i}");
            (i, client.put(&resource, &key, token, value).await)
        });
    }
    let mut replies: Vec<(usize, Reply)> = set.join_all().await;
    replies.sort_by_key(|(i, _)| *i);
    replies.into_iter().map(|(_, reply)| reply).collect()
}

/// The largest group the gateway applied, from `fencegate_commit_group_size`: the
/// smallest bucket bound that holds every group.
async fn largest_group(client: &Client) -> f64 {
    let metrics = client.metrics().await;
    let count = fencegate_tests::http::metric_value(&metrics, "fencegate_commit_group_size_count")
        .expect("the group size histogram is exported");
    for bound in ["1", "2", "4", "8", "16", "32", "64", "128", "256"] {
        let series = format!("fencegate_commit_group_size_bucket{{le=\"{bound}\"}}");
        if fencegate_tests::http::metric_value(&metrics, &series) == Some(count) {
            return bound.parse().unwrap();
        }
    }
    f64::INFINITY
}

#[tokio::test]
async fn each_write_of_a_group_is_checked_against_the_fence_the_writes_before_it_left() {
    let (db, gateway) = one_lane().await;
    let client = gateway.client();
    // Random tokens on one key: which are accepted depends on the order inside the group.
    let writes: Vec<_> = (0..QUEUED)
        .map(|_| ("g".to_owned(), "k".to_owned(), rand::random_range(1..=12)))
        .collect();
    let tokens: Vec<u64> = writes.iter().map(|(_, _, token)| *token).collect();
    let replies = send_as_one_group(&db, &client, writes).await;

    let mut accepted = Vec::new();
    for (token, reply) in tokens.iter().zip(&replies) {
        let body = reply.json();
        match reply.status {
            200 | 201 => accepted.push((body["version"].as_u64().unwrap(), *token)),
            409 => assert!(body["highest"].as_u64().unwrap() > *token, "{body}"),
            other => panic!("unexpected {other}: {body}"),
        }
    }
    accepted.sort();
    let versions: Vec<u64> = accepted.iter().map(|(version, _)| *version).collect();
    assert_eq!(versions, (1..=accepted.len() as u64).collect::<Vec<_>>());
    assert!(
        accepted.windows(2).all(|pair| pair[0].1 <= pair[1].1),
        "a write was applied after a higher token: {accepted:?}"
    );
    let max = *tokens.iter().max().unwrap();
    assert_eq!(accepted.last().unwrap().1, max);
    assert_eq!(db.highest("g").await, Some(max as i64));
    let (_, stored_token, stored_version) = db.object("g", "k").await.unwrap();
    assert_eq!(
        (stored_token as u64, stored_version as u64),
        (max, accepted.len() as u64)
    );
}

/// A group of one token per resource and no repeated object is one statement; the
/// poisoned writes there share a token and have keys of their own.
#[tokio::test]
async fn a_write_that_fails_leaves_nothing_and_does_not_fail_its_group_statement() {
    let refused = "write group refused; applying its writes one by one";
    poisoned_group(|i| (format!("poison{i}"), 50), refused).await;
}

/// Poisoned writes that repeat one object with rising tokens make the group a
/// transaction of several statements.
#[tokio::test]
async fn a_write_that_fails_leaves_nothing_and_does_not_fail_its_group_transaction() {
    let rolled_back = "write group rolled back; applying its writes one by one";
    poisoned_group(|i| ("poison".to_owned(), 50 + i as u64), rolled_back).await;
}

/// Sends a group in which every tenth write is refused by the database (a trigger
/// raises on keys starting with `poison`), the poisoned writes' key and token given by
/// `poisoned`: those answer 500 and leave nothing, every other write is applied, after
/// the gateway logged `event` for the group.
async fn poisoned_group(poisoned: fn(usize) -> (String, u64), event: &str) {
    let (db, gateway) = one_lane().await;
    let client = gateway.client();
    db.execute(
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.key LIKE 'poison%' THEN RAISE EXCEPTION 'poisoned write'; END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER refuse_poison BEFORE INSERT OR UPDATE ON fencegate.objects
                 FOR EACH ROW EXECUTE FUNCTION refuse_poison();",
    )
    .await;
    let writes: Vec<_> = (0..QUEUED)
        .map(|i| {
            if i % 10 == 3 {
                let (key, token) = poisoned(i);
                ("p".to_owned(), key, token)
            } else {
                // One token per resource: every one is accepted, whatever the order.
                (format!("r{}", i % 7), format!("k{i}"), 1 + (i % 7) as u64)
            }
        })
        .collect();
    let expected: Vec<_> = writes.clone();
    let replies = send_as_one_group(&db, &client, writes).await;

    for ((resource, key, token), reply) in expected.iter().zip(&replies) {
        if key.starts_with("poison") {
            assert_eq!(reply.status, 500, "{}", reply.json());
            assert_eq!(reply.error_code(), "internal");
            continue;
        }
        assert_eq!(reply.status, 201, "{resource}/{key}: {}", reply.json());
        let (_, stored_token, _) = db.object(resource, key).await.expect("stored");
        assert_eq!(stored_token as u64, *token);
    }
    // The refused writes raised no fence and stored nothing.
    assert_eq!(db.highest("p").await, None);
    for (_, key, _) in expected.iter().filter(|(r, ..)| r == "p") {
        assert_eq!(db.object("p", key).await, None);
    }
    // The group failed as a whole before its writes were applied one by one.
    assert!(
        !gateway.events(event).is_empty(),
        "no \"{event}\": the group did not take the path under test"
    );
}

/// Two gateways, two lanes each, writers spreading writes over a few resources in
/// random order: groups lock several fence rows each, and would deadlock if they took
/// them in different orders. Postgres would then abort one after `deadlock_timeout`, and
/// the gateway would log the failed group before retrying its writes one by one.
/// (The lanes' lock timeout is raised above `deadlock_timeout` for this, or it would
/// end a deadlock first, quietly.) Rising tokens make groups of mixed tokens per
/// resource, applied as transactions.
#[tokio::test]
async fn group_transactions_on_several_resources_never_deadlock() {
    let next_token = Arc::new(AtomicU64::new(1));
    let statuses =
        writes_on_several_resources(move |_| next_token.fetch_add(1, Ordering::Relaxed)).await;
    for (status, body) in &statuses {
        assert!(
            matches!(status, 200 | 201 | 409),
            "unexpected {status}: {body}"
        );
    }
}

/// The same with one token per resource: every group is one statement.
#[tokio::test]
async fn group_statements_on_several_resources_never_deadlock() {
    let statuses = writes_on_several_resources(|resource| resource as u64 + 1).await;
    for (status, body) in &statuses {
        assert!(matches!(status, 200 | 201), "unexpected {status}: {body}");
    }
}

/// 32 writers through two gateways, 25 writes each to one of four resources at random,
/// with the token `token` gives for the resource's index; their answers.
async fn writes_on_several_resources(
    token: impl Fn(usize) -> u64 + Send + Sync + 'static,
) -> Vec<(u16, serde_json::Value)> {
    let db = TestDb::create().await;
    let mut clients = Vec::new();
    let mut gateways = Vec::new();
    for _ in 0..2 {
        let gateway = Gateway::builder()
            .database(&db.url())
            .arg("--write-lanes")
            .arg("2")
            .arg("--write-lock-timeout")
            .arg("60s")
            .spawn()
            .await;
        clients.push(gateway.client());
        gateways.push(gateway);
    }
    let token = Arc::new(token);
    let mut writers = JoinSet::new();
    for writer in 0..32 {
        let client = clients[writer % 2].clone();
        let token = Arc::clone(&token);
        writers.spawn(async move {
            let mut statuses = Vec::new();
            for i in 0..25 {
                let index = rand::random_range(0..4);
                let resource = ["a", "b", "c", "d"][index];
                let reply = client
                    .put(
                        resource,
                        &format!("w{writer}"),
                        token(index),
                        format!("{i}"),
                    )
                    .await;
                statuses.push((reply.status, reply.json()));
            }
            statuses
        });
    }
    let statuses: Vec<_> = writers.join_all().await.into_iter().flatten().collect();
    let mut grouped = 0.0;
    for client in &clients {
        grouped += largest_group(client).await;
    }
    assert!(grouped > 2.0, "no group formed: the test proved nothing");
    for gateway in &gateways {
        for event in [
            "write group rolled back; applying its writes one by one",
            "write group refused; applying its writes one by one",
        ] {
            let failed = gateway.events(event);
            assert!(failed.is_empty(), "{failed:?}");
        }
    }
    statuses
}

/// A resource whose fence row someone else holds locked for long does not hold up the
/// writes of other resources, even with a single write lane: its first write leaves the
/// lane after `--write-lock-timeout`, its later ones queue behind it off the lanes
/// (`fencegate_writes_off_lanes`), and they are applied in their order once the lock is
/// released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_resource_does_not_stall_the_others() {
    let (db, gateway) = on_new_database(&["--write-lanes", "1"]).await;
    let client = gateway.client();
    assert_eq!(client.put("locked", "k", 1, "v0").await.status, 201);
    let holder = db.lock_fence("locked").await;
    let mut blocked = JoinSet::new();
    for i in 1..=3u64 {
        let writer = client.clone();
        blocked.spawn(async move { (i, writer.put("locked", "k", 1 + i, format!("v{i}")).await) });
        // Each write has left the lanes — the first after waiting there for the lock,
        // the next ones behind it — before the next is sent, so the writes arrive in
        // their order however slowly the machine runs.
        fencegate_tests::eventually(
            Duration::from_secs(10),
            "each locked write waits off the lanes before the next is sent",
            || async { client.metric("fencegate_writes_off_lanes").await == Some(i as f64) },
        )
        .await;
    }

    // Other resources, many at once, while "locked" stays locked.
    let started = std::time::Instant::now();
    let others: Vec<_> = (0..QUEUED)
        .map(|i| (format!("free{}", i % 5), format!("k{i}"), 1))
        .collect();
    for reply in send_all(&client, others).await {
        assert!(matches!(reply.status, 200 | 201), "{:?}", reply.body);
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "writes to other resources waited {took:?} for a lock they do not need"
    );
    assert!(blocked.try_join_next().is_none(), "the locked writes wait");

    holder.batch_execute("COMMIT").await.unwrap();
    let mut replies = blocked.join_all().await;
    replies.sort_by_key(|(i, _)| *i);
    for (i, reply) in &replies {
        assert_eq!(reply.status, 200, "write {i}: {:?}", reply.body);
        assert_eq!(reply.json()["version"], 1 + i, "in their order");
    }
    assert_eq!(db.highest("locked").await, Some(4));
    assert_eq!(client.metric("fencegate_writes_off_lanes").await, Some(0.0));
}

/// A write that waits for a lock past `--backend-timeout` is cancelled in Postgres
/// before its 503: nothing of it waits on, and it never lands when the lock is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_given_up_on_is_cancelled_in_postgres() {
    let (db, gateway) = on_new_database(&["--backend-timeout", "1s"]).await;
    let client = gateway.client();
    assert_eq!(client.put("locked", "k", 1, "v1").await.status, 201);
    let holder = db.lock_fence("locked").await;
    let reply = client.put("locked", "k", 2, "v2").await;
    assert_eq!(reply.status, 503, "{:?}", reply.body);
    assert_eq!(reply.json()["error"], "backend_unavailable");
    fencegate_tests::eventually(
        Duration::from_secs(2),
        "no session to wait for the lock",
        || async { db.lock_waiters().await == 0 },
    )
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        db.object("locked", "k").await.map(|(v, ..)| v),
        Some(b"v1".to_vec())
    );
    assert_eq!(db.highest("locked").await, Some(1));
}

/// A write of `(resource, key, token, value, extra headers)` as a test sends it.
type Request = (String, String, u64, String, Vec<(String, String)>);

/// Sends `requests` all at once while the only lane is held up by the blocker, so that
/// they queue and are applied as one group, and returns their replies in order.
async fn send_as_one_group_with(
    db: &TestDb,
    client: &Client,
    requests: Vec<Request>,
) -> Vec<Reply> {
    let blocker = Blocker::start(db, client).await;
    let mut set = JoinSet::new();
    for (i, request) in requests.into_iter().enumerate() {
        let client = client.clone();
        set.spawn(async move { (i, put_with(&client, &request).await) });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    blocker.release().await;
    let mut replies: Vec<(usize, Reply)> = set.join_all().await;
    replies.sort_by_key(|(i, _)| *i);
    assert!(
        largest_group(client).await >= 16.0,
        "the queued writes were not applied as a group"
    );
    replies.into_iter().map(|(_, reply)| reply).collect()
}

async fn put_with(client: &Client, (resource, key, token, value, extra): &Request) -> Reply {
    let token = token.to_string();
    let mut headers = vec![("fencing-token", token.as_str())];
    headers.extend(
        extra
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str())),
    );
    client
        .request(
            http::Method::PUT,
            &fencegate_tests::http::kv_path(resource, key),
            &headers,
            value.clone(),
        )
        .await
}

fn request(resource: &str, key: &str, token: u64, value: &str, extra: &[(&str, &str)]) -> Request {
    (
        resource.to_owned(),
        key.to_owned(),
        token,
        value.to_owned(),
        extra
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect(),
    )
}

/// Keyed, conditional, stale and plain writes queued together are applied as one
/// group (`fencegate_commit_group_size`), each answered as alone: keyed ones stored
/// and replayed byte for byte, a failed precondition and a stale token refused — and
/// a keyed refusal stored — without undoing the others; a key twice in the group runs
/// once, its repeat answered from its record; a key reused for another request is
/// refused. (The fence cache is kept from refusing early, so that stale writes reach
/// the group.)
#[tokio::test]
async fn keyed_conditional_and_stale_writes_ride_one_group() {
    let (db, gateway) = on_new_database(&[
        "--write-lanes",
        "1",
        "--write-lock-timeout",
        "60s",
        "--no-cache-rejections",
    ])
    .await;
    let client = gateway.client();
    for key in ["x0", "x1", "x2"] {
        assert_eq!(client.put("cond", key, 1, "v1").await.status, 201);
    }
    assert_eq!(client.advance("stale", 5).await.status, 200);
    let mut requests = Vec::new();
    for i in 0..10 {
        let idem = format!("keyed-{i}");
        requests.push(request(
            "kd",
            &format!("k{i}"),
            1,
            "v",
            &[("idempotency-key", &idem)],
        ));
    }
    for i in 0..3 {
        requests.push(request(
            "cond",
            &format!("new{i}"),
            1,
            "v",
            &[("if-none-match", "*")],
        ));
        requests.push(request(
            "cond",
            &format!("x{i}"),
            1,
            "v2",
            &[("if-match", "\"7\"")],
        ));
    }
    for i in 0..3 {
        let idem = format!("stale-{i}");
        requests.push(request(
            "stale",
            &format!("s{i}"),
            4,
            "late",
            &[("idempotency-key", &idem)],
        ));
        requests.push(request("stale", &format!("u{i}"), 3, "late", &[]));
    }
    requests.push(request(
        "cond",
        "x0",
        1,
        "keyed-cas",
        &[("if-match", "\"9\""), ("idempotency-key", "cas")],
    ));
    requests.push(request(
        "dup",
        "k",
        1,
        "same",
        &[("idempotency-key", "dup")],
    ));
    requests.push(request(
        "dup",
        "k",
        1,
        "same",
        &[("idempotency-key", "dup")],
    ));
    requests.push(request(
        "reuse",
        "k",
        1,
        "first",
        &[("idempotency-key", "reuse")],
    ));
    requests.push(request(
        "reuse",
        "k",
        1,
        "other",
        &[("idempotency-key", "reuse")],
    ));
    let expected = requests.clone();
    let replies = send_as_one_group_with(&db, &client, requests).await;

    let replayed = |reply: &Reply| reply.header("idempotency-replayed") == Some("true");
    let mut reuse = Vec::new();
    let mut dup = Vec::new();
    for (request, reply) in expected.iter().zip(&replies) {
        let (resource, key, _, _, extra) = request;
        let label = format!("{resource}/{key} {extra:?}: {}", reply.json());
        match (resource.as_str(), key.as_str()) {
            ("kd", _) => assert_eq!((reply.status, replayed(reply)), (201, false), "{label}"),
            ("cond", new) if new.starts_with("new") => assert_eq!(reply.status, 201, "{label}"),
            ("cond", "x0") if extra.len() == 2 => {
                assert_eq!(reply.status, 412, "{label}");
                assert_eq!(reply.json()["current"], 1, "{label}");
            }
            ("cond", _) => assert_eq!(reply.status, 412, "{label}"),
            ("stale", _) => {
                assert_eq!(reply.error_code(), "stale_token", "{label}");
                assert_eq!(reply.json()["highest"], 5, "{label}");
            }
            ("dup", _) => dup.push(reply),
            ("reuse", _) => reuse.push(reply),
            other => panic!("{other:?}"),
        }
    }
    // A key twice in the group: applied once, the repeat answered from its record.
    assert_eq!(dup.iter().map(|r| r.status).collect::<Vec<_>>(), [201, 201]);
    assert_eq!(dup.iter().filter(|r| replayed(r)).count(), 1);
    assert_eq!(db.object("dup", "k").await.unwrap().2, 1, "written once");
    let mut statuses: Vec<u16> = reuse.iter().map(|r| r.status).collect();
    statuses.sort();
    assert_eq!(statuses, [201, 422]);
    // Every stored answer replays byte for byte; refusals included.
    for (request, reply) in expected.iter().zip(&replies) {
        if request.4.iter().any(|(name, _)| name == "idempotency-key") && request.0 != "reuse" {
            let again = put_with(&client, request).await;
            assert_eq!(
                (again.status, replayed(&again)),
                (reply.status, true),
                "{request:?}"
            );
            assert_eq!(again.body, reply.body, "{request:?}");
        }
    }
    for i in 0..10 {
        assert_eq!(db.object("kd", &format!("k{i}")).await.unwrap().2, 1);
    }
    assert_eq!(db.highest("stale").await, Some(5));
    assert_eq!(
        db.object("cond", "x0").await.unwrap().2,
        1,
        "the failed CAS wrote nothing"
    );
}

/// A group with keyed writes that the database refuses as a set: its keyed writes are
/// each applied in a transaction of their own — the others applied once, their answers
/// stored; the refused one stores nothing — and retries get the stored answers.
#[tokio::test]
async fn keyed_writes_of_a_failed_group_are_applied_alone() {
    let (db, gateway) = one_lane().await;
    let client = gateway.client();
    db.execute(
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.key LIKE 'poison%' THEN RAISE EXCEPTION 'poisoned write'; END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER refuse_poison BEFORE INSERT OR UPDATE ON fencegate.objects
                 FOR EACH ROW EXECUTE FUNCTION refuse_poison();",
    )
    .await;
    let requests: Vec<Request> = (0..QUEUED)
        .map(|i| {
            let key = if i % 10 == 3 {
                format!("poison{i}")
            } else {
                format!("k{i}")
            };
            let idem = format!("idem-{i}");
            let extra: Vec<(&str, &str)> = match i % 2 {
                0 => vec![("idempotency-key", &idem)],
                _ => vec![],
            };
            request(&format!("r{}", i % 5), &key, 1, "v", &extra)
        })
        .collect();
    let replies = send_as_one_group_with(&db, &client, requests.clone()).await;
    for (request, reply) in requests.iter().zip(&replies) {
        let (resource, key, ..) = request;
        if key.starts_with("poison") {
            assert_eq!(reply.error_code(), "internal", "{}", reply.json());
            assert_eq!(db.object(resource, key).await, None);
            continue;
        }
        assert_eq!(reply.status, 201, "{resource}/{key}: {}", reply.json());
        assert_eq!(db.object(resource, key).await.unwrap().2, 1);
        if !request.4.is_empty() {
            let again = put_with(&client, request).await;
            assert_eq!(
                (again.status, again.body.clone()),
                (201, reply.body.clone())
            );
            assert_eq!(again.header("idempotency-replayed"), Some("true"));
        }
    }
    let stored: i64 = db
        .value("SELECT count(*) FROM fencegate.idempotency WHERE key LIKE 'idem-%'")
        .await;
    let poisoned_keyed = requests
        .iter()
        .filter(|r| r.1.starts_with("poison") && !r.4.is_empty())
        .count();
    assert_eq!(
        stored as usize,
        QUEUED / 2 - poisoned_keyed,
        "no answer stored for a refused write"
    );
}

/// A key claimed through one replica, whose write is still open (it waits for a fence
/// row someone holds), is in flight on another: its retry there is told `409
/// idempotency_in_flight` and applies nothing; once the first commits, the retry gets
/// its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_open_on_one_replica_is_in_flight_on_another() {
    let db = TestDb::create().await;
    let replica = || Gateway::builder().database(&db.url()).spawn();
    let (one, two) = (replica().await, replica().await);
    let (a, b) = (one.client(), two.client());
    assert_eq!(a.put("r", "k", 5, "v0").await.status, 201);
    let holder = db.lock_fence("r").await;
    let write = request("r", "k", 5, "v1", &[("idempotency-key", "open")]);
    let first = tokio::spawn({
        let (a, write) = (a.clone(), write.clone());
        async move { put_with(&a, &write).await }
    });
    // The first attempt has claimed its key and waits for the fence row.
    fencegate_tests::eventually(
        Duration::from_secs(5),
        "the first attempt waits",
        || async {
            db.value::<i64>("SELECT count(*) FROM fencegate.idempotency WHERE key = 'open'")
                .await
                == 0
                && db.lock_waiters().await > 0
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let retry = put_with(&b, &write).await;
    assert_eq!(
        (retry.status, retry.error_code().as_str()),
        (409, "idempotency_in_flight"),
        "{}",
        retry.json()
    );
    holder.batch_execute("COMMIT").await.unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.status, 200, "{}", first.json());
    let again = put_with(&b, &write).await;
    assert_eq!(
        (again.status, again.body.clone()),
        (200, first.body.clone())
    );
    assert_eq!(again.header("idempotency-replayed"), Some("true"));
    assert_eq!(db.object("r", "k").await.unwrap().2, 2, "applied once");
}
