//! Multipart uploads, which SDKs switch to on their own above a few MiB.
//!
//! CreateMultipartUpload presents the token, which is fixed for the upload's life: the
//! door starts the upload upstream on a fresh physical key, then records the intent,
//! which is also the upload's record — the upload id the client gets is the intent's
//! uuid. UploadPart checks the upload's token against the fence cache (a stale upload
//! stops early) and forwards the part. CompleteMultipartUpload completes the upload
//! upstream, then commits the mapping as a PUT does: the object becomes visible only
//! at that commit, so a term that lost the fence while its parts were uploading gets
//! `409 StaleFencingToken` at Complete.

use fencegate_proto::headers::{Fencing, Precondition};
use fencegate_proto::Token;
use s3s::dto::{
    AbortMultipartUploadInput, AbortMultipartUploadOutput, CompleteMultipartUploadInput,
    CompleteMultipartUploadOutput, CreateMultipartUploadInput, CreateMultipartUploadOutput,
    UploadPartInput, UploadPartOutput,
};
use s3s::{S3Error, S3ErrorCode, S3Request, S3Result};

use super::layout::{self, Intent};
use super::service::{Caller, Pending, S3Door};
use super::wire::{etag, now_ms, object_headers, s3_error_of, token_of, upstream_failed};
use crate::auth::Action;
use crate::coordinator::FrontDoor;
use crate::store::{Write, WriteOp};

