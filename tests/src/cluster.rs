//! A throwaway Postgres cluster of the test's own.
//!
//! For what the shared server must not see: its own `pg_hba.conf` (password, md5 and
//! SCRAM logins), and faults — a database that stops, crashes and comes back.
//!
//! [`Cluster::builder`] runs `initdb` of PostgreSQL 15 ([`BIN`]) into a fresh temp dir,
//! as the `postgres` OS user (tests run as root, which Postgres refuses), and starts it
//! with `pg_ctl` on a free loopback port. The superuser `postgres` has a random password
//! ([`Cluster::url`]), so a gateway logs in like any client. The harness itself connects
//! over the cluster's Unix socket, which only it can reach (the temp dir is `0700`): its
//! `pg_hba.conf` starts with `local all postgres trust`, then the test's lines, so
//! [`Cluster::execute`] works whatever the test's TCP rules are. The server is stopped
//! (`pg_ctl stop -m immediate`) and its directory removed when the value is dropped;
//! a test process killed outright leaves it running.
//!
//! [`ClusterBuilder::tls`] turns on the server's TLS with a certificate of the test's
//! ([`crate::tls::Certs`]).
//!
//! Settings are for speed, not durability: `fsync = off`. A crash of the server
//! ([`Cluster::kill`]) loses nothing, since the OS keeps what was written; only a crash
//! of the machine would.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::process::Command;
use tokio_postgres::{Client, NoTls};

/// Where PostgreSQL 15's server and client programs are.
pub const BIN: &str = "/usr/lib/postgresql/15/bin";

/// How long `pg_ctl` may wait for the server to start or stop.
const PG_CTL_TIMEOUT_SECS: &str = "60";

/// How long a [`psql`] run may take, connection included.
const PSQL_TIMEOUT: Duration = Duration::from_secs(30);

/// What a cluster is started with.
#[derive(Debug, Clone, Default)]
pub struct ClusterBuilder {
    hba: Vec<String>,
    settings: Vec<(String, String)>,
    tls: Option<ServerTls>,
}

/// The PEM files the server's TLS is made of.
#[derive(Debug, Clone)]
struct ServerTls {
    cert: PathBuf,
    key: PathBuf,
    client_ca: Option<PathBuf>,
}

impl ClusterBuilder {
    /// A `pg_hba.conf` line, after those given before (the first match decides).
    /// Without any, `host all all 127.0.0.1/32 scram-sha-256`.
    pub fn hba(mut self, line: &str) -> Self {
        self.hba.push(line.to_owned());
        self
    }

    /// A `postgresql.conf` setting, e.g. `("log_connections", "on")`; `value` is
    /// quoted as a string.
    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.settings.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Serves TLS (`ssl = on`) with the certificate `cert` and its key `key`, and with
    /// `client_ca`, asks clients for a certificate it signed (for `cert` lines of
    /// `pg_hba.conf`). The files are copied into the cluster's directory: Postgres
    /// must own its key. Whether plain connections are let in is for the `hba` lines
    /// (`hostssl`, `hostnossl`).
    pub fn tls(mut self, cert: &Path, key: &Path, client_ca: Option<&Path>) -> Self {
        self.tls = Some(ServerTls {
            cert: cert.to_owned(),
            key: key.to_owned(),
            client_ca: client_ca.map(Path::to_owned),
        });
        self
    }

