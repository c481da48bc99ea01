//! What the S3 door relies on its upstream for, pinned against a real one: Debian's
//! radosgw 16 over a single-node Ceph cluster the test starts (`fencegate_tests::s3`).
//!
//! Each fact is a step with the server behaviour it pins in its doc comment; the test
//! runs every step on one cluster, each in a bucket of its own, and checks that every
//! step ran. Where radosgw 16 differs from AWS S3 the step says so: the door must map
//! both.
//!
//! Needs `ceph-mon`, `ceph-osd`, `radosgw` and `ceph-common`; fails, never skips,
//! without them.

use std::future::Future;
use std::pin::Pin;

use http::Method;

use fencegate_tests::http::Reply;
use fencegate_tests::s3::client::{error_code, object_path, text, xml_values};
use fencegate_tests::s3::{Radosgw, S3Client};

/// Writers racing in each conditional-write race.
const RACERS: usize = 16;

/// Races run per fact: one round can be won by luck of scheduling.
const ROUNDS: usize = 4;

/// The smallest part radosgw takes in a multipart upload but for the last.
const MIN_PART: usize = 5 << 20;

type Step = for<'a> fn(&'a S3Client, &'a str) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

/// Every fact, by name, with the bucket it runs in named after it.
const STEPS: &[(&str, Step)] = &[
    ("metadata-round-trips", |s3, b| {
        Box::pin(metadata_round_trips(s3, b))
    }),
    ("if-none-match-refuses-existing", |s3, b| {
        Box::pin(if_none_match_refuses_an_existing_key(s3, b))
    }),
    ("if-none-match-race", |s3, b| {
        Box::pin(if_none_match_race_has_one_winner(s3, b))
    }),
    ("if-match-unquoted-etag", |s3, b| {
        Box::pin(if_match_takes_the_unquoted_etag(s3, b))
    }),
    ("if-match-missing-key", |s3, b| {
        Box::pin(if_match_on_a_missing_key_is_412(s3, b))
    }),
    ("if-match-race", |s3, b| {
        Box::pin(if_match_race_has_one_winner(s3, b))
    }),
    ("list-v2", |s3, b| {
        Box::pin(list_v2_prefix_delimiter_pages(s3, b))
    }),
    ("unsigned-payload", |s3, b| {
        Box::pin(unsigned_payload_is_taken_over_http(s3, b))
    }),
    ("multipart", |s3, b| {
        Box::pin(multipart_completes_without_its_condition(s3, b))
    }),
];

#[tokio::test]
async fn radosgw_honours_what_the_s3_door_relies_on() {
    let rgw = Radosgw::start().await;
    eprintln!(
        "radosgw answered {:.2} s after the start of an empty cluster",
        rgw.start_time().as_secs_f64()
    );
    let s3 = rgw.client();
    let mut ran = Vec::new();
    for (name, step) in STEPS {
        let bucket = format!("pin-{name}");
        s3.create_bucket(&bucket).await;
        step(&s3, &bucket).await;
        ran.push(*name);
    }
    assert_eq!(ran.len(), STEPS.len(), "every step ran");
}

/// The ETag header of an answer, quotes and all.
fn etag(reply: &Reply) -> String {
    reply
        .header("etag")
        .unwrap_or_else(|| panic!("no ETag in {:?}", reply.headers))
        .to_owned()
}

async fn body_of(s3: &S3Client, bucket: &str, key: &str) -> String {
    let reply = s3.get(bucket, key).await;
    assert_eq!(reply.status, 200, "GET {key}: {}", text(&reply));
    text(&reply)
}

/// User metadata set on PUT comes back on HEAD and GET as sent: a token presented as
/// `x-amz-meta-fencing-token` can be read back off the object.
async fn metadata_round_trips(s3: &S3Client, bucket: &str) {
    let put = s3
        .put(bucket, "k", &[("x-amz-meta-fencing-token", "41")], "v")
        .await;
    assert_eq!(put.status, 200, "{}", text(&put));
    let head = s3.head(bucket, "k").await;
    assert_eq!(head.status, 200);
    assert_eq!(head.header("x-amz-meta-fencing-token"), Some("41"));
}

