//! The S3 door in front of a real radosgw (`fencegate_tests::s3::door`): tokens in
//! object metadata or the `Fencing-Token` header, stale writes refused with S3's own
//! error document, SigV4 checked against the gateway's keys, grants applied, and the
//! mapped layout's promise — no older term's write becomes visible once a newer term
//! wrote or advanced — kept even for an upload held in the network past the term
//! change.
//!
//! One bed (radosgw, a proxy, a database, a gateway) runs every step, each on keys of
//! its own; the test checks that every step ran.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use http::Method;

use fencegate_tests::history::{now, Entry, Op, Outcome, Recorder};
use fencegate_tests::http::{Client, Reply};
use fencegate_tests::s3::client::{error_code, text, xml_values};
use fencegate_tests::s3::door::{DoorBed, DoorFiles, BUCKET, HTTP_KEY, READER, WRITER};
use fencegate_tests::s3::recorded;
use fencegate_tests::s3::S3Client;

type Step = for<'a> fn(&'a DoorBed, &'a str) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

const STEPS: &[(&str, Step)] = &[
    ("late-put-is-stale", |bed, k| {
        Box::pin(a_late_put_of_an_older_term_is_refused(bed, k))
    }),
    ("header-token", |bed, k| {
        Box::pin(the_token_may_come_as_a_header(bed, k))
    }),
    ("no-token", |bed, k| {
        Box::pin(a_write_without_a_token_is_refused(bed, k))
    }),
    ("bad-signature", |bed, k| {
        Box::pin(bad_signatures_reach_nothing(bed, k))
    }),
    ("grants", |bed, k| {
        Box::pin(grants_apply_to_the_resolved_resource(bed, k))
    }),
    ("reads", |bed, k| {
        Box::pin(reads_resolve_through_the_mapping(bed, k))
    }),
    ("delete", |bed, k| Box::pin(deletes_are_fenced(bed, k))),
    ("held-upload", |bed, k| {
        Box::pin(an_upload_held_past_a_term_change_never_shows(bed, k))
    }),
    ("boto3", |bed, k| {
        Box::pin(boto3_writes_through_the_door(bed, k))
    }),
    ("multipart", |bed, k| {
        Box::pin(a_multipart_upload_shows_at_its_completion(bed, k))
    }),
    ("multipart-stale", |bed, k| {
        Box::pin(a_multipart_upload_that_lost_the_fence_never_shows(bed, k))
    }),
    ("list", |bed, k| {
        Box::pin(listings_come_from_the_mappings(bed, k))
    }),
    ("delete-batch", |bed, k| {
        Box::pin(a_batch_delete_is_fenced_per_resource(bed, k))
    }),
];

/// The smallest part an upstream takes in a multipart upload but for the last.
const MIN_PART: usize = 5 << 20;

#[tokio::test]
async fn the_s3_door_fences_writes_to_a_real_object_store() {
    let bed = DoorBed::start().await;
    let mut ran = Vec::new();
    for (name, step) in STEPS {
        let key = format!("orders/{name}.json");
        step(&bed, &key).await;
        ran.push(*name);
    }
    assert_eq!(ran.len(), STEPS.len(), "every step ran");
}

fn token(value: u64) -> String {
    value.to_string()
}

/// PUT with the token in `x-amz-meta-fencing-token`.
async fn put(s3: &S3Client, key: &str, term: u64, body: &str) -> Reply {
    let term = token(term);
    s3.put(
        BUCKET,
        key,
        &[("x-amz-meta-fencing-token", &term)],
        body.to_owned(),
    )
    .await
}

fn assert_stale(reply: &Reply, presented: u64, highest: u64) {
    assert_eq!(reply.status, 409, "{}", text(reply));
    assert_eq!(
        error_code(reply).as_deref(),
        Some("StaleFencingToken"),
        "{}",
        text(reply)
    );
    assert_eq!(
        reply.header("fencing-highest"),
        Some(highest.to_string().as_str())
    );
    let message = xml_values(&text(reply), "Message").join("");
    assert!(
        message.contains(&presented.to_string()) && message.contains(&highest.to_string()),
        "the message names the presented and the highest token: {message}"
    );
}

async fn body_of(s3: &S3Client, key: &str) -> (u16, String) {
    let reply = s3.get(BUCKET, key).await;
    (reply.status, text(&reply))
}

/// The seed's scenario: term 41 writes, term 42 writes, term 41's late PUT is refused
/// with 409 `StaleFencingToken` and the object keeps term 42's bytes; nothing of the
/// late PUT reaches the bucket.
async fn a_late_put_of_an_older_term_is_refused(bed: &DoorBed, key: &str) {
    let s3 = bed.client(WRITER);
    let reply = put(&s3, key, 41, "term 41").await;
    assert_eq!(reply.status, 200, "{}", text(&reply));
    assert!(reply.header("etag").is_some_and(|etag| !etag.is_empty()));
    assert_eq!(body_of(&s3, key).await, (200, "term 41".into()));
    let reply = put(&s3, key, 42, "term 42").await;
    assert_eq!(reply.status, 200, "{}", text(&reply));
    let before = bed.physical_keys().await;
    let counted = door_stale_rejections(bed).await;
    let refused_puts = door_metric(
        bed,
        r#"fencegate_s3_requests_total{method="PUT",status="4xx"}"#,
    )
    .await;
    let late = put(&s3, key, 41, "term 41, late").await;
    assert_stale(&late, 41, 42);
    assert_eq!(door_stale_rejections(bed).await, counted + 1.0);
    let now_refused = door_metric(
        bed,
        r#"fencegate_s3_requests_total{method="PUT",status="4xx"}"#,
    )
    .await;
    assert_eq!(now_refused, refused_puts + 1.0);
    assert_eq!(body_of(&s3, key).await, (200, "term 42".into()));
    assert_eq!(
        bed.physical_keys().await,
        before,
        "the refused PUT reached the bucket"
    );
    // Physical keys carry their term.
    assert!(
        before
            .iter()
            .any(|k| k.starts_with(".fencegate/orders/42/")),
        "{before:?}"
    );
}

