//! Authority inside Postgres: a role presents or raises only the fences of resources
//! granted to it (`fencegate grant`), on every path into the fence — `fencegate.fence()`
//! over a direct connection and through the door, per-connection tokens, the triggers
//! of protected tables and of tables that call the fence without being protected,
//! writes through the parents of fenced partitions and children, and electors of a
//! guarded `leader_lease` table. Two tenants share one database throughout; the honest
//! tenant's writes keep working.

use fencegate_lease::{LeaseStore, PostgresStore};
use fencegate_tests::door::SweeperDoor;
use fencegate_tests::fenced::{connect_with, detail_fields, fence_error, sqlstate, FencedDb};
use tokio_postgres::Client;

const MAX: i64 = i64::MAX;

/// Two tenants on one database: `alice` holds the resources `a-*`, `bob` holds `b`.
/// Table `a_rows` is fenced for `a-1`, `b_rows` for `b`; both tenants may write both
/// tables as far as table privileges go, so that only the fence decides.
struct Tenants {
    fenced: FencedDb,
    alice: String,
    bob: String,
}

impl Tenants {
    async fn create() -> Tenants {
        let fenced = FencedDb::create().await;
        fenced
            .execute(
                "CREATE TABLE a_rows (id int, note text);
                 CREATE TABLE b_rows (id int, note text);",
            )
            .await;
        fenced.protect("a_rows", "a-1").await;
        fenced.protect("b_rows", "b").await;
        let alice = fenced.tenant("alice", &["a-*"]).await;
        let bob = fenced.tenant("bob", &["b"]).await;
        fenced.raise("b", 3).await;
        Tenants { fenced, alice, bob }
    }

    async fn alice(&self, options: &str) -> Client {
        connect_with(&self.alice, options).await
    }

    async fn bob(&self, options: &str) -> Client {
        connect_with(&self.bob, options).await
    }
}

/// `fencegate.fence()` of a resource the role does not hold: ZF006, nothing moves —
/// neither to the largest token nor for an equal one; its own resources work.
#[tokio::test]
async fn a_role_raises_only_its_own_resources() {
    let tenants = Tenants::create().await;
    let alice = tenants.alice("").await;
    for sql in [
        format!("SELECT fencegate.fence('b', {MAX})"),
        "SELECT fencegate.fence('b', 3)".to_owned(),
        "SELECT fencegate.fence('new-resource', 1)".to_owned(),
    ] {
        let refused = alice.query_one(&sql, &[]).await.unwrap_err();
        let error = fence_error(&refused);
        assert_eq!(error.code().code(), "ZF006", "{sql}");
        assert!(
            detail_fields(error).is_some_and(|detail| detail.starts_with("resource=")),
            "{sql}: {:?}",
            error.detail()
        );
    }
    assert_eq!(tenants.fenced.highest("b").await, Some(3));
    assert_eq!(tenants.fenced.highest("new-resource").await, None);
    // Its own, by name and by pattern.
    alice
        .batch_execute(
            "BEGIN; SELECT fencegate.fence('a-1', 5); INSERT INTO a_rows VALUES (1, 'a'); COMMIT;",
        )
        .await
        .unwrap();
    alice
        .query_one("SELECT fencegate.fence('a-2', 9)", &[])
        .await
        .unwrap();
    assert_eq!(tenants.fenced.highest("a-1").await, Some(5));
    assert_eq!(tenants.fenced.highest("a-2").await, Some(9));
    // A token of its own resource does not open the other tenant's table.
    let crossed = alice
        .batch_execute(
            "BEGIN; SELECT fencegate.fence('a-1', 5); INSERT INTO b_rows VALUES (1, 'x')",
        )
        .await
        .unwrap_err();
    assert_eq!(fence_error(&crossed).code().code(), "ZF006");
    // Bob's honest writes are untouched.
    let bob = tenants.bob("").await;
    bob.batch_execute(
        "BEGIN; SELECT fencegate.fence('b', 3); INSERT INTO b_rows VALUES (2, 'b'); COMMIT;",
    )
    .await
    .unwrap();
    assert_eq!(tenants.fenced.count("b_rows").await, 1);
}

/// A role that can act as a granted role holds its resources (membership, as Postgres
/// privileges go); revoking takes them back at once.
#[tokio::test]
async fn membership_grants_and_revoke_takes_back() {
    let tenants = Tenants::create().await;
    let db = &tenants.fenced.db;
    let carol = db.create_role("carol", "LOGIN").await;
    let bob_role = format!("{}_bob", db.name());
    db.execute(&format!("GRANT {bob_role} TO {carol}")).await;
    let carol = connect_with(&db.url_as(&carol), "").await;
    carol
        .query_one("SELECT fencegate.fence('b', 4)", &[])
        .await
        .expect("carol can act as bob");
    fencegate_gateway::admin::revoke(&tenants.fenced.admin, &bob_role, &[], false)
        .await
        .unwrap();
    let refused = carol
        .query_one("SELECT fencegate.fence('b', 5)", &[])
        .await
        .unwrap_err();
    // No resource left, and no EXECUTE on fence() either.
    assert_eq!(refused.code().unwrap().code(), "42501", "{refused:?}");
    assert_eq!(tenants.fenced.highest("b").await, Some(4));
}

