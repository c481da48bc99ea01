-- Migration 3: hosted leases, fence resets, and issued tokens only.
--
-- fencegate.leases holds the leases the gateway hosts (/v1/leases): each acquire mints
-- a token above the lease's last and the fence's highest, and raises the fence to it
-- in the same transaction. fencegate.fence_resets is the audit log of fence resets,
-- which replicas follow by generation. fencegate.issuer_bindings holds the gateway's
-- --issued-by flags, so that the in-database fence refuses, like the HTTP API, a new
-- term's token that the gateway's leases never issued (fencegate.require_issued()).

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

-- The gateway's --issued-by bindings, in order (the first that matches decides).
CREATE TABLE fencegate.issuer_bindings (
    position integer PRIMARY KEY,
    -- A resource name, or with `prefix` the start of resource names.
    pattern  text NOT NULL,
    prefix   boolean NOT NULL,
    issuer   text NOT NULL CHECK (issuer IN ('gateway', 'leader_lease'))
);

REVOKE ALL ON fencegate.leases, fencegate.fence_resets, fencegate.issuer_bindings FROM PUBLIC;
