-- Migration 2: the in-database fence for writers' own tables. Its functions live in
-- functions.sql; what stays here is what a migration must do once.
--
-- Writers get no privilege on the tables of schema fencegate: every function that
-- touches them is SECURITY DEFINER with a fixed search_path.

REVOKE ALL ON SCHEMA fencegate FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA fencegate FROM PUBLIC;
ALTER DEFAULT PRIVILEGES IN SCHEMA fencegate REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;
