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

/// The timeline a primary writes on: the first eight hex digits of its current WAL
/// file's name. (Callable by any role; fails on a standby, where nothing is minted.)
macro_rules! timeline {
    () => {
        "('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint"
    };
}

/// The bytes a record of `fencegate.idempotency` counts for, as
/// [`crate::store::txn::record_bytes`] counts them.
macro_rules! record_bytes {
    () => {
        "(octet_length(identity) + octet_length(key) + coalesce(octet_length(headers), 0)
          + coalesce(octet_length(body), 0) + 96)"
    };
}

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
    (2, crate::dbfence::M2_SQL),
    (3, crate::dbfence::M3_SQL),
    (4, crate::dbfence::M4_SQL),
    (5, crate::dbfence::M5_SQL),
    (
        6,
        "-- The answers of writes sent with an Idempotency-Key, stored in the transaction
     -- of the write; see crate::store::txn.
     CREATE TABLE fencegate.idempotency (
         identity    text NOT NULL,
         key         text NOT NULL,
         fingerprint bytea NOT NULL,
         status      smallint,
         headers     text,
         body        bytea,
         created_at  timestamptz NOT NULL DEFAULT now(),
         expires_at  timestamptz NOT NULL,
         PRIMARY KEY (identity, key)
     );
     CREATE INDEX idempotency_expiry ON fencegate.idempotency (expires_at);",
    ),
    (
        7,
        "-- Resources bound to etcd and ZooKeeper elections (--issued-by etcd:..., zookeeper:...).
     ALTER TABLE fencegate.issuer_bindings DROP CONSTRAINT issuer_bindings_issuer_check;
     ALTER TABLE fencegate.issuer_bindings ADD CONSTRAINT issuer_bindings_issuer_check
         CHECK (issuer IN ('gateway', 'leader_lease', 'etcd', 'zookeeper'));",
    ),
    (
        8,
        "-- The highest raise of each resource that the raise log let go of: a floor of
     -- every reset, so that no number of raises pushes a term out of a reset's reach.
     CREATE TABLE fencegate.raise_floors (
         resource text PRIMARY KEY,
         token    bigint NOT NULL
     );
     REVOKE ALL ON fencegate.raise_floors FROM PUBLIC;",
    ),
    (
        9,
        concat!(
            "-- The answers stored under keys, per identity: records and their bytes, kept
     -- by every gateway (it adds what it stored, about once a second) and by the
     -- removal of expired records; the bounds of keyed writes are read from here.
     CREATE TABLE fencegate.idempotency_usage (
         identity text PRIMARY KEY,
         records  bigint NOT NULL,
         bytes    bigint NOT NULL
     );
     INSERT INTO fencegate.idempotency_usage (identity, records, bytes)
         SELECT identity, count(*), sum(",
            record_bytes!(),
            ") FROM fencegate.idempotency GROUP BY identity;
     REVOKE ALL ON fencegate.idempotency_usage FROM PUBLIC;"
        ),
    ),
];

/// The readiness probe: a real write, committed on its own.
pub const READINESS_PROBE: &str = "INSERT INTO fencegate.readiness (only_row, probe_at)
     VALUES (true, clock_timestamp())
     ON CONFLICT (only_row) DO UPDATE SET probe_at = EXCLUDED.probe_at";

/// The digest of the schema's functions as applied (`fencegate.schema_functions`).
pub const FUNCTIONS_DIGEST: &str = "SELECT digest FROM fencegate.schema_functions";
/// Records the digest of the functions just applied. `$1` digest.
pub const RECORD_FUNCTIONS: &str = "INSERT INTO fencegate.schema_functions (digest) VALUES ($1)
     ON CONFLICT (only_row) DO UPDATE SET digest = EXCLUDED.digest, applied_at = now()";
/// Forgets the fenced tables that were dropped (the partition guard does at once, where
/// a superuser installed it).
pub const FORGET_DROPPED_TABLES: &str = "DELETE FROM fencegate.protected_tables p
     WHERE NOT EXISTS (SELECT FROM pg_class c WHERE c.oid = p.tbl)";
/// The gateway's keys: `sql` (the fence step of /v1/sql) and `proof` (the fence's proofs).
pub const KEYS: &str = "SELECT name, key FROM fencegate.keys WHERE name IN ('sql', 'proof')";
/// Older-term sessions ended after `$1`, in order.
pub const TAKEOVERS_SINCE: &str =
    "SELECT id, resource, token, pid, role, ended_by FROM fencegate.takeovers WHERE id > $1 ORDER BY id";
/// The last id the takeover log's sequence issued, committed or rolled back (0: none).
pub const TAKEOVER_LAST_ID: &str = "SELECT coalesce(pg_sequence_last_value(
     pg_get_serial_sequence('fencegate.takeovers', 'id')::regclass), 0)";