/// The per-connection token: a bare token applies only to the resources the role
/// holds; the named form (`a-1=7,b=4`) names each. Neither raises another tenant's
/// fence, whatever table the connection writes.
#[tokio::test]
async fn per_connection_tokens_raise_only_the_roles_own_fences() {
    let tenants = Tenants::create().await;
    let bare = tenants.alice("-c fencegate.token=1000").await;
    bare.batch_execute("INSERT INTO a_rows VALUES (1, 'alice')")
        .await
        .unwrap();
    assert_eq!(tenants.fenced.highest("a-1").await, Some(1000));
    assert_eq!(
        sqlstate(
            bare.batch_execute("INSERT INTO b_rows VALUES (1, 'x')")
                .await
        ),
        "ZF006"
    );
    assert_eq!(tenants.fenced.highest("b").await, Some(3));

    let named = tenants.alice("-c fencegate.token=a-1=1000,b=9000").await;
    named
        .batch_execute("UPDATE a_rows SET note = 'named'")
        .await
        .unwrap();
    assert_eq!(
        sqlstate(named.batch_execute("DELETE FROM b_rows").await),
        "ZF006"
    );
    // The other tenant's current token, named: the token is right, the role is not.
    let current = tenants.alice("-c fencegate.token=b=3").await;
    assert_eq!(
        sqlstate(
            current
                .batch_execute("INSERT INTO b_rows VALUES (9, 'x')")
                .await
        ),
        "ZF006"
    );
    // Named for another resource only: no token for a-1.
    let other = tenants.alice("-c fencegate.token=a-2=5").await;
    assert_eq!(
        sqlstate(other.batch_execute("DELETE FROM a_rows").await),
        "ZF002"
    );
    assert_eq!(tenants.fenced.highest("b").await, Some(3));
    assert_eq!(tenants.fenced.count("a_rows").await, 1);

    // The holder of `b` may use either form for it.
    let bob = tenants.bob("-c fencegate.token=b=3").await;
    bob.batch_execute("INSERT INTO b_rows VALUES (2, 'bob')")
        .await
        .unwrap();
    assert_eq!(tenants.fenced.count("b_rows").await, 1);
}

/// A table that calls the fence without `protect` having fenced it: its owner needs a
/// grant even to create the trigger, and with one the trigger only refuses — the
/// trigger's resource comes from the registry, never from its arguments. `check`
/// names the trigger.
#[tokio::test]
async fn a_trigger_of_ones_own_cannot_reach_another_fence() {
    let tenants = Tenants::create().await;
    let db = &tenants.fenced.db;
    let alice_role = format!("{}_alice", db.name());
    db.execute(&format!("GRANT CREATE ON SCHEMA public TO {alice_role}"))
        .await;
    let alice = tenants.alice(&format!("-c fencegate.token={MAX}")).await;
    let create = "CREATE TEMP TABLE mine (id int);
                  CREATE TRIGGER hijack BEFORE INSERT ON mine FOR EACH STATEMENT
                      EXECUTE FUNCTION fencegate.enforce('b');";
    assert_eq!(sqlstate(alice.batch_execute(create).await), "42501");

    // Even a role that may fence its own tables gets nothing from an unregistered one.
    fencegate_gateway::admin::grant(&tenants.fenced.admin, &alice_role, &[], true)
        .await
        .unwrap();
    alice
        .batch_execute(
            "CREATE TABLE mine (id int);
             CREATE TRIGGER hijack BEFORE INSERT ON mine FOR EACH STATEMENT
                 EXECUTE FUNCTION fencegate.enforce('b');",
        )
        .await
        .unwrap();
    let refused = alice
        .batch_execute("INSERT INTO mine VALUES (1)")
        .await
        .unwrap_err();
    let error = fence_error(&refused);
    assert_eq!(error.code().code(), "ZF007");
    assert_eq!(tenants.fenced.highest("b").await, Some(3));
    let findings = fencegate_gateway::admin::audit(&tenants.fenced.admin)
        .await
        .unwrap();
    assert!(
        findings
            .iter()
            .any(|f| f.finding == "unregistered_fence_trigger" && f.object == "public.mine"),
        "{findings:?}"
    );
    // Protecting its own table for another tenant's resource changes nothing either:
    // writing it then needs that resource.
    fencegate_gateway::admin::protect(&connect_with(&tenants.alice, "").await, "mine", "b")
        .await
        .unwrap();
    assert_eq!(
        sqlstate(alice.batch_execute("INSERT INTO mine VALUES (2)").await),
        "ZF006"
    );
    assert_eq!(tenants.fenced.highest("b").await, Some(3));
}

/// The Postgres door: a writer of one resource raises no other, and the honest writer
/// of that one keeps writing.
#[tokio::test]
async fn through_the_door_too() {
    let door = SweeperDoor::start().await;
    let mallory = door.db.tenant("mallory", &["mallory-*"]).await;
    let mallory = connect_with(&fencegate_tests::db::via(&mallory, door.addr()), "").await;
    let refused = mallory
        .query_one(&format!("SELECT fencegate.fence('sweeper', {MAX})"), &[])
        .await
        .unwrap_err();
    assert_eq!(fence_error(&refused).code().code(), "ZF006");
    let refused = mallory
        .batch_execute(&format!(
            "BEGIN; SET LOCAL fencegate.token = 'sweeper={MAX}'; UPDATE sweep_state SET note = 'x'"
        ))
        .await
        .unwrap_err();
    assert_eq!(fence_error(&refused).code().code(), "ZF006");
    assert_eq!(door.db.highest("sweeper").await, None);
    let writer = door.writer("").await;
    writer
        .batch_execute(
            "BEGIN; SELECT fencegate.fence('sweeper', 2);
             UPDATE sweep_state SET note = 'node-b' WHERE id = 1; COMMIT;",
        )
        .await
        .unwrap();
    assert_eq!(door.note().await, "node-b");
}

