//! The groups of `serve`'s flags, each the options of the part of the gateway it
//! configures. Their fields keep the order of `--help`, and each flag its heading.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use super::values::{parse_door_grant, parse_listen, parse_size};
// The defaults, the headings and the value types are the parent's.
use super::*;

/// The HTTP listener and its connections (`server`).
#[derive(Debug, Clone, Args)]
pub struct HttpArgs {
    /// HTTP listen address (HTTPS with --tls-cert).
    ///
    /// Address to listen on for HTTP/1.1 and cleartext HTTP/2 (h2c), or with --tls-cert
    /// for HTTPS only (HTTP/1.1 and HTTP/2 by ALPN). Use port 0 for any free port.
    #[arg(long, env = "FENCEGATE_LISTEN", default_value = DEFAULT_LISTEN, value_name = "ADDR", help_heading = heading::HTTP)]
    pub listen: SocketAddr,

    /// Threads that serve requests; 0 picks for the machine.
    ///
    /// Threads that serve requests. 1 runs the whole gateway on one thread, with no
    /// hand-offs between threads; more spread requests over that many threads. 0 (the
    /// default) picks for the machine: one thread on two CPU cores or fewer, else one
    /// per core.
    #[arg(long, env = "FENCEGATE_THREADS", default_value_t = DEFAULT_THREADS, value_name = "N", help_heading = heading::HTTP)]
    pub threads: usize,

    /// Longest time to receive a request's headers.
    ///
    /// Longest time a client may take to send a request's headers, from their first
    /// byte; slower clients are disconnected.
    #[arg(long, env = "FENCEGATE_HEADER_TIMEOUT", default_value = DEFAULT_HEADER_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::HTTP)]
    pub header_timeout: Duration,

    /// How long a connection with no request in flight stays open.
    ///
    /// How long a connection may stay open with no request in flight (HTTP/1.1 between
    /// requests, HTTP/2 with no stream open) before it is closed.
    #[arg(long, env = "FENCEGATE_IDLE_TIMEOUT", default_value = DEFAULT_IDLE_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::HTTP)]
    pub idle_timeout: Duration,

    /// Longest time a client may take to send a request body.
    ///
    /// Longest time a client may take to send a request body; past it the request gets
    /// 408 body_timeout and the connection is closed.
    #[arg(long, env = "FENCEGATE_BODY_TIMEOUT", default_value = DEFAULT_BODY_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::HTTP)]
    pub body_timeout: Duration,

    /// Longest wait for the first bytes of a request body.
    ///
    /// Longest time from the moment a handler asks for a request body (after its head
    /// and fencing checks) until its first bytes arrive; past it, 408 body_timeout. A
    /// client that declares a body and sends nothing holds its write slot no longer.
    #[arg(long, env = "FENCEGATE_BODY_FIRST_BYTE_TIMEOUT", default_value = DEFAULT_BODY_FIRST_BYTE_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::HTTP)]
    pub body_first_byte_timeout: Duration,

    /// Longest wait for a client to read what it is sent.
    ///
    /// Longest time a write to a client's connection may wait for the client to read
    /// (HTTP/1.1 and HTTP/2 alike), and that the large answers of an HTTP/2 connection
    /// may wait for their streams' windows to open; past it the connection is closed
    /// and the memory of its answers given back.
    #[arg(long, env = "FENCEGATE_WRITE_TIMEOUT", default_value = DEFAULT_WRITE_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::HTTP)]
    pub write_timeout: Duration,

    /// HTTP/2: how often a quiet connection is pinged.
    ///
    /// HTTP/2: how often an otherwise quiet connection is pinged, to find dead peers.
    #[arg(long, env = "FENCEGATE_HTTP2_KEEPALIVE_INTERVAL", default_value = DEFAULT_HTTP2_KEEPALIVE_INTERVAL, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::HTTP)]
    pub http2_keepalive_interval: Duration,

    /// HTTP/2: how long to wait for the answer to a ping.
    ///
    /// HTTP/2: how long to wait for the answer to a ping before closing the connection.
    #[arg(long, env = "FENCEGATE_HTTP2_KEEPALIVE_TIMEOUT", default_value = DEFAULT_HTTP2_KEEPALIVE_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::HTTP)]
    pub http2_keepalive_timeout: Duration,

    /// Most client connections open at once.
    ///
    /// Most client connections open at once. At the cap the longest idle one is closed
    /// to make room, or new clients wait to be accepted. Kept below the open-file limit,
    /// which is raised to its maximum at start.
    #[arg(long, env = "FENCEGATE_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS, value_name = "N", help_heading = heading::HTTP)]
    pub max_connections: usize,

    /// Largest request head (request line and headers).
    ///
    /// Largest request head (request line and headers), in bytes or with a KiB suffix.
    #[arg(long, env = "FENCEGATE_MAX_HEADER_SIZE", default_value = DEFAULT_MAX_HEADER_SIZE, value_parser = parse_size, value_name = "SIZE", help_heading = heading::HTTP)]
    pub max_header_size: usize,

    /// Time given to in-flight requests on SIGTERM/SIGINT.
    ///
    /// On SIGTERM/SIGINT, how long in-flight requests may take to finish before the
    /// remaining connections are closed.
    #[arg(long, env = "FENCEGATE_SHUTDOWN_TIMEOUT", default_value = DEFAULT_SHUTDOWN_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::HTTP)]
    pub shutdown_timeout: Duration,
}

