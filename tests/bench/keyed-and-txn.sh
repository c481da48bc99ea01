#!/usr/bin/env bash
# Writes with an Idempotency-Key against the same writes without, and /v1/txn against
# the same operations sent as single writes, on Postgres, in interleaved rounds:
#
#   plain   wrk PUT /v1/kv: token 1, 128-byte values, random keys over 100 resources
#   keyed   the same, each request with an Idempotency-Key of its own
#   cas     a compare-and-set loop: each wrk thread writes its own 1000 keys in turn,
#           each write with If-Match on the version its last answer gave (If-None-Match:
#           * for the first)
#   fresh   PUT to a new resource every time (a new fence row each)
#   txn2    POST /v1/txn of 2 puts on 2 of the 100 resources (writes/s = 2 x req/s)
#   txn8    POST /v1/txn of 8 puts on 8 of them (writes/s = 8 x req/s)
#
#   tests/bench/keyed-and-txn.sh                 # 3 rounds x 5 s
#   ROUNDS=1 DURATION=2 CLIENTS=16 tests/bench/keyed-and-txn.sh
#
# Settings (environment): ROUNDS (3), DURATION seconds (5), CLIENTS ("16 64"),
# WORKLOADS ("plain keyed cas fresh txn2 txn8"), BACKEND (postgres, or embedded: the store in a
# fresh data directory), PGPORT (5432), GATEWAY_ARGS (none), LOG.
# Every cell gets a fresh database (or data directory) and a fresh gateway (release
# build, default flags but --pg-listen off and --log warn). CPU per request: utime+stime of the gateway and
# of every Postgres process (with the backends its postmaster reaped) over the run.
# Results: the median of the rounds.
set -euo pipefail
[ -z "${LOG:-}" ] || LOG=$(realpath -m "$LOG")
cd "$(dirname "$0")/../.."

ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
CLIENTS=${CLIENTS:-16 64}
WORKLOADS=${WORKLOADS:-plain keyed cas fresh txn2 txn8}
BACKEND=${BACKEND:-postgres}
PGPORT=${PGPORT:-5432}
read -r -a GATEWAY_ARGS <<<"${GATEWAY_ARGS:-}"
LOG=${LOG:-${TMPDIR:-/tmp}/keyed-and-txn-$(date +%Y%m%d-%H%M%S).log}
DB=fg_bench_keyed
WORK=$(mktemp -d)

die() { echo "keyed-and-txn: $*" >&2; exit 1; }
for tool in wrk psql curl python3; do
  command -v "$tool" >/dev/null || die "$tool is missing (apt-get install -y postgresql-client wrk curl python3)"
done

cargo build --release --quiet -p fencegate-gateway --bin fencegate
BIN=target/release/fencegate
PSQL=(psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PGPORT" -U postgres)

GATEWAY_PID=
cleanup() {
  [ -z "$GATEWAY_PID" ] || kill "$GATEWAY_PID" 2>/dev/null || true
  "${PSQL[@]}" -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# One script per workload. Keys are unique per thread and request; resources random.
cat >"$WORK/common.lua" <<'LUA'
local counter = 0
local thread_id = 0
local value = string.rep("v", 128)
setup = function(thread)
  thread_id = thread_id + 1
  thread:set("id", thread_id)
end
init = function(args)
  math.randomseed(os.time() + (id or 0) * 7919)
end
local function resource() return "r" .. math.random(0, 99) end
local function key() return "k" .. math.random(0, 999999) end
function next_key()
  counter = counter + 1
  return (id or 0) .. "-" .. counter .. "-" .. math.random(0, 2147483647)
end
function put()
  return wrk.format("PUT", "/v1/kv/" .. resource() .. "/" .. key(), {["Fencing-Token"] = "1"}, value)
end
function keyed_put()
  return wrk.format("PUT", "/v1/kv/" .. resource() .. "/" .. key(),
    {["Fencing-Token"] = "1", ["Idempotency-Key"] = next_key()}, value)
end
local versions = {}
local turn = 0
function cas_put()
  turn = turn % 1000 + 1
  local key = "t" .. (id or 0) .. "-" .. turn
  local headers = {["Fencing-Token"] = "1"}
  local version = versions[key]
  if version then
    headers["If-Match"] = '"' .. version .. '"'
  else
    headers["If-None-Match"] = "*"
  end
  return wrk.format("PUT", "/v1/kv/cas" .. ((id or 0) % 100) .. "/" .. key, headers, value)
end
function cas_seen(status, body)
  if status == 200 or status == 201 then
    local key, version = string.match(body, '"key":"([^"]*)".-"version":(%d+)')
    if key then versions[key] = version end
  end
end
function fresh_put()
  counter = counter + 1
  return wrk.format("PUT", "/v1/kv/n" .. (id or 0) .. "-" .. counter .. "-" .. math.random(0, 2147483647) .. "/k",
    {["Fencing-Token"] = "1"}, value)
end
function txn(n)
  local ops, seen, i = {}, {}, 0
  while i < n do
    local r = resource()
    if not seen[r] then
      seen[r] = true
      i = i + 1
      ops[i] = '{"op":"put","resource":"' .. r .. '","key":"' .. key() .. '","token":1,"value":"' .. value .. '"}'
    end
  end
  return wrk.format("POST", "/v1/txn", {["Content-Type"] = "application/json"},
    '{"operations":[' .. table.concat(ops, ",") .. ']}')
end
done = function(summary, latency, requests)
  local errors = summary.errors.status + summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout
  io.write(string.format("RESULT %d %.0f %.0f %.0f %d\n", summary.requests,
    latency:percentile(50), latency:percentile(99), summary.duration, errors))
end
LUA
for workload in plain keyed cas fresh txn2 txn8; do
  {
    cat "$WORK/common.lua"
    case $workload in
      plain) echo 'request = function() return put() end' ;;
      keyed) echo 'request = function() return keyed_put() end' ;;
      cas) printf '%s\n' 'request = function() return cas_put() end' \
        'response = function(status, headers, body) cas_seen(status, body) end' ;;
      fresh) echo 'request = function() return fresh_put() end' ;;
      txn2) echo 'request = function() return txn(2) end' ;;
      txn8) echo 'request = function() return txn(8) end' ;;
    esac
  } >"$WORK/$workload.lua"