/// A fenced partition or inheritance child written through its unfenced parent: the
/// row-level fence trigger checks every row that reaches it, for its own resource.
#[tokio::test]
async fn writes_through_an_unfenced_parent_are_fenced() {
    let tenants = Tenants::create().await;
    tenants
        .fenced
        .execute(
            "CREATE TABLE shards (id int, shard int) PARTITION BY LIST (shard);
             CREATE TABLE shard_a PARTITION OF shards FOR VALUES IN (1);
             CREATE TABLE shard_b PARTITION OF shards FOR VALUES IN (2);
             CREATE TABLE jobs (id int);
             CREATE TABLE jobs_b () INHERITS (jobs);",
        )
        .await;
    let db = &tenants.fenced.db;
    db.execute(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA public TO {0}_alice, {0}_bob",
        db.name()
    ))
    .await;
    tenants.fenced.protect("shard_a", "a-1").await;
    tenants.fenced.protect("shard_b", "b").await;
    tenants.fenced.protect("jobs_b", "b").await;
    // A row in each, written by the owner (who holds every resource) with tokens.
    tenants
        .fenced
        .execute(
            "BEGIN; SET LOCAL fencegate.token = 'a-1=1,b=3';
             INSERT INTO shards VALUES (1, 1), (2, 2); INSERT INTO jobs VALUES (0);
             INSERT INTO jobs_b VALUES (1); COMMIT;",
        )
        .await;

    let anyone = tenants.alice("").await;
    for sql in [
        "INSERT INTO shards VALUES (1, 2)",
        "UPDATE shards SET id = 2",
        "DELETE FROM shards",
        "UPDATE jobs SET id = 2",
        "DELETE FROM jobs",
        "TRUNCATE shards",
        "TRUNCATE jobs",
    ] {
        let code = sqlstate(anyone.batch_execute(sql).await);
        assert!(
            code == "ZF006" || code == "ZF002",
            "{sql}: {code} (no token for b, and alice does not hold it)"
        );
    }
    // Through the parent into its own partition, with its own token: accepted.
    let alice = tenants.alice("-c fencegate.token=a-1=4").await;
    alice
        .batch_execute("INSERT INTO shards VALUES (1, 1); UPDATE shards SET id = 3 WHERE shard = 1")
        .await
        .unwrap();
    let bob = tenants.bob("-c fencegate.token=b=3").await;
    bob.batch_execute("INSERT INTO shards VALUES (2, 2); DELETE FROM jobs_b")
        .await
        .unwrap();
    assert_eq!(tenants.fenced.count("shard_a").await, 2);
    assert_eq!(tenants.fenced.count("shard_b").await, 2);
    assert_eq!(tenants.fenced.count("jobs_b").await, 0);
    assert_eq!(
        tenants.fenced.count("jobs").await,
        1,
        "the parent's own row"
    );
    assert_eq!(tenants.fenced.highest("a-1").await, Some(4));
    assert_eq!(tenants.fenced.highest("b").await, Some(3));

    // check: the parents are reported as unfenced ancestors, and a family member
    // whose row trigger is gone as a hole.
    tenants
        .fenced
        .execute(
            "DROP EVENT TRIGGER fencegate_partitions;
             DROP TRIGGER fencegate_fence_row ON shard_b;",
        )
        .await;
    let findings = fencegate_gateway::admin::audit(&tenants.fenced.admin)
        .await
        .unwrap();
    let found = |finding: &str, object: &str| {
        findings
            .iter()
            .any(|f| f.finding == finding && f.object == object)
    };
    assert!(
        found("reachable_through_ancestor", "public.shard_b"),
        "{findings:?}"
    );
    assert!(
        !found("reachable_through_ancestor", "public.shard_a"),
        "{findings:?}"
    );
    assert!(found("unfenced_ancestor", "public.shards"), "{findings:?}");
    assert!(found("unfenced_ancestor", "public.jobs"), "{findings:?}");
    // protect puts it back.
    tenants.fenced.protect("shard_b", "b").await;
    let findings = fencegate_gateway::admin::audit(&tenants.fenced.admin)
        .await
        .unwrap();
    assert!(
        !findings
            .iter()
            .any(|f| f.finding == "reachable_through_ancestor"),
        "{findings:?}"
    );
}

/// The table's owner cannot take the fence off its table, with the partition guard
/// installed: a disabled or dropped trigger is put back at once, with a warning.
#[tokio::test]
async fn an_owner_cannot_take_the_fence_off() {
    let tenants = Tenants::create().await;
    let db = &tenants.fenced.db;
    let owner = db.create_role("owner", "LOGIN").await;
    tenants
        .fenced
        .execute(&format!(
            "CREATE TABLE owned (id int); ALTER TABLE owned OWNER TO {owner};"
        ))
        .await;
    tenants.fenced.protect("owned", "b").await;
    let owner = connect_with(&db.url_as(&owner), "").await;
    owner
        .batch_execute("ALTER TABLE owned DISABLE TRIGGER fencegate_fence")
        .await
        .unwrap();
    owner
        .batch_execute("DROP TRIGGER fencegate_fence ON owned")
        .await
        .unwrap();
    let enabled: String = db
        .value("SELECT enabled::text FROM fencegate.protected WHERE tbl = 'owned'::regclass")
        .await;
    assert_eq!(enabled, "A");
    assert_eq!(
        sqlstate(owner.batch_execute("INSERT INTO owned VALUES (1)").await),
        "ZF006"
    );
}

