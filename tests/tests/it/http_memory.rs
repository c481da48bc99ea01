//! Memory bounded per request and per client: clients that do not read their answers
//! (HTTP/1.1 with a full socket, HTTP/2 streams whose windows stay shut) hold a bounded
//! amount and are closed after `--write-timeout`; a `/v1/sql` answer is cut at
//! `--sql-max-response`; one client's idle or slow bodies take only its share of
//! `--max-writes-in-flight` and `--max-body-memory`; an early answer over HTTP/2 reaches
//! curl whole. Memory is read from outside, from `/proc/<pid>/status`.

use std::net::{IpAddr, SocketAddr};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use fencegate_tests::db::TestDb;
use fencegate_tests::deployment::DataDir;
use fencegate_tests::eventually;
use fencegate_tests::gateway::{Gateway, GatewayBuilder};
use fencegate_tests::http::{kv_path, Client};
use fencegate_tests::tls::Certs;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// The size of the object the readers ask for.
const OBJECT: usize = 4 << 20;

fn rss_mib(pid: u32) -> u64 {
    fencegate_tests::rss_bytes(pid) >> 20
}

fn embedded(data: &DataDir) -> GatewayBuilder {
    Gateway::builder().args(&["--data-dir", &data.0.display().to_string()])
}

/// A gateway holding one object of [`OBJECT`] bytes at `big/obj`, with `flags`.
async fn with_large_object(data: &DataDir, flags: &[&str]) -> Gateway {
    let gateway = embedded(data)
        .args(&["--max-body", "8MiB", "--max-response-memory", "32MiB"])
        .args(flags)
        .spawn()
        .await;
    let put = gateway
        .client()
        .put("big", "obj", 1, vec![b'o'; OBJECT])
        .await;
    assert_eq!(put.status, 201, "{:?}", put.body);
    gateway
}

/// The highest RSS of `pid` over `window`, sampled every 20 ms.
async fn peak_rss_mib(pid: u32, window: Duration) -> u64 {
    let until = tokio::time::Instant::now() + window;
    let mut peak = rss_mib(pid);
    while tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
        peak = peak.max(rss_mib(pid));
    }
    peak
}

async fn metric(client: &Client, series: &str) -> f64 {
    client.metric(series).await.unwrap_or(0.0)
}

/// A connection from `source` to `to`, with a small receive buffer: the kernel holds
/// little of what the client does not read.
async fn connect_from(source: IpAddr, to: SocketAddr, receive_buffer: Option<u32>) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    if let Some(size) = receive_buffer {
        socket.set_recv_buffer_size(size).unwrap();
    }
    socket.bind(SocketAddr::new(source, 0)).unwrap();
    socket.connect(to).await.unwrap()
}

/// 60 HTTP/1.1 clients ask for a 4 MiB object and never read (240 MiB of answers):
/// the gateway holds at most `--max-response-memory` of them, answers the rest 503, and
/// closes the stalled connections after the write deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_clients_that_do_not_read_hold_bounded_memory_and_are_closed() {
    let data = DataDir::create();
    let gateway = with_large_object(&data, &["--write-timeout", "2s"]).await;
    let client = gateway.client();
    let before = rss_mib(gateway.pid());
    let mut sockets = Vec::new();
    for _ in 0..60 {
        let mut socket =
            connect_from(IpAddr::from([127, 0, 0, 1]), gateway.addr(), Some(4096)).await;
        socket
            .write_all(
                format!(
                    "GET {} HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n",
                    kv_path("big", "obj")
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        sockets.push(socket);
    }
    let peak = peak_rss_mib(gateway.pid(), Duration::from_millis(1500)).await;
    let grew = peak.saturating_sub(before);
    assert!(
        grew < 96,
        "RSS grew {grew} MiB with 60 unread 4 MiB answers and --max-response-memory 32MiB"
    );
    let refused = metric(
        &client,
        "fencegate_limit_rejections_total{reason=\"response_memory\"}",
    )
    .await;
    assert!(refused >= 40.0, "{refused} answers refused over the budget");
    eventually(
        Duration::from_secs(10),
        "stalled connections closed",
        || async { metric(&client, "fencegate_response_bytes_pending").await == 0.0 },
    )
    .await;
    let closed = metric(
        &client,
        "fencegate_connections_closed_total{reason=\"write_timeout\"}",
    )
    .await;
    assert!(
        closed >= 1.0,
        "{closed} connections closed at the write deadline"
    );
    // A stalled connection ended with its answer cut: the client reads what the kernel
    // held, then the end of the connection.
    let mut cut = 0;
    for socket in &mut sockets {
        let mut answer = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(2), socket.read_to_end(&mut answer)).await;
        if answer.starts_with(b"HTTP/1.1 200") {
            assert!(
                read.is_ok(),
                "a stalled connection is closed, not kept open"
            );
            assert!(answer.len() < OBJECT, "the answer was cut, not sent whole");
            cut += 1;
        } else {
            assert!(
                answer.starts_with(b"HTTP/1.1 503"),
                "{}",
                String::from_utf8_lossy(&answer[..answer.len().min(200)])
            );
        }
    }
    assert!(cut >= 1, "some answers were started and cut");
    // The budget is free again: an honest reader gets the whole object.
    let get = client.get("big", "obj").await;
    assert_eq!((get.status, get.body.len()), (200, OBJECT));
}

