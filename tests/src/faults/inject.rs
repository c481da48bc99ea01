//! The faults a run injects below the writers: kill -9 of a Postgres postmaster and its
//! restart, and a network partition between a gateway and Postgres.
//!
//! # kill -9 of the postmaster
//!
//! [`crash_postmaster`] finds the postmaster of a throwaway cluster by its port in
//! `/proc`, sends it SIGKILL — alone, or with every backend at once, as when the whole
//! server dies: killed alone, the postmaster lets each backend finish the statement it
//! is running, so only the second way leaves commits without their answers — waits until the backends it leaves behind have noticed
//! and exited (Postgres refuses to start while they hold its shared memory), removes
//! its stale lock file, and starts it again with `pg_ctl` on the same data directory and port: the start
//! recovers from the WAL, as after a crash.
//!
//! # Partitions
//!
//! [`Netns`] is a network namespace joined to the host by two veth pairs: one for the
//! gateway's clients, one for its Postgres. [`Netns::partition`] adds blackhole routes
//! for the Postgres pair's addresses on both sides: packets vanish without an error,
//! as when a switch between two hosts dies, while the clients' pair still works.
//! [`Netns::heal`] removes them; TCP connections that survived retransmit.
//! Only `ip` (iproute2) is needed: neither `nft` nor `iptables`.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use tokio::process::Command;

use crate::cluster::BIN;

/// How long the backends of a killed postmaster may take to exit.
const ORPHANS_PATIENCE: Duration = Duration::from_secs(30);

/// The postmaster listening on `port`: its pid and data directory.
fn postmaster(port: u16) -> Option<(u32, PathBuf)> {
    let port_flag = format!("-p{port}");
    for proc_entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = proc_entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(proc_entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|arg| String::from_utf8_lossy(arg).into_owned())
            .collect();
        if args.first().is_some_and(|a| a.ends_with("/postgres")) && args.contains(&port_flag) {
            let data = args.iter().position(|a| a == "-D")?;
            return Some((pid, PathBuf::from(args.get(data + 1)?)));
        }
    }
    None
}

/// The processes whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| stat(*child).is_some_and(|(_, parent)| parent == pid))
        .collect()
}

