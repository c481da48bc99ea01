//! TLS on the HTTP listener (`--tls-cert`, `--tls-key`, `--tls-client-ca`): HTTPS only,
//! HTTP/1.1 and HTTP/2 by ALPN, to clients that trust the CA; client certificates as
//! identities of the auth file; the certificate replaced without a restart; handshakes
//! bounded by the header deadline, counted under the connection cap, broken off by the
//! shutdown.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fencegate_gateway::auth::{new_key, stored_hash};
use fencegate_tests::deployment::DataDir;
use fencegate_tests::eventually;
use fencegate_tests::gateway::{Gateway, GatewayBuilder};
use fencegate_tests::http::{kv_path, Client};
use fencegate_tests::https::TlsClient;
use fencegate_tests::tls::Certs;
use http::{Method, Version};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A gateway on its own embedded store, serving `certs`' server certificate, with
/// `extra` flags.
fn tls_gateway(data: &DataDir, certs: &Certs, extra: &[&str]) -> GatewayBuilder {
    Gateway::builder()
        .args(&["--data-dir", &data.0.display().to_string()])
        .arg("--tls-cert")
        .arg(certs.cert.display().to_string())
        .arg("--tls-key")
        .arg(certs.key.display().to_string())
        .args(extra)
}

/// Writes `text` to `path` whole, by a rename, so that the gateway never reads half.
fn replace(path: &Path, text: &[u8]) {
    let partial = PathBuf::from(format!("{}.partial", path.display()));
    std::fs::write(&partial, text).unwrap();
    std::fs::rename(&partial, path).unwrap();
}

#[tokio::test]
async fn https_only_in_both_versions_to_clients_that_trust_the_ca() {
    let data = DataDir::create();
    let certs = Certs::generate();
    let gateway = tls_gateway(&data, &certs, &[]).spawn().await;
    let trusting = TlsClient::new(gateway.addr(), &certs.ca);

    let path = kv_path("orders", "o-1");
    let (put, version) = trusting
        .clone()
        .alpn(&["http/1.1"])
        .try_request(Method::PUT, &path, &[("fencing-token", "7")], "over TLS")
        .await
        .unwrap();
    assert_eq!((put.status, version), (201, Version::HTTP_11));
    let (get, version) = trusting
        .try_request(Method::GET, &path, &[], "")
        .await
        .unwrap();
    assert_eq!(
        (get.status, version, &get.body[..]),
        (200, Version::HTTP_2, &b"over TLS"[..]),
        "h2 is ALPN's first choice"
    );

    // A client of another library: curl on OpenSSL, HTTP/2 by ALPN.
    let curl = tokio::process::Command::new("curl")
        .args(["--silent", "--show-error", "--http2", "--cacert"])
        .arg(&certs.ca)
        .args(["--write-out", "\n%{http_version}"])
        .arg(format!("https://127.0.0.1:{}{path}", gateway.addr().port()))
        .output()
        .await
        .expect("curl runs");
    assert!(
        curl.status.success(),
        "{}",
        String::from_utf8_lossy(&curl.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&curl.stdout), "over TLS\n2");

    // Cleartext HTTP on the TLS port: no answer.
    let plain = Client::new(format!("http://{}", gateway.addr()))
        .try_request(Method::GET, "/healthz", &[], "")
        .await;
    assert!(plain.is_err(), "{plain:?}");
    // A client that does not trust the gateway's CA: no handshake.
    let stranger = Certs::generate();
    let distrusting = TlsClient::new(gateway.addr(), &stranger.ca)
        .try_request(Method::GET, "/healthz", &[], "")
        .await
        .unwrap_err();
    assert!(
        distrusting.contains("invalid peer certificate"),
        "{distrusting}"
    );

    // Those connections alone were closed.
    let (health, _) = trusting
        .try_request(Method::GET, "/healthz", &[], "")
        .await
        .unwrap();
    assert_eq!(health.status, 200);
    let ready = &gateway.events("fencegate ready")[0];
    assert_eq!(ready["fields"]["tls"], "on", "{ready}");
}

#[tokio::test]
async fn a_pair_that_does_not_load_stops_the_start_and_names_the_flag() {
    let data = DataDir::create();
    let (certs, other) = (Certs::generate(), Certs::generate());
    let failure = Gateway::builder()
        .args(&["--data-dir", &data.0.display().to_string()])
        .arg("--tls-cert")
        .arg(certs.cert.display().to_string())
        .arg("--tls-key")
        .arg(other.key.display().to_string())
        .try_spawn()
        .await
        .err()
        .expect("no start with the key of another certificate");
    assert!(
        failure.logs.contains("is not the key of the certificate"),
        "{}",
        failure.logs
    );
    let failure = tls_gateway(&data, &certs, &["--tls-client-ca", "/nonexistent/ca.pem"])
        .try_spawn()
        .await
        .err()
        .expect("no start without the client CA");
    assert!(
        failure.logs.contains("--tls-client-ca /nonexistent/ca.pem"),
        "{}",
        failure.logs
    );
}

