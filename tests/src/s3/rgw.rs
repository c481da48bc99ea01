//! A throwaway S3 server: a single-node Ceph cluster (one `ceph-mon`, one `ceph-osd` on
//! memstore) with `radosgw` in front of it, in a temp directory of its own, on free
//! loopback ports, killed and removed when dropped.
//!
//! # Start-up
//!
//! Every key is made up front and imported into the monitor when its store is created,
//! so no daemon waits on an `auth` round trip. The monitor commits every few
//! milliseconds (`paxos propose interval`, `paxos min wait`): with the defaults (1 s)
//! the cluster takes over ten seconds to start and the first bucket and the first PUT
//! each stall for seconds. Pools are one replica on one OSD, with few placement
//! groups. Data lives in the OSD's memory: keep test objects small.
//!
//! The server is ready when radosgw answers a signed S3 request (ListBuckets) with 200.
//! If a daemon exits or a tool fails on the way, the start panics with the tail of
//! every daemon's log, and the directory is kept for a look at the rest.
//!
//! Needs Debian's `ceph-mon`, `ceph-osd`, `radosgw` and `ceph-common`; fails, never
//! skips, without them.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::time::Instant;

use super::client::S3Client;

/// How long the cluster may take to answer S3 requests (2–3 s on an idle machine).
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// How long one set-up command (`ceph osd new`, `radosgw-admin user create`) may run.
const TOOL_TIMEOUT: Duration = Duration::from_secs(60);

/// Lines of each log a failure shows.
const TAIL_LINES: usize = 30;

/// The user every request is signed as.
const USER: &str = "fencegate-test";

/// A running radosgw over its own single-node Ceph cluster.
pub struct Radosgw {
    dir: PathBuf,
    port: u16,
    access_key: String,
    secret_key: String,
    daemons: Vec<Daemon>,
    started_in: Duration,
    /// Set when the start failed: the directory stays for a look at the full logs.
    keep_dir: AtomicBool,
}

/// A daemon in the foreground, its output in `<name>.out` and its own log in
/// `<name>.log`.
struct Daemon {
    name: &'static str,
    child: Child,
}

