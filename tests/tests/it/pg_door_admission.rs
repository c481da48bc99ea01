//! Who the Postgres door lets through to the database, and what the others cost.
//!
//! The database sees the door's connection, not the client's: its pg_hba.conf rules on
//! TLS and addresses judge the gateway. So the door requires TLS itself (with a
//! certificate), admits only the `--pg-allow` pairs, refuses to listen in cleartext
//! beyond loopback unless told, and keeps clients that never finish logging in from
//! taking the server's connection slots — all before it connects upstream. Floods of
//! junk make a few log lines, not one each; every refusal is counted by reason.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use fencegate_tests::cluster::{psql, Cluster};
use fencegate_tests::db::{server_url, via, TestDb};
use fencegate_tests::eventually;
use fencegate_tests::fenced::sqlstate;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::tls::Certs;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_postgres::NoTls;

/// How long anything the door does may take here before the test fails.
const PATIENCE: Duration = Duration::from_secs(10);

/// A series of `gateway`'s metrics; 0 if absent.
async fn metric(gateway: &Gateway, series: &str) -> f64 {
    gateway.client().metric(series).await.unwrap_or(0.0)
}

fn refusals(reason: &str) -> String {
    format!("fencegate_pg_refusals_total{{reason=\"{reason}\"}}")
}

/// A StartupMessage of protocol `major.minor` for `user` and `database`.
fn startup_message(major: u16, minor: u16, user: &str, database: &str) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&major.to_be_bytes());
    body.extend_from_slice(&minor.to_be_bytes());
    for part in ["user", user, "database", database] {
        body.extend_from_slice(part.as_bytes());
        body.push(0);
    }
    body.push(0);
    let mut packet = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    packet.extend_from_slice(&body);
    packet
}

/// A TCP connection to `door` from the loopback address `from`.
async fn connect_from(from: IpAddr, door: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("a socket");
    socket
        .bind(SocketAddr::new(from, 0))
        .unwrap_or_else(|e| panic!("binding {from}: {e}"));
    socket
        .connect(door)
        .await
        .unwrap_or_else(|e| panic!("connecting to the door from {from}: {e}"))
}

/// Opens a connection from `from`, sends a StartupMessage for `postgres` and then
/// nothing more, as a client that never answers the password prompt.
async fn silent_login(from: IpAddr, door: SocketAddr) -> TcpStream {
    let mut stream = connect_from(from, door).await;
    stream
        .write_all(&startup_message(3, 0, "postgres", "postgres"))
        .await
        .expect("the door reads the start-up packet");
    stream
}

/// Reads server messages until an ErrorResponse or the end of the connection: the
/// message types seen, and the error's SQLSTATE.
async fn until_error(stream: &mut TcpStream) -> (Vec<char>, Option<String>) {
    let mut tags = Vec::new();
    loop {
        let Ok(tag) = stream.read_u8().await else {
            return (tags, None);
        };
        tags.push(char::from(tag));
        let len = stream.read_u32().await.expect("a message length");
        let mut body = vec![0u8; len as usize - 4];
        stream.read_exact(&mut body).await.expect("a message body");
        if tag == b'E' {
            let code = body
                .split(|b| *b == 0)
                .find(|field| field.first() == Some(&b'C'))
                .map(|field| String::from_utf8_lossy(&field[1..]).into_owned());
            return (tags, code);
        }
    }
}