/// The store: Postgres or embedded, its pools and its write path (`store`), and the fence cache in front of it.
#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    /// Postgres connection string; without it, the embedded store.
    ///
    /// Postgres connection string, e.g. postgres://postgres@127.0.0.1:5432/app. The gateway
    /// creates its tables in schema `fencegate` of that database. Without it, the gateway
    /// keeps its fences in an embedded store under --data-dir.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL", help_heading = heading::STORE)]
    pub database_url: Option<String>,

    /// Directory of the embedded store.
    ///
    /// Directory of the embedded store (used when no --database-url is given); the file
    /// `fencegate.redb` is created there on first start.
    #[arg(long, env = "FENCEGATE_DATA_DIR", default_value = DEFAULT_DATA_DIR, value_name = "DIR", help_heading = heading::STORE)]
    pub data_dir: std::path::PathBuf,

    /// Embedded store: start a new, empty store where the directory says one was kept.
    ///
    /// Embedded store: start a new, empty store deliberately in a --data-dir whose
    /// store file is missing or empty (zero bytes) although the directory's
    /// `fencegate.store-id` says a store was kept there — which the gateway otherwise
    /// refuses, because the fences of that store would be lost. Refuses to start if
    /// `fencegate.redb` exists and is not empty, so it never erases a store: move such
    /// a file away first. Use it for one start, then drop it: once the new store
    /// exists, a start with it refuses.
    #[arg(long, env = "FENCEGATE_INIT_STORE", help_heading = heading::STORE)]
    pub init_store: bool,

    /// Largest number of Postgres connections the gateway opens.
    #[arg(long, env = "FENCEGATE_POOL_SIZE", default_value_t = DEFAULT_POOL_SIZE, value_name = "N", help_heading = heading::STORE)]
    pub pool_size: usize,

    /// Longest wait for the database, per request.
    ///
    /// Longest wait for the database, per request: for a pooled connection, and for the
    /// statements of one write. Past it the request gets 503 backend_unavailable.
    #[arg(long, env = "FENCEGATE_BACKEND_TIMEOUT", default_value = DEFAULT_BACKEND_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::STORE)]
    pub backend_timeout: Duration,

    /// Most resources whose highest token is kept in memory.
    ///
    /// Most resources whose highest token is kept in memory to reject stale writes without a
    /// database round trip. Evicting one only loses that shortcut, never correctness.
    #[arg(long, env = "FENCEGATE_CACHE_SIZE", default_value_t = DEFAULT_CACHE_SIZE, value_name = "N", help_heading = heading::STORE)]
    pub cache_size: usize,

    /// Test-only: never reject a write from the fence cache, so that every stale write
    /// reaches the store's own check (the cache still learns, for the failover audit).
    #[arg(long, hide = true)]
    pub no_cache_rejections: bool,

    /// Most concurrent writes committed together in one transaction.
    ///
    /// Most concurrent writes committed together in one transaction (group commit): one
    /// durable commit for many writes, each still checked against its own fence. 1
    /// commits every write on its own. On Postgres, keyed and conditional writes and
    /// transactions ride the groups too.
    #[arg(long, env = "FENCEGATE_GROUP_COMMIT_MAX", default_value_t = DEFAULT_GROUP_COMMIT_MAX, value_name = "N", help_heading = heading::STORE)]
    pub group_commit_max: usize,

    /// Postgres: write transactions in flight at once.
    ///
    /// Postgres: write transactions in flight at once, each on a connection of its own
    /// (besides --pool-size). A write that finds one free goes at once; writes that
    /// arrive while all are busy are committed together by the next free one.
    #[arg(long, env = "FENCEGATE_WRITE_LANES", default_value_t = DEFAULT_WRITE_LANES, value_name = "N", help_heading = heading::STORE)]
    pub write_lanes: usize,

    /// Postgres: a write lane's longest wait for a fence lock.
    ///
    /// Postgres: how long a write lane waits for a resource's fence lock (held by a SQL
    /// transaction, a conditional write, a writer of fenced tables). Past it, that
    /// resource's writes leave the lanes and wait on their own, so that one locked
    /// resource does not hold up the others.
    #[arg(long, env = "FENCEGATE_WRITE_LOCK_TIMEOUT", default_value = DEFAULT_WRITE_LOCK_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::STORE)]
    pub write_lock_timeout: Duration,
}

