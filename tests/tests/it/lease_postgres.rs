//! fencegate-lease on the seed's Postgres lease: the seed's psql steps through the
//! library, stepping down when replaced or cut off, failover timing, safe release,
//! configuration checks.

use std::sync::Arc;
use std::time::Duration;

use fencegate_lease::{
    ConfigError, Elector, LeaseConfig, LeaseStore, LossReason, PostgresStore, StoreError,
    Transition,
};
use fencegate_proto::Token;
use fencegate_tests::db::TestDb;
use fencegate_tests::lease::{
    next_term, next_transition, short_timing, spawn_elector, steady_timing, PATIENCE,
};
use fencegate_tests::proxy::Proxy;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const LEASE: &str = "invoice-sweeper";
const LONG: Duration = Duration::from_secs(15);

fn token(value: u64) -> Token {
    Token::new(value).unwrap()
}

fn store(db: &TestDb) -> Arc<PostgresStore> {
    Arc::new(PostgresStore::new(&db.url(), "leader_lease", true).expect("valid store settings"))
}

/// The lease row: (holder, epoch, live).
async fn row(db: &TestDb) -> (Option<String>, i64, bool) {
    let row = db
        .client()
        .await
        .query_one(
            "SELECT holder, epoch, expires_at > now() FROM leader_lease WHERE name = $1",
            &[&LEASE],
        )
        .await
        .expect("the lease row exists");
    (row.get(0), row.get(1), row.get(2))
}

async fn force_expiry(db: &TestDb) {
    db.client()
        .await
        .execute(
            "UPDATE leader_lease SET expires_at = now() - interval '1 second' WHERE name = $1",
            &[&LEASE],
        )
        .await
        .expect("the lease row can be updated");
}

/// Seed 000's five psql steps, through the store API, with the same results.
#[tokio::test]
async fn seed_psql_steps() {
    let db = TestDb::create().await;
    let store = store(&db);

    // 1. node-a acquires the empty lease: epoch 1, live.
    assert_eq!(
        store.acquire(LEASE, "node-a", LONG).await.unwrap(),
        Some(token(1))
    );
    assert_eq!(row(&db).await, (Some("node-a".into()), 1, true));

    // 2. node-b tries while node-a holds it: nothing.
    assert_eq!(store.acquire(LEASE, "node-b", LONG).await.unwrap(), None);

    // 3. node-a renews: same epoch.
    assert!(store.renew(LEASE, "node-a", token(1), LONG).await.unwrap());
    assert_eq!(row(&db).await, (Some("node-a".into()), 1, true));

    // Expiry forced as in the seed.
    force_expiry(&db).await;

    // 4. node-b takes over after expiry: epoch 2.
    assert_eq!(
        store.acquire(LEASE, "node-b", LONG).await.unwrap(),
        Some(token(2))
    );
    assert_eq!(row(&db).await, (Some("node-b".into()), 2, true));

    // 5. node-a wakes up and renews with its stale epoch 1: nothing.
    assert!(!store.renew(LEASE, "node-a", token(1), LONG).await.unwrap());
    assert_eq!(row(&db).await, (Some("node-b".into()), 2, true));
}

/// Step 5 through the elector: the old holder's renewal with epoch 1 matches nothing,
/// its term is cancelled with reason `replaced`, and it does not lead again while the
/// new holder does.
#[tokio::test]
async fn a_replaced_holder_steps_down() {
    let db = TestDb::create().await;
    let store = store(&db);
    let shutdown = CancellationToken::new();
    let config = steady_timing();
    let elector = Elector::new(Arc::clone(&store), LEASE, "node-a", config).unwrap();
    let mut events = elector.subscribe();
    let (task, mut terms) = spawn_elector(elector, &shutdown);

    let term = next_term(&mut terms).await;
    assert_eq!(term.epoch(), token(1));
    assert_eq!(term.holder(), "node-a");
    next_transition(&mut events, PATIENCE, |t| {
        matches!(t, Transition::Renewed { .. })
    })
    .await;
    assert_eq!(
        row(&db).await,
        (Some("node-a".into()), 1, true),
        "renewal keeps epoch 1"
    );

    force_expiry(&db).await;
    assert_eq!(
        store
            .acquire(LEASE, "node-b", Duration::from_secs(60))
            .await
            .unwrap(),
        Some(token(2))
    );

    let lost = next_transition(&mut events, PATIENCE, |t| {
        matches!(t, Transition::Lost { .. })
    })
    .await;
    assert_eq!(
        lost,
        Transition::Lost {
            epoch: token(1),
            reason: LossReason::Replaced,
            at: lost.at()
        }
    );
    assert!(!term.is_live());
    assert_eq!(term.loss_reason(), Some(LossReason::Replaced));
    // The old holder keeps trying, but node-b's lease is live: it never gets a term.
    tokio::time::sleep(config.retry_period * 5).await;
    assert!(
        terms.try_recv().is_err(),
        "node-a led again while node-b held the lease"
    );
    assert_eq!(row(&db).await, (Some("node-b".into()), 2, true));

    shutdown.cancel();
    task.await.unwrap();
}

