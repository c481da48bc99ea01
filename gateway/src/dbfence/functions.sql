-- The functions of schema fencegate: the one home of every function body. The
-- gateway applies this file after the migrations whenever its digest changes
-- (CREATE OR REPLACE keeps each function's identity, its grants and the triggers that
-- call it).
--
-- The in-database fence. fencegate.fence(resource, token) checks or raises a
-- resource's row in fencegate.fences (the row the HTTP API uses) and keeps it locked
-- to the end of the transaction. Statement-level triggers on protected tables make
-- the same check with the token the transaction presented, so a stale writer's
-- INSERT, UPDATE, DELETE, TRUNCATE or COPY fails inside its own transaction, whatever
-- shape its SQL takes.
--
-- Authority. A role presents or raises only the fences of resources it holds: granted
-- to it, or to a role it can act as, in fencegate.authority (`fencegate grant`); the
-- schema's owner and superusers hold every resource. A table's resource comes from
-- fencegate.protected_tables, which only protect() writes, never from the trigger's
-- arguments. A /v1/sql transaction holds only the resource of its fence step, which
-- only the gateway can take (fencegate.sql_fence and its key).
--
-- Lock rule: a token equal to the highest takes the fence row FOR SHARE, so writers of
-- one term run side by side; a higher token takes it exclusively (the upsert), so a new
-- term waits for the open transactions of the old one, and their later statements then
-- find the raised fence and fail. Every session that holds a fence row for its term
-- also holds a shared advisory lock on the row's lock_key (hold_key), so that a new term
-- that waited --term-takeover-timeout can find those sessions and end them. The fence
-- never takes a key exclusively: a session that holds one so, or waits to, would keep
-- writers from marking themselves, and is ended (clear_key).
--
-- Raises come from the holder's own statements only: code that runs inside a trigger
-- (another role's trigger on a table the holder writes, or on a fenced table) may
-- present the fence's token, never raise it (ZF006).
--
-- Errors use SQLSTATE class ZF, which no driver or ORM retries by itself:
--   ZF001 stale token       DETAIL 'resource=<r> presented=<n> highest=<n> proof=<hex>'
--   ZF002 missing token     DETAIL 'resource=<r>'
--   ZF003 invalid token     DETAIL 'resource=<r> presented=<text>'
--   ZF004 invalid resource name
--   ZF005 token not issued  DETAIL 'resource=<r> presented=<n> issued=<n> proof=<hex>'
--   ZF006 not authorized    DETAIL 'resource=<r> role=<role>'
--   ZF007 trigger on a table that protect did not fence   DETAIL 'table=<t>'
--   ZF008 a leader_lease change its guard refuses         DETAIL 'resource=<r>'
-- The proof is an HMAC of the DETAIL before it, under a key only the gateway and these
-- functions read: a rejection that anyone can RAISE is told apart from the fence's own.

-- Bodies of earlier versions with other arguments or results.
DROP FUNCTION IF EXISTS fencegate.fence_check(text, bigint, regclass);
DROP FUNCTION IF EXISTS fencegate.fence_check(text, bigint, regclass, text);
DROP FUNCTION IF EXISTS fencegate.holds(name, text);

-- A resource name as the HTTP API accepts it: 1-200 bytes of [A-Za-z0-9._-], not only dots.
CREATE OR REPLACE FUNCTION fencegate.valid_resource(resource text) RETURNS boolean
    LANGUAGE sql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT resource ~ '^[A-Za-z0-9._-]{1,200}$' AND resource !~ '^\.+$'
$fn$;

CREATE OR REPLACE FUNCTION fencegate.require_resource(resource text) RETURNS void
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

-- The role a SECURITY DEFINER function of this schema was called as: SET ROLE's role,
-- else the session's. (Inside such a function current_user is its owner; the setting
-- `role` is not changed by entering it.) Without a SET clause, so that it is inlined.
CREATE OR REPLACE FUNCTION fencegate.caller() RETURNS name
    LANGUAGE sql STABLE
AS $fn$
    SELECT CASE pg_catalog.current_setting('role')
               WHEN 'none' THEN SESSION_USER
               ELSE pg_catalog.current_setting('role')::name END
$fn$;

-- Whether role `who` holds `resource`: a grant of fencegate.authority to a role it can
-- act as, or it can act as the schema's owner (as every superuser can). A set-returning
-- SQL function of one SELECT, so that the planner inlines it into the query that uses
-- it (`FROM fencegate.holding(...) h WHERE h.held`), and its plan is cached with that
-- query's: a scalar SQL function with subqueries would be planned again at every call.
CREATE OR REPLACE FUNCTION fencegate.holding(who name, resource text) RETURNS TABLE (held boolean)
    LANGUAGE sql STABLE
AS $fn$
    SELECT EXISTS (SELECT FROM fencegate.authority a
                   WHERE a.pattern = holding.resource AND NOT a.prefix
                     AND pg_catalog.pg_has_role(holding.who, a.role, 'MEMBER'))
        OR EXISTS (SELECT FROM fencegate.authority a
                   WHERE a.prefix AND pg_catalog.starts_with(holding.resource, a.pattern)
                     AND pg_catalog.pg_has_role(holding.who, a.role, 'MEMBER'))
        OR pg_catalog.pg_has_role(holding.who,
               (SELECT n.nspowner FROM pg_catalog.pg_namespace n WHERE n.nspname = 'fencegate'),
               'MEMBER')
$fn$;

-- ZF006 unless the caller holds `resource`.
CREATE OR REPLACE FUNCTION fencegate.require_holds(resource text) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    who name := fencegate.caller();
BEGIN
    IF NOT (SELECT h.held FROM fencegate.holding(who, resource) h) THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF006',
            MESSAGE = format('fencegate: role %s may not present or raise the fence of resource "%s"', quote_ident(who), resource),
            DETAIL = format('resource=%s role=%s', resource, who),
            HINT = format('The fence of a resource is presented and raised only by roles granted it: fencegate grant %s --resource %s', quote_ident(who), resource),
            CONSTRAINT = 'fencegate_fence';
    END IF;
END
$fn$;

-- The HMAC-SHA256 of `detail` under the key `proof`, in hex.
CREATE OR REPLACE FUNCTION fencegate.proof(detail text) RETURNS text
    LANGUAGE sql STABLE
AS $fn$
    SELECT pg_catalog.encode(pg_catalog.sha256(k.outer_pad
               || pg_catalog.sha256(k.inner_pad || pg_catalog.convert_to(detail, 'UTF8'))), 'hex')
    FROM fencegate.keys k WHERE k.name = 'proof'
$fn$;

-- ZF001: `token` is below `highest`, the resource's highest accepted token. `tbl`
-- names the protected table whose trigger asked (NULL: none).
CREATE OR REPLACE FUNCTION fencegate.refuse_stale(resource text, token bigint, highest bigint, tbl regclass)
    RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    detail text := format('resource=%s presented=%s highest=%s', resource, token, highest);
    hint text := 'This writer''s lease has passed to a newer term: stop the work of this term, and do not retry it with the same token.';
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF001',
            MESSAGE = format('fencegate: stale fencing token %s for resource "%s": its highest accepted token is %s',
                             token, resource, highest),
            DETAIL = detail || ' proof=' || fencegate.proof(detail),
            HINT = hint,
            CONSTRAINT = 'fencegate_fence';
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'ZF001',
        MESSAGE = format('fencegate: stale fencing token %s for resource "%s" (table %s): its highest accepted token is %s',
                         token, resource, tbl, highest),
        DETAIL = detail || ' proof=' || fencegate.proof(detail),
        HINT = hint,
        CONSTRAINT = 'fencegate_fence',
        SCHEMA = (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = tbl),
        TABLE = (SELECT c.relname FROM pg_class c WHERE c.oid = tbl);
END
$fn$;

-- ZF005 unless `token` was issued for `resource`: a resource bound to the gateway's
-- leases accepts no token above its lease's last. Asked only for a new term.
CREATE OR REPLACE FUNCTION fencegate.require_issued(resource text, token bigint) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    issuer text;
    issued bigint;
    detail text;
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
        detail := format('resource=%s presented=%s issued=%s', require_issued.resource, require_issued.token, issued);
        RAISE EXCEPTION USING ERRCODE = 'ZF005',
            MESSAGE = format('fencegate: token %s was not issued for resource "%s": its lease has issued up to %s',
                             require_issued.token, require_issued.resource, issued),
            DETAIL = detail || ' proof=' || fencegate.proof(detail),
            HINT = 'Present the token the gateway''s lease issued for the current term (POST /v1/leases/<resource>/acquire).',
            CONSTRAINT = 'fencegate_fence';
    END IF;
END
$fn$;

