//! The relay on its own: a scripted client and a scripted server on in-memory pipes,
//! with a recorder for the observer. Every protocol edge the door's end-to-end tests
//! reach only through real drivers and a real server is tried here in milliseconds.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter, DuplexStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::super::wire::{self, backend, frontend, ProtocolError, WireError};
use super::{relay, Ending, Observer};

/// What the relay told its observer.
#[derive(Default)]
struct Recorder {
    max_message: usize,
    primary_only: bool,
    shutdown: CancellationToken,
    from_client: AtomicUsize,
    to_client: AtomicUsize,
    server_errors: Mutex<Vec<Vec<u8>>>,
    protocol_errors: Mutex<Vec<String>>,
    not_primary: AtomicUsize,
}

impl Observer for Recorder {
    fn max_message(&self) -> usize {
        self.max_message
    }
    fn primary_only(&self) -> bool {
        self.primary_only
    }
    fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }
    fn bytes_from_client(&self, bytes: usize) {
        self.from_client.fetch_add(bytes, Ordering::Relaxed);
    }
    fn bytes_to_client(&self, bytes: usize) {
        self.to_client.fetch_add(bytes, Ordering::Relaxed);
    }
    fn server_error(&self, body: &[u8]) {
        self.server_errors.lock().unwrap().push(body.to_vec());
    }
    fn protocol_error(&self, error: &ProtocolError) {
        self.protocol_errors.lock().unwrap().push(error.to_string());
    }
    fn not_primary(&self) {
        self.not_primary.fetch_add(1, Ordering::Relaxed);
    }
}

/// A relay running between a scripted client and a scripted server.
struct Relayed {
    client: DuplexStream,
    server: DuplexStream,
    observer: Arc<Recorder>,
    ended: JoinHandle<Result<Ending, WireError>>,
}

/// How long a test waits for something that must happen.
const SOON: Duration = Duration::from_secs(5);
/// How long a test waits to see that something does not happen.
const A_WHILE: Duration = Duration::from_millis(200);

impl Relayed {
    /// The relay of a session whose login left it in `status`, each of its four buffers
    /// `buffer` bytes long, over pipes that hold a megabyte each way.
    fn start(observer: Recorder, status: u8, buffer: usize) -> Relayed {
        Relayed::over_pipes(observer, status, buffer, 1 << 20)
    }

    /// The same, over pipes that hold `pipe` bytes each way.
    fn over_pipes(observer: Recorder, status: u8, buffer: usize, pipe: usize) -> Relayed {
        let observer = Arc::new(observer);
        let (client, door_client) = tokio::io::duplex(pipe);
        let (server, door_server) = tokio::io::duplex(pipe);
        let ended = tokio::spawn({
            let observer = Arc::clone(&observer);
            async move {
                let (client_read, client_write) = tokio::io::split(door_client);
                let (upstream_read, upstream_write) = tokio::io::split(door_server);
                let mut client_read = BufReader::with_capacity(buffer, client_read);
                let mut client_write = BufWriter::with_capacity(buffer, client_write);
                let mut upstream_read = BufReader::with_capacity(buffer, upstream_read);
                let mut upstream_write = BufWriter::with_capacity(buffer, upstream_write);
                relay(
                    &*observer,
                    (&mut client_read, &mut client_write),
                    (&mut upstream_read, &mut upstream_write),
                    status,
                )
                .await
            }
        });
        Relayed {
            client,
            server,
            observer,
            ended,
        }
    }

    /// An idle session with the door's message cap and buffers.
    fn idle() -> Relayed {
        Relayed::start(observer(), b'I', 16 << 10)
    }

    /// The client sends `bytes`; the server must read them unchanged.
    async fn client_sends(&mut self, bytes: &[u8]) {
        self.client.write_all(bytes).await.unwrap();
        assert_eq!(read_exactly(&mut self.server, bytes.len()).await, bytes);
    }

    /// The server sends `bytes`; the client must read them unchanged.
    async fn server_sends(&mut self, bytes: &[u8]) {
        self.server.write_all(bytes).await.unwrap();
        assert_eq!(read_exactly(&mut self.client, bytes.len()).await, bytes);
    }

    /// The ErrorResponse bodies the observer was given.
    fn server_errors(&self) -> Vec<Vec<u8>> {
        self.observer.server_errors.lock().unwrap().clone()
    }

