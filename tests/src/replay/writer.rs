//! A writer as a separate process, so that a scenario can freeze it (SIGSTOP) the way a
//! GC pause or a VM migration freezes a leader, and thaw it (SIGCONT).
//!
//! The process is `fencegate-replay --writer-process`: it reads one JSON command per line on
//! stdin (`{"addr", "request"}`), sends the request, and prints one JSON line per
//! answer on stdout, in order. A command sent while it is frozen waits in the pipe:
//! the process had decided to write before it froze, and does so when it wakes.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::replay::wire::{self, Reply, Request};

#[derive(Serialize, Deserialize)]
struct Order {
    addr: SocketAddr,
    request: Request,
}

#[derive(Serialize, Deserialize)]
struct Answer {
    reply: Result<Reply, String>,
}

/// The child's loop: runs until stdin closes. Reads block a thread of their own; the
/// requests themselves are async.
pub async fn serve() -> std::io::Result<()> {
    use std::io::{BufRead, Write};
    loop {
        let line = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin()
                .lock()
                .read_line(&mut line)
                .map(|n| (n, line))
        })
        .await
        .map_err(std::io::Error::other)??;
        if line.0 == 0 {
            return Ok(());
        }
        let answer = match serde_json::from_str::<Order>(&line.1) {
            Ok(order) => Answer {
                reply: wire::send_one(order.addr, &order.request).await,
            },
            Err(e) => Answer {
                reply: Err(format!("bad command: {e}")),
            },
        };
        let text = serde_json::to_string(&answer).expect("answers serialise");
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{text}")?;
        stdout.flush()?;
    }
}

/// The parent's handle on a writer process.
pub struct Writer {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Writer {
    pub fn spawn(binary: &Path) -> Result<Writer, String> {
        let mut child = Command::new(binary)
            .arg("--writer-process")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the writer process {}: {e}", binary.display()))?;
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
        Ok(Writer {
            child,
            stdin,
            stdout,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// Hands the process a request to send (it sends it when it runs).
    pub async fn order(&mut self, addr: SocketAddr, request: Request) -> Result<(), String> {
        let mut line = serde_json::to_string(&Order { addr, request }).expect("orders serialise");
        line.push('\n');
        self.stdin
            .write_all(line.as_bytes())
            .await
            .map_err(|e| format!("the writer process is gone: {e}"))
    }

    /// The next answer, in order of the orders.
    pub async fn answer(&mut self) -> Result<Reply, String> {
        let line = tokio::time::timeout(wire::PATIENCE, self.stdout.next_line())
            .await
            .map_err(|_| "the writer process did not answer".to_owned())?
            .map_err(|e| e.to_string())?
            .ok_or("the writer process exited")?;
        let answer: Answer = serde_json::from_str(&line).map_err(|e| e.to_string())?;
        answer.reply
    }

    pub fn signal(&self, name: &str) {
        crate::gateway::signal(self.pid(), name);
    }
}