/// A leader that cannot reach the database (its traffic held in the network) gives up
/// at its renew deadline, on its own clock, before the rival's acquisition; the rival
/// takes over once the lease has expired.
#[tokio::test]
async fn a_cut_off_leader_gives_up_before_the_rival_acquires() {
    let db = TestDb::create().await;
    let network = Proxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let config = short_timing();
    let shutdown = CancellationToken::new();

    let leader_store =
        PostgresStore::new(&db.url_via(network.addr()), "leader_lease", true).unwrap();
    let leader = Elector::new(leader_store, LEASE, "node-a", config).unwrap();
    let mut leader_events = leader.subscribe();
    let (leader_task, mut leader_terms) = spawn_elector(leader, &shutdown);
    let term = next_term(&mut leader_terms).await;

    let rival = Elector::new(store(&db), LEASE, "node-b", config).unwrap();
    let mut rival_events = rival.subscribe();
    let (rival_task, _rival_terms) = spawn_elector(rival, &shutdown);

    // Let the leader renew once more, then hold its traffic.
    let renewed = next_transition(&mut leader_events, PATIENCE, |t| {
        matches!(t, Transition::Renewed { .. })
    })
    .await;
    network.hold();

    let gave_up = next_transition(&mut leader_events, PATIENCE, |t| {
        matches!(t, Transition::Lost { .. })
    })
    .await;
    let acquired = next_transition(&mut rival_events, PATIENCE, |t| {
        matches!(t, Transition::Acquired { .. })
    })
    .await;
    eprintln!(
        "leader gave up {:?} after its last renewal; rival acquired {:?} after the leader gave up",
        gave_up.at() - renewed.at(),
        acquired.at() - gave_up.at()
    );
    assert!(
        matches!(gave_up, Transition::Lost { reason: LossReason::RenewDeadline, epoch, .. } if epoch == token(1))
    );
    assert!(!term.is_live());
    assert!(
        gave_up.at() < acquired.at(),
        "the old leader must give up before the rival acquires"
    );
    assert_eq!(acquired.epoch(), token(2));

    shutdown.cancel();
    network.release();
    rival_task.await.unwrap();
    leader_task.await.unwrap();
}

/// The database going away altogether (connections refused) ends the term at the
/// renew deadline too: the elector never keeps leading on a guess.
#[tokio::test]
async fn a_leader_whose_database_is_gone_steps_down() {
    let db = TestDb::create().await;
    let network = Proxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let config = short_timing();
    let shutdown = CancellationToken::new();
    let store = PostgresStore::new(&db.url_via(network.addr()), "leader_lease", true).unwrap();
    let elector = Elector::new(store, LEASE, "node-a", config).unwrap();
    let mut events = elector.subscribe();
    let (task, mut terms) = spawn_elector(elector, &shutdown);
    let term = next_term(&mut terms).await;

    let acquired_or_renewed = next_transition(&mut events, PATIENCE, |t| {
        matches!(t, Transition::Renewed { .. })
    })
    .await;
    network.cut();
    let lost = next_transition(&mut events, PATIENCE, |t| {
        matches!(t, Transition::Lost { .. })
    })
    .await;
    assert!(
        matches!(
            lost,
            Transition::Lost {
                reason: LossReason::RenewDeadline,
                ..
            }
        ),
        "{lost:?}"
    );
    assert_eq!(term.loss_reason(), Some(LossReason::RenewDeadline));
    // It stepped down no later than its last published deadline allows (plus scheduling).
    let Transition::Renewed { deadline, .. } = acquired_or_renewed else {
        unreachable!()
    };
    assert!(
        lost.at() >= deadline,
        "stepped down before its deadline: nothing to renew past"
    );
    shutdown.cancel();
    task.await.unwrap();
}