/// Two HTTP/2 connections open 60 streams each for the 4 MiB object and read none of
/// them: each connection holds at most `--max-pending-answers` large answers, memory
/// stays bounded, and the connections are closed when their answers make no progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_with_shut_windows_hold_bounded_memory_and_are_closed() {
    let data = DataDir::create();
    let gateway = with_large_object(
        &data,
        &["--write-timeout", "2s", "--max-pending-answers", "4"],
    )
    .await;
    let client = gateway.client();
    let before = rss_mib(gateway.pid());
    let mut held = Vec::new();
    for _ in 0..2 {
        let h2 = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http::<Full<Bytes>>();
        let mut streams = tokio::task::JoinSet::new();
        for _ in 0..60 {
            let (h2, url) = (
                h2.clone(),
                format!("{}{}", gateway.url(), kv_path("big", "obj")),
            );
            streams.spawn(async move {
                let request = http::Request::get(url)
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                h2.request(request).await
            });
        }
        let mut statuses = Vec::new();
        while let Some(response) = streams.join_next().await {
            let response = response.unwrap().expect("the stream is answered");
            statuses.push(response.status().as_u16());
            // Held, never read: its stream's window stays shut once it is full.
            held.push(response);
        }
        let started = statuses.iter().filter(|s| **s == 200).count();
        assert!(started <= 4, "{started} large answers on one connection");
        assert!(
            statuses.iter().all(|s| matches!(s, 200 | 503)),
            "{statuses:?}"
        );
    }
    let peak = peak_rss_mib(gateway.pid(), Duration::from_millis(1000)).await;
    let grew = peak.saturating_sub(before);
    assert!(
        grew < 96,
        "RSS grew {grew} MiB with 120 unread 4 MiB answers over HTTP/2"
    );
    // The first connection meets its own cap; the second, the budget (8 x 4 MiB).
    assert!(
        metric(
            &client,
            "fencegate_limit_rejections_total{reason=\"pending_answers\"}"
        )
        .await
            >= 50.0
    );
    eventually(
        Duration::from_secs(10),
        "stalled HTTP/2 connections closed",
        || async {
            metric(
                &client,
                "fencegate_connections_closed_total{reason=\"answers_stalled\"}",
            )
            .await
                >= 2.0
        },
    )
    .await;
    // Their bodies end in an error: the answers were cut, not completed.
    for response in held.into_iter().filter(|r| r.status() == 200) {
        let read =
            tokio::time::timeout(Duration::from_secs(5), response.into_body().collect()).await;
        assert!(
            matches!(read, Ok(Err(_))),
            "a stalled stream ends with its connection"
        );
    }
    eventually(
        Duration::from_secs(5),
        "answer memory given back",
        || async { metric(&client, "fencegate_response_bytes_pending").await == 0.0 },
    )
    .await;
}

/// A `/v1/sql` answer of about 2 MB is cut at `--sql-max-response 64KiB`: the rows
/// that fit are returned, the rest counted, and the answer says which bound cut it.
#[tokio::test]
async fn a_large_sql_answer_is_cut_at_sql_max_response() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder()
        .database(&db.url())
        .sql_as(&db.writer().await)
        .args(&["--sql-max-response", "64KiB"])
        .spawn()
        .await;
    let reply = gateway
        .client()
        .sql(
            "r",
            1,
            json!({"statements": [
                {"sql": "SELECT n, repeat('x', 1000) AS pad FROM generate_series(1, 2000) AS n"},
                {"sql": "SELECT 1 AS one"},
            ]}),
        )
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert!(
        reply.body.len() < 80 * 1024,
        "answer of {} bytes",
        reply.body.len()
    );
    let results = &reply.json()["results"];
    let rows = results[0]["rows"].as_array().unwrap();
    assert!((50..70).contains(&rows.len()), "{} rows kept", rows.len());
    // The rows kept are the first ones, in order.
    assert_eq!(rows[0][0], 1);
    assert_eq!(rows[rows.len() - 1][0], rows.len());
    assert_eq!(results[0]["truncated"], true);
    assert_eq!(results[0]["truncated_by"], "bytes");
    assert_eq!(results[0]["rows_affected"], 2000);
    // The budget is the whole answer's: the next statement's row is left out too.
    assert_eq!(results[1]["rows"], json!([]));
    assert_eq!(results[1]["truncated_by"], "bytes");
}

