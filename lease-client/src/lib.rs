//! fencegate-lease: leader election with fencing tokens, for writers that send their
//! writes through the fencegate gateway.
//!
//! A writer process competes for a named lease; while it holds the lease it leads a
//! *term*, numbered by the lease's epoch (its fencing token). The leading code gets the
//! [`Term`]: the token to send with every write, and a cancellation signal that fires
//! the moment authority is lost — the store says another holder took over, renewals
//! stop succeeding for too long on this process's own clock, or the gateway rejects
//! one of the term's writes as stale.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use fencegate_lease::{Elector, FencedClient, LeaseConfig, PostgresStore};
//! use fencegate_proto::headers::Precondition;
//! use fencegate_proto::{ObjectKey, ResourceName};
//! use tokio_util::sync::CancellationToken;
//!
//! let store = PostgresStore::new("postgres://postgres@127.0.0.1/app", "leader_lease", true)?;
//! let gateway = FencedClient::new("http://127.0.0.1:7070")?;
//! let resource = ResourceName::new("invoices")?;
//! let elector = Elector::new(store, "invoice-sweeper", "node-a-4711", LeaseConfig::default())?
//!     .advance_fences(gateway.clone(), vec![resource.clone()]);
//! elector
//!     .run(CancellationToken::new(), |term| {
//!         let (gateway, resource) = (gateway.clone(), resource.clone());
//!         async move {
//!             let key = ObjectKey::new("last-sweep").unwrap();
//!             // Stops at the first await after authority is lost.
//!             let _ = term
//!                 .run_until_lost(gateway.put(&term, &resource, &key, "done", Precondition::None))
//!                 .await;
//!         }
//!     })
//!     .await;
//! # Ok(()) }
//! ```
//!
//! # Layout
//!
//! - [`config`]: timing (`lease_duration`, `renew_interval`, `renew_deadline`,
//!   `retry_period`, `max_round_trip`), its arithmetic and validation.
//! - [`store`]: the [`LeaseStore`] trait and its rule on re-acquisition;
//!   [`PostgresStore`] (the seed's `leader_lease` table) and `RedisStore` (feature
//!   `redis`, on by default).
//! - [`elector`]: the loop that follows, acquires, renews and steps down, publishing
//!   [`Transition`]s.
//! - [`term`]: [`Term`], [`LossReason`].
//! - [`client`]: [`FencedClient`], fenced writes through the gateway, each under its
//!   own `Idempotency-Key` and resent under it while in doubt; a stale rejection ends
//!   the term.
//! - [`txn`]: [`TxnBuilder`], operations on several resources under their terms, sent
//!   as one transaction that applies all or none.
//! - `metrics` (feature `prometheus`): `fencegate_lease_*` series.
//!
//! # Invariants
//!
//! - A term's epoch is strictly above every epoch the store handed out before for the
//!   lease (each acquisition bumps it, renewals never do).
//! - A holder stops leading at `renew_deadline` after the send instant of its last
//!   successful renewal, measured on its monotonic clock; the store cannot grant the
//!   lease to anyone else before `lease_duration` after that instant.
//! - A term, once ended, never becomes live again; the client sends nothing under it.
//! - A logical write has one `Idempotency-Key`, the same on every attempt, and no
//!   other write has it: the gateway applies it at most once however often it is sent.
//! - A lease is handed back only after the leading code of the term has returned, and
//!   only if the store still records this holder at this epoch.
#![forbid(unsafe_code)]

pub mod client;
pub mod config;
pub mod elector;
#[cfg(feature = "prometheus")]
pub mod metrics;
pub mod store;
pub mod term;
pub mod txn;

pub use client::{FencedClient, Object, WriteError};
pub use config::{ConfigError, LeaseConfig};
pub use elector::{Elector, Transition};
#[cfg(feature = "prometheus")]
pub use metrics::LeaseMetrics;
#[cfg(feature = "etcd")]
pub use store::etcd::EtcdStore;
pub use store::gateway::GatewayStore;
pub use store::postgres::PostgresStore;
#[cfg(feature = "redis")]
pub use store::redis::RedisStore;
#[cfg(feature = "zookeeper")]
pub use store::zookeeper::ZooKeeperStore;
pub use store::{LeaseStore, StoreError};
pub use term::{LossReason, Lost, Term};
pub use txn::TxnBuilder;
