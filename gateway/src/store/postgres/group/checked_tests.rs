//! Checked groups against a real Postgres (as `set_tests`): a random group of plain,
//! conditional and keyed writes — keys new, retried with the same request or reused for
//! another, across rounds — applied as one checked group must answer, and leave the
//! fences, objects and stored answers, exactly as the same writes applied one at a
//! time, each in its own transaction, in the same order.

use std::sync::Arc;

use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName, Token};
use rand::Rng;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::checked::{apply_checked, Checked};
use super::set_tests::{write, Scratch};
use super::{lock_order, Item, Queued, Settled};
use crate::store::postgres::txn;
use crate::store::postgres::writes::{write_conditional, write_unconditional, Attempt};
use crate::store::txn::{Answered, Keyed, Render, StoredAnswer, Txn, TxnOp, TxnOutcome};
use crate::store::{Write, WriteOp};

/// The answer a keyed write stores: its outcome, spelled out.
fn render() -> Render {
    Arc::new(|outcome: &TxnOutcome| StoredAnswer {
        status: match outcome {
            TxnOutcome::Applied(_) => 200,
            TxnOutcome::Stale(_) => 409,
            TxnOutcome::PreconditionFailed { .. } => 412,
        },
        headers: vec![("x-outcome".to_owned(), "test".to_owned())],
        body: format!("{outcome:?}").into(),
    })
}

fn keyed(key: &str, fingerprint: u8) -> Keyed {
    Keyed {
        identity: "writer".to_owned(),
        key: key.to_owned(),
        fingerprint: [fingerprint; 32],
        ttl: std::time::Duration::from_secs(3600),
        render: render(),
    }
}

/// A random group as a lane takes it: few resources and objects; some writes with a
/// precondition; some keyed — a new key, or one of earlier rounds sent again with the
/// same request or another — never the same key twice in one group.
fn random_group(rng: &mut impl Rng, round: usize, keys: &mut Vec<(String, u8)>) -> Vec<Queued> {
    let mut used = std::collections::HashSet::new();
    let mut group: Vec<Queued> = (0..rng.random_range(1..=16))
        .map(|i| {
            let resource = format!("r{}", rng.random_range(0..3));
            let key = format!("k{}", rng.random_range(0..4));
            let value = rng
                .random_bool(0.75)
                .then(|| format!("{resource}/{key}#{round}.{i}"));
            let mut write = write(&resource, &key, rng.random_range(1..=6), value);
            write.precondition = match rng.random_range(0..8) {
                0 => Precondition::MustNotExist,
                1 => Precondition::MustExist,
                2 | 3 => Precondition::Version(rng.random_range(1..=4)),
                _ => Precondition::None,
            };
            let keyed = match rng.random_range(0..3) {
                0 => None,
                1 if !keys.is_empty() => {
                    let (key, fingerprint) = keys[rng.random_range(0..keys.len())].clone();
                    let fingerprint = if rng.random_bool(0.7) {
                        fingerprint
                    } else {
                        fingerprint ^ 1
                    };
                    Some(keyed(&key, fingerprint))
                }
                _ => {
                    let key = format!("idem-{round}-{i}");
                    keys.push((key.clone(), 7));
                    Some(keyed(&key, 7))
                }
            }
            .filter(|keyed| used.insert(keyed.key.clone()));
            let (reply, _) = oneshot::channel();
            Queued {
                item: Item::Write(write),
                keyed: keyed.map(Arc::new),
                deadline: Instant::now(),
                reply,
            }
        })
        .collect();
    // Transactions of a few operations on distinct resources, some keyed.
    for t in 0..rng.random_range(0..=3) {
        let mut resources: Vec<usize> = (0..4).collect();
        let ops: Vec<TxnOp> = (0..rng.random_range(1..=3))
            .map(|o| {
                let resource = ResourceName::new(format!(
                    "r{}",
                    resources.swap_remove(rng.random_range(0..resources.len()))
                ))
                .unwrap();
                let key = ObjectKey::new(format!("k{}", rng.random_range(0..4))).unwrap();
                let token = Token::new(rng.random_range(1..=6)).unwrap();
                let precondition = match rng.random_range(0..6) {
                    0 => Precondition::MustNotExist,
                    1 => Precondition::MustExist,
                    2 => Precondition::Version(rng.random_range(1..=4)),
                    _ => Precondition::None,
                };
                match rng.random_range(0..5) {
                    0 | 1 => TxnOp::Put {
                        resource,
                        key,
                        token,
                        value: format!("txn#{round}.{t}.{o}").into(),
                        precondition,
                    },
                    2 => TxnOp::Delete {
                        resource,
                        key,
                        token,
                        precondition,
                    },
                    3 => TxnOp::Advance { resource, token },
                    _ => TxnOp::Check {
                        resource,
                        token,
                        object: rng.random_bool(0.5).then_some((key, precondition)),
                    },
                }
            })
            .collect();
        let txn = Txn::new(ops).unwrap();
        let keyed = rng.random_bool(0.5).then(|| {
            let key = format!("txn-{round}-{t}");
            keys.push((key.clone(), 9));
            Arc::new(keyed(&key, 9))
        });
        let (reply, _) = oneshot::channel();
        group.push(Queued {
            item: Item::Txn(Arc::new(txn)),
            keyed,
            deadline: Instant::now(),
            reply,
        });
    }
    group.sort_by(lock_order);
    group
}