/// The owner of a fenced table disguises a trigger of its own as the fence's: the real
/// one renamed and disabled, a decoy under its name. The partition guard tells the fence's
/// own trigger by its function, events and timing, not by its name: it drops the decoy
/// and the renamed copy and puts the fence back, so a holder's write without a token is
/// refused again.
#[tokio::test]
async fn a_decoy_of_the_fence_trigger_is_not_taken_for_it() {
    let tenants = Tenants::create().await;
    let db = &tenants.fenced.db;
    let owner = db.create_role("owner", "LOGIN").await;
    tenants
        .fenced
        .execute(&format!(
            "CREATE TABLE owned (id int); ALTER TABLE owned OWNER TO {owner};
             GRANT INSERT ON owned TO {}_alice;",
            db.name()
        ))
        .await;
    tenants.fenced.protect("owned", "a-1").await;
    let owner = connect_with(&db.url_as(&owner), "").await;
    let decoys = [
        // Another function under the fence's name, on the fence's events.
        "CREATE FUNCTION nothing() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
         CREATE TRIGGER fencegate_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON owned
             FOR EACH STATEMENT EXECUTE FUNCTION nothing();",
        // The fence's function, never firing.
        "CREATE TRIGGER fencegate_fence BEFORE INSERT ON owned FOR EACH STATEMENT WHEN (false)
             EXECUTE FUNCTION fencegate.enforce();",
        // The fence's function, for DELETE only.
        "CREATE TRIGGER fencegate_fence BEFORE DELETE ON owned FOR EACH STATEMENT
             EXECUTE FUNCTION fencegate.enforce();",
    ];
    db.execute(&format!(
        "GRANT CREATE ON SCHEMA public TO {}_owner",
        db.name()
    ))
    .await;
    tenants
        .fenced
        .execute(&format!(
            "GRANT USAGE ON SCHEMA fencegate TO {0}_owner;
             GRANT EXECUTE ON FUNCTION fencegate.enforce() TO {0}_owner",
            db.name()
        ))
        .await;
    let alice = tenants.alice("").await;
    for (round, decoy) in decoys.iter().enumerate() {
        owner
            .batch_execute(&format!(
                "ALTER TRIGGER fencegate_fence ON owned RENAME TO real_{round}; {decoy}
                 ALTER TABLE owned DISABLE TRIGGER real_{round};"
            ))
            .await
            .unwrap_or_else(|e| panic!("{decoy}: {e:?}"));
        let triggers: Vec<String> = db
            .client()
            .await
            .query(
                "SELECT tgname || ' ' || tgfoid::regproc::text || ' ' || tgtype || ' ' || tgenabled::text
                 FROM pg_trigger WHERE tgrelid = 'owned'::regclass ORDER BY tgname",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        assert_eq!(
            triggers,
            ["fencegate_fence fencegate.enforce 62 A"],
            "{decoy}"
        );
        assert_eq!(
            sqlstate(alice.batch_execute("INSERT INTO owned VALUES (1)").await),
            "ZF002",
            "{decoy}: a holder's write without a token"
        );
        owner
            .batch_execute("DROP FUNCTION IF EXISTS nothing()")
            .await
            .unwrap();
    }
}

/// Code that is not the holder's own, run inside the holder's transaction, may not raise
/// the holder's fences: a writer of `b` owns an inbox that the holder of `a-*` writes,
/// and its statement trigger calls `fencegate.fence()` for `a-x`; the owner of a fenced
/// table, who holds no resource, adds a trigger that does the same on every fenced
/// write. Both are refused (ZF006) and the fences stay; the holder's own statements
/// raise as ever; `fencegate check` names the code that calls the fence.
#[tokio::test]
async fn another_roles_code_cannot_raise_a_holders_fence() {
    let tenants = Tenants::create().await;
    let fenced = &tenants.fenced;
    let db = &fenced.db;
    let (alice_role, bob_role) = (format!("{}_alice", db.name()), format!("{}_bob", db.name()));
    let stranger = db.create_role("stranger", "LOGIN").await;
    fenced
        .execute(&format!(
            "CREATE TABLE inbox (id int); ALTER TABLE inbox OWNER TO {bob_role};
             GRANT INSERT ON inbox TO {alice_role};
             GRANT CREATE ON SCHEMA public TO {bob_role}, {stranger};
             CREATE TABLE a_stranger (id int); ALTER TABLE a_stranger OWNER TO {stranger};
             GRANT INSERT ON a_stranger TO {alice_role};"
        ))
        .await;
    fenced.protect("a_stranger", "a-1").await;
    fenced.raise("a-1", 5).await;
    let bob = tenants.bob("").await;
    bob.batch_execute(&format!(
        "CREATE FUNCTION raise_a() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM fencegate.fence('a-x', {MAX}); RETURN NULL; END $$;
         CREATE FUNCTION raise_a_as_bob() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
         BEGIN PERFORM fencegate.fence('a-x', {MAX}); RETURN NULL; END $$;
         CREATE TRIGGER plain AFTER INSERT ON inbox FOR EACH STATEMENT EXECUTE FUNCTION raise_a();"
    ))
    .await
    .unwrap();
    let alice = tenants.alice("").await;
    for trigger in ["plain", "definer"] {
        if trigger == "definer" {
            bob.batch_execute(
                "DROP TRIGGER plain ON inbox;
                 CREATE TRIGGER definer AFTER INSERT ON inbox FOR EACH STATEMENT
                     EXECUTE FUNCTION raise_a_as_bob();",
            )
            .await
            .unwrap();
        }
        let refused = alice
            .batch_execute("INSERT INTO inbox VALUES (1)")
            .await
            .unwrap_err();
        assert_eq!(fence_error(&refused).code().code(), "ZF006", "{trigger}");
        assert_eq!(fenced.highest("a-x").await, None, "{trigger}");
    }

    // The owner of a fenced table adds a trigger that raises before the fence's.
    let stranger = connect_with(&db.url_as(&stranger), "").await;
    stranger
        .batch_execute(&format!(
            "CREATE FUNCTION first() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM fencegate.fence('a-1', {MAX}); RETURN NULL; END $$;
             CREATE TRIGGER a_first BEFORE INSERT ON a_stranger FOR EACH STATEMENT
                 EXECUTE FUNCTION first();"
        ))
        .await
        .unwrap();
    let refused = alice
        .batch_execute("BEGIN; SELECT fencegate.fence('a-1', 5); INSERT INTO a_stranger VALUES (1)")
        .await
        .unwrap_err();
    assert_eq!(fence_error(&refused).code().code(), "ZF006");
    alice.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(fenced.highest("a-1").await, Some(5));
    let findings = fencegate_gateway::admin::audit(&fenced.admin)
        .await
        .unwrap();
    assert!(
        findings
            .iter()
            .any(|f| f.finding == "foreign_trigger_on_fenced_table"
                && f.object == "public.a_stranger"
                && f.severity == "problem"),
        "{findings:?}"
    );

    // The holder's own statements raise as ever, and a trigger may present the current
    // token: the fence's own trigger on the fenced table checks it at depth one.
    stranger
        .batch_execute("DROP TRIGGER a_first ON a_stranger")
        .await
        .unwrap();
    alice
        .batch_execute(
            "BEGIN; SELECT fencegate.fence('a-1', 6); INSERT INTO a_stranger VALUES (2); COMMIT;",
        )
        .await
        .unwrap();
    assert_eq!(fenced.highest("a-1").await, Some(6));

    let findings = fencegate_gateway::admin::audit(&fenced.admin)
        .await
        .unwrap();
    for function in ["raise_a()", "raise_a_as_bob()", "first()"] {
        assert!(
            findings.iter().any(|f| f.finding == "code_calls_fence"
                && f.object == format!("function public.{function}")
                && f.severity == "warning"),
            "{function}: {findings:?}"
        );
    }
}