#[tokio::test]
async fn a_client_certificate_authenticates_as_the_identity_listing_its_name() {
    let data = DataDir::create();
    let certs = Certs::generate();
    let (node_a, unlisted) = (
        certs.client("node-a.internal"),
        certs.client("node-z.internal"),
    );
    let foreign_ca = Certs::generate();
    let forged = foreign_ca.client("node-a.internal");
    let (ops_key, stale_key) = (new_key(), new_key());
    let auth = data.0.join("auth.toml");
    std::fs::write(
        &auth,
        format!(
            r#"
            [[identity]]
            name = "node-a"
            certificates = ["node-a.internal"]
            grants = [{{ resources = ["sweeper"], actions = ["read", "write"] }}]

            [[identity]]
            name = "ops"
            keys = ["{}"]
            grants = [{{ actions = ["metrics"] }}]
            "#,
            stored_hash(&ops_key)
        ),
    )
    .unwrap();
    let gateway = tls_gateway(
        &data,
        &certs,
        &[
            "--tls-client-ca",
            &certs.ca.display().to_string(),
            "--auth-file",
            &auth.display().to_string(),
            // Failed handshakes are logged at debug.
            "--log",
            "info,fencegate_gateway::server=debug",
        ],
    )
    .spawn()
    .await;
    let anonymous = TlsClient::new(gateway.addr(), &certs.ca);
    let as_node_a = anonymous
        .clone()
        .with_certificate(&node_a.cert, &node_a.key);
    let sweeper = kv_path("sweeper", "k");
    let token = [("fencing-token", "3")];

    // The certificate alone: what node-a's grants allow, in either HTTP version.
    for alpn in ["h2", "http/1.1"] {
        let client = as_node_a.clone().alpn(&[alpn]);
        let put = client
            .request(Method::PUT, &sweeper, &token, "by cert")
            .await;
        assert!([200, 201].contains(&put.status), "{alpn}: {:?}", put.body);
        let get = client.request(Method::GET, &sweeper, &[], "").await;
        assert_eq!((get.status, &get.body[..]), (200, &b"by cert"[..]));
        // ... and nothing beyond.
        for (method, path) in [
            (Method::PUT, kv_path("orders", "k")),
            (Method::POST, "/v1/fences/sweeper/advance".to_owned()),
            (Method::GET, "/metrics".to_owned()),
        ] {
            let reply = client.request(method.clone(), &path, &token, "").await;
            assert_eq!(
                (reply.status, reply.error_code().as_str()),
                (403, "forbidden"),
                "{alpn}: {method} {path}"
            );
        }
    }

    // No certificate and no key; a name no identity lists: 401. /healthz needs neither.
    for (who, client) in [
        ("anonymous", anonymous.clone()),
        (
            "unlisted",
            anonymous
                .clone()
                .with_certificate(&unlisted.cert, &unlisted.key),
        ),
    ] {
        let reply = client.request(Method::PUT, &sweeper, &token, "x").await;
        assert_eq!(
            (reply.status, reply.error_code().as_str()),
            (401, "unauthenticated"),
            "{who}"
        );
        assert_eq!(
            client
                .request(Method::GET, "/healthz", &[], "")
                .await
                .status,
            200
        );
    }
    // Bearer keys keep working over TLS, and decide alone when sent: the key's identity
    // wins over the certificate's, and a wrong key is not rescued by the certificate.
    let ops = format!("Bearer {ops_key}");
    for client in [&anonymous, &as_node_a] {
        let metrics = client
            .request(Method::GET, "/metrics", &[("authorization", &ops)], "")
            .await;
        assert_eq!(metrics.status, 200);
    }
    let stale = format!("Bearer {stale_key}");
    let reply = as_node_a
        .request(Method::GET, &sweeper, &[("authorization", &stale)], "")
        .await;
    assert_eq!(reply.status, 401);

    // A certificate of another CA, even for a listed name: the handshake fails. (In TLS
    // 1.3 the client has sent its last flight by then, and learns it from the closed
    // connection; the gateway's log says why.)
    let refused = anonymous
        .clone()
        .with_certificate(&forged.cert, &forged.key)
        .try_request(Method::GET, "/healthz", &[], "")
        .await;
    assert!(refused.is_err(), "{refused:?}");
    eventually(
        Duration::from_secs(5),
        "the failed handshake's log",
        || async {
            gateway.events("tls handshake failed").iter().any(|event| {
                event["fields"]["error"]
                    .as_str()
                    .is_some_and(|error| error.contains("invalid peer certificate"))
            })
        },
    )
    .await;

    // Nothing the refused requests carried landed.
    let fence = as_node_a
        .request(Method::GET, "/v1/fences/sweeper", &[], "")
        .await;
    assert_eq!(fence.json()["highest"], 3, "{:?}", fence.json());
    let ready = &gateway.events("fencegate ready")[0];
    assert_eq!(ready["fields"]["tls"], "on, client certificates", "{ready}");
}

