//! The Postgres door follows the primary of a multi-host `--database-url` with
//! `target_session_attrs=read-write`: throwaway primaries with streaming standbys, the
//! real gateway binary, and clients that connect through the door as they would to
//! Postgres.
//!
//! - With the standby named first, sessions land on the primary and write.
//! - After the primary is killed and the standby promoted, new sessions reach the new
//!   primary; a session on the old one gets an error, not a hang.
//! - A server that turns read-only ends its sessions with FATAL `08006`, at login or
//!   mid-session, counted and logged.
//! - A cancel request goes to the host of the session it cancels.
//! - With `sslmode=verify-full`, each host's certificate is checked against its own
//!   name.

use std::time::Duration;

use fencegate_tests::cluster::{psql, Cluster};
use fencegate_tests::eventually;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::tls::Certs;
use tokio_postgres::{Client, NoTls};

/// The gateway's backend deadline (`--backend-timeout`), in seconds: how long one
/// attempt to connect to a server, or one statement, may take before the gateway gives
/// up on that server.
const BACKEND_TIMEOUT_S: u64 = 2;

/// How long anything the door does may take here before the test fails: ten of the
/// gateway's attempts, each bounded by its backend deadline, for a machine busy with
/// other work.
const PATIENCE: Duration = Duration::from_secs(10 * BACKEND_TIMEOUT_S);

/// The message of the door's FATAL error for a server that is not the primary.
const NOT_PRIMARY: &str =
    "the database server is not the primary (a failover may be under way); connect again";

/// A primary with table `notes (id int PRIMARY KEY, note text)`, and its streaming
/// standby, which has replayed the table.
async fn primary_and_standby() -> (Cluster, Cluster) {
    let primary = Cluster::builder()
        .hba("host replication postgres 127.0.0.1/32 trust")
        .hba("host all all 127.0.0.1/32 scram-sha-256")
        .start()
        .await;
    primary
        .execute("CREATE TABLE notes (id int PRIMARY KEY, note text NOT NULL)")
        .await;
    let standby = primary.standby(primary.addr()).await;
    let replica = standby.client().await;
    eventually(PATIENCE, "the standby replays the table", || async {
        replica
            .query_one("SELECT to_regclass('notes') IS NOT NULL", &[])
            .await
            .is_ok_and(|row| row.get(0))
    })
    .await;
    (primary, standby)
}

/// The URL of `servers`, in this order, for the primary only.
fn url(servers: &[&Cluster]) -> String {
    let hosts: Vec<String> = servers.iter().map(|s| s.addr().to_string()).collect();
    format!(
        "postgres://postgres:{}@{}/postgres?target_session_attrs=read-write&connect_timeout=2",
        servers[0].password(),
        hosts.join(",")
    )
}

async fn gateway(url: &str) -> Gateway {
    Gateway::builder()
        .database(url)
        .args(&["--backend-timeout", &format!("{BACKEND_TIMEOUT_S}s")])
        .spawn()
        .await
}

/// The superuser's connection settings through the door of `gateway`.
fn through(gateway: &Gateway, cluster: &Cluster) -> tokio_postgres::Config {
    let mut config = tokio_postgres::Config::new();
    config
        .host("127.0.0.1")
        .port(gateway.pg_addr().port())
        .user("postgres")
        .password(cluster.password())
        .dbname("postgres")
        .connect_timeout(PATIENCE);
    config
}

async fn connect(config: &tokio_postgres::Config) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// The port of the server a session is on, and whether it is a standby.
async fn server_of(client: &Client) -> (i32, bool) {
    let row = client
        .query_one("SELECT inet_server_port(), pg_is_in_recovery()", &[])
        .await
        .expect("the session answers");
    (row.get(0), row.get(1))
}

/// The SQLSTATE and message of a database error.
fn code_and_message(error: &tokio_postgres::Error) -> (String, String) {
    let db = error
        .as_db_error()
        .unwrap_or_else(|| panic!("not a database error: {error}"));
    (db.code().code().to_owned(), db.message().to_owned())
}

async fn metric(gateway: &Gateway, series: &str) -> f64 {
    gateway.client().metric(series).await.unwrap_or(0.0)
}

