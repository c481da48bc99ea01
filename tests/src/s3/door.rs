//! A gateway with its S3 door in front of a real radosgw, on a database of its own:
//! the fixture of the door's tests.
//!
//! Between the door and radosgw runs a [`Proxy`], so that a test can hold an upstream
//! request "in the network" past a term change.

use std::path::{Path, PathBuf};

use crate::db::TestDb;
use crate::gateway::{Gateway, GatewayBuilder};
use crate::proxy::Proxy;
use crate::s3::{Radosgw, S3Client};

/// The bucket the door serves.
pub const BUCKET: &str = "data";

/// The keys the door knows: (access key id, secret, identity).
pub const WRITER: (&str, &str, &str) = ("FGWRITER", "writer-secret-0123456789abcdef", "writer");
pub const READER: (&str, &str, &str) = ("FGREADER", "reader-secret-0123456789abcdef", "reader");

/// A radosgw, a proxy in front of it, a database and a gateway whose S3 door uses them.
pub struct DoorBed {
    pub rgw: Radosgw,
    pub proxy: Proxy,
    pub db: TestDb,
    pub gateway: Gateway,
    files: DoorFiles,
}

/// The files a door's gateway reads: its keys, the auth file, the upstream's
/// credentials; removed when dropped.
pub struct DoorFiles {
    dir: PathBuf,
}

impl DoorFiles {
    /// Files for an upstream that takes `access_key` and `secret_key`.
    pub fn new(access_key: &str, secret_key: &str) -> DoorFiles {
        let dir = std::env::temp_dir().join(format!(
            "fencegate-s3door-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        write_files(&dir, access_key, secret_key);
        DoorFiles { dir }
    }

    /// A gateway on `db` whose S3 door serves [`BUCKET`] from `upstream`:
    /// `data/orders/*` is the resource `orders`, which the writer may read and write
    /// and the reader only read.
    pub fn builder(&self, db: &TestDb, upstream: &str) -> GatewayBuilder {
        let path = |name: &str| self.dir.join(name).display().to_string();
        Gateway::builder().database(&db.url()).args(&[
            "--auth-file",
            &path("auth.toml"),
            "--s3-listen",
            "127.0.0.1:0",
            "--s3-upstream",
            upstream,
            "--s3-keys-file",
            &path("s3-keys.toml"),
            "--s3-upstream-credentials-file",
            &path("upstream.toml"),
            "--s3-bucket",
            BUCKET,
            "--s3-resource",
            "data/orders/*=orders",
        ])
    }
}

impl Drop for DoorFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl DoorBed {
    /// Starts everything; `data/orders/*` is the resource `orders`, and the writer may
    /// read and write it, the reader only read.
    pub async fn start() -> DoorBed {
        DoorBed::start_with(&[]).await
    }

    /// [`DoorBed::start`], with more flags for the gateway.
    pub async fn start_with(extra: &[&str]) -> DoorBed {
        let rgw = Radosgw::start().await;
        rgw.client().create_bucket(BUCKET).await;
        let upstream: std::net::SocketAddr = rgw
            .endpoint()
            .trim_start_matches("http://")
            .parse()
            .expect("radosgw listens on an address");
        let proxy = Proxy::start(upstream).await;
        let db = TestDb::create().await;
        let files = DoorFiles::new(rgw.access_key(), rgw.secret_key());
        let gateway = files
            .builder(&db, &format!("http://{}", proxy.addr()))
            .args(extra)
            .spawn()
            .await;
        DoorBed {
            rgw,
            proxy,
            db,
            gateway,
            files,
        }
    }

    /// Another gateway on the same database and upstream (a replica), through the
    /// proxy.
    pub fn replica(&self) -> GatewayBuilder {
        self.files
            .builder(&self.db, &format!("http://{}", self.proxy.addr()))
    }

    /// Another gateway on the same database, straight to radosgw (not through the
    /// proxy, so a hold does not stop it).
    pub fn direct_replica(&self) -> GatewayBuilder {
        self.files.builder(&self.db, &self.rgw.endpoint())
    }

    /// A client of the door signing with `key` (one of [`WRITER`], [`READER`]).
    pub fn client(&self, key: (&str, &str, &str)) -> S3Client {
        S3Client::new(format!("http://{}", self.gateway.s3_addr()), key.0, key.1)
    }

    /// The highest token of the resource `orders`, read over the HTTP API (0 before
    /// its first write).
    pub async fn highest(&self) -> u64 {
        let reply = crate::http::Client::new(self.gateway.url())
            .request(
                http::Method::GET,
                "/v1/fences/orders",
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
        reply.json()["highest"].as_u64().unwrap_or(0)
    }

    /// Advances `orders` to `term` over the gateway's HTTP API; panics unless it is
    /// applied.
    pub async fn advance(&self, term: u64) {
        let reply = crate::http::Client::new(self.gateway.url())
            .request(
                http::Method::POST,
                &crate::http::advance_path("orders"),
                &[
                    ("fencing-token", &term.to_string()),
                    ("authorization", &format!("Bearer {HTTP_KEY}")),
                ],
                "",
            )
            .await;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
    }

    /// The physical objects the bucket holds under the door's root, read from radosgw
    /// directly.
    pub async fn physical_keys(&self) -> Vec<String> {
        let reply = self
            .rgw
            .client()
            .list(BUCKET, &[("prefix", ".fencegate/orders/")])
            .await;
        assert_eq!(reply.status, 200, "{}", crate::s3::client::text(&reply));
        crate::s3::client::xml_values(&crate::s3::client::text(&reply), "Key")
    }
}

fn write_files(dir: &Path, access_key: &str, secret_key: &str) {
    let write = |name: &str, text: String| {
        std::fs::write(dir.join(name), text).expect("the scratch directory is writable");
    };
    let mut keys = String::new();
    for (id, secret, identity) in [WRITER, READER] {
        keys.push_str(&format!(
            "[[key]]\naccess_key_id = \"{id}\"\nsecret = \"{secret}\"\nidentity = \"{identity}\"\n\n"
        ));
    }
    write("s3-keys.toml", keys);
    write(
        "auth.toml",
        format!(
            "[[identity]]\nname = \"writer\"\nkeys = [\"{}\"]\n\
             grants = [{{ resources = [\"orders\"], actions = [\"read\", \"write\", \"advance\", \"lease\"] }}, \
             {{ resources = [], actions = [\"metrics\"] }}]\n\n\
             [[identity]]\nname = \"reader\"\n\
             grants = [{{ resources = [\"orders\"], actions = [\"read\"] }}]\n",
            fencegate_gateway::auth::stored_hash(HTTP_KEY)
        ),
    );
    write(
        "upstream.toml",
        format!("access_key_id = \"{access_key}\"\nsecret_access_key = \"{secret_key}\"\n"),
    );
}

/// The writer's bearer key on the HTTP API (to advance fences there).
pub const HTTP_KEY: &str = "fgk_s3-door-writer-http-key";
