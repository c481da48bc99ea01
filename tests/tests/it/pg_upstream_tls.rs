//! TLS from the gateway to Postgres, as the `sslmode` of each database URL asks: the
//! store's pools, the `/v1/sql` pool, the administrative commands and the Postgres
//! door's upstream leg. A throwaway cluster serves TLS with a certificate for
//! `localhost` and `127.0.0.1` from a test CA, and its `pg_hba.conf` lets in TLS
//! sessions only (`hostnossl ... reject`): a connection that is not encrypted is refused
//! by Postgres itself, and `pg_stat_ssl` shows what each session is.

use std::process::Command;

use fencegate_tests::cluster::{psql, Cluster};
use fencegate_tests::gateway::{binary, Gateway, GatewayBuilder};
use fencegate_tests::tls::Certs;
use serde_json::json;
use tokio_postgres::NoTls;

/// The login of the `/v1/sql` pool, and its password.
const SQL_LOGIN: &str = "sql_writer";
const SQL_PASSWORD: &str = "sql-s3cret";

/// A role that logs in with a client certificate (`cert` in pg_hba.conf).
const CERT_LOGIN: &str = "cert_login";

/// A cluster that speaks TLS only, with the server certificate of `certs`; client
/// certificates signed by the same CA log in as their common name.
async fn tls_only_cluster(certs: &Certs) -> Cluster {
    let cluster = Cluster::builder()
        .tls(&certs.cert, &certs.key, Some(&certs.ca))
        .hba(&format!("hostssl all {CERT_LOGIN} 127.0.0.1/32 cert"))
        .hba("hostssl all all 127.0.0.1/32 scram-sha-256")
        .hba("hostnossl all all 127.0.0.1/32 reject")
        .start()
        .await;
    cluster
        .execute(&format!(
            "CREATE ROLE {SQL_LOGIN} LOGIN PASSWORD '{SQL_PASSWORD}';
             CREATE ROLE {CERT_LOGIN} LOGIN SUPERUSER;
             CREATE TABLE notes (id int PRIMARY KEY, body text NOT NULL);
             GRANT SELECT, INSERT, UPDATE ON notes TO {SQL_LOGIN};"
        ))
        .await;
    cluster
}

/// The superuser's URL of the cluster by `host`, with `params` (e.g.
/// `sslmode=verify-full&sslrootcert=/ca.pem`).
fn url(cluster: &Cluster, host: &str, params: &str) -> String {
    format!(
        "postgres://postgres:{}@{host}:{}/postgres?{params}",
        cluster.password(),
        cluster.port()
    )
}

/// `sslmode=verify-full` against `ca`.
fn verify_full(ca: &Certs) -> String {
    format!("sslmode=verify-full&sslrootcert={}", ca.ca.display())
}

fn gateway(database_url: &str) -> GatewayBuilder {
    Gateway::builder().database(database_url)
}