/// Ends the sessions holding `$1`'s fence for a term older than `$2`.
pub const END_OLDER_TERMS: &str = "SELECT fencegate.end_older_terms($1, $2, 'gateway')";
/// Whether table `$1` (quoted) is guarded by `fencegate.guard_leader_lease()`, with both
/// its triggers enabled ALWAYS; NULL if it does not exist.
pub const LEASE_TABLE_GUARDED: &str = "
    SELECT CASE WHEN to_regclass($1) IS NULL THEN NULL ELSE (
        SELECT count(*) = 2 FROM pg_trigger t
        WHERE t.tgrelid = to_regclass($1) AND t.tgenabled = 'A'
          AND t.tgname IN ('fencegate_lease_guard', 'fencegate_lease_guard_truncate')
          AND t.tgfoid = to_regprocedure('fencegate.guard_leader_lease()')) END";
/// Records a setting the schema's functions read. `$1` name, `$2` value.
pub const SET_SETTING: &str = "INSERT INTO fencegate.settings (name, value) VALUES ($1, $2)
     ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value";

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
/// the token is stale. Locks the fence row either way. `$1` resource, `$2` token;
/// `$path` the path recorded with a raise (`fencegate.raises`).
macro_rules! fence_raise {
    ($path:literal) => {
        concat!(
            "INSERT INTO fencegate.fences AS f (resource, highest, raised_by)
             VALUES ($1::text, $2::bigint, '",
            $path,
            "')
             ON CONFLICT (resource) DO UPDATE
                 SET highest = EXCLUDED.highest, raised_by = EXCLUDED.raised_by, updated_at = now()
                 WHERE f.highest <= EXCLUDED.highest
             RETURNING f.highest"
        )
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
    fence_raise!("kv"),
    ") ",
    object_put!("FROM fence")
);
/// As [`FENCED_PUT`], for a delete.
pub const FENCED_DELETE: &str = concat!(
    "WITH fence AS (",
    fence_raise!("kv"),
    ") ",
    object_delete!("FROM fence")
);

/// The conflict clause of a group's object upsert: an accepted write's object is written
/// as [`FENCED_PUT`] or [`FENCED_DELETE`] would write it (a NULL value is a delete's
/// tombstone). Returns each written object's key, version and born version.
macro_rules! group_objects_upsert {
    () => {
        "
        ON CONFLICT (resource, key) DO UPDATE SET
            value = EXCLUDED.value, token = EXCLUDED.token,
            version = CASE WHEN EXCLUDED.value IS NULL AND o.value IS NULL
                           THEN o.version ELSE o.version + 1 END,
            born = CASE WHEN EXCLUDED.value IS NOT NULL AND o.value IS NULL
                        THEN o.version + 1 ELSE o.born END,
            updated_at = now()
        RETURNING o.resource, o.key, o.version, o.born"
    };
}

/// A group's first statement: locks the fence rows of its resources (`$1`, distinct,
/// in byte order — the order every group takes its locks in), creating each missing row
/// at 1, the lowest token, marked `raised_by = 'lock'`: a placeholder that no raise has
/// claimed yet. No fence moves.
///
/// An existing row is locked and left as it is: `ON CONFLICT DO UPDATE` locks the row
/// it conflicts with before it evaluates the `WHERE`, which here refuses the update.
/// The lock is the one an update would take, without writing a new row version that
/// [`GROUP_APPLY`] would replace at once.
///
/// A placeholder never outlives its group: the group's first accepted write of the
/// resource makes it a fence (the raise log records it then, once, with its real path),
/// and [`GROUP_TIDY`] deletes the placeholders no write claimed, so that a refused write
/// leaves no trace, as in a transaction of its own.
pub const GROUP_LOCK: &str = "
    INSERT INTO fencegate.fences AS f (resource, highest, raised_by)
    SELECT resource, 1, 'lock' FROM unnest($1::text[]) WITH ORDINALITY AS u(resource, n) ORDER BY n
    ON CONFLICT (resource) DO UPDATE SET highest = f.highest WHERE false";

/// A checked group's last statement before its answers: deletes the placeholders of
/// [`GROUP_LOCK`] among its resources (`$1`) that none of its writes claimed.
pub const GROUP_TIDY: &str = "
    DELETE FROM fencegate.fences WHERE resource = ANY ($1::text[]) AND raised_by = 'lock'";

/// Applies a run of a group's writes in one statement, after [`GROUP_LOCK`] in the same
/// transaction: `$1` resources, `$2` tokens, `$3` keys, `$4` values (NULL: a delete),
/// one element per write, in the group's order; no (resource, key) twice.
///
/// A write is accepted iff its token is at least its resource's fence and every earlier
/// token of the run on that resource. That is the fence the writes before it left:
/// an accepted write raised the fence to its token, and a stale one was below a fence
/// already counted. Each resource's fence is then raised once, to its highest accepted
/// token, and each accepted write's object is written as [`FENCED_PUT`] or
/// [`FENCED_DELETE`] would. Returns, in order, each write's new version and born
/// version, NULL for a stale write.
///
/// Written so that even a generic plan, which cannot know how many writes the arrays
/// hold, finds each fence by its primary key rather than scanning the table: the fence
/// read is a subquery per write, and the update names its rows by the array.
pub const GROUP_APPLY: &str = concat!(
    "
    WITH w AS (
        SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bytea[])
            WITH ORDINALITY AS w(resource, token, key, value, n)
    ), judged AS (
        SELECT w.*, w.token >= greatest(
                   (SELECT highest FROM fencegate.fences f WHERE f.resource = w.resource),
                   max(w.token) OVER earlier) AS accepted
        FROM w
        WINDOW earlier AS (PARTITION BY w.resource ORDER BY w.n
                           ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
    ), raised AS (
        UPDATE fencegate.fences f SET highest = top.token, raised_by = 'kv', updated_at = now()
        FROM (SELECT resource, max(token) AS token FROM judged WHERE accepted
              GROUP BY resource) top
        WHERE f.resource = ANY ($1::text[]) AND f.resource = top.resource
    ), written AS (
        INSERT INTO fencegate.objects AS o (resource, key, value, token, version, born)
        SELECT resource, key, value, token, (value IS NOT NULL)::int, (value IS NOT NULL)::int
        FROM judged WHERE accepted ORDER BY n",
    group_objects_upsert!(),
    "
    )
    SELECT o.version, o.born
    FROM judged j LEFT JOIN written o ON o.resource = j.resource AND o.key = j.key
    ORDER BY j.n"
);

/// Claims the Idempotency-Keys of a group's keyed writes, first in its transaction (the
/// order a keyed transaction takes too: keys, then fences): a new record each, or one
/// whose time ran out made new, its answer left empty until [`GROUP_ANSWER`]. A live
/// record is left as it is (the write it belongs to then does not run, see
/// [`GROUP_APPLY_CHECKED`]); an uncommitted claim of another attempt is waited for.
/// `$1` identities, `$2` keys (distinct pairs, in byte order: the order every group
/// claims in), `$3` fingerprints, `$4` times to live in milliseconds.
pub const GROUP_CLAIM: &str = "
    INSERT INTO fencegate.idempotency AS i (identity, key, fingerprint, expires_at)
    SELECT u.identity, u.key, u.fingerprint, clock_timestamp() + u.ttl * interval '1 millisecond'
    FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bigint[])
        WITH ORDINALITY AS u(identity, key, fingerprint, ttl, n)
    ORDER BY u.n
    ON CONFLICT (identity, key) DO UPDATE SET
        fingerprint = EXCLUDED.fingerprint, expires_at = EXCLUDED.expires_at,
        status = NULL, headers = NULL, body = NULL, created_at = now()
        WHERE i.expires_at <= clock_timestamp()";

/// As [`GROUP_APPLY`], for a run with conditional or keyed writes: `$5` each write's
/// precondition (NULL none, 0 the object must not exist, -1 it must exist, n >= 1 it
/// must be at version n), `$6` and `$7` its Idempotency-Key's identity and key (NULL:
/// none), claimed by [`GROUP_CLAIM`] earlier in the same transaction.
///
/// A keyed write runs only on its own claim: a record with no answer yet, which only
/// this transaction can see (a committed record always has its answer); otherwise its
/// record is returned, for its answer to be replayed. A write that runs is judged as
/// in [`GROUP_APPLY`] — its token against its resource's fence and the tokens of the
/// run's earlier writes of the resource that run and whose precondition holds — and
/// then by its precondition, against its object as it stands (a run writes an object
/// once); only a write whose token is current and whose precondition holds is applied
/// and raises the fence. Returns, in order, per write: whether it ran, whether it was
/// stale, the fence it was judged against, its object's current version (NULL: none),
/// the written version and born version (NULL: not written), and the fingerprint,
/// status, headers and body of the record of a write that did not run.
///
/// A lane plans its statements once, often while the tables are still empty, when a
/// join that scans a whole table looks cheapest; and that plan stays. So every row
/// this statement and [`TXN_APPLY`] and [`GROUP_ANSWER`] look up is looked up by its
/// primary key in a `LATERAL` subquery with `LIMIT 1`, which no plan can turn into a
/// scan of the table: the cost of a group stays that of its own rows however large the
/// tables grow.
pub const GROUP_APPLY_CHECKED: &str = concat!(
    "
    WITH w AS (
        SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bytea[],
                             $5::bigint[], $6::text[], $7::text[])
            WITH ORDINALITY AS w(resource, token, key, value, expect, identity, idem, n)
    ), looked AS (
        SELECT w.*,
               w.identity IS NULL OR (r.identity IS NOT NULL AND r.status IS NULL) AS runs,
               r.fingerprint AS found_fingerprint, r.status AS found_status,
               r.headers AS found_headers, r.body AS found_body,
               CASE WHEN o.value IS NOT NULL THEN o.version END AS current
        FROM w
        LEFT JOIN LATERAL (
            SELECT r.* FROM fencegate.idempotency r
            WHERE w.identity IS NOT NULL AND r.identity = w.identity AND r.key = w.idem LIMIT 1
        ) r ON true
        LEFT JOIN LATERAL (
            SELECT o.value, o.version FROM fencegate.objects o
            WHERE w.expect IS NOT NULL AND o.resource = w.resource AND o.key = w.key LIMIT 1
        ) o ON true
    ), checked AS (
        SELECT l.*, CASE WHEN l.expect IS NULL THEN true
                         WHEN l.expect = 0 THEN l.current IS NULL
                         WHEN l.expect = -1 THEN l.current IS NOT NULL
                         ELSE l.current IS NOT DISTINCT FROM l.expect END AS holds
        FROM looked l
    ), judged AS (
        SELECT c.*, greatest(
                   (SELECT highest FROM fencegate.fences f WHERE f.resource = c.resource),
                   max(c.token) FILTER (WHERE c.runs AND c.holds) OVER earlier) AS fence
        FROM checked c
        WINDOW earlier AS (PARTITION BY c.resource ORDER BY c.n
                           ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
    ), decided AS (
        SELECT j.*, j.runs AND j.token >= j.fence AND j.holds AS accepted FROM judged j
    ), raised AS (
        UPDATE fencegate.fences f SET highest = top.token, raised_by = 'kv', updated_at = now()
        FROM (SELECT resource, max(token) AS token FROM decided WHERE accepted
              GROUP BY resource) top
        WHERE f.resource = ANY ($1::text[]) AND f.resource = top.resource
          AND (f.highest < top.token OR f.raised_by = 'lock')
    ), written AS (
        INSERT INTO fencegate.objects AS o (resource, key, value, token, version, born)
        SELECT resource, key, value, token, (value IS NOT NULL)::int, (value IS NOT NULL)::int
        FROM decided WHERE accepted ORDER BY n",
    group_objects_upsert!(),
    "
    )
    SELECT d.runs, d.token < d.fence, d.fence, d.current, o.version, o.born,
           d.found_fingerprint, d.found_status, d.found_headers, d.found_body
    FROM decided d LEFT JOIN written o ON o.resource = d.resource AND o.key = d.key
    ORDER BY d.n"
);

/// A whole transaction of several operations in one statement, inside a group's
/// transaction after [`GROUP_CLAIM`] and [`GROUP_LOCK`] (which locked every fence it
/// involves): `$1` each operation's kind (0 put, 1 delete, 2 advance, 3 check), `$2`
/// resource, `$3` key (NULL: none), `$4` token, `$5` value (NULL: none), `$6` its
/// precondition (as [`GROUP_APPLY_CHECKED`]; for a check of an object, its version, 0
/// for none), in operation order; `$7` and `$8` the transaction's Idempotency-Key's
/// identity and key (NULL: none).
///
/// The steps of [`crate::store::txn`] at once: the transaction runs only on its own
/// claim (as a keyed write of a group); every resource is judged against its fence and
/// every object against its precondition before anything changes; only if none is
/// stale and every precondition holds are the fences raised and the objects written.
/// Returns one row per operation, in order: whether the transaction ran and applied,
/// the operation's resource's fence and whether it was stale, whether its precondition
/// held and its object's current version, the written version and born version, and
/// the record of a transaction that did not run.
pub const TXN_APPLY: &str = concat!(
    "
    WITH op AS (
        SELECT * FROM unnest($1::smallint[], $2::text[], $3::text[], $4::bigint[],
                             $5::bytea[], $6::bigint[])
            WITH ORDINALITY AS op(kind, resource, key, token, value, expect, n)
    ), rec AS (
        SELECT $7::text IS NULL OR (r.identity IS NOT NULL AND r.status IS NULL) AS runs,
               r.fingerprint, r.status, r.headers, r.body
        FROM (SELECT 1) AS one
        LEFT JOIN fencegate.idempotency r ON r.identity = $7::text AND r.key = $8::text
    ), judged AS (
        SELECT op.*, f.highest AS fence, op.token < f.highest AS stale,
               CASE WHEN o.value IS NOT NULL THEN o.version END AS current,
               CASE WHEN op.expect IS NULL THEN true
                    WHEN op.expect = 0 THEN o.value IS NULL
                    WHEN op.expect = -1 THEN o.value IS NOT NULL
                    ELSE o.value IS NOT NULL AND o.version = op.expect END AS holds
        FROM op
        CROSS JOIN LATERAL (
            SELECT f.highest FROM fencegate.fences f WHERE f.resource = op.resource LIMIT 1
        ) f
        LEFT JOIN LATERAL (
            SELECT o.value, o.version FROM fencegate.objects o
            WHERE op.key IS NOT NULL AND o.resource = op.resource AND o.key = op.key LIMIT 1
        ) o ON true
    ), verdict AS (
        SELECT (SELECT runs FROM rec) AND NOT bool_or(stale) AND bool_and(holds) AS applies
        FROM judged
    ), raised AS (
        UPDATE fencegate.fences f
        SET highest = greatest(f.highest, t.token), raised_by = 'txn', updated_at = now()
        FROM (SELECT resource, coalesce(max(token) FILTER (WHERE kind <> 3), 1) AS token
              FROM judged GROUP BY resource) t, verdict v
        WHERE v.applies AND f.resource = ANY ($2::text[]) AND f.resource = t.resource
          AND (f.highest < t.token OR f.raised_by = 'lock')
    ), written AS (
        INSERT INTO fencegate.objects AS o (resource, key, value, token, version, born)
        SELECT j.resource, j.key, j.value, j.token, (j.value IS NOT NULL)::int, (j.value IS NOT NULL)::int
        FROM judged j, verdict v WHERE v.applies AND j.kind IN (0, 1) ORDER BY j.n",
    group_objects_upsert!(),
    "
    )
    SELECT (SELECT runs FROM rec), (SELECT applies FROM verdict), j.fence, j.stale, j.holds,
           j.current, o.version, o.born,
           (SELECT fingerprint FROM rec), (SELECT status FROM rec),
           (SELECT headers FROM rec), (SELECT body FROM rec)
    FROM judged j LEFT JOIN written o ON o.resource = j.resource AND o.key = j.key
    ORDER BY j.n"
);

/// Stores the answers of a group's keyed writes that ran, under the keys
/// [`GROUP_CLAIM`] claimed, before the group commits. `$1` identities, `$2` keys, `$3`
/// statuses, `$4` headers, `$5` bodies.
pub const GROUP_ANSWER: &str = "
    UPDATE fencegate.idempotency i
    SET status = u.status, headers = u.headers, body = u.body
    FROM unnest($1::text[], $2::text[], $3::smallint[], $4::text[], $5::bytea[])
        AS u(identity, key, status, headers, body)
    CROSS JOIN LATERAL (
        SELECT r.ctid AS at FROM fencegate.idempotency r
        WHERE r.identity = u.identity AND r.key = u.key LIMIT 1
    ) claimed
    WHERE i.ctid = claimed.at";

/// A whole group in one autocommitted statement, for a group in which every write of a
/// resource carries the same token and no object is written twice (the common group:
/// one leader per resource). `$1` the group's resources (distinct, in lock order) and `$2`
/// each one's token; `$3` resources, `$4` keys and `$5` values (NULL: a delete), one
/// element per write, in the group's order.
///
/// Each fence is raised as [`FENCED_PUT`] raises it: to the token if the token is not
/// below it, the row locked either way (in `$1`'s order) and created at the token if it
/// is missing. With one token per resource, a resource's writes are then all accepted
/// (the fence row is returned) or all stale (it is not). The objects are written from
/// the returned rows, so only after their fence is locked, as [`FENCED_PUT`] or
/// [`FENCED_DELETE`] would write them. Returns, in order, each write's new version and
/// born version, NULL for a stale write.
pub const GROUP_WRITE: &str = concat!(
    "
    WITH fenced AS (
        INSERT INTO fencegate.fences AS f (resource, highest, raised_by)
        SELECT resource, token, 'kv' FROM unnest($1::text[], $2::bigint[])
            WITH ORDINALITY AS u(resource, token, n) ORDER BY n
        ON CONFLICT (resource) DO UPDATE
            SET highest = EXCLUDED.highest, raised_by = EXCLUDED.raised_by, updated_at = now()
            WHERE f.highest <= EXCLUDED.highest
        RETURNING f.resource, f.highest AS token
    ), w AS (
        SELECT * FROM unnest($3::text[], $4::text[], $5::bytea[])
            WITH ORDINALITY AS w(resource, key, value, n)
    ), written AS (
        INSERT INTO fencegate.objects AS o (resource, key, value, token, version, born)
        SELECT w.resource, w.key, w.value, fenced.token,
               (w.value IS NOT NULL)::int, (w.value IS NOT NULL)::int
        FROM w JOIN fenced ON fenced.resource = w.resource ORDER BY w.n",
    group_objects_upsert!(),
    "
    )
    SELECT o.version, o.born
    FROM w LEFT JOIN written o ON o.resource = w.resource AND o.key = w.key
    ORDER BY w.n"
);

/// Claims an idempotency key for a write about to run: a new record, or one whose time
/// ran out, made new. No row if a live record holds the key (it is then locked until the
/// transaction ends); waits for an uncommitted claim of the same key. `$1` identity,
/// `$2` key, `$3` fingerprint, `$4` time to live in milliseconds.
pub const IDEMPOTENCY_CLAIM: &str = "
    INSERT INTO fencegate.idempotency AS i (identity, key, fingerprint, expires_at)
    VALUES ($1, $2, $3, clock_timestamp() + $4::bigint * interval '1 millisecond')
    ON CONFLICT (identity, key) DO UPDATE SET
        fingerprint = EXCLUDED.fingerprint, expires_at = EXCLUDED.expires_at,
        status = NULL, headers = NULL, body = NULL, created_at = now()
        WHERE i.expires_at <= clock_timestamp()
    RETURNING true";
/// The record of a key. `$1` identity, `$2` key.
pub const IDEMPOTENCY_READ: &str = "SELECT fingerprint, status, headers, body
     FROM fencegate.idempotency WHERE identity = $1 AND key = $2";
/// The committed answer of a key, unless it expired. `$1` identity, `$2` key.
pub const IDEMPOTENCY_ANSWER: &str = "SELECT fingerprint, status, headers, body
     FROM fencegate.idempotency
     WHERE identity = $1 AND key = $2 AND expires_at > clock_timestamp() AND status IS NOT NULL";
/// Adds the answers a gateway stored since it last did to their identities' usage:
/// `$1` identities (distinct, sorted: the order every writer of the table locks rows
/// in), `$2` records, `$3` bytes.
pub const USAGE_ADD: &str = "
    INSERT INTO fencegate.idempotency_usage AS u (identity, records, bytes)
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[])
    ON CONFLICT (identity) DO UPDATE
        SET records = u.records + EXCLUDED.records, bytes = u.bytes + EXCLUDED.bytes";
