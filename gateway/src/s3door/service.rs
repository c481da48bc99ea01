//! The S3 operations of the door, on the mapped layout ([`super::layout`]).
//!
//! A PUT: authenticate (s3s verified the SigV4 signature against [`super::keys`]),
//! resolve the resource, authorise, admit the token as every door does
//! (`Coordinator::admit`: fence cache, write bounds, issuer), record an intent, upload
//! the body to a fresh write-once physical key, then commit — in one store transaction
//! — the intent's removal and the mapping, fenced by the token. The object becomes
//! visible only at that commit.

use std::net::IpAddr;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use fencegate_proto::headers::{Fencing, Precondition};
use fencegate_proto::{ObjectKey, ResourceName, Token};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use s3s::dto::{
    AbortMultipartUploadInput, AbortMultipartUploadOutput, CompleteMultipartUploadInput,
    CompleteMultipartUploadOutput, CreateMultipartUploadInput, CreateMultipartUploadOutput,
    DeleteObjectInput, DeleteObjectOutput, DeleteObjectsInput, DeleteObjectsOutput, GetObjectInput,
    GetObjectOutput, HeadObjectInput, HeadObjectOutput, ListObjectsV2Input, ListObjectsV2Output,
    PutObjectInput, PutObjectOutput, StreamingBlob, Timestamp, UploadPartInput, UploadPartOutput,
};
use s3s::{s3_error, S3Error, S3ErrorCode, S3Request, S3Response, S3Result, S3};

use super::keys::S3Keys;
use super::layout::{self, Intent, Mapping, Resources};
use super::upstream::{Conditional, Upstream, UpstreamError};
use crate::auth::{Action, Identity};
use crate::coordinator::{BodyMemory, Coordinator, FencedRequest, FrontDoor, WritePermit};
use crate::error::ApiError;
use crate::store::txn::{Answered, Txn, TxnOp, TxnOutcome};
use crate::store::{Write, WriteOp};

/// The metadata name (`x-amz-meta-fencing-token`) a writer's token may come in.
pub const TOKEN_METADATA: &str = "fencing-token";

/// The peer of the connection a request came on, added by the listener.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub IpAddr);

/// The S3 door's operations.
pub struct S3Door {
    pub(super) coordinator: Arc<Coordinator>,
    pub(super) upstream: Upstream,
    pub(super) resources: Resources,
    pub(super) keys: Arc<S3Keys>,
    /// The buckets the door serves (`--s3-bucket`).
    pub(super) buckets: std::collections::BTreeSet<String>,
    /// Largest single PUT body the door takes.
    pub(super) max_object: usize,
}

/// Who a request is, as far as the gateway's grants go.
pub(super) struct Caller {
    pub(super) name: String,
    /// `None` without `--auth-file`: every key holder may do everything.
    identity: Option<Arc<Identity>>,
    pub(super) peer: IpAddr,
}

impl S3Door {
    /// The caller of an authenticated request; s3s refused unsigned and badly signed
    /// requests before any operation runs.
    pub(super) fn caller<T>(&self, req: &S3Request<T>) -> S3Result<Caller> {
        let access_key = req
            .credentials
            .as_ref()
            .map(|c| c.access_key.as_str())
            .ok_or_else(|| s3_error!(AccessDenied, "the S3 door takes signed requests only"))?;
        let name = self
            .keys
            .identity(access_key)
            .ok_or_else(|| s3_error!(InvalidAccessKeyId))?
            .to_owned();
        let identity = match self.coordinator.authenticator() {
            None => None,
            Some(auth) => Some(auth.identities().by_name(&name).ok_or_else(|| {
                s3_error!(
                    AccessDenied,
                    "the identity of this access key is not in the gateway's --auth-file"
                )
            })?),
        };
        let peer = req
            .extensions
            .get::<Peer>()
            .map_or(IpAddr::from([0, 0, 0, 0]), |peer| peer.0);
        Ok(Caller {
            name,
            identity,
            peer,
        })
    }

    /// The resource of `key` in `bucket`, if the caller may do `action` on it.
    pub(super) fn authorise(
        &self,
        caller: &Caller,
        action: Action,
        bucket: &str,
        key: &str,
    ) -> S3Result<(ResourceName, ObjectKey)> {
        self.served(bucket)?;
        let resource = self
            .resources
            .resolve(bucket, key)
            .map_err(|e| S3Error::with_message(S3ErrorCode::InvalidBucketName, e))?;
        let mapping_key = layout::mapping_key(bucket, key)
            .map_err(|e| S3Error::with_message(S3ErrorCode::KeyTooLongError, e))?;
        self.may(caller, action, &resource)?;
        Ok((resource, mapping_key))
    }

