//! The servers under load, each a process of its own: the real `fencegate` binary, and
//! the bare HTTP server (this benchmark's own binary, `bare-http` command).
//!
//! The gateway under load runs with `--log warn`, so that the per-request span and any
//! info logging are not what is measured. With that filter it prints no ready line, so
//! readiness is `GET /readyz` answering 200; start-up time is measured separately, on
//! the ready line of a gateway logging at its default level.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// How long a server may take to become ready.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A server process, killed when dropped.
pub struct Process {
    child: Child,
    pub addr: SocketAddr,
    log: PathBuf,
}

impl Process {
    pub fn pid(&self) -> u32 {
        self.child.id().expect("the server is running")
    }

    /// Resident set size, in bytes (`VmRSS` of `/proc/<pid>/status`).
    pub fn rss(&self) -> u64 {
        fencegate_tests::rss_bytes(self.pid())
    }

    /// The last lines the server logged, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Starts `fencegate` on `database_url` with `--log warn` and waits until it is ready.
/// The gateway-reject workload is a stale flood, so the gateway runs as an operator
/// would run it for one: at most 100 rejection log lines per second.
pub async fn gateway(bin: &Path, database_url: &str, extra: &[String]) -> Result<Process, String> {
    let mut args = vec![
        "--database-url".to_owned(),
        database_url.to_owned(),
        // The benchmark measures the HTTP door; the Postgres door stays out of the way.
        "--pg-listen".to_owned(),
        "off".to_owned(),
        "--log".to_owned(),
        "warn".to_owned(),
        "--log-format".to_owned(),
        "json".to_owned(),
        "--stale-log-limit".to_owned(),
        "100".to_owned(),
    ];
    args.extend_from_slice(extra);
    start(bin, &args, "/readyz").await
}

/// Starts this binary's bare HTTP server and waits until it answers.
pub async fn bare_http() -> Result<Process, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    start(&exe, &["bare-http".to_owned()], "/").await
}

async fn start(bin: &Path, args: &[String], ready_path: &str) -> Result<Process, String> {
    let addr = free_port()?;
    let log = std::env::temp_dir().join(format!(
        "fencegate-bench-{}-{}.log",
        std::process::id(),
        addr.port()
    ));
    let log_file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let child = Command::new(bin)
        .args(args)
        .arg("--listen")
        .arg(addr.to_string())
        // Only the flags configure the server.
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let mut process = Process { child, addr, log };
    let deadline = Instant::now() + START_TIMEOUT;
    let client = fencegate_tests::http::Client::new(format!("http://{addr}"));
    loop {
        let ready = client
            .try_request(http::Method::GET, ready_path, &[], Bytes::new())
            .await;
        if ready.is_ok_and(|reply| reply.status == StatusCode::OK.as_u16()) {
            return Ok(process);
        }
        if let Ok(Some(status)) = process.child.try_wait() {
            return Err(format!(
                "{} exited with {status}:\n{}",
                bin.display(),
                process.log_tail()
            ));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} was not ready within {START_TIMEOUT:?}:\n{}",
                bin.display(),
                process.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A port that was free a moment ago. The servers take `--listen` only, so there is a
/// short window in which another process could take it; the start then fails loudly.
fn free_port() -> Result<SocketAddr, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    listener.local_addr().map_err(|e| e.to_string())
}

/// Time from spawning `fencegate` (at its default log level) to its "fencegate ready"
/// line: connecting, migrating the schema if needed, binding.
pub async fn time_to_ready(bin: &Path, database_url: &str) -> Result<Duration, String> {
    let started = Instant::now();
    let mut child = Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
        .args(["--database-url", database_url, "--pg-listen", "127.0.0.1:0"])
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let mut lines = BufReader::new(child.stderr.take().expect("stderr is piped")).lines();
    let mut seen = Vec::new();
    let ready = tokio::time::timeout(START_TIMEOUT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("\"fencegate ready\"") {
                return true;
            }
            seen.push(line);
        }
        false
    })
    .await;
    let elapsed = started.elapsed();
    let _ = child.kill().await;
    match ready {
        Ok(true) => Ok(elapsed),
        _ => Err(format!("fencegate did not get ready:\n{}", seen.join("\n"))),
    }
}

/// The bare HTTP server: HTTP/1.1 and h2c on one listener, like the gateway; reads
/// each request's body and answers a fixed `200 {}`. Whatever no gateway could beat.
pub async fn serve_bare(listen: SocketAddr) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let builder = builder.clone();
        tokio::spawn(async move {
            let service = service_fn(|request: Request<Incoming>| async move {
                let _ = request.into_body().collect().await;
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
            });
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