/// The identities at a bound of their own (`$1` records, `$2` bytes), and the records
/// and bytes of all: one row per such identity, then a row with a NULL identity and the
/// totals.
pub const USAGE_READ: &str = "
    SELECT identity, records, bytes FROM fencegate.idempotency_usage
        WHERE records >= $1 OR bytes >= $2
    UNION ALL
    SELECT NULL, coalesce(sum(records), 0)::bigint, coalesce(sum(bytes), 0)::bigint
        FROM fencegate.idempotency_usage";
/// Stores the answer of a claimed key. `$1` identity, `$2` key, `$3` status,
/// `$4` headers, `$5` body.
pub const IDEMPOTENCY_RECORD: &str = "UPDATE fencegate.idempotency
     SET status = $3, headers = $4, body = $5 WHERE identity = $1 AND key = $2";
/// Removes up to `$1` expired records, skipping any a transaction holds, and takes
/// them off their identities' usage (never below zero: a record stored by a gateway
/// that stopped before it counted it); returns how many went. Touches no fence.
pub const IDEMPOTENCY_EXPIRE: &str = concat!(
    "
    WITH gone AS (
        DELETE FROM fencegate.idempotency WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM fencegate.idempotency WHERE expires_at <= clock_timestamp()
            LIMIT $1 FOR UPDATE SKIP LOCKED))
        RETURNING identity, ",
    record_bytes!(),
    " AS bytes
    ), per AS (
        SELECT identity, count(*) AS records, sum(bytes) AS bytes FROM gone GROUP BY identity
    ), used AS (
        UPDATE fencegate.idempotency_usage u
        SET records = greatest(u.records - per.records, 0), bytes = greatest(u.bytes - per.bytes, 0)
        FROM per WHERE u.identity = per.identity
    )
    SELECT count(*) FROM gone"
);

