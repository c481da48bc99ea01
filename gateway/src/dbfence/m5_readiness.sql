-- Migration 5: the write probe of /readyz.
--
-- One row, rewritten by each gateway's readiness probe (at most once a second per
-- gateway): a real write that must commit, so that a database that cannot take writes
-- (read-only, a standby, a full disk) makes the gateway unready.

CREATE TABLE fencegate.readiness (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    probe_at timestamptz NOT NULL
);