    async fn ending(self) -> Result<Ending, WireError> {
        tokio::time::timeout(SOON, self.ended)
            .await
            .expect("the relay ends")
            .expect("the relay does not panic")
    }
}

fn observer() -> Recorder {
    Recorder {
        max_message: 1 << 20,
        ..Recorder::default()
    }
}

fn query(sql: &str) -> Vec<u8> {
    wire::message(frontend::QUERY, format!("{sql}\0").as_bytes()).to_vec()
}

fn ready(status: u8) -> Vec<u8> {
    wire::message(backend::READY_FOR_QUERY, &[status]).to_vec()
}

fn command_complete(tag: &str) -> Vec<u8> {
    wire::message(b'C', format!("{tag}\0").as_bytes()).to_vec()
}

fn error_response(code: &str, detail: &str) -> Vec<u8> {
    let mut body = Vec::new();
    for (field, value) in [
        (b'S', "ERROR"),
        (b'C', code),
        (b'M', "refused"),
        (b'D', detail),
    ] {
        body.push(field);
        body.extend_from_slice(value.as_bytes());
        body.push(0);
    }
    body.push(0);
    wire::message(backend::ERROR_RESPONSE, &body).to_vec()
}

fn parameter_status(name: &str, value: &str) -> Vec<u8> {
    wire::message(
        backend::PARAMETER_STATUS,
        format!("{name}\0{value}\0").as_bytes(),
    )
    .to_vec()
}

/// Reads exactly `len` bytes.
async fn read_exactly(stream: &mut DuplexStream, len: usize) -> Vec<u8> {
    let mut bytes = vec![0; len];
    tokio::time::timeout(SOON, stream.read_exact(&mut bytes))
        .await
        .expect("the bytes arrive")
        .expect("the stream stays open");
    bytes
}

/// Reads one message: its tag and body.
async fn read_message(stream: &mut DuplexStream) -> (u8, Vec<u8>) {
    let header = read_exactly(stream, 5).await;
    let len = u32::from_be_bytes(header[1..5].try_into().unwrap()) as usize;
    (header[0], read_exactly(stream, len - 4).await)
}

/// The SQLSTATE of a FATAL ErrorResponse, which must be what `stream` reads next.
async fn read_fatal(stream: &mut DuplexStream) -> String {
    let (tag, body) = read_message(stream).await;
    assert_eq!(tag, backend::ERROR_RESPONSE, "an ErrorResponse");
    let field = |name| {
        wire::error_fields(&body)
            .find(|(field, _)| *field == name)
            .map(|(_, value)| String::from_utf8_lossy(value).into_owned())
    };
    assert_eq!(field(b'S').as_deref(), Some("FATAL"));
    field(b'C').expect("a SQLSTATE")
}

/// Everything `stream` reads until its other end is gone.
async fn read_to_end(stream: &mut DuplexStream) -> Vec<u8> {
    let mut bytes = Vec::new();
    tokio::time::timeout(SOON, stream.read_to_end(&mut bytes))
        .await
        .expect("the other end closes")
        .expect("the stream reads");
    bytes
}

/// Whether `stream` stays silent for a while.
async fn silent(stream: &mut DuplexStream) -> bool {
    let mut byte = [0; 1];
    tokio::time::timeout(A_WHILE, stream.read(&mut byte))
        .await
        .is_err()
}

#[tokio::test]
async fn pipelined_messages_pass_through_unchanged_both_ways_and_are_counted() {
    let mut relayed = Relayed::idle();
    let mut asked = Vec::new();
    asked.extend(wire::message(frontend::PARSE, b"\0SELECT $1\0\0\0"));
    asked.extend(wire::message(
        frontend::BIND,
        b"\0\0\0\0\0\x01\0\0\0\x011\0\0",
    ));
    asked.extend(wire::message(frontend::EXECUTE, b"\0\0\0\0\0"));
    asked.extend(wire::message(frontend::SYNC, b""));
    relayed.client_sends(&asked).await;

    let mut answered = Vec::new();
    answered.extend(wire::message(b'1', b""));
    answered.extend(wire::message(b'2', b""));
    answered.extend(wire::message(b'D', b"\0\x01\0\0\0\x011"));
    answered.extend(command_complete("SELECT 1"));
    answered.extend(ready(b'I'));
    relayed.server_sends(&answered).await;

    let observer = Arc::clone(&relayed.observer);
    drop(relayed.client);
    assert_eq!(relayed.ended.await.unwrap().unwrap(), Ending::ClientClosed);
    assert_eq!(observer.from_client.load(Ordering::Relaxed), asked.len());
    assert_eq!(observer.to_client.load(Ordering::Relaxed), answered.len());
}

