#!/usr/bin/env bash
# What the Postgres door costs against pgbouncer (session mode) and against no relay at
# all: pgbench against one Postgres straight (`direct`), through pgbouncer
# (`pgbouncer`) and through the gateway's door (`door`), in interleaved rounds, median
# of the rounds per cell.
#
#   tests/bench/pg-door.sh                              # the full matrix, about 21 minutes
#   ROUNDS=1 DURATION=2 CLIENTS=8 MODES=prepared WORKLOADS=select tests/bench/pg-door.sh
#
# Settings (environment):
#   ROUNDS      rounds per cell (3)            DURATION   seconds per pgbench run (5)
#   CLIENTS     "1 8 32"                       MODES      "simple extended prepared"
#   WORKLOADS   "select fenced-update tpcb"    LOG        raw pgbench output (a file in /tmp)
#   FENCEGATE_BIN  the gateway binary (target/release/fencegate, built if missing)
#   PGPORT      the Postgres on 127.0.0.1, user postgres, trust (5432)
#   MAX_STEAL   a run with more of the CPU stolen by the hypervisor, in percent, is
#               run again (10)             TRIES      most runs of one cell (3)
#
# Workloads, all on a database this script creates (`pgbench -i -s 1`, then all four
# pgbench tables protected under resource `bench`) and drops at exit:
#   select         pgbench -S: reads only, so the relay's cost alone;
#   fenced-update  BEGIN; SELECT fencegate.fence('bench', 1); UPDATE pgbench_accounts ...;
#                  COMMIT: every client presents token 1 of one resource (share locks);
#   tpcb           pgbench's TPC-B, the token per connection: PGOPTIONS='-c fencegate.token=1'.
#
# Every cell is pgbench -M MODE -c CLIENTS -j 2 (-j 1 for one client) -T DURATION -P 1.
# Every target gets the same treatment, so that only the relay differs:
# - pgbench runs with -n everywhere; the maintenance pgbench would do before a built-in
#   script (VACUUM of branches and tellers, TRUNCATE of history) is done by this script
#   straight to Postgres before every run, so it is neither measured nor relayed.
# - pgbouncer uses each server connection once (server_lifetime = 0): like the door, it
#   gives every client connection a new Postgres backend, and no session state (a token,
#   a prepared statement) is left behind for the next client.
# - pgbouncer 1.18 cannot forward the `options` start-up parameter: it is told to ignore
#   it (ignore_startup_parameters), and its tpcb runs connect to an alias whose server
#   connections run `SET fencegate.token = 1` first (connect_query): the same session
#   token on the same kind of connection.
# - Neither relay logs connections (gateway --log warn, pgbouncer log_connections = 0).
# - Both relays speak plain TCP to Postgres: pgbouncer's server_tls_sslmode is `disable`
#   by default, and the door is given `sslmode=disable` (its default, `prefer`, would
#   encrypt the server leg wherever Postgres offers TLS).
# - The order of the three targets rotates from round to round.
#
# Steal time (tests/bench/steal.sh) is measured over every run; a run above MAX_STEAL
# is repeated, up to TRIES runs, and the table shows the median steal of each cell's
# kept runs, so that a cell measured on a busy host can be told apart.
#
# CPU per transaction is the relay process's utime+stime (/proc/PID/stat, all threads)
# over the pgbench run, connection set-up included, divided by the transactions pgbench
# counted; its resolution is one clock tick (10 ms) per run.
#
# The script stops at the first run that fails: pgbench's exit status, a "failed"
# count above 0, a run that does not end, a relay that died. The raw output of every
# run is in $LOG.
set -euo pipefail
# Paths given relative to where the script was started from.
[ -z "${FENCEGATE_BIN:-}" ] || FENCEGATE_BIN=$(realpath -m "$FENCEGATE_BIN")
[ -z "${LOG:-}" ] || LOG=$(realpath -m "$LOG")
cd "$(dirname "$0")/../.."
# shellcheck source=steal.sh
. tests/bench/steal.sh

ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
CLIENTS=${CLIENTS:-1 8 32}
MODES=${MODES:-simple extended prepared}
WORKLOADS=${WORKLOADS:-select fenced-update tpcb}
PGPORT=${PGPORT:-5432}
LOG=${LOG:-${TMPDIR:-/tmp}/pg-door-$(date +%Y%m%d-%H%M%S).log}
FENCEGATE_BIN=${FENCEGATE_BIN:-}
DB=fg_bench_pgdoor
HOST=127.0.0.1
TOKEN=1
TARGETS=(direct pgbouncer door)

