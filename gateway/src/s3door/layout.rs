//! The mapped layout: which resource an S3 key belongs to, where its bytes live in the
//! bucket, and the mapping row that says so in the fence's store.
//!
//! A logical key `orders/2026-12.json` of bucket `data` is, in the store, the object
//! `s3/data/orders/2026-12.json` of its resource, whose value is a [`Mapping`] naming a
//! write-once physical key `.fencegate/<resource>/<token>/<uuid>` in the same bucket.
//! The mapping is written only by a fenced transaction, so what the door shows is what
//! the fence allowed ([docs/s3.md](../../../docs/s3.md)).

use std::collections::BTreeMap;

use fencegate_proto::{ObjectKey, ResourceName, Token};
use serde::{Deserialize, Serialize};

/// Where the physical objects of every resource live, under the bucket's root.
pub const PHYSICAL_ROOT: &str = ".fencegate/";

/// One `--s3-resource` rule: the keys of `bucket` under `prefix` belong to `resource`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceRule {
    pub bucket: String,
    pub prefix: String,
    pub resource: ResourceName,
}

/// Parses `bucket/prefix/*=name` (or `bucket/*=name`, the whole bucket).
pub fn parse_resource_rule(text: &str) -> Result<ResourceRule, String> {
    let usage = "expected BUCKET/PREFIX*=RESOURCE, such as data/orders/*=orders";
    let (pattern, name) = text.rsplit_once('=').ok_or(usage)?;
    let pattern = pattern.strip_suffix('*').ok_or(usage)?;
    let (bucket, prefix) = pattern.split_once('/').ok_or(usage)?;
    check_bucket(bucket)?;
    if prefix.starts_with(PHYSICAL_ROOT) {
        return Err(format!("keys under {PHYSICAL_ROOT} are the door's own"));
    }
    let resource = ResourceName::new(name).map_err(|e| format!("{name:?}: {e}"))?;
    Ok(ResourceRule {
        bucket: bucket.to_owned(),
        prefix: prefix.to_owned(),
        resource,
    })
}

/// Bucket names as S3 allows them: 3 to 63 of lowercase letters, digits, `.` and `-`.
pub fn check_bucket(bucket: &str) -> Result<(), String> {
    let fits = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    if fits {
        Ok(())
    } else {
        Err(format!(
            "{bucket:?} is not a bucket name (3 to 63 lowercase letters, digits, '.' and '-')"
        ))
    }
}

/// The resource of each key: the longest matching `--s3-resource` prefix, else the
/// bucket's own name.
#[derive(Debug, Clone, Default)]
pub struct Resources {
    rules: Vec<ResourceRule>,
}

impl Resources {
    /// The rules, refused if two share a bucket and prefix.
    pub fn new(rules: Vec<ResourceRule>) -> Result<Resources, String> {
        for (at, rule) in rules.iter().enumerate() {
            if let Some(other) = rules[..at]
                .iter()
                .find(|other| other.bucket == rule.bucket && other.prefix == rule.prefix)
            {
                return Err(format!(
                    "--s3-resource maps {}/{}* twice (to {} and to {})",
                    rule.bucket, rule.prefix, other.resource, rule.resource
                ));
            }
        }
        Ok(Resources { rules })
    }

    /// The resource `key` of `bucket` belongs to.
    pub fn resolve(&self, bucket: &str, key: &str) -> Result<ResourceName, String> {
        let longest = self
            .rules
            .iter()
            .filter(|rule| rule.bucket == bucket && key.starts_with(&rule.prefix))
            .max_by_key(|rule| rule.prefix.len());
        match longest {
            Some(rule) => Ok(rule.resource.clone()),
            None => ResourceName::new(bucket).map_err(|e| e.to_string()),
        }
    }
}

impl Resources {
    /// Every resource a key of `bucket` under `prefix` may belong to, in name order:
    /// each rule for keys under `prefix`, and the resource of `prefix` itself — the
    /// longest rule whose prefix `prefix` starts with, else the bucket's own.
    pub fn covering(&self, bucket: &str, prefix: &str) -> Result<Vec<ResourceName>, String> {
        let rules = self.rules.iter().filter(|rule| rule.bucket == bucket);
        let mut covering: Vec<ResourceName> = rules
            .clone()
            .filter(|rule| rule.prefix.starts_with(prefix) && rule.prefix != prefix)
            .map(|rule| rule.resource.clone())
            .collect();
        covering.push(self.resolve(bucket, prefix)?);
        covering.sort();
        covering.dedup();
        Ok(covering)
    }
}

/// The store-key prefix of every mapping of `bucket`.
pub fn mapping_root(bucket: &str) -> String {
    format!("s3/{bucket}/")
}

/// The store key of `key`'s mapping in `bucket`.
pub fn mapping_key(bucket: &str, key: &str) -> Result<ObjectKey, String> {
    if key.starts_with(PHYSICAL_ROOT) {
        return Err(format!("keys under {PHYSICAL_ROOT} are the door's own"));
    }
    ObjectKey::new(format!("s3/{bucket}/{key}")).map_err(|e| e.to_string())
}

/// The store key of an upload's intent.
pub fn intent_key(upload: uuid::Uuid) -> ObjectKey {
    ObjectKey::new(format!("s3-intent/{upload}")).expect("a uuid makes a valid key")
}

/// The fresh physical key of one upload.
pub fn physical_key(resource: &ResourceName, token: Token, upload: uuid::Uuid) -> String {
    format!("{PHYSICAL_ROOT}{resource}/{}/{upload}", token.get())
}