/// `If-None-Match: *` on a key that exists is refused with 412 PreconditionFailed and
/// the object keeps its bytes: a write-once key cannot be overwritten.
async fn if_none_match_refuses_an_existing_key(s3: &S3Client, bucket: &str) {
    let first = s3
        .put(bucket, "k", &[("if-none-match", "*")], "first")
        .await;
    assert_eq!(
        first.status,
        200,
        "a fresh key is created: {}",
        text(&first)
    );
    let second = s3
        .put(bucket, "k", &[("if-none-match", "*")], "second")
        .await;
    assert_eq!(second.status, 412, "{}", text(&second));
    assert_eq!(error_code(&second).as_deref(), Some("PreconditionFailed"));
    assert_eq!(body_of(s3, bucket, "k").await, "first");
}

/// `RACERS` concurrent `If-None-Match: *` PUTs of one fresh key: exactly one succeeds,
/// every other is refused with 412, and the object holds the winner's bytes. The check
/// for existence and the write are one atomic step on the server.
async fn if_none_match_race_has_one_winner(s3: &S3Client, bucket: &str) {
    for round in 0..ROUNDS {
        let key = format!("race-{round}");
        let answers = race(s3, bucket, &key, &[("if-none-match", "*")]).await;
        let winners = winners(&answers);
        assert_eq!(winners.len(), 1, "round {round}: {answers:?}");
        for (racer, status, code) in &answers {
            assert!(
                *status == 200 || *status == 412,
                "round {round}: racer {racer} got {status} {code:?}"
            );
        }
        assert_eq!(
            body_of(s3, bucket, &key).await,
            format!("racer-{}", winners[0])
        );
    }
}

/// `If-Match` with the current ETag **without quotes** overwrites; with an ETag the
/// object no longer has, it is refused with 412 and the object keeps its bytes.
///
/// radosgw 16 compares the header with the bare ETag: the quoted form RFC 9110 and AWS
/// use (the ETag header as the server sent it) is always refused, current or not — a
/// Pacific bug fixed in later Ceph releases. The door sends the bare form to this
/// server; if the quoted form starts to win, the upstream was upgraded.
async fn if_match_takes_the_unquoted_etag(s3: &S3Client, bucket: &str) {
    let first = s3.put(bucket, "k", &[], "one").await;
    assert_eq!(first.status, 200, "{}", text(&first));
    let quoted = etag(&first);
    let bare = quoted.trim_matches('"').to_owned();
    assert_ne!(quoted, bare, "radosgw sends its ETag header quoted");

    let quoted_try = s3
        .put(bucket, "k", &[("if-match", quoted.as_str())], "quoted")
        .await;
    assert_eq!(
        quoted_try.status,
        412,
        "radosgw 16 refuses a quoted current ETag: {}",
        text(&quoted_try)
    );
    assert_eq!(body_of(s3, bucket, "k").await, "one");

    let second = s3.put(bucket, "k", &[("if-match", &bare)], "two").await;
    assert_eq!(
        second.status,
        200,
        "the bare current ETag wins: {}",
        text(&second)
    );
    assert_eq!(body_of(s3, bucket, "k").await, "two");

    let stale = s3.put(bucket, "k", &[("if-match", &bare)], "three").await;
    assert_eq!(
        stale.status,
        412,
        "a stale ETag is refused: {}",
        text(&stale)
    );
    assert_eq!(error_code(&stale).as_deref(), Some("PreconditionFailed"));
    assert_eq!(body_of(s3, bucket, "k").await, "two");
}

/// `If-Match` on a key that does not exist is refused with 412 and creates nothing.
/// AWS answers 404 NoSuchKey here; the door must read both as "no such object".
async fn if_match_on_a_missing_key_is_412(s3: &S3Client, bucket: &str) {
    let reply = s3
        .put(bucket, "missing", &[("if-match", "0123456789abcdef")], "v")
        .await;
    assert_eq!(reply.status, 412, "{}", text(&reply));
    assert_eq!(s3.head(bucket, "missing").await.status, 404);
}