die() { echo "pg-door: $*" >&2; exit 1; }

# --- Settings and tools -------------------------------------------------------------

[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer, not '$ROUNDS'"
[[ $DURATION =~ ^[1-9][0-9]*$ ]] || die "DURATION must be a positive integer (seconds), not '$DURATION'"
for c in $CLIENTS; do
  [[ $c =~ ^[1-9][0-9]*$ ]] || die "CLIENTS must be positive integers, not '$c'"
done
for m in $MODES; do
  [[ $m =~ ^(simple|extended|prepared)$ ]] || die "MODES: unknown mode '$m' (simple, extended, prepared)"
done
for w in $WORKLOADS; do
  [[ $w =~ ^(select|fenced-update|tpcb)$ ]] || die "WORKLOADS: unknown workload '$w' (select, fenced-update, tpcb)"
done
[ -n "$CLIENTS" ] && [ -n "$MODES" ] && [ -n "$WORKLOADS" ] || die "CLIENTS, MODES and WORKLOADS must not be empty"

for tool in psql pgbench pg_isready python3 timeout getconf; do
  command -v "$tool" >/dev/null || die "$tool is missing (psql, pgbench, pg_isready: postgresql-client)"
done
if ! command -v pgbouncer >/dev/null; then
  [ "$(id -u)" -eq 0 ] || die "pgbouncer is missing: apt-get install -y pgbouncer"
  echo "pg-door: installing pgbouncer" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null
fi

if [ -z "$FENCEGATE_BIN" ]; then
  FENCEGATE_BIN=target/release/fencegate
  if [ ! -x "$FENCEGATE_BIN" ]; then
    echo "pg-door: building $FENCEGATE_BIN" >&2
    cargo build --release -p fencegate-gateway
  fi
fi
[ -x "$FENCEGATE_BIN" ] || die "FENCEGATE_BIN '$FENCEGATE_BIN' is not an executable"

pg_isready -q -h "$HOST" -p "$PGPORT" -U postgres || die "no Postgres accepting connections on $HOST:$PGPORT"
ADMIN_URL="postgres://postgres@$HOST:$PGPORT/postgres"
URL="postgres://postgres@$HOST:$PGPORT/$DB"
DOOR_URL="$URL?sslmode=disable"
TICK_US=$(( 1000000 / $(getconf CLK_TCK) ))

# --- Clean-up on any exit -----------------------------------------------------------

WORK=$(mktemp -d)
DOOR_PID=
BOUNCER_RUNNER_PID=
DB_CREATED=

# stop PID NAME: SIGTERM, then SIGKILL if it has not exited within 5 s.
stop() {
  local pid=$1 name=$2
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  echo "pg-door: $name ($pid) did not stop on SIGTERM; killing it" >&2
  kill -KILL "$pid" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  [ -n "$DOOR_PID" ] && stop "$DOOR_PID" "the gateway"
  if [ -s "$WORK/pgbouncer.pid" ]; then
    stop "$(cat "$WORK/pgbouncer.pid")" pgbouncer
  fi
  [ -n "$BOUNCER_RUNNER_PID" ] && stop "$BOUNCER_RUNNER_PID" "pgbouncer's runuser"
  wait 2>/dev/null
  if [ -n "$DB_CREATED" ]; then
    psql "$ADMIN_URL" -qX -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" \
      || echo "pg-door: could not drop database $DB" >&2
  fi
  if [ "$rc" -ne 0 ]; then
    for f in door.log pgbouncer.log; do
      [ -s "$WORK/$f" ] && { echo "--- last lines of $f:" >&2; tail -n 20 "$WORK/$f" >&2; }
    done
    echo "pg-door: failed (exit $rc); raw output in $LOG" >&2
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_ready PORT PID NAME: until a Postgres start-up through PORT gets an answer.
wait_ready() {
  local port=$1 pid=$2 name=$3
  for _ in $(seq 150); do
    kill -0 "$pid" 2>/dev/null || die "$name exited during start-up"
    pg_isready -q -h "$HOST" -p "$port" -U postgres -d "$DB" && return 0
    sleep 0.1
  done
  die "$name did not accept connections on port $port within 15 s"
}

# cpu_ticks PID: utime + stime of the process, all threads, in clock ticks.
cpu_ticks() {
  local stat
  stat=$(cat "/proc/$1/stat") || die "process $1 is gone"
  # Fields after "pid (comm) ": state is the 1st, utime the 12th, stime the 13th.
  stat=${stat##*) }
  awk '{ print $12 + $13 }' <<<"$stat"
}

psql_db() { psql "$URL" -qX -v ON_ERROR_STOP=1 "$@"; }

: >"$LOG"

# --- The database -------------------------------------------------------------------

echo "pg-door: creating database $DB (pgbench -i -s 1), protecting the pgbench tables" >&2
psql "$ADMIN_URL" -qX -v ON_ERROR_STOP=1 -c "SET client_min_messages = warning" \
  -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB"
DB_CREATED=1
pgbench -i -s 1 -q -h "$HOST" -p "$PGPORT" -U postgres "$DB" >>"$LOG" 2>&1 || die "pgbench -i failed (see $LOG)"
for table in pgbench_accounts pgbench_branches pgbench_tellers pgbench_history; do
  "$FENCEGATE_BIN" protect "$table" --resource bench --database-url "$URL" >>"$LOG" 2>&1 \
    || die "fencegate protect $table failed (see $LOG)"
done
psql_db -c "SELECT fencegate.fence('bench', $TOKEN)" >/dev/null

cat >"$WORK/fenced-update.sql" <<SQL
\set aid random(1, 100000 * :scale)
BEGIN;
SELECT fencegate.fence('bench', $TOKEN);
UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;
COMMIT;
SQL

# --- The relays ---------------------------------------------------------------------

BOUNCER_PORT=$(free_port)
cat >"$WORK/userlist.txt" <<EOF
"postgres" ""
EOF
cat >"$WORK/pgbouncer.ini" <<EOF
[databases]
$DB = host=$HOST port=$PGPORT dbname=$DB
${DB}_token = host=$HOST port=$PGPORT dbname=$DB connect_query='SET fencegate.token = $TOKEN'

[pgbouncer]
listen_addr = $HOST
listen_port = $BOUNCER_PORT
unix_socket_dir =
pidfile = $WORK/pgbouncer.pid
auth_type = trust
auth_file = $WORK/userlist.txt
pool_mode = session
server_lifetime = 0
max_client_conn = 200
default_pool_size = 64
ignore_startup_parameters = options
log_connections = 0
log_disconnections = 0
EOF
RUN_AS=()
if [ "$(id -u)" -eq 0 ]; then
  # pgbouncer refuses to run as root.
  id postgres >/dev/null 2>&1 || die "running as root and there is no postgres user to run pgbouncer as"
  chown -R postgres "$WORK"
  RUN_AS=(runuser -u postgres --)
fi
"${RUN_AS[@]}" pgbouncer "$WORK/pgbouncer.ini" >"$WORK/pgbouncer.log" 2>&1 &
BOUNCER_RUNNER_PID=$!
wait_ready "$BOUNCER_PORT" "$BOUNCER_RUNNER_PID" pgbouncer
[ -s "$WORK/pgbouncer.pid" ] || die "pgbouncer wrote no pidfile"
BOUNCER_PID=$(cat "$WORK/pgbouncer.pid")

DOOR_PORT=$(free_port)
"$FENCEGATE_BIN" --database-url "$DOOR_URL" --listen 127.0.0.1:0 --pg-listen "$HOST:$DOOR_PORT" --log warn \
  >"$WORK/door.log" 2>&1 &
DOOR_PID=$!
wait_ready "$DOOR_PORT" "$DOOR_PID" "the gateway"

# --- Runs ---------------------------------------------------------------------------

# before_run WORKLOAD: what pgbench would do before a built-in script, straight to Postgres.
before_run() {
  case $1 in
    select | tpcb)
      psql_db -c "SET fencegate.token = $TOKEN" -c "TRUNCATE pgbench_history" \
        -c "VACUUM pgbench_branches" -c "VACUUM pgbench_tellers" >/dev/null
      ;;
  esac
}

# run ROUND WORKLOAD MODE CLIENTS TARGET [TRY]: one pgbench run, again if too much of
# it was stolen; appends a line to results.
run() {
  local round=$1 workload=$2 mode=$3 clients=$4 target=$5 try=${6:-1}
  local port=$PGPORT db=$DB pid= options=
  case $target in
    pgbouncer) port=$BOUNCER_PORT; pid=$BOUNCER_PID ;;
    door) port=$DOOR_PORT; pid=$DOOR_PID ;;
  esac
  local script=()
  case $workload in
    select) script=(-b select-only) ;;
    fenced-update) script=(-f "$WORK/fenced-update.sql") ;;
    tpcb)
      script=(-b tpcb-like)
      options="-c fencegate.token=$TOKEN"
      [ "$target" = pgbouncer ] && db=${DB}_token
      ;;
  esac
  local threads=$(( clients < 2 ? clients : 2 ))
  before_run "$workload"
  [ -z "$pid" ] || kill -0 "$pid" 2>/dev/null || die "$target ($pid) is no longer running"
  local cpu0=0 cpu1=0
  [ -n "$pid" ] && cpu0=$(cpu_ticks "$pid")
  local out rc=0 stat0
  stat0=$(cpu_stat)
  out=$(PGOPTIONS=$options timeout --kill-after=10 $(( DURATION + 60 )) \
        pgbench -h "$HOST" -p "$port" -U postgres -n -M "$mode" -c "$clients" -j "$threads" \
        -T "$DURATION" -P 1 "${script[@]}" "$db" 2>&1) || rc=$?
  [ -n "$pid" ] && cpu1=$(cpu_ticks "$pid")
  local steal; steal=$(steal_pct "$stat0" "$(cpu_stat)")
  {
    echo "=== round=$round workload=$workload mode=$mode clients=$clients target=$target exit=$rc"
    echo "$out"
  } >>"$LOG"
  local what="round $round: $workload -M $mode -c $clients via $target"
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || die "$what did not end within $(( DURATION + 60 )) s"
  [ "$rc" -eq 0 ] || { echo "$out" | tail -n 20 >&2; die "$what: pgbench exited with status $rc"; }
  local tps lat txs failed
  tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' <<<"$out")
  lat=$(sed -n 's/^latency average = \([0-9.]*\) ms$/\1/p' <<<"$out")
  txs=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$out")
  failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' <<<"$out")
  [ -n "$tps" ] && [ -n "$lat" ] && [ -n "$txs" ] && [ -n "$failed" ] \
    || { echo "$out" | tail -n 20 >&2; die "$what: could not read tps, latency and counts"; }
  [ "$failed" -eq 0 ] || { echo "$out" | tail -n 20 >&2; die "$what: $failed failed transactions"; }
  [ "$txs" -gt 0 ] || die "$what: no transactions"
  # A second of the run with no transaction at all is a stall worth seeing.
  if grep -Eq '^progress: .* 0\.0 tps' <<<"$out"; then
    echo "pg-door: warning: $what had a second without any transaction (see $LOG)" >&2
  fi
  local cpu=-
  if [ -n "$pid" ]; then
    kill -0 "$pid" 2>/dev/null || die "$what: $target died"
    cpu=$(awk -v t="$(( (cpu1 - cpu0) * TICK_US ))" -v n="$txs" 'BEGIN { printf "%.2f", t / n }')
  fi
  printf 'pg-door: %-52s %9.0f tps %8.3f ms  cpu/tx %s us  steal %s %%\n' \
    "$what" "$tps" "$lat" "$cpu" "$steal" >&2
  if too_stolen "$steal" "$try"; then
    echo "pg-door: $what: $steal % stolen, above MAX_STEAL=$MAX_STEAL; again" >&2
    run "$round" "$workload" "$mode" "$clients" "$target" $(( try + 1 ))
    return
  fi
  echo "$workload $mode $clients $target $round $tps $lat $txs $cpu $steal" >>"$WORK/results"
}