    /// Creates the cluster and starts it; panics with the server's log if it cannot.
    pub async fn start(mut self) -> Cluster {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "fencegate-cluster-{}-{}-{:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        ));
        let password = format!("pw{:016x}", rand::random::<u64>());
        let mut cluster = Cluster {
            dir,
            port: 0,
            password,
            running: false,
        };
        // Postgres must own its directory; the `0700` also keeps others off its socket.
        let dir = path(&cluster.dir);
        as_postgres(&cluster.dir, &format!("mkdir -m 0700 {dir}"))
            .await
            .unwrap_or_else(|e| panic!("creating {dir}: {e}"));
        std::fs::write(cluster.dir.join("pwfile"), &cluster.password)
            .expect("the password file can be written");
        let initdb = format!(
            "{BIN}/initdb -D {dir}/data -U postgres --pwfile {dir}/pwfile --no-sync \
             --encoding=UTF8 --locale=C.UTF-8"
        );
        as_postgres(&cluster.dir, &initdb)
            .await
            .unwrap_or_else(|e| panic!("initdb failed: {e}"));
        let _ = std::fs::remove_file(cluster.dir.join("pwfile"));
        let data = cluster.dir.join("data");

        let mut hba = vec!["local all postgres trust".to_owned()];
        if self.hba.is_empty() {
            hba.push("host all all 127.0.0.1/32 scram-sha-256".to_owned());
        }
        hba.extend(self.hba);
        std::fs::write(data.join("pg_hba.conf"), hba.join("\n") + "\n")
            .expect("pg_hba.conf can be written");
        if let Some(tls) = &self.tls {
            let files = [
                ("ssl_cert_file", "server.crt", Some(&tls.cert)),
                ("ssl_key_file", "server.key", Some(&tls.key)),
                ("ssl_ca_file", "client-ca.crt", tls.client_ca.as_ref()),
            ];
            for (setting, name, from) in files {
                if let Some(from) = from {
                    let copy = owned_copy(&cluster.dir, from, &data.join(name));
                    self.settings.push((setting.to_owned(), copy));
                }
            }
            self.settings.push(("ssl".to_owned(), "on".to_owned()));
        }
        let mut conf = format!(
            "\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{dir}'\nfsync = off\n"
        );
        for (name, value) in &self.settings {
            conf.push_str(&format!("{name} = '{}'\n", value.replace('\'', "''")));
        }
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .expect("postgresql.conf can be opened");
        std::io::Write::write_all(&mut file, conf.as_bytes())
            .expect("postgresql.conf can be written");

        // The port was free a moment ago; if something took it since, take another.
        for attempt in 1..=3 {
            cluster.port = crate::free_port();
            match cluster.pg_ctl_start().await {
                Ok(()) => return cluster,
                Err(error) if attempt < 3 && error.contains("Address already in use") => {}
                Err(error) => panic!("the throwaway Postgres did not start: {error}"),
            }
        }
        unreachable!("the last attempt panics")
    }
}

/// A Postgres server of the test's own, stopped and removed when dropped.
pub struct Cluster {
    /// The temp dir: data in `data/`, the server log, the Unix socket.
    dir: PathBuf,
    port: u16,
    password: String,
    /// Whether the server was started and not stopped since: what `Drop` must stop.
    running: bool,
}