async fn the_token_may_come_as_a_header(bed: &DoorBed, key: &str) {
    let s3 = bed.client(WRITER);
    let reply = s3
        .put(BUCKET, key, &[("fencing-token", "43")], "by header")
        .await;
    assert_eq!(reply.status, 200, "{}", text(&reply));
    let reply = s3
        .put(BUCKET, key, &[("fencing-token", "42")], "stale header")
        .await;
    assert_stale(&reply, 42, 43);
    // Both, differing: refused as an invalid argument, nothing written.
    let reply = s3
        .put(
            BUCKET,
            key,
            &[("fencing-token", "43"), ("x-amz-meta-fencing-token", "44")],
            "two tokens",
        )
        .await;
    assert_eq!(reply.status, 400, "{}", text(&reply));
    assert_eq!(error_code(&reply).as_deref(), Some("InvalidArgument"));
    assert_eq!(body_of(&s3, key).await, (200, "by header".into()));
}

async fn a_write_without_a_token_is_refused(bed: &DoorBed, key: &str) {
    let s3 = bed.client(WRITER);
    let before = bed.physical_keys().await;
    let reply = s3.put(BUCKET, key, &[], "no token").await;
    assert_eq!(reply.status, 400, "{}", text(&reply));
    assert_eq!(error_code(&reply).as_deref(), Some("MissingFencingToken"));
    let reply = s3
        .put(
            BUCKET,
            key,
            &[("x-amz-meta-fencing-token", "forty-four")],
            "bad",
        )
        .await;
    assert_eq!(
        error_code(&reply).as_deref(),
        Some("InvalidArgument"),
        "{}",
        text(&reply)
    );
    assert_eq!(s3.get(BUCKET, key).await.status, 404);
    assert_eq!(bed.physical_keys().await, before);
}

async fn bad_signatures_reach_nothing(bed: &DoorBed, key: &str) {
    let door = format!("http://{}", bed.gateway.s3_addr());
    let before = bed.physical_keys().await;
    let wrong_secret = S3Client::new(&door, WRITER.0, "not-the-writer-secret-0123456789");
    let reply = put(&wrong_secret, key, 50, "forged").await;
    assert_eq!(reply.status, 403, "{}", text(&reply));
    assert_eq!(error_code(&reply).as_deref(), Some("SignatureDoesNotMatch"));
    let unknown = S3Client::new(&door, "FGNOBODY", "whatever-secret-0123456789abcdef");
    let reply = put(&unknown, key, 50, "forged").await;
    assert_eq!(reply.status, 403, "{}", text(&reply));
    assert_eq!(error_code(&reply).as_deref(), Some("InvalidAccessKeyId"));
    // Unsigned: anonymous requests are refused.
    let reply = Client::new(&door)
        .request(Method::GET, &format!("/{BUCKET}/{key}"), &[], "")
        .await;
    assert_eq!(
        reply.status,
        403,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(bed.physical_keys().await, before);
    // Nothing raised the fence either: the highest token is still below 50.
    assert!(bed.highest().await < 50);
}

async fn grants_apply_to_the_resolved_resource(bed: &DoorBed, key: &str) {
    let reader = bed.client(READER);
    let reply = put(&reader, key, 60, "by a reader").await;
    assert_eq!(reply.status, 403, "{}", text(&reply));
    assert_eq!(error_code(&reply).as_deref(), Some("AccessDenied"));
    // A key outside every rule belongs to the resource named like the bucket, which
    // no one here is granted.
    let writer = bed.client(WRITER);
    let reply = put(&writer, "invoices/1.json", 60, "elsewhere").await;
    assert_eq!(
        error_code(&reply).as_deref(),
        Some("AccessDenied"),
        "{}",
        text(&reply)
    );
    // A bucket the door does not serve.
    let reply = writer
        .put(
            "other",
            key,
            &[("x-amz-meta-fencing-token", "60")],
            "elsewhere",
        )
        .await;
    assert_eq!(
        error_code(&reply).as_deref(),
        Some("NoSuchBucket"),
        "{}",
        text(&reply)
    );
    // The door's own physical keys are not logical keys.
    let reply = writer.get(BUCKET, ".fencegate/orders/41/x").await;
    assert_ne!(reply.status, 200, "{}", text(&reply));
    assert_eq!(reader.get(BUCKET, key).await.status, 404);
}

async fn reads_resolve_through_the_mapping(bed: &DoorBed, key: &str) {
    let s3 = bed.client(WRITER);
    let highest = bed.highest().await;
    let reply = s3
        .put(
            BUCKET,
            key,
            &[
                ("x-amz-meta-fencing-token", &token(highest)),
                ("x-amz-meta-owner", "sweeper"),
                ("content-type", "application/json"),
            ],
            "{\"total\": 12}",
        )
        .await;
    assert_eq!(reply.status, 200, "{}", text(&reply));
    let etag = reply.header("etag").unwrap().to_owned();
    let reader = bed.client(READER);
    let head = reader.head(BUCKET, key).await;
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), Some("13"));
    assert_eq!(head.header("etag"), Some(etag.as_str()));
    assert_eq!(head.header("content-type"), Some("application/json"));
    assert_eq!(head.header("x-amz-meta-owner"), Some("sweeper"));
    assert_eq!(
        head.header("x-amz-meta-fencing-token"),
        Some(token(highest).as_str())
    );
    let ranged = reader
        .request_path(
            Method::GET,
            &fencegate_tests::s3::client::object_path(BUCKET, key),
            &[("range", "bytes=1-7")],
            "",
        )
        .await;
    assert_eq!(ranged.status, 206, "{}", text(&ranged));
    assert_eq!(text(&ranged), "\"total\"");
    let missing = reader.get(BUCKET, "orders/never-written.json").await;
    assert_eq!(missing.status, 404);
    assert_eq!(error_code(&missing).as_deref(), Some("NoSuchKey"));
}