/// The bounds of the process: bodies, writes and answers in memory or in flight.
#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Largest accepted request body.
    ///
    /// Largest accepted request body: bytes, or with a KiB/MiB/GiB suffix. Larger bodies get 413.
    #[arg(long, env = "FENCEGATE_MAX_BODY", default_value = DEFAULT_MAX_BODY, value_parser = parse_size, value_name = "SIZE", help_heading = heading::LIMITS)]
    pub max_body: usize,

    /// Most writes being processed at once.
    ///
    /// Most writes (PUT, DELETE, advance, SQL) being processed at once; more get
    /// 503 overloaded with Retry-After at once.
    #[arg(long, env = "FENCEGATE_MAX_WRITES_IN_FLIGHT", default_value_t = DEFAULT_MAX_WRITES_IN_FLIGHT, value_name = "N", help_heading = heading::LIMITS)]
    pub max_writes_in_flight: usize,

    /// Most request-body bytes held in memory at once.
    ///
    /// Most request-body bytes held in memory at once, over all requests; more get 503
    /// overloaded with Retry-After at once. A body of up to 16 KiB counts its
    /// Content-Length from the start; a larger one from its first bytes (its
    /// Content-Length, or what has arrived if it has none).
    #[arg(long, env = "FENCEGATE_MAX_BODY_MEMORY", default_value = DEFAULT_MAX_BODY_MEMORY, value_parser = parse_size, value_name = "SIZE", help_heading = heading::LIMITS)]
    pub max_body_memory: usize,

    /// Share of the two limits above that one client may hold.
    ///
    /// The share (percent) of --max-writes-in-flight and --max-body-memory that one
    /// client may hold: one identity when authentication is on, else one peer address.
    /// Past it that client's writes get 503 overloaded (writes_share, body_share) while
    /// other clients' go on. Behind a proxy that hides client addresses without
    /// authentication, every client is one peer: raise it to 100.
    #[arg(long, env = "FENCEGATE_MAX_CLIENT_SHARE", default_value_t = DEFAULT_MAX_CLIENT_SHARE, value_parser = clap::value_parser!(u8).range(1..=100), value_name = "PERCENT", help_heading = heading::LIMITS)]
    pub max_client_share: u8,

    /// Most bytes of large answers held in memory at once.
    ///
    /// Most bytes of large answers (over 16 KiB: objects read, /v1/sql answers) held in
    /// memory until their clients read them, over all connections; past it such a
    /// request gets 503 overloaded (response_memory).
    #[arg(long, env = "FENCEGATE_MAX_RESPONSE_MEMORY", default_value = DEFAULT_MAX_RESPONSE_MEMORY, value_parser = parse_size, value_name = "SIZE", help_heading = heading::LIMITS)]
    pub max_response_memory: usize,

    /// Most large answers one connection may have unsent.
    ///
    /// Most large answers (over 16 KiB) one connection may have unsent at once — with
    /// HTTP/2, streams whose client has not read their data; past it, 503 overloaded
    /// (pending_answers).
    #[arg(long, env = "FENCEGATE_MAX_PENDING_ANSWERS", default_value_t = DEFAULT_MAX_PENDING_ANSWERS, value_name = "N", help_heading = heading::LIMITS)]
    pub max_pending_answers: usize,

    /// Most operations in one POST /v1/txn.
    ///
    /// Most operations in one POST /v1/txn; past it, 400 too_many_operations.
    #[arg(long, env = "FENCEGATE_TXN_MAX_OPERATIONS", default_value_t = DEFAULT_TXN_MAX_OPERATIONS, value_name = "N", help_heading = heading::LIMITS)]
    pub txn_max_operations: usize,

    /// Largest POST /v1/txn body.
    ///
    /// Largest POST /v1/txn body (its JSON, values included); past it, 413
    /// body_too_large. Also bounded by --max-body.
    #[arg(long, env = "FENCEGATE_TXN_MAX_BYTES", default_value = DEFAULT_TXN_MAX_BYTES, value_parser = parse_size, value_name = "SIZE", help_heading = heading::LIMITS)]
    pub txn_max_bytes: usize,
}

/// Who may do what (`auth`).
#[derive(Debug, Clone, Args)]
pub struct AuthArgs {
    /// Identities, their keys and grants (TOML); turns authentication on.
    ///
    /// Identities, their keys and grants (TOML; see docs/auth.md): every request but
    /// /healthz must then carry `Authorization: Bearer <key>` of an identity with a
    /// grant for it — or come over a connection whose client certificate (verified by
    /// --tls-client-ca) bears a name the identity lists. Reloaded when the file
    /// changes. `fencegate key new` makes a key.
    #[arg(long, env = "FENCEGATE_AUTH_FILE", value_name = "FILE", help_heading = heading::AUTH)]
    pub auth_file: Option<std::path::PathBuf>,

    /// Hash of an administrator's key, for fence resets without --auth-file.
    ///
    /// A file holding the hash of an administrator's key (`fencegate key new` prints
    /// both), for fence resets (POST /v1/fences/{resource}/reset) on a gateway without
    /// --auth-file: the request then carries `Authorization: Bearer <key>`. Without
    /// either, resets are refused.
    #[arg(long, env = "FENCEGATE_ADMIN_KEY_FILE", conflicts_with = "auth_file", value_name = "FILE", help_heading = heading::AUTH)]
    pub admin_key_file: Option<std::path::PathBuf>,

    /// Serve a non-loopback --listen address without --auth-file.
    ///
    /// Serve HTTP on a non-loopback --listen address without --auth-file: anyone who
    /// can reach the gateway may then write, advance and read any resource.
    #[arg(long, env = "FENCEGATE_INSECURE_NO_AUTH", help_heading = heading::AUTH)]
    pub insecure_no_auth: bool,
}