-- The token as a number, or ZF002 (none) / ZF003 (not a token).
CREATE OR REPLACE FUNCTION fencegate.parse_token(resource text, presented text, tbl regclass) RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF presented IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF002',
            MESSAGE = format('fencegate: no fencing token for resource "%s"%s', resource,
                             CASE WHEN tbl IS NULL THEN '' ELSE format(', which fences table %s', tbl) END),
            DETAIL = format('resource=%s', resource),
            HINT = format('Present the token of your lease first in the transaction: SELECT fencegate.fence(%L, <token>), or set fencegate.token (SET LOCAL, set_config, or options=-c fencegate.token=%s=<token>).', resource, resource),
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

-- The token the setting fencegate.token presents for `resource`: `orders=42,billing=7`
-- names each resource; a bare `42` is for whichever resource the role holds. Inlined.
CREATE OR REPLACE FUNCTION fencegate.setting_token(resource text, setting text) RETURNS text
    LANGUAGE sql IMMUTABLE
AS $fn$
    SELECT CASE WHEN pg_catalog.strpos(setting, '=') = 0 THEN nullif(pg_catalog.btrim(setting), '')
                ELSE nullif(pg_catalog.split_part(pg_catalog.split_part(
                         ',' || pg_catalog.replace(setting, ' ', '') || ',', ',' || resource || '=', 2), ',', 1), '')
           END
$fn$;

-- The token this transaction presented for `resource`: the one a fencegate.fence() call
-- recorded, else the fencegate.token setting; NULL if neither. Not trusted: the caller
-- checks it against the fence and the role's authority like any other token. Inlined.
CREATE OR REPLACE FUNCTION fencegate.presented(resource text) RETURNS text
    LANGUAGE sql STABLE
AS $fn$
    SELECT coalesce(
        nullif(pg_catalog.split_part(pg_catalog.split_part(
                   ' ' || pg_catalog.current_setting('fencegate.fenced', true) || ' ',
                   ' ' || resource || '=', 2), ' ', 1), ''),
        fencegate.setting_token(resource, pg_catalog.current_setting('fencegate.token', true)))
$fn$;

-- Ends the sessions that hold `resource`'s fence row for a term older than `token`
-- (they hold its advisory key), if the fence is still below `token`: what a new term
-- does after waiting --term-takeover-timeout for them. The gateway's own sessions and
-- superusers' are left alone. Ending a session rolls its transaction back; nothing of
-- an older term commits after a newer one. Needs the schema's owner to be a member of
-- pg_signal_backend (fencegate check says so). Returns how many it ended.
CREATE OR REPLACE FUNCTION fencegate.end_older_terms(resource text, token bigint, ended_by text)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    highest bigint;
    key bigint;
    owner oid := (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = 'fencegate');
    holder record;
    ended integer := 0;
BEGIN
    SELECT f.highest, f.lock_key INTO highest, key FROM fencegate.fences f
        WHERE f.resource = end_older_terms.resource;
    IF highest IS NULL OR highest >= end_older_terms.token THEN
        RETURN 0;
    END IF;
    FOR holder IN
        SELECT DISTINCT l.pid, a.usename::text AS role
        FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.objsubid = 1
          AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
          AND l.classid = ((key >> 32) & 4294967295)::oid AND l.objid = (key & 4294967295)::oid
          AND l.pid <> pg_backend_pid()
          AND NOT pg_has_role(a.usesysid, owner, 'MEMBER')
    LOOP
        BEGIN
            IF pg_terminate_backend(holder.pid) THEN
                ended := ended + 1;
                INSERT INTO fencegate.takeovers (resource, token, pid, role, ended_by)
                    VALUES (end_older_terms.resource, end_older_terms.token, holder.pid, holder.role, ended_by);
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE WARNING 'fencegate: could not end session % of role %, which holds an older term of resource "%": grant pg_signal_backend to the owner of schema fencegate',
                holder.pid, holder.role, end_older_terms.resource;
        END;
    END LOOP;
    DELETE FROM fencegate.takeovers t WHERE t.at < now() - interval '7 days';
    RETURN ended;
END
$fn$;

-- Ends the sessions that hold, or wait to hold, `resource`'s advisory key `key`
-- exclusively: the fence never takes it so, and such a session keeps the writers of
-- the current term from marking themselves (hold_key). Then takes the key shared,
-- waiting a moment for the ended sessions to let it go. Always true: a writer that
-- cannot mark itself still writes (a WARNING says so), only unseen by a takeover.
-- Each ended session is recorded as a takeover by `token`, ended_by `key_holder`.
CREATE OR REPLACE FUNCTION fencegate.clear_key(resource text, token bigint, key bigint)
    RETURNS boolean
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    owner oid := (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = 'fencegate');
    holder record;
    before text := current_setting('lock_timeout');
BEGIN
    FOR holder IN
        SELECT DISTINCT l.pid, a.usename::text AS role
        FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.mode = 'ExclusiveLock'
          AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
          AND l.classid = ((key >> 32) & 4294967295)::oid AND l.objid = (key & 4294967295)::oid
          AND l.pid <> pg_backend_pid()
          AND NOT pg_has_role(a.usesysid, owner, 'MEMBER')
    LOOP
        BEGIN
            IF pg_terminate_backend(holder.pid) THEN
                RAISE LOG 'fencegate: ended session % of role %, which held the advisory key of resource "%" exclusively',
                    holder.pid, holder.role, clear_key.resource;
                INSERT INTO fencegate.takeovers (resource, token, pid, role, ended_by)
                    VALUES (clear_key.resource, clear_key.token, holder.pid, holder.role, 'key_holder');
            END IF;
        EXCEPTION WHEN insufficient_privilege THEN
            NULL;
        END;
    END LOOP;
    BEGIN
        PERFORM set_config('lock_timeout', '1s', true);
        PERFORM pg_advisory_xact_lock_shared(key);
        PERFORM set_config('lock_timeout', before, true);
    EXCEPTION WHEN lock_not_available THEN
        RAISE WARNING 'fencegate: another session holds the advisory key of resource "%" exclusively; this transaction writes unseen by a new term''s takeover', clear_key.resource
            USING HINT = 'Grant pg_signal_backend to the owner of schema fencegate, so that the fence can end such sessions.';
    END;
    RETURN true;
END
$fn$;

-- Marks this transaction as a holder of `resource`'s fence for `token`: the shared
-- advisory key, taken at once, or after clear_key ended whoever held it exclusively.
-- Always true; a SQL function, so that the fast paths inline it.
CREATE OR REPLACE FUNCTION fencegate.hold_key(resource text, token bigint, key bigint)
    RETURNS boolean
    LANGUAGE sql
AS $fn$
    SELECT pg_catalog.pg_try_advisory_xact_lock_shared(key) OR fencegate.clear_key(resource, token, key)
$fn$;

-- ZF006 for a raise of `resource`'s fence from code that is not the holder's own
-- statement: anything run by a trigger deeper than `depth` (0 for fence(), 1 for the
-- trigger of a fenced table) — another role's trigger on a table the holder writes, a
-- trigger on a fenced table that presents a token of its own choosing.
CREATE OR REPLACE FUNCTION fencegate.require_own_statement(resource text, depth integer)
    RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    who name;
BEGIN
    IF pg_trigger_depth() > depth THEN
        who := fencegate.caller();
        RAISE EXCEPTION USING ERRCODE = 'ZF006',
            MESSAGE = format('fencegate: the fence of resource "%s" is raised only by the holder''s own statements, not from inside a trigger', resource),
            DETAIL = format('resource=%s role=%s', resource, who),
            HINT = 'Raise the fence with SELECT fencegate.fence(...) at the start of the transaction; code that triggers run may present the current token, not raise it.',
            CONSTRAINT = 'fencegate_fence';
    END IF;
END
$fn$;

-- Raises `resource`'s fence to `token` (created if missing), recording `path`, if
-- `token` is above it; returns the new highest and the row's lock key, or NULLs if the
-- fence was already at or above `token`. Waits at most the term takeover timeout for
-- the sessions of the older term, then ends them (end_older_terms) and waits again.
CREATE OR REPLACE FUNCTION fencegate.raise_fence(resource text, token bigint, path text,
                                                 OUT highest bigint, OUT lock_key bigint)
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    wait text := (SELECT s.value FROM fencegate.settings s WHERE s.name = 'term_takeover_timeout_ms');
    before text := current_setting('lock_timeout');