started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
for round in $(seq "$ROUNDS"); do
  # Rotate the order, so that each target takes each place in turn.
  order=()
  for i in 0 1 2; do order+=("${TARGETS[$(( (i + round - 1) % 3 ))]}"); done
  for workload in $WORKLOADS; do
    for mode in $MODES; do
      for clients in $CLIENTS; do
        for target in "${order[@]}"; do
          run "$round" "$workload" "$mode" "$clients" "$target"
        done
      done
    done
  done
done

# --- Report -------------------------------------------------------------------------

pg_version=$(psql "$ADMIN_URL" -XAtc "SHOW server_version")
echo
echo "Started $started; $ROUNDS round(s) of $DURATION s per cell, median of the rounds."
echo "$(pgbench --version); $(pgbouncer --version | head -n 1); PostgreSQL $pg_version; $(nproc) cores."
echo "Gateway: $FENCEGATE_BIN. Raw output: $LOG"
echo
python3 - "$WORK/results" "$WORKLOADS" "$MODES" "$CLIENTS" <<'PY'
import statistics, sys
from collections import defaultdict

results, workloads, modes, clients = sys.argv[1], *(a.split() for a in sys.argv[2:])
runs = defaultdict(dict)  # (workload, mode, clients, target) -> round -> (tps, lat, cpu, steal)
for line in open(results):
    w, m, c, t, r, tps, lat, _txs, cpu, steal = line.split()
    runs[(w, m, int(c), t)][int(r)] = (float(tps), float(lat), None if cpu == "-" else float(cpu), float(steal))