/// A transaction's hold on the fence of a resource it writes: the row locked as
/// [`GROUP_LOCK`] locks it (made at 1, the lowest token, if missing), nothing raised
/// yet. `$1` resource.
pub const TXN_FENCE_LOCK: &str =
    "INSERT INTO fencegate.fences AS f (resource, highest, raised_by) VALUES ($1, 1, 'txn')
     ON CONFLICT (resource) DO UPDATE SET highest = f.highest WHERE false";
/// Raises a fence the transaction holds to its token, once every check passed; a fence
/// already at the token is left as it is. `$1` resource, `$2` token.
pub const TXN_FENCE_SET: &str =
    "UPDATE fencegate.fences SET highest = $2, raised_by = 'txn', updated_at = now()
     WHERE resource = $1 AND highest < $2";
/// A transaction's hold on the fence of a resource it only checks: the row made (at 1,
/// the lowest token: no fence) if missing, then locked for share.
pub const TXN_FENCE_ENSURE: &str =
    "INSERT INTO fencegate.fences (resource, highest, raised_by) VALUES ($1, 1, 'txn')
     ON CONFLICT (resource) DO NOTHING";
pub const TXN_FENCE_SHARE: &str =
    "SELECT highest FROM fencegate.fences WHERE resource = $1 FOR SHARE";