BEGIN
    IF wait IS NOT NULL AND wait <> '0'
       AND (before::interval = interval '0' OR before::interval > (wait || 'ms')::interval) THEN
        BEGIN
            PERFORM set_config('lock_timeout', wait || 'ms', true);
            INSERT INTO fencegate.fences AS f (resource, highest, raised_by)
                VALUES (raise_fence.resource, raise_fence.token, raise_fence.path)
                ON CONFLICT ON CONSTRAINT fences_pkey DO UPDATE
                    SET highest = EXCLUDED.highest, raised_by = EXCLUDED.raised_by, updated_at = now()
                    WHERE f.highest < EXCLUDED.highest
                RETURNING f.highest, f.lock_key INTO raise_fence.highest, raise_fence.lock_key;
            PERFORM set_config('lock_timeout', before, true);
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            PERFORM fencegate.end_older_terms(raise_fence.resource, raise_fence.token, 'fence');
        END;
    END IF;
    INSERT INTO fencegate.fences AS f (resource, highest, raised_by)
        VALUES (raise_fence.resource, raise_fence.token, raise_fence.path)
        ON CONFLICT ON CONSTRAINT fences_pkey DO UPDATE
            SET highest = EXCLUDED.highest, raised_by = EXCLUDED.raised_by, updated_at = now()
            WHERE f.highest < EXCLUDED.highest
        RETURNING f.highest, f.lock_key INTO raise_fence.highest, raise_fence.lock_key;
END
$fn$;

-- The check itself: raises the fence to `token` or checks it, leaving the row locked
-- (FOR SHARE when equal, exclusively when raised) and the row's advisory key held;
-- ZF001 if the token is stale, ZF005 if its issuer never issued it, ZF006 for a raise
-- from a trigger deeper than `depth` (require_own_statement). `tbl` names the
-- protected table whose trigger asked (NULL: none), `path` the path that raises.
-- Callers are SECURITY DEFINER functions of this schema that checked the authority.
CREATE OR REPLACE FUNCTION fencegate.fence_check(resource text, token bigint, tbl regclass, path text,
                                                 depth integer)
    RETURNS bigint
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    highest bigint;
    key bigint;
BEGIN
    -- Three rounds at most: a round ends early only when the upsert found a row it did
    -- not raise, which the next round then reads (and holds locked) as it is.
    FOR round IN 1..3 LOOP
        SELECT f.highest INTO highest FROM fencegate.fences f
            WHERE f.resource = fence_check.resource;
        IF highest = fence_check.token THEN
            -- Same term: a share lock. If a raise holds the row, this waits for it and
            -- then reads the raised value.
            SELECT f.highest, f.lock_key INTO highest, key FROM fencegate.fences f
                WHERE f.resource = fence_check.resource FOR SHARE;
        ELSIF highest IS NULL OR highest < fence_check.token THEN
            -- A new term: only from the holder's own statement, only if its issuer
            -- issued it; then the exclusive upsert, which waits for every open
            -- transaction that holds the row, old term or new.
            PERFORM fencegate.require_own_statement(fence_check.resource, fence_check.depth);
            PERFORM fencegate.require_issued(fence_check.resource, fence_check.token);
            SELECT r.highest, r.lock_key INTO highest, key
                FROM fencegate.raise_fence(fence_check.resource, fence_check.token, fence_check.path) r;
            CONTINUE WHEN highest IS NULL;
        END IF;
        IF highest = fence_check.token THEN
            PERFORM fencegate.hold_key(fence_check.resource, highest, key);
            RETURN highest;
        ELSIF highest > fence_check.token THEN
            PERFORM fencegate.refuse_stale(fence_check.resource, fence_check.token, highest, tbl);
        END IF;
    END LOOP;
    RAISE EXCEPTION 'fencegate: the fence of resource "%" kept changing while it was checked', fence_check.resource;
END
$fn$;

-- The fence step for writers: checks `token` against `resource`'s fence, raising it if
-- higher, keeps the fence row locked until the transaction ends, and records the token
-- for the triggers of the resource's protected tables. Returns the highest token. The
-- caller must hold the resource (ZF006).
--
-- The common case — the current term's token, presented by a role that holds the
-- resource — is one statement. Everything else (a new term, a stale or invalid token,
-- an unknown resource, no authority) goes through the checks and fence_check().
-- (PL/pgSQL sets up its expressions again in every transaction; the fast paths keep to
-- few of them, and to no regular expression.)
CREATE OR REPLACE FUNCTION fencegate.fence(resource text, token bigint) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    highest bigint;
    key bigint;
    marked boolean;
    fenced text := coalesce(current_setting('fencegate.fenced', true), '');
BEGIN
    SELECT f.highest, f.lock_key INTO highest, key FROM fencegate.fences f
        WHERE f.resource = fence.resource AND f.highest = fence.token
          AND EXISTS (SELECT FROM fencegate.holding(fencegate.caller(), fence.resource) h WHERE h.held)
        FOR SHARE OF f;
    IF FOUND THEN
        -- After the row is found and locked, for its key alone (see enforce()).
        marked := fencegate.hold_key(fence.resource, highest, key);
    ELSE
        PERFORM fencegate.require_resource(fence.resource);
        PERFORM fencegate.require_holds(fence.resource);
        PERFORM fencegate.parse_token(fence.resource, fence.token::text, NULL);
        highest := fencegate.fence_check(fence.resource, fence.token, NULL, 'door', 0);
    END IF;
    -- Newest first: fencegate.presented() reads the first entry of a resource.
    IF strpos(' ' || fenced, ' ' || fence.resource || '=' || fence.token || ' ') <> 1 THEN
        PERFORM set_config('fencegate.fenced', fence.resource || '=' || fence.token || ' ' || fenced, true);
    END IF;
    RETURN highest;
END
$fn$;