done

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ticks_of() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
postgres_ticks() {
  local total=0 pid
  for pid in $(pgrep -x postgres || true); do
    total=$((total + $(awk '{print $14 + $15 + $16 + $17}' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}

run_cell() { # run_cell WORKLOAD CLIENTS -> "req/s p50 p99 gw_us pg_us"
  local workload=$1 clients=$2 port
  local store
  case $BACKEND in
    postgres)
      "${PSQL[@]}" -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" >/dev/null
      store=(--database-url "postgres://postgres@127.0.0.1:$PGPORT/$DB")
      ;;
    embedded)
      rm -rf "$WORK/data"
      store=(--data-dir "$WORK/data")
      ;;
    *) die "BACKEND must be postgres or embedded" ;;
  esac
  port=$(free_port)
  setsid "$BIN" --listen "127.0.0.1:$port" --pg-listen off --log warn \
    "${store[@]}" "${GATEWAY_ARGS[@]}" >>"$LOG" 2>&1 &
  GATEWAY_PID=$!
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && break
    sleep 0.1
  done
  local gw0 pg0 out
  gw0=$(ticks_of "$GATEWAY_PID"); pg0=$(postgres_ticks)
  out=$(wrk -t 2 -c "$clients" -d "${DURATION}s" --latency -s "$WORK/$workload.lua" "http://127.0.0.1:$port" 2>&1)
  local gw1 pg1
  gw1=$(ticks_of "$GATEWAY_PID"); pg1=$(postgres_ticks)
  echo "$out" >>"$LOG"
  kill "$GATEWAY_PID"; wait "$GATEWAY_PID" 2>/dev/null || true; GATEWAY_PID=
  local line; line=$(grep '^RESULT' <<<"$out") || die "wrk failed: $out"
  read -r _ requests p50 p99 micros errors <<<"$line"
  [ "$errors" -eq 0 ] || die "$workload at $clients clients: $errors errors (see $LOG)"
  local hz; hz=$(getconf CLK_TCK)
  python3 - "$requests" "$micros" "$p50" "$p99" "$((gw1 - gw0))" "$((pg1 - pg0))" "$hz" <<'PY'
import sys
requests, micros, p50, p99, gw, pg, hz = map(float, sys.argv[1:])
per = 1e6 / hz / requests
print(f"{requests / micros * 1e6:.0f} {p50:.0f} {p99:.0f} {gw * per:.0f} {pg * per:.0f}")
PY
}

declare -A results
for round in $(seq "$ROUNDS"); do
  for clients in $CLIENTS; do
    for workload in $WORKLOADS; do
      results[$workload,$clients]+="$(run_cell "$workload" "$clients");"
      echo "round $round: $workload at $clients clients done" >&2
    done
  done
done

echo "| workload | clients | req/s | writes/s | p50 µs | p99 µs | gateway CPU µs/req | Postgres CPU µs/req |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
for clients in $CLIENTS; do
  for workload in $WORKLOADS; do
    python3 - "$workload" "$clients" "${results[$workload,$clients]}" <<'PY'
import statistics, sys
workload, clients, runs = sys.argv[1], sys.argv[2], [r.split() for r in sys.argv[3].split(";") if r]
med = [statistics.median(float(r[i]) for r in runs) for i in range(5)]
ops = {"txn2": 2, "txn8": 8}.get(workload, 1)
print(f"| {workload} | {clients} | {med[0]:.0f} | {med[0] * ops:.0f} | {med[1]:.0f} | {med[2]:.0f} | {med[3]:.0f} | {med[4]:.0f} |")
PY
  done
done
