//! The HTTP layer under clients that are careless, slow or abusive, over real sockets:
//! early answers reach the client, slow and idle connections are closed by their
//! deadlines, the connection cap makes room for a new client, overload is answered at
//! once with bounded memory, and shutdown does not wait for stuck clients.

use std::process::Command;
use std::time::{Duration, Instant};

use fencegate_tests::db::TestDb;
use fencegate_tests::deployment::DataDir;
use fencegate_tests::gateway::{Gateway, GatewayBuilder};
use fencegate_tests::inprocess::{Api, InProcess};
use fencegate_tests::proxy::Proxy;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A gateway on a fresh embedded store, with extra flags.
async fn embedded(flags: &[&str]) -> (DataDir, Gateway) {
    let dir = DataDir::create();
    let gateway = Gateway::builder()
        .arg("--data-dir")
        .arg(dir.0.to_string_lossy())
        .args(flags)
        .spawn()
        .await;
    (dir, gateway)
}

/// Runs a Python program that prints one JSON line; returns it.
fn python(program: &str, args: &[&str]) -> Value {
    let output = Command::new("python3")
        .arg("-c")
        .arg(program)
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        output.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "python printed no JSON ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// Stale writes on one keep-alive connection, each sent as Python's http.client sends
/// them when told to: the head, then the body in a write of its own. The answer comes
/// before the body is read; the body is drained behind it.
const STALE_FLOOD: &str = r#"
import http.client, json, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
statuses, errors, reconnects = {}, [], 0
body = b"x" * 300
for i in range(count):
    try:
        conn.putrequest("PUT", "/v1/kv/flood/k")
        conn.putheader("Fencing-Token", "1")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        conn.send(body)
        reply = conn.getresponse()
        reply.read()
        statuses[reply.status] = statuses.get(reply.status, 0) + 1
        if reply.will_close:
            reconnects += 1
    except Exception as error:
        errors.append(repr(error))
        conn.close()
print(json.dumps({"statuses": statuses, "errors": errors[:5], "error_count": len(errors), "reconnects": reconnects}))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_flood_of_stale_writes_sees_every_answer() {
    let (_dir, gateway) = embedded(&[]).await;
    let client = gateway.client();
    assert_eq!(client.put("flood", "k", 2, "current").await.status, 201);
    let port = gateway.addr().port().to_string();
    let result = tokio::task::spawn_blocking(move || python(STALE_FLOOD, &[&port, "2000"]))
        .await
        .unwrap();
    assert_eq!(result["error_count"], 0, "{result}");
    assert_eq!(result["statuses"]["409"], 2000, "{result}");
    assert_eq!(
        result["reconnects"], 0,
        "small unread bodies are drained: the connection stays open: {result}"
    );
}

/// Bodies over `--max-body`, each on a fresh connection, sent whole by the client
/// before it reads: every client sees its 413, none a broken pipe or a reset.
const OVERSIZED: &str = r#"
import http.client, json, sys
port, count, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
statuses, errors = {}, []
for i in range(count):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("PUT", "/v1/kv/big/k%d" % i, body=b"x" * size, headers={"Fencing-Token": "1"})
        reply = conn.getresponse()
        body = json.loads(reply.read())
        statuses[reply.status] = statuses.get(reply.status, 0) + 1
        assert body["error"] == "body_too_large", body
        assert reply.getheader("Connection") == "close"
    except Exception as error:
        errors.append(repr(error))
    finally:
        conn.close()
print(json.dumps({"statuses": statuses, "errors": errors[:5], "error_count": len(errors)}))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_get_their_413() {
    let (_dir, gateway) = embedded(&[]).await;
    let port = gateway.addr().port().to_string();
    let size = ((1 << 20) + 1).to_string();
    let result = tokio::task::spawn_blocking(move || python(OVERSIZED, &[&port, "40", &size]))
        .await
        .unwrap();
    assert_eq!(result["error_count"], 0, "{result}");
    assert_eq!(result["statuses"]["413"], 40, "{result}");
}

/// A head of 100 headers is served; one of 101 is refused with 431 and its connection
/// closed, nothing written, and the gateway goes on serving.
#[tokio::test]
async fn a_head_of_more_than_100_headers_gets_431() {
    let (_dir, gateway) = embedded(&[]).await;
    let head = |headers: usize, token: u64| {
        // host, fencing-token and content-length, then padding up to `headers`.
        let padding: String = (3..headers)
            .map(|i| format!("x-pad-{i}: {i}\r\n"))
            .collect();
        format!(
            "PUT /v1/kv/r/k{headers} HTTP/1.1\r\nhost: gw\r\nfencing-token: {token}\r\ncontent-length: 1\r\n{padding}\r\nv"
        )
    };
    let mut stream = TcpStream::connect(gateway.addr()).await.unwrap();
    stream.write_all(head(100, 1).as_bytes()).await.unwrap();
    let answer = read_some(&mut stream, "100 headers").await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");

    let mut stream = TcpStream::connect(gateway.addr()).await.unwrap();
    stream.write_all(head(101, 2).as_bytes()).await.unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(5))
        .await
        .expect("the connection is closed");
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");

    let client = gateway.client();
    assert_eq!(client.get("r", "k101").await.status, 404, "nothing written");
    let fence: Value = client.fence("r").await.json();
    assert_eq!(fence["highest"], 1, "{fence}");
}