-- The fence step of a /v1/sql transaction, run by the gateway only (`key` is the
-- gateway's key `sql`): fence_check() for the gateway's SQL login, which holds no
-- resource itself, and the grant of this one resource and token to the rest of the
-- transaction (fencegate.sql_grants), which the triggers of its tables honour.
CREATE OR REPLACE FUNCTION fencegate.sql_fence(resource text, token bigint, key bytea) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    highest bigint;
    row_key bigint;
    marked boolean;
BEGIN
    IF NOT EXISTS (SELECT FROM fencegate.keys k WHERE k.name = 'sql' AND k.key = sql_fence.key) THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF006',
            MESSAGE = 'fencegate: only the gateway takes the fence step of a /v1/sql transaction',
            DETAIL = format('resource=%s role=%s', sql_fence.resource, fencegate.caller()),
            CONSTRAINT = 'fencegate_fence';
    END IF;
    SELECT f.highest, f.lock_key INTO highest, row_key FROM fencegate.fences f
        WHERE f.resource = sql_fence.resource AND f.highest = sql_fence.token
        FOR SHARE;
    IF FOUND THEN
        marked := fencegate.hold_key(sql_fence.resource, highest, row_key);
    ELSE
        PERFORM fencegate.require_resource(sql_fence.resource);
        PERFORM fencegate.parse_token(sql_fence.resource, sql_fence.token::text, NULL);
        highest := fencegate.fence_check(sql_fence.resource, sql_fence.token, NULL, 'sql', 0);
    END IF;
    INSERT INTO fencegate.sql_grants AS g (pid, xact, resource, token)
        VALUES (pg_backend_pid(), pg_current_xact_id(), sql_fence.resource, sql_fence.token)
        ON CONFLICT (pid) DO UPDATE
            SET xact = EXCLUDED.xact, resource = EXCLUDED.resource, token = EXCLUDED.token;
    -- The triggers' hint that this transaction's authority is its grant (see enforce()).
    PERFORM set_config('fencegate.sql_step', 'on', true);
    RETURN highest;
END
$fn$;

-- The idempotency record of a keyed /v1/sql transaction, claimed and stored inside that
-- transaction (the SQL login may not touch fencegate.idempotency): only the gateway can
-- (the key is the schema's). The claim waits at most in_flight_ms for an uncommitted
-- claim of the same key (SQLSTATE 55P03 past it). claimed is true for a new claim;
-- false with the earlier attempt's record otherwise.
CREATE OR REPLACE FUNCTION fencegate.sql_idempotency_claim(identity text, idem_key text,
        fingerprint bytea, ttl_ms bigint, in_flight_ms bigint, key bytea)
    RETURNS TABLE (claimed boolean, found_fingerprint bytea, status smallint, headers text, body bytea)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    waited text := current_setting('lock_timeout');
    taken bigint;
BEGIN
    IF NOT EXISTS (SELECT FROM fencegate.keys k WHERE k.name = 'sql' AND k.key = sql_idempotency_claim.key) THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF006',
            MESSAGE = 'fencegate: only the gateway keeps the answers of /v1/sql transactions';
    END IF;
    PERFORM set_config('lock_timeout', in_flight_ms::text, true);
    INSERT INTO fencegate.idempotency AS i (identity, key, fingerprint, expires_at)
        VALUES (sql_idempotency_claim.identity, sql_idempotency_claim.idem_key,
                sql_idempotency_claim.fingerprint,
                clock_timestamp() + sql_idempotency_claim.ttl_ms * interval '1 millisecond')
        ON CONFLICT ON CONSTRAINT idempotency_pkey DO UPDATE SET
            fingerprint = EXCLUDED.fingerprint, expires_at = EXCLUDED.expires_at,
            status = NULL, headers = NULL, body = NULL, created_at = now()
            WHERE i.expires_at <= clock_timestamp();
    GET DIAGNOSTICS taken = ROW_COUNT;
    PERFORM set_config('lock_timeout', waited, true);
    IF taken > 0 THEN
        RETURN QUERY SELECT true, NULL::bytea, NULL::smallint, NULL::text, NULL::bytea;
        RETURN;
    END IF;
    RETURN QUERY SELECT false, i.fingerprint, i.status, i.headers, i.body
        FROM fencegate.idempotency i
        WHERE i.identity = sql_idempotency_claim.identity AND i.key = sql_idempotency_claim.idem_key;
END
$fn$;

-- Stores the answer of a keyed /v1/sql transaction under the key it claimed.
CREATE OR REPLACE FUNCTION fencegate.sql_idempotency_record(identity text, idem_key text,
        status smallint, headers text, body bytea, key bytea) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF NOT EXISTS (SELECT FROM fencegate.keys k WHERE k.name = 'sql' AND k.key = sql_idempotency_record.key) THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF006',
            MESSAGE = 'fencegate: only the gateway keeps the answers of /v1/sql transactions';
    END IF;
    UPDATE fencegate.idempotency i
        SET status = sql_idempotency_record.status, headers = sql_idempotency_record.headers,
            body = sql_idempotency_record.body
        WHERE i.identity = sql_idempotency_record.identity AND i.key = sql_idempotency_record.idem_key;
END
$fn$;

-- The trigger's long way: the table's registration, the transaction's /v1/sql grant
-- or the caller's authority, the presented token, and fence_check().
CREATE OR REPLACE FUNCTION fencegate.enforce_slow(tbl regclass) RETURNS void
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    resource text := (SELECT p.resource FROM fencegate.protected_tables p WHERE p.tbl = enforce_slow.tbl);
    granted_resource text;
    granted_token bigint;
    who name;
BEGIN
    IF resource IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF007',
            MESSAGE = format('fencegate: table %s is not fenced, but a trigger on it calls the fence', tbl),
            DETAIL = format('table=%s', tbl),
            HINT = 'Only fencegate protect fences a table (and records its resource); drop this trigger.',
            CONSTRAINT = 'fencegate_fence';
    END IF;
    SELECT g.resource, g.token INTO granted_resource, granted_token FROM fencegate.sql_grants g
        WHERE g.pid = pg_backend_pid() AND g.xact = pg_current_xact_id_if_assigned();
    IF FOUND THEN
        -- A /v1/sql transaction: the resource of its fence step is all it holds.
        IF granted_resource <> resource THEN
            who := fencegate.caller();
            RAISE EXCEPTION USING ERRCODE = 'ZF006',
                MESSAGE = format('fencegate: table %s is fenced for resource "%s", not for "%s", the resource of this transaction', tbl, resource, granted_resource),
                DETAIL = format('resource=%s role=%s', resource, who),
                CONSTRAINT = 'fencegate_fence';
        END IF;
        PERFORM fencegate.fence_check(resource, granted_token, tbl, 'sql', 1);
        RETURN;
    END IF;
    PERFORM fencegate.require_holds(resource);
    PERFORM fencegate.fence_check(resource,
                                  fencegate.parse_token(resource, fencegate.presented(resource), tbl),
                                  tbl, 'door', 1);
END
$fn$;

-- The trigger of protected tables: statement-level on every fenced table, and
-- row-level on fenced tables that a write through an unfenced ancestor could reach.
-- Fails closed: without a token for the table's resource, or without authority over
-- it, the statement is refused.
--
-- Every statement checks again, since any record of an earlier check in this
-- transaction could be forged (custom settings are writable by every role). The common
-- case is one statement: the registration, the authority (or the transaction's /v1/sql
-- grant), and the share lock of a fence row whose highest is the presented token; then
-- the takeover mark of that row alone.
--
-- The table's resource is a scalar subquery, so that the fence row is found by its key
-- in any plan the session keeps. Joined instead, a generic plan over small tables
-- (statistics as autovacuum gathers them) hash-joins a scan of every fence: each
-- condition on the fences' rows — a takeover mark in the WHERE clause, say — is then
-- evaluated for every resource, not for this table's. (The mark is taken after the
-- row is found for that reason: a writer holds its own resource's key and no other, so
-- that another resource's takeover never ends it.)
CREATE OR REPLACE FUNCTION fencegate.enforce() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    fence_resource text;
    fence_highest bigint;
    fence_key bigint;
    marked boolean;
BEGIN
    -- Compared as text, so that no cast can fail here; a token written otherwise
    -- ('007') is read properly by the long way.
    -- A /v1/sql transaction says so in fencegate.sql_step, set by its fence step: a hint
    -- only, which a writer can set or reset. Set by anyone else, the grant is not found
    -- and the long way decides; reset in a /v1/sql transaction, the SQL login holds no
    -- resource of its own (the gateway refuses to start otherwise, and fencegate check
    -- reports it), and the long way, which reads the grant first, decides.
    IF current_setting('fencegate.sql_step', true) = 'on' THEN
        SELECT f.resource, f.highest, f.lock_key INTO fence_resource, fence_highest, fence_key
            FROM fencegate.fences f
            WHERE f.resource = (SELECT p.resource FROM fencegate.protected_tables p WHERE p.tbl = TG_RELID)
              AND EXISTS (SELECT FROM fencegate.sql_grants g
                          WHERE g.pid = pg_backend_pid() AND g.xact = pg_current_xact_id_if_assigned()
                            AND g.resource = f.resource AND g.token = f.highest)
            FOR SHARE OF f;
    ELSE
        SELECT f.resource, f.highest, f.lock_key INTO fence_resource, fence_highest, fence_key
            FROM fencegate.fences f
            WHERE f.resource = (SELECT p.resource FROM fencegate.protected_tables p WHERE p.tbl = TG_RELID)
              AND f.highest::text = fencegate.presented(f.resource)
              AND EXISTS (SELECT FROM fencegate.holding(fencegate.caller(), f.resource) h WHERE h.held)
            FOR SHARE OF f;
    END IF;
    IF FOUND THEN
        marked := fencegate.hold_key(fence_resource, fence_highest, fence_key);
    ELSE
        PERFORM fencegate.enforce_slow(TG_RELID);
    END IF;
    IF TG_LEVEL = 'ROW' THEN
        IF TG_OP = 'DELETE' THEN
            RETURN OLD;
        END IF;
        RETURN NEW;
    END IF;
    RETURN NULL;
END
$fn$;

-- A table and every table below it: partitions at any depth, and inheritance children.
CREATE OR REPLACE FUNCTION fencegate.family(tbl regclass) RETURNS SETOF regclass
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

-- A table and every table above it: the tables a write through which reaches it.
CREATE OR REPLACE FUNCTION fencegate.ancestors(tbl regclass) RETURNS SETOF regclass
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH RECURSIVE up(rel) AS (
        SELECT tbl::oid
        UNION
        SELECT i.inhparent FROM pg_inherits i JOIN up ON i.inhrelid = up.rel
    )
    SELECT rel::regclass FROM up
$fn$;

-- The state of the fence's own trigger on `rel` — the statement trigger
-- fencegate_fence, or with `row_level` the row-level fencegate_fence_row: its
-- tgenabled; 'X' if the trigger of that name is not the fence's own (another function,
-- other events or timing, a WHEN condition, columns or arguments: a decoy); NULL if
-- there is none.
CREATE OR REPLACE FUNCTION fencegate.fence_trigger(rel regclass, row_level boolean) RETURNS "char"
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT CASE WHEN t.tgfoid = 'fencegate.enforce()'::regprocedure
                     -- BEFORE, FOR EACH ROW: INSERT, UPDATE, DELETE; FOR EACH STATEMENT: also TRUNCATE.
                     AND t.tgtype = CASE WHEN row_level THEN 31 ELSE 62 END
                     AND t.tgqual IS NULL AND t.tgnargs = 0 AND t.tgattr = ''::int2vector
                THEN t.tgenabled ELSE 'X' END
    FROM pg_trigger t
    WHERE t.tgrelid = rel
      AND t.tgname = CASE WHEN row_level THEN 'fencegate_fence_row' ELSE 'fencegate_fence' END
$fn$;

-- Protected tables: every registered table, with its resource and the state of its
-- statement trigger (fence_trigger: NULL missing, 'X' a decoy of its name).
CREATE OR REPLACE VIEW fencegate.protected AS
    SELECT p.tbl, p.resource COLLATE "C" AS resource, fencegate.fence_trigger(p.tbl, false) AS enabled
    FROM fencegate.protected_tables p
    JOIN pg_class c ON c.oid = p.tbl;

-- Records `rel` as fenced for `resource`, for a caller that can act as its owner.
CREATE OR REPLACE FUNCTION fencegate.register_table(rel regclass, resource text) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    existing text;
BEGIN
    PERFORM fencegate.require_resource(resource);
    IF NOT pg_has_role(fencegate.caller(), (SELECT c.relowner FROM pg_class c WHERE c.oid = rel), 'MEMBER') THEN
        RAISE EXCEPTION USING ERRCODE = '42501',
            MESSAGE = format('fencegate: only the owner of table %s may fence it', rel);
    END IF;
    SELECT p.resource INTO existing FROM fencegate.protected_tables p WHERE p.tbl = rel;
    IF existing IS NOT NULL AND existing <> resource THEN
        RAISE EXCEPTION 'fencegate: table % is already fenced for resource "%"; unprotect it first', rel, existing;
    END IF;
    INSERT INTO fencegate.protected_tables (tbl, resource) VALUES (rel, resource)
        ON CONFLICT (tbl) DO NOTHING;
END
$fn$;

-- Forgets that `rel` is fenced, for a caller that can act as its owner.
CREATE OR REPLACE FUNCTION fencegate.unregister_table(rel regclass) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF NOT pg_has_role(fencegate.caller(), (SELECT c.relowner FROM pg_class c WHERE c.oid = rel), 'MEMBER') THEN
        RAISE EXCEPTION USING ERRCODE = '42501',
            MESSAGE = format('fencegate: only the owner of table %s may take its fence off', rel);
    END IF;
    DELETE FROM fencegate.protected_tables p WHERE p.tbl = rel;
    RETURN FOUND;
END
$fn$;

-- Puts the statement trigger on a registered table, ENABLE ALWAYS (so that
-- session_replication_role = replica does not skip it), in place of a decoy of its
-- name; and drops the fence's own function from triggers of other names (a fence
-- trigger renamed, disabled, and replaced by a decoy). Runs with the caller's
-- privileges: only a table's owner may change its triggers.
CREATE OR REPLACE FUNCTION fencegate.install_trigger(rel regclass) RETURNS void
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    stray name;
BEGIN
    -- No DDL when there is nothing to do: the partition guard runs after every ALTER
    -- TABLE and DROP TRIGGER, and calls this — also inside the DDL below, so the state
    -- is read again after each step.
    FOR stray IN SELECT t.tgname FROM pg_trigger t
                 WHERE t.tgrelid = rel AND NOT t.tgisinternal
                   AND t.tgfoid = 'fencegate.enforce()'::regprocedure
                   AND t.tgname NOT IN ('fencegate_fence', 'fencegate_fence_row') LOOP
        EXECUTE format('DROP TRIGGER IF EXISTS %I ON %s', stray, rel);
    END LOOP;
    IF fencegate.fence_trigger(rel, false) = 'X' THEN
        EXECUTE format('DROP TRIGGER fencegate_fence ON %s', rel);
    END IF;
    IF fencegate.fence_trigger(rel, false) IS NULL THEN
        EXECUTE format('CREATE TRIGGER fencegate_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %s FOR EACH STATEMENT EXECUTE FUNCTION fencegate.enforce()', rel);
    END IF;
    IF fencegate.fence_trigger(rel, false) IS DISTINCT FROM 'A' THEN
        EXECUTE format('ALTER TABLE %s ENABLE ALWAYS TRIGGER fencegate_fence', rel);
    END IF;
