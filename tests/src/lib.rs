//! The end-to-end test harness: real Postgres databases, the real `fencegate` binary,
//! a plain HTTP client, and a TCP proxy that can hold and cut traffic.
//!
//! # Layout
//!
//! - [`cluster`]: a throwaway Postgres cluster of the test's own (`initdb`), for
//!   authentication set-ups and faults the shared server must not see; and `psql`, run
//!   with a clean environment.
//! - [`db`]: a fresh database per test on the machine's Postgres, dropped afterwards.
//! - [`door`]: the Postgres door in front of a fenced table.
//! - [`deployment`]: a gateway with its own fresh store, for tests run against every
//!   backend (`backend_tests!`).
//! - [`fenced`]: fenced tables in a fresh database, and writers connected straight to
//!   Postgres.
//! - [`gateway`]: spawns the built `fencegate` binary on a free port and waits for its
//!   "ready" log line; SIGTERM, SIGKILL, restart, captured logs.
//! - [`faults`]: fault runs — lease-holding writer processes, and the faults injected
//!   under them (pauses, kill -9 of gateways and of Postgres, partitions, clock skew)
//!   — each run's history checked.
//! - [`ha`]: a Postgres HA cluster — etcd, three Patroni nodes, HAProxy — from the
//!   reference deployment in `deploy/patroni/`, and its faults.
//! - [`history`]: histories of runs, and the linearizability checker that judges them
//!   against a model of a fenced register.
//! - [`http`]: a small client for the gateway's API.
//! - [`https`]: the same over TLS, a connection per request, with a client certificate
//!   if asked.
//! - [`inprocess`]: the gateway as a task of the test itself, on the embedded store, for
//!   the API-contract suites (`api_tests!`) and tests under a paused clock.
//! - [`lease`]: lease timing for tests, and the `invoice-sweeper` example as a process.
//! - [`prometheus`]: a real Prometheus server on a free port, and its query API.
//! - [`proxy`]: a loopback TCP proxy whose traffic a test can hold, release and cut.
//! - [`replay`]: failure scenarios as data, run against real processes.
//! - [`s3`]: a throwaway single-node Ceph cluster with radosgw, an S3 upstream on free
//!   loopback ports, and a SigV4-signing client for it.
//! - [`tls`]: a throwaway certificate authority, server and client certificates
//!   (`openssl`).
//!
//! Services a test needs are never skipped: if Postgres is unreachable the test fails
//! with a message that says how to start it.
#![forbid(unsafe_code)]

pub mod cluster;
pub mod db;
pub mod deployment;
pub mod door;
pub mod faults;
pub mod fenced;
pub mod gateway;
pub mod ha;
pub mod history;
pub mod http;
pub mod https;
pub mod inprocess;
pub mod lease;
pub mod prometheus;
pub mod proxy;
pub mod replay;
pub mod s3;
pub mod tls;

/// Polls `condition` every 10 ms until it holds, or panics after `timeout` with `what`.
pub async fn eventually<F, Fut>(timeout: std::time::Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// The resident set size of process `pid`, in bytes (`VmRSS` of `/proc/<pid>/status`):
/// memory as the machine sees it, read from outside the process.
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status is readable: {e}"));
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("/proc status has VmRSS");
    kib * 1024
}

/// A loopback port that was free a moment ago, for a server that binds it itself. If
/// another process takes it in between, that server fails to start and says so.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free loopback port exists");
    listener
        .local_addr()
        .expect("a bound socket has an address")
        .port()
}
pub mod auth_file;
pub mod sources;