impl Cluster {
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        (Ipv4Addr::LOCALHOST, self.port).into()
    }

    /// The superuser's password.
    pub fn password(&self) -> &str {
        &self.password
    }

    /// The superuser's URL of database `postgres`, over TCP (the test's `pg_hba.conf`
    /// lines must let it in).
    pub fn url(&self) -> String {
        self.url_as("postgres", &self.password, "postgres")
    }

    /// The URL of `db` as `user` with `password`, over TCP. Names and password go in
    /// as they are, so they must not need escaping.
    pub fn url_as(&self, user: &str, password: &str, db: &str) -> String {
        for part in [user, password, db] {
            assert!(
                part.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.~".contains(c)),
                "{part:?} would need escaping in a URL"
            );
        }
        format!("postgres://{user}:{password}@{}/{db}", self.addr())
    }

    /// A superuser connection to database `postgres`, over the Unix socket.
    pub async fn client(&self) -> Client {
        let (client, connection) = tokio_postgres::Config::new()
            .host_path(&self.dir)
            .port(self.port)
            .user("postgres")
            .dbname("postgres")
            .connect(NoTls)
            .await
            .unwrap_or_else(|e| panic!("cannot reach the throwaway Postgres: {e}\n{}", self.log()));
        tokio::spawn(async move {
            let _ = connection.await;
        });
        client
    }

    /// Runs `sql` (one or more statements) as the superuser; panics with the SQL if it
    /// fails.
    pub async fn execute(&self, sql: &str) {
        self.client()
            .await
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// Shuts the server down cleanly (`pg_ctl stop -m fast`: sessions are ended, a
    /// checkpoint is written) and waits until it is down.
    pub async fn stop(&mut self) {
        self.pg_ctl_stop("fast").await;
    }

    /// Stops the server as a crash would (`pg_ctl stop -m immediate`: every process
    /// quits at once, no checkpoint; the next start recovers from the WAL).
    pub async fn kill(&mut self) {
        self.pg_ctl_stop("immediate").await;
    }

    /// Starts the server again, on the same port, after [`Cluster::stop`] or
    /// [`Cluster::kill`]. Panics with the log if it does not start (e.g. if another
    /// process took the port meanwhile).
    pub async fn start(&mut self) {
        assert!(!self.running, "the throwaway Postgres is already running");
        if let Err(error) = self.pg_ctl_start().await {
            panic!("the throwaway Postgres did not start again: {error}");
        }
    }

    /// A streaming standby of this server, started: a base backup taken through
    /// `upstream` (this server's address, or a proxy in front of it), which stays the
    /// address the standby streams from — so a test can cut replication there. This
    /// server's `pg_hba.conf` must let `postgres` in for replication from 127.0.0.1
    /// without a password (`host replication postgres 127.0.0.1/32 trust`).
    pub async fn standby(&self, upstream: SocketAddr) -> Cluster {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "fencegate-standby-{}-{}-{:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        ));
        let mut standby = Cluster {
            dir,
            port: 0,
            password: self.password.clone(),
            running: false,
        };
        let dir = path(&standby.dir);
        as_postgres(&standby.dir, &format!("mkdir -m 0700 {dir}"))
            .await
            .unwrap_or_else(|e| panic!("creating {dir}: {e}"));
        let backup = format!(
            "{BIN}/pg_basebackup -h {} -p {} -U postgres -D {dir}/data -R -X stream \
             --checkpoint=fast --no-sync",
            upstream.ip(),
            upstream.port()
        );
        as_postgres(&standby.dir, &backup)
            .await
            .unwrap_or_else(|e| panic!("pg_basebackup failed: {e}\nprimary log:\n{}", self.log()));
        let conf = format!("\nunix_socket_directories = '{dir}'\n");
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(standby.dir.join("data/postgresql.conf"))
            .expect("the standby's postgresql.conf can be opened");
        std::io::Write::write_all(&mut file, conf.as_bytes())
            .expect("the standby's postgresql.conf can be written");
        for attempt in 1..=3 {
            standby.port = crate::free_port();
            match standby.pg_ctl_start().await {
                Ok(()) => return standby,
                Err(error) if attempt < 3 && error.contains("Address already in use") => {}
                Err(error) => panic!("the standby did not start: {error}"),
            }
        }
        unreachable!("the last attempt panics")
    }

    /// Promotes a standby to a primary (`pg_ctl promote`), waiting until it accepts
    /// writes.
    pub async fn promote(&self) {
        let promote = format!(
            "{BIN}/pg_ctl promote -w -t {PG_CTL_TIMEOUT_SECS} -D {}/data",
            path(&self.dir)
        );
        as_postgres(&self.dir, &promote)
            .await
            .unwrap_or_else(|e| panic!("pg_ctl promote: {e}\nserver log:\n{}", self.log()));
    }

    /// `pg_ctl start`, waiting until the server accepts connections; the error holds
    /// the server's log.
    async fn pg_ctl_start(&mut self) -> Result<(), String> {
        let dir = path(&self.dir);
        let start = format!(
            "{BIN}/pg_ctl start -w -t {PG_CTL_TIMEOUT_SECS} -D {dir}/data -l {dir}/server.log \
             -o -p{}",
            self.port
        );
        match as_postgres(&self.dir, &start).await {
            Ok(()) => {
                self.running = true;
                Ok(())
            }
            Err(error) => Err(format!("{error}\nserver log:\n{}", self.log())),
        }
    }

    async fn pg_ctl_stop(&mut self, mode: &str) {
        let stop = format!(
            "{BIN}/pg_ctl stop -w -t {PG_CTL_TIMEOUT_SECS} -m {mode} -D {}/data",
            path(&self.dir)
        );
        as_postgres(&self.dir, &stop)
            .await
            .unwrap_or_else(|e| panic!("pg_ctl stop -m {mode}: {e}\nserver log:\n{}", self.log()));
        self.running = false;
    }
}