def median(key, i):
    values = [v[i] for v in runs[key].values() if v[i] is not None]
    return statistics.median(values) if values else None

print("| workload | mode | clients | direct tps | pgbouncer tps | door tps | door/pgbouncer | door/direct "
      "| door/pgbouncer by round | direct ms | pgbouncer ms | door ms | pgbouncer CPU µs/tx | door CPU µs/tx "
      "| steal % |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
misses = []
for w in workloads:
    for m in modes:
        for c in map(int, clients):
            d, b, g = ((w, m, c, t) for t in ("direct", "pgbouncer", "door"))
            tps = {k: median(k, 0) for k in (d, b, g)}
            lat = {k: median(k, 1) for k in (d, b, g)}
            by_round = [runs[g][r][0] / runs[b][r][0] for r in sorted(runs[g])]
            vs_bouncer = tps[g] / tps[b]
            if vs_bouncer < 1.0:
                misses.append(f"{w} -M {m} -c {c}: {vs_bouncer:.2f}")
            spread = f"{min(by_round):.2f}–{max(by_round):.2f}" if len(by_round) > 1 else "-"
            print(f"| {w} | {m} | {c} | {tps[d]:,.0f} | {tps[b]:,.0f} | {tps[g]:,.0f} | {vs_bouncer:.2f} "
                  f"| {tps[g] / tps[d]:.2f} | {spread} | {lat[d]:.3f} | {lat[b]:.3f} | {lat[g]:.3f} "
                  f"| {median(b, 2):.1f} | {median(g, 2):.1f} "
                  f"| {statistics.median(v[3] for k in (d, b, g) for v in runs[k].values()):.0f} |")
print()
if misses:
    print(f"door < 1.0 × pgbouncer (tps) in {len(misses)} cell(s): " + "; ".join(misses))
else:
    print("door ≥ 1.0 × pgbouncer (tps) in every cell")
PY

# The gateway logs at warn: anything it logged is worth a look, as are pgbouncer's warnings.
if [ -s "$WORK/door.log" ]; then
  echo
  echo "The gateway logged $(wc -l <"$WORK/door.log") line(s); the first:"
  head -n 20 "$WORK/door.log"
fi
if grep -Eq ' (WARNING|ERROR|FATAL) ' "$WORK/pgbouncer.log"; then
  echo
  echo "pgbouncer logged warnings or errors; the first:"
  grep -E ' (WARNING|ERROR|FATAL) ' "$WORK/pgbouncer.log" | head -n 20
fi