/// TLS of the HTTP listener (`tls`).
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// PEM certificate chain for HTTPS on --listen (with --tls-key).
    ///
    /// PEM certificate chain (the server's certificate first) for TLS on --listen, with
    /// --tls-key: the listener then speaks TLS only, HTTP/1.1 and HTTP/2 by ALPN.
    /// Checked every second and reloaded when it changes, without a restart; a pair
    /// that does not load is logged and the one in force stays.
    #[arg(long, env = "FENCEGATE_TLS_CERT", requires = "tls_key", value_name = "FILE", help_heading = heading::TLS)]
    pub tls_cert: Option<std::path::PathBuf>,

    /// PEM private key of --tls-cert.
    ///
    /// PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1); reloaded with it.
    #[arg(long, env = "FENCEGATE_TLS_KEY", requires = "tls_cert", value_name = "FILE", help_heading = heading::TLS)]
    pub tls_key: Option<std::path::PathBuf>,

    /// PEM CA certificates that sign client certificates.
    ///
    /// PEM CA certificates that sign client certificates (needs --tls-cert). Clients
    /// may then present a certificate: one this CA signed is verified, and its DNS
    /// names authenticate the identity of --auth-file that lists them under
    /// `certificates`; any other fails the handshake. Clients without one still
    /// connect, and need a bearer key. Reloaded when it changes.
    #[arg(long, env = "FENCEGATE_TLS_CLIENT_CA", requires = "tls_cert", value_name = "FILE", help_heading = heading::TLS)]
    pub tls_client_ca: Option<std::path::PathBuf>,
}

/// Keyed writes: how long their answers are kept, and their bounds.
#[derive(Debug, Clone, Args)]
pub struct IdempotencyArgs {
    /// How long a keyed write's answer is kept.
    ///
    /// How long the answer of a write sent with an Idempotency-Key is kept: a retry
    /// with the same key within this time gets the stored answer and applies nothing;
    /// after it, the key is free again. Expired answers are removed in the background.
    #[arg(long, env = "FENCEGATE_IDEMPOTENCY_TTL", default_value = DEFAULT_IDEMPOTENCY_TTL, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::IDEMPOTENCY)]
    pub idempotency_ttl: Duration,

    /// Most answers stored per identity.
    ///
    /// Most answers one identity (all clients together without --auth-file) may have
    /// stored under its keys; past it, its keyed writes with new keys get 429
    /// idempotency_quota_exceeded until answers expire (retries of stored keys are
    /// answered as ever). Checked against a count every gateway updates about once a
    /// second, so it may be passed by a second's writes.
    #[arg(long, env = "FENCEGATE_IDEMPOTENCY_IDENTITY_MAX_RECORDS", default_value_t = DEFAULT_IDEMPOTENCY_IDENTITY_MAX_RECORDS, value_name = "N", help_heading = heading::IDEMPOTENCY)]
    pub idempotency_identity_max_records: u64,

    /// Most bytes stored per identity.
    ///
    /// Most bytes (KiB, MiB, GiB) of stored answers one identity may have, as
    /// --idempotency-identity-max-records counts records.
    #[arg(long, env = "FENCEGATE_IDEMPOTENCY_IDENTITY_MAX_BYTES", default_value = DEFAULT_IDEMPOTENCY_IDENTITY_MAX_BYTES, value_parser = parse_size, value_name = "SIZE", help_heading = heading::IDEMPOTENCY)]
    pub idempotency_identity_max_bytes: usize,

    /// Most bytes stored for all identities.
    ///
    /// Most bytes of stored answers over all identities; past it, every keyed write
    /// with a new key gets 429 idempotency_quota_exceeded until answers expire.
    #[arg(long, env = "FENCEGATE_IDEMPOTENCY_MAX_BYTES", default_value = DEFAULT_IDEMPOTENCY_MAX_BYTES, value_parser = parse_size, value_name = "SIZE", help_heading = heading::IDEMPOTENCY)]
    pub idempotency_max_bytes: usize,

    /// Largest /v1/sql answer stored for retries.
    ///
    /// Largest answer of a keyed POST /v1/sql that is stored for its retries: its rows
    /// are cut there as --sql-max-response cuts them (`truncated_by: "bytes"`). Other
    /// keyed answers are small by construction (a /v1/txn's by --txn-max-operations).
    #[arg(long, env = "FENCEGATE_IDEMPOTENCY_MAX_ANSWER", default_value = DEFAULT_IDEMPOTENCY_MAX_ANSWER, value_parser = parse_size, value_name = "SIZE", help_heading = heading::IDEMPOTENCY)]
    pub idempotency_max_answer: usize,
}

/// The S3 door (`s3door`).
#[derive(Debug, Clone, Args)]
pub struct S3Args {
    /// Address of the S3 door; `off` (the default) for none.
    ///
    /// Address of the S3 door, where writers connect with their own S3 SDK
    /// (docs/s3.md); `off` for none. Needs --s3-upstream, --s3-keys-file and
    /// --s3-bucket. Port 0 picks a free port.
    #[arg(long, env = "FENCEGATE_S3_LISTEN", default_value = "off", value_parser = parse_listen, value_name = "ADDR", help_heading = heading::S3_DOOR)]
    pub s3_listen: Listen,

