//! The seed's invoice sweeper as real processes: two `invoice-sweeper` examples compete
//! for the lease and write through the real gateway. A killed leader is replaced within
//! the lease arithmetic; a paused leader, resumed, finds its write rejected and steps
//! down; the data holds only the current leader's writes.

use std::collections::BTreeMap;
use std::time::Duration;

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::lease::{process_timing, process_timing_args, Event, Sweeper, PATIENCE};
use fencegate_tests::proxy::Proxy;
use tokio::time::Instant;

const INVOICES: u32 = 3;

fn args(db: &TestDb, gateway: &str) -> Vec<String> {
    let mut args = vec![
        "--gateway".to_owned(),
        gateway.to_owned(),
        "--database-url".to_owned(),
        db.url(),
        "--invoices".to_owned(),
        INVOICES.to_string(),
        "--sweep-interval".to_owned(),
        "50ms".to_owned(),
    ];
    args.extend(process_timing_args());
    args
}

fn epoch_of(event: &Event) -> u64 {
    event
        .field("epoch")
        .as_u64()
        .expect("the event has an epoch")
}

/// Every write a sweeper saw accepted: (key, version) -> (node, epoch).
fn accepted(sweepers: &[&Sweeper]) -> BTreeMap<(String, u64), (String, u64)> {
    let mut writes = BTreeMap::new();
    for sweeper in sweepers {
        for event in sweeper.events_named("reminder written") {
            let key = event.field("key").as_str().unwrap().to_owned();
            let version = event.field("version").as_u64().unwrap();
            let previous = writes.insert((key, version), (sweeper.node.clone(), epoch_of(&event)));
            assert!(
                previous.is_none(),
                "two writes were accepted as the same version"
            );
        }
    }
    writes
}

/// Per key, in the gateway's order of acceptance (versions), epochs never go down, and
/// each epoch belongs to one node: no two writers were ever accepted in one epoch window.
fn assert_one_writer_per_epoch(writes: &BTreeMap<(String, u64), (String, u64)>) {
    let mut owner_of_epoch = BTreeMap::new();
    let mut last_epoch_of_key = BTreeMap::new();
    for ((key, version), (node, epoch)) in writes {
        let owner = owner_of_epoch.entry(*epoch).or_insert_with(|| node.clone());
        assert_eq!(
            owner, node,
            "epoch {epoch} has writes from {owner} and {node}"
        );
        let last = last_epoch_of_key.entry(key.clone()).or_insert(*epoch);
        assert!(
            *epoch >= *last,
            "{key} v{version}: epoch {epoch} accepted after epoch {last}"
        );
        *last = *epoch;
    }
}

/// Kill -9 the leader: the other sweeper takes over within lease + renew_interval
/// (+ slack), with the next epoch, and only one writer is ever accepted per epoch.
#[tokio::test]
async fn a_killed_leader_is_replaced() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder().database(&db.url()).spawn().await;
    let a = Sweeper::spawn("node-a", &args(&db, &gateway.url()));
    a.wait_for("sweep done", PATIENCE, |e| epoch_of(e) == 1)
        .await;
    let mut b = Sweeper::spawn("node-b", &args(&db, &gateway.url()));
    b.wait_for("sweeper started", PATIENCE, |_| true).await;

    a.signal("KILL");
    let killed = Instant::now();
    let acquired = b.wait_for("lease acquired", PATIENCE, |_| true).await;
    let failover = acquired.seen - killed;
    let config = process_timing();
    eprintln!("failover after kill -9: {failover:?}");
    assert_eq!(epoch_of(&acquired), 2);
    let bound = config.lease_duration + config.renew_interval + Duration::from_secs(1);
    assert!(
        failover <= bound,
        "failover took {failover:?}, more than {bound:?}"
    );

    b.wait_for("sweep done", PATIENCE, |e| epoch_of(e) == 2)
        .await;
    assert_one_writer_per_epoch(&accepted(&[&a, &b]));
    assert_every_reminder_is_node_bs(&db).await;

    b.signal("TERM");
    assert!(b.wait().await, "node-b exits cleanly on SIGTERM");
    b.wait_for("lease released", PATIENCE, |_| true).await;
}

