//! The Postgres door with a real driver (tokio-postgres) and raw sockets: writers keep
//! their driver, stale transactions are refused by the fenced tables and counted by the
//! gateway, sessions behave as on Postgres itself, and bad input closes one connection
//! without touching the others.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use fencegate_tests::door::SweeperDoor;
use fencegate_tests::eventually;
use fencegate_tests::fenced::{detail_fields, fence_error, sqlstate};
use futures_util::{SinkExt, StreamExt, TryStreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_postgres::{AsyncMessage, Client, NoTls};

/// How long anything the door does may take here before the test fails.
const PATIENCE: Duration = Duration::from_secs(10);

/// One term's write: fence first in the transaction, then the update.
async fn write_as(
    client: &mut Client,
    token: i64,
    note: &str,
) -> Result<(), tokio_postgres::Error> {
    let transaction = client.transaction().await?;
    transaction
        .query_one("SELECT fencegate.fence($1, $2)", &[&"sweeper", &token])
        .await?;
    transaction
        .execute("UPDATE sweep_state SET note = $1 WHERE id = 1", &[&note])
        .await?;
    transaction.commit().await
}

#[tokio::test]
async fn the_old_leaders_delayed_transaction_is_refused_counted_and_logged() {
    let door = SweeperDoor::start().await;
    let mut node_a = door.writer("").await;
    let mut node_b = door.writer("").await;

    write_as(&mut node_b, 42, "node-b")
        .await
        .expect("node-b's term");
    let error = write_as(&mut node_a, 41, "node-a")
        .await
        .expect_err("node-a's delayed transaction");

    let error = fence_error(&error);
    assert_eq!(error.code().code(), "ZF001");
    assert_eq!(
        detail_fields(error),
        Some("resource=sweeper presented=41 highest=42")
    );
    assert!(error.hint().is_some_and(|hint| !hint.is_empty()));
    assert_eq!(door.note().await, "node-b");

    let counted = "fencegate_stale_rejections_total{resource=\"sweeper\"}";
    assert_eq!(door.metric(counted).await, 1.0);
    assert_eq!(
        door.metric("fencegate_last_rejected_token{resource=\"sweeper\"}")
            .await,
        41.0
    );
    let logged = door.gateway.events("stale write rejected");
    assert_eq!(logged.len(), 1, "{logged:?}");
    let fields = &logged[0]["fields"];
    assert_eq!(fields["door"], "pg");
    assert_eq!(fields["resource"], "sweeper");
    assert_eq!(
        (fields["presented"].as_i64(), fields["highest"].as_i64()),
        (Some(41), Some(42))
    );
    assert!(door.metric("fencegate_pg_sessions_total").await >= 2.0);
    assert!(
        door.metric("fencegate_pg_bytes_total{direction=\"from_client\"}")
            .await
            > 0.0
    );
    assert!(
        door.metric("fencegate_pg_bytes_total{direction=\"to_client\"}")
            .await
            > 0.0
    );
}

/// A raise inside a transaction that then fails must not reach the gateway's fence
/// cache: the database names it as the highest, but it is rolled back.
#[tokio::test]
async fn a_rejection_naming_an_uncommitted_raise_does_not_poison_the_gateway() {
    let door = SweeperDoor::start().await;
    let writer = door.writer("").await;
    let error = writer
        .batch_execute(
            "BEGIN; SELECT fencegate.fence('sweeper', 90); SELECT fencegate.fence('sweeper', 50);",
        )
        .await
        .expect_err("50 is below this transaction's own 90");
    assert_eq!(fence_error(&error).code().code(), "ZF001");
    writer.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(door.db.highest("sweeper").await, None, "90 was rolled back");
    // The HTTP API still accepts a token between the two.
    let reply = door.gateway.client().put("sweeper", "k", 60, "v").await;
    assert_eq!(reply.status, 201, "{:?}", reply.json());
}

#[tokio::test]
async fn a_token_per_connection_travels_in_the_start_up_options() {
    let door = SweeperDoor::start().await;
    let current = door.writer("-c fencegate.token=42").await;
    current
        .execute(
            "UPDATE sweep_state SET note = 'session 42' WHERE id = 1",
            &[],
        )
        .await
        .expect("a current token for the session");
    let stale = door.writer("-c fencegate.token=41").await;
    let refused = stale
        .execute(
            "UPDATE sweep_state SET note = 'session 41' WHERE id = 1",
            &[],
        )
        .await;
    assert_eq!(sqlstate(refused), "ZF001");
    let none = door.writer("").await;
    let refused = none
        .execute("UPDATE sweep_state SET note = 'no token' WHERE id = 1", &[])
        .await;
    assert_eq!(sqlstate(refused), "ZF002");
    assert_eq!(door.note().await, "session 42");
}

#[tokio::test]
async fn statements_after_a_commit_in_one_query_need_their_own_token() {
    let door = SweeperDoor::start().await;
    let writer = door.writer("").await;
    let result = writer
        .batch_execute(
            "BEGIN;
             SELECT fencegate.fence('sweeper', 42);
             UPDATE sweep_state SET note = 'first' WHERE id = 1;
             COMMIT;
             UPDATE sweep_state SET note = 'second' WHERE id = 1;",
        )
        .await;
    assert_eq!(sqlstate(result), "ZF002");
    assert_eq!(door.note().await, "first");
}

#[tokio::test]
async fn a_stale_fence_in_a_pipeline_fails_the_whole_transaction() {
    let door = SweeperDoor::start().await;
    door.db.raise("sweeper", 42).await;
    let mut writer = door.writer("").await;
    let transaction = writer.transaction().await.unwrap();
    let fence = transaction
        .prepare("SELECT fencegate.fence('sweeper', $1)")
        .await
        .unwrap();
    let update = transaction
        .prepare("UPDATE sweep_state SET note = 'pipelined' WHERE id = 1")
        .await
        .unwrap();
    let insert = transaction
        .prepare("INSERT INTO sweep_state VALUES (2, 'pipelined')")
        .await
        .unwrap();
    // Sent in this order, before any answer: tokio-postgres pipelines concurrent
    // queries of prepared statements.
    let (fence, first, second) = tokio::join!(
        transaction.query_one(&fence, &[&41i64]),
        transaction.execute(&update, &[]),
        transaction.execute(&insert, &[]),
    );
    assert_eq!(sqlstate(fence), "ZF001");
    assert_eq!(sqlstate(first), "25P02");
    assert_eq!(sqlstate(second), "25P02");
    transaction.rollback().await.unwrap();
    assert_eq!(door.note().await, "initial");
    assert_eq!(door.db.count("sweep_state").await, 1);
}

#[tokio::test]
async fn an_error_in_a_transaction_block_then_rollback_leaves_the_session_usable() {
    let door = SweeperDoor::start().await;
    let writer = door.writer("").await;
    writer.batch_execute("BEGIN").await.unwrap();
    assert_eq!(sqlstate(writer.simple_query("SELECT 1/0").await), "22012");
    assert_eq!(sqlstate(writer.simple_query("SELECT 1").await), "25P02");
    writer.batch_execute("ROLLBACK").await.unwrap();
    let one: i32 = writer.query_one("SELECT 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
}

#[tokio::test]
async fn copy_in_needs_a_token_and_copy_out_streams_rows() {
    let door = SweeperDoor::start().await;
    let mut writer = door.writer("").await;

    let copied = copy_rows(&mut writer, Some(42), "2\tcopied\n3\tcopied\n").await;
    assert_eq!(copied.unwrap(), 2);
    assert_eq!(
        sqlstate(copy_rows(&mut writer, None, "4\tunfenced\n").await),
        "ZF002"
    );
    assert_eq!(door.db.count("sweep_state").await, 3);

    // tokio-postgres gives up a connection whose COPY FROM failed (directly against
    // Postgres as well): read on a new one.
    let reader = door.writer("").await;
    let out = reader
        .copy_out("COPY (SELECT id, note FROM sweep_state ORDER BY id) TO STDOUT")
        .await
        .unwrap();
    let chunks: Vec<Bytes> = out.try_collect().await.unwrap();
    let text = String::from_utf8(chunks.concat()).unwrap();
    assert_eq!(text, "1\tinitial\n2\tcopied\n3\tcopied\n");
}

/// COPY FROM STDIN into `sweep_state` in a transaction fenced with `token`, if any.
async fn copy_rows(
    writer: &mut Client,
    token: Option<i64>,
    rows: &'static str,
) -> Result<u64, tokio_postgres::Error> {
    let transaction = writer.transaction().await?;
    if let Some(token) = token {
        transaction
            .query_one("SELECT fencegate.fence('sweeper', $1)", &[&token])
            .await?;
    }
    let sink = transaction
        .copy_in("COPY sweep_state (id, note) FROM STDIN")
        .await?;
    let mut sink = std::pin::pin!(sink);
    sink.send(Bytes::from_static(rows.as_bytes())).await?;
    let copied = sink.as_mut().finish().await?;
    transaction.commit().await?;
    Ok(copied)
}

#[tokio::test]
async fn a_cancel_stops_only_its_own_statement() {
    let door = SweeperDoor::start().await;
    let sleeper = door.writer("").await;
    let cancel = sleeper.cancel_token();
    let other = door.writer("").await;

    let sleeping = tokio::spawn(async move { sleeper.simple_query("SELECT pg_sleep(30)").await });
    let neighbour =
        tokio::spawn(async move { other.query_one("SELECT pg_sleep(1.5), 7", &[]).await });
    eventually(PATIENCE, "the sleeper's statement runs", || async {
        door.db
            .db
            .value::<i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND query = 'SELECT pg_sleep(30)'
                   AND state = 'active'",
            )
            .await
            == 1
    })
    .await;
    cancel
        .cancel_query(NoTls)
        .await
        .expect("the door takes the cancel request");
    let cancelled = tokio::time::timeout(PATIENCE, sleeping)
        .await
        .expect("cancelled well before its 30 s")
        .unwrap();
    assert_eq!(sqlstate(cancelled), "57014");
    let neighbour = neighbour
        .await
        .unwrap()
        .expect("the other session is untouched");
    assert_eq!(neighbour.get::<_, i32>(1), 7);
    assert_eq!(
        door.metric("fencegate_pg_cancels_total{outcome=\"forwarded\"}")
            .await,
        1.0
    );

    // A key the door never issued cancels nothing, and gets no answer.
    let mut forged = TcpStream::connect(door.addr()).await.unwrap();
    let mut request = BytesMut::new();
    request.put_u32(16);
    request.put_u32(80_877_102);
    request.put_i32(1);
    request.put_u32(0xdead_beef);
    forged.write_all(&request).await.unwrap();
    let mut reply = Vec::new();
    tokio::time::timeout(PATIENCE, forged.read_to_end(&mut reply))
        .await
        .expect("the door closes the connection")
        .unwrap();
    assert!(reply.is_empty(), "no reply to a cancel request: {reply:?}");
    assert_eq!(
        door.metric("fencegate_pg_cancels_total{outcome=\"unknown_key\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn notifications_reach_an_idle_listener() {
    let door = SweeperDoor::start().await;
    let config: tokio_postgres::Config = door.writer_url().parse().unwrap();
    let (listener, mut connection) = config.connect(NoTls).await.unwrap();
    let (sent, mut received) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(notification) = message {
                let _ = sent.send((
                    notification.channel().to_owned(),
                    notification.payload().to_owned(),
                ));
            }
        }
    });
    listener.batch_execute("LISTEN sweeps").await.unwrap();
    let notifier = door.writer("").await;
    notifier
        .batch_execute("NOTIFY sweeps, 'swept 3'")
        .await
        .unwrap();
    let notification = tokio::time::timeout(PATIENCE, received.recv())
        .await
        .expect("delivered while the listener is idle")
        .unwrap();
    assert_eq!(notification, ("sweeps".to_owned(), "swept 3".to_owned()));
}

