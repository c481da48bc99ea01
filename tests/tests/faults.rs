//! Fault runs with real processes, bounded: every fault of `fencegate-faults` for a few
//! seconds each, every history checked. No run but the control may have a violation;
//! the control (fencing off) must have some, or the checker proves nothing.
//!
//! Needs root, PostgreSQL 15's server programs, iproute2 and the test Postgres server;
//! fails, never skips, without them.

use std::path::PathBuf;
use std::time::Duration;

use fencegate_tests::faults::{self, Fault, Leases, Settings};

/// How long each fault is injected here (`fencegate-faults` defaults to longer).
const DURATION: Duration = Duration::from_secs(4);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_run_keeps_its_history_linearizable_and_the_control_does_not() {
    let settings = Settings {
        duration: DURATION,
        resources: 2,
        writers: 2,
        ttl: Duration::from_millis(600),
        lanes: 3,
        binary: PathBuf::from(env!("CARGO_BIN_EXE_fencegate-faults")),
    };
    let leases = Leases::create().await.unwrap_or_else(|e| panic!("{e}"));
    let mut failures = Vec::new();
    for fault in Fault::ALL {
        let report = faults::run(fault, &settings, &leases)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", fault.name()));
        println!("{}", report.line());
        for violation in &report.violations {
            println!("    {violation}");
        }
        assert!(
            report.injected > 0,
            "{}: no fault was injected",
            fault.name()
        );
        assert!(
            report.counts.applied > 0 && report.counts.reads > 0,
            "{}: the writers wrote and read: {:?}",
            fault.name(),
            report.counts
        );
        if !report.passed() {
            failures.push(fault.name());
        }
        match fault {
            // A paused holder's decided write must meet the fence; without the fence,
            // it gets in.
            Fault::Pause | Fault::Clock => assert!(
                report.counts.stale > 0,
                "{}: no stale write was rejected",
                fault.name()
            ),
            Fault::Control => assert!(
                report.late_applied > 0,
                "control: no late write was applied"
            ),
            _ => {}
        }
    }
    assert!(failures.is_empty(), "runs that failed: {failures:?}");
}
