//! Every SQL text the Postgres backend runs, and the schema migrations.
//!
//! The write path is kept to SQL that Postgres-compatible distributed engines also
//! accept: no functions, no triggers, no advisory locks. Migration 2 adds the
//! in-database fence for writers' own tables ([`crate::dbfence`]), which needs PL/pgSQL.
//!
//! # Locking rule
//!
//! Every write first upserts the resource's row in `fencegate.fences`
//! (`INSERT .. ON CONFLICT DO UPDATE`), which locks that row — also when the `WHERE`
//! of the update is false — until the transaction ends. Only then does it touch
//! `fencegate.objects`. So all writes to one resource are serialised on the fence row,
//! a writer that waited for the lock sees the newer token (ON CONFLICT works on the
//! latest committed row version, even under READ COMMITTED), and the object row is
//! only ever modified by the holder of its resource's fence lock.

/// Schema migrations, in order. Each runs once, in the migration transaction.
pub const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        "CREATE TABLE fencegate.fences (
         resource   text PRIMARY KEY,
         highest    bigint NOT NULL CHECK (highest > 0),
         updated_at timestamptz NOT NULL DEFAULT now()
     );
     CREATE TABLE fencegate.objects (
         resource   text NOT NULL,
         key        text NOT NULL,
         -- NULL marks a deleted object. The row stays as a tombstone so that versions
         -- keep rising across delete and re-create, and If-Match cannot be fooled.
         value      bytea,
         token      bigint NOT NULL,
         version    bigint NOT NULL,
         -- The version at which the current incarnation was created (answers 201 vs 200).
         born       bigint NOT NULL,
         updated_at timestamptz NOT NULL DEFAULT now(),
         PRIMARY KEY (resource, key)
     );",
    ),
    (2, crate::dbfence::SCHEMA_SQL),
];

/// Creates the schema and the migrations table, serialised between gateways that
/// start together by a transaction-scoped advisory lock (start-up only).
pub const PREPARE_MIGRATIONS: &str = "
    SET LOCAL client_min_messages = warning;
    SELECT pg_advisory_xact_lock(7317411105063129665);
    CREATE SCHEMA IF NOT EXISTS fencegate;
    CREATE TABLE IF NOT EXISTS fencegate.schema_migrations (
        version    integer PRIMARY KEY,
        applied_at timestamptz NOT NULL DEFAULT now()
    );";

pub const SCHEMA_VERSION: &str =
    "SELECT coalesce(max(version), 0) FROM fencegate.schema_migrations";
pub const RECORD_MIGRATION: &str = "INSERT INTO fencegate.schema_migrations (version) VALUES ($1)";

/// Raises the fence to `$2` iff `$2 >= highest`; returns the new highest, or no row if
/// the token is stale. Locks the fence row either way. `$1` resource, `$2` token.
macro_rules! fence_raise {
    () => {
        "INSERT INTO fencegate.fences AS f (resource, highest) VALUES ($1::text, $2::bigint)
         ON CONFLICT (resource) DO UPDATE SET highest = EXCLUDED.highest, updated_at = now()
             WHERE f.highest <= EXCLUDED.highest
         RETURNING f.highest"
    };
}

/// Writes (or revives) an object; `$1` resource, `$2` token, `$3` key, `$4` value.
/// Returns the new version and the version the incarnation was born at.
macro_rules! object_put {
    ($source:literal) => {
        concat!(
            "INSERT INTO fencegate.objects AS o (resource, key, value, token, version, born)
             SELECT $1::text, $3::text, $4::bytea, $2::bigint, 1, 1 ",
            $source,
            " ON CONFLICT (resource, key) DO UPDATE SET
                 value = EXCLUDED.value, token = EXCLUDED.token, version = o.version + 1,
                 born = CASE WHEN o.value IS NULL THEN o.version + 1 ELSE o.born END,
                 updated_at = now()
             RETURNING o.version, o.born"
        )
    };
}

/// Deletes an object by leaving a tombstone; a missing or deleted object keeps its
/// version (a new key gets a version-0 tombstone). `$1` resource, `$2` token, `$3` key.
macro_rules! object_delete {
    ($source:literal) => {
        concat!(
            "INSERT INTO fencegate.objects AS o (resource, key, value, token, version, born)
             SELECT $1::text, $3::text, NULL, $2::bigint, 0, 0 ",
            $source,
            " ON CONFLICT (resource, key) DO UPDATE SET
                 value = NULL, token = EXCLUDED.token,
                 version = CASE WHEN o.value IS NULL THEN o.version ELSE o.version + 1 END,
                 updated_at = now()
             RETURNING o.version, o.born"
        )
    };
}

/// Fence check and put in one statement, one round trip: the object insert reads
/// from the fence CTE, so it runs only after the fence row is locked and raised, and
/// not at all if the token is stale. An autocommitted statement is its own
/// transaction: on any error nothing of it remains.
pub const FENCED_PUT: &str = concat!(
    "WITH fence AS (",
    fence_raise!(),
    ") ",
    object_put!("FROM fence")
);
/// As [`FENCED_PUT`], for a delete.
pub const FENCED_DELETE: &str = concat!(
    "WITH fence AS (",
    fence_raise!(),
    ") ",
    object_delete!("FROM fence")
);

/// The fence step alone: an advance, or the first statement of a conditional write.
pub const FENCE_RAISE: &str = fence_raise!();
/// The object steps alone, run inside a transaction that already holds the fence lock.
pub const OBJECT_PUT: &str = object_put!("");
pub const OBJECT_DELETE: &str = object_delete!("");
/// The object's current version (`None` if deleted); run after the fence lock is held,
/// so its snapshot includes every earlier write of the resource.
pub const OBJECT_VERSION: &str =
    "SELECT version, value IS NOT NULL FROM fencegate.objects WHERE resource = $1 AND key = $2";

pub const GET_OBJECT: &str =
    "SELECT value, version, token FROM fencegate.objects WHERE resource = $1 AND key = $2 AND value IS NOT NULL";
pub const GET_FENCE: &str = "SELECT highest FROM fencegate.fences WHERE resource = $1";
pub const PING: &str = "SELECT 1";