/// Reads what the server sends until it closes or `within` passes.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> Option<String> {
    let mut received = Vec::new();
    let read = tokio::time::timeout(within, stream.read_to_end(&mut received)).await;
    read.ok()
        .map(|_| String::from_utf8_lossy(&received).into_owned())
}

/// What the server sends next (one read), within 5 s; panics with `what` otherwise.
async fn read_some(stream: &mut TcpStream, what: &str) -> String {
    let mut received = vec![0; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut received))
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within 5 s"))
        .unwrap();
    String::from_utf8_lossy(&received[..n]).into_owned()
}

/// `Expect: 100-continue`: a stale write is answered without its body ever being asked
/// for; a current one is asked for it, then accepted.
#[tokio::test]
async fn expect_continue_lets_a_stale_write_skip_its_body() {
    let (_dir, gateway) = embedded(&[]).await;
    assert_eq!(gateway.client().put("r", "k", 5, "v").await.status, 201);
    let head = |token: u64| {
        format!(
            "PUT /v1/kv/r/k HTTP/1.1\r\nhost: gw\r\nfencing-token: {token}\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n"
        )
    };
    let mut stale = TcpStream::connect(gateway.addr()).await.unwrap();
    stale.write_all(head(4).as_bytes()).await.unwrap();
    let answer = read_some(&mut stale, "answered before the body").await;
    assert!(answer.starts_with("HTTP/1.1 409"), "{answer}");
    assert!(!answer.contains("100 Continue"), "{answer}");

    let mut current = TcpStream::connect(gateway.addr()).await.unwrap();
    current.write_all(head(5).as_bytes()).await.unwrap();
    let mut interim = vec![0; 64];
    let n = current.read(&mut interim).await.unwrap();
    assert!(
        String::from_utf8_lossy(&interim[..n]).starts_with("HTTP/1.1 100 Continue"),
        "{:?}",
        String::from_utf8_lossy(&interim[..n])
    );
    current.write_all(b"hello").await.unwrap();
    let mut answer = vec![0; 4096];
    let n = current.read(&mut answer).await.unwrap();
    assert!(String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 200"));
}

/// A stale write whose body comes late: the answer does not wait for the body, and the
/// body, read after the answer, leaves the connection open for the next request.
#[tokio::test]
async fn a_stale_write_is_answered_before_a_late_body_and_keeps_its_connection() {
    let (_dir, gateway) = embedded(&[]).await;
    assert_eq!(gateway.client().put("r", "k", 5, "v").await.status, 201);
    let mut stream = TcpStream::connect(gateway.addr()).await.unwrap();
    stream
        .write_all(
            b"PUT /v1/kv/r/k HTTP/1.1\r\nhost: gw\r\nfencing-token: 4\r\ncontent-length: 5\r\n\r\n",
        )
        .await
        .unwrap();
    let answer = read_some(&mut stream, "answered before the body was sent").await;
    assert!(answer.starts_with("HTTP/1.1 409"), "{answer}");
    assert!(
        !answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );

    tokio::time::sleep(Duration::from_millis(100)).await;
    stream.write_all(b"hello").await.unwrap();
    stream
        .write_all(b"GET /v1/fences/r HTTP/1.1\r\nhost: gw\r\n\r\n")
        .await
        .unwrap();
    let next = read_some(
        &mut stream,
        "the next request on the connection is answered",
    )
    .await;
    assert!(next.starts_with("HTTP/1.1 200"), "{next}");
}

/// Slow headers, slow bodies and idle connections are closed by their default
/// deadlines (`--header-timeout 10s`, `--body-timeout 30s`, `--idle-timeout 60s`). The
/// gateway runs in this process on a paused clock: its timers and the test's share it,
/// so each deadline passes at once, and exactly.
#[tokio::test(start_paused = true)]
async fn slow_and_idle_connections_meet_the_default_deadlines() {
    use tokio::time::Instant;
    let gateway = InProcess::start(&[]).await;
    let addr = gateway.addr();

    // A head sent a byte every 500 ms: closed 10 s after its first byte.
    let mut slow_head = TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    let head = b"PUT /v1/kv/r/k HTTP/1.1\r\nhost: gw\r\nfencing-token: 1\r\n";
    let mut closed_after = None;
    for byte in head.iter().cycle().take(60) {
        if slow_head.write_all(&[*byte]).await.is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        let mut probe = [0; 1];
        if let Ok(Ok(0)) =
            tokio::time::timeout(Duration::from_millis(500), slow_head.read(&mut probe)).await
        {
            closed_after = Some(started.elapsed());
            break;
        }
    }
    let closed_after = closed_after.expect("a slow head is closed");
    assert!(
        closed_after >= Duration::from_secs(10) && closed_after <= Duration::from_millis(10_500),
        "closed after {closed_after:?}"
    );

    // A body sent too slowly: 408 after 30 s, and the connection closes.
    let mut slow_body = TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    slow_body
        .write_all(b"PUT /v1/kv/r/k HTTP/1.1\r\nhost: gw\r\nfencing-token: 1\r\ncontent-length: 100\r\n\r\nabc")
        .await
        .unwrap();
    let answer = read_until_closed(&mut slow_body, Duration::from_secs(120))
        .await
        .expect("the slow body's connection closes");
    assert_eq!(started.elapsed().as_secs(), 30);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("body_timeout") && answer.contains("connection: close"),
        "{answer}"
    );

    // A connection that says nothing, and one idle after a request: 60 s each.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    assert_eq!(
        read_until_closed(&mut silent, Duration::from_secs(120))
            .await
            .as_deref(),
        Some("")
    );
    assert_eq!(started.elapsed().as_secs(), 60);
    let mut used = TcpStream::connect(addr).await.unwrap();
    used.write_all(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let answer = read_until_closed(&mut used, Duration::from_secs(120))
        .await
        .expect("an idle keep-alive connection is closed");
    assert_eq!(started.elapsed().as_secs(), 60);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// With a low open-file limit and every connection taken by idle clients, a new client
/// still gets in: the longest idle connection makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_client_gets_in_past_a_crowd_of_idle_ones() {
    let dir = DataDir::create();
    let gateway = GatewayBuilder::default()
        .run_under(&["prlimit", "--nofile=256:256", "--"])
        .arg("--data-dir")
        .arg(dir.0.to_string_lossy())
        .spawn()
        .await;
    let ready = &gateway.events("fencegate ready")[0];
    let cap = ready["fields"]["max_connections"].as_u64().unwrap();
    assert!(cap < 256, "the cap stays under the open-file limit: {cap}");
    let mut idle = Vec::new();
    for _ in 0..cap + 50 {
        match tokio::time::timeout(
            Duration::from_millis(200),
            TcpStream::connect(gateway.addr()),
        )
        .await
        {
            Ok(Ok(stream)) => idle.push(stream),
            _ => break,
        }
    }
    let started = Instant::now();
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        gateway.client().put("crowd", "k", 1, "in"),
    )
    .await
    .expect("a new client is served while idle ones hold every connection");
    assert_eq!(reply.status, 201);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        gateway.events("accept failed").is_empty(),
        "no file-descriptor exhaustion"
    );
    drop(idle);
}