/// Clients that send `/v1/sql` transactions with 3 MB answers, fresh or replays of a
/// stored one, and never read: each transaction claims room for its answer at
/// `--sql-max-response` before it runs, so no more answers are held than
/// `--max-response-memory` takes and the others are refused (`response_memory`)
/// before they run; nothing is held once the stalled connections are closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_answers_nobody_reads_stay_within_the_response_budget() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder()
        .database(&db.url())
        .sql_as(&db.writer().await)
        .args(&[
            "--max-response-memory",
            "8MiB",
            "--sql-max-response",
            "4MiB",
            "--idempotency-max-answer",
            "4MiB",
            "--write-timeout",
            "2s",
        ])
        .spawn()
        .await;
    let client = gateway.client();
    let body = json!({"statements": [{"sql": "SELECT repeat('x', 3000000) AS big"}]}).to_string();
    // One keyed answer, stored and read whole, to be replayed.
    let stored = client
        .request(
            http::Method::POST,
            "/v1/sql/r",
            &[("fencing-token", "1"), ("idempotency-key", "big")],
            body.clone(),
        )
        .await;
    assert_eq!(stored.status, 200, "{:?}", stored.body);
    assert!(stored.body.len() > 3_000_000);

    let mut sockets = Vec::new();
    for n in 0..12 {
        let mut socket =
            connect_from(IpAddr::from([127, 0, 0, 1]), gateway.addr(), Some(4096)).await;
        let key = if n % 2 == 0 {
            "idempotency-key: big\r\n"
        } else {
            ""
        };
        socket
            .write_all(
                format!(
                    "POST /v1/sql/r HTTP/1.1\r\nhost: gw\r\nfencing-token: 1\r\n{key}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        sockets.push(socket);
    }
    let mut most = 0.0f64;
    for _ in 0..20 {
        most = most.max(metric(&client, "fencegate_response_bytes_pending").await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        most <= (8 << 20) as f64,
        "{most} bytes of answers held past --max-response-memory 8MiB"
    );
    let refused = metric(
        &client,
        "fencegate_limit_rejections_total{reason=\"response_memory\"}",
    )
    .await;
    assert!(refused >= 10.0, "{refused} of 12 refused with room for two");
    eventually(
        Duration::from_secs(10),
        "stalled connections closed and their answers dropped",
        || async { metric(&client, "fencegate_response_bytes_pending").await == 0.0 },
    )
    .await;
    drop(sockets);
}

/// Writes whose bodies never start, or stop after a byte or part-way: body memory is
/// claimed as bytes come, so bodies that declare much and send a byte hold little,
/// from however many addresses; a peer holds at most its share of the writes in flight
/// and of the body memory its bytes take; the writes that never start end after
/// `--body-first-byte-timeout`; another peer's writes all land meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peers_idle_bodies_leave_room_for_other_peers_writes() {
    let data = DataDir::create();
    let gateway = embedded(&data)
        .args(&[
            "--max-writes-in-flight",
            "64",
            "--max-body-memory",
            "8MiB",
            "--max-client-share",
            "25",
            "--body-timeout",
            "30s",
        ])
        .spawn()
        .await;
    let client = gateway.client();
    let put = |key: &str, length: usize| {
        format!(
            "PUT {} HTTP/1.1\r\nhost: gw\r\nfencing-token: 1\r\ncontent-length: {length}\r\n\r\n",
            kv_path("victim", key)
        )
    };
    // 127.0.0.2: 24 writes that declare 1000 bytes and send none. Its share of the
    // writes in flight is 16 of 64: the other 8 are refused at once.
    let mut idle = Vec::new();
    for i in 0..24 {
        let mut socket = connect_from(IpAddr::from([127, 0, 0, 2]), gateway.addr(), None).await;
        socket
            .write_all(put(&format!("i{i}"), 1000).as_bytes())
            .await
            .unwrap();
        idle.push(socket);
    }
    let started = tokio::time::Instant::now();
    let answers = first_answers(&mut idle, Duration::from_millis(300)).await;
    let refused = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 503"))
        .count();
    assert_eq!(refused, 8, "{answers:?}");
    let mut holding: Vec<TcpStream> = idle
        .into_iter()
        .zip(&answers)
        .filter(|(_, answer)| answer.is_empty())
        .map(|(socket, _)| socket)
        .collect();
    assert_eq!(
        metric(
            &client,
            "fencegate_limit_rejections_total{reason=\"writes_share\"}"
        )
        .await,
        8.0
    );
    // 127.0.0.3 to .7: 4 writes each that declare 1 MiB and send one byte (20 MiB
    // declared against 8 MiB of body memory). Memory is claimed as bytes come, not by
    // the declared length: they hold little, and none is refused.
    let mut slow = Vec::new();
    for peer in 3..=7u8 {
        for i in 0..4 {
            let mut socket =
                connect_from(IpAddr::from([127, 0, 0, peer]), gateway.addr(), None).await;
            socket
                .write_all(put(&format!("s{peer}-{i}"), 1 << 20).as_bytes())
                .await
                .unwrap();
            socket.write_all(b"x").await.unwrap();
            slow.push(socket);
        }
    }
    let answers = first_answers(&mut slow, Duration::from_millis(300)).await;
    assert!(answers.iter().all(String::is_empty), "{answers:?}");
    // 127.0.0.8: 8 writes that send 600 KiB of their 1 MiB and stall. Its share of
    // body memory is 2 MiB of 8: most are refused as their bytes come.
    let mut heavy = Vec::new();
    for i in 0..8 {
        let mut socket = connect_from(IpAddr::from([127, 0, 0, 8]), gateway.addr(), None).await;
        socket
            .write_all(put(&format!("h{i}"), 1 << 20).as_bytes())
            .await
            .unwrap();
        let _ = tokio::time::timeout(
            Duration::from_millis(200),
            socket.write_all(&vec![b'h'; 600 << 10]),
        )
        .await;
        heavy.push(socket);
    }
    let answers = first_answers(&mut heavy, Duration::from_millis(500)).await;
    let refused = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 503"))
        .count();
    assert!(refused >= 4, "{answers:?}");
    assert_eq!(
        metric(
            &client,
            "fencegate_limit_rejections_total{reason=\"body_share\"}"
        )
        .await,
        refused as f64
    );
    // Meanwhile 127.0.0.1's writes, 8 at once, of 128 KiB each, all land.
    let mut writes = tokio::task::JoinSet::new();
    for i in 0..8 {
        let client = client.clone();
        writes.spawn(async move {
            client
                .put("other", &format!("k{i}"), 1, vec![b'v'; 128 << 10])
                .await
        });
    }
    for reply in writes.join_all().await {
        assert_eq!(reply.status, 201, "{:?}", reply.body);
    }
    // The idle writes that held their place end 408 after --body-first-byte-timeout
    // (1s), not --body-timeout (30s).
    let answers = first_answers(&mut holding, Duration::from_secs(5)).await;
    let timed_out = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 408"))
        .count();
    assert_eq!(timed_out, 16, "{answers:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "after {:?}",
        started.elapsed()
    );
    drop((slow, heavy));
}

/// The first bytes each socket receives within `wait` (empty if none), in order.
async fn first_answers(sockets: &mut [TcpStream], wait: Duration) -> Vec<String> {
    let until = tokio::time::Instant::now() + wait;
    let mut answers = Vec::new();
    for socket in sockets {
        let mut answer = [0; 512];
        let read = tokio::time::timeout_at(until, socket.read(&mut answer)).await;
        answers.push(match read {
            Ok(Ok(n)) => String::from_utf8_lossy(&answer[..n]).into_owned(),
            _ => String::new(),
        });
    }
    answers
}

/// curl over HTTP/2 and TLS, 30 stale writes with small bodies answered early from the
/// fence cache: every one reaches curl as its 409.
#[tokio::test]
async fn curl_over_http2_sees_every_early_answer() {
    let data = DataDir::create();
    let certs = Certs::generate();
    let gateway = embedded(&data)
        .arg("--tls-cert")
        .arg(certs.cert.display().to_string())
        .arg("--tls-key")
        .arg(certs.key.display().to_string())
        .spawn()
        .await;
    let port = gateway.addr().port();
    let url = format!("https://localhost:{port}{}", kv_path("orders", "o-1"));
    let curl = |token: &'static str| {
        let (url, ca) = (url.clone(), certs.ca.clone());
        async move {
            let output = tokio::process::Command::new("curl")
                .args([
                    "--http2",
                    "-sS",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code} %{http_version}",
                ])
                .arg("--resolve")
                .arg(format!("localhost:{port}:127.0.0.1"))
                .arg("--cacert")
                .arg(&ca)
                .args(["-X", "PUT", "-H", &format!("fencing-token: {token}")])
                .args(["--data-binary", &"b".repeat(2048)])
                .arg(&url)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .output()
                .await
                .expect("curl runs (apt-get install -y curl)");
            (
                String::from_utf8_lossy(&output.stdout).into_owned(),
                String::from_utf8_lossy(&output.stderr).into_owned(),
            )
        }
    };
    assert_eq!(curl("5").await.0, "201 2");
    for _ in 0..30 {
        let (answer, errors) = curl("4").await;
        assert_eq!(answer, "409 2", "curl said: {errors}");
    }
}