/// The fence step alone: an advance.
pub const FENCE_ADVANCE: &str = fence_raise!("advance");
/// The first statement of a conditional write.
pub const FENCE_RAISE: &str = fence_raise!("kv");
/// The object steps alone, run inside a transaction that already holds the fence lock.
pub const OBJECT_PUT: &str = object_put!("");
pub const OBJECT_DELETE: &str = object_delete!("");
/// The object's current version (`None` if deleted); run after the fence lock is held,
/// so its snapshot includes every earlier write of the resource.
pub const OBJECT_VERSION: &str =
    "SELECT version, value IS NOT NULL FROM fencegate.objects WHERE resource = $1 AND key = $2";

pub const GET_OBJECT: &str =
    "SELECT value, version, token FROM fencegate.objects WHERE resource = $1 AND key = $2 AND value IS NOT NULL";
/// Live objects of a resource under a key prefix, after a key, in byte order.
pub const LIST_OBJECTS: &str = "SELECT key, value FROM fencegate.objects \
     WHERE resource = $1 AND value IS NOT NULL AND starts_with(key, $2) \
       AND key COLLATE \"C\" > $3 \
     ORDER BY key COLLATE \"C\" LIMIT $4";
pub const GET_FENCE: &str = "SELECT highest FROM fencegate.fences WHERE resource = $1";
pub const PING: &str = "SELECT 1";
/// Which server this is: its system identifier, its timeline (the last checkpoint's
/// on a standby), its postmaster's start time and its address; and whether it is a
/// standby.
pub const SERVER_IDENTITY: &str = concat!(
    "SELECT (SELECT system_identifier FROM pg_control_system())::text,
            CASE WHEN pg_is_in_recovery()
                 THEN (SELECT timeline_id FROM pg_control_checkpoint())::bigint
                 ELSE ",
    timeline!(),
    " END,
            pg_postmaster_start_time()::text || ' '
            || coalesce(host(inet_server_addr()), 'local') || ':' || coalesce(inet_server_port(), 0),
            pg_is_in_recovery()"
);

