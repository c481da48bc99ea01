//! The writer's batching, driven directly: jobs queued before the writer runs, so the
//! batches it forms are known.

use std::path::PathBuf;

use bytes::Bytes;
use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName, Token};
use redb::{Database, ReadableDatabase};
use tokio::sync::{mpsc, oneshot};

use super::{commit_batch, writer, Job, Responder};
use crate::store::embedded::{initialise, FENCES, OBJECTS};
use crate::store::{AdvanceOutcome, StoreError, Write, WriteOp, WriteOutcome};

/// A store file in a directory of its own, removed when dropped.
struct Scratch {
    dir: PathBuf,
    db: Database,
}

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("fencegate-embedded-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(crate::store::embedded::FILE_NAME);
        let db = Database::create(&path).unwrap();
        initialise(&db, &path, false, None).unwrap();
        Scratch { dir, db }
    }

    fn fence(&self, resource: &str) -> Option<u64> {
        let txn = self.db.begin_read().unwrap();
        let fences = txn.open_table(FENCES).unwrap();
        let highest = fences.get(resource).unwrap().map(|e| e.value());
        highest
    }

    /// (token, version, born, value) of an object.
    fn object(&self, resource: &str, key: &str) -> Option<(u64, u64, u64, Option<Vec<u8>>)> {
        let txn = self.db.begin_read().unwrap();
        let objects = txn.open_table(OBJECTS).unwrap();
        let row = objects.get((resource, key)).unwrap().map(|e| {
            let (token, version, born, value) = e.value();
            (token, version, born, value.map(<[u8]>::to_vec))
        });
        row
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

type Awaited<T> = oneshot::Receiver<Result<T, StoreError>>;

fn write(
    resource: &str,
    token: u64,
    precondition: Precondition,
    op: WriteOp,
) -> (Job, Awaited<WriteOutcome>) {
    let (reply, answer): (Responder<WriteOutcome>, _) = oneshot::channel();
    let write = Write {
        resource: ResourceName::new(resource).unwrap(),
        key: ObjectKey::new("k").unwrap(),
        token: Token::new(token).unwrap(),
        precondition,
        op,
    };
    (Job::Write { write, reply }, answer)
}

fn put(resource: &str, token: u64, value: &'static str) -> (Job, Awaited<WriteOutcome>) {
    write(
        resource,
        token,
        Precondition::None,
        WriteOp::Put(Bytes::from_static(value.as_bytes())),
    )
}

fn advance(resource: &str, token: u64) -> (Job, Awaited<AdvanceOutcome>) {
    let (reply, answer) = oneshot::channel();
    let job = Job::Advance {
        resource: ResourceName::new(resource).unwrap(),
        token: Token::new(token).unwrap(),
        reply,
    };
    (job, answer)
}

fn answered<T>(mut answer: Awaited<T>) -> T {
    answer
        .try_recv()
        .expect("the job was answered")
        .expect("the job succeeded")
}

fn token(n: u64) -> Token {
    Token::new(n).unwrap()
}

#[test]
fn one_batch_checks_each_job_against_the_fence_the_jobs_before_it_left() {
    let store = Scratch::new("order");
    let (j1, a1) = put("r", 5, "one");
    let (j2, a2) = put("r", 3, "late");
    let (j3, a3) = advance("r", 7);
    let (j4, a4) = put("r", 6, "behind the advance");
    let (j5, a5) = write("r", 9, Precondition::Version(9), WriteOp::Delete);
    let (j6, a6) = write("r", 7, Precondition::Version(1), WriteOp::Delete);
    let (j7, a7) = put("r", 7, "two");
    let (j8, a8) = advance("r", 6);
    let (j9, a9) = write("r", 8, Precondition::MustExist, WriteOp::Delete);

    commit_batch(&store.db, vec![j1, j2, j3, j4, j5, j6, j7, j8, j9]);

    assert_eq!(
        answered(a1),
        WriteOutcome::Applied {
            version: 1,
            created: true
        }
    );
    assert_eq!(answered(a2), WriteOutcome::Stale { highest: token(5) });
    assert_eq!(answered(a3), AdvanceOutcome::Applied);
    assert_eq!(answered(a4), WriteOutcome::Stale { highest: token(7) });
    assert_eq!(
        answered(a5),
        WriteOutcome::PreconditionFailed { current: Some(1) }
    );
    // The rejected write with token 9 left the fence at 7, so token 7 still writes.
    assert_eq!(
        answered(a6),
        WriteOutcome::Applied {
            version: 2,
            created: false
        }
    );
    // Put over a tombstone: a new object, its version continuing the sequence.
    assert_eq!(
        answered(a7),
        WriteOutcome::Applied {
            version: 3,
            created: true
        }
    );
    assert_eq!(answered(a8), AdvanceOutcome::Stale { highest: token(7) });
    assert_eq!(
        answered(a9),
        WriteOutcome::Applied {
            version: 4,
            created: false
        }
    );
    assert_eq!(store.fence("r"), Some(8));
    assert_eq!(store.object("r", "k"), Some((8, 4, 3, None)));
}

#[test]
fn the_writer_commits_what_is_waiting_in_batches_of_at_most_the_group_size() {
    let store = Scratch::new("batches");
    let (queue, jobs) = mpsc::channel(64);
    let mut answers = Vec::new();
    for n in 1..=10 {
        let (job, answer) = put("r", n, "v");
        queue.try_send(job).unwrap();
        answers.push(answer);
    }
    drop(queue);
    let sizes = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new("t", "t")).unwrap();

    // Every job is queued before the writer starts, so it forms full batches: 4, 4, 2.
    writer(
        &store.db,
        jobs,
        4,
        &sizes,
        &std::sync::atomic::AtomicBool::new(false),
    );

    assert_eq!(sizes.get_sample_count(), 3);
    assert_eq!(sizes.get_sample_sum(), 10.0);
    for (n, answer) in (1..).zip(answers) {
        assert_eq!(
            answered(answer),
            WriteOutcome::Applied {
                version: n,
                created: n == 1
            }
        );
    }
    assert_eq!(store.fence("r"), Some(10));
}

#[test]
fn a_caller_that_gave_up_does_not_disturb_the_rest_of_its_batch() {
    let store = Scratch::new("gave-up");
    let (j1, a1) = put("r", 1, "abandoned");
    let (j2, a2) = put("r", 2, "kept");
    drop(a1);

    commit_batch(&store.db, vec![j1, j2]);

    // The abandoned write still committed: the caller was told nothing, and learns
    // the outcome by reading, as after a timeout.
    assert_eq!(
        answered(a2),
        WriteOutcome::Applied {
            version: 2,
            created: false
        }
    );
    assert_eq!(
        store.object("r", "k"),
        Some((2, 2, 1, Some(b"kept".to_vec())))
    );
}