END
$fn$;

-- Fenced tables with rows that a write through an ancestor could reach unchecked: an
-- ancestor not fenced for the same resource fires only its own statement triggers, so
-- these tables need the row-level trigger too. One row per such table, with one such
-- ancestor.
CREATE OR REPLACE FUNCTION fencegate.reachable_from_above() RETURNS TABLE (tbl regclass, resource text, ancestor regclass)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT DISTINCT ON (p.tbl) p.tbl, p.resource, a.rel
    FROM fencegate.protected_tables p
    JOIN pg_class c ON c.oid = p.tbl AND c.relkind = 'r'
    CROSS JOIN LATERAL fencegate.ancestors(p.tbl) AS a(rel)
    WHERE a.rel <> p.tbl
      AND NOT EXISTS (SELECT FROM fencegate.protected_tables q WHERE q.tbl = a.rel AND q.resource = p.resource)
    ORDER BY p.tbl, a.rel
$fn$;

-- The fenced tables of `tbl`'s family (every table above and below it): whether each
-- needs the row-level trigger (reachable_from_above) and whether it has it. Read-only.
CREATE OR REPLACE FUNCTION fencegate.family_coverage(tbl regclass)
    RETURNS TABLE (rel regclass, needed boolean, enabled "char")
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT DISTINCT m.rel,
           m.rel IN (SELECT r.tbl FROM fencegate.reachable_from_above() r),
           fencegate.fence_trigger(m.rel, true)
    FROM fencegate.ancestors(tbl) AS a(top)
    CROSS JOIN LATERAL fencegate.family(a.top) AS m(rel)
    WHERE EXISTS (SELECT FROM fencegate.protected_tables p WHERE p.tbl = m.rel)
$fn$;

-- Gives the row-level trigger to the fenced tables of `tbl`'s family that need it, and
-- takes it from those that no longer do. Runs with the caller's privileges.
CREATE OR REPLACE FUNCTION fencegate.cover_family(tbl regclass) RETURNS void
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    member record;
BEGIN
    -- No DDL when there is nothing to do: the partition guard runs after every ALTER
    -- TABLE and DROP TRIGGER, and calls this.
    -- (The DDL below runs the guard too, so each state is read again before each step.)
    FOR member IN SELECT * FROM fencegate.family_coverage(tbl) LOOP
        IF fencegate.fence_trigger(member.rel, true) = 'X'
           OR (NOT member.needed AND fencegate.fence_trigger(member.rel, true) IS NOT NULL) THEN
            -- A decoy of the row-level trigger's name, or a trigger no longer needed.
            EXECUTE format('DROP TRIGGER IF EXISTS fencegate_fence_row ON %s', member.rel);
        END IF;
        IF member.needed AND fencegate.fence_trigger(member.rel, true) IS NULL THEN
            EXECUTE format('CREATE TRIGGER fencegate_fence_row BEFORE INSERT OR UPDATE OR DELETE ON %s FOR EACH ROW EXECUTE FUNCTION fencegate.enforce()', member.rel);
        END IF;
        IF member.needed AND fencegate.fence_trigger(member.rel, true) IS DISTINCT FROM 'A' THEN
            EXECUTE format('ALTER TABLE %s ENABLE ALWAYS TRIGGER fencegate_fence_row', member.rel);
        END IF;
    END LOOP;
END
$fn$;

-- Fences `tbl` and every partition and child below it for `resource` (and gives the
-- row-level trigger to those that a write through an unfenced ancestor could reach).
-- Runs with the caller's privileges: the caller must own the tables. Returns the
-- tables it fenced.
CREATE OR REPLACE FUNCTION fencegate.protect(tbl regclass, resource text) RETURNS SETOF regclass
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    rel regclass;
BEGIN
    PERFORM fencegate.require_resource(resource);
    FOR rel IN SELECT fencegate.family(tbl) LOOP
        IF (SELECT c.relkind FROM pg_class c WHERE c.oid = rel) NOT IN ('r', 'p') THEN
            RAISE EXCEPTION 'fencegate: % is not a table; only tables and partitioned tables can be protected', rel;
        END IF;
        PERFORM fencegate.register_table(rel, resource);
        PERFORM fencegate.install_trigger(rel);
        RETURN NEXT rel;
    END LOOP;
    PERFORM fencegate.cover_family(tbl);
END
$fn$;

-- Takes the fence off `tbl` and everything below it; returns those tables.
CREATE OR REPLACE FUNCTION fencegate.unprotect(tbl regclass) RETURNS SETOF regclass
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    rel regclass;
BEGIN
    FOR rel IN SELECT p.tbl FROM fencegate.protected p WHERE p.tbl IN (SELECT fencegate.family(unprotect.tbl)) LOOP
        PERFORM fencegate.unregister_table(rel);
        EXECUTE format('DROP TRIGGER IF EXISTS fencegate_fence ON %s', rel);
        EXECUTE format('DROP TRIGGER IF EXISTS fencegate_fence_row ON %s', rel);
        RETURN NEXT rel;
    END LOOP;
    PERFORM fencegate.cover_family(tbl);
END
$fn$;

