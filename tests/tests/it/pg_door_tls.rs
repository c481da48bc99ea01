//! The Postgres door's TLS, seen by libpq (psql) and by a raw socket: with
//! `--pg-tls-cert/--pg-tls-key` it answers SSLRequest with `S` and a certificate a
//! client can verify; without them it answers `N`, as a Postgres server without TLS
//! does. GSSAPI encryption is always refused with `N`.

use std::time::Duration;

use fencegate_tests::cluster::{psql, Cluster};
use fencegate_tests::db::TestDb;
use fencegate_tests::eventually;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::tls::Certs;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Request codes of the start-up packets that negotiate encryption.
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

/// How long the door may take to answer a raw request.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

async fn tls_gateway(database_url: &str, certs: &Certs) -> Gateway {
    Gateway::builder()
        .database(database_url)
        .arg("--pg-tls-cert")
        .arg(certs.cert.to_string_lossy())
        .arg("--pg-tls-key")
        .arg(certs.key.to_string_lossy())
        .spawn()
        .await
}

/// libpq's connection string for `dbname` through `gateway`'s door, by the name the
/// certificate is for (`localhost`) at `127.0.0.1`, with `extra` settings.
fn conninfo(gateway: &Gateway, user: &str, dbname: &str, extra: &str) -> String {
    format!(
        "host=localhost hostaddr=127.0.0.1 port={} user={user} dbname={dbname} {extra}",
        gateway.pg_addr().port()
    )
}

/// `sslmode=verify-full` against the CA of `certs`.
fn verified(certs: &Certs) -> String {
    format!("sslmode=verify-full sslrootcert={}", certs.ca.display())
}

