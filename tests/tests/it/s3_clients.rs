//! Real S3 SDKs through the S3 door, in front of a real radosgw
//! (`fencegate_tests::s3::door`): boto3 with the Python client's `fence_s3_client`,
//! `@aws-sdk/client-s3` with object metadata and with the TypeScript client's
//! middleware, and the Rust SDK (`aws-sdk-s3`) with metadata and with a header added
//! before signing. Each runs the seed's scenario on a key of its own — term T writes,
//! term T+1 writes, T's late write is refused with `409 StaleFencingToken` and
//! `Fencing-Highest: T+1`, the object keeps T+1's bytes — and checks that a header
//! token is one of the request's SigV4 signed headers.
//!
//! The scripts (`tests/clients/s3/`) run on the machine's python3 and node, with the
//! packages `tests/clients/install.sh` installs: boto3 and httpx for python3, the SDK
//! in `tests/clients/node`, TypeScript in `clients/node`. A missing one fails its step,
//! naming what to run; nothing is skipped. One bed runs every step, and the test
//! checks that every step ran.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_s3::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::{
    BehaviorVersion, ConfigBag, Credentials, Intercept, Region, RuntimeComponents,
};
use aws_sdk_s3::error::{BoxError, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use fencegate_tests::s3::client::text;
use fencegate_tests::s3::door::{DoorBed, BUCKET, READER, WRITER};
use tokio::process::Command;

type Step = for<'a> fn(&'a DoorBed, &'a str) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

const STEPS: &[(&str, Step)] = &[
    ("boto3", |bed, k| {
        Box::pin(boto3_with_the_python_hook(bed, k))
    }),
    ("aws-sdk-js", |bed, k| {
        Box::pin(aws_sdk_js_with_metadata_and_the_middleware(bed, k))
    }),
    ("aws-sdk-rust", |bed, k| {
        Box::pin(aws_sdk_rust_with_metadata_and_a_signed_header(bed, k))
    }),
];

#[tokio::test]
async fn real_s3_sdks_write_through_the_door_and_are_fenced() {
    let bed = DoorBed::start().await;
    let mut ran = Vec::new();
    for (name, step) in STEPS {
        let key = format!("orders/sdk-{name}.json");
        step(&bed, &key).await;
        ran.push(*name);
    }
    assert_eq!(ran.len(), STEPS.len(), "every step ran");
}

/// How long one script may take (the TypeScript compile included).
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(120);

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the workspace")
}

fn script(name: &str) -> PathBuf {
    repo().join("tests/clients/s3").join(name)
}

/// Fails, naming the installer, when `path` (something it installs) is missing.
fn installed(path: &Path) {
    assert!(
        path.exists(),
        "{} is missing: run tests/clients/install.sh",
        path.display()
    );
}

/// Runs `command`, failing loudly if it cannot start, runs too long or exits non-zero;
/// returns what it printed.
async fn run(mut command: Command) -> String {
    command.kill_on_drop(true);
    let shown = format!("{command:?}");
    let output: Output = tokio::time::timeout(SCRIPT_TIMEOUT, command.output())
        .await
        .unwrap_or_else(|_| panic!("{shown} ran longer than {SCRIPT_TIMEOUT:?}"))
        .unwrap_or_else(|e| {
            panic!("{shown} cannot run ({e}); tests/clients/install.sh installs the clients")
        });
    let said = format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "{shown}: {}\n{said}",
        output.status
    );
    said
}

/// The arguments every script takes: ENDPOINT ACCESS_KEY SECRET BUCKET KEY TERM.
fn door_args(bed: &DoorBed, key: &str, term: u64) -> Vec<String> {
    vec![
        format!("http://{}", bed.gateway.s3_addr()),
        WRITER.0.into(),
        WRITER.1.into(),
        BUCKET.into(),
        key.into(),
        term.to_string(),
    ]
}

/// What the door serves for `key`, read by another identity, and the fence after it.
async fn assert_kept(bed: &DoorBed, key: &str, term: u64) {
    let reply = bed.client(READER).get(BUCKET, key).await;
    assert_eq!(
        (reply.status, text(&reply)),
        (200, format!("term {term}")),
        "the door serves term {term}'s bytes"
    );
    assert_eq!(
        bed.highest().await,
        term,
        "no refused write raised the fence"
    );
}

/// boto3, with `fencegate.fence_s3_client` from `clients/python/src` adding the header.
async fn boto3_with_the_python_hook(bed: &DoorBed, key: &str) {
    let term = bed.highest().await + 1;
    let python = repo().join("clients/python/src");
    let mut command = Command::new("python3");
    command
        .arg(script("boto3_fenced.py"))
        .args(door_args(bed, key, term))
        .env("PYTHONPATH", &python);
    let said = run(command).await;
    for line in [
        "late PUT refused: StaleFencingToken",
        "late DELETE refused: StaleFencingToken",
        "4 writes carried their term's token as a signed header",
    ] {
        assert!(said.contains(line), "{line:?} missing from\n{said}");
    }
    assert_kept(bed, key, term + 1).await;
}

