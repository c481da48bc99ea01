//! A randomised run through the S3 door, judged by the history checker
//! (`fencegate_tests::history`): terms follow each other on one resource, each term's
//! writer writing through a replica that goes straight to radosgw, while a zombie of
//! the term before sends a late PUT through a gateway whose upload is held in the
//! network until the new term has written; readers read through both doors all along.
//!
//! Every operation is recorded with its invocation and completion, and the history
//! must be linearizable against the fenced register: no read returns an older term's
//! bytes once a newer term's write was acknowledged, and no acknowledged write is lost.
//! Each PUT's term has an acknowledged write before its zombie, so that a fence raised
//! by a zombie's intent (a fenced write of its own, docs/s3.md) is one an acknowledged
//! write of that term had raised already.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};

use fencegate_tests::history::{check, Counts, Outcome, Recorder};
use fencegate_tests::s3::door::{DoorBed, WRITER};
use fencegate_tests::s3::recorded::{read, write};
use fencegate_tests::s3::S3Client;

/// Terms in a run.
const TERMS: u64 = 12;

/// Keys of the resource written.
const KEYS: [&str; 2] = ["orders/history/a.json", "orders/history/b.json"];

/// Reads the readers make at least, over the run.
const MIN_READS: usize = 2 * TERMS as usize;

#[tokio::test]
async fn a_random_run_through_the_s3_door_is_linearizable() {
    let seed: u64 = std::env::var("FENCEGATE_S3_HISTORY_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("seed {seed} (FENCEGATE_S3_HISTORY_SEED={seed} repeats the run's choices)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let bed = DoorBed::start().await;
    let replica = bed.direct_replica().spawn().await;
    let through_proxy = bed.client(WRITER);
    let direct = S3Client::new(format!("http://{}", replica.s3_addr()), WRITER.0, WRITER.1);
    let history = Recorder::new();

    let reading = Arc::new(AtomicBool::new(true));
    let reads_done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let readers: Vec<_> = [(&through_proxy, 100), (&direct, 101)]
        .into_iter()
        .map(|(s3, client)| {
            let (s3, history, reading) = (s3.clone(), history.clone(), Arc::clone(&reading));
            let reads_done = Arc::clone(&reads_done);
            tokio::spawn(async move {
                let mut turn = 0;
                while reading.load(Ordering::SeqCst) {
                    let key = KEYS[turn % KEYS.len()];
                    turn += 1;
                    read(&s3, client, key, &history).await;
                    reads_done.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
            })
        })
        .collect();

    for term in 1..=TERMS {
        let writer = term as u32;
        for round in 0..2 {
            let key = KEYS[rng.random_range(0..KEYS.len())];
            let value = format!("term {term} round {round}");
            let op = write(&direct, writer, key, term, &value, &history).await;
            assert!(
                matches!(op, Outcome::Applied { .. }),
                "term {term}'s own write was refused: {op:?}"
            );
        }
        if term == TERMS || !rng.random_bool(0.7) {
            continue;
        }
        // The term's zombie: a late PUT through the proxied gateway, held until the
        // next term wrote.
        bed.proxy.hold();
        let zombie = {
            let (s3, history) = (through_proxy.clone(), history.clone());
            let key = KEYS[rng.random_range(0..KEYS.len())];
            tokio::spawn(async move {
                write(
                    &s3,
                    1000 + writer,
                    key,
                    term,
                    &format!("term {term} zombie"),
                    &history,
                )
                .await
            })
        };
        fencegate_tests::eventually(
            Duration::from_secs(10),
            "the zombie's upload is held",
            || async { bed.proxy.held_bytes() > 0 },
        )
        .await;
        let key = KEYS[rng.random_range(0..KEYS.len())];
        let first = write(
            &direct,
            writer + 1,
            key,
            term + 1,
            &format!("term {} first", term + 1),
            &history,
        )
        .await;
        assert!(matches!(first, Outcome::Applied { .. }), "{first:?}");
        bed.proxy.release();
        let late = zombie.await.expect("the zombie's task");
        assert!(
            matches!(late, Outcome::Stale { .. }),
            "a zombie's late PUT was not refused: {late:?}"
        );
    }
    // The readers read on until they have read at least a few times per term.
    fencegate_tests::eventually(Duration::from_secs(30), "the readers read", || async {
        reads_done.load(Ordering::SeqCst) >= MIN_READS
    })
    .await;
    reading.store(false, Ordering::SeqCst);
    for reader in readers {
        reader.await.expect("a reader's task");
    }
    for key in KEYS {
        read(&direct, 200, key, &history).await;
        read(&through_proxy, 201, key, &history).await;
    }

    let entries = history.entries();
    let counts = Counts::of(&entries);
    eprintln!("{counts:?}");
    assert!(counts.stale > 0, "the run refused no zombie (seed {seed})");
    assert!(
        counts.reads >= MIN_READS,
        "the readers read too little: {counts:?}"
    );
    let violations = check(&entries);
    assert!(
        violations.is_empty(),
        "seed {seed}: the history is not linearizable:\n{}",
        violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}