/// A role that holds no resource takes a fence's takeover key exclusively, where
/// `pg_locks` showed it, so that the current term's writers cannot mark themselves and
/// a new term's takeover finds no one to end. The fence ends that session as the next
/// writer marks itself, and the new term ends the older term's open transaction after
/// the takeover timeout as ever.
#[tokio::test]
async fn no_role_can_hide_an_older_term_from_a_takeover() {
    let tenants = Tenants::create().await;
    let fenced = &tenants.fenced;
    fenced
        .execute("INSERT INTO fencegate.settings VALUES ('term_takeover_timeout_ms', '300')")
        .await;
    fenced.raise("a-1", 7).await;
    let key: i64 = fenced
        .db
        .value("SELECT lock_key FROM fencegate.fences WHERE resource = 'a-1'")
        .await;
    let mallory = fenced.tenant("mallory", &[]).await;
    let mallory = connect_with(&mallory, "").await;
    mallory
        .query_one("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .unwrap();

    // A writer of term 7 marks itself, ending mallory's session; mallory comes back.
    tenants
        .alice("")
        .await
        .batch_execute("BEGIN; SELECT fencegate.fence('a-1', 7); COMMIT;")
        .await
        .unwrap();
    assert!(
        mallory.batch_execute("SELECT 1").await.is_err(),
        "the session that held the key exclusively is ended"
    );
    let mallory = fenced.tenant("mallory2", &[]).await;
    let mallory = connect_with(&mallory, "").await;
    mallory
        .query_one("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .unwrap();
    let old = tenants.alice("").await;
    old.batch_execute(
        "BEGIN; SELECT fencegate.fence('a-1', 7); INSERT INTO a_rows VALUES (1, 'old')",
    )
    .await
    .unwrap();
    assert!(mallory.batch_execute("SELECT 1").await.is_err());
    let new = tenants.alice("").await;
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        new.batch_execute(
            "BEGIN; SELECT fencegate.fence('a-1', 8); INSERT INTO a_rows VALUES (2, 'new'); COMMIT;",
        ),
    )
    .await
    .expect("the new term ends the older one instead of waiting for it")
    .expect("the raise completes");
    assert!(old.batch_execute("COMMIT").await.is_err());
    assert_eq!(fenced.count("a_rows").await, 1);
    let ended: Vec<String> = fenced
        .db
        .client()
        .await
        .query("SELECT ended_by FROM fencegate.takeovers ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    // The second key holder's record rolled back with the old term's transaction it was
    // ended in; the log's sequence counts it.
    assert_eq!(ended, ["key_holder", "fence"]);
    let issued: i64 = fenced
        .db
        .value("SELECT pg_sequence_last_value('fencegate.takeovers_id_seq')")
        .await;
    assert_eq!(issued, 3);
}

/// A writer marks itself as a holder of its own resource's term only: its statements
/// take the advisory key of the fence they present and no other, whatever plan the
/// session keeps for them (each form runs often enough first for a generic plan). A
/// takeover of another resource — an older term of `b` ended by a newer one — leaves
/// the writer of `a-1` alone, and its transaction commits.
#[tokio::test]
async fn a_writer_holds_no_other_resources_takeover_key() {
    let tenants = Tenants::create().await;
    let fenced = &tenants.fenced;
    fenced
        .execute("INSERT INTO fencegate.settings VALUES ('term_takeover_timeout_ms', '300')")
        .await;
    fenced.raise("a-1", 7).await;
    for other in ["a-2", "a-3", "a-4", "a-5"] {
        fenced.raise(other, 1).await;
    }
    // The statistics autovacuum would gather: small tables, as most deployments have.
    fenced.execute("ANALYZE").await;
    let own: i64 = fenced
        .db
        .value("SELECT lock_key FROM fencegate.fences WHERE resource = 'a-1'")
        .await;
    let forms = [
        (
            "-c fencegate.token=a-1=7",
            "INSERT INTO a_rows VALUES (1, 'token')",
        ),
        (
            "",
            "SELECT fencegate.fence('a-1', 7); INSERT INTO a_rows VALUES (2, 'fence')",
        ),
    ];
    for (older, (options, statements)) in (3..).zip(forms) {
        let writer = tenants.alice(options).await;
        for _ in 0..12 {
            writer
                .batch_execute(&format!("BEGIN; {statements}; COMMIT;"))
                .await
                .unwrap();
        }
        writer
            .batch_execute(&format!("BEGIN; {statements};"))
            .await
            .unwrap();
        let keys: Vec<i64> = writer
            .query(
                "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks
                 WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        assert_eq!(
            keys,
            [own],
            "{statements:?}: the advisory keys the writer holds"
        );

        // Another resource's older term, ended by its newer one.
        let old = tenants.bob("").await;
        old.batch_execute(&format!(
            "BEGIN; SELECT fencegate.fence('b', {older}); INSERT INTO b_rows VALUES (1, 'old')"
        ))
        .await
        .unwrap();
        let new = tenants.bob("").await;
        let newer = older + 1;
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            new.batch_execute(&format!(
                "BEGIN; SELECT fencegate.fence('b', {newer}); COMMIT;"
            )),
        )
        .await
        .expect("the newer term of b ends the older one")
        .expect("the raise of b completes");
        assert!(old.batch_execute("COMMIT").await.is_err());
        writer
            .batch_execute("COMMIT")
            .await
            .expect("the writer of a-1 is not ended by a takeover of b");
    }
}

/// The seed's `leader_lease` table, guarded: the seed's statements (through the lease
/// client's store) still elect; an elector cannot write an epoch of its own choosing,
/// take a lease another role holds, elect for a resource it does not hold, or delete;
/// the owner retires a forged record with a reason, on the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn electors_cannot_forge_a_guarded_leader_lease() {
    let tenants = Tenants::create().await;
    let db = &tenants.fenced.db;
    tenants
        .fenced
        .execute(&format!(
            "CREATE TABLE leader_lease (name text PRIMARY KEY, holder text,
                 epoch bigint NOT NULL DEFAULT 0,
                 expires_at timestamptz NOT NULL DEFAULT '-infinity');
             INSERT INTO leader_lease (name) VALUES ('a-1'), ('b');
             GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON leader_lease TO {0}_alice, {0}_bob;",
            db.name()
        ))
        .await;
    fencegate_gateway::admin::guard_leader_lease(&tenants.fenced.admin, "leader_lease")
        .await
        .unwrap();

    // The seed's statements, as the lease client runs them.
    let store = PostgresStore::new(&tenants.alice, "leader_lease", false).unwrap();
    let ttl = std::time::Duration::from_secs(30);
    let epoch = store.acquire("a-1", "node-a", ttl).await.unwrap().unwrap();
    assert_eq!(epoch.get(), 1);
    assert!(store.renew("a-1", "node-a", epoch, ttl).await.unwrap());
    let again = store.acquire("a-1", "node-a", ttl).await.unwrap().unwrap();
    assert_eq!(again.get(), 2, "re-acquiring is a new term");

    let alice = tenants.alice("").await;
    for (sql, code) in [
        (
            format!("UPDATE leader_lease SET epoch = {MAX} WHERE name = 'a-1'"),
            "ZF008",
        ),
        (
            "UPDATE leader_lease SET epoch = epoch + 2 WHERE name = 'a-1'".to_owned(),
            "ZF008",
        ),
        (
            "UPDATE leader_lease SET epoch = 1 WHERE name = 'a-1'".to_owned(),
            "ZF008",
        ),
        (
            "UPDATE leader_lease SET epoch = epoch + 1, holder = 'x' WHERE name = 'b'".to_owned(),
            "ZF006",
        ),
        (
            format!("INSERT INTO leader_lease (name, epoch) VALUES ('a-9', {MAX})"),
            "ZF008",
        ),
        (
            "DELETE FROM leader_lease WHERE name = 'a-1'".to_owned(),
            "ZF008",
        ),
        ("TRUNCATE leader_lease".to_owned(), "ZF008"),
        (
            "UPDATE leader_lease SET holder_role = 'nobody' WHERE name = 'a-1'".to_owned(),
            "ZF008",
        ),
    ] {
        assert_eq!(sqlstate(alice.batch_execute(&sql).await), code, "{sql}");
    }
    // Bob may elect for b, but not take a-1 while alice holds it, even if he held it.
    let bob = tenants.bob("").await;
    bob.batch_execute(
        "UPDATE leader_lease SET holder = 'node-b', epoch = epoch + 1,
             expires_at = now() + interval '30 seconds' WHERE name = 'b'",
    )
    .await
    .unwrap();
    let holder_role: String = db
        .value("SELECT holder_role::text FROM leader_lease WHERE name = 'b'")
        .await;
    assert_eq!(holder_role, format!("{}_bob", db.name()));
    let epochs: Vec<(String, i64)> = tenants
        .fenced
        .admin
        .query("SELECT name, epoch FROM leader_lease ORDER BY name", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(epochs, [("a-1".to_owned(), 2), ("b".to_owned(), 1)]);

    // The owner forges (or finds) a record, then retires it with a reason.
    tenants
        .fenced
        .execute(&format!(
            "UPDATE leader_lease SET epoch = {MAX} WHERE name = 'b'"
        ))
        .await;
    let mut owner = fencegate_gateway::admin::connect(&db.url()).await.unwrap();
    let refused = tenants
        .fenced
        .admin
        .batch_execute("UPDATE leader_lease SET epoch = 1 WHERE name = 'b'")
        .await
        .unwrap_err();
    assert_eq!(
        refused.code().unwrap().code(),
        "ZF008",
        "a reason is required"
    );
    let retired = fencegate_gateway::admin::retire_lease(
        &mut owner,
        "leader_lease",
        "b",
        1,
        "epoch forged in incident 7",
    )
    .await
    .unwrap();
    assert_eq!(retired, MAX);
    let record: (String, i64, i64, String) = {
        let row = tenants
            .fenced
            .admin
            .query_one(
                "SELECT name, from_epoch, to_epoch, reason FROM fencegate.issuer_retirements",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1), row.get(2), row.get(3))
    };
    assert_eq!(
        record,
        (
            "b".to_owned(),
            MAX,
            1,
            "epoch forged in incident 7".to_owned()
        )
    );
}