impl Radosgw {
    /// Starts a cluster in a fresh temp directory and waits until radosgw answers S3
    /// requests signed with [`Radosgw::access_key`].
    pub async fn start() -> Radosgw {
        let started = Instant::now();
        let dir = std::env::temp_dir().join(format!(
            "fencegate-rgw-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        for sub in ["run", "mon.a", "osd.0", "rgw"] {
            let path = dir.join(sub);
            std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        let mut rgw = Radosgw {
            port: crate::free_port(),
            access_key: random_key(20, b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"),
            secret_key: random_key(
                40,
                b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789",
            ),
            dir,
            daemons: Vec::new(),
            started_in: Duration::ZERO,
            keep_dir: AtomicBool::new(false),
        };
        rgw.run().await;
        rgw.started_in = started.elapsed();
        rgw
    }

    /// `http://127.0.0.1:<port>`, for path-style requests.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn access_key(&self) -> &str {
        &self.access_key
    }

    pub fn secret_key(&self) -> &str {
        &self.secret_key
    }

    /// A client that signs as the cluster's user.
    pub fn client(&self) -> S3Client {
        S3Client::new(self.endpoint(), &self.access_key, &self.secret_key)
    }

    /// From an empty directory to radosgw answering.
    pub fn start_time(&self) -> Duration {
        self.started_in
    }

    /// The radosgw process's id, while it runs.
    pub fn gateway_pid(&self) -> Option<u32> {
        self.daemons
            .iter()
            .find(|daemon| daemon.name == "client.rgw")
            .and_then(|daemon| daemon.child.id())
    }

    /// The ids of every daemon of the cluster (monitor, OSD, radosgw).
    pub fn pids(&self) -> Vec<u32> {
        self.daemons
            .iter()
            .filter_map(|daemon| daemon.child.id())
            .collect()
    }

    /// Kills radosgw alone (SIGKILL), leaving the cluster and its objects; the S3
    /// endpoint refuses connections until [`Radosgw::start_gateway`].
    pub async fn stop_gateway(&mut self) {
        let at = self
            .daemons
            .iter()
            .position(|daemon| daemon.name == "client.rgw")
            .expect("radosgw runs");
        let mut daemon = self.daemons.remove(at);
        let _ = daemon.child.start_kill();
        let _ = daemon.child.wait().await;
    }

    /// Starts radosgw again on the same port and waits until it answers.
    pub async fn start_gateway(&mut self) {
        let conf = self.conf();
        let c = conf.to_str().expect("temp paths are UTF-8").to_owned();
        self.spawn(
            "client.rgw",
            "radosgw",
            &["-c", &c, "-n", "client.rgw", "-f"],
        );
        self.wait_answers().await;
    }

    fn conf(&self) -> PathBuf {
        self.dir.join("ceph.conf")
    }

    async fn run(&mut self) {
        let mon_port = crate::free_port();
        let fsid = uuid();
        let osd_uuid = uuid();
        let conf = self.conf();
        std::fs::write(&conf, ceph_conf(&self.dir, &fsid, mon_port, self.port))
            .unwrap_or_else(|e| panic!("{}: {e}", conf.display()));

        let keyring = self.dir.join("keyring");
        let keyring = keyring.to_str().expect("temp paths are UTF-8");
        self.tool("ceph-authtool", &["--create-keyring", keyring])
            .await;
        for (name, caps) in KEYS {
            let mut args = vec![keyring, "--gen-key", "-n", name];
            for (service, cap) in *caps {
                args.extend(["--cap", service, cap]);
            }
            self.tool("ceph-authtool", &args).await;
        }
        let monmap = self.dir.join("monmap");
        let monmap = monmap.to_str().expect("temp paths are UTF-8");
        let mon_addr = format!("[v2:127.0.0.1:{mon_port}]");
        self.tool(
            "monmaptool",
            &[
                "--create",
                "--enable-all-features",
                "--set-min-mon-release",
                "16",
                "--addv",
                "a",
                &mon_addr,
                "--fsid",
                &fsid,
                monmap,
            ],
        )
        .await;
        let conf = conf.to_str().expect("temp paths are UTF-8").to_owned();
        let c = conf.as_str();
        self.tool(
            "ceph-mon",
            &[
                "-c",
                c,
                "--mkfs",
                "-i",
                "a",
                "--monmap",
                monmap,
                "--keyring",
                keyring,
            ],
        )
        .await;
        self.spawn("mon.a", "ceph-mon", &["-c", c, "-i", "a", "-f"]);

        // The OSD's id and uuid are registered before its store is made, so it boots
        // straight into the map.
        self.tool("ceph", &["-c", c, "osd", "new", &osd_uuid, "0"])
            .await;
        self.tool(
            "ceph-osd",
            &["-c", c, "-i", "0", "--mkfs", "--osd-uuid", &osd_uuid],
        )
        .await;
        self.spawn("osd.0", "ceph-osd", &["-c", c, "-i", "0", "-f"]);
        self.spawn(
            "client.rgw",
            "radosgw",
            &["-c", c, "-n", "client.rgw", "-f"],
        );
        let (access_key, secret_key) = (self.access_key.clone(), self.secret_key.clone());
        // radosgw-admin waits for the pools radosgw creates, so it runs alongside.
        self.tool(
            "radosgw-admin",
            &[
                "-c",
                c,
                "user",
                "create",
                "--uid",
                USER,
                "--display-name",
                USER,
                "--access-key",
                &access_key,
                "--secret",
                &secret_key,
            ],
        )
        .await;

        self.wait_answers().await;
    }

    /// Waits until radosgw answers a signed ListBuckets.
    async fn wait_answers(&mut self) {
        let client = self.client();
        let started = Instant::now();
        loop {
            self.check_daemons();
            let answer = client
                .try_request_path(http::Method::GET, "/", &[], "")
                .await;
            match answer {
                Ok(reply) if reply.status == 200 => return,
                Ok(reply) if started.elapsed() > START_TIMEOUT => self.fail(&format!(
                    "radosgw answers ListBuckets with {}: {}",
                    reply.status,
                    String::from_utf8_lossy(&reply.body)
                )),
                Err(e) if started.elapsed() > START_TIMEOUT => {
                    self.fail(&format!("radosgw does not answer on {}: {e}", self.port))
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Starts `program` in the foreground in a process group of its own.
    fn spawn(&mut self, name: &'static str, program: &str, args: &[&str]) {
        let out = self.dir.join(format!("{name}.out"));
        let file = std::fs::File::create(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
        let err = file.try_clone().expect("a log file can be duplicated");
        let child = Command::new(program)
            .args(args)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| self.fail(&format!("cannot start {program}: {e}{}", INSTALL)));
        self.daemons.push(Daemon { name, child });
    }

    /// Runs a set-up command to its end; fails the start if it fails.
    async fn tool(&mut self, program: &str, args: &[&str]) {
        self.check_daemons();
        let run = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let output = match tokio::time::timeout(TOOL_TIMEOUT, run).await {
            Err(_) => self.fail(&format!(
                "{program} {} ran for over {TOOL_TIMEOUT:?}",
                args.join(" ")
            )),
            Ok(Err(e)) => self.fail(&format!("cannot run {program}: {e}{INSTALL}")),
            Ok(Ok(output)) => output,
        };
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            // A monitor port taken by another cluster between `free_port` and the bind
            // shows up as a refused key, not as a port clash.
            let hint = if stderr.contains("Permission denied") {
                "\n(a permission error from a monitor can mean another cluster holds its port)"
            } else {
                ""
            };
            self.fail(&format!(
                "{program} {} failed ({}):\n{}{stderr}{hint}",
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stdout),
            ));
        }
    }

    /// Fails the start if a daemon has exited.
    fn check_daemons(&mut self) {
        let exited = self.daemons.iter_mut().find_map(|daemon| {
            let status = daemon.child.try_wait().ok().flatten()?;
            Some(format!("{} exited ({status})", daemon.name))
        });
        if let Some(exited) = exited {
            self.fail(&exited);
        }
    }

    /// Panics with `what` and the tail of every daemon's logs.
    fn fail(&self, what: &str) -> ! {
        let mut logs = String::new();
        for name in ["mon.a", "osd.0", "client.rgw"] {
            for ext in ["out", "log"] {
                let path = self.dir.join(format!("{name}.{ext}"));
                let tail = tail(&path);
                if !tail.is_empty() {
                    let _ = write!(logs, "\n--- {}:\n{tail}", path.display());
                }
            }
        }
        self.keep_dir.store(true, Ordering::Relaxed);
        panic!(
            "the Ceph cluster for radosgw did not start: {what}\n(its files stay in {}){logs}",
            self.dir.display()
        );
    }
}

impl Drop for Radosgw {
    fn drop(&mut self) {
        // SIGKILL: the cluster is thrown away, and a clean stop takes seconds.
        for daemon in &mut self.daemons {
            let _ = daemon.child.start_kill();
        }
        if !self.keep_dir.load(Ordering::Relaxed) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// What a failure to find a Ceph program adds.
const INSTALL: &str =
    " (Debian: apt-get install ceph-mon ceph-osd radosgw ceph-common; .ci/run installs them)";

/// Every key of the cluster with its capabilities, made before the monitor exists.
const KEYS: &[(&str, &[(&str, &str)])] = &[
    ("mon.", &[("mon", "allow *")]),
    (
        "client.admin",
        &[("mon", "allow *"), ("osd", "allow *"), ("mgr", "allow *")],
    ),
    (
        "osd.0",
        &[
            ("mon", "allow profile osd"),
            ("osd", "allow *"),
            ("mgr", "allow profile osd"),
        ],
    ),
    (
        "client.rgw",
        &[
            ("mon", "allow rw"),
            ("osd", "allow rwx"),
            ("mgr", "allow rw"),
        ],
    ),
];

/// The cluster's configuration: everything on 127.0.0.1 over msgr2 only, one replica,
/// fast paxos, memstore, and every file under `dir`.
fn ceph_conf(dir: &Path, fsid: &str, mon_port: u16, rgw_port: u16) -> String {
    let dir = dir.display();
    format!(
        "[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = {dir}/keyring
run dir = {dir}/run
admin socket = {dir}/run/$name.asok
log file = {dir}/$name.log
mon data = {dir}/$name
osd data = {dir}/$name
osd objectstore = memstore
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
paxos propose interval = 0.1
paxos min wait = 0.01

[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw data = {dir}/rgw
"
    )
}

fn uuid() -> String {
    let b: [u8; 16] = rand::random();
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
        u16::from_be_bytes([b[4], b[5]]),
        u16::from_be_bytes([b[6], b[7]]) & 0x0fff,
        (u16::from_be_bytes([b[8], b[9]]) & 0x3fff) | 0x8000,
        u64::from_be_bytes([0, 0, b[10], b[11], b[12], b[13], b[14], b[15]]),
    )
}

fn random_key(len: usize, alphabet: &[u8]) -> String {
    (0..len)
        .map(|_| alphabet[rand::random_range(0..alphabet.len())] as char)
        .collect()
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
}