    /// PEM certificate chain of the S3 door's TLS (with --s3-tls-key).
    ///
    /// PEM certificate chain of the S3 door's TLS (with --s3-tls-key): the door then
    /// speaks HTTPS only. Reloaded when the files change.
    #[arg(long, env = "FENCEGATE_S3_TLS_CERT", requires = "s3_tls_key", value_name = "FILE", help_heading = heading::S3_DOOR)]
    pub s3_tls_cert: Option<std::path::PathBuf>,

    /// PEM private key of the S3 door's TLS certificate.
    #[arg(long, env = "FENCEGATE_S3_TLS_KEY", requires = "s3_tls_cert", value_name = "FILE", help_heading = heading::S3_DOOR)]
    pub s3_tls_key: Option<std::path::PathBuf>,

    /// Run the S3 door on a non-loopback address without TLS.
    ///
    /// Run the S3 door on a non-loopback --s3-listen address without --s3-tls-cert:
    /// SigV4 signs the headers, but object bytes then cross the network in cleartext,
    /// and an unsigned-payload body could be altered on the way.
    #[arg(long, env = "FENCEGATE_S3_INSECURE_CLEARTEXT", help_heading = heading::S3_DOOR)]
    pub s3_insecure_cleartext: bool,

    /// The S3-compatible server behind the door (http://host:port).
    ///
    /// The S3-compatible server the door keeps objects in, as `http://host:port`
    /// (path-style requests). The door signs every request to it with its own
    /// credentials (--s3-upstream-credentials-file, or AWS_ACCESS_KEY_ID and
    /// AWS_SECRET_ACCESS_KEY); a client's signature is never forwarded.
    #[arg(long, env = "FENCEGATE_S3_UPSTREAM", value_name = "URL", help_heading = heading::S3_DOOR)]
    pub s3_upstream: Option<String>,

    /// TOML file of the upstream's access key id and secret.
    ///
    /// TOML file with `access_key_id` and `secret_access_key`: the credentials the
    /// door signs upstream requests with. Without it, AWS_ACCESS_KEY_ID and
    /// AWS_SECRET_ACCESS_KEY are read from the environment.
    #[arg(long, env = "FENCEGATE_S3_UPSTREAM_CREDENTIALS_FILE", value_name = "FILE", help_heading = heading::S3_DOOR)]
    pub s3_upstream_credentials_file: Option<std::path::PathBuf>,

    /// TOML file of the door's access keys: id → secret and identity.
    ///
    /// TOML file of the access keys clients sign with (`[[key]]` entries with
    /// `access_key_id`, `secret` and `identity`). Every request's SigV4 signature is
    /// checked against it; a bad or missing one is refused before anything reaches
    /// the upstream. With --auth-file, each key's identity must be listed there and
    /// its grants apply; without, every key may read and write.
    #[arg(long, env = "FENCEGATE_S3_KEYS_FILE", value_name = "FILE", help_heading = heading::S3_DOOR)]
    pub s3_keys_file: Option<std::path::PathBuf>,

    /// A bucket the door serves (repeatable).
    ///
    /// A bucket of the upstream the door serves; repeat the flag for more. Requests
    /// for other buckets are refused. At start the door checks, in each, that the
    /// upstream honours conditional writes (see --s3-skip-conformance-check).
    #[arg(long = "s3-bucket", env = "FENCEGATE_S3_BUCKET", value_delimiter = ',', value_name = "BUCKET", help_heading = heading::S3_DOOR)]
    pub s3_buckets: Vec<String>,

    /// Map a bucket prefix to a resource: `BUCKET/PREFIX*=RESOURCE` (repeatable).
    ///
    /// The keys of BUCKET under PREFIX belong to RESOURCE (`data/orders/*=orders`);
    /// the longest matching prefix wins. Keys no rule covers belong to the resource
    /// named like their bucket.
    #[arg(long = "s3-resource", env = "FENCEGATE_S3_RESOURCE", value_delimiter = ',', value_parser = crate::s3door::layout::parse_resource_rule, value_name = "RULE", help_heading = heading::S3_DOOR)]
    pub s3_resources: Vec<crate::s3door::layout::ResourceRule>,

    /// The region the door signs for and takes signatures of.
    #[arg(long, env = "FENCEGATE_S3_REGION", default_value = DEFAULT_S3_REGION, value_name = "REGION", help_heading = heading::S3_DOOR)]
    pub s3_region: String,

    /// Largest single PUT body (bytes, KiB, MiB, GiB).
    ///
    /// Largest body of a single PutObject (bytes, KiB, MiB, GiB); larger ones are
    /// refused with EntityTooLarge. The door holds a body in memory while it uploads
    /// it, within the gateway's body memory (--max-body-memory).
    #[arg(long, env = "FENCEGATE_S3_MAX_OBJECT", default_value = DEFAULT_S3_MAX_OBJECT, value_parser = parse_size, value_name = "SIZE", help_heading = heading::S3_DOOR)]
    pub s3_max_object: usize,

    /// Longest an upstream request may take.
    #[arg(long, env = "FENCEGATE_S3_UPSTREAM_TIMEOUT", default_value = DEFAULT_S3_UPSTREAM_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::S3_DOOR)]
    pub s3_upstream_timeout: Duration,

