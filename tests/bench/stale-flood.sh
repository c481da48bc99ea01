#!/usr/bin/env bash
# Stale rejections per second under a flood, with the default logging (at most 100
# "stale write rejected" lines a second) and with every rejection logged
# (--stale-log-limit 0): wrk, 16 connections, a 128-byte stale PUT, interleaved rounds.
#
#   tests/bench/stale-flood.sh [ROUNDS] [SECONDS]     (defaults: 3 rounds of 8 s)
#
# Needs wrk and a release build (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}
SECONDS_PER_RUN=${2:-8}
BIN=target/release/fencegate
[ -x "$BIN" ] || { echo "build first: cargo build --release" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT

cat >"$WORK/stale.lua" <<'LUA'
wrk.method = "PUT"
wrk.path = "/v1/kv/flood/k"
wrk.headers["Fencing-Token"] = "1"
wrk.body = string.rep("x", 128)
LUA

start() { # start NAME FLAGS...: a gateway on a free port; prints its port
  local name=$1; shift
  "$BIN" --listen 127.0.0.1:0 --data-dir "$WORK/$name" --log-format json "$@" \
    >/dev/null 2>"$WORK/$name.log" &
  until grep -q '"fencegate ready"' "$WORK/$name.log" 2>/dev/null; do sleep 0.05; done
  sed -n 's/.*"addr":"127.0.0.1:\([0-9]*\)".*/\1/p' "$WORK/$name.log" | head -1
}
DEFAULT=$(start default)
EVERY=$(start every --stale-log-limit 0)
for port in "$DEFAULT" "$EVERY"; do
  curl -s -X PUT "http://127.0.0.1:$port/v1/kv/flood/k" -H 'Fencing-Token: 2' -d current >/dev/null
done

for round in $(seq "$ROUNDS"); do
  for pair in "default:$DEFAULT" "every:$EVERY"; do
    name=${pair%%:*}; port=${pair##*:}
    rate=$(wrk -t2 -c16 -d"${SECONDS_PER_RUN}s" -s "$WORK/stale.lua" "http://127.0.0.1:$port" \
           | sed -n 's/^Requests\/sec: *\([0-9.]*\)/\1/p')
    lines=$(grep -c '"stale write rejected"' "$WORK/$name.log" || true)
    bytes=$(stat -c %s "$WORK/$name.log")
    echo "round $round $name: $rate rejections/s (log so far: $lines lines, $bytes bytes)"
  done
done
