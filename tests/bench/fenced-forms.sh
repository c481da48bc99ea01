#!/usr/bin/env bash
# Fenced-table writes against their unprotected twins, in every form a writer uses, at
# 1, 16 and 64 clients, with one resource for all clients and with sixteen: pgbench
# -M prepared over the unix socket, interleaved rounds, throughput and the Postgres
# CPU per transaction (every backend, reaped ones included) side by side.
#
#   tests/bench/fenced-forms.sh [ROUNDS] [SECONDS]     (defaults: 3 rounds of 12 s)
#
# Forms (each a one-row UPDATE of a random row):
#   statement   the UPDATE alone; fenced sessions present their token for the session
#               (options=-c fencegate.token=...)
#   fence()     BEGIN; SELECT fencegate.fence(resource, 7); the UPDATE; COMMIT — its
#               twin is BEGIN; the UPDATE; COMMIT
# Resources: `one` — every client writes table fenced (resource bench); `many` — each
# transaction writes one of sixteen tables fenced_1..16 (resources bench-1..16), the
# twins plain_1..16.
#
# Needs pgbench and psql, a Postgres superuser at $PGURL (default
# postgres://postgres@127.0.0.1:5432; the writers connect over $PGHOST, default the
# unix socket /var/run/postgresql) and the fencegate binary ($FENCEGATE, else
# target/release, else target/debug). The writers log in as fg_forms_writer, granted
# bench and bench-* (fencegate grant) and nothing else. synchronous_commit is off in
# these sessions, so that the commit's fsync does not drown the fence's cost.
set -euo pipefail
cd "$(dirname "$0")/../.."

ROUNDS=${1:-3}
SECONDS_PER_RUN=${2:-12}
WARMUP=${WARMUP:-5}
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432}
SOCKET=${PGHOST:-/var/run/postgresql}
DB=fg_bench_forms
WRITER=fg_forms_writer
MANY=16
FENCEGATE=${FENCEGATE:-target/release/fencegate}
[ -x "$FENCEGATE" ] || FENCEGATE=target/debug/fencegate
[ -x "$FENCEGATE" ] || { echo "build fencegate first: cargo build --release" >&2; exit 1; }
WORK=$(mktemp -d)
cleanup() {
  rm -rf "$WORK"
  psql "$PGURL/postgres" -qX -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "DROP ROLE IF EXISTS $WRITER" >/dev/null 2>&1 || true
}
trap cleanup EXIT

psql "$PGURL/postgres" -qX -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" \
  -c "DROP ROLE IF EXISTS $WRITER" -c "CREATE DATABASE $DB" -c "CREATE ROLE $WRITER LOGIN" >/dev/null
URL="$PGURL/$DB"
{
  echo "CREATE TABLE plain (id int PRIMARY KEY, v bigint NOT NULL DEFAULT 0);"
  echo "CREATE TABLE fenced (id int PRIMARY KEY, v bigint NOT NULL DEFAULT 0);"
  echo "INSERT INTO plain (id) SELECT generate_series(1, 10000);"
  echo "INSERT INTO fenced (id) SELECT generate_series(1, 10000);"
  for k in $(seq $MANY); do
    for t in plain fenced; do
      echo "CREATE TABLE ${t}_$k (id int PRIMARY KEY, v bigint NOT NULL DEFAULT 0);"
      echo "INSERT INTO ${t}_$k (id) SELECT generate_series(1, 1000);"
    done
  done
  echo "GRANT SELECT, UPDATE ON ALL TABLES IN SCHEMA public TO $WRITER;"
} | psql "$URL" -qX -v ON_ERROR_STOP=1 >/dev/null
"$FENCEGATE" protect fenced --resource bench --database-url "$URL" >/dev/null
for k in $(seq $MANY); do
  "$FENCEGATE" protect "fenced_$k" --resource "bench-$k" --database-url "$URL" >/dev/null
done
"$FENCEGATE" grant "$WRITER" --resource bench --resource 'bench-*' --database-url "$URL" >/dev/null
{
  echo "SELECT fencegate.fence('bench', 7);"
  for k in $(seq $MANY); do echo "SELECT fencegate.fence('bench-$k', 7);"; done
} | psql "$URL" -qX -v ON_ERROR_STOP=1 >/dev/null
psql "$URL" -qX -c "VACUUM ANALYZE" >/dev/null

# The scripts: DIR/<form>-<twin|fenced>-<one|many>[-k].sql
update() { printf 'UPDATE %s SET v = v + 1 WHERE id = :id;\n' "$1"; }
script() { # script FILE FORM TABLE RESOURCE ROWS
  local fence=""
  [ "$2" = "fence" ] && [ -n "$4" ] && fence="SELECT fencegate.fence('$4', 7);"
  {
    echo "\\set id random(1, $5)"
    if [ "$2" = "fence" ]; then echo "BEGIN;"; [ -n "$fence" ] && echo "$fence"; fi
    update "$3"
    if [ "$2" = "fence" ]; then echo "COMMIT;"; fi
  } >"$1"
}
for form in statement fence; do
  script "$WORK/$form-twin-one.sql" "$form" plain "" 10000
  script "$WORK/$form-fenced-one.sql" "$form" fenced bench 10000
  for k in $(seq $MANY); do
    script "$WORK/$form-twin-many-$k.sql" "$form" "plain_$k" "" 1000
    script "$WORK/$form-fenced-many-$k.sql" "$form" "fenced_$k" "bench-$k" 1000
  done