/// Lines of a server's log that a failing test prints.
const TAIL_LINES: usize = 40;

impl Drop for Cluster {
    /// Stops the server and removes its directory; in a test that is failing, prints the
    /// end of its log first (libtest shows a failing test's output).
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- postgres {} (port {}), its last {TAIL_LINES} log lines:\n{}",
                self.dir.display(),
                self.port,
                lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
            );
        }
        if self.running {
            let stop = format!(
                "{BIN}/pg_ctl stop -w -m immediate -D {}/data",
                self.dir.display()
            );
            let _ = std::process::Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .args(stop.split_whitespace())
                .current_dir(&self.dir)
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `command` (split at whitespace) as the `postgres` OS user in `cwd` (postgres
/// may not enter the test's own directory); the error holds the command and its output.
async fn as_postgres(cwd: &Path, command: &str) -> Result<(), String> {
    let cwd = if cwd.exists() { cwd } else { Path::new("/") };
    let output = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .args(command.split_whitespace())
        .current_dir(cwd)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| {
            format!("cannot run `runuser -u postgres -- {command}` (util-linux, PostgreSQL 15 and a `postgres` user are needed): {e}")
        })?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{command}` exited with {}:\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// Copies `from` to `to` for the server: owned by the owner of `dir` (the `postgres`
/// user), readable by it alone, as Postgres wants its key. Returns the copy's path.
fn owned_copy(dir: &Path, from: &Path, to: &Path) -> String {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let owner = std::fs::metadata(dir).expect("the cluster's directory exists");
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copying {} for the server: {e}", from.display()));
    std::os::unix::fs::chown(to, Some(owner.uid()), Some(owner.gid()))
        .unwrap_or_else(|e| panic!("giving {} to the server's user: {e}", to.display()));
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o600))
        .unwrap_or_else(|e| panic!("chmod 0600 {}: {e}", to.display()));
    path(to).to_owned()
}

/// `path` as text for a command line.
fn path(path: &Path) -> &str {
    let text = path.to_str().expect("temp paths are UTF-8");
    assert!(
        !text.contains(char::is_whitespace),
        "{text:?}: the temp dir (TMPDIR) must not contain spaces"
    );
    text
}

/// What a [`psql`] run printed, and whether it succeeded.
#[derive(Debug)]
pub struct Psql {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Psql {
    /// The output, trimmed; panics with the error if psql failed.
    pub fn ok(&self) -> &str {
        assert!(self.success, "psql failed:\n{}{}", self.stdout, self.stderr);
        self.stdout.trim()
    }

    /// The error output; panics if psql succeeded.
    pub fn failed(&self) -> &str {
        assert!(!self.success, "psql succeeded:\n{}", self.stdout);
        &self.stderr
    }
}

/// Runs `psql` — libpq, the reference client — of the same installation, connecting
/// with `conninfo` (e.g. `host=127.0.0.1 port=5432 user=x dbname=y sslmode=require`)
/// and `password` (`PGPASSWORD`), and running each of `commands` (`-c`). No psqlrc, no
/// password prompt, no environment but `PATH`, unaligned tuples-only output, a 10 s
/// connect timeout.
pub async fn psql(conninfo: &str, password: Option<&str>, commands: &[&str]) -> Psql {
    let mut command = Command::new(format!("{BIN}/psql"));
    command
        .args("-X -w -A -t -v ON_ERROR_STOP=1 -d".split(' '))
        .arg(conninfo)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("PGCONNECT_TIMEOUT", "10")
        .kill_on_drop(true);
    for sql in commands {
        command.args(["-c", sql]);
    }
    if let Some(password) = password {
        command.env("PGPASSWORD", password);
    }
    let output = tokio::time::timeout(PSQL_TIMEOUT, command.output())
        .await
        .unwrap_or_else(|_| panic!("psql {conninfo:?} {commands:?} took over {PSQL_TIMEOUT:?}"))
        .unwrap_or_else(|e| panic!("cannot run {BIN}/psql (PostgreSQL 15's client): {e}"));
    Psql {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}
