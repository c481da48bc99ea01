//! The gateway inside the test's own process: `fencegate_gateway::run` on a port-0
//! listener with the embedded store in a fresh directory. No binary to build, no
//! database, no process to start — for the API-contract suites, and for tests of
//! timing under `tokio::time::pause`, where the gateway's timers run on the paused
//! clock and a 60-second deadline passes at once.
//!
//! `api_tests!` runs one scenario against both this and the real binary on Postgres,
//! through [`Api`]: what such a scenario may use of a gateway.

use std::future::Future;
use std::net::SocketAddr;

use clap::Parser;
use fencegate_gateway::config::{Cli, Command};
use fencegate_gateway::StartError;
use http::Method;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::deployment::{DataDir, Deployment};
use crate::http::Client;

/// A gateway running as a task of the test's runtime.
pub struct InProcess {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), StartError>>,
    _data: DataDir,
}

impl InProcess {
    /// Starts a gateway with `flags` (as on the command line) on the embedded store,
    /// and waits until it answers `/healthz`. Panics with the gateway's own error if
    /// the flags are invalid or it cannot start.
    pub async fn start(flags: &[&str]) -> InProcess {
        let data = DataDir::create();
        let data_dir = data.0.to_string_lossy().into_owned();
        let args = ["fencegate", "--data-dir", &data_dir]
            .into_iter()
            .chain(flags.iter().copied());
        let config = match Cli::try_parse_from(args) {
            Ok(cli) => match cli.into_command() {
                Command::Serve(config) => *config,
                _ => panic!("{flags:?} name a command, not a gateway"),
            },
            Err(error) => panic!("invalid gateway flags {flags:?}: {error}"),
        };
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port is free");
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async {
            let _ = stopped.await;
        };
        let task = tokio::spawn(fencegate_gateway::run(config, listener, shutdown));
        let mut gateway = InProcess {
            addr,
            stop: Some(stop),
            task,
            _data: data,
        };
        if let Err(error) = gateway
            .client()
            .try_request(Method::GET, "/healthz", &[], "")
            .await
        {
            let outcome = (&mut gateway.task).await;
            panic!("the in-process gateway did not start ({error}): {outcome:?}");
        }
        gateway
    }

    /// Shuts down as on SIGTERM: finishes the requests in flight, then returns what
    /// `run` returned.
    pub async fn stop(mut self) -> Result<(), StartError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task)
            .await
            .expect("the gateway task did not panic")
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What an API-contract scenario may use of a gateway, wherever it runs.
pub trait Api {
    fn addr(&self) -> SocketAddr;

    /// `http://host:port`.
    fn url(&self) -> String {
        format!("http://{}", self.addr())
    }

    fn client(&self) -> Client {
        Client::new(self.url())
    }

    /// The durable highest token of `resource`.
    fn highest(&self, resource: &str) -> impl Future<Output = Option<u64>>;

    /// The stored object `(value, token, version)`.
    fn object(
        &self,
        resource: &str,
        key: &str,
    ) -> impl Future<Output = Option<(Vec<u8>, u64, u64)>>;
}

impl Api for InProcess {
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The embedded store's file is held by the gateway, so it is read through the API,
    /// whose reads go to the store, not to the fence cache.
    async fn highest(&self, resource: &str) -> Option<u64> {
        self.client().read_highest(resource).await
    }

    async fn object(&self, resource: &str, key: &str) -> Option<(Vec<u8>, u64, u64)> {
        self.client().read_object(resource, key).await
    }
}

impl Api for Deployment {
    fn addr(&self) -> SocketAddr {
        self.gateway.addr()
    }

    async fn highest(&self, resource: &str) -> Option<u64> {
        Deployment::highest(self, resource).await
    }

    async fn object(&self, resource: &str, key: &str) -> Option<(Vec<u8>, u64, u64)> {
        Deployment::object(self, resource, key).await
    }
}

/// Declares API-contract tests: each `async fn name(gateway) { .. }` becomes a module
/// `name` with two tests, `in_process` (the gateway in this process, embedded store)
/// and `postgres` (the `fencegate` binary on a fresh database). The body sees `gateway`
/// through [`Api`]. Gateway flags go in brackets, as for `backend_tests!`.
#[macro_export]
macro_rules! api_tests {
    ($($(#[$meta:meta])* async fn $name:ident($gateway:ident) $([$($flag:expr),* $(,)?])? $body:block)*) => {
        $(
            $(#[$meta])*
            mod $name {
                #[allow(unused_imports)]
                use super::*;
                #[allow(unused_imports)]
                use $crate::inprocess::Api;
                use $crate::deployment::{Backend, Deployment};
                use $crate::inprocess::InProcess;

                async fn scenario($gateway: impl Api) $body

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn in_process() {
                    scenario(InProcess::start(&[$($($flag),*)?]).await).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    let deployment = Deployment::start_with(Backend::Postgres, |builder| {
                        builder $($(.arg($flag))*)?
                    })
                    .await;
                    scenario(deployment).await
                }
            }
        )*
    };
}
