//! S3 operations through the door, recorded in a history for the checker
//! ([`crate::history`]): a PUT is a write of its key with its token, a GET a read, and a
//! multipart upload a write that takes effect at its Complete. The resource is the
//! fence's, `orders` for the door's test bed.

use crate::history::{now, Entry, Op, Outcome, Recorder};
use crate::http::Reply;
use crate::s3::client::{error_code, object_path, text};
use crate::s3::door::BUCKET;
use crate::s3::S3Client;

/// The fence's resource of the bed's `orders/` keys, as the checker names it.
pub const RESOURCE: &str = "orders";

/// A PUT with the token in metadata, recorded.
pub async fn write(
    s3: &S3Client,
    client: u32,
    key: &str,
    term: u64,
    value: &str,
    history: &Recorder,
) -> Outcome {
    let op = Op::Write {
        key: key.to_owned(),
        token: term,
        value: value.to_owned(),
        if_version: None,
    };
    let invoked = now();
    let reply = s3
        .try_put(
            BUCKET,
            key,
            &[("x-amz-meta-fencing-token", &term.to_string())],
            value.to_owned(),
        )
        .await;
    let completed = now();
    let outcome = match &reply {
        Ok(reply) => write_outcome(reply),
        Err(_) => Outcome::Indeterminate,
    };
    history.record(Entry {
        client,
        resource: RESOURCE.to_owned(),
        op,
        invoked,
        completed,
        outcome: outcome.clone(),
    });
    outcome
}

/// What a write's answer tells the checker.
pub fn write_outcome(reply: &Reply) -> Outcome {
    match reply.status {
        200 => Outcome::Applied { version: None },
        409 if error_code(reply).as_deref() == Some("StaleFencingToken") => Outcome::Stale {
            highest: reply.header("fencing-highest").and_then(|h| h.parse().ok()),
        },
        // Refused before anything was tried.
        400 | 403 => panic!("a write of the run was refused: {}", text(reply)),
        _ => Outcome::Indeterminate,
    }
}

/// A GET, recorded.
pub async fn read(s3: &S3Client, client: u32, key: &str, history: &Recorder) {
    let invoked = now();
    let reply = s3
        .try_request_path(http::Method::GET, &object_path(BUCKET, key), &[], "")
        .await;
    let completed = now();
    let outcome = match reply {
        Ok(reply) if reply.status == 200 => Outcome::Read {
            value: Some(text(&reply)),
            version: None,
        },
        Ok(reply) if reply.status == 404 => Outcome::Read {
            value: None,
            version: None,
        },
        _ => Outcome::NotApplied,
    };
    history.record(Entry {
        client,
        resource: RESOURCE.to_owned(),
        op: Op::Read {
            key: key.to_owned(),
        },
        invoked,
        completed,
        outcome,
    });
}
