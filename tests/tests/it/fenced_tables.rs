//! Fenced tables written straight through Postgres — tokio-postgres and psql, no
//! gateway in between: every way of writing a protected table presents a current
//! token or fails inside its own transaction, with fencegate's SQLSTATE.

use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use fencegate_tests::db::{server_addr, via};
use fencegate_tests::eventually;
use fencegate_tests::fenced::{connect_with, detail_fields, fence_error, sqlstate, FencedDb};
use fencegate_tests::proxy::Proxy;
use futures_util::SinkExt;
use tokio_postgres::Client;

/// `orders`, fenced for resource `orders`, whose fence stands at 5.
async fn orders() -> FencedDb {
    let fenced = FencedDb::create().await;
    fenced
        .execute("CREATE TABLE orders (id int PRIMARY KEY, note text)")
        .await;
    assert_eq!(fenced.protect("orders", "orders").await, ["orders"]);
    fenced.raise("orders", 5).await;
    fenced
}

/// Every statement that writes a table, as one writer session would send it.
const WRITES: &[(&str, &str)] = &[
    ("insert", "INSERT INTO orders VALUES (100, 'inserted')"),
    ("update", "UPDATE orders SET note = 'updated' WHERE id = 1"),
    ("delete", "DELETE FROM orders WHERE id = 1"),
    (
        "data-modifying CTE",
        "WITH moved AS (UPDATE orders SET note = 'cte' WHERE id = 1 RETURNING id) SELECT count(*) FROM moved",
    ),
    (
        "insert ... on conflict",
        "INSERT INTO orders VALUES (1, 'upsert') ON CONFLICT (id) DO UPDATE SET note = EXCLUDED.note",
    ),
    (
        "a statement that changes no row",
        "UPDATE orders SET note = 'never' WHERE id = -1",
    ),
    ("truncate", "TRUNCATE orders"),
];

async fn reset_rows(fenced: &FencedDb) {
    fenced
        .unfenced(
            "orders",
            "DELETE FROM orders; INSERT INTO orders VALUES (1, 'original')",
        )
        .await;
}

