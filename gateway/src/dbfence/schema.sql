-- The in-database fence (fencegate schema version 2).
--
-- fencegate.fence(resource, token) checks or raises a resource's row in fencegate.fences
-- (the row the HTTP API uses) and keeps it locked to the end of the transaction.
-- Statement-level triggers on protected tables call the same check with the token the
-- transaction presented, so a stale writer's INSERT, UPDATE, DELETE, TRUNCATE or COPY
-- fails inside its own transaction, whatever shape its SQL takes.
--
-- Lock rule: a token equal to the highest takes the fence row FOR SHARE, so writers of
-- one term run side by side; a higher token takes it exclusively (the upsert), so a new
-- term waits for the open transactions of the old one, and their later statements then
-- find the raised fence and fail. Every function that touches fencegate.fences is
-- SECURITY DEFINER with a fixed search_path: writers get EXECUTE on fencegate.fence()
-- and no privilege on any table of this schema.
--
-- Errors use SQLSTATE class ZF, which no driver or ORM retries by itself:
--   ZF001 stale token      DETAIL 'resource=<r> presented=<n> highest=<n>'
--   ZF002 missing token    DETAIL 'resource=<r>'
--   ZF003 invalid token    DETAIL 'resource=<r> presented=<text>'
--   ZF004 invalid resource name

REVOKE ALL ON SCHEMA fencegate FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA fencegate FROM PUBLIC;
ALTER DEFAULT PRIVILEGES IN SCHEMA fencegate REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;

-- A resource name as the HTTP API accepts it: 1-200 bytes of [A-Za-z0-9._-], not only dots.
CREATE FUNCTION fencegate.valid_resource(resource text) RETURNS boolean
    LANGUAGE sql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT resource ~ '^[A-Za-z0-9._-]{1,200}$' AND resource !~ '^\.+$'
$fn$;