/// `RACERS` concurrent `If-Match` PUTs with the same current ETag: exactly one
/// succeeds and the object holds its bytes. The losers are refused with 412 or, on
/// radosgw 16, with 500 `UnknownError` (the store's ECANCELED for a lost
/// compare-and-swap; most losers of most rounds here): the write was not applied, but
/// the code is the one of any internal error, so the door can read a 500 only as
/// "unknown" and must look at the object to learn more.
async fn if_match_race_has_one_winner(s3: &S3Client, bucket: &str) {
    for round in 0..ROUNDS {
        let key = format!("race-{round}");
        let seed = s3.put(bucket, &key, &[], "seed").await;
        assert_eq!(seed.status, 200, "{}", text(&seed));
        let bare = etag(&seed).trim_matches('"').to_owned();
        let answers = race(s3, bucket, &key, &[("if-match", &bare)]).await;
        let winners = winners(&answers);
        assert_eq!(winners.len(), 1, "round {round}: {answers:?}");
        let refused_500 = answers.iter().filter(|(_, status, _)| *status == 500);
        let codes: std::collections::BTreeSet<_> = refused_500
            .clone()
            .map(|(_, _, code)| code.clone())
            .collect();
        eprintln!(
            "If-Match race, round {round}: one winner, {} losers answered 500 {codes:?}",
            refused_500.count()
        );
        for (racer, status, code) in &answers {
            assert!(
                matches!(status, 200 | 412 | 500),
                "round {round}: racer {racer} got {status} {code:?}"
            );
            if *status == 500 {
                assert_eq!(code.as_deref(), Some("UnknownError"), "racer {racer}");
            }
        }
        assert_eq!(
            body_of(s3, bucket, &key).await,
            format!("racer-{}", winners[0])
        );
    }
}

/// ListObjectsV2 with `prefix` and `delimiter` lists the keys directly under the
/// prefix and rolls deeper ones into `CommonPrefixes`; `max-keys` truncates and
/// `continuation-token` resumes where the last page stopped, keys in UTF-8 order.
async fn list_v2_prefix_delimiter_pages(s3: &S3Client, bucket: &str) {
    for key in ["a/1", "a/2", "a/b/3", "b/4", "top"] {
        let reply = s3.put(bucket, key, &[], key.to_owned()).await;
        assert_eq!(reply.status, 200, "{key}: {}", text(&reply));
    }

    let under_a = s3
        .list(bucket, &[("prefix", "a/"), ("delimiter", "/")])
        .await;
    assert_eq!(under_a.status, 200, "{}", text(&under_a));
    let body = text(&under_a);
    assert_eq!(xml_values(&body, "Key"), ["a/1", "a/2"], "{body}");
    assert_eq!(common_prefixes(&body), ["a/b/"], "{body}");

    let top = s3.list(bucket, &[("delimiter", "/")]).await;
    let body = text(&top);
    assert_eq!(xml_values(&body, "Key"), ["top"], "{body}");
    assert_eq!(common_prefixes(&body), ["a/", "b/"], "{body}");

    let mut keys = Vec::new();
    let mut token: Option<String> = None;
    for _page in 0..10 {
        let mut params = vec![("prefix", "a/"), ("max-keys", "1")];
        if let Some(token) = &token {
            params.push(("continuation-token", token.as_str()));
        }
        let page = s3.list(bucket, &params).await;
        assert_eq!(page.status, 200, "{}", text(&page));
        let body = text(&page);
        keys.extend(xml_values(&body, "Key"));
        token = xml_values(&body, "NextContinuationToken")
            .into_iter()
            .next();
        let truncated = xml_values(&body, "IsTruncated") == ["true"];
        assert_eq!(truncated, token.is_some(), "{body}");
        if !truncated {
            break;
        }
    }
    assert_eq!(keys, ["a/1", "a/2", "a/b/3"], "every key once, in order");
}

/// The `Prefix` of each `CommonPrefixes` element.
fn common_prefixes(body: &str) -> Vec<String> {
    xml_values(body, "CommonPrefixes")
        .iter()
        .flat_map(|group| xml_values(group, "Prefix"))
        .collect()
}