/// Whether the cluster's sessions of `application_name` are all encrypted; panics if
/// there is none.
async fn all_encrypted(cluster: &Cluster, application_name: &str) -> bool {
    let rows = cluster
        .client()
        .await
        .query(
            "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.application_name = $1",
            &[&application_name],
        )
        .await
        .expect("pg_stat_ssl can be read");
    assert!(!rows.is_empty(), "no session of {application_name}");
    rows.iter().all(|row| row.get::<_, bool>(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_carries_every_upstream_connection_over_tls() {
    let certs = Certs::generate();
    let cluster = tls_only_cluster(&certs).await;
    let sql_url = format!(
        "postgres://{SQL_LOGIN}:{SQL_PASSWORD}@localhost:{}/postgres?{}",
        cluster.port(),
        verify_full(&certs)
    );
    let gateway = gateway(&url(&cluster, "localhost", &verify_full(&certs)))
        .sql_as(&sql_url)
        .spawn()
        .await;
    let ready = gateway.events("fencegate ready");
    let backend = ready[0]["fields"]["backend"].as_str().unwrap();
    assert!(
        backend.ends_with("over TLS (sslmode=verify-full: certificate and host name verified)"),
        "{backend}"
    );

    // HTTP writes, on the store's pool and the write lanes.
    let client = gateway.client();
    let put = client.put("r", "k", 1, "v1").await;
    assert!((200..300).contains(&put.status), "{:?}", put.body);
    assert_eq!(client.get("r", "k").await.body, "v1");

    // A fenced SQL transaction, on the /v1/sql pool.
    let sql = client
        .sql(
            "r",
            1,
            json!({"statements": [{"sql": "INSERT INTO notes VALUES (1, 'over TLS')"}]}),
        )
        .await;
    assert_eq!(sql.status, 200, "{:?}", sql.body);

    // A session through the door, whose own leg to the door is plain: the server sees
    // the door's TLS.
    let door = gateway.pg_addr();
    let conninfo = format!(
        "host={} port={} user=postgres dbname=postgres sslmode=disable application_name=door",
        door.ip(),
        door.port()
    );
    let out = psql(
        &conninfo,
        Some(cluster.password()),
        &[
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            "SELECT body FROM notes WHERE id = 1",
        ],
    )
    .await;
    assert_eq!(out.ok(), "t\nover TLS");

    // tokio-postgres through the door, with the extended protocol.
    let (door_client, connection) = tokio_postgres::Config::new()
        .host(door.ip().to_string())
        .port(door.port())
        .user("postgres")
        .password(cluster.password())
        .dbname("postgres")
        .application_name("door")
        .connect(NoTls)
        .await
        .expect("tokio-postgres logs in through the door");
    tokio::spawn(connection);
    let ssl: bool = door_client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid() AND $1::int = 1",
            &[&1i32],
        )
        .await
        .expect("the query runs through the door")
        .get(0);
    assert!(ssl);

    for application_name in ["fencegate", "fencegate-sql", "door"] {
        assert!(
            all_encrypted(&cluster, application_name).await,
            "a session of {application_name} is not encrypted"
        );
    }

    // The administrative commands connect the same way.
    let check = Command::new(binary())
        .arg("check")
        .env_clear()
        .env(
            "DATABASE_URL",
            url(&cluster, "localhost", &verify_full(&certs)),
        )
        .output()
        .expect("the binary runs");
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
}

/// What the gateway does with each `sslmode`, against a server that refuses plain
/// connections: `Ok` if it starts, otherwise what its start-up error must say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_decides_what_is_checked() {
    let certs = Certs::generate();
    let other_ca = Certs::generate();
    let cluster = tls_only_cluster(&certs).await;
    let ca = certs.ca.display().to_string();
    let wrong_ca = other_ca.ca.display().to_string();
    // The server's address under a name its certificate does not hold.
    let misnamed = "misnamed.invalid";
    let at_loopback = "hostaddr=127.0.0.1";
    let cases: &[(&str, String, Result<(), &str>)] = &[
        ("localhost", verify_full(&certs), Ok(())),
        ("127.0.0.1", verify_full(&certs), Ok(())),
        (
            "localhost",
            verify_full(&other_ca),
            Err("invalid peer certificate"),
        ),
        (
            misnamed,
            format!("{at_loopback}&{}", verify_full(&certs)),
            Err("not valid for name"),
        ),
        (
            misnamed,
            format!("{at_loopback}&sslmode=verify-ca&sslrootcert={ca}"),
            Ok(()),
        ),
        (
            misnamed,
            format!("{at_loopback}&sslmode=verify-ca&sslrootcert={wrong_ca}"),
            Err("invalid peer certificate"),
        ),
        // As libpq: a root certificate given is a chain checked, whatever the mode.
        (
            "localhost",
            format!("sslmode=require&sslrootcert={wrong_ca}"),
            Err("invalid peer certificate"),
        ),
        (misnamed, format!("{at_loopback}&sslmode=require"), Ok(())),
        ("localhost", "sslmode=prefer".to_owned(), Ok(())),
        ("localhost", String::new(), Ok(())),
        ("localhost", "sslmode=allow".to_owned(), Ok(())),
        (
            "localhost",
            "sslmode=disable".to_owned(),
            Err("pg_hba.conf rejects connection"),
        ),
        (
            "localhost",
            "sslmode=verify-full".to_owned(),
            Err("--database-url: sslmode=verify-full needs sslrootcert"),
        ),
        (
            "localhost",
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem".to_owned(),
            Err("could not read sslrootcert /nonexistent/ca.pem"),
        ),
    ];
    let mut ran = 0;
    for (host, params, expected) in cases {
        let database_url = url(&cluster, host, params);
        let started = gateway(&database_url).try_spawn().await;
        match (started, expected) {
            (Ok(gateway), Ok(())) => {
                let put = gateway.client().put("r", "k", 1, "v").await;
                assert!((200..300).contains(&put.status), "{params}: {:?}", put.body);
                let out = psql(
                    &format!(
                        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
                        gateway.pg_addr().port()
                    ),
                    Some(cluster.password()),
                    &["SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"],
                )
                .await;
                assert_eq!(out.ok(), "t", "{host} {params}: the door's session");
            }
            (Err(failure), Err(reason)) => {
                assert!(
                    failure.logs.contains(reason),
                    "{host} {params}: the error says {reason:?}:\n{}",
                    failure.logs
                );
                assert!(
                    !failure.logs.contains(cluster.password()),
                    "the password is not shown"
                );
                assert!(!failure.status.is_some_and(|status| status.success()));
            }
            (Ok(_), Err(reason)) => panic!("{host} {params}: started, expected {reason:?}"),
            (Err(failure), Ok(())) => panic!("{host} {params}: did not start: {failure}"),
        }
        ran += 1;
    }
    assert_eq!(ran, cases.len());
}

/// A client certificate (`sslcert`, `sslkey`) logs the gateway in by `cert` in
/// pg_hba.conf, with no password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_logs_the_gateway_in() {
    let certs = Certs::generate();
    let cluster = tls_only_cluster(&certs).await;
    let login = certs.client(CERT_LOGIN);
    let database_url = format!(
        "postgres://{CERT_LOGIN}@localhost:{}/postgres?{}&sslcert={}&sslkey={}",
        cluster.port(),
        verify_full(&certs),
        login.cert.display(),
        login.key.display()
    );
    let gateway = gateway(&database_url).spawn().await;
    let put = gateway.client().put("r", "k", 1, "v").await;
    assert!((200..300).contains(&put.status), "{:?}", put.body);
    let users: Vec<String> = cluster
        .client()
        .await
        .query(
            "SELECT usename::text FROM pg_stat_activity WHERE application_name = 'fencegate'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert!(
        !users.is_empty() && users.iter().all(|user| user == CERT_LOGIN),
        "{users:?}"
    );

    // Half a client certificate is a start-up error.
    let half = database_url.replace(&format!("&sslkey={}", login.key.display()), "");
    let failure = gateway_failure(&half).await;
    assert!(
        failure.contains("sslcert and sslkey go together"),
        "{failure}"
    );
}

