#!/usr/bin/env bash
# The gateway against the tools users know, in interleaved rounds on one Postgres:
#
#   accept  pgbench -M prepared sending the gateway's own fenced write (FENCED_PUT, as
#           `fencegate-bench pgbench-script` prints it) straight to Postgres (`direct`),
#           against wrk sending the same writes as PUT /v1/kv through the gateway
#           (`gateway`): token 1, 128-byte values, random keys over RESOURCES resources.
#   stale   wrk sending stale PUTs (token 1 to a resource whose fence is at 2) to the
#           gateway with its default flags (`gateway-stale`), against wrk sending the same
#           PUTs to a bare hyper server that reads the body and answers 200 (`bare`).
#
#   tests/bench/accept.sh                               # 3 rounds x 5 s, about 6 minutes
#   ROUNDS=1 DURATION=2 CLIENTS=16 RESOURCES=100 tests/bench/accept.sh
#
# Settings (environment):
#   ROUNDS     rounds per cell (3)             DURATION    seconds per run (5)
#   CLIENTS    "1 16 64"                       RESOURCES   "1 100 10000"
#   VALUE      value size in bytes (128)       WORKLOADS   "accept stale"
#   PGPORT     the Postgres on 127.0.0.1, user postgres, trust (5432)
#   MAX_STEAL  a run with more of the CPU stolen by the hypervisor, in percent, is run
#              again (10)                      TRIES       most runs of one cell (3)
#   PIN        1: in the stale workload, the server (bare or gateway) on CPU 0 and wrk
#              on the other CPUs (taskset), so that both servers get the same share
#              of the machine whatever their number of threads (unset: no pinning)
#   SESSION    own: each server (gateway, bare hyper) runs in a session of its own
#              (setsid), so that the kernel's autogroup scheduling shares the CPUs
#              between it and the load generator as it does between Postgres's
#              backends (each of which runs in a session of its own) and as a service
#              manager's own group for a service would; shared: in this script's
#              session, next to wrk, where each thread gets a share of its own
#              (default: own)
#   GATEWAY_ARGS  flags added to every gateway this script starts, split on spaces,
#              e.g. "--threads 2" (none)
#   LOG        raw tool output (a file in /tmp)
#
# pgbench runs with -j 2 (-j 1 for one client) and -n; wrk with -t 2 (-t 1 for one
# connection). The latencies of `direct` come from pgbench's per-transaction log
# (-l). Each gateway cell gets a fresh gateway (release build, --pg-listen off,
# otherwise default flags: logging at info, stale lines capped at 100 a second) on a
# fresh database, as pgbench's does.
# CPU per request is utime+stime (/proc/PID/stat, all threads) of the gateway, and of
# every Postgres server process (with the backends that exited, as their postmaster
# reaped them), over the run, divided by the requests counted; one clock tick (10 ms)
# per run is its resolution. Steal time (tests/bench/steal.sh) is measured over every
# run; a run above MAX_STEAL is repeated, up to TRIES runs, and the table shows the
# median steal of the kept runs. Results: the median of the rounds.
set -euo pipefail
[ -z "${LOG:-}" ] || LOG=$(realpath -m "$LOG")
cd "$(dirname "$0")/../.."
# shellcheck source=steal.sh
. tests/bench/steal.sh

ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
CLIENTS=${CLIENTS:-1 16 64}
RESOURCES=${RESOURCES:-1 100 10000}
VALUE=${VALUE:-128}
WORKLOADS=${WORKLOADS:-accept stale}
PIN=${PIN:-}
SESSION=${SESSION:-own}
read -r -a GATEWAY_ARGS <<<"${GATEWAY_ARGS:-}"
PGPORT=${PGPORT:-5432}
LOG=${LOG:-${TMPDIR:-/tmp}/accept-$(date +%Y%m%d-%H%M%S).log}
DB=fg_bench_accept
WORK=$(mktemp -d)

die() { echo "accept: $*" >&2; exit 1; }
for tool in pgbench wrk psql curl; do
  command -v "$tool" >/dev/null || die "$tool is missing (apt-get install -y postgresql-client wrk curl)"
done
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer"
[[ $DURATION =~ ^[1-9][0-9]*$ ]] || die "DURATION must be a positive integer (seconds)"
case $PIN in
  "") ;;
  1)
    command -v taskset >/dev/null || die "PIN=1 needs taskset (apt-get install -y util-linux)"
    [ "$(nproc)" -ge 2 ] || die "PIN=1 needs at least two CPUs"
    ;;
  *) die "PIN must be 1 or unset" ;;