#[tokio::test]
async fn messages_larger_than_the_buffers_stream_through_in_pieces() {
    // 64-byte buffers: every message below spans many reads.
    let mut relayed = Relayed::start(observer(), b'I', 64);
    let sql = format!("SELECT '{}'", "x".repeat(100_000));
    let asked = [query(&sql), query("SELECT 2")].concat();
    // The pipes hold a megabyte: each side writes all, then the other reads.
    relayed.client_sends(&asked).await;

    let row = wire::message(b'D', &vec![7; 200_000]).to_vec();
    let error = error_response("23505", &"d".repeat(5_000));
    let answered = [row, error.clone(), ready(b'I')].concat();
    relayed.server_sends(&answered).await;
    // The error, read in pieces, still reached the observer whole.
    assert_eq!(relayed.server_errors(), &[error[5..].to_vec()]);
    assert_eq!(
        relayed.observer.from_client.load(Ordering::Relaxed),
        asked.len()
    );
}

#[tokio::test]
async fn a_flush_without_a_sync_goes_out_at_once_and_so_does_its_reply() {
    let mut relayed = Relayed::idle();
    let asked = [
        wire::message(frontend::PARSE, b"s1\0SELECT 1\0\0\0").to_vec(),
        wire::message(frontend::FLUSH, b"").to_vec(),
    ]
    .concat();
    relayed.client.write_all(&asked).await.unwrap();
    // The client sends nothing more, and waits: the relay must not hold the batch back
    // for a Sync that is not coming.
    assert_eq!(read_exactly(&mut relayed.server, asked.len()).await, asked);
    let parse_complete = wire::message(b'1', b"").to_vec();
    relayed.server.write_all(&parse_complete).await.unwrap();
    assert_eq!(read_message(&mut relayed.client).await, (b'1', Vec::new()));
}