/// The SQL login of `/v1/sql`, connected by itself as a writer's statements run: it
/// cannot call the fence, cannot take the fence step without the gateway's key, and a
/// setting or a forged record of a fence step opens no fenced table.
#[tokio::test]
async fn the_sql_login_holds_no_fence() {
    let tenants = Tenants::create().await;
    let db = &tenants.fenced.db;
    let sql_login = db.create_role("sql", "LOGIN").await;
    db.execute(&format!(
        "GRANT USAGE ON SCHEMA public TO {sql_login};
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {sql_login};"
    ))
    .await;
    let gateway = fencegate_tests::gateway::Gateway::builder()
        .database(&db.url())
        .sql_as(&db.url_as(&sql_login))
        .spawn()
        .await;
    let login = connect_with(&db.url_as(&sql_login), "").await;
    for (sql, code) in [
        (format!("SELECT fencegate.fence('b', {MAX})"), "42501"),
        (
            format!("SELECT fencegate.sql_fence('b', {MAX}, '\\x00')"),
            "ZF006",
        ),
        (
            format!("BEGIN; SET LOCAL fencegate.token = 'b={MAX}'; UPDATE b_rows SET note = 'x'"),
            "ZF006",
        ),
        (
            "BEGIN; SELECT set_config('fencegate.fenced', 'b=3', true); DELETE FROM b_rows"
                .to_owned(),
            "ZF006",
        ),
        ("INSERT INTO fencegate.sql_grants VALUES (pg_backend_pid(), pg_current_xact_id(), 'b', 3)".to_owned(), "42501"),
    ] {
        assert_eq!(sqlstate(login.batch_execute(&sql).await), code, "{sql}");
        let _ = login.batch_execute("ROLLBACK").await;
    }
    assert_eq!(tenants.fenced.highest("b").await, Some(3));

    // Through the gateway: a transaction of `a-1` writes a-1's table, not b's.
    let client = gateway.client();
    let own = client
        .sql(
            "a-1",
            7,
            serde_json::json!({"statements": [{"sql": "INSERT INTO a_rows VALUES (1, 'sql')"}]}),
        )
        .await;
    assert_eq!(own.status, 200, "{:?}", own.json());
    let crossed = client
        .sql(
            "a-1",
            7,
            serde_json::json!({"statements": [{"sql": "UPDATE b_rows SET note = 'x'"}]}),
        )
        .await;
    assert_eq!(crossed.json()["sqlstate"], "ZF006", "{:?}", crossed.json());
    assert_eq!(tenants.fenced.highest("a-1").await, Some(7));
    assert_eq!(tenants.fenced.highest("b").await, Some(3));
}

