//! A gateway together with the store behind it, for tests that run against every backend.
//!
//! A test written as `backend_tests! { async fn name(deployment) { ... } }` becomes one
//! test per backend (`name::postgres`, `name::embedded`), each with its own fresh store.

use std::path::{Path, PathBuf};

use crate::db::TestDb;
use crate::gateway::{Gateway, GatewayBuilder};
use crate::http::Client;

/// Where a gateway keeps its fences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A fresh database on the test Postgres server.
    Postgres,
    /// The embedded store, in a fresh temporary data directory.
    Embedded,
}

/// The store of a deployment.
enum Store {
    Postgres(TestDb),
    Embedded(DataDir),
}

/// A running gateway and its own fresh store.
pub struct Deployment {
    pub backend: Backend,
    pub gateway: Gateway,
    store: Store,
}

impl Deployment {
    pub async fn start(backend: Backend) -> Deployment {
        Deployment::start_with(backend, |builder| builder).await
    }

    /// Starts with extra flags.
    pub async fn start_with(
        backend: Backend,
        configure: impl FnOnce(GatewayBuilder) -> GatewayBuilder,
    ) -> Deployment {
        let store = match backend {
            Backend::Postgres => Store::Postgres(TestDb::create().await),
            Backend::Embedded => Store::Embedded(DataDir::create()),
        };
        let gateway = configure(builder_for(&store)).spawn().await;
        Deployment {
            backend,
            gateway,
            store,
        }
    }

    /// A builder for another gateway on the same store.
    pub fn builder(&self) -> GatewayBuilder {
        builder_for(&self.store)
    }

    pub fn client(&self) -> Client {
        self.gateway.client()
    }

    /// The Postgres database, for tests that look at it directly.
    pub fn db(&self) -> &TestDb {
        match &self.store {
            Store::Postgres(db) => db,
            Store::Embedded(_) => panic!("an embedded deployment has no Postgres database"),
        }
    }

    /// The embedded store's data directory.
    pub fn data_dir(&self) -> &Path {
        match &self.store {
            Store::Embedded(dir) => &dir.0,
            Store::Postgres(_) => panic!("a Postgres deployment has no data directory"),
        }
    }

    /// The durable highest token of `resource`: read from the database itself, or for
    /// the embedded store (whose file the gateway holds locked) through the API's read
    /// of the store, which bypasses the fence cache.
    pub async fn highest(&self, resource: &str) -> Option<u64> {
        match &self.store {
            Store::Postgres(db) => db.highest(resource).await.map(|h| h as u64),
            Store::Embedded(_) => self.client().read_highest(resource).await,
        }
    }

    /// The stored object `(value, token, version)`, read as [`Deployment::highest`] reads.
    pub async fn object(&self, resource: &str, key: &str) -> Option<(Vec<u8>, u64, u64)> {
        match &self.store {
            Store::Postgres(db) => {
                let object = db.object(resource, key).await;
                object.map(|(value, token, version)| (value, token as u64, version as u64))
            }
            Store::Embedded(_) => self.client().read_object(resource, key).await,
        }
    }
}

fn builder_for(store: &Store) -> GatewayBuilder {
    match store {
        Store::Postgres(db) => Gateway::builder().database(&db.url()),
        Store::Embedded(dir) => Gateway::builder()
            .arg("--data-dir")
            .arg(dir.0.to_string_lossy()),
    }
}

/// A temporary directory, removed when dropped.
pub struct DataDir(pub PathBuf);

impl DataDir {
    pub fn create() -> DataDir {
        let name = format!(
            "fencegate-test-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        let path = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&path).expect("the temporary directory can be created");
        DataDir(path)
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Declares tests that run once per backend: each `async fn name(deployment) { .. }`
/// becomes a module `name` with one `#[tokio::test]` per backend, each on a fresh
/// store. Gateway flags go in brackets: `async fn name(deployment) ["--max-body", "16"] { .. }`.
#[macro_export]
macro_rules! backend_tests {
    ($($(#[$meta:meta])* async fn $name:ident($deployment:ident) $([$($flag:expr),* $(,)?])? $body:block)*) => {
        $(
            $(#[$meta])*
            mod $name {
                #[allow(unused_imports)]
                use super::*;
                use $crate::deployment::{Backend, Deployment};

                async fn scenario($deployment: Deployment) $body

                async fn start(backend: Backend) -> Deployment {
                    Deployment::start_with(backend, |builder| builder $($(.arg($flag))*)?).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    scenario(start(Backend::Postgres).await).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn embedded() {
                    scenario(start(Backend::Embedded).await).await
                }
            }
        )*
    };
}