fn rss_kib(pid: u32) -> u64 {
    fencegate_tests::rss_bytes(pid) / 1024
}

/// 300 concurrent 1 MiB writes against a database that does not answer: writes past
/// `--max-body-memory` are answered 503 overloaded with Retry-After at once, and the
/// gateway's memory stays bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overload_of_large_writes_is_shed_with_bounded_memory() {
    let db = TestDb::create().await;
    let network = Proxy::start(fencegate_tests::db::server_addr().await).await;
    let gateway = Gateway::builder()
        .database(&db.url_via(network.addr()))
        .arg("--max-body-memory")
        .arg("16MiB")
        .arg("--backend-timeout")
        .arg("10s")
        .spawn()
        .await;
    let client = gateway.client();
    assert_eq!(client.put("big", "k", 1, "warm").await.status, 201);
    let before = rss_kib(gateway.pid());
    network.hold();
    let body = bytes::Bytes::from(vec![b'x'; 1 << 20]);
    let mut writes = tokio::task::JoinSet::new();
    for i in 0..300 {
        let (client, body) = (client.clone(), body.clone());
        writes.spawn(async move {
            let started = Instant::now();
            let reply = client.put("big", &format!("k{i}"), 1, body).await;
            (reply, started.elapsed())
        });
    }
    let mut shed = 0;
    let mut peak = before;
    while writes.len() > 300 - 250 {
        let (reply, took) = writes.join_next().await.unwrap().unwrap();
        peak = peak.max(rss_kib(gateway.pid()));
        assert_eq!(reply.status, 503, "{:?}", reply.body);
        assert_eq!(reply.json()["error"], "overloaded");
        assert_eq!(reply.header("retry-after"), Some("1"));
        assert!(
            took < Duration::from_secs(5),
            "answered at once, not after {took:?}"
        );
        shed += 1;
    }
    peak = peak.max(rss_kib(gateway.pid()));
    let grew_mib = peak.saturating_sub(before) / 1024;
    assert!(
        grew_mib < 64,
        "RSS grew {grew_mib} MiB under 300 x 1 MiB writes with --max-body-memory 16MiB"
    );
    network.release();
    let rest: Vec<_> = writes.join_all().await;
    let accepted = rest
        .iter()
        .filter(|(reply, _)| matches!(reply.status, 200 | 201))
        .count();
    assert!(
        accepted > 0 && shed >= 250,
        "accepted {accepted}, shed {shed}"
    );
}