impl S3Door {
    pub(super) async fn create_multipart(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<CreateMultipartUploadOutput> {
        let caller = self.caller(&req)?;
        let input = req.input;
        let (resource, mapping_key) =
            self.authorise(&caller, Action::Write, &input.bucket, &input.key)?;
        let fencing = token_of(&req.headers, input.metadata.as_ref())?;
        let _permit = self
            .admit(&caller, &resource, &mapping_key, &fencing)
            .await?;
        let upload = uuid::Uuid::new_v4();
        let mut intent = Intent {
            physical: layout::physical_key(&resource, fencing.token, upload),
            bucket: input.bucket.clone(),
            key: input.key.clone(),
            token: fencing.token.get(),
            upload_id: None,
            content_type: input.content_type,
            metadata: input.metadata.unwrap_or_default().into_iter().collect(),
            created_at_ms: now_ms(),
        };
        // Nothing of an upload is an object until it is completed, and completing
        // needs the intent: so the upload may start first.
        let upload_id = self
            .upstream
            .create_multipart(&intent.bucket, &intent.physical, &object_headers(&intent))
            .await
            .map_err(|error| upstream_failed(&error))?;
        intent.upload_id = Some(upload_id.clone());
        if let Err(error) = self
            .record_intent(&caller, &resource, upload, &intent, &fencing)
            .await
        {
            let _ = self
                .upstream
                .abort_multipart(&intent.bucket, &intent.physical, &upload_id)
                .await;
            return Err(error);
        }
        Ok(CreateMultipartUploadOutput {
            bucket: Some(input.bucket),
            key: Some(input.key),
            upload_id: Some(upload.to_string()),
            ..Default::default()
        })
    }

    pub(super) async fn upload_part_of(
        &self,
        req: S3Request<UploadPartInput>,
    ) -> S3Result<UploadPartOutput> {
        let caller = self.caller(&req)?;
        let input = req.input;
        let (found, _permit) = self
            .admitted_upload(&caller, &input.bucket, &input.key, &input.upload_id)
            .await?;
        if !(1..=10_000).contains(&input.part_number) {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidArgument,
                "part numbers go from 1 to 10000",
            ));
        }
        let (body, _memory) = self.read_body(&caller, input.body).await?;
        let upload_id = found.intent.upload_id.as_deref().unwrap_or_default();
        let part_etag = self
            .upstream
            .upload_part(
                &found.intent.bucket,
                &found.intent.physical,
                upload_id,
                input.part_number,
                body,
            )
            .await
            .map_err(|error| upstream_failed(&error))?;
        Ok(UploadPartOutput {
            e_tag: Some(etag(&part_etag)),
            ..Default::default()
        })
    }

    pub(super) async fn complete_multipart(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<CompleteMultipartUploadOutput> {
        let caller = self.caller(&req)?;
        let input = req.input;
        let (found, _permit) = self
            .admitted_upload(&caller, &input.bucket, &input.key, &input.upload_id)
            .await?;
        let parts: Vec<(i32, String)> = input
            .multipart_upload
            .and_then(|upload| upload.parts)
            .unwrap_or_default()
            .into_iter()
            .map(|part| {
                let number = part.part_number.unwrap_or(0);
                let tag = part
                    .e_tag
                    .map(|tag| format!("\"{}\"", tag.value()))
                    .unwrap_or_default();
                (number, tag)
            })
            .collect();
        if parts.is_empty() {
            return Err(S3Error::with_message(
                S3ErrorCode::MalformedXML,
                "CompleteMultipartUpload lists no part",
            ));
        }
        let (bucket, physical) = (&found.intent.bucket, &found.intent.physical);
        let upload_id = found.intent.upload_id.as_deref().unwrap_or_default();
        self.upstream
            .complete_multipart(bucket, physical, upload_id, &parts)
            .await
            .map_err(|error| upstream_failed(&error))?;
        // radosgw answers Complete with an empty ETag: the object's own comes from a
        // HEAD.
        let (object_etag, size) = self
            .upstream
            .head(bucket, physical)
            .await
            .map_err(|error| upstream_failed(&error))?
            .ok_or_else(|| {
                S3Error::with_message(
                    S3ErrorCode::InternalError,
                    "the completed upload is not in the bucket; nothing was made visible",
                )
            })?;
        let etag_text = object_etag.clone();
        self.commit(&caller, found, (object_etag, size)).await?;
        Ok(CompleteMultipartUploadOutput {
            bucket: Some(input.bucket),
            key: Some(input.key),
            e_tag: Some(etag(&etag_text)),
            ..Default::default()
        })
    }

    pub(super) async fn abort_multipart(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<AbortMultipartUploadOutput> {
        let caller = self.caller(&req)?;
        let input = req.input;
        let found = self
            .upload(&caller, &input.bucket, &input.key, &input.upload_id)
            .await?;
        let upload_id = found.intent.upload_id.as_deref().unwrap_or_default();
        self.upstream
            .abort_multipart(&found.intent.bucket, &found.intent.physical, upload_id)
            .await
            .map_err(|error| upstream_failed(&error))?;
        // The intent goes with the upload; one a newer term's fence keeps (the delete
        // is a write of the upload's token) is left for the collector.
        let write = Write {
            resource: found.resource,
            key: layout::intent_key(found.upload),
            token: found.fencing.token,
            precondition: Precondition::MustExist,
            op: WriteOp::Delete,
        };
        let _ = self
            .coordinator
            .write(write, &found.fencing, Some(&caller.name), FrontDoor::S3)
            .await;
        Ok(AbortMultipartUploadOutput::default())
    }

    /// The upload `upload_id` of `key`, let in by the checks of every write with its
    /// token ([`S3Door::admit`]: a stale upload stops here); the permit is held until
    /// the request is done with.
    async fn admitted_upload(
        &self,
        caller: &Caller,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> S3Result<(Pending, crate::coordinator::WritePermit)> {
        let found = self.upload(caller, bucket, key, upload_id).await?;
        let permit = self
            .admit(caller, &found.resource, &found.mapping_key, &found.fencing)
            .await?;
        Ok((found, permit))
    }

    /// The upload `upload_id` of `key`, if the caller may write it.
    async fn upload(
        &self,
        caller: &Caller,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> S3Result<Pending> {
        let (resource, mapping_key) = self.authorise(caller, Action::Write, bucket, key)?;
        let no_such = || {
            S3Error::with_message(
                S3ErrorCode::NoSuchUpload,
                "no upload of this key has this id (completed, aborted, or never started)",
            )
        };
        let upload = uuid::Uuid::parse_str(upload_id).map_err(|_| no_such())?;
        let stored = self
            .coordinator
            .get(&resource, &layout::intent_key(upload), |_| Ok(()))
            .await
            .map_err(s3_error_of)?;
        let Some((object, ())) = stored else {
            return Err(no_such());
        };
        let intent = Intent::decode(&object.value, &resource)
            .map_err(|e| S3Error::with_message(S3ErrorCode::InternalError, e))?;
        if intent.bucket != bucket || intent.key != key || intent.upload_id.is_none() {
            return Err(no_such());
        }
        let token = Token::new(intent.token)
            .map_err(|e| S3Error::with_message(S3ErrorCode::InternalError, e.to_string()))?;
        Ok(Pending {
            resource,
            mapping_key,
            upload,
            intent,
            fencing: Fencing {
                token,
                holder: None,
            },
        })
    }
}