#[tokio::test]
async fn a_16_mib_value_round_trips() {
    let door = SweeperDoor::start().await;
    let writer = door.writer("").await;
    let value: Vec<u8> = (0..16 << 20).map(|i: u32| (i % 251) as u8).collect();
    let row = writer
        .query_one("SELECT $1::bytea, length($1::bytea)", &[&value])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(1), 16 << 20);
    assert!(
        row.get::<_, Vec<u8>>(0) == value,
        "the value came back changed"
    );
}

/// A writer that vanishes — its process killed — in the middle of a transaction that
/// holds the fence's lock: the door closes its upstream connection and cancels the
/// running statement, so the server rolls back and the next term is not held up.
#[tokio::test]
async fn a_client_killed_mid_transaction_leaves_nothing_behind() {
    let door = SweeperDoor::start().await;
    let url = format!("{}?application_name=fg-killed", door.writer_url());
    let mut psql = tokio::process::Command::new("psql")
        .args(["-X", "-q", &url, "-c"])
        .arg("BEGIN; SELECT fencegate.fence('sweeper', 60); SELECT pg_sleep(60);")
        .kill_on_drop(true)
        .spawn()
        .expect("psql runs (apt-get install postgresql-client)");
    let backends = || async {
        door.db
            .db
            .value::<i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND application_name = 'fg-killed'",
            )
            .await
    };
    eventually(PATIENCE, "psql's statement runs", || async {
        backends().await == 1
    })
    .await;
    psql.kill().await.unwrap();
    eventually(PATIENCE, "the killed writer's backend is gone", || async {
        backends().await == 0
    })
    .await;

    // An idle transaction whose client drops its socket (no Terminate) ends too.
    let config: tokio_postgres::Config =
        format!("{}?application_name=fg-dropped", door.writer_url())
            .parse()
            .unwrap();
    let (client, connection) = config.connect(NoTls).await.unwrap();
    let connection = tokio::spawn(connection);
    client
        .batch_execute("BEGIN; SELECT fencegate.fence('sweeper', 61);")
        .await
        .unwrap();
    connection.abort();
    eventually(PATIENCE, "the dropped writer's backend is gone", || async {
        door.db
            .db
            .value::<i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND application_name = 'fg-dropped'",
            )
            .await
            == 0
    })
    .await;

    // Neither raise committed, and the next term does not wait for either.
    assert_eq!(door.db.highest("sweeper").await, None);
    let mut next = door.writer("").await;
    tokio::time::timeout(PATIENCE, write_as(&mut next, 62, "next term"))
        .await
        .expect("no lock left behind")
        .unwrap();
    assert_eq!(door.note().await, "next term");
}