#[tokio::test]
async fn a_new_certificate_is_served_without_a_restart_and_a_broken_one_is_not() {
    let data = DataDir::create();
    // The gateway's files are copies, replaced as a secret store would replace them.
    let (first, second) = (Certs::generate(), Certs::generate());
    let served = data.0.join("tls");
    std::fs::create_dir_all(&served).unwrap();
    let (cert, key) = (served.join("server.crt"), served.join("server.key"));
    std::fs::copy(&first.cert, &cert).unwrap();
    std::fs::copy(&first.key, &key).unwrap();
    let gateway = Gateway::builder()
        .args(&["--data-dir", &data.0.display().to_string()])
        .args(&["--tls-cert", &cert.display().to_string()])
        .args(&["--tls-key", &key.display().to_string()])
        .spawn()
        .await;
    let (old_ca, new_ca) = (
        TlsClient::new(gateway.addr(), &first.ca),
        TlsClient::new(gateway.addr(), &second.ca),
    );
    let health = |client: TlsClient| async move {
        client
            .try_request(Method::GET, "/healthz", &[], "")
            .await
            .map(|(reply, _)| reply.status)
    };
    assert_eq!(health(old_ca.clone()).await, Ok(200));
    assert!(health(new_ca.clone()).await.is_err());

    // A certificate file that does not parse is not loaded; the pair in force stays.
    replace(
        &cert,
        b"-----BEGIN CERTIFICATE-----\nbroken\n-----END CERTIFICATE-----\n",
    );
    eventually(Duration::from_secs(10), "the reload to fail", || async {
        !gateway
            .events("tls certificate not reloaded; the certificate in force stays")
            .is_empty()
    })
    .await;
    assert_eq!(health(old_ca.clone()).await, Ok(200));

    // The second CA's pair, key first: for a moment the files do not match, and the
    // gateway waits for the certificate.
    let started = Instant::now();
    replace(&key, &std::fs::read(&second.key).unwrap());
    replace(&cert, &std::fs::read(&second.cert).unwrap());
    eventually(Duration::from_secs(10), "the new certificate", || {
        let new_ca = new_ca.clone();
        async move { health(new_ca).await == Ok(200) }
    })
    .await;
    println!("new certificate served after {:?}", started.elapsed());
    assert!(
        health(old_ca).await.is_err(),
        "the old CA's certificate is gone"
    );
    assert!(!gateway.events("tls certificate reloaded").is_empty());
}

#[tokio::test]
async fn handshakes_are_bounded_by_the_header_deadline_and_hold_a_place_under_the_cap() {
    let data = DataDir::create();
    let certs = Certs::generate();
    let gateway = tls_gateway(
        &data,
        &certs,
        &["--header-timeout", "1s", "--max-connections", "1"],
    )
    .spawn()
    .await;
    // A client that starts a TLS record and stops.
    let mut stalled = TcpStream::connect(gateway.addr()).await.unwrap();
    stalled.write_all(&[0x16, 0x03, 0x01]).await.unwrap();
    let opened = Instant::now();
    // It holds the only place: a client arriving meanwhile waits to be accepted.
    let client = TlsClient::new(gateway.addr(), &certs.ca);
    let waiting = tokio::spawn(async move {
        let reply = client.request(Method::GET, "/healthz", &[], "").await;
        (reply.status, Instant::now())
    });
    let closed = tokio::time::timeout(Duration::from_secs(10), stalled.read(&mut [0; 64]))
        .await
        .expect("the stalled handshake is closed");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    let after = opened.elapsed();
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(5),
        "closed after {after:?}"
    );
    let (status, answered) = waiting.await.unwrap();
    assert_eq!(status, 200);
    assert!(
        answered.duration_since(opened) >= Duration::from_millis(900),
        "the waiting client was served before the stalled handshake gave up its place"
    );
}

#[tokio::test]
async fn shutdown_breaks_off_handshakes_under_way() {
    let data = DataDir::create();
    let certs = Certs::generate();
    let mut gateway = tls_gateway(&data, &certs, &["--header-timeout", "60s"])
        .spawn()
        .await;
    let mut stalled = TcpStream::connect(gateway.addr()).await.unwrap();
    stalled.write_all(&[0x16, 0x03, 0x01]).await.unwrap();
    // Let the gateway accept it before the signal.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let signalled = Instant::now();
    let status = gateway.terminate().await;
    assert!(status.success(), "{status}");
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "the shutdown waited {:?} for a handshake",
        signalled.elapsed()
    );
    let closed = tokio::time::timeout(Duration::from_secs(5), stalled.read(&mut [0; 64]))
        .await
        .expect("the connection is closed");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
}
