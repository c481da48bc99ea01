//! The set-based group statements against a real Postgres (`FENCEGATE_TEST_PG`, by
//! default postgres://postgres@127.0.0.1:5432; the tests fail if it cannot be reached):
//! a group applied by [`set_statement`] or [`set_transaction`] must answer, and leave the
//! tables, exactly as the same writes applied one statement each, in the same order.

use bytes::Bytes;
use deadpool_postgres::Object;
use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName, Token};
use rand::Rng;

use super::{
    by_resource, one_token_per_resource, runs_without_repeats, set_statement, set_transaction,
    GroupResult,
};
use crate::store::postgres::writes::write_unconditional;
use crate::store::postgres::{migrate, new_pool, PgPool};
use crate::store::{Write, WriteOp};

fn server_url() -> String {
    std::env::var("FENCEGATE_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// A new database with the `fencegate` schema, dropped when the value is.
pub(super) struct Scratch {
    name: String,
    pool: PgPool,
}

impl Scratch {
    pub(super) async fn create() -> Scratch {
        let name = format!("fg_group_{:016x}", rand::random::<u64>());
        admin(&format!("CREATE DATABASE {name}")).await;
        let url = format!("{}/{name}?sslmode=disable", server_url());
        let crate::pgtls::PgUrl { config, tls } = crate::pgtls::parse(&url).unwrap();
        let (mut client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        migrate(&mut client).await.unwrap();
        Scratch {
            name,
            pool: new_pool(config, &tls, 2),
        }
    }

    pub(super) async fn client(&self) -> Object {
        self.pool.clone().into_inner().get().await.unwrap()
    }

    /// Every fence and object, in order.
    pub(super) async fn contents(&self) -> Vec<String> {
        let client = self.client().await;
        let rows = client
            .query(
                "SELECT format('fence %s %s', resource, highest) FROM fencegate.fences
                 UNION ALL
                 SELECT format('object %s/%s %s token %s version %s born %s',
                               resource, key, encode(value, 'escape'), token, version, born)
                 FROM fencegate.objects
                 ORDER BY 1",
                &[],
            )
            .await
            .unwrap();
        rows.iter().map(|row| row.get(0)).collect()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Best effort, on a thread of its own: the test's runtime may be shutting down.
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(admin(&format!(
                    "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                )))
        })
        .join();
    }
}

async fn admin(sql: &str) {
    let url = format!("{}/postgres?sslmode=disable", server_url());
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("the test Postgres server {url} cannot be reached: {e:?}"));
    tokio::spawn(connection);
    client
        .batch_execute(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
}

pub(super) fn write(resource: &str, key: &str, token: u64, value: Option<String>) -> Write {
    Write {
        resource: ResourceName::new(resource).unwrap(),
        key: ObjectKey::new(key).unwrap(),
        token: Token::new(token).unwrap(),
        precondition: Precondition::None,
        op: match value {
            Some(value) => WriteOp::Put(Bytes::from(value)),
            None => WriteOp::Delete,
        },
    }
}

/// A random group, sorted as a lane sorts it: few resources and keys, so that tokens
/// cross, objects repeat, and deletes meet live objects, tombstones and new keys.
fn random_group(rng: &mut impl Rng, round: usize) -> Vec<Write> {
    let mut group: Vec<Write> = (0..rng.random_range(2..=24))
        .map(|i| {
            let resource = format!("r{}", rng.random_range(0..3));
            let key = format!("k{}", rng.random_range(0..4));
            let value = rng
                .random_bool(0.75)
                .then(|| format!("{resource}/{key}#{round}.{i}"));
            write(&resource, &key, rng.random_range(1..=10), value)
        })
        .collect();
    group.sort_by(by_resource);
    group
}

/// What the expected answers of [`grouped_as_one_by_one`] were, to check that the
/// rounds covered what they are for.
#[derive(Debug, Default)]
struct Coverage {
    stale: usize,
    applied: usize,
    created: usize,
    deleted: usize,
}

/// Applies `rounds` groups made by `group_of` on one database by `apply`, and the same
/// writes one statement each on another, and checks that every answer and, after each
/// round, both databases' tables are the same.
async fn grouped_as_one_by_one(
    rounds: usize,
    mut group_of: impl FnMut(&mut rand::rngs::ThreadRng, usize) -> Vec<Write>,
    apply: impl AsyncFn(&Object, &[&Write]) -> Option<GroupResult>,
) -> Coverage {
    let (grouped, one_by_one) = (Scratch::create().await, Scratch::create().await);
    let (group_client, each_client) = (grouped.client().await, one_by_one.client().await);
    let mut rng = rand::rng();
    let mut seen = Coverage::default();
    for round in 0..rounds {
        let group = group_of(&mut rng, round);
        let writes: Vec<&Write> = group.iter().collect();

        let answers = match apply(&group_client, &writes).await {
            Some(GroupResult::Committed(answers)) => answers,
            Some(GroupResult::Failed(error)) => panic!("round {round}: {error:?}"),
            Some(GroupResult::RolledBack) => panic!("round {round}: rolled back"),
            Some(GroupResult::Blocked(resource)) => panic!("round {round}: {resource} locked"),
            None => panic!("round {round}: a lock timed out"),
        };
        let mut expected = Vec::new();
        for write in &writes {
            expected.push(write_unconditional(&each_client, write).await);
        }

        assert_eq!(answers.len(), writes.len());
        for (index, (got, want)) in answers.iter().zip(&expected).enumerate() {
            let want = want.as_ref().expect("a single statement succeeds");
            assert_eq!(
                got.as_ref().ok(),
                Some(want),
                "round {round}, write {index} of {writes:#?}"
            );
            match want {
                super::Attempt::Stale => seen.stale += 1,
                super::Attempt::Applied { created, .. } => {
                    seen.applied += 1;
                    seen.created += usize::from(*created);
                    seen.deleted += usize::from(matches!(writes[index].op, WriteOp::Delete));
                }
                super::Attempt::PreconditionFailed { .. } => unreachable!("no precondition"),
            }
        }
        assert_eq!(
            grouped.contents().await,
            one_by_one.contents().await,
            "after round {round}"
        );
    }
    seen
}

#[tokio::test]
async fn a_group_transaction_answers_and_writes_as_one_statement_per_write() {
    let mut runs = 0;
    let group_of = |rng: &mut rand::rngs::ThreadRng, round| {
        let group = random_group(rng, round);
        runs += runs_without_repeats(&group.iter().collect::<Vec<_>>()).len();
        group
    };
    let seen = grouped_as_one_by_one(60, group_of, async |client, writes| {
        set_transaction(client, writes).await
    })
    .await;
    assert!(seen.stale > 0 && seen.created > 0, "{seen:?}");
    assert!(runs > 60, "no group repeated an object");
}

/// A random group that [`set_statement`] takes: each resource's writes carry one token
/// (drawn per round, so fences are raised, met and missed), no object twice.
fn random_plain_group(rng: &mut impl Rng, round: usize) -> Vec<Write> {
    let tokens: Vec<u64> = (0..3).map(|_| rng.random_range(1..=10)).collect();
    let mut objects: Vec<(usize, usize)> =
        (0..3).flat_map(|r| (0..4).map(move |k| (r, k))).collect();
    let count = rng.random_range(2..=objects.len());
    let mut group: Vec<Write> = (0..count)
        .map(|i| {
            let (r, k) = objects.swap_remove(rng.random_range(0..objects.len()));
            let (resource, key) = (format!("r{r}"), format!("k{k}"));
            let value = rng
                .random_bool(0.75)
                .then(|| format!("{resource}/{key}#{round}.{i}"));
            write(&resource, &key, tokens[r], value)
        })
        .collect();
    group.sort_by(by_resource);
    group
}

#[tokio::test]
async fn a_group_statement_answers_and_writes_as_one_statement_per_write() {
    let seen = grouped_as_one_by_one(80, random_plain_group, async |client, writes| {
        let fences = one_token_per_resource(writes).expect("one token per resource");
        set_statement(client, writes, &fences).await
    })
    .await;
    assert!(
        seen.stale > 0 && seen.applied > 0 && seen.created > 0 && seen.deleted > 0,
        "{seen:?}"
    );
}

/// A group statement that meets a fence row locked by someone else stops at the lane's
/// lock timeout and applies nothing, not even the writes of the free resources.
#[tokio::test]
async fn a_group_statement_that_meets_a_locked_fence_applies_nothing() {
    let scratch = Scratch::create().await;
    let (holder, lane) = (scratch.client().await, scratch.client().await);
    holder
        .batch_execute("INSERT INTO fencegate.fences (resource, highest) VALUES ('b', 1)")
        .await
        .unwrap();
    holder
        .batch_execute("BEGIN; SELECT 1 FROM fencegate.fences WHERE resource = 'b' FOR UPDATE")
        .await
        .unwrap();
    lane.batch_execute("SET lock_timeout = '100ms'")
        .await
        .unwrap();
    let group = [
        write("a", "k", 1, Some("1".into())),
        write("b", "k", 1, Some("2".into())),
        write("c", "k", 1, Some("3".into())),
    ];
    let writes: Vec<&Write> = group.iter().collect();
    let fences = one_token_per_resource(&writes).expect("a plain group");
    assert!(
        set_statement(&lane, &writes, &fences).await.is_none(),
        "the lock timeout is reported as such"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
    drop((holder, lane)); // the pool holds two connections
    assert_eq!(scratch.contents().await, ["fence b 1"]);
}

#[test]
fn only_groups_with_one_token_per_resource_and_no_repeated_object_take_one_statement() {
    let plain = [
        write("a", "k1", 3, Some("1".into())),
        write("a", "k2", 3, None),
        write("b", "k1", 1, Some("2".into())),
    ];
    let writes: Vec<&Write> = plain.iter().collect();
    let fences = one_token_per_resource(&writes).expect("a plain group");
    assert_eq!(fences.resources, ["a", "b"]);
    assert_eq!(fences.tokens, [3, 1]);

    let crossing = [
        write("a", "k1", 3, Some("1".into())),
        write("a", "k2", 4, Some("2".into())),
    ];
    let writes: Vec<&Write> = crossing.iter().collect();
    assert!(one_token_per_resource(&writes).is_none(), "two tokens on a");

    let repeated = [
        write("a", "k1", 3, Some("1".into())),
        write("a", "k1", 3, Some("2".into())),
    ];
    let writes: Vec<&Write> = repeated.iter().collect();
    assert!(one_token_per_resource(&writes).is_none(), "a/k1 twice");
}

#[tokio::test]
async fn objects_written_twice_in_a_group_are_split_into_runs_in_order() {
    let group = [
        write("a", "k1", 1, Some("1".into())),
        write("a", "k2", 1, Some("2".into())),
        write("a", "k1", 2, None),
        write("b", "k1", 1, Some("3".into())),
        write("b", "k1", 1, Some("4".into())),
    ];
    let writes: Vec<&Write> = group.iter().collect();
    let runs: Vec<usize> = runs_without_repeats(&writes)
        .iter()
        .map(|run| run.len())
        .collect();
    assert_eq!(runs, [2, 2, 1]);
}

#[test]
fn large_values_end_a_run_before_its_parameters_grow_past_the_cap() {
    let big = "x".repeat(super::RUN_BYTES / 2 + 1);
    let group: Vec<Write> = (0..5)
        .map(|i| write("a", &format!("k{i}"), 1, Some(big.clone())))
        .collect();
    let writes: Vec<&Write> = group.iter().collect();
    let runs: Vec<usize> = runs_without_repeats(&writes)
        .iter()
        .map(|run| run.len())
        .collect();
    assert_eq!(runs, [1, 1, 1, 1, 1]);
    // A value larger than the cap is a run of its own, never an empty run.
    let huge = [write("a", "k", 1, Some("x".repeat(super::RUN_BYTES + 1)))];
    let writes: Vec<&Write> = huge.iter().collect();
    assert_eq!(runs_without_repeats(&writes).len(), 1);
}

/// `GROUP_LOCK` holds each existing fence row's lock until the transaction ends, without
/// writing a new version of it, and creates the missing rows at 1.
#[tokio::test]
async fn the_lock_statement_locks_existing_fences_without_writing_them() {
    let scratch = Scratch::create().await;
    let (holder, other) = (scratch.client().await, scratch.client().await);
    holder
        .batch_execute("INSERT INTO fencegate.fences (resource, highest) VALUES ('a', 5)")
        .await
        .unwrap();
    let version = "SELECT ctid::text, xmin::text FROM fencegate.fences WHERE resource = 'a'";
    let before = holder.query_one(version, &[]).await.unwrap();
    let (before_ctid, before_xmin): (String, String) = (before.get(0), before.get(1));

    holder.batch_execute("BEGIN").await.unwrap();
    let resources = vec!["a", "b"];
    holder
        .execute(super::statements::GROUP_LOCK, &[&resources])
        .await
        .unwrap();

    let after = other.query_one(version, &[]).await.unwrap();
    assert_eq!(
        (after.get::<_, String>(0), after.get::<_, String>(1)),
        (before_ctid, before_xmin),
        "the locked fence row got a new version"
    );
    let locked = other
        .query(
            "SELECT 1 FROM fencegate.fences WHERE resource = 'a' FOR UPDATE NOWAIT",
            &[],
        )
        .await
        .expect_err("the fence row is not locked");
    assert_eq!(
        locked.code(),
        Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE),
        "{locked:?}"
    );

    holder.batch_execute("COMMIT").await.unwrap();
    other
        .query(
            "SELECT 1 FROM fencegate.fences WHERE resource = 'a' FOR UPDATE NOWAIT",
            &[],
        )
        .await
        .expect("the lock ends with the transaction");
    drop((holder, other)); // the pool holds two connections
    assert_eq!(
        scratch.contents().await,
        ["fence a 5", "fence b 1"],
        "no fence moved, and the missing one was created at 1"
    );
}
