//! The Postgres door relays authentication message by message: the server's
//! `pg_hba.conf` decides, and the gateway stores no password. A throwaway cluster asks
//! each role for a different method — SCRAM-SHA-256, md5, a cleartext password — and
//! clients log in through the door with libpq (psql) and tokio-postgres. A wrong
//! password reaches the client as the server's own FATAL 28P01, and is counted.

use std::time::Duration;

use fencegate_tests::cluster::{psql, Cluster};
use fencegate_tests::eventually;
use fencegate_tests::gateway::Gateway;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};

/// Roles of the cluster, each admitted by the `pg_hba.conf` method it is named after.
const SCRAM: &str = "scram_user";
const MD5: &str = "md5_user";
const PASSWORD: &str = "password_user";

/// Every role's password.
const SECRET: &str = "door-s3cret";

/// How long a login through the door may take.
const LOGIN_TIMEOUT: Duration = Duration::from_secs(30);

/// A throwaway cluster with one role per method, and a gateway whose door leads to it.
struct Door {
    cluster: Cluster,
    gateway: Gateway,
}

async fn door() -> Door {
    let cluster = Cluster::builder()
        .hba(&format!("host all {MD5} 127.0.0.1/32 md5"))
        .hba(&format!("host all {PASSWORD} 127.0.0.1/32 password"))
        .hba("host all all 127.0.0.1/32 scram-sha-256")
        // Logs the method that admitted each session: proof of which one ran.
        .setting("log_connections", "on")
        .start()
        .await;
    // The md5 role's password is stored as md5: against a SCRAM secret, an md5 line
    // runs SCRAM instead.
    cluster
        .execute(&format!(
            "CREATE ROLE {SCRAM} LOGIN PASSWORD '{SECRET}';
             CREATE ROLE {PASSWORD} LOGIN PASSWORD '{SECRET}';
             SET password_encryption = 'md5';
             CREATE ROLE {MD5} LOGIN PASSWORD '{SECRET}';"
        ))
        .await;
    // The gateway logs in with the superuser's password, by SCRAM, like any client.
    let gateway = Gateway::builder().database(&cluster.url()).spawn().await;
    Door { cluster, gateway }
}

impl Door {
    /// libpq's connection string for `role` through the door.
    fn conninfo(&self, role: &str) -> String {
        let addr = self.gateway.pg_addr();
        format!(
            "host={} port={} user={role} dbname=postgres",
            addr.ip(),
            addr.port()
        )
    }

    /// Logs in through the door with tokio-postgres.
    async fn connect(&self, role: &str, password: &str) -> Result<Client, tokio_postgres::Error> {
        let addr = self.gateway.pg_addr();
        let mut config = tokio_postgres::Config::new();
        config
            .host(addr.ip().to_string())
            .port(addr.port())
            .user(role)
            .password(password)
            .dbname("postgres");
        let (client, connection) = tokio::time::timeout(LOGIN_TIMEOUT, config.connect(NoTls))
            .await
            .unwrap_or_else(|_| panic!("logging in as {role} took over {LOGIN_TIMEOUT:?}"))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }

    async fn metric(&self, name: &str) -> f64 {
        self.gateway.client().metric(name).await.unwrap_or(0.0)
    }

    /// Waits until the door's counters read `sessions` and `failures`: a session is
    /// counted just after its ReadyForQuery is relayed, so the client may be first.
    async fn assert_counted(&self, sessions: f64, failures: f64) {
        let what = format!("{sessions} sessions and {failures} authentication failures");
        eventually(Duration::from_secs(10), &what, || async {
            self.metric("fencegate_pg_sessions_total").await == sessions
                && self.metric("fencegate_pg_auth_failures_total").await == failures
        })
        .await;
    }
}

async fn current_user(client: &Client) -> String {
    client
        .query_one("select current_user::text", &[])
        .await
        .expect("the session answers")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_md5_and_password_logins_are_relayed() {
    let door = door().await;
    for (role, method) in [
        (SCRAM, "scram-sha-256"),
        (MD5, "md5"),
        (PASSWORD, "password"),
    ] {
        let out = psql(&door.conninfo(role), Some(SECRET), &["select current_user"]).await;
        assert_eq!(out.ok(), role, "psql as {role}");
        let admitted = format!("connection authenticated: identity=\"{role}\" method={method}");
        assert!(
            door.cluster.log().contains(&admitted),
            "the server admitted {role} by {method}; its log:\n{}",
            door.cluster.log()
        );
    }
    door.assert_counted(3.0, 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authenticated_session_runs_queries() {
    let door = door().await;
    let client = door
        .connect(SCRAM, SECRET)
        .await
        .expect("SCRAM login through the door");
    let one: i32 = client
        .query_one("select 1", &[])
        .await
        .expect("select 1 runs")
        .get(0);
    assert_eq!(one, 1);
    // The extended protocol too: Parse, Bind, Execute with a parameter.
    let sum: i32 = client
        .query_one("select $1::int + 1", &[&41i32])
        .await
        .expect("a prepared statement runs")
        .get(0);
    assert_eq!(sum, 42);
    assert_eq!(current_user(&client).await, SCRAM);
    door.assert_counted(1.0, 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_passwords_are_the_servers_28p01_and_are_counted() {
    let door = door().await;
    let bystander = door
        .connect(SCRAM, SECRET)
        .await
        .expect("a session already open");
    for role in [SCRAM, MD5, PASSWORD] {
        let error = match door.connect(role, "wrong-password").await {
            Ok(_) => panic!("{role} logged in with a wrong password"),
            Err(error) => error,
        };
        let db = error
            .as_db_error()
            .unwrap_or_else(|| panic!("{role}: not the server's error: {error:?}"));
        assert_eq!(db.code(), &SqlState::INVALID_PASSWORD, "{role}: {db:?}");
        assert_eq!(db.severity(), "FATAL", "{role}: {db:?}");
    }
    // libpq shows the server's own message.
    let out = psql(&door.conninfo(MD5), Some("wrong-password"), &["select 1"]).await;
    assert!(
        out.failed().contains(&format!(
            "password authentication failed for user \"{MD5}\""
        )),
        "{}",
        out.stderr
    );

    // Nothing else broke: the open session and new logins work.
    assert_eq!(current_user(&bystander).await, SCRAM);
    for role in [SCRAM, MD5, PASSWORD] {
        let client = door
            .connect(role, SECRET)
            .await
            .expect("a right password still works");
        assert_eq!(current_user(&client).await, role);
    }
    door.assert_counted(4.0, 4.0).await;
    drop(bystander);
    eventually(
        Duration::from_secs(10),
        "every door connection closed",
        || async { door.metric("fencegate_pg_connections").await == 0.0 },
    )
    .await;
}