/// A StartupMessage for `user` and `database`, protocol 3.0.
fn startup(user: &str, database: &str) -> Bytes {
    startup_with(196_608, &[("user", user), ("database", database)])
}

/// A StartupMessage of protocol `version` with `parameters`.
fn startup_with(version: u32, parameters: &[(&str, &str)]) -> Bytes {
    let mut body = BytesMut::new();
    body.put_u32(version);
    for (name, value) in parameters {
        body.put_slice(name.as_bytes());
        body.put_u8(0);
        body.put_slice(value.as_bytes());
        body.put_u8(0);
    }
    body.put_u8(0);
    let mut packet = BytesMut::new();
    packet.put_u32(u32::try_from(body.len() + 4).unwrap());
    packet.put_slice(&body);
    packet.freeze()
}

/// Reads one server message: its type and body.
async fn read_message(stream: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let tag = stream.read_u8().await?;
    let len = stream.read_u32().await?;
    let mut body = vec![0; len as usize - 4];
    stream.read_exact(&mut body).await?;
    Ok((tag, body))
}

/// The SQLSTATE of an ErrorResponse body.
fn error_code(body: &[u8]) -> String {
    body.split(|b| *b == 0)
        .find(|field| field.first() == Some(&b'C'))
        .map(|field| String::from_utf8_lossy(&field[1..]).into_owned())
        .unwrap_or_default()
}