/// `@aws-sdk/client-s3` with metadata, then with the TypeScript client's middleware,
/// compiled from `clients/node/src` into a scratch directory for this run.
async fn aws_sdk_js_with_metadata_and_the_middleware(bed: &DoorBed, key: &str) {
    installed(&repo().join("tests/clients/node/node_modules/@aws-sdk/client-s3"));
    let tsc = repo().join("clients/node/node_modules/typescript/bin/tsc");
    installed(&tsc);
    let compiled = Scratch::new("fencegate-node");
    let mut command = Command::new("node");
    command
        .arg(&tsc)
        .arg("-p")
        .arg(repo().join("clients/node/tsconfig.json"))
        .arg("--outDir")
        .arg(&compiled.0);
    run(command).await;
    // The package is ESM, which Node decides by the nearest package.json.
    std::fs::write(compiled.0.join("package.json"), r#"{"type": "module"}"#)
        .expect("the scratch directory is writable");

    let term = bed.highest().await + 1;
    let mut command = Command::new("node");
    command
        .arg(script("aws_sdk_seed.mjs"))
        .args(door_args(bed, key, term))
        .arg(compiled.0.join("index.js"));
    let said = run(command).await;
    for line in [
        "late PUT refused: StaleFencingToken",
        "late PUT with the middleware refused: StaleFencingToken",
        "late DELETE with the middleware refused: StaleFencingToken",
        "the middleware sent the token as a signed header",
    ] {
        assert!(said.contains(line), "{line:?} missing from\n{said}");
    }
    assert_kept(bed, key, term + 1).await;
}

/// A directory under the system's temp dir, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(prefix: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "{prefix}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The Rust SDK on plain HTTP (its hyper client without TLS), path-style, one attempt
/// per call.
fn rust_sdk(bed: &DoorBed) -> aws_sdk_s3::Client {
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(format!("http://{}", bed.gateway.s3_addr()))
        .region(Region::new("us-east-1"))
        .force_path_style(true)
        .credentials_provider(Credentials::new(
            WRITER.0,
            WRITER.1,
            None,
            None,
            "fencegate-tests",
        ))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .retry_config(RetryConfig::disabled())
        .build();
    aws_sdk_s3::Client::from_conf(config)
}

/// A request's `fencing-token` and `authorization` headers, as sent.
#[derive(Debug, Clone)]
struct Sent {
    token: Option<String>,
    authorization: String,
}

/// Records each request's [`Sent`] headers, after signing.
#[derive(Debug, Default, Clone)]
struct SentHeaders(Arc<Mutex<Vec<Sent>>>);

impl Intercept for SentHeaders {
    fn name(&self) -> &'static str {
        "SentHeaders"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let headers = context.request().headers();
        self.0.lock().unwrap().push(Sent {
            token: headers.get("fencing-token").map(str::to_owned),
            authorization: headers.get("authorization").unwrap_or_default().to_owned(),
        });
        Ok(())
    }
}

/// The refusal of a stale write, as the Rust SDK reports it.
fn assert_stale<T, E>(
    result: Result<T, SdkError<E, aws_sdk_s3::config::http::HttpResponse>>,
    highest: u64,
) where
    T: std::fmt::Debug,
    E: ProvideErrorMetadata + std::fmt::Debug,
{
    let error = result.expect_err("a write of an older term is refused");
    assert_eq!(error.code(), Some("StaleFencingToken"), "{error:?}");
    let response = error.raw_response().expect("the door answered");
    assert_eq!(response.status().as_u16(), 409, "{error:?}");
    assert_eq!(
        response.headers().get("fencing-highest"),
        Some(highest.to_string().as_str())
    );
}

/// `aws-sdk-s3`: the token as metadata (`.metadata("fencing-token", ..)`), then as the
/// `Fencing-Token` header added by `customize().mutate_request(..)`, which runs before
/// signing.
async fn aws_sdk_rust_with_metadata_and_a_signed_header(bed: &DoorBed, key: &str) {
    let s3 = rust_sdk(bed);
    let term = bed.highest().await + 1;
    let put = |token: u64, body: String| {
        s3.put_object()
            .bucket(BUCKET)
            .key(key)
            .metadata("fencing-token", token.to_string())
            .body(ByteStream::from(body.into_bytes()))
            .send()
    };
    put(term, format!("term {term}"))
        .await
        .expect("term T writes");
    put(term + 1, format!("term {}", term + 1))
        .await
        .expect("term T+1 writes");
    assert_stale(put(term, format!("term {term}, late")).await, term + 1);

    let sent = SentHeaders::default();
    let header = move |request: &mut aws_sdk_s3::config::http::HttpRequest| {
        request
            .headers_mut()
            .insert("fencing-token", term.to_string());
    };
    let late = s3
        .put_object()
        .bucket(BUCKET)
        .key(key)
        .body(ByteStream::from_static(b"late, by header"))
        .customize()
        .mutate_request(header)
        .interceptor(sent.clone())
        .send()
        .await;
    assert_stale(late, term + 1);
    let delete = s3
        .delete_object()
        .bucket(BUCKET)
        .key(key)
        .customize()
        .mutate_request(header)
        .interceptor(sent.clone())
        .send()
        .await;
    assert_stale(delete, term + 1);
    let sent = sent.0.lock().unwrap().clone();
    assert_eq!(sent.len(), 2);
    for Sent {
        token,
        authorization,
    } in sent
    {
        assert_eq!(token, Some(term.to_string()));
        let signed = authorization
            .split("SignedHeaders=")
            .nth(1)
            .and_then(|rest| rest.split(',').next())
            .unwrap_or_default();
        assert!(
            signed.split(';').any(|name| name == "fencing-token"),
            "the header is signed: {authorization}"
        );
    }

    let held = s3
        .get_object()
        .bucket(BUCKET)
        .key(key)
        .send()
        .await
        .expect("the object reads back");
    assert_eq!(
        held.metadata().and_then(|m| m.get("fencing-token")),
        Some(&(term + 1).to_string())
    );
    let body = held.body.collect().await.expect("the body").into_bytes();
    assert_eq!(body.as_ref(), format!("term {}", term + 1).as_bytes());
    assert_kept(bed, key, term + 1).await;
}