/// Creates the lease's row if it has none; `$1` resource.
pub const LEASE_ENSURE: &str =
    "INSERT INTO fencegate.leases (resource) VALUES ($1) ON CONFLICT (resource) DO NOTHING";

/// The lease, locked, on the database's clock: holder, identity, last token (0 if
/// none), milliseconds left (0 once expired). `$1` resource.
macro_rules! lease_columns {
    () => {
        "holder, identity, token,
         CASE WHEN expires_at > clock_timestamp()
              THEN ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint
              ELSE 0 END"
    };
}
pub const LEASE_LOCK: &str = concat!(
    "SELECT ",
    lease_columns!(),
    " FROM fencegate.leases WHERE resource = $1 FOR UPDATE"
);
pub const LEASE_READ: &str = concat!(
    "SELECT ",
    lease_columns!(),
    " FROM fencegate.leases WHERE resource = $1"
);

/// Locks the resource's fence row, creating it if missing (the caller raises it in the
/// same transaction); returns its highest, 0 if the row is new, and the server's
/// timeline (the epoch of the token minted). `$1` resource.
pub const FENCE_LOCK: &str = concat!(
    "INSERT INTO fencegate.fences AS f (resource, highest, raised_by) VALUES ($1, 1, 'lease')
     ON CONFLICT (resource) DO UPDATE SET highest = f.highest
     RETURNING CASE WHEN xmax = 0 THEN 0 ELSE highest END, ",
    timeline!()
);

