//! The parts of the lanes that need no database: the pipelining of a group's
//! statements, lock order, deadlines, and the regrouping of a locked resource's writes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName, Token};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{answer_expired, by_resource, pipeline, rejoin, runs_by_resource, Queued, Reply};
use crate::store::postgres::writes::Attempt;
use crate::store::{StoreError, UnavailableReason, Write, WriteOp};

fn write(resource: &str, token: u64) -> Write {
    Write {
        resource: ResourceName::new(resource).unwrap(),
        key: ObjectKey::new("k").unwrap(),
        token: Token::new(token).unwrap(),
        precondition: Precondition::None,
        op: WriteOp::Put(Bytes::from_static(b"v")),
    }
}

fn queued(resource: &str, token: u64, deadline: Instant) -> (Queued, oneshot::Receiver<Reply>) {
    let (reply, answer) = oneshot::channel();
    let queued = Queued {
        item: super::Item::Write(write(resource, token)),
        keyed: None,
        deadline,
        reply,
    };
    (queued, answer)
}

fn label(write: &Write) -> (String, u64) {
    (write.resource.as_str().to_owned(), write.token.get())
}

/// A future that records when it is first polled, is pending once, then yields `value`.
fn recorded<T: Send + 'static>(
    log: &Arc<Mutex<Vec<String>>>,
    name: &str,
    value: T,
) -> impl std::future::Future<Output = T> + Send + 'static {
    let (log, name) = (Arc::clone(log), name.to_owned());
    async move {
        log.lock().unwrap().push(format!("sent {name}"));
        tokio::task::yield_now().await;
        log.lock().unwrap().push(format!("answered {name}"));
        value
    }
}

#[tokio::test]
async fn a_pipeline_sends_every_request_before_it_waits_for_any_answer() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let middle: Vec<super::Pipelined<'static, u32>> = (1..=3)
        .map(|n| -> super::Pipelined<'static, u32> {
            Box::pin(recorded(&log, &format!("write {n}"), Ok(n)))
        })
        .collect();

    let (first, middle, last) = pipeline(
        recorded(&log, "BEGIN", "begun"),
        middle,
        recorded(&log, "COMMIT", "committed"),
    )
    .await;

    assert_eq!(first, "begun");
    assert_eq!(
        middle.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!(last, "committed");
    let log = log.lock().unwrap();
    assert_eq!(
        log[..5],
        [
            "sent BEGIN",
            "sent write 1",
            "sent write 2",
            "sent write 3",
            "sent COMMIT"
        ],
        "every request goes out, in order, before any answer is awaited: {log:?}"
    );
    assert_eq!(log.len(), 10);
}

#[test]
fn a_group_takes_its_locks_in_resource_order_keeping_each_resources_writes_in_order() {
    let mut writes = [
        write("orders", 3),
        write("billing", 7),
        write("orders", 1),
        write("audit", 2),
        write("billing", 5),
        write("orders", 2),
    ];

    writes.sort_by(by_resource);

    let order: Vec<_> = writes.iter().map(label).collect();
    let expected = [
        ("audit", 2),
        ("billing", 7),
        ("billing", 5),
        ("orders", 3),
        ("orders", 1),
        ("orders", 2),
    ];
    assert_eq!(
        order,
        expected.map(|(r, t)| (r.to_owned(), t)).to_vec(),
        "a later write with a lower token must stay after the earlier one, or it would pass its fence"
    );
}

#[tokio::test(start_paused = true)]
async fn writes_past_their_deadline_are_answered_unapplied_and_never_sent() {
    let start = Instant::now();
    let (early, early_answer) = queued("r", 1, start + Duration::from_millis(100));
    let (late, late_answer) = queued("r", 2, start + Duration::from_secs(5));
    tokio::time::advance(Duration::from_secs(1)).await;

    let live = answer_expired(vec![early, late], Instant::now());

    assert_eq!(
        live.iter()
            .map(|q| label(q.write().unwrap()))
            .collect::<Vec<_>>(),
        [("r".to_owned(), 2)]
    );
    match early_answer.await.unwrap() {
        Err(StoreError::Unavailable {
            reason: UnavailableReason::Timeout,
            applied: Some(false),
        }) => {}
        other => panic!("an expired write must be answered timeout, not applied: {other:?}"),
    }
    drop(live);
    assert!(
        late_answer.await.is_err(),
        "the live write is left to the lane"
    );
}

#[test]
fn a_locked_resources_writes_wait_together_in_arrival_order() {
    let deadline = Instant::now() + Duration::from_secs(5);
    let writes = [("b", 4), ("a", 1), ("b", 3), ("c", 9), ("a", 2)]
        .map(|(resource, token)| queued(resource, token, deadline).0);

    let runs = runs_by_resource(writes.into());

    let runs: Vec<Vec<_>> = runs
        .iter()
        .map(|run| run.iter().map(|q| label(q.write().unwrap())).collect())
        .collect();
    let owned = |run: &[(&str, u64)]| {
        run.iter()
            .map(|(r, t)| (r.to_string(), *t))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        runs,
        [
            owned(&[("b", 4), ("b", 3)]),
            owned(&[("a", 1), ("a", 2)]),
            owned(&[("c", 9)])
        ]
    );
}

#[test]
fn a_regrouped_group_answers_each_write_in_its_place() {
    let writes = [
        write("a", 1),
        write("locked", 2),
        write("b", 3),
        write("locked", 4),
        write("c", 5),
    ];
    let writes: Vec<&Write> = writes.iter().collect();
    let rest = vec![
        Ok(Attempt::Applied {
            version: 10,
            created: false,
        }),
        Ok(Attempt::Stale),
        Err(StoreError::Internal("third".into())),
    ];

    let answers = rejoin(&writes, &ResourceName::new("locked").unwrap(), rest);

    let described: Vec<String> = answers
        .iter()
        .map(|answer| match answer {
            Ok(Attempt::Applied { version, .. }) => format!("applied {version}"),
            Ok(Attempt::Stale) => "stale".into(),
            Ok(Attempt::PreconditionFailed { .. }) => "precondition failed".into(),
            Err(StoreError::Unavailable {
                reason: UnavailableReason::LockTimeout,
                applied: Some(false),
            }) => "locked".into(),
            Err(other) => format!("error {other}"),
        })
        .collect();
    assert_eq!(
        described,
        [
            "applied 10",
            "locked",
            "stale",
            "locked",
            "error unexpected backend error: third"
        ]
    );
}