    /// How often the collector sweeps unreferenced uploads.
    ///
    /// How often each gateway's collector removes the physical objects no mapping
    /// names (refused uploads, overwritten and deleted objects) and the intents of
    /// abandoned uploads (docs/s3.md).
    #[arg(long, env = "FENCEGATE_S3_GC_INTERVAL", default_value = DEFAULT_S3_GC_INTERVAL, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::S3_DOOR)]
    pub s3_gc_interval: Duration,

    /// How long an unreferenced object stays before it is removed.
    ///
    /// How long a physical object no mapping names stays before the collector removes
    /// it: a reader that resolved a mapping just before an overwrite still finds its
    /// object within this time.
    #[arg(long, env = "FENCEGATE_S3_GC_GRACE", default_value = DEFAULT_S3_GC_GRACE, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::S3_DOOR)]
    pub s3_gc_grace: Duration,

    /// Longest an upload may take from its start to its commit.
    ///
    /// Longest an upload (a PUT, or a multipart upload from Create to Complete) may
    /// take; the collector then removes its intent, and its commit fails with nothing
    /// made visible.
    #[arg(long, env = "FENCEGATE_S3_UPLOAD_MAX_AGE", default_value = DEFAULT_S3_UPLOAD_MAX_AGE, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::S3_DOOR)]
    pub s3_upload_max_age: Duration,

    /// Skip the start-up check of the upstream's conditional writes.
    ///
    /// Start without racing concurrent If-None-Match PUTs in each bucket. The check
    /// refuses to start on an upstream that lets two of them win, because the
    /// door's write-once objects rest on it.
    #[arg(long, env = "FENCEGATE_S3_SKIP_CONFORMANCE_CHECK", help_heading = heading::S3_DOOR)]
    pub s3_skip_conformance_check: bool,
}

/// The Postgres door (`pgdoor`).
#[derive(Debug, Clone, Args)]
pub struct DoorArgs {
    /// Address of the Postgres door; `off` for none.
    ///
    /// Address of the Postgres door, where writers connect with their own Postgres
    /// driver (docs/postgres-door.md); `off` for none. On with the Postgres backend
    /// (--database-url) only. Port 0 picks a free port.
    #[arg(long, env = "FENCEGATE_PG_LISTEN", default_value = DEFAULT_PG_LISTEN, value_parser = parse_listen, value_name = "ADDR", help_heading = heading::PG_DOOR)]
    pub pg_listen: Listen,

    /// PEM certificate chain of the door's TLS (with --pg-tls-key).
    ///
    /// PEM certificate chain of the Postgres door's TLS (with --pg-tls-key). Without
    /// it, the door answers `N` to SSLRequest. Reloaded when the files change.
    #[arg(long, env = "FENCEGATE_PG_TLS_CERT", requires = "pg_tls_key", value_name = "FILE", help_heading = heading::PG_DOOR)]
    pub pg_tls_cert: Option<std::path::PathBuf>,

    /// PEM private key of the Postgres door's TLS certificate.
    #[arg(long, env = "FENCEGATE_PG_TLS_KEY", requires = "pg_tls_cert", value_name = "FILE", help_heading = heading::PG_DOOR)]
    pub pg_tls_key: Option<std::path::PathBuf>,

    /// Refuse door clients without TLS.
    ///
    /// Refuse Postgres clients that do not use TLS (FATAL 28000, before any connection
    /// to the database), as a `hostssl` line of pg_hba.conf would: the database sees
    /// the door's TLS, not the client's. On by default with --pg-tls-cert;
    /// `--pg-require-tls=false` lets cleartext clients in beside TLS ones. Cancel
    /// requests are accepted either way.
    #[arg(long, env = "FENCEGATE_PG_REQUIRE_TLS", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "true|false", help_heading = heading::PG_DOOR)]
    pub pg_require_tls: Option<bool>,

    /// Run the door on a non-loopback address without TLS.
    ///
    /// Run the Postgres door on a non-loopback --pg-listen address without
    /// --pg-tls-cert: passwords and data then cross the network in cleartext.
    #[arg(long, env = "FENCEGATE_PG_INSECURE_CLEARTEXT", help_heading = heading::PG_DOOR)]
    pub pg_insecure_cleartext: bool,

    /// A database/role pair the door admits (repeatable).
    ///
    /// A `database/role` pair the Postgres door admits; repeat the flag for more, `*`
    /// for any database or any role (`orders/*`). Other logins are refused with FATAL
    /// 28000 before any connection to the database. Without it, every pair is admitted
    /// (and pg_hba.conf decides).
    #[arg(long = "pg-allow", env = "FENCEGATE_PG_ALLOW", value_delimiter = ',', value_name = "DATABASE/ROLE", value_parser = parse_door_grant, help_heading = heading::PG_DOOR)]
    pub pg_allow: Vec<DoorGrant>,

    /// Largest message a Postgres client may send.
    ///
    /// Largest protocol message a Postgres client may send (bytes, KiB, MiB, GiB);
    /// longer ones close the connection with a protocol error. Messages are streamed,
    /// never held in memory whole. The start-up packet is capped at 10000 bytes.
    #[arg(long, env = "FENCEGATE_PG_MAX_MESSAGE", default_value = DEFAULT_PG_MAX_MESSAGE, value_parser = parse_size, value_name = "SIZE", help_heading = heading::PG_DOOR)]
    pub pg_max_message: usize,

