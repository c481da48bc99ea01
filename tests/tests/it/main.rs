//! The integration suites, one module each, linked into one test binary: every suite
//! links the gateway and every client library, and one link is much cheaper than one
//! per suite.
//!
//! Run one suite with its module path as the filter:
//!
//! ```text
//! cargo test -p fencegate-tests --test it authority::
//! cargo test -p fencegate-tests --test it authority::a_writer_holds_no_other
//! ```
//!
//! The suites run side by side in this process's test threads, so none may own
//! anything process-wide: each test starts its own gateways on free ports, and its own
//! databases, temp dirs and Redis prefixes under fresh names; a query of the shared
//! server's `pg_stat_activity` keeps to the test's own database. The suites that
//! restart or cut processes for minutes — `patroni`, `faults`, `failover`,
//! `replay_random` — are test binaries of their own (`tests/tests/*.rs`).
#![forbid(unsafe_code)]

mod auth;
mod authority;
mod authority_gateway;
mod bad_input;
mod bench_smoke;
mod client_retries;
mod concurrency;
mod dashboards;
mod embedded;
mod faults_sources;
mod fenced_cli;
mod fenced_concurrency;
mod fenced_tables;
mod group_commit;
mod history;
mod http2;
mod http_hardening;
mod http_memory;
mod http_tls;
mod idempotency;
mod idempotency_faults;
mod lease_gateway;
mod lease_holders;
mod lease_postgres;
mod lease_redis;
mod lease_sources;
mod lease_sweeper;
mod leases;
mod lifecycle;
mod logging;
mod openapi;
mod outage;
mod pg_door;
mod pg_door_admission;
mod pg_door_auth;
mod pg_door_clients;
mod pg_door_failover;
mod pg_door_tls;
mod pg_upstream_tls;
mod readiness;
mod replay_command;
mod replay_network;
mod replay_scenarios;
mod s3_clients;
mod s3_door;
mod s3_history;
mod s3_upstream;
mod seed;
mod sql_fenced;
mod sql_guard;
mod sql_hostile;
mod sql_latency;
mod sql_login;
mod sql_setup;
mod sql_values;
mod store_identity;
mod store_settings;
mod txn;
mod uncached;