/// SIGTERM with stuck clients — idle, half a head sent, half a body sent — exits at once.
#[tokio::test]
async fn shutdown_does_not_wait_for_stuck_clients() {
    let (_dir, mut gateway) = embedded(&["--shutdown-timeout", "30s"]).await;
    let addr = gateway.addr();
    let _idle = TcpStream::connect(addr).await.unwrap();
    let mut half_head = TcpStream::connect(addr).await.unwrap();
    half_head
        .write_all(b"PUT /v1/kv/r/k HTTP/1.1\r\nhost:")
        .await
        .unwrap();
    let mut half_body = TcpStream::connect(addr).await.unwrap();
    half_body
        .write_all(b"PUT /v1/kv/r/k HTTP/1.1\r\nhost: gw\r\nfencing-token: 1\r\ncontent-length: 100\r\n\r\nabc")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    gateway.signal("TERM");
    let status = gateway.wait().await;
    assert!(status.success(), "{status}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "shutdown took {:?} with stuck clients",
        started.elapsed()
    );
}

/// A request with both Transfer-Encoding and Content-Length is read by its
/// Transfer-Encoding (RFC 9112), and its connection closes after the answer: a second
/// request hidden behind the first, by a front that trusts Content-Length, is never
/// answered.
#[tokio::test]
async fn both_framings_close_the_connection() {
    let (_dir, gateway) = embedded(&[]).await;
    let mut stream = TcpStream::connect(gateway.addr()).await.unwrap();
    stream
        .write_all(
            b"PUT /v1/kv/r/k HTTP/1.1\r\nhost: gw\r\nfencing-token: 1\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n\
              5\r\nhello\r\n0\r\n\r\n\
              GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n",
        )
        .await
        .unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(5))
        .await
        .expect("the connection closes after the first answer");
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    assert_eq!(answer.matches("HTTP/1.1").count(), 1, "{answer}");
    assert_eq!(&gateway.client().get("r", "k").await.body[..], b"hello");
}
