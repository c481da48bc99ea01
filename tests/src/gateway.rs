//! Spawns the real `fencegate` binary.
//!
//! The gateway is started with `--listen 127.0.0.1:0 --log-format json`; the harness
//! learns its address from the "fencegate ready" log line, which is also the readiness
//! signal: no sleeping, no fixed ports. Every later log line is kept for assertions.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::http::Client;

/// How long a gateway may take to print its ready line.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The built gateway binary: `FENCEGATE_BIN`, or `fencegate` in this test's target dir.
pub fn binary() -> PathBuf {
    built(
        "FENCEGATE_BIN",
        "fencegate",
        "cargo build -p fencegate-gateway",
    )
}

/// A binary built alongside the tests: the path in `$env_var` if set, otherwise
/// `relative` (e.g. `fencegate`, `examples/invoice-sweeper`) in this test's target dir.
/// Panics with `build` (the command that makes it) if it is missing.
pub fn built(env_var: &str, relative: &str, build: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(env_var) {
        return path.into();
    }
    let exe = std::env::current_exe().expect("the test binary has a path");
    // target/<profile>/deps/<test> -> target/<profile>/<relative>
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binaries live in target/<profile>/deps")
        .join(relative);
    assert!(
        path.exists(),
        "{} does not exist: build it first with `{build}` \
         (.ci/run builds every binary and example before the tests)",
        path.display()
    );
    path
}

/// How to start a gateway.
#[derive(Debug, Clone, Default)]
pub struct GatewayBuilder {
    args: Vec<String>,
    listen: Option<SocketAddr>,
    /// A command the binary runs under, e.g. `prlimit --nofile=256 --`.
    wrapper: Vec<String>,
}

impl GatewayBuilder {
    /// `--database-url`.
    pub fn database(self, url: &str) -> Self {
        self.arg("--database-url").arg(url)
    }

    /// `--sql`, running writers' SQL as the login of `url` (`--sql-database-url`).
    pub fn sql_as(self, url: &str) -> Self {
        self.arg("--sql").arg("--sql-database-url").arg(url)
    }

    /// Any other flag or value.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Flags and values, in order.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|arg| arg.to_string()));
        self
    }

    /// Runs the gateway under `command` (which must exec what follows it), e.g.
    /// `["prlimit", "--nofile=256", "--"]`.
    pub fn run_under(mut self, command: &[&str]) -> Self {
        self.wrapper = command.iter().map(|part| (*part).to_owned()).collect();
        self
    }

    /// Listen on this address instead of a free port (for restarts in place).
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = Some(addr);
        self
    }

    /// Starts the gateway and waits until it is ready; panics with its logs if it is not.
    pub async fn spawn(self) -> Gateway {
        match self.try_spawn().await {
            Ok(gateway) => gateway,
            Err(failure) => panic!("the gateway did not start: {failure}"),
        }
    }

    /// Starts the gateway; on failure returns its exit status and everything it logged.
    pub async fn try_spawn(self) -> Result<Gateway, StartFailure> {
        let listen = self
            .listen
            .map_or_else(|| "127.0.0.1:0".to_owned(), |a| a.to_string());
        let mut command = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(binary());
                command
            }
            None => Command::new(binary()),
        };
        if !self.args.iter().any(|arg| arg == "--pg-listen") {
            // A free port, so that gateways on Postgres can run side by side.
            command.args(["--pg-listen", "127.0.0.1:0"]);
        }
        if self.args.iter().any(|arg| arg == "--database-url") {
            // A gateway opens its pools whole at start and keeps them; tests run many
            // gateways side by side on one server of 100 connections, so each takes
            // few unless the test asks for more.
            for (flag, size) in [("--pool-size", "4"), ("--sql-pool-size", "2")] {
                if !self.args.iter().any(|arg| arg == flag) {
                    command.args([flag, size]);
                }
            }
        }
        let mut child = command
            .args(["--listen", &listen, "--log-format", "json"])
            .args(&self.args)
            // Only what is passed here configures the gateway.
            .env_clear()
            .env("RUST_BACKTRACE", "1")
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the gateway binary can be executed");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr is piped")).lines();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let ready = tokio::time::timeout(START_TIMEOUT, async {
            while let Ok(Some(line)) = lines.next_line().await {
                let addrs = ready_addrs(&line);
                logs.lock().unwrap().push(line);
                if addrs.is_some() {
                    return addrs;
                }
            }
            None
        })
        .await;
        let (addr, pg_addr, s3_addr) = match ready {
            Ok(Some(addrs)) => addrs,
            Ok(None) | Err(_) => {
                let _ = child.start_kill();
                let status = child.wait().await.ok();
                let logs = logs.lock().unwrap().join("\n");
                return Err(StartFailure { status, logs });
            }
        };
        let sink = Arc::clone(&logs);
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                sink.lock().unwrap().push(line);
            }
        });
        Ok(Gateway {
            child,
            addr,
            pg_addr,
            s3_addr,
            logs,
            builder: self,
        })
    }
}

