//! Fault runs with the leases in etcd and in ZooKeeper: writer processes elect through
//! the lease client's stores, the gateways check every new term's token against the
//! election (`--issued-by etcd:...`, `zookeeper:...`), and each history is checked.
//!
//! - `pause`: the holder is stopped past its lease (its etcd lease, or its ZooKeeper
//!   session, expires on the server), a rival leads, and the holder's decided write
//!   goes out late: it must be refused, and no history may have a violation.
//! - `source-kill`: kill -9 of the etcd member or the ZooKeeper server while writers
//!   lead and write, and a restart on its data.
//!
//! Needs etcd, ZooKeeper with Java and the test Postgres server; fails, never skips,
//! without them.

use std::path::PathBuf;
use std::time::Duration;

use fencegate_tests::faults::{self, Fault, Leases, Settings};

/// etcd's shortest lease; the ZooKeeper sessions get the same.
const TTL: Duration = Duration::from_secs(2);

fn settings(duration: Duration) -> Settings {
    Settings {
        duration,
        resources: 2,
        writers: 2,
        ttl: TTL,
        lanes: 3,
        binary: PathBuf::from(env!("CARGO_BIN_EXE_fencegate-faults")),
    }
}

async fn run_on(leases: &Leases) {
    let source = leases.source().name();
    for (fault, duration) in [
        (Fault::Pause, Duration::from_secs(6)),
        (Fault::SourceKill, Duration::from_secs(4)),
    ] {
        let report = faults::run(fault, &settings(duration), leases)
            .await
            .unwrap_or_else(|e| panic!("{source} {}: {e}", fault.name()));
        println!("{source:<10} {}", report.line());
        for violation in &report.violations {
            println!("    {violation}");
        }
        assert!(
            report.injected > 0,
            "{source} {}: nothing injected",
            fault.name()
        );
        assert!(
            report.counts.applied > 0 && report.counts.reads > 0,
            "{source} {}: the writers wrote and read: {:?}",
            fault.name(),
            report.counts
        );
        assert!(
            report.violations.is_empty(),
            "{source} {}: the history has violations",
            fault.name()
        );
        if fault == Fault::Pause {
            assert!(
                report.counts.stale > 0,
                "{source} pause: the paused holder's decided write was not refused"
            );
        }
    }
}

/// One test, so that the two sources' runs do not share the machine's two cores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_with_leases_in_etcd_and_zookeeper_keep_every_history_linearizable() {
    let etcd = Leases::etcd().await.unwrap_or_else(|e| panic!("{e}"));
    run_on(&etcd).await;
    drop(etcd);
    let zookeeper = Leases::zookeeper().await.unwrap_or_else(|e| panic!("{e}"));
    run_on(&zookeeper).await;
}