/// psql's `\conninfo` then `select 1`, through the door as `postgres` (trust on the
/// test server): the output.
async fn conninfo_and_select_1(gateway: &Gateway, db: &TestDb, extra: &str) -> String {
    let out = psql(
        &conninfo(gateway, "postgres", db.name(), extra),
        None,
        &["\\conninfo", "select 1"],
    )
    .await;
    let text = out.ok().to_owned();
    assert_eq!(text.lines().last(), Some("1"), "{extra}: {text}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_door_is_verified_and_encrypted() {
    let db = TestDb::create().await;
    let certs = Certs::generate();
    let gateway = tls_gateway(&db.url(), &certs).await;

    let full = conninfo_and_select_1(&gateway, &db, &verified(&certs)).await;
    assert!(full.contains("SSL connection (protocol: TLS"), "{full}");
    let required = conninfo_and_select_1(&gateway, &db, "sslmode=require").await;
    assert!(
        required.contains("SSL connection (protocol: TLS"),
        "{required}"
    );

    let stranger = Certs::generate();
    let out = psql(
        &conninfo(&gateway, "postgres", db.name(), &verified(&stranger)),
        None,
        &["select 1"],
    )
    .await;
    assert!(
        out.failed().contains("certificate verify failed"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_door_without_tls_answers_n() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder().database(&db.url()).spawn().await;

    let out = psql(
        &conninfo(&gateway, "postgres", db.name(), "sslmode=require"),
        None,
        &["select 1"],
    )
    .await;
    assert!(
        out.failed()
            .contains("server does not support SSL, but SSL was required"),
        "{}",
        out.stderr
    );
    let preferred = conninfo_and_select_1(&gateway, &db, "sslmode=prefer").await;
    assert!(!preferred.contains("SSL"), "{preferred}");
    let disabled = conninfo_and_select_1(&gateway, &db, "sslmode=disable").await;
    assert!(!disabled.contains("SSL"), "{disabled}");
}

/// SCRAM channel binding (`SCRAM-SHA-256-PLUS`) ties the client's proof to the TLS
/// channel it sees: a hash of the certificate that ended its TLS, here the door's. The
/// server could only check it against its own end of a TLS channel, and the door's
/// upstream connection has no TLS at all, so no binding could ever verify: the door is,
/// by construction, the man in the middle that channel binding exists to detect. It
/// withdraws `-PLUS` from the mechanisms (the server does not offer it on a plain
/// connection anyway), so `channel_binding=prefer` logs in with plain SCRAM, and
/// `channel_binding=require` is refused by libpq itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_through_the_tls_door_has_no_channel_binding() {
    let cluster = Cluster::builder()
        .hba("host all all 127.0.0.1/32 scram-sha-256")
        .start()
        .await;
    let certs = Certs::generate();
    let gateway = tls_gateway(&cluster.url(), &certs).await;
    let login = |binding: &str| {
        let extra = format!("{} channel_binding={binding}", verified(&certs));
        conninfo(&gateway, "postgres", "postgres", &extra)
    };

    let preferred = psql(
        &login("prefer"),
        Some(cluster.password()),
        &["\\conninfo", "select 1"],
    )
    .await;
    let text = preferred.ok();
    assert!(text.contains("SSL connection (protocol: TLS"), "{text}");
    assert_eq!(text.lines().last(), Some("1"), "{text}");

    let required = psql(&login("require"), Some(cluster.password()), &["select 1"]).await;
    assert!(
        required.failed().contains(
            "channel binding is required, but server did not offer an authentication method \
             that supports channel binding"
        ),
        "{}",
        required.stderr
    );
}

/// Sends a start-up packet of just `code` (length 8).
async fn send_request(socket: &mut TcpStream, code: u32) {
    let mut packet = 8u32.to_be_bytes().to_vec();
    packet.extend_from_slice(&code.to_be_bytes());
    socket
        .write_all(&packet)
        .await
        .expect("the door reads requests");
}

/// Sends a request that the door answers with one byte, and returns that byte.
async fn answer(socket: &mut TcpStream, code: u32) -> u8 {
    send_request(socket, code).await;
    tokio::time::timeout(ANSWER_TIMEOUT, socket.read_u8())
        .await
        .unwrap_or_else(|_| panic!("no answer to request {code} in {ANSWER_TIMEOUT:?}"))
        .unwrap_or_else(|e| panic!("no answer to request {code}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gssapi_is_refused_then_tls_granted() {
    let db = TestDb::create().await;
    let certs = Certs::generate();
    let gateway = tls_gateway(&db.url(), &certs).await;
    let mut socket = TcpStream::connect(gateway.pg_addr())
        .await
        .expect("the door accepts");
    assert_eq!(char::from(answer(&mut socket, GSSENC_REQUEST).await), 'N');
    assert_eq!(char::from(answer(&mut socket, SSL_REQUEST).await), 'S');
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ssl_request_is_a_protocol_error() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder().database(&db.url()).spawn().await;
    let mut socket = TcpStream::connect(gateway.pg_addr())
        .await
        .expect("the door accepts");
    assert_eq!(char::from(answer(&mut socket, SSL_REQUEST).await), 'N');

    send_request(&mut socket, SSL_REQUEST).await;
    let mut rest = Vec::new();
    let read = tokio::time::timeout(ANSWER_TIMEOUT, socket.read_to_end(&mut rest))
        .await
        .expect("the door closes the connection");
    // Closed, with nothing said (or reset, if our request was still unread).
    assert!(
        matches!(&read, Ok(0))
            || matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "{read:?} {rest:?}"
    );
    eventually(
        Duration::from_secs(10),
        "the protocol error counted",
        || async {
            gateway
                .client()
                .metric("fencegate_pg_protocol_errors_total")
                .await
                == Some(1.0)
        },
    )
    .await;
}

/// Writes `text` to `path` whole, by a rename, as a secret store replaces a file.
fn replace(path: &std::path::Path, text: &[u8]) {
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text).unwrap();
    std::fs::rename(&partial, path).unwrap();
}

/// The door's certificate reloads like the HTTP listener's: a new pair is served to the
/// next sessions without a restart, and a broken file is not loaded: the pair in force
/// stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_door_certificate_is_served_without_a_restart_and_a_broken_one_is_not() {
    let db = TestDb::create().await;
    let (first, second) = (Certs::generate(), Certs::generate());
    let served = std::env::temp_dir().join(format!(
        "fg-door-tls-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&served).unwrap();
    let (cert, key) = (served.join("server.crt"), served.join("server.key"));
    std::fs::copy(&first.cert, &cert).unwrap();
    std::fs::copy(&first.key, &key).unwrap();
    let gateway = tls_gateway_with_files(&db.url(), &cert, &key).await;
    let select_1 = |certs: &Certs| {
        let conninfo = conninfo(&gateway, "postgres", db.name(), &verified(certs));
        async move { psql(&conninfo, None, &["select 1"]).await }
    };
    assert_eq!(select_1(&first).await.ok().lines().last(), Some("1"));
    assert!(!select_1(&second).await.success, "not yet the second pair");

    replace(
        &cert,
        b"-----BEGIN CERTIFICATE-----\nbroken\n-----END CERTIFICATE-----\n",
    );
    eventually(Duration::from_secs(10), "the reload to fail", || async {
        gateway
            .events("tls certificate not reloaded; the certificate in force stays")
            .iter()
            .any(|event| event["fields"]["listener"] == "Postgres")
    })
    .await;
    assert_eq!(select_1(&first).await.ok().lines().last(), Some("1"));

    replace(&key, &std::fs::read(&second.key).unwrap());
    replace(&cert, &std::fs::read(&second.cert).unwrap());
    eventually(Duration::from_secs(10), "the second pair served", || {
        let attempt = select_1(&second);
        async move { attempt.await.success }
    })
    .await;
    assert!(
        !select_1(&first).await.success,
        "the first CA's certificate is gone"
    );
    let _ = std::fs::remove_dir_all(&served);
}

async fn tls_gateway_with_files(
    database_url: &str,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Gateway {
    Gateway::builder()
        .database(database_url)
        .arg("--pg-tls-cert")
        .arg(cert.to_string_lossy())
        .arg("--pg-tls-key")
        .arg(key.to_string_lossy())
        .spawn()
        .await
}
