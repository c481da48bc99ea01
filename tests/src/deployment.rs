//! A gateway together with the store behind it, for tests that run against every backend.
//!
//! A test written as `backend_tests! { async fn name(deployment) { ... } }` becomes one
//! test per backend (`name::postgres`, ...), each with its own fresh store.

use crate::db::TestDb;
use crate::gateway::{Gateway, GatewayBuilder};
use crate::http::Client;

/// Where a gateway keeps its fences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
}

/// A running gateway and its own fresh store.
pub struct Deployment {
    pub backend: Backend,
    pub gateway: Gateway,
    db: TestDb,
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
        match backend {
            Backend::Postgres => {
                let db = TestDb::create().await;
                let gateway = configure(Gateway::builder().database(&db.url()))
                    .spawn()
                    .await;
                Deployment {
                    backend,
                    gateway,
                    db,
                }
            }
        }
    }

    /// A builder for another gateway on the same store.
    pub fn builder(&self) -> GatewayBuilder {
        match self.backend {
            Backend::Postgres => Gateway::builder().database(&self.db.url()),
        }
    }

    pub fn client(&self) -> Client {
        self.gateway.client()
    }

    /// The Postgres database, for tests that look at it directly.
    pub fn db(&self) -> &TestDb {
        &self.db
    }

    /// The durable highest token of `resource`, read from the store itself.
    pub async fn highest(&self, resource: &str) -> Option<u64> {
        self.db.highest(resource).await.map(|h| h as u64)
    }

    /// The stored object `(value, token, version)`, read from the store itself.
    pub async fn object(&self, resource: &str, key: &str) -> Option<(Vec<u8>, u64, u64)> {
        self.db
            .object(resource, key)
            .await
            .map(|(v, t, n)| (v, t as u64, n as u64))
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
            }
        )*
    };
}
