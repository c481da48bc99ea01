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

use fencegate_proto::headers::{Fencing, Precondition};
use fencegate_proto::{ObjectKey, ResourceName};
use http::StatusCode;
use s3s::dto::{
    AbortMultipartUploadInput, AbortMultipartUploadOutput, CompleteMultipartUploadInput,
    CompleteMultipartUploadOutput, CreateMultipartUploadInput, CreateMultipartUploadOutput,
    DeleteObjectInput, DeleteObjectOutput, DeleteObjectsInput, DeleteObjectsOutput, GetObjectInput,
    GetObjectOutput, HeadObjectInput, HeadObjectOutput, ListObjectsV2Input, ListObjectsV2Output,
    PutObjectInput, PutObjectOutput, StreamingBlob, UploadPartInput, UploadPartOutput,
};
use s3s::{s3_error, S3Error, S3ErrorCode, S3Request, S3Response, S3Result, S3};

use super::keys::S3Keys;
use super::layout::{self, Intent, Mapping, Resources};
use super::upstream::{Conditional, Upstream};
use super::wire::{
    etag, now_ms, object_headers, read_body, s3_error_of, stale_error, timestamp, token_of,
    upstream_failed,
};
use crate::auth::{Action, Identity};
use crate::coordinator::{Coordinator, FencedRequest, FrontDoor, WritePermit};
use crate::store::txn::{Answered, Txn, TxnOp, TxnOutcome};
use crate::store::{Write, WriteOp};

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

/// An upload between its intent and its commit: where it goes, and with which token.
pub(super) struct Pending {
    pub(super) resource: ResourceName,
    /// The store key of the logical key's mapping.
    pub(super) mapping_key: ObjectKey,
    /// The intent's uuid (a multipart upload's id, to its client).
    pub(super) upload: uuid::Uuid,
    pub(super) intent: Intent,
    pub(super) fencing: Fencing,
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

    /// Makes an uploaded object (its ETag and size) visible: in one fenced
    /// transaction, deletes the upload's intent (which must still exist) and writes the
    /// key's mapping.
    pub(super) async fn commit(
        &self,
        caller: &Caller,
        pending: Pending,
        (etag, size): (String, u64),
    ) -> S3Result<()> {
        let Pending {
            resource,
            mapping_key,
            upload,
            intent,
            fencing,
        } = pending;
        let (resource, fencing) = (&resource, &fencing);
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
            } => Err(stale_error(members)),
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

    /// Reads a request's body, with the claim on the body budget it holds (the caller's
    /// share of `--max-body-memory`), released when the claim is dropped.
    pub(super) async fn read_body(
        &self,
        caller: &Caller,
        body: Option<StreamingBlob>,
    ) -> S3Result<(bytes::Bytes, crate::coordinator::BodyMemory)> {
        let client = self.coordinator.client(Some(&caller.name), caller.peer);
        let mut memory = self.coordinator.body_memory(client);
        let body = read_body(body, self.max_object, &mut memory).await?;
        Ok((body, memory))
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
        let (body, _memory) = self.read_body(&caller, input.body).await?;

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
        let pending = Pending {
            resource,
            mapping_key,
            upload,
            intent,
            fencing,
        };
        self.commit(&caller, pending, (stored.etag, size)).await?;
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
