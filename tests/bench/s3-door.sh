#!/usr/bin/env bash
# The S3 door against radosgw straight, in one run (tests/src/bin/fencegate-s3-bench.rs):
#
#   tests/bench/s3-door.sh                  # 3 rounds x 5 s, 1 and 16 clients
#   tests/bench/s3-door.sh 1 2 4            # 1 round x 2 s, 4 clients
#
# Needs what the S3 tests need (ceph-mon, ceph-osd, radosgw, ceph-common; Postgres at
# 127.0.0.1:5432). Builds the gateway and the benchmark in release mode.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release --quiet -p fencegate-gateway --bin fencegate
cargo build --release --quiet -p fencegate-tests --bin fencegate-s3-bench
FENCEGATE_BIN=$PWD/target/release/fencegate exec target/release/fencegate-s3-bench "$@"