/// A SQL login that holds a resource, or can act as a role that does, is refused at
/// start: the writers' statements would hold it too.
#[tokio::test]
async fn a_sql_login_with_resources_of_its_own_is_refused() {
    let tenants = Tenants::create().await;
    let refused = fencegate_tests::gateway::Gateway::builder()
        .database(&tenants.fenced.db.url())
        .sql_as(&tenants.bob)
        .try_spawn()
        .await
        .err()
        .expect("a SQL login holding `b` does not start");
    assert!(
        refused.logs.contains("holds resources of its own"),
        "{refused}"
    );
}

/// The same with `--sql-role`: the writer's statements run as that role, which holds no
/// resource; the transaction's own resource is all they hold. A `--sql-role` that
/// holds resources is refused at start, like the login.
#[tokio::test]
async fn with_a_sql_role_too() {
    let tenants = Tenants::create().await;
    let db = &tenants.fenced.db;
    let sql_login = db.create_role("sql", "LOGIN").await;
    let sql_role = db.create_role("sqlrole", "NOLOGIN").await;
    db.execute(&format!(
        "GRANT {sql_role} TO {sql_login};
         GRANT USAGE ON SCHEMA public TO {sql_role};
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {sql_role};"
    ))
    .await;
    let gateway = fencegate_tests::gateway::Gateway::builder()
        .database(&db.url())
        .sql_as(&db.url_as(&sql_login))
        .args(&["--sql-role", &sql_role])
        .spawn()
        .await;
    let client = gateway.client();
    let statements = |sql: &str| serde_json::json!({"statements": [{"sql": sql}]});
    let own = client
        .sql("b", 3, statements("INSERT INTO b_rows VALUES (1, 'sql')"))
        .await;
    assert_eq!(own.status, 200, "{:?}", own.json());
    let crossed = client
        .sql("b", 3, statements("INSERT INTO a_rows VALUES (1, 'x')"))
        .await;
    assert_eq!(crossed.json()["sqlstate"], "ZF006", "{:?}", crossed.json());
    drop(gateway);

    fencegate_gateway::admin::grant(
        &tenants.fenced.admin,
        &sql_role,
        &[fencegate_gateway::auth::Pattern::parse("a-*").unwrap()],
        false,
    )
    .await
    .unwrap();
    let refused = fencegate_tests::gateway::Gateway::builder()
        .database(&db.url())
        .sql_as(&db.url_as(&sql_login))
        .args(&["--sql-role", &sql_role])
        .try_spawn()
        .await
        .err()
        .expect("a --sql-role that holds resources does not start");
    assert!(
        refused.logs.contains(&format!("can act as {sql_role}")),
        "{refused}"
    );
}

