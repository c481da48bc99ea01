//! Lease sources the tests start for themselves: one etcd member and one ZooKeeper
//! server, each on free loopback ports with a temp directory of its own, killed and
//! removed when dropped.
//!
//! Needs `etcd`/`etcdctl` (Debian: etcd-server, etcd-client) and ZooKeeper's jar with
//! a Java runtime (Debian: zookeeperd); fails, never skips, without them.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::time::Instant;

/// How long a server may take to start answering.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// ZooKeeper's jar, as Debian installs it (its manifest names its dependencies).
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";

fn temp_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "fencegate-{what}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir
}

fn spawn(name: &str, command: &mut Command, log: &Path) -> Child {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    let err = file.try_clone().expect("a log file can be duplicated");
    command
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name} (is it installed?): {e}"))
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

async fn kill(child: &mut Child) {
    let _ = child.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
}

/// One etcd member, a cluster of its own.
pub struct Etcd {
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl Etcd {
    /// Starts a new member on a fresh data directory and waits until it answers.
    pub async fn start() -> Etcd {
        let mut etcd = Etcd {
            dir: temp_dir("etcd"),
            client_port: crate::free_port(),
            peer_port: crate::free_port(),
            child: None,
        };
        etcd.run().await;
        etcd
    }

    /// `127.0.0.1:port`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint()]
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    async fn run(&mut self) {
        let client = format!("http://{}", self.endpoint());
        let peer = self.peer_url();
        let mut command = Command::new("etcd");
        command
            .args(["--name", "m0", "--data-dir"])
            .arg(self.data())
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("m0={peer}")])
            .args(["--initial-cluster-state", "new"])
            .args(["--logger", "zap"]);
        self.child = Some(spawn("etcd", &mut command, &self.dir.join("etcd.log")));
        let started = Instant::now();
        while !self.healthy().await {
            assert!(
                started.elapsed() < START_TIMEOUT,
                "etcd did not become healthy:\n{}",
                tail(&self.dir.join("etcd.log"))
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn healthy(&self) -> bool {
        self.etcdctl(&["endpoint", "health"]).await.is_ok()
    }

    /// Runs `etcdctl --endpoints <this> ARGS` (API v3); its stdout, or what failed.
    pub async fn etcdctl(&self, args: &[&str]) -> Result<String, String> {
        let output = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoint(), "--command-timeout", "2s"])
            .args(args)
            .output()
            .await
            .map_err(|e| format!("etcdctl: {e}"))?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).into_owned())
        }
    }

    /// kill -9 the member.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill(&mut child).await;
        }
    }

    /// Starts the member again on its data directory.
    pub async fn restart(&mut self) {
        self.kill().await;
        self.run().await;
    }

    /// Saves a snapshot of the member's data; its path.
    pub async fn snapshot(&self) -> PathBuf {
        let path = self
            .dir
            .join(format!("snapshot-{:08x}.db", rand::random::<u32>()));
        let path_text = path.to_str().expect("temp paths are UTF-8");
        self.etcdctl(&["snapshot", "save", path_text])
            .await
            .unwrap_or_else(|e| panic!("etcdctl snapshot save: {e}"));
        path
    }

    /// Stops the member, replaces its data with `snapshot` restored as an operator
    /// would without `--bump-revision`, and starts it again: the cluster's revision
    /// goes back to the snapshot's.
    pub async fn restore(&mut self, snapshot: &Path) {
        self.kill().await;
        std::fs::remove_dir_all(self.data()).expect("the data directory can be removed");
        let output = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["snapshot", "restore"])
            .arg(snapshot)
            .args(["--name", "m0", "--data-dir"])
            .arg(self.data())
            .args(["--initial-cluster", &format!("m0={}", self.peer_url())])
            .args(["--initial-advertise-peer-urls", &self.peer_url()])
            .output()
            .await
            .expect("etcdctl runs");
        assert!(
            output.status.success(),
            "etcdctl snapshot restore: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        self.run().await;
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One standalone ZooKeeper server.
pub struct ZooKeeper {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

/// ZooKeeper's tick: session timeouts are negotiated between 2 and 20 ticks by default;
/// this server allows 200 ms to 60 s, so that tests can expire sessions quickly.
const TICK_MS: u32 = 100;

impl ZooKeeper {
    /// Starts a server on a fresh data directory and waits until it answers.
    pub async fn start() -> ZooKeeper {
        let mut zookeeper = ZooKeeper {
            dir: temp_dir("zookeeper"),
            port: crate::free_port(),
            child: None,
        };
        // A quorum of one, not standalone mode: every start elects a leader and begins
        // a new zxid epoch, as an ensemble does after a leader change.
        let data = zookeeper.dir.join("data");
        let config = format!(
            "tickTime={TICK_MS}\ndataDir={}\nclientPort={}\nclientPortAddress=127.0.0.1\n\
             initLimit=50\nsyncLimit=20\nstandaloneEnabled=false\n\
             server.1=127.0.0.1:{}:{}\n\
             minSessionTimeout=200\nmaxSessionTimeout=60000\nadmin.enableServer=false\n\
             4lw.commands.whitelist=ruok,srvr\n",
            data.display(),
            zookeeper.port,
            crate::free_port(),
            crate::free_port()
        );
        std::fs::create_dir_all(&data).expect("the data directory is created");
        std::fs::write(data.join("myid"), "1\n").expect("myid is written");
        std::fs::write(zookeeper.dir.join("zoo.cfg"), config).expect("zoo.cfg is written");
        zookeeper.run().await;
        zookeeper
    }

    /// `127.0.0.1:port`.
    pub fn connect(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    async fn run(&mut self) {
        assert!(
            Path::new(ZOOKEEPER_JAR).exists(),
            "{ZOOKEEPER_JAR} is missing: install Debian's zookeeperd"
        );
        let mut command = Command::new("java");
        command
            .args(["-Xmx256m", "-cp", ZOOKEEPER_JAR])
            .arg(format!("-Dzookeeper.log.dir={}", self.dir.display()))
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(self.dir.join("zoo.cfg"));
        let log = self.dir.join("zookeeper.log");
        self.child = Some(spawn("ZooKeeper (java)", &mut command, &log));
        let started = Instant::now();
        while !self.answers().await {
            assert!(
                started.elapsed() < START_TIMEOUT,
                "ZooKeeper did not answer:\n{}",
                tail(&log)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether the server serves clients: `srvr` names its mode once it leads.
    async fn answers(&self) -> bool {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let Ok(mut stream) = tokio::net::TcpStream::connect(self.connect()).await else {
            return false;
        };
        if stream.write_all(b"srvr").await.is_err() {
            return false;
        }
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut answer));
        matches!(read.await, Ok(Ok(_))) && String::from_utf8_lossy(&answer).contains("Mode: leader")
    }

    /// kill -9 the server.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill(&mut child).await;
        }
    }

    /// Starts the server again on its data directory: sessions live on, and zxids
    /// continue in a new epoch (a new leader election).
    pub async fn restart(&mut self) {
        self.kill().await;
        self.run().await;
    }
}

impl Drop for ZooKeeper {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