/// The first ErrorResponse's SQLSTATE, within `within`.
async fn refused_within(stream: &mut TcpStream, within: Duration) -> String {
    let (tags, code) = tokio::time::timeout(within, until_error(stream))
        .await
        .unwrap_or_else(|_| panic!("no error within {within:?}"));
    code.unwrap_or_else(|| panic!("closed without an error after {tags:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleartext_client_never_reaches_a_hostssl_only_server() {
    let certs = Certs::generate();
    let cluster = Cluster::builder()
        .tls(&certs.cert, &certs.key, None)
        .hba("hostssl all all 127.0.0.1/32 scram-sha-256")
        .setting("log_connections", "on")
        .start()
        .await;
    let gateway = Gateway::builder()
        .database(&format!("{}?sslmode=require", cluster.url()))
        .arg("--pg-tls-cert")
        .arg(certs.cert.to_string_lossy())
        .arg("--pg-tls-key")
        .arg(certs.key.to_string_lossy())
        .spawn()
        .await;
    let door = gateway.pg_addr();

    let mut cleartext = tokio_postgres::Config::new();
    cleartext
        .host("127.0.0.1")
        .port(door.port())
        .user("postgres")
        .password(cluster.password())
        .dbname("postgres")
        .application_name("cleartext_probe")
        .ssl_mode(tokio_postgres::config::SslMode::Disable);
    let refused = cleartext.connect(NoTls).await.map(|_| ());
    let error = refused.as_ref().err().and_then(|e| e.as_db_error());
    assert_eq!(
        error.map(|e| e.message()),
        Some("the fencegate door requires TLS; connect with sslmode=require"),
        "{refused:?}"
    );
    assert_eq!(sqlstate(refused), "28000");

    let tls = psql(
        &format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=require \
             channel_binding=disable application_name=tls_probe",
            door.port()
        ),
        Some(cluster.password()),
        &["select 1"],
    )
    .await;
    assert_eq!(tls.ok(), "1");
    let log = cluster.log();
    assert!(log.contains("application_name=tls_probe"), "{log}");
    assert!(
        !log.contains("cleartext_probe"),
        "the refused client reached the server:\n{log}"
    );
    assert_eq!(metric(&gateway, &refusals("tls_required")).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_door_other_hosts_can_reach_needs_tls_or_the_insecure_flag() {
    let db = TestDb::create().await;
    let failure = Gateway::builder()
        .database(&db.url())
        .args(&["--pg-listen", "0.0.0.0:0"])
        .try_spawn()
        .await
        .err()
        .expect("a cleartext door on 0.0.0.0 does not start");
    assert!(
        failure.logs.contains(
            "--pg-listen 0.0.0.0:0 is reachable from other hosts, and without --pg-tls-cert"
        ) && failure.logs.contains("--pg-insecure-cleartext"),
        "{failure}"
    );
    let failure = Gateway::builder()
        .database(&db.url())
        .arg("--pg-require-tls")
        .try_spawn()
        .await
        .err()
        .expect("TLS required without a certificate does not start");
    assert!(
        failure
            .logs
            .contains("--pg-require-tls needs --pg-tls-cert"),
        "{failure}"
    );

    let gateway = Gateway::builder()
        .database(&db.url())
        .args(&["--pg-listen", "0.0.0.0:0", "--pg-insecure-cleartext"])
        .spawn()
        .await;
    let door = SocketAddr::from(([127, 0, 0, 1], gateway.pg_addr().port()));
    let out = psql(
        &format!(
            "host=127.0.0.1 port={} user=postgres dbname={} sslmode=disable",
            door.port(),
            db.name()
        ),
        None,
        &["select 1"],
    )
    .await;
    assert_eq!(out.ok(), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_allowed_database_and_role_pairs_get_in() {
    let db = TestDb::create().await;
    let allowed = format!("{}/postgres", db.name());
    let gateway = Gateway::builder()
        .database(&db.url())
        .args(&["--pg-allow", &allowed, "--pg-allow", "*/nobody_here"])
        .spawn()
        .await;
    let door = gateway.pg_addr();

    let (client, connection) = tokio_postgres::connect(&db.url_via(door), NoTls)
        .await
        .expect("an allowed pair logs in");
    tokio::spawn(connection);
    let one: i32 = client.query_one("select 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);

    let elsewhere = via(&format!("{}/postgres", server_url()), door);
    let refused = tokio_postgres::connect(&elsewhere, NoTls).await.map(|_| ());
    let message = refused
        .as_ref()
        .err()
        .and_then(|e| e.as_db_error())
        .map(|e| e.message().to_owned());
    assert_eq!(sqlstate(refused), "28000");
    assert!(
        message.is_some_and(|m| m.contains("--pg-allow")),
        "the refusal names the setting"
    );
    assert_eq!(metric(&gateway, &refusals("not_allowed")).await, 1.0);
}

/// A StartupMessage of protocol 3.0 with `pairs` as its parameters, as sent.
fn startup_with(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut body = vec![0, 3, 0, 0];
    for (name, value) in pairs {
        for part in [name, value] {
            body.extend_from_slice(part.as_bytes());
            body.push(0);
        }
    }
    body.push(0);
    let mut packet = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    packet.extend_from_slice(&body);
    packet
}

/// Runs `sql` as a simple query on a logged-in raw session; the first column of its
/// first row.
async fn simple_query(stream: &mut TcpStream, sql: &str) -> String {
    let mut query = vec![b'Q'];
    query.extend_from_slice(&((sql.len() + 5) as u32).to_be_bytes());
    query.extend_from_slice(sql.as_bytes());
    query.push(0);
    stream.write_all(&query).await.unwrap();
    let mut value = None;
    loop {
        let tag = stream.read_u8().await.expect("a message");
        let len = stream.read_u32().await.unwrap();
        let mut body = vec![0u8; len as usize - 4];
        stream.read_exact(&mut body).await.unwrap();
        match tag {
            b'D' if value.is_none() => {
                let len = u32::from_be_bytes([body[2], body[3], body[4], body[5]]) as usize;
                value = Some(String::from_utf8_lossy(&body[6..6 + len]).into_owned());
            }
            b'E' => panic!("{sql}: {}", String::from_utf8_lossy(&body)),
            b'Z' => return value.expect("a row"),
            _ => {}
        }
    }
}

/// Reads a raw session's login up to its first ReadyForQuery (the server trusts the
/// door); panics on an error.
async fn logged_in(stream: &mut TcpStream) {
    let (tags, code) = tokio::time::timeout(PATIENCE, async {
        let mut tags = Vec::new();
        loop {
            let tag = stream.read_u8().await.expect("a message");
            tags.push(char::from(tag));
            let len = stream.read_u32().await.unwrap();
            let mut body = vec![0u8; len as usize - 4];
            stream.read_exact(&mut body).await.unwrap();
            match tag {
                b'E' => return (tags, Some(String::from_utf8_lossy(&body).into_owned())),
                b'Z' => return (tags, None),
                _ => {}
            }
        }
    })
    .await
    .expect("a login within the test's patience");
    assert_eq!(code, None, "{tags:?}");
}

/// The door reads a StartupMessage as Postgres will: a parameter named twice — a second
/// `user` or `database` past `--pg-allow`, a second `options` past the door's own — is
/// refused (08P01) before anything reaches the server, and the door's
/// `idle_in_transaction_session_timeout` holds over the client's, however it is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_up_packet_is_judged_as_postgres_reads_it() {
    let db = TestDb::create().await;
    let name = db.name().to_owned();
    let allowed = format!("{name}/postgres");
    let gateway = Gateway::builder()
        .database(&db.url())
        .args(&[
            "--pg-allow",
            &format!("{name}/alice"),
            "--pg-allow",
            &allowed,
        ])
        .spawn()
        .await;
    let door = gateway.pg_addr();
    let protocol_errors = "fencegate_pg_protocol_errors_total";

    let twice: [&[(&str, &str)]; 4] = [
        &[("user", "alice"), ("database", &name), ("user", "postgres")],
        &[
            ("user", "alice"),
            ("database", &name),
            ("database", "postgres"),
        ],
        &[
            ("user", "postgres"),
            ("database", &name),
            ("options", "-c idle_in_transaction_session_timeout=0"),
            ("options", "-c statement_timeout=0"),
        ],
        &[
            ("user", "postgres"),
            ("database", &name),
            ("application_name", "a"),
            ("application_name", "b"),
        ],
    ];
    for (sent, pairs) in twice.iter().enumerate() {
        let mut stream = TcpStream::connect(door).await.unwrap();
        stream.write_all(&startup_with(pairs)).await.unwrap();
        assert_eq!(
            refused_within(&mut stream, PATIENCE).await,
            "08P01",
            "{pairs:?}"
        );
        assert_eq!(metric(&gateway, protocol_errors).await, (sent + 1) as f64);
    }
    // Bytes after the terminator are not forwarded unjudged either.
    let mut trailing = startup_with(&[("user", "alice"), ("database", &name)]);
    trailing.extend_from_slice(b"user\0postgres\0\0");
    let len = (trailing.len() as u32).to_be_bytes();
    trailing[..4].copy_from_slice(&len);
    let mut stream = TcpStream::connect(door).await.unwrap();
    stream.write_all(&trailing).await.unwrap();
    assert_eq!(refused_within(&mut stream, PATIENCE).await, "08P01");
    // The allowed pair, asking for no idle timeout both ways Postgres reads.
    let mut stream = TcpStream::connect(door).await.unwrap();
    stream
        .write_all(&startup_with(&[
            ("user", "postgres"),
            ("database", &name),
            ("options", "-c idle_in_transaction_session_timeout=0"),
            ("idle_in_transaction_session_timeout", "0"),
        ]))
        .await
        .unwrap();
    logged_in(&mut stream).await;
    assert_eq!(
        simple_query(&mut stream, "SHOW idle_in_transaction_session_timeout").await,
        "1min",
        "the door's --pg-idle-in-transaction-timeout"
    );
    assert_eq!(
        simple_query(&mut stream, "SELECT current_user").await,
        "postgres"
    );
}

/// A throwaway server with 20 connection slots, 3 of them for superusers.
async fn small_server() -> Cluster {
    Cluster::builder()
        .setting("max_connections", "20")
        .setting("superuser_reserved_connections", "3")
        .start()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_that_never_finish_cannot_take_the_servers_slots() {
    let cluster = small_server().await;
    let pools = ["--pool-size", "4", "--write-lanes", "1"];

    // 17 open slots, 5 for the gateway's pools: a door of 64 could starve it.
    let failure = Gateway::builder()
        .database(&cluster.url())
        .args(&pools)
        .args(&["--pg-max-connections", "64"])
        .try_spawn()
        .await
        .err()
        .expect("a door cap that does not fit stops the start");
    for part in [
        "--pg-max-connections 64 does not fit the database",
        "max_connections = 20",
        "superuser_reserved_connections = 3",
        "--pool-size 4, --write-lanes 1",
        "12 or less",
    ] {
        assert!(failure.logs.contains(part), "{part:?} in {failure}");
    }

    // The default cap is lowered to what fits, and says so.
    let gateway = Gateway::builder()
        .database(&cluster.url())
        .args(&pools)
        .args(&[
            "--pg-max-pending-auth",
            "4",
            "--pg-max-pending-auth-per-peer",
            "2",
            "--pg-startup-timeout",
            "2s",
        ])
        .spawn()
        .await;
    let ready = gateway.events("fencegate ready");
    assert_eq!(ready[0]["fields"]["pg_max_connections"], 12, "{ready:?}");
    let warned = gateway
        .logs()
        .into_iter()
        .filter(|e| e["level"] == "WARN")
        .filter(|e| e["fields"]["pg_max_connections"] == 12)
        .count();
    assert_eq!(warned, 1, "{:?}", gateway.logs());
    let door = gateway.pg_addr();
    let [one, two, three, four]: [IpAddr; 4] =
        ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"].map(|ip| ip.parse().unwrap());

    // Ten silent logins from one address: two wait at the password prompt, eight are
    // refused at once.
    let flood_started = Instant::now();
    let mut waiting = Vec::new();
    for _ in 0..10 {
        let mut stream = silent_login(one, door).await;
        let mut first = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_millis(500), stream.peek(&mut first)).await;
        match read {
            Ok(Ok(1)) if first[0] == b'E' => {
                assert_eq!(refused_within(&mut stream, PATIENCE).await, "53300");
            }
            _ => waiting.push(stream),
        }
    }
    assert_eq!(waiting.len(), 2, "per-address cap of 2");

    // A real client from another address logs in meanwhile.
    let mut config = tokio_postgres::Config::new();
    config
        .user("postgres")
        .password(cluster.password())
        .dbname("postgres");
    let (client, connection) = config
        .connect_raw(connect_from(two, door).await, NoTls)
        .await
        .expect("a login from another address goes through during the flood");
    tokio::spawn(connection);
    client.simple_query("select 1").await.expect("a session");

    // Two more silent logins fill the cap of four; a fifth is refused for the total.
    for _ in 0..2 {
        waiting.push(silent_login(three, door).await);
    }
    eventually(PATIENCE, "four logins waiting", || async {
        metric(&gateway, "fencegate_pg_connections").await >= 5.0
    })
    .await;
    let mut over = silent_login(four, door).await;
    assert_eq!(refused_within(&mut over, PATIENCE).await, "53300");

    // The gateway's own writes go on.
    let put = gateway.client().put("flood", "k", 1, "v").await;
    assert_eq!(put.status, 201, "{put:?}");
    let in_use: i64 = cluster
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(in_use <= 17, "{in_use} server connections");

    // The silent ones are ended at the deadline.
    for mut stream in waiting {
        let (tags, code) = tokio::time::timeout(PATIENCE, until_error(&mut stream))
            .await
            .expect("a silent login is ended");
        assert_eq!(tags.first(), Some(&'R'), "the password prompt came first");
        assert_eq!(code.as_deref(), Some("08006"));
    }
    let elapsed = flood_started.elapsed();
    assert!(elapsed < Duration::from_secs(6), "{elapsed:?}");

    assert_eq!(metric(&gateway, &refusals("auth_pending_peer")).await, 8.0);
    assert_eq!(metric(&gateway, &refusals("auth_pending")).await, 1.0);
    assert_eq!(metric(&gateway, &refusals("auth_timeout")).await, 4.0);

    // And once the flood is over, the first address logs in again.
    let (again, connection) = config
        .connect_raw(connect_from(one, door).await, NoTls)
        .await
        .expect("a login after the flood");
    tokio::spawn(connection);
    again.simple_query("select 1").await.expect("a session");
}

/// Sends `packet` on a new connection and waits for the door to close it.
async fn send_and_wait_for_close(door: SocketAddr, packet: &[u8]) {
    let mut stream = TcpStream::connect(door).await.expect("the door accepts");
    stream.write_all(packet).await.expect("the door reads");
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut rest))
        .await
        .expect("the door closes the connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_of_junk_make_a_few_log_lines_and_failed_logins_name_the_peer() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder().database(&db.url()).spawn().await;
    let door = gateway.pg_addr();
    const FLOOD: usize = 1000;

    let mut cancel = 16u32.to_be_bytes().to_vec();
    cancel.extend_from_slice(&80_877_102u32.to_be_bytes());
    cancel.extend_from_slice(&[0, 0, 0, 42, 1, 2, 3, 4]);
    let version_4 = startup_message(4, 0, "postgres", "postgres");
    for _ in 0..FLOOD {
        send_and_wait_for_close(door, &cancel).await;
        send_and_wait_for_close(door, &version_4).await;
    }
    let unknown = "fencegate_pg_cancels_total{outcome=\"unknown_key\"}";
    assert_eq!(metric(&gateway, unknown).await, FLOOD as f64);
    assert_eq!(
        metric(&gateway, "fencegate_pg_protocol_errors_total").await,
        FLOOD as f64
    );
    let cancels = gateway.events("Postgres cancel request with an unknown key ignored");
    assert!((1..=2).contains(&cancels.len()), "{cancels:?}");
    let broken = gateway.events("Postgres client broke the protocol");
    assert!((1..=2).contains(&broken.len()), "{broken:?}");

    let stranger = format!(
        "host=127.0.0.1 port={} user=no_such_door_role dbname={}",
        door.port(),
        db.name()
    );
    let refused = tokio_postgres::connect(&stranger, NoTls).await.map(|_| ());
    assert_eq!(sqlstate(refused), "28000");
    eventually(PATIENCE, "the failed login logged", || async {
        !gateway.events("Postgres door login failed").is_empty()
    })
    .await;
    let failed = &gateway.events("Postgres door login failed")[0]["fields"];
    assert!(
        failed["peer"]
            .as_str()
            .is_some_and(|peer| peer.starts_with("127.0.0.1:")),
        "{failed}"
    );
    assert_eq!(failed["user"], "Some(\"no_such_door_role\")");
    assert_eq!(failed["sqlstate"], "28000");

    // The lines left out are summed up within a window.
    eventually(Duration::from_secs(15), "a summary line", || async {
        gateway.logs().iter().any(|event| {
            event["fields"]["message"].as_str().is_some_and(|m| {
                m.contains("more cancel requests with unknown keys in the last 10s")
            })
        })
    })
    .await;
}