    /// Most Postgres door connections open at once.
    ///
    /// Most Postgres door connections open at once (each has its own connection to
    /// the database); further clients are refused with FATAL 53300. Checked at start
    /// against the server's max_connections, less its reserved slots and the
    /// gateway's own pools: a value given here that does not fit stops the start; the
    /// default (64) is lowered to what fits, with a warning.
    #[arg(
        long,
        env = "FENCEGATE_PG_MAX_CONNECTIONS",
        value_name = "N (default 64)",
        help_heading = heading::PG_DOOR
    )]
    pub pg_max_connections: Option<usize>,

    /// Most door connections still logging in at once.
    ///
    /// Most Postgres door connections still authenticating at once (from connecting to
    /// the end of the login); further clients are refused with FATAL 53300 at once,
    /// without a connection to the database.
    #[arg(long, env = "FENCEGATE_PG_MAX_PENDING_AUTH", default_value_t = DEFAULT_PG_MAX_PENDING_AUTH, value_name = "N", help_heading = heading::PG_DOOR)]
    pub pg_max_pending_auth: usize,

    /// As --pg-max-pending-auth, per client IP.
    ///
    /// As --pg-max-pending-auth, for the connections of one client IP address.
    #[arg(long, env = "FENCEGATE_PG_MAX_PENDING_AUTH_PER_PEER", default_value_t = DEFAULT_PG_MAX_PENDING_AUTH_PER_PEER, value_name = "N", help_heading = heading::PG_DOOR)]
    pub pg_max_pending_auth_per_peer: usize,

    /// End sessions idle in a transaction.
    ///
    /// `idle_in_transaction_session_timeout` of the Postgres door's sessions: a client
    /// that leaves a transaction open and idle this long is disconnected by the
    /// database, and its locks are freed. 0 leaves the server's setting.
    #[arg(long, env = "FENCEGATE_PG_IDLE_IN_TRANSACTION_TIMEOUT", default_value = DEFAULT_PG_IDLE_IN_TRANSACTION_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::PG_DOOR)]
    pub pg_idle_in_transaction_timeout: Duration,

    /// Longest time a Postgres client may take to log in.
    ///
    /// Longest time a Postgres client may take from connecting to the end of
    /// authentication, the password exchange included; then it is disconnected.
    #[arg(long, env = "FENCEGATE_PG_STARTUP_TIMEOUT", default_value = DEFAULT_PG_STARTUP_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::PG_DOOR)]
    pub pg_startup_timeout: Duration,
}

/// Fenced SQL transactions (`/v1/sql`, `sql`).
#[derive(Debug, Clone, Args)]
pub struct SqlArgs {
    /// Enable fenced SQL transactions (POST /v1/sql/{resource}).
    ///
    /// Enable fenced SQL transactions (`POST /v1/sql/{resource}`): writers' own
    /// statements run in the fence check's transaction. Postgres backend only; needs
    /// --sql-database-url.
    #[arg(long = "sql", env = "FENCEGATE_SQL", help_heading = heading::SQL)]
    pub enabled: bool,

    /// Postgres connection string of a writer-only login, for writers' SQL.
    ///
    /// Postgres connection string for writers' SQL: the login of a writer-only role,
    /// which may not be a superuser, create roles, own schema `fencegate` or write its
    /// tables, hold resources of its own (`fencegate grant`), nor be able to switch to a
    /// role that can. The gateway grants it the fence step of /v1/sql
    /// (`fencegate.sql_fence()`); grant it the writers' tables yourself. Same database
    /// as --database-url.
    #[arg(long, env = "FENCEGATE_SQL_DATABASE_URL", hide_env_values = true, value_name = "URL", help_heading = heading::SQL)]
    pub sql_database_url: Option<String>,

    /// Most connections of the --sql-database-url pool.
    #[arg(long, env = "FENCEGATE_SQL_POOL_SIZE", default_value_t = DEFAULT_SQL_POOL_SIZE, value_name = "N", help_heading = heading::SQL)]
    pub sql_pool_size: usize,

    /// Role every SQL transaction switches to.
    ///
    /// Role every SQL transaction switches to (`SET LOCAL ROLE`) before the writer's
    /// statements, to narrow the --sql-database-url login further. The login must be a
    /// member of it.
    #[arg(long, env = "FENCEGATE_SQL_ROLE", value_name = "ROLE", help_heading = heading::SQL)]
    pub sql_role: Option<String>,

    /// Also run DDL in SQL transactions.
    ///
    /// Also run DDL in SQL transactions: CREATE/ALTER/DROP of tables, views, indexes,
    /// sequences, types and schemas, TRUNCATE, COMMENT.
    #[arg(long, env = "FENCEGATE_SQL_ALLOW_DDL", help_heading = heading::SQL)]
    pub sql_allow_ddl: bool,

    /// Most statements in one SQL transaction.
    #[arg(long, env = "FENCEGATE_SQL_MAX_STATEMENTS", default_value_t = DEFAULT_SQL_MAX_STATEMENTS, value_name = "N", help_heading = heading::SQL)]
    pub sql_max_statements: usize,

    /// Longest time one SQL statement may run.
    ///
    /// `statement_timeout` of SQL transactions: the longest one statement may run. At most
    /// --backend-timeout, which bounds the whole transaction.
    #[arg(long, env = "FENCEGATE_SQL_STATEMENT_TIMEOUT", default_value = DEFAULT_SQL_STATEMENT_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::SQL)]
    pub sql_statement_timeout: Duration,