esac
case $SESSION in
  own) command -v setsid >/dev/null || die "SESSION=own needs setsid (apt-get install -y util-linux)" ;;
  shared) ;;
  *) die "SESSION must be own or shared" ;;
esac

cargo build --release --quiet -p fencegate-gateway -p fencegate-tests --bin fencegate --bin fencegate-bench
BIN=target/release/fencegate
BENCH=target/release/fencegate-bench
PSQL=(psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PGPORT" -U postgres)

GATEWAY_PID= BARE_PID=
cleanup() {
  [ -z "$GATEWAY_PID" ] || kill "$GATEWAY_PID" 2>/dev/null || true
  [ -z "$BARE_PID" ] || kill "$BARE_PID" 2>/dev/null || true
  "${PSQL[@]}" -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

value=$(head -c "$VALUE" /dev/zero | tr '\0' v)
"$BENCH" pgbench-script > "$WORK/statement.sql"

fresh_db() {
  "${PSQL[@]}" -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" >/dev/null
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_gateway() {
  local port; port=$(free_port)
  as_server "$BIN" --listen "127.0.0.1:$port" --pg-listen off \
    --database-url "postgres://postgres@127.0.0.1:$PGPORT/$DB" "${GATEWAY_ARGS[@]}" >>"$LOG" 2>&1 &
  GATEWAY_PID=$!
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && { GATEWAY_URL="http://127.0.0.1:$port"; return; }
    sleep 0.1
  done
  die "the gateway did not get ready (see $LOG)"
}

stop_gateway() { kill "$GATEWAY_PID"; wait "$GATEWAY_PID" 2>/dev/null || true; GATEWAY_PID=; }

# utime+stime in clock ticks of a process (all threads).
ticks_of() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
# The same for every Postgres server process, plus what the postmaster has reaped of
# its children (cutime+cstime): a backend that exits during a run still counts.
postgres_ticks() {
  local total=0 pid
  for pid in $(pgrep -x postgres || true); do
    total=$((total + $(awk '{print $14 + $15 + $16 + $17}' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}

threads() { [ "$1" -gt 1 ] && echo 2 || echo 1; }

# The server under test and the load generator, on CPUs of their own while PINNED is
# set (stale cells with PIN=1), the server in a session of its own with SESSION=own.
# as_server execs, and so do taskset and setsid (setsid forks only when its caller
# leads a process group, and a background job of this script does not), so that $! of
# `as_server … &` is the server's own PID, whose CPU time is measured.
as_server() {
  [ "$SESSION" = shared ] || set -- setsid "$@"
  if [ -n "${PINNED:-}" ]; then exec taskset -c 0 "$@"; else exec "$@"; fi
}
as_client() {
  if [ -n "${PINNED:-}" ]; then taskset -c "1-$(( $(nproc) - 1 ))" "$@"; else "$@"; fi
}

# wrk's Lua: PUT of random keys over $2 resources (or one stale key), printing the
# counts at the end (non2xx: answers other than 2xx and 3xx).
write_lua() { # write_lua FILE RESOURCES STALE(0|1)
  cat >"$1" <<EOF
local value = string.rep("v", $VALUE)
local resources, stale = $2, $3
request = function()
  local path
  if stale == 1 then
    path = "/v1/kv/stale/k"
  else
    path = "/v1/kv/r" .. math.random(resources) .. "/k" .. math.random(1000000)
  end
  return wrk.format("PUT", path, {["Fencing-Token"] = "1", ["Content-Type"] = "application/octet-stream"}, value)
end
done = function(summary, latency, requests)
  io.write(string.format("RESULT requests=%d p50_us=%d p99_us=%d errors=%d non2xx=%d\n",
    summary.requests, latency:percentile(50), latency:percentile(99),
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.errors.status))
end
EOF
}

declare -A RESULTS
record() { RESULTS["$1"]+="$2 "; }

# run_wrk NAME URL CLIENTS LUA PID EXPECT(ok|refused)
run_wrk() {
  local before_gw before_pg before_stat out
  before_gw=$(ticks_of "$5"); before_pg=$(postgres_ticks); before_stat=$(cpu_stat)
  out=$(as_client wrk -t "$(threads "$3")" -c "$3" -d "${DURATION}s" --latency -s "$4" "$2" 2>&1)
  echo "== $1 c=$3: $out" >>"$LOG"
  local line; line=$(grep '^RESULT' <<<"$out") || die "wrk printed no result (see $LOG)"
  local requests p50 p99 errors
  requests=$(sed -E 's/.*requests=([0-9]+).*/\1/' <<<"$line")
  p50=$(sed -E 's/.*p50_us=([0-9]+).*/\1/' <<<"$line")
  p99=$(sed -E 's/.*p99_us=([0-9]+).*/\1/' <<<"$line")
  errors=$(sed -E 's/.*errors=([0-9]+).*/\1/' <<<"$line")
  [ "$errors" = 0 ] || die "$1: wrk saw $errors socket errors (see $LOG)"
  local non2xx; non2xx=$(sed -E 's/.*non2xx=([0-9]+).*/\1/' <<<"$line")
  case $6 in
    ok) [ "$non2xx" = 0 ] || die "$1: $non2xx answers were not 2xx (see $LOG)" ;;
    refused) [ "$non2xx" = "$requests" ] || die "$1: $((requests - non2xx)) stale writes were accepted (see $LOG)" ;;
  esac
  local gw=$(( $(ticks_of "$5") - before_gw )) pg=$(( $(postgres_ticks) - before_pg ))
  local steal; steal=$(steal_pct "$before_stat" "$(cpu_stat)")
  echo "$(( requests / DURATION )) $p50 $p99 $gw $pg $requests $steal"
}

run_pgbench() { # run_pgbench CLIENTS RESOURCES
  local before_pg before_stat out
  before_pg=$(postgres_ticks); before_stat=$(cpu_stat)
  rm -f "$WORK"/pgbench_log.*
  # -l: one line per transaction, its latency in µs in the third column, for the
  # median and p99 (pgbench itself prints only the average).
  out=$(cd "$WORK" && pgbench -n -M prepared -h 127.0.0.1 -p "$PGPORT" -U postgres -c "$1" \
    -j "$(threads "$1")" -T "$DURATION" -D "value=$value" -D "resources=$2" -f "$WORK/direct.sql" \
    -l --log-prefix=pgbench_log "$DB" 2>&1) || die "pgbench failed: $out"
  echo "== direct c=$1 r=$2: $out" >>"$LOG"
  local tps
  tps=$(sed -nE 's/^tps = ([0-9.]+).*/\1/p' <<<"$out" | head -1)
  local requests; requests=$(sed -nE 's/^number of transactions actually processed: ([0-9]+).*/\1/p' <<<"$out")
  local percentiles
  percentiles=$(cat "$WORK"/pgbench_log.* | awk '{print $3}' | sort -n \
    | awk '{a[NR]=$1} END{if (NR == 0) {print "- -"} else {print a[int((NR+1)/2)], a[int((NR*99+99)/100)]}}')
  local pg=$(( $(postgres_ticks) - before_pg ))
  echo "${tps%.*} $percentiles 0 $pg $requests $(steal_pct "$before_stat" "$(cpu_stat)")"
}

{
  echo '\set r random(1, :resources)'
  echo '\set k random(1, 1000000)'
  cat "$WORK/statement.sql"
} >"$WORK/direct.sql"

median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }

# One measurement each; they set `result`.
accept_cell() { # accept_cell TARGET CLIENTS RESOURCES
  fresh_db
  if [ "$1" = direct ]; then
    start_gateway; stop_gateway # creates the schema the statement writes
    result=$(run_pgbench "$2" "$3")
  else
    start_gateway
    result=$(run_wrk gateway "$GATEWAY_URL" "$2" "$WORK/accept.lua" "$GATEWAY_PID" ok)
    stop_gateway
  fi
}
stale_cell() { # stale_cell TARGET CLIENTS
  local PINNED=$PIN
  if [ "$1" = bare ]; then
    local port; port=$(free_port)
    as_server "$BENCH" bare-http --listen "127.0.0.1:$port" >>"$LOG" 2>&1 &
    BARE_PID=$!
    for _ in $(seq 50); do curl -s "http://127.0.0.1:$port/" >/dev/null && break; sleep 0.1; done
    result=$(run_wrk bare "http://127.0.0.1:$port" "$2" "$WORK/stale.lua" "$BARE_PID" ok)
    kill "$BARE_PID"; wait "$BARE_PID" 2>/dev/null || true; BARE_PID=
  else
    fresh_db; start_gateway
    curl -sf -XPUT -H 'Fencing-Token: 2' --data x "$GATEWAY_URL/v1/kv/stale/k" >/dev/null
    result=$(run_wrk gateway-stale "$GATEWAY_URL" "$2" "$WORK/stale.lua" "$GATEWAY_PID" refused)
    stop_gateway
  fi
}
# measured CELL ARGS...: the cell, again while more than MAX_STEAL of the CPU was stolen.
measured() {
  local try=1 steal
  while :; do
    "$@"
    steal=$(awk '{print $7}' <<<"$result")
    too_stolen "$steal" "$try" || return 0
    echo "$*: $steal % of the CPU stolen, above MAX_STEAL=$MAX_STEAL; again" >&2
    try=$((try + 1))
  done
}

for round in $(seq "$ROUNDS"); do
  for c in $CLIENTS; do
    if [[ " $WORKLOADS " == *" accept "* ]]; then
      for r in $RESOURCES; do
        write_lua "$WORK/accept.lua" "$r" 0
        # Alternate which goes first from round to round.
        order=(direct gateway); [ $((round % 2)) = 0 ] && order=(gateway direct)
        for target in "${order[@]}"; do
          measured accept_cell "$target" "$c" "$r"
          record "accept/$target/$c/$r" "$result|"
          echo "round $round accept $target c=$c r=$r: $result" >&2
        done
      done
    fi
    if [[ " $WORKLOADS " == *" stale "* ]]; then
      write_lua "$WORK/stale.lua" 1 1
      order=(bare gateway-stale); [ $((round % 2)) = 0 ] && order=(gateway-stale bare)
      for target in "${order[@]}"; do
        measured stale_cell "$target" "$c"
        record "stale/$target/$c/-" "$result|"
        echo "round $round stale $target c=$c: $result" >&2
      done
    fi
  done
done

# The table: medians of the rounds; CPU in µs per request (10 ms ticks).
[ "${#GATEWAY_ARGS[@]}" = 0 ] || printf '\nGateway flags added: %s\n' "${GATEWAY_ARGS[*]}"
[ -z "$PIN" ] || printf '\nStale cells pinned: the server on CPU 0, wrk on CPUs 1-%s.\n' "$(( $(nproc) - 1 ))"
printf '\nServers %s (SESSION=%s; autogroup scheduling %s).\n' \
  "$([ "$SESSION" = own ] && echo 'each in a session of its own' || echo "in the load generator's session")" "$SESSION" \
  "$([ "$(cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null)" = 1 ] && echo on || echo off)"
printf '\n| workload | target | conc | resources | req/s | p50 µs | p99 µs | gateway CPU µs/req | Postgres CPU µs/req | ratio | steal %% |\n'
printf '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n'
field() { tr '|' '\n' | grep -v '^ *$' | awk -v f="$1" '{print $f}' | median; }
cpu() { tr '|' '\n' | grep -v '^ *$' | awk -v f="$1" '$6 > 0 {printf "%d ", $f * 10000 / $6}' | median; }
for key in $(printf '%s\n' "${!RESULTS[@]}" | sort -t/ -k1,1 -k3,3n -k4,4n -k2,2); do
  IFS=/ read -r workload target c r <<<"$key"
  runs=${RESULTS[$key]}
  rps=$(field 1 <<<"$runs"); p50=$(field 2 <<<"$runs"); p99=$(field 3 <<<"$runs")
  gw=$(cpu 4 <<<"$runs"); pg=$(cpu 5 <<<"$runs")
  case $target in
    gateway) base=${RESULTS["accept/direct/$c/$r"]:-} ;;
    gateway-stale) base=${RESULTS["stale/bare/$c/-"]:-} ;;
    *) base= ;;
  esac
  ratio=
  [ -z "$base" ] || ratio=$(awk -v a="$rps" -v b="$(field 1 <<<"$base")" 'BEGIN{printf "%.2f", a/b}')
  [ "$target" = direct ] && gw=-
  steal=$(field 7 <<<"$runs")
  printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' \
    "$workload" "$target" "$c" "$r" "$rps" "$p50" "$p99" "$gw" "$pg" "$ratio" "$steal"
done
echo "raw output: $LOG"