-- Partitions and children of protected tables that are not fenced themselves, with
-- the resource of their nearest protected ancestor.
CREATE OR REPLACE FUNCTION fencegate.unprotected_descendants() RETURNS TABLE (tbl regclass, resource text, parent regclass)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH RECURSIVE below(rel, resource, parent) AS (
        SELECT i.inhrelid, p.resource, p.tbl::oid
            FROM fencegate.protected_tables p JOIN pg_inherits i ON i.inhparent = p.tbl
        UNION
        SELECT i.inhrelid, b.resource, b.parent
            FROM below b JOIN pg_inherits i ON i.inhparent = b.rel
    )
    SELECT b.rel::regclass, b.resource, b.parent::regclass FROM below b
    WHERE NOT EXISTS (SELECT FROM fencegate.protected_tables p WHERE p.tbl = b.rel)
$fn$;

-- The event trigger function of the partition guard, at the end of every CREATE
-- TABLE, ALTER TABLE, DROP TABLE and DROP TRIGGER: fences new partitions and children
-- of protected tables (and attached ones); puts back the statement trigger of a fenced
-- table that anyone but a superuser dropped or disabled (a table's owner may change
-- its triggers, not take its fence off: that is `fencegate unprotect`); keeps the
-- row-level triggers where families need them; and forgets dropped tables. Installed
-- by install_partition_guard(), and runs as the superuser who installed it.
--
-- Its definition is kept as text (partition_guard_definition()), because the function
-- belongs to the superuser who installed the guard: a gateway whose login is not a
-- superuser cannot replace it, and leaves it as it is (fencegate check then reports
-- partition_guard_outdated until a superuser runs install_partition_guard() again).
CREATE OR REPLACE FUNCTION fencegate.partition_guard_definition() RETURNS text
    LANGUAGE sql IMMUTABLE
    SET search_path = pg_catalog, pg_temp
AS $definition$ SELECT $guard$
CREATE OR REPLACE FUNCTION fencegate.fence_new_partitions() RETURNS event_trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    missing record;
    repaired record;
BEGIN
    -- fencegate partition guard 5 (fencegate.audit() looks for this line)
    DELETE FROM fencegate.protected_tables p WHERE NOT EXISTS (SELECT FROM pg_class c WHERE c.oid = p.tbl);
    FOR missing IN SELECT * FROM fencegate.unprotected_descendants() LOOP
        INSERT INTO fencegate.protected_tables (tbl, resource) VALUES (missing.tbl, missing.resource)
            ON CONFLICT (tbl) DO NOTHING;
        PERFORM fencegate.install_trigger(missing.tbl);
    END LOOP;
    IF NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = fencegate.caller()) THEN
        FOR repaired IN SELECT p.tbl, p.enabled FROM fencegate.protected p WHERE p.enabled IS DISTINCT FROM 'A' LOOP
            PERFORM fencegate.install_trigger(repaired.tbl);
            RAISE WARNING 'fencegate: the fence trigger of table % was %; it is back',
                repaired.tbl, CASE WHEN repaired.enabled IS NULL THEN 'dropped' ELSE 'disabled' END
                USING HINT = 'Only fencegate unprotect takes the fence off a table.';
        END LOOP;
    END IF;
    FOR missing IN SELECT DISTINCT r.tbl FROM fencegate.reachable_from_above() r
                   WHERE fencegate.fence_trigger(r.tbl, true) IS DISTINCT FROM 'A' LOOP
        PERFORM fencegate.cover_family(missing.tbl);
    END LOOP;
END
$fn$;
$guard$ $definition$;

DO $do$
DECLARE
    owner oid := (SELECT p.proowner FROM pg_proc p
                  WHERE p.oid = to_regprocedure('fencegate.fence_new_partitions()'));
BEGIN
    IF owner IS NULL OR pg_has_role(current_user, owner, 'USAGE') THEN
        EXECUTE fencegate.partition_guard_definition();
    ELSE
        RAISE WARNING 'fencegate: the partition guard''s function belongs to role %, and is left as it is; a superuser brings it up to date with SELECT fencegate.install_partition_guard()',
            owner::regrole;
    END IF;
END
$do$;