#[tokio::test]
async fn an_oversized_message_ends_the_session_with_08p01_and_none_of_it_reaches_the_server() {
    let mut relayed = Relayed::start(
        Recorder {
            max_message: 1024,
            ..observer()
        },
        b'I',
        16 << 10,
    );
    // Only the header: the relay must refuse before it reads or passes on the body.
    let mut header = vec![frontend::QUERY];
    header.extend_from_slice(&2_000u32.to_be_bytes());
    relayed.client.write_all(&header).await.unwrap();
    assert_eq!(read_fatal(&mut relayed.client).await, "08P01");
    let Relayed {
        mut server,
        observer,
        ended,
        ..
    } = relayed;
    assert_eq!(ended.await.unwrap().unwrap(), Ending::ProtocolError);
    assert_eq!(read_to_end(&mut server).await, b"");
    assert_eq!(observer.protocol_errors.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn an_unknown_message_type_ends_the_session_with_08p01() {
    let mut relayed = Relayed::idle();
    relayed
        .client
        .write_all(&wire::message(b'?', b"what"))
        .await
        .unwrap();
    assert_eq!(read_fatal(&mut relayed.client).await, "08P01");
    let observer = Arc::clone(&relayed.observer);
    assert_eq!(relayed.ending().await.unwrap(), Ending::ProtocolError);
    let told = observer.protocol_errors.lock().unwrap();
    assert_eq!(told.len(), 1);
    assert!(told[0].contains('?'), "{told:?}");
}

#[tokio::test]
async fn a_protocol_error_is_told_between_two_server_messages_never_inside_one() {
    // Small buffers, so the server's row is in flight, half relayed, when the client
    // breaks the protocol.
    let mut relayed = Relayed::start(observer(), b'I', 64);
    relayed
        .client
        .write_all(&query("SELECT big"))
        .await
        .unwrap();
    read_exactly(&mut relayed.server, query("SELECT big").len()).await;
    let row = wire::message(b'D', &[1; 10_000]).to_vec();
    relayed.server.write_all(&row[..5_000]).await.unwrap();
    read_exactly(&mut relayed.client, 4_000).await;

    relayed
        .client
        .write_all(&wire::message(b'?', b""))
        .await
        .unwrap();
    tokio::time::sleep(A_WHILE).await;
    relayed.server.write_all(&row[5_000..]).await.unwrap();
    // The rest of the row first, whole, then the FATAL error.
    assert_eq!(
        read_exactly(&mut relayed.client, row.len() - 4_000).await,
        row[4_000..]
    );
    assert_eq!(read_fatal(&mut relayed.client).await, "08P01");
    assert_eq!(relayed.ending().await.unwrap(), Ending::ProtocolError);
}

#[tokio::test]
async fn terminate_is_passed_on_and_ends_the_session() {
    let mut relayed = Relayed::idle();
    let terminate = wire::message(frontend::TERMINATE, b"").to_vec();
    relayed.client.write_all(&terminate).await.unwrap();
    assert_eq!(read_exactly(&mut relayed.server, 5).await, terminate);
    assert_eq!(relayed.ending().await.unwrap(), Ending::Terminated);
}

#[tokio::test]
async fn a_client_that_leaves_idle_is_told_apart_from_one_that_leaves_mid_statement() {
    let relayed = Relayed::idle();
    drop(relayed.client);
    assert_eq!(relayed.ended.await.unwrap().unwrap(), Ending::ClientClosed);

    let mut relayed = Relayed::idle();
    relayed
        .client
        .write_all(&query("SELECT pg_sleep(60)"))
        .await
        .unwrap();
    read_message(&mut relayed.server).await;
    drop(relayed.client);
    assert_eq!(
        relayed.ended.await.unwrap().unwrap(),
        Ending::ClientLeftRunning
    );

    // Answered: idle again.
    let mut relayed = Relayed::idle();
    relayed.client.write_all(&query("SELECT 1")).await.unwrap();
    read_message(&mut relayed.server).await;
    relayed.server.write_all(&ready(b'I')).await.unwrap();
    read_message(&mut relayed.client).await;
    drop(relayed.client);
    assert_eq!(relayed.ended.await.unwrap().unwrap(), Ending::ClientClosed);
}

#[tokio::test]
async fn a_server_that_closes_ends_the_session() {
    let relayed = Relayed::idle();
    drop(relayed.server);
    assert_eq!(relayed.ended.await.unwrap().unwrap(), Ending::ServerClosed);
}

#[tokio::test]
async fn shutdown_ends_an_idle_session_at_once_with_57p01() {
    let mut relayed = Relayed::idle();
    relayed.observer.shutdown.cancel();
    assert_eq!(read_fatal(&mut relayed.client).await, "57P01");
    assert_eq!(relayed.ending().await.unwrap(), Ending::Shutdown);
}

#[tokio::test]
async fn shutdown_lets_a_running_statement_answer_before_it_closes() {
    let mut relayed = Relayed::idle();
    let asked = query("UPDATE t SET v = 1");
    relayed.client.write_all(&asked).await.unwrap();
    read_exactly(&mut relayed.server, asked.len()).await;
    relayed.observer.shutdown.cancel();
    assert!(silent(&mut relayed.client).await, "closed while running");

    let answered = [command_complete("UPDATE 1"), ready(b'I')].concat();
    relayed.server_sends(&answered).await;
    assert_eq!(read_fatal(&mut relayed.client).await, "57P01");
    assert_eq!(relayed.ending().await.unwrap(), Ending::Shutdown);
}

#[tokio::test]
async fn shutdown_waits_for_an_open_transaction_to_end() {
    // The login left the session idle; the client then opens a transaction.
    let mut relayed = Relayed::idle();
    relayed.client.write_all(&query("BEGIN")).await.unwrap();
    read_message(&mut relayed.server).await;
    relayed
        .server
        .write_all(&[command_complete("BEGIN"), ready(b'T')].concat())
        .await
        .unwrap();
    read_message(&mut relayed.client).await;
    assert_eq!(read_message(&mut relayed.client).await, (b'Z', vec![b'T']));

    relayed.observer.shutdown.cancel();
    assert!(
        silent(&mut relayed.client).await,
        "closed inside a transaction"
    );

    relayed.client.write_all(&query("COMMIT")).await.unwrap();
    read_message(&mut relayed.server).await;
    relayed
        .server
        .write_all(&[command_complete("COMMIT"), ready(b'I')].concat())
        .await
        .unwrap();
    read_message(&mut relayed.client).await;
    assert_eq!(read_message(&mut relayed.client).await, (b'Z', vec![b'I']));
    assert_eq!(read_fatal(&mut relayed.client).await, "57P01");
    assert_eq!(relayed.ending().await.unwrap(), Ending::Shutdown);
}

#[tokio::test]
async fn shutdown_of_a_session_whose_login_left_a_transaction_open_waits_too() {
    let mut relayed = Relayed::start(observer(), b'T', 16 << 10);
    relayed.observer.shutdown.cancel();
    assert!(
        silent(&mut relayed.client).await,
        "closed inside a transaction"
    );
    relayed.client.write_all(&query("ROLLBACK")).await.unwrap();
    read_message(&mut relayed.server).await;
    relayed.server.write_all(&ready(b'I')).await.unwrap();
    assert_eq!(read_message(&mut relayed.client).await, (b'Z', vec![b'I']));
    assert_eq!(read_fatal(&mut relayed.client).await, "57P01");
}

#[tokio::test]
async fn server_errors_reach_the_observer_and_the_client_unchanged() {
    let mut relayed = Relayed::idle();
    relayed.client.write_all(&query("INSERT")).await.unwrap();
    read_message(&mut relayed.server).await;
    let error = error_response("ZF001", "resource=orders token=3 fence=4");
    let answered = [error.clone(), ready(b'I')].concat();
    relayed.server_sends(&answered).await;
    assert_eq!(relayed.server_errors(), &[error[5..].to_vec()]);
    // A notice (`N`) and a row are not errors.
    relayed
        .server
        .write_all(&wire::message(b'N', b"SNOTICE\0\0"))
        .await
        .unwrap();
    read_message(&mut relayed.client).await;
    assert_eq!(relayed.observer.server_errors.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn a_server_turning_read_only_ends_a_primary_only_session_with_08006() {
    let mut relayed = Relayed::start(
        Recorder {
            primary_only: true,
            ..observer()
        },
        b'I',
        16 << 10,
    );
    // Another setting is relayed as it is.
    let timezone = parameter_status("TimeZone", "UTC");
    relayed.server_sends(&timezone).await;

    relayed
        .server
        .write_all(&parameter_status("default_transaction_read_only", "on"))
        .await
        .unwrap();
    // The ParameterStatus itself is not relayed: the FATAL error stands in its place.
    assert_eq!(read_fatal(&mut relayed.client).await, "08006");
    let observer = Arc::clone(&relayed.observer);
    assert_eq!(relayed.ending().await.unwrap(), Ending::NotPrimary);
    assert_eq!(observer.not_primary.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn a_server_turning_read_only_is_relayed_when_any_server_will_do() {
    let mut relayed = Relayed::idle();
    for (name, value) in [
        ("in_hot_standby", "on"),
        ("default_transaction_read_only", "on"),
    ] {
        let status = parameter_status(name, value);
        relayed.server_sends(&status).await;
    }
    assert_eq!(relayed.observer.not_primary.load(Ordering::Relaxed), 0);
    assert!(!relayed.ended.is_finished());
}

#[tokio::test]
async fn a_slow_client_stops_the_relay_reading_from_the_server() {
    // Small pipes: the server's row fills the client's pipe and the relay's buffers,
    // and then the server's writes wait, rather than the door holding the row.
    let Relayed {
        mut client,
        mut server,
        ended,
        ..
    } = Relayed::over_pipes(observer(), b'I', 4 << 10, 4 << 10);
    let row = wire::message(b'D', &vec![9; 1 << 20]).to_vec();
    let writing = tokio::spawn({
        let row = row.clone();
        async move {
            server.write_all(&row).await.unwrap();
            server
        }
    });
    tokio::time::sleep(A_WHILE).await;
    assert!(
        !writing.is_finished(),
        "a megabyte went in with nobody reading it"
    );
    // Once the client reads, it all arrives, and the server's write completes.
    assert_eq!(read_exactly(&mut client, row.len()).await, row);
    let _server = tokio::time::timeout(SOON, writing).await.unwrap().unwrap();
    ended.abort();
}