/// A gateway that failed to start.
#[derive(Debug)]
pub struct StartFailure {
    pub status: Option<ExitStatus>,
    pub logs: String,
}

impl std::fmt::Display for StartFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit status {:?}; output:\n{}", self.status, self.logs)
    }
}

/// The HTTP address, and the Postgres and S3 doors' if any, of a "fencegate ready"
/// line.
fn ready_addrs(line: &str) -> Option<(SocketAddr, Option<SocketAddr>, Option<SocketAddr>)> {
    let event: Value = serde_json::from_str(line).ok()?;
    let fields = event.get("fields")?;
    if fields.get("message")?.as_str()? != "fencegate ready" {
        return None;
    }
    let addr = fields.get("addr")?.as_str()?.parse().ok()?;
    let door = |name: &str| {
        fields
            .get(name)
            .and_then(Value::as_str)
            .and_then(|addr| addr.parse().ok())
    };
    Some((addr, door("pg_addr"), door("s3_addr")))
}

/// A running gateway process. Killed when dropped.
pub struct Gateway {
    child: Child,
    addr: SocketAddr,
    pg_addr: Option<SocketAddr>,
    s3_addr: Option<SocketAddr>,
    logs: Arc<Mutex<Vec<String>>>,
    builder: GatewayBuilder,
}

impl Gateway {
    /// A gateway on `db` with fenced SQL transactions enabled (`--sql`), run as the
    /// database's writer role ([`crate::db::TestDb::writer`]), and defaults otherwise.
    pub async fn with_sql(db: &crate::db::TestDb) -> Gateway {
        Gateway::builder()
            .database(&db.url())
            .sql_as(&db.writer().await)
            .spawn()
            .await
    }

    pub fn builder() -> GatewayBuilder {
        GatewayBuilder::default()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The Postgres door's address; panics if the gateway has none.
    pub fn pg_addr(&self) -> SocketAddr {
        self.pg_addr
            .expect("the gateway runs the Postgres door (--database-url, --pg-listen not off)")
    }

    /// `http://127.0.0.1:<port>`.
    /// The S3 door's address; panics if it has none.
    pub fn s3_addr(&self) -> SocketAddr {
        self.s3_addr
            .expect("the gateway runs the S3 door (--s3-listen)")
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn client(&self) -> Client {
        Client::new(self.url())
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("the gateway is running")
    }

    /// Sends SIGTERM and waits for the process to exit.
    pub async fn terminate(&mut self) -> ExitStatus {
        self.signal("TERM");
        self.wait().await
    }

    /// Sends a signal (`TERM`, `INT`, `STOP`, `CONT`, ...) without waiting.
    pub fn signal(&self, name: &str) {
        signal(self.pid(), name);
    }

    /// Waits for the process to exit (30 s at most).
    pub async fn wait(&mut self) -> ExitStatus {
        tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("the gateway exits within 30 s")
            .expect("waiting for the gateway works")
    }

    /// Sends SIGKILL and waits for the process to exit.
    pub async fn kill(&mut self) {
        self.child.kill().await.expect("the gateway can be killed");
    }

    /// Stops the gateway with SIGTERM and starts it again, with the same flags, on the
    /// same address.
    pub async fn restart(&mut self) {
        let status = self.terminate().await;
        assert!(
            status.success(),
            "the gateway exited with {status} on SIGTERM"
        );
        let next = self.builder.clone().listen(self.addr).spawn().await;
        *self = next;
    }

    /// Every JSON log event so far.
    pub fn logs(&self) -> Vec<Value> {
        self.logs
            .lock()
            .unwrap()
            .iter()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect()
    }

    /// Its log lines, now and later.
    pub fn log_lines(&self) -> LogLines {
        LogLines(Arc::clone(&self.logs))
    }

    /// The log events whose message is `message`.
    pub fn events(&self, message: &str) -> Vec<Value> {
        self.logs()
            .into_iter()
            .filter(|event| event["fields"]["message"].as_str() == Some(message))
            .collect()
    }
}

/// Lines of a gateway's log that a failing test prints.
const TAIL_LINES: usize = 40;

impl Drop for Gateway {
    /// In a test that is failing, prints the end of the gateway's log: what it was
    /// doing when the test gave up (libtest shows a failing test's output).
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- gateway {}, its last {TAIL_LINES} log lines:\n{}",
                self.addr,
                self.log_lines().tail(TAIL_LINES)
            );
        }
    }
}

/// A gateway's log lines as it printed them, shared with the gateway: for the report
/// of a failure elsewhere (a test bed's wait that ran out).
#[derive(Clone)]
pub struct LogLines(Arc<Mutex<Vec<String>>>);

impl LogLines {
    /// The last `count` lines.
    pub fn tail(&self, count: usize) -> String {
        let lines = self.0.lock().unwrap();
        lines[lines.len().saturating_sub(count)..].join("\n")
    }
}

/// Sends a signal with the system's `kill` command (no unsafe code in this crate).
pub fn signal(pid: u32, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("the kill command runs");
    assert!(status.success(), "kill -{name} {pid} failed");
}