/// A session through the door as the database's owner, up to its first ReadyForQuery.
async fn raw_session(door: &SweeperDoor) -> TcpStream {
    let mut stream = TcpStream::connect(door.addr()).await.unwrap();
    stream
        .write_all(&startup("postgres", door.db.db.name()))
        .await
        .unwrap();
    loop {
        let (tag, body) = read_message(&mut stream).await.unwrap();
        assert_ne!(
            tag,
            b'E',
            "start-up failed: {}",
            String::from_utf8_lossy(&body)
        );
        if tag == b'Z' {
            return stream;
        }
    }
}

/// Reads until the door closes the connection; the ErrorResponse codes it sent.
async fn errors_until_closed(stream: &mut TcpStream) -> Vec<String> {
    let mut codes = Vec::new();
    tokio::time::timeout(PATIENCE, async {
        while let Ok((tag, body)) = read_message(stream).await {
            if tag == b'E' {
                codes.push(error_code(&body));
            }
        }
    })
    .await
    .expect("the door closes the connection");
    codes
}

#[tokio::test]
async fn bad_input_closes_one_connection_and_the_door_serves_the_rest() {
    let door = SweeperDoor::start_with(&["--pg-max-message", "1KiB"]).await;
    let mut bystander = door.writer("").await;

    // Garbage where the start-up packet belongs: closed without an answer.
    let mut garbage = TcpStream::connect(door.addr()).await.unwrap();
    garbage.write_all(&[0xff; 64]).await.unwrap();
    assert_eq!(
        errors_until_closed(&mut garbage).await,
        Vec::<String>::new()
    );

    // A protocol version the door does not speak.
    let mut old = TcpStream::connect(door.addr()).await.unwrap();
    let mut packet = startup("postgres", "postgres").to_vec();
    packet[4..8].copy_from_slice(&0x0002_0000u32.to_be_bytes());
    old.write_all(&packet).await.unwrap();
    assert_eq!(errors_until_closed(&mut old).await, ["0A000"]);

    // After start-up: an unknown message type, a length below its own 4 bytes, a
    // message over --pg-max-message. Each gets 08P01 and a closed connection.
    for bad in [
        &[b'!', 0, 0, 0, 4][..],
        &[b'Q', 0, 0, 0, 2][..],
        &[b'Q', 0, 0, 0x10, 0][..],
    ] {
        let mut session = raw_session(&door).await;
        session.write_all(bad).await.unwrap();
        assert_eq!(
            errors_until_closed(&mut session).await,
            ["08P01"],
            "{bad:?}"
        );
    }

    // A length that lies: the client promises more than it sends, then leaves.
    let mut liar = raw_session(&door).await;
    liar.write_all(&[b'Q', 0, 0, 1, 0, b'S', b'E'])
        .await
        .unwrap();
    drop(liar);

    assert_eq!(door.metric("fencegate_pg_protocol_errors_total").await, 5.0);
    write_as(&mut bystander, 42, "still served")
        .await
        .expect("the connection opened before the bad ones works");
    let mut newcomer = door.writer("").await;
    write_as(&mut newcomer, 42, "newcomer")
        .await
        .expect("a new connection works");
    assert_eq!(door.note().await, "newcomer");
}