/// Failover with the short timing: after the leader crashes (no release), a follower
/// takes over within lease + renew_interval (+ slack), and never before the crashed
/// leader's own deadline.
#[tokio::test]
async fn a_follower_takes_over_after_the_leader_dies() {
    let db = TestDb::create().await;
    let config = short_timing();
    let shutdown = CancellationToken::new();

    let leader = Elector::new(store(&db), LEASE, "node-a", config).unwrap();
    let mut leader_events = leader.subscribe();
    let (leader_task, mut leader_terms) = spawn_elector(leader, &shutdown);
    next_term(&mut leader_terms).await;
    let follower = Elector::new(store(&db), LEASE, "node-b", config).unwrap();
    let mut follower_events = follower.subscribe();
    let (follower_task, _) = spawn_elector(follower, &shutdown);

    let renewed = next_transition(&mut leader_events, PATIENCE, |t| {
        matches!(t, Transition::Renewed { .. })
    })
    .await;
    leader_task.abort();
    let died = Instant::now();
    let _ = leader_task.await;
    // The last deadline the leader published before it died.
    let mut last_deadline = match renewed {
        Transition::Renewed { deadline, .. } => deadline,
        _ => unreachable!(),
    };
    while let Ok(event) = leader_events.try_recv() {
        if let Transition::Renewed { deadline, .. } = event {
            last_deadline = deadline;
        }
    }

    let acquired = next_transition(&mut follower_events, PATIENCE, |t| {
        matches!(t, Transition::Acquired { .. })
    })
    .await;
    let failover = acquired.at() - died;
    eprintln!(
        "failover after the leader died: {failover:?} (lease {:?})",
        config.lease_duration
    );
    assert_eq!(acquired.epoch(), token(2));
    assert!(
        acquired.at() > last_deadline,
        "the follower acquired before the leader's own deadline"
    );
    let bound = config.lease_duration + config.renew_interval + Duration::from_secs(1);
    assert!(
        failover <= bound,
        "failover took {failover:?}, more than {bound:?}"
    );

    shutdown.cancel();
    follower_task.await.unwrap();
}

/// A late release by a replaced holder does not free its successor's lease; the
/// successor's own release does.
#[tokio::test]
async fn a_late_release_does_not_free_the_successors_lease() {
    let db = TestDb::create().await;
    let store = store(&db);
    assert_eq!(
        store.acquire(LEASE, "node-a", LONG).await.unwrap(),
        Some(token(1))
    );
    force_expiry(&db).await;
    assert_eq!(
        store.acquire(LEASE, "node-b", LONG).await.unwrap(),
        Some(token(2))
    );

    assert!(!store.release(LEASE, "node-a", token(1)).await.unwrap());
    assert_eq!(row(&db).await, (Some("node-b".into()), 2, true));
    // Same holder name, old epoch (a restarted node-b's predecessor): still refused.
    assert!(!store.release(LEASE, "node-b", token(1)).await.unwrap());
    assert_eq!(row(&db).await, (Some("node-b".into()), 2, true));

    assert!(store.release(LEASE, "node-b", token(2)).await.unwrap());
    assert_eq!(row(&db).await, (None, 2, false));
    // The next acquisition still gets a new epoch.
    assert_eq!(
        store.acquire(LEASE, "node-a", LONG).await.unwrap(),
        Some(token(3))
    );
}

/// The re-acquisition rule: a holder that restarts under the same identity takes its
/// lease back at once, but with a new epoch that fences its previous life.
#[tokio::test]
async fn reacquiring_under_the_same_identity_mints_a_new_epoch() {
    let db = TestDb::create().await;
    let store = store(&db);
    assert_eq!(
        store.acquire(LEASE, "node-a", LONG).await.unwrap(),
        Some(token(1))
    );
    assert_eq!(
        store.acquire(LEASE, "node-a", LONG).await.unwrap(),
        Some(token(2))
    );
    assert!(
        !store.renew(LEASE, "node-a", token(1), LONG).await.unwrap(),
        "the previous life's epoch is over"
    );
    assert!(store.renew(LEASE, "node-a", token(2), LONG).await.unwrap());
}