#[tokio::test]
async fn with_the_standby_named_first_sessions_land_on_the_primary_and_write() {
    let (primary, standby) = primary_and_standby().await;
    let gateway = gateway(&url(&[&standby, &primary])).await;
    let config = through(&gateway, &primary);
    for id in 1..=3 {
        let client = connect(&config).await.expect("a session through the door");
        assert_eq!(
            server_of(&client).await,
            (i32::from(primary.port()), false),
            "session {id} is on the primary"
        );
        client
            .execute("INSERT INTO notes VALUES ($1, 'through the door')", &[&id])
            .await
            .expect("the primary takes the write");
    }
    // libpq, the reference client, the same way.
    let conninfo = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        gateway.pg_addr().port()
    );
    let out = psql(
        &conninfo,
        Some(primary.password()),
        &[
            "INSERT INTO notes VALUES (4, 'psql')",
            "SELECT count(*) FROM notes",
        ],
    )
    .await;
    assert_eq!(out.ok().lines().last(), Some("4"));
    assert_eq!(
        metric(&gateway, "fencegate_pg_not_primary_total{during=\"login\"}").await,
        0.0,
        "the standby was skipped before any session reached it"
    );
}

#[tokio::test]
async fn after_a_failover_new_sessions_reach_the_new_primary() {
    let (mut primary, standby) = primary_and_standby().await;
    let gateway = gateway(&url(&[&primary, &standby])).await;
    let config = through(&gateway, &primary);
    let old = connect(&config).await.expect("a session on the primary");
    assert_eq!(server_of(&old).await, (i32::from(primary.port()), false));
    old.execute("INSERT INTO notes VALUES (1, 'before')", &[])
        .await
        .unwrap();

    primary.kill().await;
    standby.promote().await;

    // The session on the old primary ends with an error, soon.
    let ended = tokio::time::timeout(PATIENCE, old.simple_query("SELECT 1"))
        .await
        .expect("the old session answers, not hangs");
    assert!(ended.is_err(), "the old primary is gone: {ended:?}");

    let client = connect(&config)
        .await
        .expect("a new session reaches the new primary");
    assert_eq!(server_of(&client).await, (i32::from(standby.port()), false));
    client
        .execute("INSERT INTO notes VALUES (2, 'after')", &[])
        .await
        .expect("the new primary takes the write");
    let switched = gateway.events("the Postgres door switched to another database host");
    assert_eq!(switched.len(), 1, "{:?}", gateway.logs());
    assert_eq!(
        switched[0]["fields"]["to"],
        standby.addr().to_string(),
        "{switched:?}"
    );
}

#[tokio::test]
async fn a_server_that_turns_read_only_ends_its_sessions() {
    let primary = Cluster::builder().start().await;
    primary
        .execute("CREATE TABLE notes (id int PRIMARY KEY, note text NOT NULL)")
        .await;
    let gateway = gateway(&url(&[&primary])).await;
    let config = through(&gateway, &primary);
    let session = connect(&config).await.expect("a session on the primary");
    session
        .execute("INSERT INTO notes VALUES (1, 'writable')", &[])
        .await
        .unwrap();

    // ALTER SYSTEM runs alone: a batch is one transaction.
    primary
        .execute("ALTER SYSTEM SET default_transaction_read_only = on")
        .await;
    primary.execute("SELECT pg_reload_conf()").await;

    // At login: the server says so before the session is handed over.
    eventually(PATIENCE, "a new session is refused at login", || async {
        match connect(&config).await {
            Ok(_) => false,
            Err(error) => {
                assert_eq!(
                    code_and_message(&error),
                    ("08006".to_owned(), NOT_PRIMARY.to_owned())
                );
                true
            }
        }
    })
    .await;
    assert_eq!(
        metric(&gateway, "fencegate_pg_not_primary_total{during=\"login\"}").await,
        1.0
    );

    // Mid-session: the server reports the change with its next answer, which the door
    // replaces with its FATAL error.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let error = loop {
        match tokio::time::timeout_at(deadline, session.simple_query("SELECT 1"))
            .await
            .expect("the session is ended within the patience")
        {
            Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(error) => break error,
        }
    };
    assert_eq!(
        code_and_message(&error),
        ("08006".to_owned(), NOT_PRIMARY.to_owned())
    );
    eventually(PATIENCE, "the door ends the session", || async {
        session.is_closed()
    })
    .await;
    assert_eq!(
        metric(
            &gateway,
            "fencegate_pg_not_primary_total{during=\"session\"}"
        )
        .await,
        1.0
    );
    let logged =
        gateway.events("Postgres door session ended: its database server is not the primary");
    let during: Vec<_> = logged
        .iter()
        .map(|e| e["fields"]["during"].clone())
        .collect();
    assert_eq!(during, ["login", "session"], "{logged:?}");

    // With no writable host, the door says so; once there is one again, sessions
    // resume.
    let refused = connect(&config).await.expect_err("no primary to reach");
    let (code, message) = code_and_message(&refused);
    assert_eq!(code, "08006");
    assert!(
        message.contains("no host is a reachable primary"),
        "{message}"
    );
    primary
        .execute("ALTER SYSTEM RESET default_transaction_read_only")
        .await;
    primary.execute("SELECT pg_reload_conf()").await;
    eventually(
        PATIENCE,
        "sessions resume on the writable server",
        || async {
            match connect(&config).await {
                Ok(client) => client
                    .execute("INSERT INTO notes VALUES (2, 'again')", &[])
                    .await
                    .is_ok(),
                Err(_) => false,
            }
        },
    )
    .await;
}

