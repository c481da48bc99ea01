#!/usr/bin/env bash
# Creates the fixture the client scripts start from, in a fresh database DB:
# table sweep_state (one row: 1 'initial') protected under resource `sweeper`
# (no token presented yet), and a login role DB_writer that may write it and holds
# resource `sweeper` (fencegate grant).
# Drops DB and DB_writer first if they exist. Prints the writer's DSN.
#
#   tests/clients/fixture.sh fg_clients
#   FENCEGATE_CLIENT_DSN=$(tests/clients/fixture.sh fg_clients) python3 tests/clients/python/check_psycopg.py
#
# Env: PGHOST (127.0.0.1), PGPORT (5432), PGSUPERUSER (postgres), FENCEGATE_BIN
# (target/debug/fencegate of this workspace).
set -euo pipefail

db=${1:?usage: fixture.sh DBNAME}
[[ $db =~ ^[a-z_][a-z0-9_]*$ ]] || { echo "fixture.sh: DBNAME must be a lowercase SQL identifier" >&2; exit 2; }
host=${PGHOST:-127.0.0.1}
port=${PGPORT:-5432}
su=${PGSUPERUSER:-postgres}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=${FENCEGATE_BIN:-$root/target/debug/fencegate}
writer=${db}_writer

psql_as() { # psql_as DB SQL
  PGOPTIONS='-c client_min_messages=warning' psql -X -q -v ON_ERROR_STOP=1 -h "$host" -p "$port" -U "$su" -d "$1" -c "$2" >/dev/null
}

psql_as postgres "DROP DATABASE IF EXISTS $db WITH (FORCE)"
psql_as postgres "DROP ROLE IF EXISTS $writer"
psql_as postgres "CREATE DATABASE $db"
psql_as "$db" "CREATE TABLE sweep_state (id int PRIMARY KEY, note text NOT NULL);
               INSERT INTO sweep_state VALUES (1, 'initial')"
"$bin" protect sweep_state --resource sweeper \
  --database-url "postgres://$su@$host:$port/$db" >/dev/null
psql_as "$db" "CREATE ROLE $writer LOGIN;
               GRANT USAGE ON SCHEMA public TO $writer;
               GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA public TO $writer"
"$bin" grant "$writer" --resource sweeper \
  --database-url "postgres://$su@$host:$port/$db" >/dev/null

echo "postgres://$writer@$host:$port/$db"