/// What a logical key names: one write-once physical object and what to answer about
/// it. Kept as the store object's value (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mapping {
    pub physical: String,
    /// The physical object's ETag, quotes included.
    pub etag: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    /// User metadata (`x-amz-meta-*`, names without the prefix), as stored upstream.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// When the mapping was committed, in milliseconds since the epoch.
    pub written_at_ms: i64,
    pub token: u64,
}

impl Mapping {
    /// Decodes a store value, refusing one whose physical key is not of `resource`: a
    /// writer of another path into the store (the HTTP API, with a valid token) cannot
    /// make the door serve another resource's objects.
    pub fn decode(value: &[u8], resource: &ResourceName) -> Result<Mapping, String> {
        let mapping: Mapping = serde_json::from_slice(value)
            .map_err(|_| "the stored value is not an S3 mapping".to_owned())?;
        let own = format!("{PHYSICAL_ROOT}{resource}/");
        if !mapping.physical.starts_with(&own) || mapping.physical.contains("/../") {
            return Err(format!(
                "the stored mapping names {:?}, outside {own}",
                mapping.physical
            ));
        }
        Ok(mapping)
    }

    pub fn encode(&self) -> bytes::Bytes {
        serde_json::to_vec(self)
            .expect("a mapping serializes")
            .into()
    }
}

/// An upload under way: written (as a fenced write with the upload's token) before
/// its object can land, deleted by the commit that maps it. A multipart upload's
/// intent is also its record: the upload id a client gets is the intent's uuid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Intent {
    pub physical: String,
    pub bucket: String,
    pub key: String,
    pub token: u64,
    /// The upstream's id of a multipart upload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    pub created_at_ms: i64,
}

impl Intent {
    /// Decodes a store value, refusing one whose physical key is not of `resource`.
    pub fn decode(value: &[u8], resource: &ResourceName) -> Result<Intent, String> {
        let intent: Intent = serde_json::from_slice(value)
            .map_err(|_| "the stored value is not an S3 upload's intent".to_owned())?;
        let own = format!("{PHYSICAL_ROOT}{resource}/");
        if !intent.physical.starts_with(&own) || intent.physical.contains("/../") {
            return Err(format!(
                "the stored intent names {:?}, outside {own}",
                intent.physical
            ));
        }
        Ok(intent)
    }

    pub fn encode(&self) -> bytes::Bytes {
        serde_json::to_vec(self)
            .expect("an intent serializes")
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(text: &str) -> ResourceRule {
        parse_resource_rule(text).unwrap()
    }

    #[test]
    fn the_longest_prefix_wins_and_the_bucket_is_the_default() {
        let resources = Resources::new(vec![
            rule("data/orders/*=orders"),
            rule("data/orders/eu/*=orders-eu"),
        ])
        .unwrap();
        let of = |bucket, key| resources.resolve(bucket, key).unwrap().to_string();
        assert_eq!(of("data", "orders/2026-12.json"), "orders");
        assert_eq!(of("data", "orders/eu/1.json"), "orders-eu");
        assert_eq!(of("data", "invoices/1.json"), "data");
        assert_eq!(of("other", "orders/1.json"), "other");
    }

    #[test]
    fn a_listing_covers_the_resources_its_prefix_may_reach() {
        let resources = Resources::new(vec![
            rule("data/orders/*=orders"),
            rule("data/orders/eu/*=orders-eu"),
        ])
        .unwrap();
        let names = |prefix| {
            let covering = resources.covering("data", prefix).unwrap();
            covering.iter().map(ToString::to_string).collect::<Vec<_>>()
        };
        assert_eq!(names(""), ["data", "orders", "orders-eu"]);
        assert_eq!(names("orders/"), ["orders", "orders-eu"]);
        assert_eq!(names("orders/eu/2026"), ["orders-eu"]);
        assert_eq!(names("ord"), ["data", "orders", "orders-eu"]);
        assert_eq!(names("invoices/"), ["data"]);
    }

    #[test]
    fn bad_rules_are_refused() {
        for text in [
            "data/orders=orders",
            "data/orders/*",
            "Data/orders/*=orders",
            "data/orders/*=no spaces",
            "data/.fencegate/*=x",
        ] {
            assert!(parse_resource_rule(text).is_err(), "{text}");
        }
        let twice = Resources::new(vec![rule("data/a/*=x"), rule("data/a/*=y")]);
        assert!(twice.unwrap_err().contains("twice"));
    }

    #[test]
    fn a_mapping_outside_its_resource_is_refused() {
        let resource = ResourceName::new("orders").unwrap();
        let mut mapping = Mapping {
            physical: physical_key(&resource, Token::new(41).unwrap(), uuid::Uuid::nil()),
            etag: "\"e\"".into(),
            size: 1,
            content_type: None,
            metadata: BTreeMap::new(),
            written_at_ms: 0,
            token: 41,
        };
        assert_eq!(
            Mapping::decode(&mapping.encode(), &resource).unwrap(),
            mapping
        );
        mapping.physical = ".fencegate/payroll/41/x".into();
        assert!(Mapping::decode(&mapping.encode(), &resource).is_err());
        mapping.physical = ".fencegate/orders/../payroll/41/x".into();
        assert!(Mapping::decode(&mapping.encode(), &resource).is_err());
        assert!(Mapping::decode(b"plain bytes", &resource).is_err());
    }

    #[test]
    fn the_door_own_keys_are_not_logical_keys() {
        assert!(mapping_key("data", ".fencegate/orders/41/x").is_err());
        assert!(mapping_key("data", "orders/1.json").is_ok());
    }
}