/// Two queries sent in pieces of 1 to 7 bytes, each piece its own segment: the door
/// reads headers and bodies cut anywhere, and both queries are answered in full.
#[tokio::test]
async fn messages_cut_anywhere_arrive_whole() {
    let door = SweeperDoor::start().await;
    let mut session = raw_session(&door).await;
    session.set_nodelay(true).unwrap();
    let mut queries = BytesMut::new();
    for sql in ["SELECT 'first'", "SELECT repeat('x', 40)"] {
        queries.put_u8(b'Q');
        queries.put_u32(u32::try_from(sql.len() + 5).unwrap());
        queries.put_slice(sql.as_bytes());
        queries.put_u8(0);
    }
    let mut rest = &queries[..];
    for piece in (1..=7).cycle() {
        if rest.is_empty() {
            break;
        }
        let (now, later) = rest.split_at(piece.min(rest.len()));
        session.write_all(now).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
        rest = later;
    }
    let mut tags = Vec::new();
    let mut rows = Vec::new();
    tokio::time::timeout(PATIENCE, async {
        while tags.iter().filter(|tag| **tag == b'Z').count() < 2 {
            let (tag, body) = read_message(&mut session).await.unwrap();
            if tag == b'D' {
                // One column: its length, then its text.
                rows.push(String::from_utf8_lossy(&body[6..]).into_owned());
            }
            tags.push(tag);
        }
    })
    .await
    .expect("both queries answered");
    assert_eq!(tags, b"TDCZTDCZ");
    assert_eq!(rows, ["first".to_string(), "x".repeat(40)]);

    // An answer many times the door's buffers, in small messages: rows cut at every
    // buffer's end.
    let sql = "SELECT g::text FROM generate_series(1, 20000) g";
    let mut query = BytesMut::new();
    query.put_u8(b'Q');
    query.put_u32(u32::try_from(sql.len() + 5).unwrap());
    query.put_slice(sql.as_bytes());
    query.put_u8(0);
    session.write_all(&query).await.unwrap();
    let mut expected = 1..=20_000;
    tokio::time::timeout(PATIENCE, async {
        loop {
            let (tag, body) = read_message(&mut session).await.unwrap();
            match tag {
                b'D' => {
                    let row = String::from_utf8_lossy(&body[6..]).into_owned();
                    assert_eq!(row, expected.next().unwrap().to_string());
                }
                b'Z' => break,
                _ => {}
            }
        }
    })
    .await
    .expect("the query answered");
    assert_eq!(expected.next(), None, "every row");
}