done
TOKENS="bench=7"
for k in $(seq $MANY); do TOKENS="$TOKENS,bench-$k=7"; done

# Postgres' CPU so far, in clock ticks: every server process, and what the postmaster
# collected from the backends it reaped.
postmaster=$(head -1 "$(psql "$PGURL/postgres" -XAtc 'SHOW data_directory')/postmaster.pid")
pg_ticks() {
  local total=0 pid
  for pid in $(pgrep -P "$postmaster") "$postmaster"; do
    [ -r "/proc/$pid/stat" ] || continue
    total=$((total + $(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  echo $((total + $(awk '{print $16 + $17}' "/proc/$postmaster/stat")))
}
HZ=$(getconf CLK_TCK)

# run FORM KIND RESOURCES CLIENTS: appends "form kind resources clients tps cpu_us" to
# results. Both are measured after the first WARMUP seconds and before the last one, so
# that the backends' start (connecting, loading catalogs, compiling PL/pgSQL) is left out.
run() {
  local files=() options="-c synchronous_commit=off"
  if [ "$3" = one ]; then
    files=(-f "$WORK/$1-$2-one.sql")
  else
    for k in $(seq $MANY); do files+=(-f "$WORK/$1-$2-many-$k.sql"); done
  fi
  if [ "$1" = statement ] && [ "$2" = fenced ]; then options="$options -c fencegate.token=$TOKENS"; fi
  PGOPTIONS="$options" pgbench -h "$SOCKET" -U "$WRITER" "$DB" -n -M prepared -P 1 \
    -c "$4" -j "$(( $4 < 2 ? $4 : 2 ))" -T "$SECONDS_PER_RUN" "${files[@]}" >"$WORK/out" 2>&1 &
  local bench=$! before after
  sleep "$WARMUP"
  before=$(pg_ticks)
  sleep $(( SECONDS_PER_RUN - WARMUP - 1 ))
  after=$(pg_ticks)
  wait "$bench" || { cat "$WORK/out" >&2; exit 1; }
  python3 - "$WORK/out" "$WARMUP" "$(( SECONDS_PER_RUN - 1 ))" "$(( after - before ))" "$HZ" \
    "$1 $2 $3 $4" >>"$WORK/results" <<'PY'
import re, sys
out, start, end, ticks, hz, label = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
per_second = [float(m.group(2)) for m in re.finditer(r"progress: ([0-9.]+) s, ([0-9.]+) tps", open(out).read())
              if start < float(m.group(1)) <= end]
if not per_second:
    sys.exit(f"no progress lines between {start} and {end} s in {out}")
tps = sum(per_second) / len(per_second)
print(label, f"{tps:.1f}", f"{ticks / hz * 1e6 / (tps * (end - start)):.1f}")
PY
}

for round in $(seq "$ROUNDS"); do
  for clients in 1 16 64; do
    echo "round $round of $ROUNDS, $clients clients" >&2
    for resources in one many; do
      for form in statement fence; do
        run "$form" twin "$resources" "$clients"
        run "$form" fenced "$resources" "$clients"
      done
    done
  done
done

echo
echo "pgbench -M prepared over the unix socket, -T $SECONDS_PER_RUN (measured from ${WARMUP} s to the last second), $ROUNDS interleaved rounds, medians;"
echo "Postgres CPU per transaction in µs (all backends); ratio = fenced / twin"
echo
python3 - "$WORK/results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    form, kind, resources, clients, tps, cpu = line.split()
    rows.setdefault((form, resources, int(clients), kind), []).append((float(tps), float(cpu)))
med = {k: (statistics.median(t for t, _ in v), statistics.median(c for _, c in v)) for k, v in rows.items()}
print("| form | resources | clients | twin tps | fenced tps | ratio | twin CPU µs/tx | fenced CPU µs/tx |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for form in ("statement", "fence"):
    for resources in ("one", "many"):
        for clients in (1, 16, 64):
            twin, fenced = med[(form, resources, clients, "twin")], med[(form, resources, clients, "fenced")]
            name = "UPDATE, session token" if form == "statement" else "fence() then UPDATE"
            print(f"| {name} | {resources} | {clients} | {twin[0]:,.0f} | {fenced[0]:,.0f} | "
                  f"{fenced[0] / twin[0]:.2f} × | {twin[1]:.0f} | {fenced[1]:.0f} |")
PY
