//! DeleteObjects: one fenced transaction per resource the batch touches, in resource
//! name order (the order every write group takes fence locks, so two batches cannot
//! deadlock). Each key gets its own `<Deleted>` or `<Error>`; a resource whose token is
//! stale, or that the caller may not write, fails only its own keys.

use std::collections::BTreeMap;
use std::sync::Arc;

use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName};
use s3s::dto::{DeleteObjectsInput, DeleteObjectsOutput, DeletedObject, Error as KeyError};
use s3s::{S3Error, S3ErrorCode, S3Request, S3Result};

use super::layout;
use super::service::S3Door;
use super::wire::{s3_error_of, stale_error, token_of};
use crate::auth::Action;
use crate::coordinator::FrontDoor;
use crate::store::txn::{Answered, Txn, TxnOp, TxnOutcome};

/// Most keys one DeleteObjects may name, as S3.
const MAX_KEYS: usize = 1000;

impl S3Door {
    pub(super) async fn delete_batch(
        &self,
        req: S3Request<DeleteObjectsInput>,
    ) -> S3Result<DeleteObjectsOutput> {
        let caller = self.caller(&req)?;
        let fencing = token_of(&req.headers, None)?;
        let input = req.input;
        let bucket = input.bucket.as_str();
        self.served(bucket)?;
        if input.delete.objects.len() > MAX_KEYS {
            return Err(S3Error::with_message(
                S3ErrorCode::MalformedXML,
                "DeleteObjects names at most 1000 keys",
            ));
        }
        let quiet = input.delete.quiet.unwrap_or(false);
        let mut by_resource: BTreeMap<ResourceName, BTreeMap<String, ObjectKey>> = BTreeMap::new();
        let mut errors = Vec::new();
        for object in input.delete.objects {
            let key = object.key;
            let resolved = self
                .resources
                .resolve(bucket, &key)
                .and_then(|resource| Ok((resource, layout::mapping_key(bucket, &key)?)));
            match resolved {
                Ok((resource, mapping_key)) => {
                    by_resource
                        .entry(resource)
                        .or_default()
                        .insert(key, mapping_key);
                }
                Err(message) => errors.push(key_error(key, "InvalidArgument", message)),
            }
        }
        let mut deleted = Vec::new();
        for (resource, keys) in by_resource {
            match self.delete_in(&caller, &resource, &keys, &fencing).await {
                Ok(()) => deleted.extend(keys.into_keys().map(|key| DeletedObject {
                    key: Some(key),
                    ..Default::default()
                })),
                Err(error) => {
                    let code = error.code().as_str().to_owned();
                    let message = error.message().unwrap_or_default().to_owned();
                    errors.extend(
                        keys.into_keys()
                            .map(|key| key_error(key, &code, message.clone())),
                    );
                }
            }
        }
        Ok(DeleteObjectsOutput {
            deleted: (!quiet && !deleted.is_empty()).then_some(deleted),
            errors: (!errors.is_empty()).then_some(errors),
            ..Default::default()
        })
    }

    /// Deletes `keys` of `resource` in one fenced transaction.
    async fn delete_in(
        &self,
        caller: &super::service::Caller,
        resource: &ResourceName,
        keys: &BTreeMap<String, ObjectKey>,
        fencing: &fencegate_proto::headers::Fencing,
    ) -> S3Result<()> {
        self.may(caller, Action::Write, resource)?;
        let first = keys
            .values()
            .next()
            .expect("a resource of the batch has keys");
        let _permit = self.admit(caller, resource, first, fencing).await?;
        let ops = keys
            .values()
            .map(|key| TxnOp::Delete {
                resource: resource.clone(),
                key: key.clone(),
                token: fencing.token,
                precondition: Precondition::None,
            })
            .collect();
        let txn = Txn::new(ops)
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
            _ => Err(S3Error::with_message(
                S3ErrorCode::InternalError,
                "an unexpected answer to the deletion's transaction",
            )),
        }
    }
}

fn key_error(key: String, code: &str, message: String) -> KeyError {
    KeyError {
        code: Some(code.to_owned()),
        key: Some(key),
        message: Some(message),
        ..Default::default()
    }
}