/// Seed 000's pause: node-a is frozen (SIGSTOP) with a write in flight, past its lease;
/// node-b takes over with epoch 2 and sweeps. Resumed (SIGCONT), node-a's write is
/// rejected with 409 (presented 1, highest 2), its term ends, it does not lead again
/// while node-b does, and the data holds only node-b's writes.
#[tokio::test]
async fn a_paused_leader_is_fenced_and_steps_down() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder().database(&db.url()).spawn().await;
    let network = Proxy::start(gateway.addr()).await;
    let a = Sweeper::spawn("node-a", &args(&db, &format!("http://{}", network.addr())));
    a.wait_for("sweep done", PATIENCE, |e| epoch_of(e) == 1)
        .await;
    let b = Sweeper::spawn("node-b", &args(&db, &gateway.url()));
    b.wait_for("sweeper started", PATIENCE, |_| true).await;

    // node-a's next write sits in the network; then node-a freezes.
    network.hold();
    fencegate_tests::eventually(PATIENCE, "node-a's write to be in flight", || async {
        network.held_bytes() > 0
    })
    .await;
    a.signal("STOP");

    // node-b takes over after the lease expires, advances the fence and sweeps.
    let acquired = b.wait_for("lease acquired", PATIENCE, |_| true).await;
    assert_eq!(epoch_of(&acquired), 2);
    b.wait_for("sweep done", PATIENCE, |e| epoch_of(e) == 2)
        .await;

    // The delayed write arrives and is refused while node-a is still frozen.
    network.release();
    fencegate_tests::eventually(PATIENCE, "the gateway to reject node-a's write", || async {
        !gateway.events("stale write rejected").is_empty()
    })
    .await;
    let rejection = &gateway.events("stale write rejected")[0]["fields"];
    assert_eq!(
        (
            rejection["presented"].as_u64(),
            rejection["highest"].as_u64()
        ),
        (Some(1), Some(2))
    );
    assert_eq!(rejection["holder"], "node-a");

    a.signal("CONT");
    let refused = a
        .wait_for(
            "reminder rejected: a newer leader has written; stopping",
            PATIENCE,
            |_| true,
        )
        .await;
    assert_eq!(
        (
            refused.field("presented").as_u64(),
            refused.field("highest").as_u64()
        ),
        (Some(1), Some(2))
    );
    let lost = a.wait_for("leadership lost", PATIENCE, |_| true).await;
    assert_eq!(epoch_of(&lost), 1);
    // Either its own deadline or the rejection ended the term, whichever it saw first.
    let reason = lost.field("reason").as_str().unwrap();
    assert!(
        ["renew_deadline", "stale_rejection"].contains(&reason),
        "{reason}"
    );

    // node-b keeps sweeping; node-a never leads again meanwhile.
    let sweeps = b.events_named("sweep done").len();
    fencegate_tests::eventually(PATIENCE, "node-b to sweep twice more", || async {
        b.events_named("sweep done").len() >= sweeps + 2
    })
    .await;
    assert_eq!(
        a.events_named("lease acquired").len(),
        1,
        "node-a led again while node-b held the lease"
    );
    assert_one_writer_per_epoch(&accepted(&[&a, &b]));
    assert_every_reminder_is_node_bs(&db).await;
    assert_eq!(db.highest("invoices").await, Some(2));
}

/// Every invoice's reminder stored is the one node-b sent in epoch 2, with its token.
async fn assert_every_reminder_is_node_bs(db: &TestDb) {
    for invoice in 1..=INVOICES {
        let (value, token, _) = db
            .object("invoices", &format!("invoice-{invoice:03}/reminder"))
            .await
            .unwrap();
        assert_eq!(token, 2);
        assert!(String::from_utf8(value)
            .unwrap()
            .starts_with("reminder sent by node-b (epoch 2"));
    }
}