/// `fencegate_door_stale_rejections_total{door="s3"}`.
async fn door_stale_rejections(bed: &DoorBed) -> f64 {
    door_metric(bed, r#"fencegate_door_stale_rejections_total{door="s3"}"#).await
}

/// One series of the gateway's metrics.
async fn door_metric(bed: &DoorBed, series: &str) -> f64 {
    let http = Client::new(bed.gateway.url());
    let reply = http
        .request(
            Method::GET,
            "/metrics",
            &[("authorization", &format!("Bearer {HTTP_KEY}"))],
            "",
        )
        .await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let text = String::from_utf8_lossy(&reply.body);
    fencegate_tests::http::metric_value(&text, series)
        .unwrap_or_else(|| panic!("{series} is not exported"))
}

async fn deletes_are_fenced(bed: &DoorBed, key: &str) {
    let s3 = bed.client(WRITER);
    let highest = bed.highest().await;
    assert_eq!(put(&s3, key, highest, "to delete").await.status, 200);
    let path = fencegate_tests::s3::client::object_path(BUCKET, key);
    let stale = s3
        .request_path(
            Method::DELETE,
            &path,
            &[("fencing-token", &token(highest - 1))],
            "",
        )
        .await;
    assert_stale(&stale, highest - 1, highest);
    assert_eq!(body_of(&s3, key).await, (200, "to delete".into()));
    let untokened = s3.request_path(Method::DELETE, &path, &[], "").await;
    assert_eq!(
        error_code(&untokened).as_deref(),
        Some("MissingFencingToken")
    );
    let deleted = s3
        .request_path(
            Method::DELETE,
            &path,
            &[("fencing-token", &token(highest))],
            "",
        )
        .await;
    assert_eq!(deleted.status, 204, "{}", text(&deleted));
    assert_eq!(s3.get(BUCKET, key).await.status, 404);
}

/// The window check-then-PUT leaves open: term T's PUT passes every check, its upload
/// is held in the network, term T+1 advances the fence and is acknowledged, then the
/// upload lands. The door's commit finds the fence above T and refuses: the object
/// keeps the bytes it had, and the late upload's physical object is referenced by
/// nothing.
async fn an_upload_held_past_a_term_change_never_shows(bed: &DoorBed, key: &str) {
    let s3 = bed.client(WRITER);
    let term = bed.highest().await;
    assert_eq!(put(&s3, key, term, "before the hold").await.status, 200);
    let before = bed.physical_keys().await;

    bed.proxy.hold();
    let late = {
        let s3 = s3.clone();
        let key = key.to_owned();
        tokio::spawn(async move { put(&s3, &key, term, "held past the term change").await })
    };
    fencegate_tests::eventually(Duration::from_secs(10), "the upload is held", || async {
        bed.proxy.held_bytes() > 0
    })
    .await;
    bed.advance(term + 1).await;
    bed.proxy.release();

    let late = late.await.expect("the late PUT's task");
    assert_stale(&late, term, term + 1);
    assert_eq!(body_of(&s3, key).await, (200, "before the hold".into()));
    // The upload did land: one more physical object, which no mapping names.
    let after = bed.physical_keys().await;
    assert_eq!(after.len(), before.len() + 1, "{before:?} → {after:?}");
}

/// boto3, the Python SDK, unchanged but for the endpoint: the seed's script.
async fn boto3_writes_through_the_door(bed: &DoorBed, key: &str) {
    let term = bed.highest().await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/s3/boto3_seed.py");
    let output = tokio::process::Command::new("python3")
        .arg(script)
        .args([
            &format!("http://{}", bed.gateway.s3_addr()),
            WRITER.0,
            WRITER.1,
            BUCKET,
            key,
            &token(term + 1),
        ])
        .output()
        .await
        .expect("python3 runs");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "the boto3 script failed:\n{said}");
    assert!(
        said.contains("late PUT refused: StaleFencingToken"),
        "{said}"
    );
    // What boto3 read, the door and the bucket agree on.
    let s3 = bed.client(READER);
    assert_eq!(body_of(&s3, key).await, (200, format!("term {}", term + 2)));
}