/// Raises a locked fence row to a token a lease minted. `$1` resource, `$2` highest.
pub const FENCE_SET_LEASE: &str =
    "UPDATE fencegate.fences SET highest = $2, raised_by = 'lease', updated_at = now()
     WHERE resource = $1";
/// Lowers a locked fence row (a reset). `$1` resource, `$2` highest.
pub const FENCE_LOWER: &str =
    "UPDATE fencegate.fences SET highest = $2, raised_by = 'reset', updated_at = now()
     WHERE resource = $1";

/// Gives the lease a new term. `$1` resource, `$2` holder, `$3` identity, `$4` token,
/// `$5` ttl in milliseconds.
pub const LEASE_MINT: &str = concat!(
    "UPDATE fencegate.leases SET holder = $2, identity = $3, token = $4,
         expires_at = clock_timestamp() + $5::bigint * interval '1 millisecond',
         acquired_at = clock_timestamp()
     WHERE resource = $1 RETURNING ",
    lease_columns!()
);
/// Extends the lease's term. `$1` resource, `$2` ttl in milliseconds.
pub const LEASE_EXTEND: &str = concat!(
    "UPDATE fencegate.leases
         SET expires_at = clock_timestamp() + $2::bigint * interval '1 millisecond'
     WHERE resource = $1 RETURNING ",
    lease_columns!()
);
/// Frees the lease, keeping its last token and the identity that token is bound to.
/// `$1` resource.
pub const LEASE_FREE: &str = concat!(
    "UPDATE fencegate.leases SET holder = NULL, expires_at = '-infinity'
     WHERE resource = $1 RETURNING ",
    lease_columns!()
);