    /// Refuses a bucket the door does not serve.
    pub(super) fn served(&self, bucket: &str) -> S3Result<()> {
        if self.buckets.contains(bucket) {
            Ok(())
        } else {
            Err(S3Error::with_message(
                S3ErrorCode::NoSuchBucket,
                "the S3 door does not serve this bucket (--s3-bucket)",
            ))
        }
    }

    /// Refuses `action` on `resource` unless the caller's grants allow it.
    pub(super) fn may(
        &self,
        caller: &Caller,
        action: Action,
        resource: &ResourceName,
    ) -> S3Result<()> {
        match &caller.identity {
            Some(identity) if !identity.may(action, Some(resource)) => Err(S3Error::with_message(
                S3ErrorCode::AccessDenied,
                format!(
                    "identity {:?} may not {} resource {resource}",
                    caller.name,
                    action.as_str()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The checks every door's write passes, in their one order.
    pub(super) async fn admit(
        &self,
        caller: &Caller,
        resource: &ResourceName,
        key: &ObjectKey,
        fencing: &Fencing,
    ) -> S3Result<WritePermit> {
        let entry = FencedRequest {
            resource,
            key: Some(key),
            fencing,
            identity: Some(&caller.name),
            client: self.coordinator.client(Some(&caller.name), caller.peer),
            keyed: false,
            door: FrontDoor::S3,
        };
        self.coordinator.admit(entry).await.map_err(s3_error_of)
    }

    /// Records an upload's intent, before anything of it can land upstream: a fenced
    /// write with the upload's token, which must be new.
    pub(super) async fn record_intent(
        &self,
        caller: &Caller,
        resource: &ResourceName,
        upload: uuid::Uuid,
        intent: &Intent,
        fencing: &Fencing,
    ) -> S3Result<()> {
        let write = Write {
            resource: resource.clone(),
            key: layout::intent_key(upload),
            token: fencing.token,
            precondition: Precondition::MustNotExist,
            op: WriteOp::Put(intent.encode()),
        };
        self.coordinator
            .write(write, fencing, Some(&caller.name), FrontDoor::S3)
            .await
            .map(drop)
            .map_err(s3_error_of)
    }

    /// Makes an uploaded object visible: in one fenced transaction, deletes the
    /// upload's intent (which must still exist) and writes the key's mapping.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn commit(
        &self,
        caller: &Caller,
        resource: &ResourceName,
        upload: uuid::Uuid,
        intent: Intent,
        mapping_key: ObjectKey,
        fencing: &Fencing,
        (etag, size): (String, u64),
    ) -> S3Result<()> {
        let mapping = Mapping {
            physical: intent.physical,
            etag,
            size,
            content_type: intent.content_type,
            metadata: intent.metadata,
            written_at_ms: now_ms(),
            token: fencing.token.get(),
        };
        let txn = Txn::new(vec![
            TxnOp::Delete {
                resource: resource.clone(),
                key: layout::intent_key(upload),
                token: fencing.token,
                precondition: Precondition::MustExist,
            },
            TxnOp::Put {
                resource: resource.clone(),
                key: mapping_key,
                token: fencing.token,
                value: mapping.encode(),
                precondition: Precondition::None,
            },
        ])
        .map_err(|e| S3Error::with_message(S3ErrorCode::InternalError, e.to_string()))?;
        let answered = self
            .coordinator
            .txn(
                Arc::new(txn),
                None,
                fencing.holder.as_deref(),
                Some(&caller.name),
                FrontDoor::S3,
            )
            .await
            .map_err(s3_error_of)?;
        match answered {
            Answered::Ran {
                outcome: TxnOutcome::Applied(_),
                ..
            } => Ok(()),
            Answered::Ran {
                outcome: TxnOutcome::Stale(members),
                ..
            } => {
                let member = members.into_iter().next().ok_or_else(|| {
                    S3Error::with_message(S3ErrorCode::InternalError, "a stale outcome without a member")
                })?;
                Err(s3_error_of(ApiError::Stale {
                    resource: member.resource,
                    presented: member.presented,
                    highest: member.highest,
                }))
            }
            Answered::Ran {
                outcome: TxnOutcome::PreconditionFailed { .. },
                ..
            } => Err(S3Error::with_message(
                S3ErrorCode::InternalError,
                "the upload outlived its intent (collected as abandoned); nothing was made visible, retry",
            )),
            _ => Err(S3Error::with_message(
                S3ErrorCode::InternalError,
                "an unexpected answer to the mapping's commit",
            )),
        }
    }

    /// The mapping `key` names, if any.
    async fn mapping(&self, resource: &ResourceName, key: &ObjectKey) -> S3Result<Option<Mapping>> {
        let found = self
            .coordinator
            .get(resource, key, |_| Ok(()))
            .await
            .map_err(s3_error_of)?;
        let Some((object, ())) = found else {
            return Ok(None);
        };
        Mapping::decode(&object.value, resource)
            .map(Some)
            .map_err(|e| S3Error::with_message(S3ErrorCode::InternalError, e))
    }
}

/// The headers of an upload's physical object: its content type and user metadata.
pub(super) fn object_headers(intent: &Intent) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(content_type) = &intent.content_type {
        if let Ok(value) = HeaderValue::from_str(content_type) {
            headers.insert(http::header::CONTENT_TYPE, value);
        }
    }
    for (name, value) in &intent.metadata {
        let name = HeaderName::from_bytes(format!("x-amz-meta-{name}").as_bytes());
        let value = HeaderValue::from_str(value);
        if let (Ok(name), Ok(value)) = (name, value) {
            headers.insert(name, value);
        }
    }
    headers
}

/// The writer's token: `x-amz-meta-fencing-token` or the `Fencing-Token` header; both
/// present and different is refused.
pub(super) fn token_of(
    headers: &HeaderMap,
    metadata: Option<&s3s::dto::Metadata>,
) -> S3Result<Fencing> {
    let from_metadata = metadata
        .and_then(|metadata| metadata.get(TOKEN_METADATA))
        .map(|value| Token::parse(value.as_bytes()));
    let from_header = match Fencing::from_headers(headers) {
        Ok(fencing) => Some(Ok(fencing)),
        Err(fencegate_proto::ProtoError::MissingToken) => None,
        Err(error) => Some(Err(error)),
    };
    let invalid = |e: &dyn std::fmt::Display| {
        S3Error::with_message(S3ErrorCode::InvalidArgument, format!("fencing token: {e}"))
    };
    match (from_metadata, from_header) {
        (None, None) => Err(S3Error::with_message(
            S3ErrorCode::Custom("MissingFencingToken".into()),
            "a write through the S3 door needs a fencing token: send it as the object \
             metadata fencing-token (x-amz-meta-fencing-token) or the Fencing-Token header",
        )
        .with_status(StatusCode::BAD_REQUEST)),
        (Some(Err(e)), _) => Err(invalid(&e)),
        (_, Some(Err(e))) => Err(invalid(&e)),
        (Some(Ok(token)), None) => Ok(Fencing {
            token,
            holder: None,
        }),
        (None, Some(Ok(fencing))) => Ok(fencing),
        (Some(Ok(token)), Some(Ok(fencing))) if token == fencing.token => Ok(fencing),
        (Some(Ok(token)), Some(Ok(fencing))) => Err(invalid(&format!(
            "the metadata says {token} and the Fencing-Token header {}",
            fencing.token
        ))),
    }
}

trait WithStatus {
    fn with_status(self, status: StatusCode) -> Self;
}

impl WithStatus for S3Error {
    fn with_status(mut self, status: StatusCode) -> S3Error {
        self.set_status_code(status);
        self
    }
}

/// The S3 error answering `error`, with the stale token's own code and header.
pub(super) fn s3_error_of(error: ApiError) -> S3Error {
    let message = error.to_string();
    match &error {
        ApiError::Stale { highest, .. } => {
            let mut s3 =
                S3Error::with_message(S3ErrorCode::Custom("StaleFencingToken".into()), message)
                    .with_status(StatusCode::CONFLICT);
            let mut headers = HeaderMap::new();
            headers.insert(
                HeaderName::from_static("fencing-highest"),
                HeaderValue::from(highest.get()),
            );
            s3.set_headers(headers);
            s3
        }
        ApiError::Forbidden { .. } | ApiError::Unauthenticated => {
            S3Error::with_message(S3ErrorCode::AccessDenied, message)
        }
        ApiError::Proto(_) => S3Error::with_message(S3ErrorCode::InvalidArgument, message),
        ApiError::Overloaded(_)
        | ApiError::ShuttingDown
        | ApiError::NotSynchronouslyReplicated
        | ApiError::IssuerUnavailable { .. }
        | ApiError::Store(crate::store::StoreError::Unavailable { .. }) => {
            S3Error::with_message(S3ErrorCode::SlowDown, message)
                .with_status(StatusCode::SERVICE_UNAVAILABLE)
        }
        ApiError::Store(crate::store::StoreError::Internal(_)) => {
            S3Error::with_message(S3ErrorCode::InternalError, message)
        }
        _ => {
            let code = error.code();
            let status =
                StatusCode::from_u16(code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let name = pascal_case(code.as_str());
            S3Error::with_message(S3ErrorCode::Custom(name.into()), message).with_status(status)
        }
    }
}

/// `token_not_issued` → `TokenNotIssued`: the gateway's error codes in S3's style.
fn pascal_case(code: &str) -> String {
    code.split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect()
}

pub(super) fn upstream_failed(error: &UpstreamError) -> S3Error {
    tracing::warn!(%error, "S3 upstream request failed");
    S3Error::with_message(
        S3ErrorCode::ServiceUnavailable,
        format!("the upstream object store failed ({error}); nothing was made visible, retry"),
    )
    .with_status(StatusCode::SERVICE_UNAVAILABLE)
}

/// Reads a PUT body into memory, refusing one above `limit`, and claims the memory it
/// takes from the gateway's body budget (`--max-body-memory`, the client's share).
pub(super) async fn read_body(
    body: Option<StreamingBlob>,
    limit: usize,
    memory: &mut BodyMemory,
) -> S3Result<Bytes> {
    use futures_util::StreamExt;
    let Some(mut body) = body else {
        return Ok(Bytes::new());
    };
    let mut read = BytesMut::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| {
            S3Error::with_message(
                S3ErrorCode::IncompleteBody,
                format!("the body could not be read: {e}"),
            )
        })?;
        if read.len() + chunk.len() > limit {
            return Err(S3Error::with_message(
                S3ErrorCode::EntityTooLarge,
                format!(
                    "a single PUT through the door takes at most {limit} bytes \
                     (--s3-max-object); larger objects go as multipart uploads"
                ),
            ));
        }
        memory
            .grow_to(read.len() + chunk.len())
            .map_err(|overload| {
                S3Error::with_message(
                    S3ErrorCode::SlowDown,
                    ApiError::Overloaded(overload).to_string(),
                )
                .with_status(StatusCode::SERVICE_UNAVAILABLE)
            })?;
        read.extend_from_slice(&chunk);
    }
    Ok(read.freeze())
}

pub(super) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

pub(super) fn timestamp(ms: i64) -> Timestamp {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0).unsigned_abs());
    Timestamp::from(at)
}