/// A stand-in for an S3 server that does not honour `If-None-Match` (a mock: such
/// servers — older MinIO and gateways — are not packaged here): it answers every
/// request `200` with an ETag. The door's start-up race sees every conditional PUT
/// win, and the gateway refuses to start, saying why.
#[tokio::test]
async fn a_door_refuses_an_upstream_whose_conditional_writes_all_win() {
    use hyper::service::service_fn;
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = std::sync::Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let counted = std::sync::Arc::clone(&counted);
            tokio::spawn(async move {
                let service = service_fn(move |_request: http::Request<hyper::body::Incoming>| {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    async {
                        http::Response::builder()
                            .status(200)
                            .header("etag", "\"takes-everything\"")
                            .body(http_body_util::Full::new(bytes::Bytes::new()))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    let db = fencegate_tests::db::TestDb::create().await;
    let files = DoorFiles::new("upstream-key", "upstream-secret");
    let failure = files
        .builder(&db, &format!("http://{addr}"))
        .try_spawn()
        .await
        .err()
        .expect("the gateway refuses the upstream");
    assert!(
        failure
            .logs
            .contains("does not honour conditional writes atomically"),
        "{failure}"
    );
    assert!(
        failure.logs.contains("--s3-skip-conformance-check"),
        "{failure}"
    );
    assert!(
        seen.load(std::sync::atomic::Ordering::SeqCst) >= 2,
        "the race ran"
    );
    // Told to skip the check, it starts.
    let gateway = files
        .builder(&db, &format!("http://{addr}"))
        .arg("--s3-skip-conformance-check")
        .spawn()
        .await;
    let _ = gateway.s3_addr();
}

/// The door's flags are checked before anything starts.
#[tokio::test]
async fn the_door_names_what_it_lacks() {
    for (args, says) in [
        (
            vec!["--s3-listen", "127.0.0.1:0"],
            "--s3-listen needs --s3-upstream",
        ),
        (
            vec![
                "--s3-listen",
                "127.0.0.1:0",
                "--s3-upstream",
                "https://s3.example",
            ],
            "must be an http:// URL",
        ),
        (
            vec![
                "--s3-listen",
                "127.0.0.1:0",
                "--s3-upstream",
                "http://127.0.0.1:1",
            ],
            "--s3-listen needs --s3-keys-file",
        ),
        (
            vec![
                "--s3-listen",
                "0.0.0.0:0",
                "--s3-upstream",
                "http://127.0.0.1:1",
                "--s3-keys-file",
                "/nonexistent",
                "--s3-bucket",
                "data",
            ],
            "reachable from other hosts",
        ),
    ] {
        let dir =
            std::env::temp_dir().join(format!("fencegate-s3-flags-{:08x}", rand::random::<u32>()));
        let failure = fencegate_tests::gateway::Gateway::builder()
            .args(&["--data-dir", &dir.display().to_string()])
            .args(&args)
            .try_spawn()
            .await
            .err()
            .unwrap_or_else(|| panic!("{args:?} started"));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(failure.logs.contains(says), "{args:?}: {failure}");
    }
}

/// CreateMultipartUpload with the token in metadata.
async fn create_upload(s3: &S3Client, key: &str, term: u64) -> Reply {
    let path = fencegate_tests::s3::client::object_path(BUCKET, key);
    s3.request_path(
        Method::POST,
        &format!("{path}?uploads"),
        &[("x-amz-meta-fencing-token", &token(term))],
        "",
    )
    .await
}

async fn upload_part(s3: &S3Client, key: &str, upload: &str, number: u32, bytes: Vec<u8>) -> Reply {
    let path = fencegate_tests::s3::client::object_path(BUCKET, key);
    s3.request_path(
        Method::PUT,
        &format!("{path}?partNumber={number}&uploadId={upload}"),
        &[],
        bytes,
    )
    .await
}

async fn complete_upload(s3: &S3Client, key: &str, upload: &str, parts: &[(u32, String)]) -> Reply {
    let path = fencegate_tests::s3::client::object_path(BUCKET, key);
    let listed: String = parts
        .iter()
        .map(|(number, etag)| {
            format!("<Part><PartNumber>{number}</PartNumber><ETag>{etag}</ETag></Part>")
        })
        .collect();
    s3.request_path(
        Method::POST,
        &format!("{path}?uploadId={upload}"),
        &[],
        format!("<CompleteMultipartUpload>{listed}</CompleteMultipartUpload>"),
    )
    .await
}

/// Two parts, invisible until Complete, then the whole object under the key.
async fn a_multipart_upload_shows_at_its_completion(bed: &DoorBed, key: &str) {
    let s3 = bed.client(WRITER);
    let term = bed.highest().await;
    assert_eq!(put(&s3, key, term, "small").await.status, 200);
    let created = create_upload(&s3, key, term).await;
    assert_eq!(created.status, 200, "{}", text(&created));
    let upload = xml_values(&text(&created), "UploadId").remove(0);
    let mut parts = Vec::new();
    for (number, bytes) in [(1, vec![b'x'; MIN_PART]), (2, b"tail".to_vec())] {
        let part = upload_part(&s3, key, &upload, number, bytes).await;
        assert_eq!(part.status, 200, "part {number}: {}", text(&part));
        parts.push((number, part.header("etag").unwrap().to_owned()));
    }
    assert_eq!(
        body_of(&s3, key).await,
        (200, "small".into()),
        "parts are not visible before Complete"
    );
    let completed = complete_upload(&s3, key, &upload, &parts).await;
    assert_eq!(completed.status, 200, "{}", text(&completed));
    let etag = xml_values(&text(&completed), "ETag").remove(0);
    assert!(etag.ends_with("-2\""), "the multipart ETag: {etag}");
    let head = s3.head(BUCKET, key).await;
    assert_eq!(
        head.header("content-length"),
        Some((MIN_PART + 4).to_string().as_str())
    );
    assert_eq!(head.header("etag"), Some(etag.as_str()));
    let (status, body) = body_of(&s3, key).await;
    assert_eq!(status, 200);
    assert!(body.len() == MIN_PART + 4 && body.ends_with("xtail"));
    // The upload is gone once completed; a forged id names none.
    let again = complete_upload(&s3, key, &upload, &parts).await;
    assert_eq!(
        error_code(&again).as_deref(),
        Some("NoSuchUpload"),
        "{}",
        text(&again)
    );
    let forged = upload_part(&s3, key, "not-an-upload", 1, b"x".to_vec()).await;
    assert_eq!(
        error_code(&forged).as_deref(),
        Some("NoSuchUpload"),
        "{}",
        text(&forged)
    );
}

/// An upload whose term is overtaken while its parts go up: its next part is refused
/// from the fence cache, its Complete is refused at the commit, and the key keeps what
/// it had.
async fn a_multipart_upload_that_lost_the_fence_never_shows(bed: &DoorBed, key: &str) {
    let s3 = bed.client(WRITER);
    let term = bed.highest().await;
    assert_eq!(put(&s3, key, term, "kept").await.status, 200);
    let created = create_upload(&s3, key, term).await;
    assert_eq!(created.status, 200, "{}", text(&created));
    let upload = xml_values(&text(&created), "UploadId").remove(0);
    let part = upload_part(&s3, key, &upload, 1, b"by the old term".to_vec()).await;
    assert_eq!(part.status, 200, "{}", text(&part));
    let parts = vec![(1, part.header("etag").unwrap().to_owned())];

    bed.advance(term + 1).await;
    let late_part = upload_part(&s3, key, &upload, 2, b"more".to_vec()).await;
    assert_stale(&late_part, term, term + 1);
    let completed = complete_upload(&s3, key, &upload, &parts).await;
    assert_stale(&completed, term, term + 1);
    assert_eq!(body_of(&s3, key).await, (200, "kept".into()));
}

/// ListObjectsV2 lists logical keys from the mappings — never the bucket's physical
/// keys — in byte order, folds keys under a delimiter, and pages with a continuation
/// token; deleted keys are not listed.
async fn listings_come_from_the_mappings(bed: &DoorBed, key: &str) {
    let s3 = bed.client(WRITER);
    let term = bed.highest().await;
    let dir = key.trim_end_matches(".json");
    let names = [
        "a.json",
        "b/1.json",
        "b/2.json",
        "c.json",
        "d/e/f.json",
        "gone.json",
    ];
    for name in names {
        let reply = put(&s3, &format!("{dir}/{name}"), term, name).await;
        assert_eq!(reply.status, 200, "{}", text(&reply));
    }
    let path = fencegate_tests::s3::client::object_path(BUCKET, &format!("{dir}/gone.json"));
    let deleted = s3
        .request_path(
            Method::DELETE,
            &path,
            &[("fencing-token", &token(term))],
            "",
        )
        .await;
    assert_eq!(deleted.status, 204, "{}", text(&deleted));
    let prefix = format!("{dir}/");
    let expected: Vec<String> = ["a.json", "b/1.json", "b/2.json", "c.json", "d/e/f.json"]
        .iter()
        .map(|name| format!("{prefix}{name}"))
        .collect();

    let reader = bed.client(READER);
    let all = reader.list(BUCKET, &[("prefix", &prefix)]).await;
    assert_eq!(all.status, 200, "{}", text(&all));
    assert_eq!(xml_values(&text(&all), "Key"), expected);

    let folded = reader
        .list(BUCKET, &[("prefix", &prefix), ("delimiter", "/")])
        .await;
    let folded = text(&folded);
    assert_eq!(
        xml_values(&folded, "Key"),
        [format!("{prefix}a.json"), format!("{prefix}c.json")]
    );
    let common: Vec<String> = xml_values(&folded, "Prefix")
        .into_iter()
        .filter(|p| p != &prefix)
        .collect();
    assert_eq!(common, [format!("{prefix}b/"), format!("{prefix}d/")]);

    // Pages of two, through every key once, in order.
    let mut paged = Vec::new();
    let mut continuation: Option<String> = None;
    for _ in 0..10 {
        let mut params = vec![("prefix", prefix.as_str()), ("max-keys", "2")];
        if let Some(token) = &continuation {
            params.push(("continuation-token", token.as_str()));
        }
        let page = reader.list(BUCKET, &params).await;
        assert_eq!(page.status, 200, "{}", text(&page));
        let page = text(&page);
        let keys = xml_values(&page, "Key");
        assert!(keys.len() <= 2, "{page}");
        paged.extend(keys);
        match xml_values(&page, "NextContinuationToken").pop() {
            Some(next) => continuation = Some(next),
            None => break,
        }
    }
    assert_eq!(paged, expected);

    // The whole bucket reaches its own resource, which the reader is not granted.
    let everything = reader.list(BUCKET, &[]).await;
    assert_eq!(everything.status, 403, "{}", text(&everything));
    // The door's physical keys never show.
    let orders = reader.list(BUCKET, &[("prefix", "orders/")]).await;
    let every_key = xml_values(&text(&orders), "Key");
    assert!(!every_key.is_empty());
    assert!(
        every_key.iter().all(|k| k.starts_with("orders/")),
        "{every_key:?}"
    );
    let forged = reader
        .list(
            BUCKET,
            &[
                ("prefix", &prefix),
                ("continuation-token", "bm90LWEtY3Vyc29y"),
            ],
        )
        .await;
    assert_eq!(
        error_code(&forged).as_deref(),
        Some("InvalidArgument"),
        "{}",
        text(&forged)
    );
}

/// DeleteObjects: every key of a resource in one fenced transaction; a stale token
/// fails that resource's keys, each with its own `<Error>`; a key of a resource the
/// caller may not write fails alone.
async fn a_batch_delete_is_fenced_per_resource(bed: &DoorBed, key: &str) {
    let s3 = bed.client(WRITER);
    let term = bed.highest().await;
    let dir = key.trim_end_matches(".json");
    let keys: Vec<String> = (1..=3).map(|n| format!("{dir}/{n}.json")).collect();
    for key in &keys {
        assert_eq!(put(&s3, key, term, key).await.status, 200);
    }
    let batch = |names: &[&str]| {
        let objects: String = names
            .iter()
            .map(|name| format!("<Object><Key>{name}</Key></Object>"))
            .collect();
        format!("<Delete>{objects}</Delete>")
    };
    let send = |token: u64, body: String| {
        let s3 = s3.clone();
        async move {
            s3.request_path(
                Method::POST,
                &format!("/{BUCKET}?delete"),
                &[("fencing-token", &token.to_string())],
                body,
            )
            .await
        }
    };
    let stale = send(term - 1, batch(&[&keys[0], &keys[1]])).await;
    assert_eq!(stale.status, 200, "{}", text(&stale));
    let stale = text(&stale);
    assert_eq!(
        xml_values(&stale, "Code"),
        ["StaleFencingToken", "StaleFencingToken"],
        "{stale}"
    );
    assert!(xml_values(&stale, "Deleted").is_empty());
    for key in &keys {
        assert_eq!(body_of(&s3, key).await, (200, key.clone()));
    }
    let mixed = send(term, batch(&[&keys[0], &keys[1], "invoices/1.json"])).await;
    let mixed = text(&mixed);
    let deleted: Vec<String> = xml_values(&mixed, "Deleted")
        .iter()
        .flat_map(|entry| xml_values(entry, "Key"))
        .collect();
    assert_eq!(deleted, [keys[0].clone(), keys[1].clone()], "{mixed}");
    assert_eq!(xml_values(&mixed, "Code"), ["AccessDenied"], "{mixed}");
    assert_eq!(s3.get(BUCKET, &keys[0]).await.status, 404);
    assert_eq!(s3.get(BUCKET, &keys[1]).await.status, 404);
    assert_eq!(body_of(&s3, &keys[2]).await, (200, keys[2].clone()));
}

/// Faults around the door, judged twice: each step asserts what its writer and readers
/// see, and every write, advance and read of the whole run goes into one history that
/// must be linearizable against the fenced register (`fencegate_tests::history`): no
/// older term's bytes after a newer term's acknowledged write, no acknowledged write
/// lost.
#[tokio::test]
async fn the_s3_door_keeps_its_promise_through_faults() {
    let mut bed = DoorBed::start().await;
    let history = Recorder::new();
    a_door_paused_mid_upload_cannot_publish_an_older_term(&bed, &history).await;
    a_gateway_killed_during_a_multipart_upload_loses_nothing(&mut bed, &history).await;
    an_upstream_restart_loses_no_acknowledged_write(&mut bed, &history).await;
    let entries = history.entries();
    assert!(entries.len() >= 15, "{} operations", entries.len());
    let violations = fencegate_tests::history::check(&entries);
    assert!(
        violations.is_empty(),
        "the faults' history is not linearizable:\n{}",
        violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Reads `key` through every client in `readers`, recorded, and returns what the
/// first one read.
async fn read_all(readers: &[&S3Client], key: &str, history: &Recorder) -> (u16, String) {
    for (at, s3) in readers.iter().enumerate() {
        recorded::read(s3, 500 + at as u32, key, history).await;
    }
    body_of(readers[0], key).await
}

/// Advances `orders` to `term` through the bed's gateway, recorded.
async fn recorded_advance(bed: &DoorBed, term: u64, history: &Recorder) {
    let invoked = now();
    bed.advance(term).await;
    history.record(Entry {
        client: 900,
        resource: recorded::RESOURCE.to_owned(),
        op: Op::Advance { token: term },
        invoked,
        completed: now(),
        outcome: Outcome::Applied { version: None },
    });
}

/// Gateway A checks and sends term T's upload, which is held in the network; A is
/// stopped (SIGSTOP); gateway B, straight to the bucket, writes term T+1; the upload
/// is let through and A resumes. A's commit finds the fence at T+1: the writer gets
/// 409, and every reader keeps seeing term T+1's bytes.
async fn a_door_paused_mid_upload_cannot_publish_an_older_term(bed: &DoorBed, history: &Recorder) {
    let key = "orders/paused.json";
    let a = bed.client(WRITER);
    let b_gateway = bed.direct_replica().spawn().await;
    let b = S3Client::new(
        format!("http://{}", b_gateway.s3_addr()),
        WRITER.0,
        WRITER.1,
    );
    let term = 100;
    let first = recorded::write(&a, 1, key, term, "term 100", history).await;
    assert_eq!(first, Outcome::Applied { version: None });
    read_all(&[&a, &b], key, history).await;

    bed.proxy.hold();
    let late = {
        let (a, history) = (a.clone(), history.clone());
        tokio::spawn(async move {
            recorded::write(&a, 2, key, term, "term 100, paused", &history).await
        })
    };
    fencegate_tests::eventually(Duration::from_secs(10), "the upload is held", || async {
        bed.proxy.held_bytes() > 0
    })
    .await;
    bed.gateway.signal("STOP");
    let newer = recorded::write(&b, 3, key, term + 1, "term 101", history).await;
    assert_eq!(newer, Outcome::Applied { version: None });
    read_all(&[&b], key, history).await;
    bed.proxy.release();
    tokio::time::sleep(Duration::from_millis(200)).await;
    bed.gateway.signal("CONT");

    let late = late.await.expect("the paused PUT's task");
    assert_eq!(
        late,
        Outcome::Stale {
            highest: Some(term + 1)
        }
    );
    assert_eq!(
        read_all(&[&b, &a], key, history).await,
        (200, "term 101".into())
    );
}

/// A multipart upload's record lives in the fence's store, not in a gateway: after
/// kill -9 of the gateway that started it, another gateway completes it, and the
/// object shows; an upload of a term overtaken meanwhile is refused at Complete.
async fn a_gateway_killed_during_a_multipart_upload_loses_nothing(
    bed: &mut DoorBed,
    history: &Recorder,
) {
    let (key, stale_key) = ("orders/killed.json", "orders/killed-stale.json");
    let s3 = bed.client(WRITER);
    let term = bed.highest().await;
    let mut uploads = Vec::new();
    for key in [key, stale_key] {
        let created = create_upload(&s3, key, term).await;
        assert_eq!(created.status, 200, "{}", text(&created));
        let upload = xml_values(&text(&created), "UploadId").remove(0);
        let part = upload_part(&s3, key, &upload, 1, format!("all of {key}").into_bytes()).await;
        assert_eq!(part.status, 200, "{}", text(&part));
        uploads.push((upload, vec![(1, part.header("etag").unwrap().to_owned())]));
    }
    bed.gateway.kill().await;

    bed.gateway = bed.replica().spawn().await;
    let s3 = bed.client(WRITER);
    let (upload, parts) = &uploads[0];
    let completed = recorded_complete(&s3, key, term, upload, parts, history).await;
    assert_eq!(completed, Outcome::Applied { version: None });
    assert_eq!(
        read_all(&[&s3], key, history).await,
        (200, format!("all of {key}"))
    );

    recorded_advance(bed, term + 1, history).await;
    let (upload, parts) = &uploads[1];
    let completed = recorded_complete(&s3, stale_key, term, upload, parts, history).await;
    assert_eq!(
        completed,
        Outcome::Stale {
            highest: Some(term + 1)
        }
    );
    assert_eq!(read_all(&[&s3], stale_key, history).await.0, 404);
}

/// CompleteMultipartUpload, recorded as the write of the upload's bytes (`all of
/// <key>`, as the steps upload them) that takes effect at its commit.
async fn recorded_complete(
    s3: &S3Client,
    key: &str,
    term: u64,
    upload: &str,
    parts: &[(u32, String)],
    history: &Recorder,
) -> Outcome {
    let invoked = now();
    let reply = complete_upload(s3, key, upload, parts).await;
    let outcome = recorded::write_outcome(&reply);
    history.record(Entry {
        client: 800,
        resource: recorded::RESOURCE.to_owned(),
        op: Op::Write {
            key: key.to_owned(),
            token: term,
            value: format!("all of {key}"),
            if_version: None,
        },
        invoked,
        completed: now(),
        outcome: outcome.clone(),
    });
    outcome
}

/// radosgw killed and started again: a PUT while it is down fails with a retryable
/// error and shows nothing; every acknowledged object is there afterwards, and the
/// retried PUT is applied.
async fn an_upstream_restart_loses_no_acknowledged_write(bed: &mut DoorBed, history: &Recorder) {
    let key = "orders/restart.json";
    let s3 = bed.client(WRITER);
    let term = bed.highest().await;
    let before = recorded::write(&s3, 10, key, term, "before", history).await;
    assert_eq!(before, Outcome::Applied { version: None });
    bed.rgw.stop_gateway().await;
    let invoked = now();
    let failed = put(&s3, key, term, "while down").await;
    assert_eq!(failed.status, 503, "{}", text(&failed));
    history.record(Entry {
        client: 11,
        resource: recorded::RESOURCE.to_owned(),
        op: Op::Write {
            key: key.to_owned(),
            token: term,
            value: "while down".into(),
            if_version: None,
        },
        invoked,
        completed: now(),
        outcome: Outcome::Indeterminate,
    });
    bed.rgw.start_gateway().await;
    assert_eq!(read_all(&[&s3], key, history).await, (200, "before".into()));
    assert_eq!(
        read_all(&[&s3], "orders/paused.json", history).await,
        (200, "term 101".into())
    );
    let retried = recorded::write(&s3, 12, key, term, "after", history).await;
    assert_eq!(retried, Outcome::Applied { version: None });
    assert_eq!(read_all(&[&s3], key, history).await, (200, "after".into()));
}

/// The collector (here a replica's, sweeping every 300 ms, with a grace of one second
/// and an upload bound of five, which no PUT of the test takes): it removes the
/// physical objects of overwritten and refused uploads, never one a mapping names; and
/// once it took an abandoned upload's intent, that upload can no longer be made
/// visible.
#[tokio::test]
async fn the_collector_removes_only_what_nothing_names() {
    let bed = DoorBed::start().await;
    let collecting = bed
        .direct_replica()
        .args(&[
            "--s3-gc-interval",
            "300ms",
            "--s3-gc-grace",
            "1s",
            "--s3-upload-max-age",
            "5s",
        ])
        .spawn()
        .await;
    let s3 = bed.client(WRITER);
    let key = "orders/collected.json";
    for body in ["first", "second", "third"] {
        assert_eq!(put(&s3, key, 7, body).await.status, 200);
    }
    fencegate_tests::eventually(
        Duration::from_secs(20),
        "the overwritten objects are collected",
        || async { bed.physical_keys().await.len() == 1 },
    )
    .await;
    assert_eq!(body_of(&s3, key).await, (200, "third".into()));

    // An upload held past the upload bound: its intent is collected meanwhile, so
    // its commit fails, and the object it landed is collected in turn.
    bed.proxy.hold();
    let held = {
        let s3 = s3.clone();
        tokio::spawn(async move { put(&s3, key, 7, "held too long").await })
    };
    fencegate_tests::eventually(Duration::from_secs(10), "the upload is held", || async {
        bed.proxy.held_bytes() > 0
    })
    .await;
    fencegate_tests::eventually(
        Duration::from_secs(20),
        "the collector takes the held upload's intent",
        || async {
            collecting
                .events("S3 door: collected unreferenced uploads")
                .iter()
                .any(|event| event["fields"]["intents"].as_u64() >= Some(1))
        },
    )
    .await;
    bed.proxy.release();
    let held = held.await.expect("the held PUT's task");
    assert_eq!(held.status, 500, "{}", text(&held));
    assert!(
        text(&held).contains("outlived its intent"),
        "{}",
        text(&held)
    );
    assert_eq!(body_of(&s3, key).await, (200, "third".into()));
    fencegate_tests::eventually(
        Duration::from_secs(20),
        "the late upload's object is collected",
        || async { bed.physical_keys().await.len() == 1 },
    )
    .await;
    assert_eq!(body_of(&s3, key).await, (200, "third".into()));
}

/// With `--s3-tls-cert`, the door speaks HTTPS: boto3, trusting the test CA, runs the
/// seed's scenario over it, word for word: `orders/2026-12.json` written under term 41,
/// then term 42, then term 41's late PUT refused with 409 `StaleFencingToken`, the
/// object still holding term 42's bytes.
#[tokio::test]
async fn the_door_speaks_https_with_a_certificate() {
    let certs = fencegate_tests::tls::Certs::generate();
    let (cert, key) = (
        certs.cert.display().to_string(),
        certs.key.display().to_string(),
    );
    let bed = DoorBed::start_with(&["--s3-tls-cert", &cert, "--s3-tls-key", &key]).await;
    let endpoint = format!("https://localhost:{}", bed.gateway.s3_addr().port());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/s3/boto3_seed.py");
    let output = tokio::process::Command::new("python3")
        .arg(script)
        .args([
            &endpoint,
            WRITER.0,
            WRITER.1,
            BUCKET,
            "orders/2026-12.json",
            "41",
        ])
        .env("AWS_CA_BUNDLE", &certs.ca)
        .output()
        .await
        .expect("python3 runs");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "boto3 over HTTPS failed:\n{said}");
    assert!(
        said.contains("late PUT refused: StaleFencingToken"),
        "{said}"
    );
    assert!(said.contains("the object holds 'term 42'"), "{said}");
    assert!(
        said.contains("multipart upload of 6291456 bytes in 2 parts"),
        "{said}"
    );
    // Cleartext to the TLS door gets no answer.
    let plain = Client::new(format!("http://{}", bed.gateway.s3_addr()))
        .try_request(Method::GET, "/data/orders/2026-12.json", &[], "")
        .await;
    assert!(plain.is_err() || plain.is_ok_and(|reply| reply.status != 200));
}

/// Issuer bindings (`--issued-by`) hold at the S3 door as on the others: with `orders`
/// bound to the gateway's hosted leases, a token no lease issued is refused with 403
/// `TokenNotIssued` and nothing reaches the bucket; the token of a lease the writer
/// holds is taken.
#[tokio::test]
async fn issuer_bindings_hold_at_the_s3_door() {
    let bed = DoorBed::start_with(&["--issued-by", "gateway:orders"]).await;
    let s3 = bed.client(WRITER);
    let key = "orders/issued.json";
    let refused = put(&s3, key, 7, "no lease issued this").await;
    assert_eq!(refused.status, 403, "{}", text(&refused));
    assert_eq!(
        error_code(&refused).as_deref(),
        Some("TokenNotIssued"),
        "{}",
        text(&refused)
    );
    assert!(bed.physical_keys().await.is_empty());

    let http = Client::new(bed.gateway.url());
    let granted = http
        .request(
            Method::POST,
            "/v1/leases/orders/acquire",
            &[
                ("content-type", "application/json"),
                ("authorization", &format!("Bearer {HTTP_KEY}")),
            ],
            r#"{"holder": "writer-1", "ttl_ms": 60000}"#,
        )
        .await;
    assert_eq!(
        granted.status,
        200,
        "{}",
        String::from_utf8_lossy(&granted.body)
    );
    let term = granted.json()["token"].as_u64().expect("a lease's token");
    let taken = put(&s3, key, term, "under the lease").await;
    assert_eq!(taken.status, 200, "{}", text(&taken));
    assert_eq!(body_of(&s3, key).await, (200, "under the lease".into()));
}