/// What a gateway that does not start logged.
async fn gateway_failure(database_url: &str) -> String {
    match gateway(database_url).try_spawn().await {
        Ok(_) => panic!("the gateway started"),
        Err(failure) => failure.logs,
    }
}

/// With TLS on both of the door's legs, a client that supports SCRAM channel binding
/// cannot log in by SCRAM (the server would take the door's withdrawal of it for a
/// downgrade): the door says so, and the same client with `channel_binding=disable`
/// logs in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_binding_over_two_tls_legs_is_refused_with_the_fix() {
    let certs = Certs::generate();
    let cluster = tls_only_cluster(&certs).await;
    let gateway = gateway(&url(&cluster, "localhost", &verify_full(&certs)))
        .arg("--pg-tls-cert")
        .arg(certs.cert.to_string_lossy())
        .arg("--pg-tls-key")
        .arg(certs.key.to_string_lossy())
        .spawn()
        .await;
    let conninfo = |extra: &str| {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=require {extra}",
            gateway.pg_addr().port()
        )
    };
    let refused = psql(&conninfo(""), Some(cluster.password()), &["SELECT 1"]).await;
    assert!(
        refused.failed().contains("channel_binding=disable"),
        "{}",
        refused.stderr
    );
    let out = psql(
        &conninfo("channel_binding=disable"),
        Some(cluster.password()),
        &["SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"],
    )
    .await;
    assert_eq!(out.ok(), "t");
}