/// A client asking for protocol 3.2 and an unknown protocol option gets the server's
/// NegotiateProtocolVersion, relayed, and its session.
#[tokio::test]
async fn protocol_versions_are_negotiated_by_the_server() {
    let door = SweeperDoor::start().await;
    let mut stream = TcpStream::connect(door.addr()).await.unwrap();
    let packet = startup_with(
        0x0003_0002,
        &[
            ("user", "postgres"),
            ("database", door.db.db.name()),
            ("_pq_.fencegate_test", "1"),
        ],
    );
    stream.write_all(&packet).await.unwrap();
    let mut tags = Vec::new();
    loop {
        let (tag, body) = read_message(&mut stream).await.unwrap();
        assert_ne!(tag, b'E', "{}", String::from_utf8_lossy(&body));
        tags.push(tag);
        if tag == b'v' {
            // The newest version the server speaks, then the options it ignored.
            assert_eq!(&body[..4], &0x0003_0000u32.to_be_bytes(), "3.0");
            assert!(String::from_utf8_lossy(&body).contains("_pq_.fencegate_test"));
        }
        if tag == b'Z' {
            break;
        }
    }
    assert_eq!(tags.first(), Some(&b'v'), "{tags:?}");
}

/// Parse, Describe and Flush with no Sync (how asyncpg and postgres.js prepare): the
/// answers come at once, not when a Sync arrives.
#[tokio::test]
async fn a_flush_without_sync_is_answered_at_once() {
    let door = SweeperDoor::start().await;
    let mut session = raw_session(&door).await;
    let mut messages = BytesMut::new();
    let mut parse = BytesMut::new();
    parse.put_slice(b"\0SELECT $1::int + 1\0");
    parse.put_u16(0);
    for (tag, body) in [(b'P', &parse[..]), (b'D', &b"S\0"[..]), (b'H', &b""[..])] {
        messages.put_u8(tag);
        messages.put_u32(u32::try_from(body.len() + 4).unwrap());
        messages.put_slice(body);
    }
    session.write_all(&messages).await.unwrap();
    let mut tags = Vec::new();
    tokio::time::timeout(PATIENCE, async {
        while tags.len() < 3 {
            tags.push(read_message(&mut session).await.unwrap().0);
        }
    })
    .await
    .expect("ParseComplete, ParameterDescription and RowDescription without a Sync");
    assert_eq!(tags, [b'1', b't', b'T']);
}

