#!/usr/bin/env bash
# Installs what the client scripts need, idempotently: psycopg 3 (binary wheel, which
# bundles libpq 17+) and asyncpg for python3's pip, node-postgres and pg-copy-streams
# into node/node_modules (npm ci, from package-lock.json), and the Debian package
# libpostgresql-jdbc-java for /usr/share/java/postgresql.jar. Needs python3, pip, npm
# and java already; apt-get needs root. Stops at the first failure.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

echo "install.sh: python packages"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
  'psycopg[binary]>=3.2,<4' 'asyncpg>=0.29,<1'
python3 -c 'import psycopg, asyncpg'

echo "install.sh: node packages"
(cd "$here/node" && npm ci --no-audit --no-fund --loglevel=error)

if [[ ! -f /usr/share/java/postgresql.jar ]]; then
  echo "install.sh: libpostgresql-jdbc-java"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libpostgresql-jdbc-java
fi
[[ -f /usr/share/java/postgresql.jar ]] || { echo "install.sh: /usr/share/java/postgresql.jar is missing" >&2; exit 1; }
echo "install.sh: done"
