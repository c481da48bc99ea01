//! ListObjectsV2, answered from the mappings, not from the bucket (which holds physical
//! keys): keys in byte order, as S3 sorts them; `prefix`, `delimiter` folding keys into
//! common prefixes, `max-keys` and an opaque continuation token.
//!
//! A bucket's keys may belong to several resources (`--s3-resource`): the listing
//! merges the mappings of every resource its prefix may reach, keeping of each key
//! only the mapping in the resource the key resolves to now. It needs the read grant
//! on each of them. It is read page by page from the store, not as one snapshot: a
//! listing that spans pages may miss a key written meanwhile, as S3's may.

use base64::Engine;
use fencegate_proto::ResourceName;
use s3s::dto::{CommonPrefix, ListObjectsV2Input, ListObjectsV2Output, Object};
use s3s::{S3Error, S3ErrorCode, S3Request, S3Result};

use super::layout::{self, Mapping};
use super::service::S3Door;
use super::wire::s3_error_of;
use crate::auth::Action;

/// Most keys a listing answers in one page, as S3.
const MAX_KEYS: usize = 1000;

/// Mappings read from each resource per store call.
const BATCH: usize = 1000;

/// A store key above every key that starts with `prefix` (no `char` is above it).
fn past(prefix: &str) -> String {
    format!("{prefix}{}", char::MAX)
}

/// One line of the answer.
enum Entry {
    Key(String, Mapping),
    Folded(String),
}

impl S3Door {
    pub(super) async fn list_v2(
        &self,
        req: S3Request<ListObjectsV2Input>,
    ) -> S3Result<ListObjectsV2Output> {
        let caller = self.caller(&req)?;
        let input = req.input;
        let bucket = input.bucket.as_str();
        self.served(bucket)?;
        let prefix = input.prefix.clone().unwrap_or_default();
        let delimiter = input.delimiter.clone().filter(|d| !d.is_empty());
        let max_keys = match input.max_keys {
            Some(n) if n < 0 => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    "max-keys must not be negative",
                ))
            }
            Some(n) => usize::try_from(n).unwrap_or(0).min(MAX_KEYS),
            None => MAX_KEYS,
        };
        let covering = self
            .resources
            .covering(bucket, &prefix)
            .map_err(|e| S3Error::with_message(S3ErrorCode::InvalidBucketName, e))?;
        for resource in &covering {
            self.may(&caller, Action::Read, resource)?;
        }
        let root = layout::mapping_root(bucket);
        let store_prefix = format!("{root}{prefix}");
        let mut cursor = match (&input.continuation_token, &input.start_after) {
            (Some(token), _) => Some(decode_token(token, &root)?),
            (None, Some(after)) => Some(format!("{root}{after}")),
            (None, None) => None,
        };

        let mut entries: Vec<Entry> = Vec::new();
        let mut truncated = false;
        'pages: loop {
            let (keys, bound) = self
                .merged_page(&covering, bucket, &store_prefix, cursor.as_deref())
                .await?;
            for (store_key, mapping) in keys {
                if entries.len() == max_keys {
                    truncated = true;
                    break 'pages;
                }
                let key = &store_key[root.len()..];
                let folded = delimiter.as_deref().and_then(|delimiter| {
                    key[prefix.len()..]
                        .find(delimiter)
                        .map(|at| key[..prefix.len() + at + delimiter.len()].to_owned())
                });
                match folded {
                    Some(common) => {
                        cursor = Some(past(&format!("{root}{common}")));
                        entries.push(Entry::Folded(common));
                        continue 'pages;
                    }
                    None => {
                        cursor = Some(store_key.clone());
                        entries.push(Entry::Key(key.to_owned(), mapping));
                    }
                }
            }
            match bound {
                // Every key up to the bound was taken or belongs elsewhere.
                Some(bound) => cursor = Some(bound),
                None => break,
            }
        }

        let next = truncated
            .then(|| cursor.as_deref().map(encode_token))
            .flatten();
        let key_count = i32::try_from(entries.len()).unwrap_or(i32::MAX);
        let (mut contents, mut common_prefixes) = (Vec::new(), Vec::new());
        for entry in entries {
            match entry {
                Entry::Key(key, mapping) => contents.push(Object {
                    key: Some(key),
                    e_tag: Some(s3s::dto::ETag::Strong(
                        mapping.etag.trim_matches('"').to_owned(),
                    )),
                    size: Some(i64::try_from(mapping.size).unwrap_or(i64::MAX)),
                    last_modified: Some(super::wire::timestamp(mapping.written_at_ms)),
                    storage_class: Some(s3s::dto::ObjectStorageClass::from_static("STANDARD")),
                    ..Default::default()
                }),
                Entry::Folded(prefix) => common_prefixes.push(CommonPrefix {
                    prefix: Some(prefix),
                }),
            }
        }
        Ok(ListObjectsV2Output {
            name: Some(input.bucket),
            prefix: Some(prefix),
            delimiter,
            max_keys: Some(i32::try_from(max_keys).unwrap_or(i32::MAX)),
            key_count: Some(key_count),
            is_truncated: Some(truncated),
            continuation_token: input.continuation_token,
            next_continuation_token: next,
            start_after: input.start_after,
            contents: (!contents.is_empty()).then_some(contents),
            common_prefixes: (!common_prefixes.is_empty()).then_some(common_prefixes),
            ..Default::default()
        })
    }

    /// The next mappings after `cursor`, merged across `resources` in key order, each
    /// kept only if its key resolves to the resource it was found in; and the key up to
    /// which that is all (`None`: nothing is left after them). Where a resource's batch
    /// was full, keys past its last one are left for the next call, so that none is
    /// skipped.
    async fn merged_page(
        &self,
        resources: &[ResourceName],
        bucket: &str,
        store_prefix: &str,
        cursor: Option<&str>,
    ) -> S3Result<(Vec<(String, Mapping)>, Option<String>)> {
        let mut merged = Vec::new();
        let mut bound: Option<String> = None;
        for resource in resources {
            let page = self
                .coordinator
                .list(resource, store_prefix, cursor, BATCH)
                .await
                .map_err(s3_error_of)?;
            if page.len() == BATCH {
                let last = page.last().map(|(key, _)| key.clone());
                bound = match (bound, last) {
                    (Some(bound), Some(last)) => Some(bound.min(last)),
                    (bound, last) => bound.or(last),
                };
            }
            let root = layout::mapping_root(bucket);
            for (store_key, value) in page {
                let key = &store_key[root.len()..];
                if self.resources.resolve(bucket, key).as_ref() != Ok(resource) {
                    continue;
                }
                let mapping = Mapping::decode(&value, resource)
                    .map_err(|e| S3Error::with_message(S3ErrorCode::InternalError, e))?;
                merged.push((store_key, mapping));
            }
        }
        merged.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        if let Some(bound) = &bound {
            merged.retain(|(key, _)| key.as_bytes() <= bound.as_bytes());
        }
        Ok((merged, bound))
    }
}

fn encode_token(cursor: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(cursor)
}

fn decode_token(token: &str, root: &str) -> S3Result<String> {
    let invalid = || {
        S3Error::with_message(
            S3ErrorCode::InvalidArgument,
            "the continuation token is not one this bucket's listing gave",
        )
    };
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| invalid())?;
    let cursor = String::from_utf8(bytes).map_err(|_| invalid())?;
    if cursor.starts_with(root) {
        Ok(cursor)
    } else {
        Err(invalid())
    }
}