/// `RACERS` concurrent PUTs of `key`, racer i writing `racer-i` with `headers`; each
/// racer's status and error code, in racer order.
async fn race(
    s3: &S3Client,
    bucket: &str,
    key: &str,
    headers: &[(&str, &str)],
) -> Vec<(usize, u16, Option<String>)> {
    let puts = (0..RACERS).map(|racer| async move {
        let reply = s3
            .try_put(bucket, key, headers, format!("racer-{racer}"))
            .await
            .unwrap_or_else(|e| panic!("racer {racer}: {e}"));
        (racer, reply.status, error_code(&reply))
    });
    futures_util::future::join_all(puts).await
}

fn winners(answers: &[(usize, u16, Option<String>)]) -> Vec<usize> {
    answers
        .iter()
        .filter(|(_, status, _)| *status == 200)
        .map(|(racer, _, _)| *racer)
        .collect()
}

/// A PUT signed with `x-amz-content-sha256: UNSIGNED-PAYLOAD` is taken over plain HTTP
/// and stores the bytes sent: the door can stream a body upstream as it arrives,
/// without hashing it first. (AWS takes it too; over plain HTTP nothing protects the
/// body on the way, which is why the door signs it only over TLS unless told.)
async fn unsigned_payload_is_taken_over_http(s3: &S3Client, bucket: &str) {
    let unsigned = s3.clone().with_unsigned_payload();
    let put = unsigned
        .put(bucket, "k", &[("if-none-match", "*")], "streamed")
        .await;
    assert_eq!(put.status, 200, "{}", text(&put));
    assert_eq!(body_of(s3, bucket, "k").await, "streamed");
}

/// A multipart upload — Create, two parts (all but the last at least 5 MiB), Complete —
/// makes one object of the parts' bytes, visible only once completed. Facts of radosgw
/// 16 the door must work around:
///
/// - `If-None-Match: *` on CompleteMultipartUpload is ignored: completing over an
///   existing key replaces it (AWS refuses with 412 since 2024). So the write-once
///   physical keys of the mapped layout must be fresh by construction (a uuid in the
///   key), not by a condition, and the plain layout cannot condition a multipart write.
/// - CompleteMultipartUpload answers with an empty `<ETag>`: the object's ETag
///   (`"<md5 of the parts' md5s>-<parts>"`) comes from a HEAD afterwards.
async fn multipart_completes_without_its_condition(s3: &S3Client, bucket: &str) {
    let taken = s3.put(bucket, "k", &[], "old").await;
    assert_eq!(taken.status, 200, "{}", text(&taken));
    let path = object_path(bucket, "k");

    let create = s3
        .request_path(Method::POST, &format!("{path}?uploads"), &[], "")
        .await;
    assert_eq!(create.status, 200, "{}", text(&create));
    let upload = xml_values(&text(&create), "UploadId").remove(0);
    let mut parts = String::new();
    for (number, bytes) in [(1, vec![b'x'; MIN_PART]), (2, b"tail".to_vec())] {
        let part = s3
            .request_path(
                Method::PUT,
                &format!("{path}?partNumber={number}&uploadId={upload}"),
                &[],
                bytes,
            )
            .await;
        assert_eq!(part.status, 200, "part {number}: {}", text(&part));
        parts += &format!(
            "<Part><PartNumber>{number}</PartNumber><ETag>{}</ETag></Part>",
            etag(&part)
        );
    }
    assert_eq!(
        s3.head(bucket, "k").await.header("content-length"),
        Some("3"),
        "the parts are not visible before Complete"
    );

    let complete = s3
        .request_path(
            Method::POST,
            &format!("{path}?uploadId={upload}"),
            &[("if-none-match", "*")],
            format!("<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>"),
        )
        .await;
    assert_eq!(
        complete.status,
        200,
        "radosgw 16 ignores If-None-Match on Complete: {}",
        text(&complete)
    );
    assert_eq!(
        xml_values(&text(&complete), "ETag"),
        [""],
        "radosgw 16 leaves Complete's ETag empty"
    );
    let head = s3.head(bucket, "k").await;
    assert_eq!(
        head.header("content-length"),
        Some((MIN_PART + 4).to_string().as_str()),
        "the upload replaced the existing object"
    );
    assert!(etag(&head).ends_with("-2\""), "{}", etag(&head));
}