-- Installs (or reinstalls) the partition guard: its function, up to date, and its
-- event trigger. Creating an event trigger needs a superuser; the function then runs
-- as that superuser, so that it may add the trigger to a partition whoever created it.
-- (So does the code of this schema that it calls: install the guard only if the
-- gateway's login is trusted as much.)
CREATE OR REPLACE FUNCTION fencegate.install_partition_guard() RETURNS void
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    DROP EVENT TRIGGER IF EXISTS fencegate_partitions;
    EXECUTE fencegate.partition_guard_definition();
    EXECUTE format('ALTER FUNCTION fencegate.fence_new_partitions() OWNER TO %I', current_user);
    REVOKE ALL ON FUNCTION fencegate.fence_new_partitions() FROM PUBLIC;
    CREATE EVENT TRIGGER fencegate_partitions ON ddl_command_end
        WHEN TAG IN ('CREATE TABLE', 'ALTER TABLE', 'DROP TABLE', 'DROP TRIGGER')
        EXECUTE FUNCTION fencegate.fence_new_partitions();
END
$fn$;

-- Records every raise of a fence (fencegate.raises), keeping the latest 32 per
-- resource; the highest raise it lets go of becomes the resource's floor
-- (fencegate.raise_floors), which no reset goes below, so that no number of raises
-- pushes the current term out of a reset's reach. A write group's placeholder row
-- (raised_by 'lock', at 1, never committed as such) is recorded when a write claims it.
CREATE OR REPLACE FUNCTION fencegate.log_raise() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    evicted bigint;
BEGIN
    INSERT INTO fencegate.raises (resource, token, path)
        VALUES (NEW.resource, NEW.highest, NEW.raised_by)
        ON CONFLICT (resource, token) DO NOTHING;
    WITH gone AS (
        DELETE FROM fencegate.raises r
            WHERE r.resource = NEW.resource
              AND r.token < (SELECT k.token FROM fencegate.raises k WHERE k.resource = NEW.resource
                             ORDER BY k.token DESC OFFSET 31 LIMIT 1)
            RETURNING r.token
    )
    SELECT max(gone.token) INTO evicted FROM gone;
    IF evicted IS NOT NULL THEN
        INSERT INTO fencegate.raise_floors AS f (resource, token) VALUES (NEW.resource, evicted)
            ON CONFLICT (resource) DO UPDATE SET token = greatest(f.token, EXCLUDED.token);
    END IF;
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS fencegate_raised ON fencegate.fences;
CREATE TRIGGER fencegate_raised AFTER UPDATE OF highest ON fencegate.fences
    FOR EACH ROW WHEN (NEW.highest > OLD.highest OR OLD.raised_by = 'lock')
    EXECUTE FUNCTION fencegate.log_raise();
-- A new fence's first raise, for all the fences a statement created at once: a fence
-- row is never deleted once a raise claimed it, so a new one has no raises to evict.
CREATE OR REPLACE FUNCTION fencegate.log_created() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    INSERT INTO fencegate.raises (resource, token, path)
        SELECT c.resource, c.highest, c.raised_by FROM created c WHERE c.raised_by <> 'lock'
        ON CONFLICT (resource, token) DO NOTHING;
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS fencegate_created ON fencegate.fences;
CREATE TRIGGER fencegate_created AFTER INSERT ON fencegate.fences
    REFERENCING NEW TABLE AS created
    FOR EACH STATEMENT EXECUTE FUNCTION fencegate.log_created();
ALTER TABLE fencegate.fences ENABLE ALWAYS TRIGGER fencegate_raised;
ALTER TABLE fencegate.fences ENABLE ALWAYS TRIGGER fencegate_created;

-- The guard of a seed `leader_lease` table (`fencegate leader-lease guard`): electors
-- move a lease only the way the seed's statements do, and only for resources they
-- hold. A new term raises the epoch by exactly one, and only when the lease is free,
-- expired, or held by the same role; renewing and releasing keep the epoch, by the
-- holder's role only; electors never delete. holder_role records the role that took
-- the term. The table's owner (the administrator) may change anything; lowering an
-- epoch (retiring a forged record) needs a reason in fencegate.reason and is recorded
-- in fencegate.issuer_retirements.
CREATE OR REPLACE FUNCTION fencegate.guard_leader_lease() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    who name := fencegate.caller();
    owner oid := (SELECT c.relowner FROM pg_class c WHERE c.oid = TG_RELID);
    resource text;
    reason text := nullif(current_setting('fencegate.reason', true), '');
BEGIN
    IF pg_has_role(who, owner, 'MEMBER') THEN
        IF TG_OP = 'UPDATE' AND NEW.epoch < OLD.epoch THEN
            IF reason IS NULL THEN
                RAISE EXCEPTION USING ERRCODE = 'ZF008',
                    MESSAGE = format('fencegate: lowering the epoch of lease "%s" retires a forged record and needs a reason', OLD.name),
                    DETAIL = format('resource=%s', OLD.name),
                    HINT = 'Use fencegate leader-lease retire, which records who, when and why.';
            END IF;
            INSERT INTO fencegate.issuer_retirements (lease_table, name, from_epoch, to_epoch, role, reason)
                VALUES (TG_RELID::regclass::text, OLD.name, OLD.epoch, NEW.epoch, who, reason);
        END IF;
        IF TG_LEVEL = 'STATEMENT' THEN
            RETURN NULL;
        ELSIF TG_OP = 'DELETE' THEN
            RETURN OLD;
        END IF;
        RETURN NEW;
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF008',
            MESSAGE = format('fencegate: electors may not truncate %s: a lease row keeps its epoch for good', TG_RELID::regclass);
    ELSIF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF008',
            MESSAGE = format('fencegate: electors may not delete lease "%s": a lease row keeps its epoch for good', OLD.name),
            DETAIL = format('resource=%s', OLD.name);
    END IF;
    resource := NEW.name;
    IF NOT (SELECT h.held FROM fencegate.holding(who, resource) h) THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF006',
            MESSAGE = format('fencegate: role %s may not elect for resource "%s"', quote_ident(who), resource),
            DETAIL = format('resource=%s role=%s', resource, who),
            HINT = format('fencegate grant %s --resource %s', quote_ident(who), resource),
            CONSTRAINT = 'fencegate_fence';
    END IF;
    IF TG_OP = 'INSERT' THEN
        IF NEW.epoch NOT IN (0, 1) THEN
            RAISE EXCEPTION USING ERRCODE = 'ZF008',
                MESSAGE = format('fencegate: a new lease "%s" starts at epoch 0 or 1, not %s', resource, NEW.epoch),
                DETAIL = format('resource=%s', resource);
        END IF;
        NEW.holder_role := CASE WHEN NEW.holder IS NULL THEN NULL ELSE who END;
        RETURN NEW;
    END IF;
    IF NEW.name <> OLD.name THEN
        RAISE EXCEPTION USING ERRCODE = 'ZF008',
            MESSAGE = format('fencegate: lease "%s" may not be renamed', OLD.name),
            DETAIL = format('resource=%s', OLD.name);
    END IF;
    IF NEW.epoch = OLD.epoch + 1 THEN
        IF OLD.holder IS NOT NULL AND OLD.expires_at >= now() AND OLD.holder_role IS DISTINCT FROM who THEN
            RAISE EXCEPTION USING ERRCODE = 'ZF008',
                MESSAGE = format('fencegate: lease "%s" is held by another role until %s', resource, OLD.expires_at),
                DETAIL = format('resource=%s', resource);
        END IF;
        NEW.holder_role := who;
        RETURN NEW;
    ELSIF NEW.epoch = OLD.epoch THEN
        IF NEW.holder_role IS DISTINCT FROM OLD.holder_role
           OR (OLD.holder_role IS DISTINCT FROM who AND (OLD.holder IS NOT NULL OR NEW.holder IS NOT NULL)) THEN
            RAISE EXCEPTION USING ERRCODE = 'ZF008',
                MESSAGE = format('fencegate: only the role that took the term of lease "%s" may renew or release it', resource),
                DETAIL = format('resource=%s', resource);
        END IF;
        RETURN NEW;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'ZF008',
        MESSAGE = format('fencegate: the epoch of lease "%s" may only rise by one, on a new term (from %s to %s refused)', resource, OLD.epoch, NEW.epoch),
        DETAIL = format('resource=%s', resource);
END
$fn$;

-- What `fencegate check` reports: one row per finding. `problem` rows are holes in the
-- fence; `warning` rows are risks; `info` rows say who can reach the fence.
CREATE OR REPLACE FUNCTION fencegate.audit() RETURNS TABLE (severity text, finding text, object text, detail text)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH owner AS (
        SELECT n.nspowner AS oid FROM pg_namespace n WHERE n.nspname = 'fencegate'
    ),
    -- Roles other than superusers and those acting as the schema's owner.
    other AS (
        SELECT r.oid, r.rolname FROM pg_roles r
        WHERE NOT r.rolsuper AND r.rolname !~ '^pg_'
          AND NOT pg_has_role(r.oid, (SELECT oid FROM owner), 'MEMBER')
    ),
    -- Writers: roles that hold a resource or may call fencegate.fence().
    writer AS (
        SELECT o.oid, o.rolname FROM other o
        WHERE has_function_privilege(o.oid, 'fencegate.fence(text, bigint)', 'EXECUTE')
           OR EXISTS (SELECT FROM fencegate.authority a WHERE pg_has_role(o.oid, a.role, 'MEMBER'))
    ),
    fence_triggers AS (
        SELECT t.tgrelid::regclass AS tbl, t.tgname
        FROM pg_trigger t
        WHERE t.tgfoid = 'fencegate.enforce()'::regprocedure AND NOT t.tgisinternal
    )
    SELECT 'problem', 'unprotected_partition', d.tbl::text,
           format('below %s, which is fenced for resource "%s", but not fenced itself: writes straight to it are not fenced (fencegate protect %s --resource %s)',
                  d.parent, d.resource, d.tbl, d.resource)
        FROM fencegate.unprotected_descendants() d
    UNION ALL
    SELECT 'problem', 'reachable_through_ancestor', r.tbl::text,
           format('fenced for resource "%s", but a write through %s, which is not fenced for it, reaches its rows and it has no row-level fence trigger (fencegate protect %s --resource %s)',
                  r.resource, r.ancestor, r.tbl, r.resource)
        FROM fencegate.reachable_from_above() r
        WHERE fencegate.fence_trigger(r.tbl, true) IS DISTINCT FROM 'A'
    UNION ALL
    SELECT DISTINCT 'warning', 'unfenced_ancestor', r.ancestor::text,
           format('above %s, which is fenced for resource "%s": its own rows are not fenced (writes through it into fenced tables are, row by row)',
                  r.tbl, r.resource)
        FROM fencegate.reachable_from_above() r
    UNION ALL
    SELECT 'problem', 'trigger_not_always', p.tbl::text,
           format('the fencegate trigger is %s, not ENABLE ALWAYS (fencegate protect %s --resource %s)',
                  CASE p.enabled WHEN 'D' THEN 'disabled' WHEN 'R' THEN 'enabled for replicas only' WHEN 'O' THEN 'enabled for origin sessions only'
                                 WHEN 'X' THEN 'replaced by another trigger of its name' ELSE 'missing' END,
                  p.tbl, p.resource)
        FROM fencegate.protected p WHERE p.enabled IS DISTINCT FROM 'A'
    UNION ALL
    SELECT 'problem', 'unregistered_fence_trigger', ft.tbl::text,
           format('trigger %s calls fencegate.enforce() but the table was not fenced by fencegate protect: drop the trigger',
                  quote_ident(ft.tgname))
        FROM fence_triggers ft
        WHERE NOT EXISTS (SELECT FROM fencegate.protected_tables p WHERE p.tbl = ft.tbl)
    UNION ALL
    SELECT CASE WHEN f.prosrc ~* 'fencegate' THEN 'problem' ELSE 'warning' END,
           'foreign_trigger_on_fenced_table', t.tgrelid::regclass::text,
           format('trigger %s runs %s, of role %s, inside every write to this table, with the writer''s authority%s',
                  quote_ident(t.tgname), f.oid::regprocedure, quote_ident(pg_get_userbyid(f.proowner)),
                  CASE WHEN f.prosrc ~* 'fencegate'
                       THEN ': it calls the fence or sets its token, and may present a token of its own choosing before the fence''s trigger reads it (drop it)'
                       ELSE ': check that the writers trust its owner' END)
        FROM pg_trigger t
        JOIN fencegate.protected_tables p ON p.tbl = t.tgrelid
        JOIN pg_proc f ON f.oid = t.tgfoid
        WHERE NOT t.tgisinternal AND t.tgfoid <> 'fencegate.enforce()'::regprocedure
    UNION ALL
    SELECT 'warning', 'code_calls_fence', c.object,
           format('%s, of role %s, calls the fence or sets its token: it runs with the authority of whoever runs it, so a holder that writes through it, reads it or fires it raises and presents its own fences as this code says; a raise from a trigger is refused (ZF006), from a view, rule, default or function called directly it is not',
                  c.object, quote_ident(c.owner))
        FROM (
            SELECT format('function %s', p.oid::regprocedure) AS object, pg_get_userbyid(p.proowner) AS owner, p.prosrc AS code
                FROM pg_proc p
                WHERE p.pronamespace NOT IN ('fencegate'::regnamespace, 'pg_catalog'::regnamespace, 'information_schema'::regnamespace)
                  AND p.prolang IN (SELECT l.oid FROM pg_language l WHERE l.lanname NOT IN ('c', 'internal'))
            UNION ALL
            SELECT format('view %s', c.oid::regclass), pg_get_userbyid(c.relowner), pg_get_viewdef(c.oid)
                FROM pg_class c
                WHERE c.relkind IN ('v', 'm')
                  AND c.relnamespace NOT IN ('fencegate'::regnamespace, 'pg_catalog'::regnamespace, 'information_schema'::regnamespace)
            UNION ALL
            SELECT format('rule %s on %s', quote_ident(r.rulename), r.ev_class::regclass), pg_get_userbyid(c.relowner), pg_get_ruledef(r.oid)
                FROM pg_rewrite r JOIN pg_class c ON c.oid = r.ev_class
                WHERE r.rulename <> '_RETURN'
                  AND c.relnamespace NOT IN ('fencegate'::regnamespace, 'pg_catalog'::regnamespace, 'information_schema'::regnamespace)
            UNION ALL
            SELECT format('the default of column %s of %s', quote_ident(a.attname), d.adrelid::regclass), pg_get_userbyid(c.relowner),
                   pg_get_expr(d.adbin, d.adrelid)
                FROM pg_attrdef d
                JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
                JOIN pg_class c ON c.oid = d.adrelid
                WHERE c.relnamespace NOT IN ('fencegate'::regnamespace, 'pg_catalog'::regnamespace, 'information_schema'::regnamespace)
        ) c
        WHERE c.code ~* 'fencegate\s*\.\s*(fence|sql_fence)\s*\(|fencegate\.token'
    UNION ALL
    SELECT 'problem', 'writer_owns_protected_table', p.tbl::text,
           format('writer role %s can act as the owner %s of this table, and so drop or disable its trigger',
                  quote_ident(w.rolname), quote_ident(o.rolname))
        FROM fencegate.protected_tables p
        JOIN pg_class c ON c.oid = p.tbl
        JOIN pg_roles o ON o.oid = c.relowner
        JOIN writer w ON pg_has_role(w.oid, c.relowner, 'MEMBER')
    UNION ALL
    SELECT 'problem', 'role_can_write_fences', quote_ident(o.rolname),
           format('role %s has privileges on %s, or can act as a role that does: it could change fences directly',
                  quote_ident(o.rolname), c.oid::regclass)
        FROM other o
        CROSS JOIN pg_class c
        WHERE c.relnamespace = 'fencegate'::regnamespace AND c.relkind IN ('r', 'p')
          AND has_table_privilege(o.oid, c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')
    UNION ALL
    SELECT 'problem', 'role_can_create_in_fencegate', quote_ident(o.rolname),
           format('role %s may create objects in schema fencegate', quote_ident(o.rolname))
        FROM other o
        WHERE has_schema_privilege(o.oid, 'fencegate', 'CREATE')
    UNION ALL
    SELECT 'problem', 'public_can_execute', p.oid::regprocedure::text,
           'every role may execute this function of schema fencegate (REVOKE EXECUTE ... FROM PUBLIC)'
        FROM pg_proc p
        WHERE p.pronamespace = 'fencegate'::regnamespace
          AND EXISTS (SELECT FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                      WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')
    UNION ALL
    SELECT 'info', 'role_can_reach_fence', quote_ident(o.rolname),
           format('may call %s; holds %s', string_agg(DISTINCT p.proname, ', '),
                  coalesce((SELECT string_agg(a.pattern || CASE WHEN a.prefix THEN '*' ELSE '' END, ', ' ORDER BY a.pattern)
                            FROM fencegate.authority a WHERE pg_has_role(o.oid, a.role, 'MEMBER')), 'no resource'))
        FROM other o
        JOIN pg_proc p ON p.pronamespace = 'fencegate'::regnamespace
                      AND p.proname IN ('fence', 'sql_fence', 'enforce', 'guard_leader_lease', 'protect', 'unprotect')
        WHERE has_function_privilege(o.oid, p.oid, 'EXECUTE')
        GROUP BY o.oid, o.rolname
    UNION ALL
    SELECT 'problem', 'sql_login_holds_resources', quote_ident(o.rolname),
           format('role %s may take the fence step of /v1/sql and holds resources of its own: the writers'' statements of /v1/sql could present or raise them (fencegate revoke %s)',
                  quote_ident(o.rolname), quote_ident(o.rolname))
        FROM other o
        WHERE has_function_privilege(o.oid, 'fencegate.sql_fence(text, bigint, bytea)', 'EXECUTE')
          AND EXISTS (SELECT FROM fencegate.authority a WHERE pg_has_role(o.oid, a.role, 'MEMBER'))
    UNION ALL
    SELECT 'warning', 'authority_of_missing_role', a.role::oid::text,
           format('resource pattern %s%s is granted to a role that no longer exists (fencegate revoke)',
                  a.pattern, CASE WHEN a.prefix THEN '*' ELSE '' END)
        FROM fencegate.authority a
        WHERE NOT EXISTS (SELECT FROM pg_roles r WHERE r.oid = a.role)
    UNION ALL
    SELECT 'problem', 'prepared_transactions_enabled', 'max_prepared_transactions',
           format('max_prepared_transactions is %s: a prepared transaction can hold a fence row across disconnects and restarts, and no new term can end it; set it to 0',
                  current_setting('max_prepared_transactions'))
        WHERE current_setting('max_prepared_transactions')::int > 0
    UNION ALL
    SELECT 'problem', 'prepared_transaction_holds_fence', f.resource,
           format('prepared transaction %s holds the fence of resource "%s": COMMIT PREPARED or ROLLBACK PREPARED it', l.virtualtransaction, f.resource)
        FROM pg_locks l
        JOIN fencegate.fences f ON l.classid = ((f.lock_key >> 32) & 4294967295)::oid AND l.objid = (f.lock_key & 4294967295)::oid
        WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.pid IS NULL
    UNION ALL
    SELECT 'warning', 'takeover_cannot_end_sessions', quote_ident(r.rolname),
           format('the owner of schema fencegate, %s, may not end other roles'' sessions: a new term cannot end an older term''s sessions that hold its fence (GRANT pg_signal_backend TO %s)',
                  quote_ident(r.rolname), quote_ident(r.rolname))
        FROM pg_roles r
        WHERE r.oid = (SELECT oid FROM owner) AND NOT r.rolsuper
          AND NOT pg_has_role(r.oid, 'pg_signal_backend', 'MEMBER')
    UNION ALL
    SELECT 'warning', 'partition_guard_outdated', 'fencegate_partitions',
           'the partition guard runs a function of an earlier version (it belongs to the superuser who installed it): a superuser runs SELECT fencegate.install_partition_guard() to bring it up to date'
        FROM pg_event_trigger e JOIN pg_proc p ON p.oid = e.evtfoid
        WHERE e.evtname = 'fencegate_partitions'
          AND p.prosrc NOT LIKE '%fencegate partition guard 5 %'
    UNION ALL
    SELECT 'warning', 'no_partition_guard', 'fencegate_partitions',
           'no event trigger fences new partitions of protected tables as they are created or puts back a fence trigger that was dropped: run SELECT fencegate.install_partition_guard() as a superuser, or run fencegate check after changing fenced tables'
        WHERE NOT EXISTS (SELECT FROM pg_event_trigger e WHERE e.evtname = 'fencegate_partitions' AND e.evtenabled <> 'D'
                          AND e.evttags @> ARRAY['CREATE TABLE', 'ALTER TABLE', 'DROP TABLE', 'DROP TRIGGER'])
$fn$;

-- No function of the schema is PUBLIC's; those of another owner (the partition guard's,
-- a superuser's) are left to it.
DO $do$
DECLARE
    function regprocedure;
BEGIN
    FOR function IN SELECT p.oid::regprocedure FROM pg_proc p
                    WHERE p.pronamespace = 'fencegate'::regnamespace
                      AND pg_has_role(current_user, p.proowner, 'USAGE') LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', function);
    END LOOP;
END
$do$;
REVOKE ALL ON ALL TABLES IN SCHEMA fencegate FROM PUBLIC;

-- Roles granted the right to fence their tables before fence_trigger() existed call it
-- through protect(): they get it as the grant gives it now.
DO $do$
DECLARE
    grantee regrole;
BEGIN
    FOR grantee IN SELECT DISTINCT a.grantee::regrole
                   FROM pg_proc p, aclexplode(p.proacl) a
                   WHERE p.oid = 'fencegate.protect(regclass, text)'::regprocedure
                     AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION fencegate.fence_trigger(regclass, boolean) TO %s', grantee);
    END LOOP;
END
$do$;

DO $do$
BEGIN
    IF (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user) THEN
        PERFORM fencegate.install_partition_guard();
    END IF;
END
$do$;
