//! The Postgres door with the clients writers use: psql, pgbench, psycopg 3, asyncpg,
//! node-postgres and pgjdbc. Each driver's script (`tests/clients/`, installed by
//! `tests/clients/install.sh`) runs its scenarios through the door and checks every
//! answer itself; the same scripts pass against Postgres directly.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use fencegate_tests::door::SweeperDoor;
use fencegate_tests::tls::Certs;
use tokio::process::Command;

/// How long one client's whole run may take.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("clients")
}

/// Runs `program args` with `env`, failing loudly if it cannot start or runs too long.
async fn run(program: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(program);
    command.args(args).kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    let output = tokio::time::timeout(CLIENT_TIMEOUT, command.output())
        .await
        .unwrap_or_else(|_| panic!("{program} {args:?} ran longer than {CLIENT_TIMEOUT:?}"))
        .unwrap_or_else(|e| {
            panic!("{program} cannot run ({e}); tests/clients/install.sh installs the clients")
        });
    output
}

fn text(output: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Runs a driver's script through the door on a fresh fixture: every check passes, and
/// the stale rejections it provoked are counted and logged by the gateway.
async fn script_passes(program: &str, script: &[&str]) {
    let door = SweeperDoor::start().await;
    script_passes_through(&door, program, script, &[]).await;
}

async fn script_passes_through(
    door: &SweeperDoor,
    program: &str,
    script: &[&str],
    env: &[(&str, &str)],
) {
    let dsn = door.writer_url();
    let mut env = env.to_vec();
    env.push(("FENCEGATE_CLIENT_DSN", &dsn));
    let output = run(program, script, &env).await;
    let report = text(&output);
    assert!(output.status.success(), "{report}");
    let last = String::from_utf8_lossy(&output.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned();
    assert!(
        last.starts_with("ok ") && last.ends_with(" checks"),
        "{report}"
    );
    let counted = door
        .metric("fencegate_stale_rejections_total{resource=\"sweeper\"}")
        .await;
    assert!(counted >= 2.0, "rejections counted: {counted}\n{report}");
    let logged = door.gateway.events("stale write rejected");
    assert!(
        logged.iter().all(|event| event["fields"]["door"] == "pg")
            && logged.iter().any(|event| {
                event["fields"]["presented"] == 41 && event["fields"]["highest"] == 42
            }),
        "{logged:?}"
    );
}

fn script(relative: &str) -> String {
    clients_dir().join(relative).display().to_string()
}

#[tokio::test]
async fn psycopg() {
    script_passes("python3", &[&script("python/check_psycopg.py")]).await;
}

/// psycopg's libpq (17 or later) over the door's TLS: after an SSLRequest, and direct
/// (`sslnegotiation=direct`, ALPN `postgresql`), with the certificate verified.
#[tokio::test]
async fn psycopg_over_tls() {
    let certs = Certs::generate();
    let (cert, key) = (
        certs.cert.display().to_string(),
        certs.key.display().to_string(),
    );
    let door = SweeperDoor::start_with(&["--pg-tls-cert", &cert, "--pg-tls-key", &key]).await;
    let ca = certs.ca.display().to_string();
    script_passes_through(
        &door,
        "python3",
        &[&script("python/check_psycopg.py")],
        &[("FENCEGATE_CLIENT_TLS_ROOT", &ca)],
    )
    .await;
}

#[tokio::test]
async fn asyncpg() {
    script_passes("python3", &[&script("python/check_asyncpg.py")]).await;
}

#[tokio::test]
async fn node_postgres() {
    script_passes("node", &[&script("node/check_pg.js")]).await;
}

#[tokio::test]
async fn pgjdbc() {
    script_passes(
        "java",
        &[
            "-cp",
            "/usr/share/java/postgresql.jar",
            &script("java/CheckPgjdbc.java"),
        ],
    )
    .await;
}

/// psql with the token in PGOPTIONS: the current term writes, the old one gets the
/// fence's error with its SQLSTATE, DETAIL and HINT.
#[tokio::test]
async fn psql() {
    let door = SweeperDoor::start().await;
    let url = door.writer_url();
    let psql = |token: &'static str, note: &'static str| {
        let url = url.clone();
        async move {
            let sql = format!("UPDATE sweep_state SET note = '{note}' WHERE id = 1");
            let options = format!("-c fencegate.token={token}");
            run(
                "psql",
                &[
                    "-X",
                    "-v",
                    "ON_ERROR_STOP=1",
                    "-v",
                    "VERBOSITY=verbose",
                    &url,
                    "-c",
                    &sql,
                ],
                &[("PGOPTIONS", &options)],
            )
            .await
        }
    };
    let current = psql("42", "node-b").await;
    assert!(current.status.success(), "{}", text(&current));
    let stale = psql("41", "node-a").await;
    assert!(!stale.status.success(), "{}", text(&stale));
    let stderr = String::from_utf8_lossy(&stale.stderr);
    for expected in [
        "ERROR:  ZF001",
        "DETAIL:  resource=sweeper presented=41 highest=42",
        "HINT:",
    ] {
        assert!(stderr.contains(expected), "{expected:?} in {stderr}");
    }
    assert_eq!(door.note().await, "node-b");
}

/// pgbench through the door in each query mode: its own tables loaded with COPY, then
/// fenced transactions; every transaction succeeds. Then a stale token: every
/// transaction fails, and the gateway counts them.
#[tokio::test]
async fn pgbench() {
    let door = SweeperDoor::start().await;
    let addr = door.addr();
    let (host, port) = (addr.ip().to_string(), addr.port().to_string());
    let database = door.db.db.name().to_owned();
    let pgbench = |args: Vec<String>, options: &'static str| {
        let (host, port, database) = (host.clone(), port.clone(), database.clone());
        async move {
            let mut all = vec![
                "-h".to_owned(),
                host,
                "-p".to_owned(),
                port,
                "-U".to_owned(),
                "postgres".to_owned(),
            ];
            all.extend(args);
            all.push(database);
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            run("pgbench", &all, &[("PGOPTIONS", options)]).await
        }
    };
    let init = pgbench(vec!["-i".into(), "-q".into()], "").await;
    assert!(init.status.success(), "{}", text(&init));
    door.db.protect("pgbench_accounts", "bench").await;

    let script = std::env::temp_dir().join(format!("fenced-update-{}.sql", std::process::id()));
    std::fs::write(
        &script,
        "\\set aid random(1, 100000)\n\
         BEGIN;\n\
         SELECT fencegate.fence('bench', 5);\n\
         UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n\
         COMMIT;\n",
    )
    .unwrap();
    let script = script.display().to_string();
    for mode in ["simple", "extended", "prepared"] {
        let run = pgbench(
            [
                "-n", "-c", "2", "-j", "2", "-t", "50", "-M", mode, "-f", &script,
            ]
            .map(str::to_owned)
            .to_vec(),
            "",
        )
        .await;
        let report = text(&run);
        assert!(run.status.success(), "{mode}: {report}");
        assert!(
            report.contains("number of transactions actually processed: 100/100"),
            "{mode}: {report}"
        );
    }
    let balance: i64 = door
        .db
        .db
        .value("SELECT sum(abalance)::bigint FROM pgbench_accounts")
        .await;
    assert_eq!(balance, 300, "each of the 300 transactions added 1");

    // A newer term, then the old one's token for the whole session: refused.
    door.db.raise("bench", 6).await;
    let stale = pgbench(
        [
            "-n",
            "-c",
            "1",
            "-t",
            "5",
            "-M",
            "prepared",
            "-b",
            "simple-update",
        ]
        .map(str::to_owned)
        .to_vec(),
        "-c fencegate.token=5",
    )
    .await;
    assert!(!stale.status.success(), "{}", text(&stale));
    assert!(
        String::from_utf8_lossy(&stale.stderr)
            .contains("DETAIL:  resource=bench presented=5 highest=6"),
        "{}",
        text(&stale)
    );
    assert!(
        door.metric("fencegate_stale_rejections_total{resource=\"bench\"}")
            .await
            >= 1.0
    );
    let _ = std::fs::remove_file(&script);
}
