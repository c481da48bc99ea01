#!/usr/bin/env bash
# Installs what the client scripts need, idempotently: for python3's pip, psycopg 3
# (binary wheel, which bundles libpq 17+), asyncpg, boto3, and httpx (the dependency of
# the fencegate package in clients/python/src, which the S3 scripts import from the
# checkout); node-postgres, pg-copy-streams and @aws-sdk/client-s3 into
# node/node_modules (npm ci, from package-lock.json); TypeScript into
# clients/node/node_modules (npm ci there), with which the S3 door's test compiles the
# TypeScript client; and the Debian package libpostgresql-jdbc-java for
# /usr/share/java/postgresql.jar. Needs python3, pip, npm and java already; apt-get
# needs root. Stops at the first failure.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

echo "install.sh: python packages"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
  'psycopg[binary]>=3.2,<4' 'asyncpg>=0.29,<1' 'boto3>=1.26,<2' 'httpx>=0.25,<1'
python3 -c 'import psycopg, asyncpg, boto3, httpx'

echo "install.sh: node packages"
(cd "$here/node" && npm ci --no-audit --no-fund --loglevel=error)
(cd "$here/../../clients/node" && npm ci --no-audit --no-fund --loglevel=error --ignore-scripts)

if [[ ! -f /usr/share/java/postgresql.jar ]]; then
  echo "install.sh: libpostgresql-jdbc-java"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libpostgresql-jdbc-java
fi
[[ -f /usr/share/java/postgresql.jar ]] || { echo "install.sh: /usr/share/java/postgresql.jar is missing" >&2; exit 1; }
echo "install.sh: done"