    /// Most rows returned by one SQL transaction.
    ///
    /// Most rows returned by one SQL transaction, over all its statements; further rows
    /// are counted but left out, and the answer says so (`truncated`).
    #[arg(long, env = "FENCEGATE_SQL_MAX_ROWS", default_value_t = DEFAULT_SQL_MAX_ROWS, value_name = "N", help_heading = heading::SQL)]
    pub sql_max_rows: usize,

    /// Most bytes of JSON the rows of one SQL answer take.
    ///
    /// Most bytes (KiB, MiB) of JSON the rows of one SQL answer take, over all its
    /// statements; further rows are counted but left out, and the answer says so
    /// (`truncated`, `truncated_by: "bytes"`). Each transaction claims this much of
    /// --max-response-memory before it runs, and gives back what its answer does not
    /// use.
    #[arg(long, env = "FENCEGATE_SQL_MAX_RESPONSE", default_value = DEFAULT_SQL_MAX_RESPONSE, value_parser = parse_size, value_name = "SIZE", help_heading = heading::SQL)]
    pub sql_max_response: usize,

    /// Longest SQL text of one statement.
    ///
    /// Longest SQL text of one statement (bytes, KiB, MiB); longer ones are refused
    /// before they are parsed.
    #[arg(long, env = "FENCEGATE_SQL_MAX_STATEMENT_SIZE", default_value = DEFAULT_SQL_MAX_STATEMENT_SIZE, value_parser = parse_size, value_name = "SIZE", help_heading = heading::SQL)]
    pub sql_max_statement_size: usize,
}

/// The fence database's replication, watched and required.
#[derive(Debug, Clone, Args)]
pub struct ReplicationArgs {
    /// Postgres: refuse writes without a synchronous standby.
    ///
    /// Postgres: refuse writes, fence raises and lease steps (503
    /// not_synchronously_replicated, nothing applied) while the fence database has no
    /// synchronous standby streaming — read every second from synchronous_commit,
    /// synchronous_standby_names and pg_stat_replication, whose standbys the gateway's
    /// login sees only as a member of pg_monitor (or pg_read_all_stats). Without this
    /// flag the gateway still reports it (metrics, ready line, a warning when it
    /// changes). See docs/failover.md.
    #[arg(long, env = "FENCEGATE_REQUIRE_SYNCHRONOUS_REPLICATION", help_heading = heading::REPLICATION)]
    pub require_synchronous_replication: bool,

    /// Patroni REST APIs of the fence database's cluster, comma-separated.
    ///
    /// Postgres under Patroni: the REST API of each Patroni node of the fence database's
    /// cluster, comma-separated (e.g. http://db-1:8008,http://db-2:8008,http://db-3:8008;
    /// one is enough, but is not read while that node is down). The gateway reads
    /// /config of the first that answers, every second, for synchronous_mode and
    /// synchronous_mode_strict, exported as fencegate_backend_patroni_synchronous_mode
    /// and said in the ready line.
    #[arg(
        long,
        env = "FENCEGATE_PATRONI_URL",
        value_name = "URL[,URL...]",
        value_delimiter = ',',
        help_heading = heading::REPLICATION
    )]
    pub patroni_url: Vec<String>,
}

/// Logs and metrics.
#[derive(Debug, Clone, Args)]
pub struct LoggingArgs {
    /// Log format: `json` for log pipelines.
    ///
    /// Log format: `text` for people, `json` for log pipelines.
    #[arg(long, env = "FENCEGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, value_name = "FORMAT", help_heading = heading::LOGGING)]
    pub log_format: LogFormat,

    /// Log filter, in tracing's EnvFilter syntax.
    ///
    /// Log filter, in tracing's EnvFilter syntax (e.g. `info`, `fencegate_gateway=debug`).
    #[arg(long, env = "FENCEGATE_LOG", default_value = "info", value_name = "FILTER", help_heading = heading::LOGGING)]
    pub log: String,

    /// Most "stale write rejected" log lines per second.
    ///
    /// Most "stale write rejected" log lines per second; 0 logs every rejection. Metrics
    /// count every rejection either way; the next line logged carries `unlogged`, the
    /// number of lines left out, and a summary line counts them once a second while a
    /// flood lasts.
    #[arg(long, env = "FENCEGATE_STALE_LOG_LIMIT", default_value_t = DEFAULT_STALE_LOG_LIMIT, value_name = "N", help_heading = heading::LOGGING)]
    pub stale_log_limit: u64,

    /// Most distinct values of the `resource` metric label.
    ///
    /// Most distinct values of the `resource` metric label. Once all are taken, a new
    /// resource takes the label of one unused for 10 minutes (whose series then go);
    /// otherwise it is counted under `resource="_other"`. So metrics cannot grow without
    /// bound, and junk resource names cannot take the labels of resources in use.
    #[arg(long, env = "FENCEGATE_METRICS_RESOURCE_CAP", default_value_t = DEFAULT_METRICS_RESOURCE_CAP, value_name = "N", help_heading = heading::LOGGING)]
    pub metrics_resource_cap: usize,
}
