-- Migration 4: authority inside Postgres.
--
-- Which roles may present or raise which resources' fences (fencegate.authority);
-- which tables are fenced for which resource, as only `protect` records it
-- (fencegate.protected_tables); the fence step of /v1/sql transactions
-- (fencegate.sql_grants); every raise of every fence, for resets (fencegate.raises);
-- keys that only the gateway and the schema's functions read (fencegate.keys); the
-- generation of the issuer bindings; the sessions of older terms that a new term ended
-- (fencegate.takeovers); the retirement of forged leader_lease records.

-- A role may present or raise the fence of resources matching a pattern: a resource
-- name, or (prefix) the start of resource names. Roles that can act as a granted role
-- (membership) hold its grants, as Postgres privileges go. regrole and regclass
-- columns are dumped by name, so pg_dump and pg_restore keep them.
CREATE TABLE fencegate.authority (
    role       regrole NOT NULL,
    pattern    text NOT NULL,
    prefix     boolean NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pattern, prefix, role)
);

-- The fenced tables, each with its resource: written only by fencegate.protect() (for
-- a caller that owns the table) and by the partition guard. The trigger of a table
-- takes its resource from here, never from its arguments.
CREATE TABLE fencegate.protected_tables (
    tbl          regclass PRIMARY KEY,
    resource     text NOT NULL,
    protected_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO fencegate.protected_tables (tbl, resource)
    SELECT t.tgrelid::regclass,
           convert_from(substring(t.tgargs FROM 1 FOR position('\x00'::bytea IN t.tgargs) - 1), 'UTF8')
    FROM pg_trigger t
    WHERE t.tgname = 'fencegate_fence' AND t.tgfoid = to_regprocedure('fencegate.enforce()')
      AND NOT t.tgisinternal;

-- The fence step of a /v1/sql transaction: the one resource and token that the
-- gateway vouched for, for the transaction `xact` of backend `pid`. Unlogged: a grant
-- lives no longer than its transaction, and transaction ids never repeat.
CREATE UNLOGGED TABLE fencegate.sql_grants (
    pid      integer PRIMARY KEY,
    xact     xid8 NOT NULL,
    resource text NOT NULL,
    token    bigint NOT NULL
);

-- Secrets of the gateway: `sql` proves that a /v1/sql fence step comes from the
-- gateway; `proof` signs the DETAIL of the fence's rejections (HMAC-SHA256), so that
-- the gateway counts only rejections the fence really made. inner_pad and outer_pad
-- are the key xor 0x36 and 0x5c, so that SQL computes the MAC with sha256() alone.
CREATE TABLE fencegate.keys (
    name      text PRIMARY KEY,
    key       bytea NOT NULL,
    inner_pad bytea NOT NULL,
    outer_pad bytea NOT NULL
);
DO $do$
DECLARE
    purpose text;
    key bytea;
    inner_pad bytea;
    outer_pad bytea;
BEGIN
    FOREACH purpose IN ARRAY ARRAY['sql', 'proof'] LOOP
        -- Two version-4 UUIDs: 244 random bits from the server's strong source.
        key := decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex');
        inner_pad := key || decode(repeat('00', 64 - length(key)), 'hex');
        outer_pad := inner_pad;
        FOR i IN 0..63 LOOP
            inner_pad := set_byte(inner_pad, i, get_byte(inner_pad, i) # 54);
            outer_pad := set_byte(outer_pad, i, get_byte(outer_pad, i) # 92);
        END LOOP;
        INSERT INTO fencegate.keys VALUES (purpose, key, inner_pad, outer_pad);
    END LOOP;
END
$do$;

-- Which path raised the fence last (kv, advance, sql, door, lease, restore), for the
-- raise log; and a random key per fence, under which every session that holds the
-- fence row for its term also holds a shared advisory lock, so that a new term can
-- find and end the sessions of older terms that would hold it up.
ALTER TABLE fencegate.fences
    ADD COLUMN raised_by text NOT NULL DEFAULT 'unknown',
    ADD COLUMN lock_key bigint NOT NULL
        DEFAULT (floor(random() * 4e18) - 2e18)::bigint;

-- Every raise of a fence, the latest 32 per resource: a reset may go below none of
-- these tokens but the one it declares forged. Written by a trigger on
-- fencegate.fences, so that no path can raise a fence without a record.
CREATE TABLE fencegate.raises (
    resource text NOT NULL,
    token    bigint NOT NULL,
    path     text NOT NULL,
    at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (resource, token)
);
INSERT INTO fencegate.raises (resource, token, path, at)
    SELECT resource, highest, 'unknown', updated_at FROM fencegate.fences;

-- The token a reset declared forged.
ALTER TABLE fencegate.fence_resets ADD COLUMN forged bigint;

-- The generation of the issuer bindings in force: bumped only by a gateway started
-- with --replace-issuer-bindings (or writing the first bindings), so that replicas
-- can tell a deliberate change from drift.
CREATE TABLE fencegate.issuer_binding_state (
    only_row   boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    generation bigint NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO fencegate.issuer_binding_state (generation)
    SELECT 1 WHERE EXISTS (SELECT FROM fencegate.issuer_bindings);

-- Settings of the gateway that the schema's functions read (term_takeover_timeout_ms).
CREATE TABLE fencegate.settings (
    name  text PRIMARY KEY,
    value text NOT NULL
);

-- Sessions of an older term that held a fence row a new term was raising, ended.
CREATE TABLE fencegate.takeovers (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    resource text NOT NULL,
    -- The new term's token.
    token    bigint NOT NULL,
    pid      integer NOT NULL,
    role     text NOT NULL,
    -- Who ended it: `fence` (the in-database fence) or `gateway`.
    ended_by text NOT NULL
);

-- Forged records of leader_lease tables, retired by their owner
-- (`fencegate leader-lease retire`).
CREATE TABLE fencegate.issuer_retirements (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    lease_table text NOT NULL,
    name        text NOT NULL,
    from_epoch  bigint NOT NULL,
    to_epoch    bigint NOT NULL,
    role        text NOT NULL,
    reason      text NOT NULL
);

-- The digest of the functions.sql last applied: the functions are defined there once
-- and applied again whenever it changes.
CREATE TABLE fencegate.schema_functions (
    only_row   boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    digest     text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

REVOKE ALL ON ALL TABLES IN SCHEMA fencegate FROM PUBLIC;
