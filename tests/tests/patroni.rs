//! The gateway on a real Postgres HA cluster: Patroni with etcd, behind HAProxy
//! (`deploy/patroni/`), started by the test
//! ([`HaCluster`](fencegate_tests::ha::HaCluster)); the run of faults, its writers and
//! its summary are in [`fencegate_tests::ha::run`]. This file says what each mode must
//! keep.
//!
//! Two gateways serve one cluster, one through HAProxy and one with a multi-host URL
//! (`target_session_attrs=read-write`). Writers take turns holding the gateway's hosted
//! lease of a resource and write with its token, through both gateways, while a fault
//! hits the cluster: kill -9 of the primary's postmaster, a switchover, the primary
//! frozen (SIGSTOP) until another node is promoted, a restart of etcd, the primary cut
//! off from the network until another node is promoted, and in synchronous mode kill -9
//! of the primary's whole node (Patroni and Postgres; started again afterwards). Then
//! every key is read once more and the history is checked for
//! linearizability against a fenced register ([`fencegate_tests::history::check`]): every acknowledged
//! write is there, and no write of an older term got in after a newer term's.
//!
//! Writers of a second resource write through the gateways' Postgres doors instead, to
//! a fenced table (`fencegate.protect`): one with tokio-postgres, one with `psql`, each
//! in a transaction that presents its term's token with `fencegate.fence()` first. Their
//! histories are checked the same way, with the table's `version` column as the
//! object's version.
//!
//! Acquires are sent with an `Idempotency-Key` and retried with it until answered, so
//! every term's token is known (an acquire raises the fence). Writes are not retried:
//! an answer that does not say whether a write was applied (`503` with
//! `write_applied: null`, a broken connection) is indeterminate in the history.
//!
//! In synchronous mode a third gateway runs as `deploy/patroni/README.md` sets it up:
//! its own login and database made by the README's SQL (a member of `pg_monitor`, not a
//! superuser), through HAProxy, with `--patroni-url` naming every node and
//! `--require-synchronous-replication`. It must report the cluster as synchronously
//! replicated, in its ready line and its metrics, at the start and after the faults.
//!
//! Through each fault, one lease holder per gateway — the Rust client's elector on a
//! hosted lease of its own, default timing — holds its lease, as an application would.
//! `deploy/patroni/README.md` promises that a 15 s ttl rides out a switchover and a
//! 30 s ttl a dead node: there each holder must keep its term, the same token renewed
//! after the recovery. The other faults run with 15 s (a crash of Postgres, etcd
//! restarted) or 30 s (a frozen or cut-off primary), and how the holders fared is
//! printed only ([`Fault::holder_ttl`]).
//!
//! Each fault prints one line: operations, acknowledged, indeterminate, violations, and
//! how long writes were unavailable (`cargo test -p fencegate-tests --test patroni --
//! --nocapture`); and one more with each gateway's outage, timed by [`Probe`]s that
//! write through it on their own: from the fault (the switchover request, the kill) to
//! the first write it accepted again; and one with how each lease holder fared.
//! Synchronous mode must keep everything;
//! asynchronous mode prints the same and asserts only that no older term's write was
//! applied after a newer term's was acknowledged.

use fencegate_tests::ha::run::run;
#[cfg(doc)]
use fencegate_tests::ha::{run::Fault, Probe};

/// One cluster at a time: the machine has few cores, and each cluster is seven processes.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_mode_keeps_every_acknowledged_write_through_faults() {
    let _serial = SERIAL.lock().await;
    run(true, |summary| {
        let fault = summary.fault.name();
        assert!(
            summary.violations.is_empty() && summary.lost.is_empty(),
            "{fault}: {:#?}\nlost: {:#?}",
            summary.violations,
            summary.lost
        );
        assert_eq!(summary.late_applied, 0, "{fault}");
        assert_eq!(summary.internal, 0, "{fault}");
        assert_eq!(summary.tokens_twice, 0, "{fault}");
        assert!(summary.counts.applied > 0, "{fault}");
        summary.assert_holders_kept();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_mode_lets_no_older_term_in_through_faults() {
    let _serial = SERIAL.lock().await;
    run(false, |summary| {
        let fault = summary.fault.name();
        for violation in &summary.violations {
            println!("asynchronous {fault}: {violation}");
        }
        for write in &summary.lost {
            println!("asynchronous {fault}: lost {write}");
        }
        assert_eq!(summary.late_applied, 0, "{fault}");
        assert_eq!(summary.internal, 0, "{fault}");
        assert_eq!(summary.tokens_twice, 0, "{fault}");
        assert!(summary.counts.applied > 0, "{fault}");
        summary.assert_holders_kept();
    })
    .await;
}
