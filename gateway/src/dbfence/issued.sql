-- Hosted leases, fence resets, and issued tokens only (fencegate schema version 3).
--
-- fencegate.leases holds the leases the gateway hosts (/v1/leases): each acquire mints
-- a token above the lease's last and the fence's highest, and raises the fence to it
-- in the same transaction. fencegate.fence_resets is the audit log of fence resets,
-- which replicas follow by generation. fencegate.issuer_bindings holds the gateway's
-- --issued-by flags, so that the in-database fence refuses, like the HTTP API, a new
-- term's token that the gateway's leases never issued:
--   ZF005 token not issued  DETAIL 'resource=<r> presented=<n> issued=<n>'
-- (Resources bound to a leader_lease table are checked by the gateway's HTTP API only:
-- that table may live in another database.)

CREATE TABLE fencegate.leases (
    resource    text PRIMARY KEY,
    -- NULL once released (or before the first acquire).
    holder      text,
    -- The authenticated identity that took the lease; NULL without authentication.
    identity    text,
    -- The last token minted for the lease; 0 before the first acquire.
    token       bigint NOT NULL DEFAULT 0 CHECK (token >= 0),
    expires_at  timestamptz NOT NULL DEFAULT '-infinity',
    acquired_at timestamptz
);

CREATE TABLE fencegate.fence_resets (
    generation bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT now(),
    resource   text NOT NULL,
    from_token bigint NOT NULL,
    to_token   bigint NOT NULL,
    identity   text,
    reason     text NOT NULL
);

-- The gateway's --issued-by bindings, in order (the first that matches decides);
-- written whole by a gateway when it starts.
CREATE TABLE fencegate.issuer_bindings (
    position integer PRIMARY KEY,
    -- A resource name, or with `prefix` the start of resource names.
    pattern  text NOT NULL,
    prefix   boolean NOT NULL,
    issuer   text NOT NULL CHECK (issuer IN ('gateway', 'leader_lease'))
);

REVOKE ALL ON fencegate.leases, fencegate.fence_resets, fencegate.issuer_bindings FROM PUBLIC;

-- ZF005 unless `token` was issued for `resource`: a resource bound to the gateway's
-- leases accepts no token above its lease's last. Runs only for a new term.
CREATE FUNCTION fencegate.require_issued(resource text, token bigint) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    issuer text;
    issued bigint;
BEGIN
    SELECT b.issuer INTO issuer FROM fencegate.issuer_bindings b
        WHERE CASE WHEN b.prefix THEN starts_with(require_issued.resource, b.pattern)
                   ELSE b.pattern = require_issued.resource END
        ORDER BY b.position LIMIT 1;
    IF issuer IS DISTINCT FROM 'gateway' THEN
        RETURN;
    END IF;
    SELECT coalesce(max(l.token), 0) INTO issued FROM fencegate.leases l
        WHERE l.resource = require_issued.resource;
    IF issued < require_issued.token THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF005',
            MESSAGE = format('fencegate: token %s was not issued for resource "%s": its lease has issued up to %s',
                             require_issued.token, require_issued.resource, issued),
            DETAIL = format('resource=%s presented=%s issued=%s', require_issued.resource, require_issued.token, issued),
            HINT = 'Present the token the gateway''s lease issued for the current term (POST /v1/leases/<resource>/acquire).',
            CONSTRAINT = 'fencegate_fence';
    END IF;
END
$fn$;

-- The check of version 2, now asking require_issued() before a new term raises the fence.
CREATE OR REPLACE FUNCTION fencegate.fence_check(resource text, token bigint, tbl regclass)
    RETURNS bigint
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    highest bigint;
BEGIN
    -- Three rounds at most: a round ends early only when the upsert found a row it did
    -- not raise, which the next round then reads (and holds locked) as it is.
    FOR round IN 1..3 LOOP
        SELECT f.highest INTO highest FROM fencegate.fences f
            WHERE f.resource = fence_check.resource;
        IF highest = fence_check.token THEN
            -- Same term: a share lock. If a raise holds the row, this waits for it and
            -- then reads the raised value.
            SELECT f.highest INTO highest FROM fencegate.fences f
                WHERE f.resource = fence_check.resource FOR SHARE;
        ELSIF highest IS NULL OR highest < fence_check.token THEN
            -- A new term: only if its issuer issued it (version 3); then the exclusive
            -- upsert, which waits for every open transaction that holds the row, old
            -- term or new.
            PERFORM fencegate.require_issued(fence_check.resource, fence_check.token);
            INSERT INTO fencegate.fences AS f (resource, highest)
                VALUES (fence_check.resource, fence_check.token)
                ON CONFLICT ON CONSTRAINT fences_pkey DO UPDATE
                    SET highest = EXCLUDED.highest, updated_at = now()
                    WHERE f.highest < EXCLUDED.highest
                RETURNING f.highest INTO highest;
            CONTINUE WHEN NOT FOUND;
        END IF;
        IF highest = fence_check.token THEN
            RETURN highest;
        ELSIF highest > fence_check.token THEN
            IF tbl IS NULL THEN
                RAISE EXCEPTION USING ERRCODE = 'ZF001',
                    MESSAGE = format('fencegate: stale fencing token %s for resource "%s": its highest accepted token is %s',
                                     fence_check.token, fence_check.resource, highest),
                    DETAIL = format('resource=%s presented=%s highest=%s', fence_check.resource, fence_check.token, highest),
                    HINT = 'This writer''s lease has passed to a newer term: stop the work of this term, and do not retry it with the same token.',
                    CONSTRAINT = 'fencegate_fence';
            ELSE
                RAISE EXCEPTION USING ERRCODE = 'ZF001',
                    MESSAGE = format('fencegate: stale fencing token %s for resource "%s" (table %s): its highest accepted token is %s',
                                     fence_check.token, fence_check.resource, tbl, highest),
                    DETAIL = format('resource=%s presented=%s highest=%s', fence_check.resource, fence_check.token, highest),
                    HINT = 'This writer''s lease has passed to a newer term: stop the work of this term, and do not retry it with the same token.',
                    CONSTRAINT = 'fencegate_fence',
                    SCHEMA = (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = tbl),
                    TABLE = (SELECT c.relname FROM pg_class c WHERE c.oid = tbl);
            END IF;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'fencegate: the fence of resource "%" kept changing while it was checked', fence_check.resource;
END
$fn$;