/// A reset's floors (0 when none): the lease's last token; the highest token an object
/// of the resource was written with, but `$2` (the token the reset declares forged) and
/// the tokens earlier resets declared forged; and the highest token but `$2` that a
/// raise of its fence recorded (`fencegate.raises`: every path), or that the raise log
/// let go of (`fencegate.raise_floors`). `$1` resource, `$2` the forged token.
pub const RESET_FLOORS: &str =
    "SELECT coalesce((SELECT token FROM fencegate.leases WHERE resource = $1), 0),
            coalesce((SELECT max(o.token) FROM fencegate.objects o
                      WHERE o.resource = $1 AND o.token <> $2
                        AND NOT EXISTS (SELECT FROM fencegate.fence_resets r
                                        WHERE r.resource = $1 AND r.forged = o.token)), 0),
            greatest(coalesce((SELECT max(token) FROM fencegate.raises WHERE resource = $1 AND token <> $2), 0),
                     coalesce((SELECT token FROM fencegate.raise_floors WHERE resource = $1), 0))";
/// Forgets the raises a reset went below. `$1` resource, `$2` the reset's token.
pub const RESET_RETIRE_RAISES: &str =
    "DELETE FROM fencegate.raises WHERE resource = $1 AND token > $2";
/// The resource's fence, locked. `$1` resource.
pub const FENCE_FOR_UPDATE: &str =
    "SELECT highest FROM fencegate.fences WHERE resource = $1 FOR UPDATE";
/// Records a reset; returns its generation. `$1` resource, `$2` from, `$3` to,
/// `$4` identity, `$5` reason.
pub const RESET_RECORD: &str =
    "INSERT INTO fencegate.fence_resets (resource, from_token, to_token, identity, reason, forged)
     VALUES ($1, $2, $3, $4, $5, $2) RETURNING generation";
/// Resets after generation `$1`, in order.
pub const RESETS_SINCE: &str = "SELECT generation, resource, to_token FROM fencegate.fence_resets
     WHERE generation > $1 ORDER BY generation";

/// Finds the fences below tokens this gateway saw committed — a database that lost
/// them, as after a failover to an asynchronous standby — raises them back, and
/// returns them with what was found (NULL: no row). Resources reset after generation
/// `$3` are left alone: their fences went down on purpose. `$1` resources, `$2` tokens.
pub const FENCES_RESTORE: &str = "
    WITH seen AS (
        SELECT * FROM unnest($1::text[], $2::bigint[]) AS s(resource, highest)
    ), behind AS (
        SELECT s.resource, s.highest AS seen, f.highest AS found
        FROM seen s LEFT JOIN fencegate.fences f USING (resource)
        WHERE (f.highest IS NULL OR f.highest < s.highest)
          AND NOT EXISTS (SELECT 1 FROM fencegate.fence_resets r
                          WHERE r.resource = s.resource AND r.generation > $3)
    ), raised AS (
        INSERT INTO fencegate.fences AS f (resource, highest, raised_by)
        SELECT resource, seen, 'restore' FROM behind
        ON CONFLICT (resource) DO UPDATE
            SET highest = EXCLUDED.highest, raised_by = EXCLUDED.raised_by, updated_at = now()
            WHERE f.highest < EXCLUDED.highest
        RETURNING f.resource
    )
    SELECT b.resource, b.seen, b.found FROM behind b JOIN raised USING (resource)";