async fn rows(fenced: &FencedDb) -> Vec<(i32, String)> {
    fenced
        .admin
        .query("SELECT id, note FROM orders ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Each write statement: refused without a token, with a stale one and with one that
/// is not a token — the table unchanged, with the documented SQLSTATE, DETAIL and HINT
/// — and accepted with the current token.
#[tokio::test]
async fn every_write_statement_needs_a_current_token() {
    let fenced = orders().await;
    let original = vec![(1, "original".to_owned())];
    for (what, sql) in WRITES {
        reset_rows(&fenced).await;

        let missing = fenced.run_as_writer(None, sql).await.unwrap_err();
        let error = fence_error(&missing);
        assert_eq!(error.code().code(), "ZF002", "{what}: {}", error.message());
        assert_eq!(error.detail(), Some("resource=orders"), "{what}");
        assert!(
            error
                .hint()
                .unwrap()
                .contains("fencegate.fence('orders', <token>)"),
            "{what}: {:?}",
            error.hint()
        );
        assert_eq!(error.table(), None, "{what}");

        let stale = fenced.run_as_writer(Some("4"), sql).await.unwrap_err();
        let error = fence_error(&stale);
        assert_eq!(error.code().code(), "ZF001", "{what}");
        assert_eq!(
            error.message(),
            "fencegate: stale fencing token 4 for resource \"orders\" (table public.orders): its highest accepted token is 5",
            "{what}"
        );
        assert_eq!(
            detail_fields(error),
            Some("resource=orders presented=4 highest=5"),
            "{what}"
        );
        assert!(error.hint().unwrap().contains("stop the work of this term"));
        assert_eq!(
            (error.schema(), error.table(), error.constraint()),
            (Some("public"), Some("orders"), Some("fencegate_fence")),
            "{what}"
        );

        for invalid in ["abc", "0", "-3", "9223372036854775808", "1.5"] {
            let refused = fenced.run_as_writer(Some(invalid), sql).await.unwrap_err();
            assert_eq!(
                fence_error(&refused).code().code(),
                "ZF003",
                "{what} with {invalid}"
            );
        }
        assert_eq!(
            rows(&fenced).await,
            original,
            "{what}: refused writes changed nothing"
        );

        fenced
            .run_as_writer(Some("5"), sql)
            .await
            .unwrap_or_else(|e| panic!("{what} with the current token: {e}"));
    }
    assert_eq!(fenced.highest("orders").await, Some(5));
}

/// COPY FROM fires the statement trigger like an INSERT.
#[tokio::test]
async fn copy_from_needs_a_current_token() {
    let fenced = orders().await;
    let copy = async |writer: &Client| -> Result<u64, tokio_postgres::Error> {
        let sink = writer.copy_in("COPY orders FROM STDIN").await?;
        futures_util::pin_mut!(sink);
        sink.send(Bytes::from_static(b"7\tcopied\n8\tcopied\n"))
            .await?;
        sink.finish().await
    };
    assert_eq!(sqlstate(copy(&fenced.writer("").await).await), "ZF002");
    assert_eq!(
        sqlstate(copy(&fenced.writer_with_token("4").await).await),
        "ZF001"
    );
    assert_eq!(fenced.count("orders").await, 0);
    assert_eq!(copy(&fenced.writer_with_token("5").await).await.unwrap(), 2);
    assert_eq!(fenced.count("orders").await, 2);
}

/// The token can come with the transaction instead of the session: from a
/// `fencegate.fence()` call, `SET LOCAL` or `set_config(..., true)`. It ends with the
/// transaction, and a rolled-back savepoint takes it back.
#[tokio::test]
async fn transaction_tokens_end_with_their_transaction() {
    let fenced = orders().await;
    let writer = fenced.writer("").await;
    for present in [
        "SELECT fencegate.fence('orders', 5)",
        "SET LOCAL fencegate.token = 5",
        "SELECT set_config('fencegate.token', '5', true)",
    ] {
        fenced.unfenced("orders", "TRUNCATE orders").await;
        writer
            .batch_execute(&format!(
                "BEGIN; {present}; INSERT INTO orders VALUES (1, 'in'); COMMIT;"
            ))
            .await
            .unwrap_or_else(|e| panic!("{present}: {e}"));
        assert_eq!(
            sqlstate(
                writer
                    .batch_execute("INSERT INTO orders VALUES (2, 'after')")
                    .await
            ),
            "ZF002",
            "{present}: the next transaction has no token"
        );
        assert_eq!(fenced.count("orders").await, 1, "{present}");
    }

    // fence() records its token per resource: a token for another resource does not
    // open this table.
    assert_eq!(
        sqlstate(
            writer
                .batch_execute(
                    "BEGIN; SELECT fencegate.fence('orders-x', 9); INSERT INTO orders VALUES (3, 'x')"
                )
                .await
        ),
        "ZF002"
    );
    writer.batch_execute("ROLLBACK").await.unwrap();

    // A savepoint rolled back takes the fence call (and its lock) with it.
    writer
        .batch_execute(
            "BEGIN; SAVEPOINT s; SELECT fencegate.fence('orders', 5); ROLLBACK TO SAVEPOINT s",
        )
        .await
        .unwrap();
    assert_eq!(
        sqlstate(
            writer
                .batch_execute("INSERT INTO orders VALUES (4, 'x')")
                .await
        ),
        "ZF002"
    );
    writer.batch_execute("ROLLBACK").await.unwrap();

    // A stale fence() call fails at once, before any write.
    let stale = writer
        .query_one("SELECT fencegate.fence('orders', 4)", &[])
        .await
        .unwrap_err();
    let error = fence_error(&stale);
    assert_eq!(
        (error.code().code(), detail_fields(error)),
        ("ZF001", Some("resource=orders presented=4 highest=5"))
    );
    assert_eq!(error.table(), None);
    assert_eq!(fenced.count("orders").await, 1);
}

/// One Query message with COMMIT in the middle: what follows the COMMIT runs in a new
/// transaction, where the transaction's token is gone — it fails closed. Sent by
/// tokio-postgres and by psql alike.
#[tokio::test]
async fn a_commit_in_the_middle_of_a_query_fails_closed() {
    let fenced = orders().await;
    let script = "BEGIN; SELECT fencegate.fence('orders', 5); INSERT INTO orders VALUES (1, 'fenced'); COMMIT; INSERT INTO orders VALUES (2, 'after the commit')";
    let refused = fenced
        .writer("")
        .await
        .simple_query(script)
        .await
        .unwrap_err();
    assert_eq!(fence_error(&refused).code().code(), "ZF002");
    assert_eq!(rows(&fenced).await, [(1, "fenced".to_owned())]);

    fenced.unfenced("orders", "TRUNCATE orders").await;
    let psql = Command::new("psql")
        .args([
            fenced.writer_url(),
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            script,
        ])
        .output()
        .expect("psql runs");
    assert!(!psql.status.success());
    let stderr = String::from_utf8_lossy(&psql.stderr);
    assert!(
        stderr.contains("no fencing token for resource \"orders\""),
        "{stderr}"
    );
    assert_eq!(rows(&fenced).await, [(1, "fenced".to_owned())]);
}

/// psql with the token in PGOPTIONS, and `\copy`: the current token writes, a stale
/// one does not.
#[tokio::test]
async fn psql_with_a_session_token() {
    let fenced = orders().await;
    let psql = |token: &str, command: &str| {
        Command::new("psql")
            .args([
                fenced.writer_url(),
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                command,
            ])
            .env("PGOPTIONS", format!("-c fencegate.token={token}"))
            .output()
            .expect("psql runs")
    };
    let stale = psql("4", "INSERT INTO orders VALUES (1, 'stale')");
    assert!(!stale.status.success());
    let stderr = String::from_utf8_lossy(&stale.stderr);
    assert!(
        stderr.contains("stale fencing token 4 for resource \"orders\""),
        "{stderr}"
    );
    let copy_file = std::env::temp_dir().join(format!("fencegate-copy-{}.tsv", fenced.db.name()));
    std::fs::write(&copy_file, "1\tfrom a file\n").unwrap();
    let copy = format!("\\copy orders FROM '{}'", copy_file.display());
    assert!(!psql("4", &copy).status.success());
    assert_eq!(fenced.count("orders").await, 0);
    let current = psql("5", &copy);
    assert!(current.status.success(), "{:?}", current);
    std::fs::remove_file(copy_file).unwrap();
    assert_eq!(rows(&fenced).await, [(1, "from a file".to_owned())]);
}

/// A foreign key's ON DELETE CASCADE from an unfenced table into a fenced one runs the
/// fenced table's trigger.
#[tokio::test]
async fn a_cascade_into_a_fenced_table_needs_a_token() {
    let fenced = FencedDb::create().await;
    fenced
        .execute(
            "CREATE TABLE customers (id int PRIMARY KEY);
             CREATE TABLE invoices (id int PRIMARY KEY, customer int REFERENCES customers ON DELETE CASCADE);
             INSERT INTO customers VALUES (1); INSERT INTO invoices VALUES (10, 1);",
        )
        .await;
    fenced.protect("invoices", "billing").await;
    fenced.raise("billing", 3).await;
    let refused = fenced
        .run_as_writer(None, "DELETE FROM customers WHERE id = 1")
        .await
        .unwrap_err();
    assert_eq!(fence_error(&refused).code().code(), "ZF002");
    assert_eq!(
        (
            fenced.count("customers").await,
            fenced.count("invoices").await
        ),
        (1, 1)
    );
    fenced
        .run_as_writer(Some("3"), "DELETE FROM customers WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(fenced.count("invoices").await, 0);
}

/// Partitions are fenced with their table — those present when it is protected, and
/// those created or attached later — so a write straight to a partition is fenced too.
#[tokio::test]
async fn partitions_old_and_new_are_fenced() {
    let fenced = FencedDb::create().await;
    fenced
        .execute(
            "CREATE TABLE events (id int, at date NOT NULL) PARTITION BY RANGE (at);
             CREATE TABLE events_2026 PARTITION OF events FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');",
        )
        .await;
    assert_eq!(
        fenced.protect("events", "events").await,
        ["events", "events_2026"]
    );
    fenced
        .execute(
            "CREATE TABLE events_2027 PARTITION OF events FOR VALUES FROM ('2027-01-01') TO ('2028-01-01');
             CREATE TABLE events_2028 (id int, at date NOT NULL);
             ALTER TABLE events ATTACH PARTITION events_2028 FOR VALUES FROM ('2028-01-01') TO ('2029-01-01');",
        )
        .await;
    fenced.raise("events", 2).await;
    let stale = fenced.writer_with_token("1").await;
    for (partition, day) in [
        ("events_2026", "2026-06-01"),
        ("events_2027", "2027-06-01"),
        ("events_2028", "2028-06-01"),
    ] {
        let refused = stale
            .batch_execute(&format!("INSERT INTO {partition} VALUES (1, '{day}')"))
            .await
            .unwrap_err();
        assert_eq!(fence_error(&refused).code().code(), "ZF001", "{partition}");
        let refused = stale
            .batch_execute(&format!("TRUNCATE {partition}"))
            .await
            .unwrap_err();
        assert_eq!(fence_error(&refused).code().code(), "ZF001", "{partition}");
    }
    assert_eq!(fenced.count("events").await, 0);
    let current = fenced.writer_with_token("2").await;
    current
        .batch_execute("INSERT INTO events_2027 VALUES (1, '2027-06-01'); INSERT INTO events VALUES (2, '2028-06-01')")
        .await
        .unwrap();
    assert_eq!(fenced.count("events").await, 2);
}

/// A procedure that commits inside: a session token covers every transaction it
/// starts; a token presented inside it ends at its COMMIT, and the rest fails closed.
#[tokio::test]
async fn a_procedure_that_commits_inside() {
    let fenced = orders().await;
    fenced
        .execute(&format!(
            "CREATE PROCEDURE two_inserts(token bigint) LANGUAGE plpgsql AS $$
             BEGIN
                 IF token IS NOT NULL THEN PERFORM fencegate.fence('orders', token); END IF;
                 INSERT INTO orders VALUES (1, 'before the commit');
                 COMMIT;
                 INSERT INTO orders VALUES (2, 'after the commit');
             END $$;
             GRANT EXECUTE ON PROCEDURE two_inserts TO {};",
            fenced.db.writer_role()
        ))
        .await;

    assert_eq!(
        sqlstate(
            fenced
                .run_as_writer(Some("4"), "CALL two_inserts(NULL)")
                .await
        ),
        "ZF001"
    );
    assert_eq!(fenced.count("orders").await, 0);

    let refused = fenced
        .run_as_writer(None, "CALL two_inserts(5)")
        .await
        .unwrap_err();
    assert_eq!(fence_error(&refused).code().code(), "ZF002");
    assert_eq!(rows(&fenced).await, [(1, "before the commit".to_owned())]);

    fenced.unfenced("orders", "TRUNCATE orders").await;
    fenced
        .run_as_writer(Some("5"), "CALL two_inserts(NULL)")
        .await
        .unwrap();
    assert_eq!(fenced.count("orders").await, 2);
}

/// Under REPEATABLE READ and SERIALIZABLE the snapshot is fixed at the first
/// statement. A stale writer whose snapshot is older than the raise gets `40001`
/// (the row changed under it) — never an accepted write — and its retry, with a new
/// snapshot, gets `ZF001`. One whose snapshot already sees the raise gets `ZF001`.
#[tokio::test]
async fn repeatable_read_and_serializable_writers() {
    let fenced = orders().await;
    for isolation in ["REPEATABLE READ", "SERIALIZABLE"] {
        let writer = fenced.writer("").await;
        writer
            .batch_execute(&format!(
                "BEGIN ISOLATION LEVEL {isolation}; SELECT count(*) FROM orders"
            ))
            .await
            .unwrap();
        let raised = fenced.highest("orders").await.unwrap() + 1;
        fenced.raise("orders", raised).await;
        let token = raised - 1;
        assert_eq!(
            sqlstate(
                writer
                    .query_one("SELECT fencegate.fence('orders', $1)", &[&token])
                    .await
            ),
            "40001",
            "{isolation}"
        );
        writer.batch_execute("ROLLBACK").await.unwrap();

        writer
            .batch_execute(&format!("BEGIN ISOLATION LEVEL {isolation}"))
            .await
            .unwrap();
        let retried = writer
            .query_one("SELECT fencegate.fence('orders', $1)", &[&token])
            .await
            .unwrap_err();
        assert_eq!(fence_error(&retried).code().code(), "ZF001", "{isolation}");
        writer.batch_execute("ROLLBACK").await.unwrap();

        // With a current token, the same isolation writes.
        writer
            .batch_execute(&format!(
                "BEGIN ISOLATION LEVEL {isolation}; SELECT fencegate.fence('orders', {raised});
                 INSERT INTO orders VALUES ({raised}, '{isolation}'); COMMIT;"
            ))
            .await
            .unwrap();
    }
    assert_eq!(fenced.count("orders").await, 2);
}

/// The fence function refuses what is not a resource or a token, and writers cannot
/// reach the table behind it: fences only go up, through the function.
#[tokio::test]
async fn writers_cannot_lower_or_forge_fences() {
    let fenced = orders().await;
    let writer = fenced.writer_with_token("5").await;
    for (sql, code) in [
        ("SELECT fencegate.fence('...', 1)", "ZF004"),
        ("SELECT fencegate.fence('a b', 1)", "ZF004"),
        ("SELECT fencegate.fence(NULL, 1)", "ZF004"),
        ("SELECT fencegate.fence('orders', 0)", "ZF003"),
        ("SELECT fencegate.fence('orders', NULL)", "ZF002"),
        ("SELECT fencegate.fence('orders', 4)", "ZF001"),
        ("UPDATE fencegate.fences SET highest = 1", "42501"),
        ("DELETE FROM fencegate.fences", "42501"),
        ("SELECT * FROM fencegate.fences", "42501"),
        ("SELECT * FROM fencegate.objects", "42501"),
        (
            "SELECT fencegate.fence_check('orders', 1, NULL, 'door', 0)",
            "42501",
        ),
        ("SELECT fencegate.clear_key('orders', 5, 1)", "42501"),
        ("SELECT fencegate.hold_key('orders', 5, 1)", "42501"),
        ("SELECT fencegate.raise_fence('orders', 9, 'door')", "42501"),
        ("SELECT fencegate.sql_fence('orders', 9, '\\x00')", "42501"),
        (
            "SELECT fencegate.end_older_terms('orders', 9, 'x')",
            "42501",
        ),
        (
            "SELECT fencegate.register_table('orders', 'other')",
            "42501",
        ),
        ("SELECT * FROM fencegate.keys", "42501"),
        (
            "INSERT INTO fencegate.authority VALUES (current_user::regrole, '', true)",
            "42501",
        ),
        ("DELETE FROM fencegate.raises", "42501"),
        ("SELECT fencegate.protect('orders', 'other')", "42501"),
        ("SELECT fencegate.unprotect('orders')", "42501"),
        (
            "ALTER TABLE orders DISABLE TRIGGER fencegate_fence",
            "42501",
        ),
        ("DROP TRIGGER fencegate_fence ON orders", "42501"),
        ("SET session_replication_role = replica", "42501"),
        ("CREATE TABLE fencegate.mine (id int)", "42501"),
        ("DROP SCHEMA fencegate CASCADE", "42501"),
    ] {
        assert_eq!(sqlstate(writer.batch_execute(sql).await), code, "{sql}");
    }
    // A forged record of a fence() call is only a token like any other: checked.
    let forged = writer
        .batch_execute(
            "BEGIN; SELECT set_config('fencegate.fenced', 'orders=4', true);
             INSERT INTO orders VALUES (1, 'forged')",
        )
        .await
        .unwrap_err();
    assert_eq!(fence_error(&forged).code().code(), "ZF001");
    writer.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(fenced.highest("orders").await, Some(5));
    assert_eq!(fenced.count("orders").await, 0);
}

/// The seed's sweeper, over its own connections: node-a (epoch 1) sends its sweep,
/// which the network holds; node-b takes over with epoch 2 and sweeps; node-a's sweep
/// arrives and its own transaction refuses it — `sweep_state` keeps node-b's note.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_sweeper_over_direct_connections() {
    let fenced = FencedDb::create().await;
    fenced
        .execute(
            "CREATE TABLE sweep_state (id int PRIMARY KEY, last_epoch bigint NOT NULL, note text);
             INSERT INTO sweep_state VALUES (1, 1, 'sweep by node-a');",
        )
        .await;
    fenced.protect("sweep_state", "sweeper").await;
    fenced.raise("sweeper", 1).await;

    let network = Proxy::start(server_addr().await).await;
    let node_a = connect_with(&via(fenced.writer_url(), network.addr()), "").await;
    network.hold();
    let delayed = tokio::spawn(async move {
        node_a
            .batch_execute(
                "BEGIN; SELECT fencegate.fence('sweeper', 1);
                 UPDATE sweep_state SET last_epoch = 1, note = 'stale write by node-a' WHERE id = 1;
                 COMMIT;",
            )
            .await
    });
    eventually(
        Duration::from_secs(5),
        "node-a's sweep to reach the network",
        || async { network.held_bytes() > 0 },
    )
    .await;

    let node_b = fenced.writer("").await;
    node_b
        .batch_execute(
            "BEGIN; SELECT fencegate.fence('sweeper', 2);
             UPDATE sweep_state SET last_epoch = 2, note = 'sweep by node-b' WHERE id = 1;
             COMMIT;",
        )
        .await
        .unwrap();

    network.release();
    let late = delayed.await.unwrap().unwrap_err();
    let error = fence_error(&late);
    assert_eq!(
        (error.code().code(), detail_fields(error)),
        ("ZF001", Some("resource=sweeper presented=1 highest=2"))
    );
    let note: String = fenced
        .admin
        .query_one("SELECT note FROM sweep_state", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(note, "sweep by node-b");
}

/// `jobs` fenced for `jobs` at 11 and `queue` fenced for `queue` at 7, with job 42 queued.
async fn jobs_and_queue() -> FencedDb {
    let fenced = FencedDb::create().await;
    fenced
        .execute("CREATE TABLE jobs (id int PRIMARY KEY, state text); CREATE TABLE queue (job int PRIMARY KEY)")
        .await;
    fenced.protect("jobs", "jobs").await;
    fenced.protect("queue", "queue").await;
    fenced.raise("jobs", 11).await;
    fenced.raise("queue", 7).await;
    fenced
        .unfenced("jobs", "INSERT INTO jobs VALUES (42, 'queued')")
        .await;
    fenced
        .unfenced("queue", "INSERT INTO queue VALUES (42)")
        .await;
    fenced
}

/// What the two tables hold: job 42's state, and whether it is still queued.
async fn job_42(fenced: &FencedDb) -> (String, i64) {
    let state: String = fenced
        .admin
        .query_one("SELECT state FROM jobs WHERE id = 42", &[])
        .await
        .unwrap()
        .get(0);
    (state, fenced.count("queue").await)
}

const START_JOB: &str =
    "UPDATE jobs SET state = 'running' WHERE id = 42; DELETE FROM queue WHERE job = 42;";

/// One transaction fences two resources, each with its own token, and writes both:
/// a stale token for either one leaves both tables and both fences as they were; with
/// both current, both are written and both fences raised, at the commit.
#[tokio::test]
async fn one_transaction_fences_several_resources_all_or_nothing() {
    let fenced = jobs_and_queue().await;
    let writer = fenced.writer("").await;
    for (jobs, queue, stale) in [
        (12, 6, "resource=queue presented=6 highest=7"),
        (10, 8, "resource=jobs presented=10 highest=11"),
    ] {
        let refused = writer
            .batch_execute(&format!(
                "BEGIN; SELECT fencegate.fence('jobs', {jobs}), fencegate.fence('queue', {queue}); {START_JOB} COMMIT;"
            ))
            .await
            .unwrap_err();
        let error = fence_error(&refused);
        assert_eq!(
            (error.code().code(), detail_fields(error)),
            ("ZF001", Some(stale))
        );
        writer.batch_execute("ROLLBACK").await.unwrap();
        assert_eq!(job_42(&fenced).await, ("queued".to_owned(), 1));
        assert_eq!(
            fenced.highest("jobs").await,
            Some(11),
            "the current token of jobs was not raised"
        );
        assert_eq!(fenced.highest("queue").await, Some(7));
    }
    // A failing write after both fences passed takes both raises back with it.
    let failing = writer
        .batch_execute(&format!(
            "BEGIN; SELECT fencegate.fence('jobs', 12), fencegate.fence('queue', 8); {START_JOB} INSERT INTO queue VALUES (NULL); COMMIT;"
        ))
        .await
        .unwrap_err();
    assert_eq!(failing.as_db_error().unwrap().code().code(), "23502");
    writer.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(job_42(&fenced).await, ("queued".to_owned(), 1));
    assert_eq!(
        (fenced.highest("jobs").await, fenced.highest("queue").await),
        (Some(11), Some(7))
    );

    writer
        .batch_execute(&format!(
            "BEGIN; SELECT fencegate.fence('jobs', 12), fencegate.fence('queue', 8); {START_JOB} COMMIT;"
        ))
        .await
        .unwrap();
    assert_eq!(job_42(&fenced).await, ("running".to_owned(), 0));
    assert_eq!(
        (fenced.highest("jobs").await, fenced.highest("queue").await),
        (Some(12), Some(8))
    );
}

/// A resource fenced but not written in the transaction (a check) keeps its term until
/// the commit: a new term's raise waits for it, so the transaction cannot commit on a
/// term that has already passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_only_checked_keeps_its_term_until_the_commit() {
    let fenced = jobs_and_queue().await;
    let writer = fenced.writer("").await;
    writer
        .batch_execute("BEGIN; SELECT fencegate.fence('jobs', 12), fencegate.fence('queue', 7);")
        .await
        .unwrap();
    let raising = {
        let new_term = fenced.writer("").await;
        tokio::spawn(async move {
            new_term
                .query_one("SELECT fencegate.fence('queue', 8)", &[])
                .await
                .map(|_| ())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !raising.is_finished(),
        "the new term of queue waits for the check to commit"
    );
    writer
        .batch_execute("UPDATE jobs SET state = 'checked against queue 7' WHERE id = 42; COMMIT;")
        .await
        .unwrap();
    raising.await.unwrap().unwrap();
    assert_eq!(fenced.highest("queue").await, Some(8));
    assert_eq!(fenced.highest("jobs").await, Some(12));
}