/// A process's state letter and parent pid.
fn stat(pid: u32) -> Option<(char, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ppid ...; comm may hold spaces, so read after its ')'.
    let mut fields = text[text.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    let parent = fields.next()?.parse().ok()?;
    Some((state, parent))
}

fn alive(pid: u32) -> bool {
    stat(pid).is_some_and(|(state, _)| state != 'Z' && state != 'X')
}

/// Sends SIGKILL to the postmaster of the cluster on `port` (and with `backends`, to
/// every process it started), waits for its backends to exit and starts it again.
pub async fn crash_postmaster(port: u16, backends: bool) -> Result<(), String> {
    let (pid, data) = postmaster(port).ok_or(format!("no postmaster listens on port {port}"))?;
    let orphans = children(pid);
    crate::gateway::signal(pid, "KILL");
    if backends {
        for &orphan in &orphans {
            // One may have exited already.
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &orphan.to_string()])
                .output();
        }
    }
    let deadline = tokio::time::Instant::now() + ORPHANS_PATIENCE;
    while alive(pid) || orphans.iter().any(|&orphan| alive(orphan)) {
        if tokio::time::Instant::now() > deadline {
            return Err("the killed postmaster's backends did not exit".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let dir = data.parent().ok_or("the data directory has a parent")?;
    // The dead postmaster may stay a zombie for as long as nobody reaps it, and
    // Postgres takes a zombie's pid in its lock files for a live server: the locks
    // are stale once the process is dead, so they go.
    let _ = std::fs::remove_file(data.join("postmaster.pid"));
    let _ = std::fs::remove_file(dir.join(format!(".s.PGSQL.{port}.lock")));
    let start = format!(
        "{BIN}/pg_ctl start -w -t 60 -D {} -l {}/server.log -o -p{port}",
        data.display(),
        dir.display()
    );
    let output = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .args(start.split_whitespace())
        .current_dir(dir)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| format!("cannot run pg_ctl: {e}"))?;
    if !output.status.success() {
        let log = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
        return Err(format!(
            "Postgres did not start again after kill -9: {}{}\n{log}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}

/// A network namespace for one gateway, removed when dropped.
pub struct Netns {
    name: String,
    /// `10.a.b.0`: clients' pair `.1` (host) / `.2` (namespace), Postgres's pair `.5`
    /// (host) / `.6` (namespace).
    base: [u8; 3],
    partitioned: bool,
}

impl Netns {
    /// Creates the namespace and its two links. Needs root and iproute2.
    pub async fn create() -> Result<Netns, String> {
        let tag = format!("{:06x}", rand::random::<u32>() & 0xff_ffff);
        let base = [
            10,
            200 + rand::random::<u8>() % 50,
            (rand::random::<u8>() % 64) * 4,
        ];
        let netns = Netns {
            name: format!("fgf{tag}"),
            base,
            partitioned: false,
        };
        let name = &netns.name;
        ip(&["netns", "add", name]).await?;
        ip(&["-n", name, "link", "set", "lo", "up"]).await?;
        for (pair, host, inside) in [("c", 1, 2), ("d", 5, 6)] {
            let (outer, inner) = (format!("fg{pair}{tag}o"), format!("fg{pair}{tag}i"));
            ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ])
            .await?;
            ip(&["link", "set", &inner, "netns", name]).await?;
            let host_addr = format!("{}/30", netns.addr(host));
            ip(&["addr", "add", &host_addr, "dev", &outer]).await?;
            ip(&["link", "set", &outer, "up"]).await?;
            let inside_addr = format!("{}/30", netns.addr(inside));
            ip(&["-n", name, "addr", "add", &inside_addr, "dev", &inner]).await?;
            ip(&["-n", name, "link", "set", &inner, "up"]).await?;
        }
        Ok(netns)
    }

    fn addr(&self, last: u8) -> Ipv4Addr {
        Ipv4Addr::new(self.base[0], self.base[1], self.base[2], last)
    }

    /// The namespace's address on the clients' link: where its gateway listens.
    pub fn gateway_addr(&self) -> Ipv4Addr {
        self.addr(2)
    }

    /// The host's address on the Postgres link: where Postgres must listen.
    pub fn database_addr(&self) -> Ipv4Addr {
        self.addr(5)
    }

    /// The namespace's address on the Postgres link: what Postgres must let in.
    pub fn database_client_addr(&self) -> Ipv4Addr {
        self.addr(6)
    }

    /// The command prefix that runs a program inside the namespace.
    pub fn exec_prefix(&self) -> [String; 4] {
        ["ip", "netns", "exec", &self.name].map(str::to_owned)
    }

    /// Drops every packet between the namespace and Postgres, both ways.
    pub async fn partition(&mut self) -> Result<(), String> {
        self.routes("add").await?;
        self.partitioned = true;
        Ok(())
    }

    /// Lets packets through again.
    pub async fn heal(&mut self) -> Result<(), String> {
        if self.partitioned {
            self.routes("del").await?;
            self.partitioned = false;
        }
        Ok(())
    }

    async fn routes(&self, verb: &str) -> Result<(), String> {
        let to_database = format!("{}/32", self.database_addr());
        let to_gateway = format!("{}/32", self.database_client_addr());
        ip(&["-n", &self.name, "route", verb, "blackhole", &to_database]).await?;
        ip(&["route", verb, "blackhole", &to_gateway]).await
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if self.partitioned {
            let to_gateway = format!("{}/32", self.database_client_addr());
            let _ = std::process::Command::new("ip")
                .args(["route", "del", "blackhole", &to_gateway])
                .output();
        }
        // Deleting the namespace deletes its ends of the veth pairs, and with them
        // the host's ends.
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Runs `ip <args>`; the error names the command and what it printed.
pub(crate) async fn ip(args: &[&str]) -> Result<(), String> {
    ip_output(args).await.map(drop)
}

/// Runs `ip <args>`: what it printed, or an error naming the command.
pub(crate) async fn ip_output(args: &[&str]) -> Result<String, String> {
    let output = Command::new("ip")
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| format!("cannot run `ip` (iproute2 is needed, as root): {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}