/// The ETag as S3's DTO has it (the value without quotes).
pub(super) fn etag(text: &str) -> s3s::dto::ETag {
    s3s::dto::ETag::Strong(text.trim_matches('"').to_owned())
}

#[async_trait::async_trait]
impl S3 for S3Door {
    async fn put_object(
        &self,
        req: S3Request<PutObjectInput>,
    ) -> S3Result<S3Response<PutObjectOutput>> {
        let caller = self.caller(&req)?;
        let input = req.input;
        let (resource, mapping_key) =
            self.authorise(&caller, Action::Write, &input.bucket, &input.key)?;
        let fencing = token_of(&req.headers, input.metadata.as_ref())?;
        let _permit = self
            .admit(&caller, &resource, &mapping_key, &fencing)
            .await?;
        let client = self.coordinator.client(Some(&caller.name), caller.peer);
        let mut memory = self.coordinator.body_memory(client);
        let body = read_body(input.body, self.max_object, &mut memory).await?;

        let upload = uuid::Uuid::new_v4();
        let intent = Intent {
            physical: layout::physical_key(&resource, fencing.token, upload),
            bucket: input.bucket.clone(),
            key: input.key.clone(),
            token: fencing.token.get(),
            upload_id: None,
            content_type: input.content_type,
            metadata: input.metadata.unwrap_or_default().into_iter().collect(),
            created_at_ms: now_ms(),
        };
        self.record_intent(&caller, &resource, upload, &intent, &fencing)
            .await?;
        let size = body.len() as u64;
        let headers = object_headers(&intent);
        let stored = match self
            .upstream
            .put_new(&intent.bucket, &intent.physical, &headers, body)
            .await
        {
            Ok(Conditional::Stored(stored)) => stored,
            Ok(Conditional::Refused) => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InternalError,
                    "the upstream already held this upload's fresh key; nothing was made visible, retry",
                ))
            }
            Err(error) => return Err(upstream_failed(&error)),
        };
        let etag_text = stored.etag.clone();
        self.commit(
            &caller,
            &resource,
            upload,
            intent,
            mapping_key,
            &fencing,
            (stored.etag, size),
        )
        .await?;
        let output = PutObjectOutput {
            e_tag: Some(etag(&etag_text)),
            ..Default::default()
        };
        Ok(S3Response::new(output))
    }

    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        Ok(S3Response::new(self.create_multipart(req).await?))
    }

    async fn upload_part(
        &self,
        req: S3Request<UploadPartInput>,
    ) -> S3Result<S3Response<UploadPartOutput>> {
        Ok(S3Response::new(self.upload_part_of(req).await?))
    }

    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        Ok(S3Response::new(self.complete_multipart(req).await?))
    }

    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        Ok(S3Response::new(self.abort_multipart(req).await?))
    }

    async fn get_object(
        &self,
        req: S3Request<GetObjectInput>,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        let caller = self.caller(&req)?;
        let (bucket, key) = (&req.input.bucket, &req.input.key);
        let (resource, mapping_key) = self.authorise(&caller, Action::Read, bucket, key)?;
        let Some(mapping) = self.mapping(&resource, &mapping_key).await? else {
            return Err(s3_error!(NoSuchKey));
        };
        let range = req
            .headers
            .get(http::header::RANGE)
            .and_then(|value| value.to_str().ok());
        let response = self
            .upstream
            .get(bucket, &mapping.physical, range)
            .await
            .map_err(|error| upstream_failed(&error))?;
        let status = response.status();
        let header = |name: http::header::HeaderName| {
            response
                .headers()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)
        };
        let content_length = header(http::header::CONTENT_LENGTH).and_then(|v| v.parse().ok());
        let content_range = header(http::header::CONTENT_RANGE);
        let body = StreamingBlob::from(s3s::Body::from(response.into_body()));
        let output = GetObjectOutput {
            body: Some(body),
            content_length,
            content_range,
            content_type: mapping.content_type.clone(),
            e_tag: Some(etag(&mapping.etag)),
            last_modified: Some(timestamp(mapping.written_at_ms)),
            metadata: Some(mapping.metadata.into_iter().collect()),
            accept_ranges: Some("bytes".to_owned()),
            ..Default::default()
        };
        let mut answer = S3Response::new(output);
        if status == StatusCode::PARTIAL_CONTENT {
            answer.status = Some(status);
        }
        Ok(answer)
    }

    async fn head_object(
        &self,
        req: S3Request<HeadObjectInput>,
    ) -> S3Result<S3Response<HeadObjectOutput>> {
        let caller = self.caller(&req)?;
        let (bucket, key) = (&req.input.bucket, &req.input.key);
        let (resource, mapping_key) = self.authorise(&caller, Action::Read, bucket, key)?;
        let Some(mapping) = self.mapping(&resource, &mapping_key).await? else {
            return Err(s3_error!(NoSuchKey));
        };
        let output = HeadObjectOutput {
            content_length: Some(mapping.size as i64),
            content_type: mapping.content_type.clone(),
            e_tag: Some(etag(&mapping.etag)),
            last_modified: Some(timestamp(mapping.written_at_ms)),
            metadata: Some(mapping.metadata.into_iter().collect()),
            accept_ranges: Some("bytes".to_owned()),
            ..Default::default()
        };
        Ok(S3Response::new(output))
    }

    async fn delete_objects(
        &self,
        req: S3Request<DeleteObjectsInput>,
    ) -> S3Result<S3Response<DeleteObjectsOutput>> {
        Ok(S3Response::new(self.delete_batch(req).await?))
    }

    async fn list_objects_v2(
        &self,
        req: S3Request<ListObjectsV2Input>,
    ) -> S3Result<S3Response<ListObjectsV2Output>> {
        Ok(S3Response::new(self.list_v2(req).await?))
    }

    async fn delete_object(
        &self,
        req: S3Request<DeleteObjectInput>,
    ) -> S3Result<S3Response<DeleteObjectOutput>> {
        let caller = self.caller(&req)?;
        let (bucket, key) = (&req.input.bucket, &req.input.key);
        let (resource, mapping_key) = self.authorise(&caller, Action::Write, bucket, key)?;
        let fencing = token_of(&req.headers, None)?;
        let _permit = self
            .admit(&caller, &resource, &mapping_key, &fencing)
            .await?;
        let write = Write {
            resource,
            key: mapping_key,
            token: fencing.token,
            precondition: Precondition::None,
            op: WriteOp::Delete,
        };
        self.coordinator
            .write(write, &fencing, Some(&caller.name), FrontDoor::S3)
            .await
            .map_err(s3_error_of)?;
        Ok(S3Response::with_status(
            DeleteObjectOutput::default(),
            StatusCode::NO_CONTENT,
        ))
    }
}