/// Grants of a dropped role are revoked by its oid; revoking the right to fence tables
/// leaves the role's resources; `grants` lists both kinds.
#[tokio::test]
async fn revoke_and_grants_cover_every_kind() {
    let tenants = Tenants::create().await;
    let db = &tenants.fenced.db;
    let admin = &tenants.fenced.admin;
    let alice_role = format!("{}_alice", db.name());
    fencegate_gateway::admin::grant(admin, &alice_role, &[], true)
        .await
        .unwrap();
    let listed = fencegate_gateway::admin::grants(admin).await.unwrap();
    let has = |listed: &[fencegate_gateway::admin::Held], role: &str, pattern: &str| {
        listed
            .iter()
            .any(|h| h.role == role && h.pattern == pattern)
    };
    assert!(has(&listed, &alice_role, "a-*"), "{listed:?}");
    assert!(has(&listed, &alice_role, "--tables"), "{listed:?}");
    fencegate_gateway::admin::revoke(admin, &alice_role, &[], true)
        .await
        .unwrap();
    let listed = fencegate_gateway::admin::grants(admin).await.unwrap();
    assert!(has(&listed, &alice_role, "a-*"), "{listed:?}");
    assert!(!has(&listed, &alice_role, "--tables"), "{listed:?}");
    tenants
        .alice("")
        .await
        .query_one("SELECT fencegate.fence('a-1', 3)", &[])
        .await
        .expect("alice keeps her resources");

    // A dropped role's grant stays until revoked by its oid.
    let gone = db.create_role("gone", "").await;
    fencegate_gateway::admin::grant(
        admin,
        &gone,
        &[fencegate_gateway::auth::Pattern::parse("z").unwrap()],
        false,
    )
    .await
    .unwrap();
    let oid: u32 = db
        .value(&format!(
            "SELECT oid FROM pg_roles WHERE rolname = '{gone}'"
        ))
        .await;
    db.execute(&format!(
        "REVOKE ALL ON SCHEMA fencegate FROM {gone};
         REVOKE ALL ON FUNCTION fencegate.fence(text, bigint) FROM {gone};
         DROP ROLE {gone};"
    ))
    .await;
    let findings = fencegate_gateway::admin::audit(admin).await.unwrap();
    assert!(
        findings
            .iter()
            .any(|f| f.finding == "authority_of_missing_role" && f.object == oid.to_string()),
        "{findings:?}"
    );
    let taken = fencegate_gateway::admin::revoke(admin, &oid.to_string(), &[], false)
        .await
        .unwrap();
    assert_eq!(taken, 1);
    let findings = fencegate_gateway::admin::audit(admin).await.unwrap();
    assert!(
        !findings
            .iter()
            .any(|f| f.finding == "authority_of_missing_role"),
        "{findings:?}"
    );
}

/// A gateway whose login is not a superuser starts on a schema whose partition guard a
/// superuser installed — its function belongs to that superuser, and the gateway leaves
/// it as it is; `check` says when it is out of date, until a superuser installs it again.
#[tokio::test]
async fn a_gateway_login_that_is_not_a_superuser_upgrades_around_the_guard() {
    let db = fencegate_tests::db::TestDb::create().await;
    let login = db.create_role("gw", "LOGIN").await;
    db.execute(&format!(
        "GRANT CREATE ON DATABASE {} TO {login}",
        db.name()
    ))
    .await;
    let url = db.url_as(&login);
    fencegate_gateway::admin::connect(&url)
        .await
        .expect("the gateway's login creates the schema");
    let superuser = fencegate_gateway::admin::connect(&db.url()).await.unwrap();
    superuser
        .batch_execute("SELECT fencegate.install_partition_guard()")
        .await
        .unwrap();
    // A later version of the functions, applied by the gateway's login.
    db.execute("UPDATE fencegate.schema_functions SET digest = 'an earlier version'")
        .await;
    let gateway = fencegate_gateway::admin::connect(&url)
        .await
        .expect("the functions are applied around the superuser's");
    let applied: String = db
        .value("SELECT digest FROM fencegate.schema_functions")
        .await;
    assert_ne!(applied, "an earlier version");
    let outdated = |findings: &[fencegate_gateway::admin::Finding]| {
        findings
            .iter()
            .any(|f| f.finding == "partition_guard_outdated")
    };
    let findings = fencegate_gateway::admin::audit(&gateway).await.unwrap();
    assert!(!outdated(&findings), "{findings:?}");
    // An earlier body, as a superuser of an earlier version left it.
    superuser
        .batch_execute(
            "CREATE OR REPLACE FUNCTION fencegate.fence_new_partitions() RETURNS event_trigger
                 LANGUAGE plpgsql SECURITY DEFINER AS $$ BEGIN END $$",
        )
        .await
        .unwrap();
    let findings = fencegate_gateway::admin::audit(&gateway).await.unwrap();
    assert!(outdated(&findings), "{findings:?}");
    superuser
        .batch_execute("SELECT fencegate.install_partition_guard()")
        .await
        .unwrap();
    let findings = fencegate_gateway::admin::audit(&gateway).await.unwrap();
    assert!(!outdated(&findings), "{findings:?}");
}