#[tokio::test]
async fn gssapi_encryption_and_tls_are_declined_without_a_certificate() {
    let door = SweeperDoor::start().await;
    let mut stream = TcpStream::connect(door.addr()).await.unwrap();
    for code in [80_877_104u32, 80_877_103] {
        let mut request = BytesMut::new();
        request.put_u32(8);
        request.put_u32(code);
        stream.write_all(&request).await.unwrap();
        assert_eq!(stream.read_u8().await.unwrap(), b'N', "request {code}");
    }
    // Then the StartupMessage, in the clear.
    stream
        .write_all(&startup("postgres", door.db.db.name()))
        .await
        .unwrap();
    loop {
        let (tag, body) = read_message(&mut stream).await.unwrap();
        assert_ne!(tag, b'E', "{}", String::from_utf8_lossy(&body));
        if tag == b'Z' {
            break;
        }
    }
}

/// On SIGTERM an idle session is closed at once with 57P01; a session inside a
/// transaction may finish it first.
#[tokio::test]
async fn shutdown_closes_idle_sessions_and_lets_transactions_finish() {
    let mut door = SweeperDoor::start().await;
    let idle = door.writer("").await;
    let mut busy = door.writer("").await;
    let transaction = busy.transaction().await.unwrap();
    transaction
        .query_one("SELECT fencegate.fence('sweeper', 42)", &[])
        .await
        .unwrap();

    door.gateway.signal("TERM");
    eventually(PATIENCE, "the idle session is closed", || async {
        idle.is_closed()
    })
    .await;
    transaction
        .execute("UPDATE sweep_state SET note = 'finished' WHERE id = 1", &[])
        .await
        .expect("the open transaction goes on");
    transaction.commit().await.expect("and commits");
    let status = door.gateway.wait().await;
    assert!(status.success(), "{status}");
    assert_eq!(door.note().await, "finished");
}

/// Through the door, one transaction fences two resources: a stale token for one is
/// counted as that resource's rejection, the whole transaction is rolled back (neither
/// table written, neither fence raised), and with both tokens current both commit.
#[tokio::test]
async fn one_transaction_through_the_door_fences_two_resources() {
    let door = SweeperDoor::start().await;
    door.db
        .execute("CREATE TABLE invoices_sent (id int PRIMARY KEY)")
        .await;
    door.db.protect("invoices_sent", "mailer").await;
    door.db.raise("mailer", 3).await;
    door.db.raise("sweeper", 2).await;
    let writer = door.writer("").await;
    let step = |sweeper: i64, mailer: i64| {
        format!(
            "BEGIN; SELECT fencegate.fence('mailer', {mailer}), fencegate.fence('sweeper', {sweeper});
             UPDATE sweep_state SET note = 'swept with the mailer' WHERE id = 1;
             INSERT INTO invoices_sent VALUES (123);
             COMMIT;"
        )
    };
    let refused = writer.batch_execute(&step(2, 2)).await.unwrap_err();
    assert_eq!(
        detail_fields(fence_error(&refused)),
        Some("resource=mailer presented=2 highest=3")
    );
    writer.batch_execute("ROLLBACK").await.unwrap();
    assert_ne!(door.note().await, "swept with the mailer");
    assert_eq!(door.db.count("invoices_sent").await, 0);
    assert_eq!(door.db.highest("sweeper").await, Some(2));
    assert_eq!(
        door.metric("fencegate_stale_rejections_total{resource=\"mailer\"}")
            .await,
        1.0
    );
    assert_eq!(
        door.metric("fencegate_stale_rejections_total{resource=\"sweeper\"}")
            .await,
        0.0
    );

    writer.batch_execute(&step(5, 4)).await.unwrap();
    assert_eq!(door.note().await, "swept with the mailer");
    assert_eq!(door.db.count("invoices_sent").await, 1);
    assert_eq!(
        (
            door.db.highest("sweeper").await,
            door.db.highest("mailer").await
        ),
        (Some(5), Some(4))
    );
}