/// Clean shutdown releases the lease: a successor acquires long before the lease
/// (60 s) could have expired.
#[tokio::test]
async fn shutdown_releases_the_lease() {
    let db = TestDb::create().await;
    let config = LeaseConfig::with_lease(Duration::from_secs(60));
    let (first_stop, second_stop) = (CancellationToken::new(), CancellationToken::new());
    let first = Elector::new(store(&db), LEASE, "node-a", config).unwrap();
    let mut first_events = first.subscribe();
    let (first_task, mut first_terms) = spawn_elector(first, &first_stop);
    let term = next_term(&mut first_terms).await;

    // A quick-retrying successor, so that the test does not wait for 8 s retries.
    let successor_config = LeaseConfig {
        retry_period: Duration::from_millis(50),
        ..config
    };
    let second = Elector::new(store(&db), LEASE, "node-b", successor_config).unwrap();
    let mut second_events = second.subscribe();
    let (second_task, _) = spawn_elector(second, &second_stop);

    first_stop.cancel();
    let ended = next_transition(&mut first_events, PATIENCE, |t| {
        matches!(t, Transition::Lost { .. })
    })
    .await;
    assert!(matches!(
        ended,
        Transition::Lost {
            reason: LossReason::Shutdown,
            ..
        }
    ));
    assert_eq!(term.loss_reason(), Some(LossReason::Shutdown));
    tokio::time::timeout(PATIENCE, first_task)
        .await
        .expect("run returns after shutdown")
        .unwrap();
    let acquired = next_transition(&mut second_events, PATIENCE, |t| {
        matches!(t, Transition::Acquired { .. })
    })
    .await;
    assert_eq!(acquired.epoch(), token(2));
    assert!(acquired.at() > ended.at());
    second_stop.cancel();
    second_task.await.unwrap();
}

/// Leading code that returns hands the lease back (`released`) and ends `run`.
#[tokio::test]
async fn leading_code_that_returns_releases_the_lease() {
    let db = TestDb::create().await;
    let elector = Elector::new(store(&db), LEASE, "node-a", steady_timing()).unwrap();
    let mut events = elector.subscribe();
    let done = tokio::time::timeout(
        PATIENCE,
        elector.run(CancellationToken::new(), |term| async move {
            assert!(term.is_live());
        }),
    );
    done.await
        .expect("run returns once the leading code has returned");
    let mut seen = Vec::new();
    while let Ok(event) = events.try_recv() {
        seen.push(event);
    }
    assert!(
        matches!(
            seen.as_slice(),
            [
                Transition::Acquired { .. },
                Transition::Lost {
                    reason: LossReason::Released,
                    ..
                }
            ]
        ),
        "{seen:?}"
    );
    assert_eq!(row(&db).await, (None, 1, false));
}

/// Settings that would let a holder lead past its lease are refused with the rule
/// they break; so are bad names, holders and table names.
#[tokio::test]
async fn bad_configuration_is_rejected() {
    let db = TestDb::create().await;
    let base = short_timing();
    let ms = Duration::from_millis;
    let cases: Vec<(LeaseConfig, &str)> = vec![
        (
            LeaseConfig {
                renew_deadline: base.lease_duration,
                ..base
            },
            "must step down before a rival can acquire",
        ),
        (
            LeaseConfig {
                renew_interval: base.renew_deadline,
                ..base
            },
            "needs at least one retry",
        ),
        (
            LeaseConfig {
                renew_deadline: ms(450),
                max_round_trip: ms(200),
                ..base
            },
            "plus one round trip",
        ),
        (
            LeaseConfig {
                retry_period: base.renew_deadline,
                ..base
            },
            "retry_period",
        ),
        (
            LeaseConfig {
                renew_retry_period: base.renew_deadline,
                ..base
            },
            "renew_retry_period",
        ),
        (
            LeaseConfig {
                lease_duration: Duration::ZERO,
                ..base
            },
            "lease_duration must be greater than zero",
        ),
    ];
    for (config, expected) in cases {
        let error = Elector::new(store(&db), LEASE, "node-a", config)
            .err()
            .expect("bad timing accepted");
        assert!(
            error.to_string().contains(expected),
            "{error} (wanted {expected:?})"
        );
    }
    assert!(matches!(
        Elector::new(store(&db), "a lease", "node-a", base).err(),
        Some(ConfigError::InvalidName(_))
    ));
    assert!(matches!(
        Elector::new(store(&db), LEASE, "", base).err(),
        Some(ConfigError::InvalidHolder(_))
    ));
    assert!(matches!(
        Elector::new(store(&db), LEASE, "node\na", base).err(),
        Some(ConfigError::InvalidHolder(_))
    ));
    assert!(matches!(
        PostgresStore::new(&db.url(), "leases; DROP TABLE x", true),
        Err(StoreError::Invalid(_))
    ));
    // Without create_missing, a missing row is an error, not a silent no-op.
    let strict = PostgresStore::new(&db.url(), "leader_lease", false).unwrap();
    let error = strict
        .acquire(LEASE, "node-a", LONG)
        .await
        .expect_err("a missing table is an error");
    assert!(matches!(error, StoreError::Unexpected(_)), "{error}");
}