/// The one write of a keyed write's transaction.
fn txn_of(write: &Write) -> Txn {
    let op = match &write.op {
        WriteOp::Put(value) => TxnOp::Put {
            resource: write.resource.clone(),
            key: write.key.clone(),
            token: write.token,
            value: value.clone(),
            precondition: write.precondition,
        },
        WriteOp::Delete => TxnOp::Delete {
            resource: write.resource.clone(),
            key: write.key.clone(),
            token: write.token,
            precondition: write.precondition,
        },
    };
    Txn::new(vec![op]).unwrap()
}

/// What a write came to, comparable across the two ways.
#[derive(Debug, PartialEq)]
enum Came {
    Attempt(Attempt),
    Keyed(Answered),
}

async fn the_stored_answers(scratch: &Scratch) -> Vec<String> {
    let client = scratch.client().await;
    client
        .query(
            "SELECT format('%s %s %s %s', identity, key, status, encode(body, 'escape'))
             FROM fencegate.idempotency ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test]
async fn a_checked_group_answers_and_writes_as_one_transaction_per_write() {
    let (grouped, one_by_one) = (Scratch::create().await, Scratch::create().await);
    let (group_client, mut each_client) = (grouped.client().await, one_by_one.client().await);
    let mut rng = rand::rng();
    let mut keys = Vec::new();
    let mut kinds = std::collections::BTreeMap::<&str, usize>::new();
    for round in 0..60 {
        let group = random_group(&mut rng, round, &mut keys);
        let settled = match apply_checked(&group_client, &group).await {
            Checked::Settled(settled) => settled,
            Checked::NotAsASet => panic!("round {round}: not applied as a set"),
        };
        assert_eq!(settled.len(), group.len());
        for (index, (queued, settled)) in group.iter().zip(settled).enumerate() {
            let got = match settled.unwrap_or_else(|e| panic!("round {round}: {e:?}")) {
                Settled::Attempt(attempt) => Came::Attempt(attempt),
                Settled::Answered(answered) => Came::Keyed(answered),
                Settled::Alone => panic!("round {round}: write {index} left alone"),
            };
            let want = match (&queued.item, queued.keyed.as_deref()) {
                (Item::Txn(whole), keyed) => {
                    Came::Keyed(txn::run(&mut each_client, whole, keyed).await.unwrap())
                }
                (Item::Write(_), Some(keyed)) => Came::Keyed(
                    txn::run(
                        &mut each_client,
                        &txn_of(queued.write().unwrap()),
                        Some(keyed),
                    )
                    .await
                    .unwrap(),
                ),
                (Item::Write(_), None)
                    if queued.write().unwrap().precondition == Precondition::None =>
                {
                    Came::Attempt(
                        write_unconditional(&each_client, queued.write().unwrap())
                            .await
                            .unwrap(),
                    )
                }
                (Item::Write(_), None) => Came::Attempt(
                    write_conditional(&mut each_client, queued.write().unwrap())
                        .await
                        .unwrap(),
                ),
            };
            *kinds
                .entry(match &want {
                    Came::Attempt(Attempt::Applied { .. }) => "applied",
                    Came::Attempt(Attempt::Stale) => "stale",
                    Came::Attempt(Attempt::PreconditionFailed { .. }) => "precondition",
                    Came::Keyed(Answered::Ran {
                        outcome: TxnOutcome::Applied(_),
                        ..
                    }) => "keyed applied",
                    Came::Keyed(Answered::Ran {
                        outcome: TxnOutcome::Stale(_),
                        ..
                    }) => "keyed stale",
                    Came::Keyed(Answered::Ran { .. }) => "keyed precondition",
                    Came::Keyed(Answered::Replayed(_)) => "replayed",
                    Came::Keyed(Answered::KeyReused) => "key reused",
                    Came::Keyed(Answered::InFlight) => "in flight",
                })
                .or_default() += 1;
            assert_eq!(got, want, "round {round}, write {index}");
        }
        assert_eq!(
            grouped.contents().await,
            one_by_one.contents().await,
            "after round {round}"
        );
        assert_eq!(
            the_stored_answers(&grouped).await,
            the_stored_answers(&one_by_one).await,
            "after round {round}"
        );
    }
    for kind in [
        "applied",
        "stale",
        "precondition",
        "keyed applied",
        "keyed stale",
        "keyed precondition",
        "replayed",
        "key reused",
    ] {
        assert!(
            kinds.get(kind).copied().unwrap_or(0) > 0,
            "no {kind}: {kinds:?}"
        );
    }
}