CREATE FUNCTION fencegate.require_resource(resource text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF resource IS NULL OR NOT fencegate.valid_resource(resource) THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF004',
            MESSAGE = format('fencegate: invalid resource name %s', coalesce(quote_literal(left(resource, 200)), 'NULL')),
            HINT = 'A resource name is 1 to 200 characters of A-Z, a-z, 0-9, ".", "_" and "-", and not only dots.';
    END IF;
END
$fn$;

-- The check itself: raises the fence to `token` or checks it, leaving the row locked
-- (FOR SHARE when equal, exclusively when raised); raises ZF001 if the token is stale.
-- `tbl` names the protected table whose trigger asked, for the error (NULL: none).
-- Callers are SECURITY DEFINER functions of this schema.
CREATE FUNCTION fencegate.fence_check(resource text, token bigint, tbl regclass)
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
            -- A new term: the exclusive upsert, which waits for every open transaction
            -- that holds the row, old term or new.
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

-- The token this transaction presented for `resource`: the one a fencegate.fence() call
-- recorded, else the fencegate.token setting; NULL if neither. Not trusted: the caller
-- checks it against the fence like any other token. Without a SET clause, so that it
-- is inlined into its caller, enforce(), whose search_path is fixed; only the schema's
-- owner may call it.
CREATE FUNCTION fencegate.presented(resource text) RETURNS text
    LANGUAGE sql STABLE
AS $fn$
    SELECT coalesce(
        nullif(split_part(split_part(' ' || current_setting('fencegate.fenced', true) || ' ',
                                     ' ' || resource || '=', 2), ' ', 1), ''),
        nullif(current_setting('fencegate.token', true), ''))
$fn$;

-- The token as a number, or ZF002 (none) / ZF003 (not a token).
CREATE FUNCTION fencegate.parse_token(resource text, presented text, tbl regclass) RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF presented IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF002',
            MESSAGE = format('fencegate: no fencing token for resource "%s"%s', resource,
                             CASE WHEN tbl IS NULL THEN '' ELSE format(', which fences table %s', tbl) END),
            DETAIL = format('resource=%s', resource),
            HINT = format('Present the token of your lease first in the transaction: SELECT fencegate.fence(%L, <token>), or set fencegate.token (SET LOCAL, set_config, or options=-c fencegate.token=<token>).', resource),
            CONSTRAINT = 'fencegate_fence';
    END IF;
    IF presented !~ '^[0-9]{1,19}$' OR presented::numeric NOT BETWEEN 1 AND 9223372036854775807 THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF003',
            MESSAGE = format('fencegate: invalid fencing token %s for resource "%s": a token is a decimal integer from 1 to 9223372036854775807',
                             quote_literal(left(presented, 40)), resource),
            DETAIL = format('resource=%s presented=%s', resource, left(presented, 40)),
            HINT = 'Present the token your lease store issued for the current term.',
            CONSTRAINT = 'fencegate_fence';
    END IF;
    RETURN presented::bigint;
END
$fn$;

-- The fence step for writers: checks `token` against `resource`'s fence, raising it if
-- higher, keeps the fence row locked until the transaction ends, and records the token
-- for the triggers of the resource's protected tables. Returns the highest token.
--
-- The common case — the token of the current term — is one statement: the share lock
-- of a row whose highest equals the token. Everything else (a new term, a stale or
-- invalid token, an unknown resource) goes through the checks and fence_check().
-- (PL/pgSQL sets up its expressions again in every transaction; the fast paths keep to
-- few of them, and to no regular expression.)
CREATE FUNCTION fencegate.fence(resource text, token bigint) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    highest bigint;
    fenced text := coalesce(current_setting('fencegate.fenced', true), '');
BEGIN
    SELECT f.highest INTO highest FROM fencegate.fences f
        WHERE f.resource = fence.resource AND f.highest = fence.token FOR SHARE;
    IF NOT FOUND THEN
        PERFORM fencegate.require_resource(fence.resource);
        PERFORM fencegate.parse_token(fence.resource, fence.token::text, NULL);
        highest := fencegate.fence_check(fence.resource, fence.token, NULL);
    END IF;
    -- Newest first: fencegate.presented() reads the first entry of a resource.
    IF strpos(' ' || fenced, ' ' || fence.resource || '=' || fence.token || ' ') <> 1 THEN
        PERFORM set_config('fencegate.fenced', fence.resource || '=' || fence.token || ' ' || fenced, true);
    END IF;
    RETURN highest;
END
$fn$;

-- The trigger of protected tables (argument: the resource). Fails closed: without a
-- token for the resource, the statement is refused.
--
-- Every statement checks again, since any record of an earlier check in this
-- transaction could be forged (custom settings are writable by every role). For a
-- token already checked it costs one index probe: the share lock the transaction
-- holds, taken again. Anything else goes the long way (fence_check).
CREATE FUNCTION fencegate.enforce() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    presented text := fencegate.presented(TG_ARGV[0]);
BEGIN
    -- Compared as text, so that no cast can fail here; a token written otherwise
    -- ('007') is read properly below.
    PERFORM FROM fencegate.fences f
        WHERE f.resource = TG_ARGV[0] AND f.highest::text = presented FOR SHARE;
    IF NOT FOUND THEN
        PERFORM fencegate.fence_check(TG_ARGV[0],
                                      fencegate.parse_token(TG_ARGV[0], presented, TG_RELID),
                                      TG_RELID);
    END IF;
    RETURN NULL;
END
$fn$;

-- A table and every table below it: partitions at any depth, and inheritance children.
CREATE FUNCTION fencegate.family(tbl regclass) RETURNS SETOF regclass
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH RECURSIVE family(rel) AS (
        SELECT tbl::oid
        UNION
        SELECT i.inhrelid FROM pg_inherits i JOIN family ON i.inhparent = family.rel
    )
    SELECT rel::regclass FROM family
$fn$;

-- Protected tables: every table with fencegate's trigger, with its resource.
CREATE VIEW fencegate.protected AS
    SELECT t.tgrelid::regclass AS tbl,
           convert_from(substring(t.tgargs FROM 1 FOR position('\x00'::bytea IN t.tgargs) - 1), 'UTF8') AS resource,
           t.tgenabled AS enabled
    FROM pg_trigger t
    WHERE t.tgname = 'fencegate_fence' AND t.tgfoid = 'fencegate.enforce()'::regprocedure;

-- Installs the fence trigger on `tbl` and every partition and child below it, enabled
-- ALWAYS (so session_replication_role = replica does not skip it). Runs with the
-- caller's privileges: the caller must own the tables. Returns the tables it fenced.
CREATE FUNCTION fencegate.protect(tbl regclass, resource text) RETURNS SETOF regclass
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    rel regclass;
    existing text;
BEGIN
    PERFORM fencegate.require_resource(resource);
    FOR rel IN SELECT fencegate.family(tbl) LOOP
        IF (SELECT c.relkind FROM pg_class c WHERE c.oid = rel) NOT IN ('r', 'p') THEN
            RAISE EXCEPTION 'fencegate: % is not a table; only tables and partitioned tables can be protected', rel;
        END IF;
        SELECT p.resource INTO existing FROM fencegate.protected p WHERE p.tbl = rel;
        IF existing IS NOT NULL AND existing <> resource THEN
            RAISE EXCEPTION 'fencegate: table % is already fenced for resource "%"; unprotect it first', rel, existing;
        END IF;
        IF existing IS NULL THEN
            EXECUTE format('CREATE TRIGGER fencegate_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %s FOR EACH STATEMENT EXECUTE FUNCTION fencegate.enforce(%L)', rel, resource);
        END IF;
        EXECUTE format('ALTER TABLE %s ENABLE ALWAYS TRIGGER fencegate_fence', rel);
        RETURN NEXT rel;
    END LOOP;
END
$fn$;

-- Removes the fence trigger from `tbl` and everything below it; returns those tables.
CREATE FUNCTION fencegate.unprotect(tbl regclass) RETURNS SETOF regclass
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    rel regclass;
BEGIN
    FOR rel IN SELECT p.tbl FROM fencegate.protected p WHERE p.tbl IN (SELECT fencegate.family(unprotect.tbl)) LOOP
        EXECUTE format('DROP TRIGGER fencegate_fence ON %s', rel);
        RETURN NEXT rel;
    END LOOP;
END
$fn$;

-- Partitions and children of protected tables that lack the trigger, with the resource
-- of their nearest protected ancestor.
CREATE FUNCTION fencegate.unprotected_descendants() RETURNS TABLE (tbl regclass, resource text, parent regclass)
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH RECURSIVE below(rel, resource, parent) AS (
        SELECT i.inhrelid, p.resource, p.tbl::oid
            FROM fencegate.protected p JOIN pg_inherits i ON i.inhparent = p.tbl
        UNION
        SELECT i.inhrelid, b.resource, b.parent
            FROM below b JOIN pg_inherits i ON i.inhparent = b.rel
    )
    SELECT b.rel::regclass, b.resource, b.parent::regclass FROM below b
    WHERE NOT EXISTS (SELECT FROM fencegate.protected p WHERE p.tbl = b.rel)
$fn$;

-- The event trigger function that fences new partitions and children of protected
-- tables as they are created or attached. Installed by install_partition_guard().
CREATE FUNCTION fencegate.fence_new_partitions() RETURNS event_trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    missing record;
BEGIN
    FOR missing IN SELECT * FROM fencegate.unprotected_descendants() LOOP
        PERFORM fencegate.protect(missing.tbl, missing.resource);
    END LOOP;
END
$fn$;

-- Installs (or reinstalls) the event trigger that fences new partitions. Creating an
-- event trigger needs a superuser; the function then runs as that superuser, so that
-- it may add the trigger to a partition whoever created it.
CREATE FUNCTION fencegate.install_partition_guard() RETURNS void
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    DROP EVENT TRIGGER IF EXISTS fencegate_partitions;
    EXECUTE format('ALTER FUNCTION fencegate.fence_new_partitions() OWNER TO %I', current_user);
    CREATE EVENT TRIGGER fencegate_partitions ON ddl_command_end
        WHEN TAG IN ('CREATE TABLE', 'ALTER TABLE')
        EXECUTE FUNCTION fencegate.fence_new_partitions();
END
$fn$;

-- What `fencegate check` reports: one row per finding. `problem` rows are holes in the
-- fence; `warning` rows are risks.
CREATE FUNCTION fencegate.audit() RETURNS TABLE (severity text, finding text, object text, detail text)
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH owner AS (
        SELECT n.nspowner AS oid FROM pg_namespace n WHERE n.nspname = 'fencegate'
    ),
    -- Writers: roles that may call fencegate.fence(), other than superusers and the
    -- owner of schema fencegate.
    writer AS (
        SELECT r.oid, r.rolname FROM pg_roles r
        WHERE has_function_privilege(r.oid, 'fencegate.fence(text, bigint)', 'EXECUTE')
          AND NOT r.rolsuper AND r.oid <> (SELECT oid FROM owner) AND r.rolname !~ '^pg_'
    )
    SELECT 'problem', 'unprotected_partition', d.tbl::text,
           format('below %s, which is fenced for resource "%s", but has no fencegate trigger: writes straight to it are not fenced (fencegate protect %s --resource %s)',
                  d.parent, d.resource, d.tbl, d.resource)
        FROM fencegate.unprotected_descendants() d
    UNION ALL
    SELECT 'problem', 'trigger_not_always', p.tbl::text,
           format('the fencegate trigger is %s, not ENABLE ALWAYS (fencegate protect %s --resource %s)',
                  CASE p.enabled WHEN 'D' THEN 'disabled' WHEN 'R' THEN 'enabled for replicas only' ELSE 'enabled for origin sessions only' END,
                  p.tbl, p.resource)
        FROM fencegate.protected p WHERE p.enabled <> 'A'
    UNION ALL
    SELECT 'problem', 'writer_owns_protected_table', p.tbl::text,
           format('writer role %s can act as the owner %s of this table, and so disable or drop its trigger',
                  quote_ident(w.rolname), quote_ident(o.rolname))
        FROM fencegate.protected p
        JOIN pg_class c ON c.oid = p.tbl
        JOIN pg_roles o ON o.oid = c.relowner
        JOIN writer w ON pg_has_role(w.oid, c.relowner, 'MEMBER')
    UNION ALL
    SELECT 'problem', 'role_can_write_fences', quote_ident(r.rolname),
           format('role %s has privileges on %s, or can act as a role that does: it could change fences directly',
                  quote_ident(r.rolname), c.oid::regclass)
        FROM pg_roles r
        CROSS JOIN pg_class c
        WHERE c.relnamespace = 'fencegate'::regnamespace AND c.relkind IN ('r', 'p')
          AND NOT r.rolsuper AND r.rolname !~ '^pg_' AND NOT pg_has_role(r.oid, (SELECT oid FROM owner), 'MEMBER')
          AND has_table_privilege(r.oid, c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')
    UNION ALL
    SELECT 'problem', 'role_can_create_in_fencegate', quote_ident(r.rolname),
           format('role %s may create objects in schema fencegate', quote_ident(r.rolname))
        FROM pg_roles r
        WHERE NOT r.rolsuper AND r.rolname !~ '^pg_' AND NOT pg_has_role(r.oid, (SELECT oid FROM owner), 'MEMBER')
          AND has_schema_privilege(r.oid, 'fencegate', 'CREATE')
    UNION ALL
    SELECT 'problem', 'public_can_execute', p.oid::regprocedure::text,
           'every role may execute this function, which changes fences (REVOKE EXECUTE ... FROM PUBLIC)'
        FROM pg_proc p
        WHERE p.pronamespace = 'fencegate'::regnamespace
          AND (p.prosecdef OR p.proname = 'fence_check')
          AND p.prorettype NOT IN ('trigger'::regtype, 'event_trigger'::regtype)
          AND EXISTS (SELECT FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                      WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')
    UNION ALL
    SELECT 'warning', 'no_partition_guard', 'fencegate_partitions',
           'no event trigger fences new partitions of protected tables as they are created: run SELECT fencegate.install_partition_guard() as a superuser, or run fencegate check after adding partitions'
        WHERE NOT EXISTS (SELECT FROM pg_event_trigger e WHERE e.evtname = 'fencegate_partitions' AND e.evtenabled <> 'D')
$fn$;

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA fencegate FROM PUBLIC;
-- What a table's owner needs to fence it and to audit: harmless to every role, since
-- protect() and unprotect() run with the caller's privileges, only a table's owner may
-- change its triggers, and a trigger function cannot be called but as a trigger
-- (creating a trigger needs EXECUTE on it). Roles still need USAGE on the schema.
GRANT EXECUTE ON FUNCTION fencegate.valid_resource(text), fencegate.require_resource(text),
    fencegate.family(regclass), fencegate.unprotected_descendants(),
    fencegate.protect(regclass, text), fencegate.unprotect(regclass), fencegate.audit(),
    fencegate.enforce()
    TO PUBLIC;
GRANT SELECT ON fencegate.protected TO PUBLIC;

DO $do$
BEGIN
    IF (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user) THEN
        PERFORM fencegate.install_partition_guard();
    END IF;
END
$do$;