#[tokio::test]
async fn a_cancel_goes_to_the_host_of_its_session() {
    let (primary, standby) = primary_and_standby().await;
    let gateway = gateway(&url(&[&standby, &primary])).await;
    let config = through(&gateway, &primary);
    let sleeper = connect(&config).await.expect("a session on the primary");
    assert_eq!(
        server_of(&sleeper).await,
        (i32::from(primary.port()), false)
    );
    let cancel = sleeper.cancel_token();
    let sleeping = tokio::spawn(async move { sleeper.simple_query("SELECT pg_sleep(60)").await });
    let observer = primary.client().await;
    eventually(PATIENCE, "the sleep runs on the primary", || async {
        observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE query = 'SELECT pg_sleep(60)' AND state = 'active'",
                &[],
            )
            .await
            .is_ok_and(|row| row.get::<_, i64>(0) == 1)
    })
    .await;
    cancel
        .cancel_query(NoTls)
        .await
        .expect("the door takes the cancel request");
    let cancelled = tokio::time::timeout(PATIENCE, sleeping)
        .await
        .expect("cancelled well before its 60 s")
        .unwrap()
        .expect_err("the statement is cancelled");
    assert_eq!(code_and_message(&cancelled).0, "57014");
    assert_eq!(
        metric(
            &gateway,
            "fencegate_pg_cancels_total{outcome=\"forwarded\"}"
        )
        .await,
        1.0
    );
}

/// Two independent servers, each with a certificate for one name only: `localhost` for
/// the first, `127.0.0.1` for the second. When the first goes away, the door reaches the
/// second only if it checks that one's certificate against the second host's name.
#[tokio::test]
async fn with_verify_full_each_host_is_checked_against_its_own_name() {
    let certs = Certs::generate();
    let by_name = certs.server_for("DNS:localhost");
    let by_address = certs.server_for("IP:127.0.0.1");
    let tls = |cert: &fencegate_tests::tls::ClientCert| {
        Cluster::builder()
            .tls(&cert.cert, &cert.key, None)
            .hba("hostssl all all 127.0.0.1/32 scram-sha-256")
            .hba("hostnossl all all 127.0.0.1/32 reject")
    };
    let mut first = tls(&by_name).start().await;
    let second = tls(&by_address).start().await;
    // One URL, one password.
    second
        .execute(&format!(
            "ALTER ROLE postgres PASSWORD '{}'",
            first.password()
        ))
        .await;
    let url = format!(
        "postgres://postgres:{}@localhost:{},127.0.0.1:{}/postgres\
         ?sslmode=verify-full&sslrootcert={}&target_session_attrs=read-write&connect_timeout=2",
        first.password(),
        first.port(),
        second.port(),
        certs.ca.display()
    );
    let gateway = gateway(&url).await;
    let config = through(&gateway, &first);
    let client = connect(&config).await.expect("a session on the first host");
    assert_eq!(server_of(&client).await.0, i32::from(first.port()));

    first.kill().await;
    let client = connect(&config)
        .await
        .expect("a session on the second host, its certificate checked against 127.0.0.1");
    assert_eq!(server_of(&client).await.0, i32::from(second.port()));
    let encrypted: bool = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(encrypted);
}
