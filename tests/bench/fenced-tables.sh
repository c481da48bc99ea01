#!/usr/bin/env bash
# What the in-database fence costs a writer: pgbench on the same table unfenced and
# fenced, a single-row UPDATE autocommitted and a 5-statement transaction, at
# concurrency 1 and 16, in interleaved rounds; then the same UPDATE looped inside the
# server, without a network round trip in between.
#
#   tests/bench/fenced-tables.sh [ROUNDS] [SECONDS]      (defaults: 3 rounds of 5 s)
#
# ROUNDS 0 runs only the in-server loops (IN_SERVER_RUNS of them, default 7).
#
# Needs pgbench and psql, a Postgres at $PGURL (default postgres://postgres@127.0.0.1:5432,
# a superuser) and the fencegate binary ($FENCEGATE, else target/release, else
# target/debug; build it first). The writers log in as role fg_bench_writer, which
# holds resource `bench` (fencegate grant) and nothing else: the fence checks their
# authority as it checks any writer's. The fenced writers present their token for the
# session (options=-c fencegate.token=7); the "fence()" rows call
# SELECT fencegate.fence('bench', 7) first in each transaction instead.
# synchronous_commit is off for these sessions: the fence's cost does not depend on it,
# and the commit's fsync would drown it in noise.
set -euo pipefail
cd "$(dirname "$0")/../.."

ROUNDS=${1:-3}
SECONDS_PER_RUN=${2:-5}
IN_SERVER_RUNS=${IN_SERVER_RUNS:-7}
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432}
DB=fg_bench_fenced
WRITER=fg_bench_writer
FENCEGATE=${FENCEGATE:-target/release/fencegate}
[ -x "$FENCEGATE" ] || FENCEGATE=target/debug/fencegate
[ -x "$FENCEGATE" ] || { echo "build fencegate first: cargo build --release" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

psql "$PGURL/postgres" -qX -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" \
  -c "DROP ROLE IF EXISTS $WRITER" -c "CREATE DATABASE $DB" -c "CREATE ROLE $WRITER LOGIN"
URL="$PGURL/$DB"
# The writer's URL: the superuser's with the writer's name.
WURL="${PGURL%%://*}://$WRITER@${PGURL#*@}/$DB"
psql "$URL" -qX -v ON_ERROR_STOP=1 <<SQL
CREATE TABLE plain (id int PRIMARY KEY, v bigint NOT NULL DEFAULT 0);
CREATE TABLE fenced (id int PRIMARY KEY, v bigint NOT NULL DEFAULT 0);
INSERT INTO plain (id) SELECT generate_series(1, 10000);
INSERT INTO fenced (id) SELECT generate_series(1, 10000);
GRANT SELECT, UPDATE ON plain, fenced TO $WRITER;
SQL
"$FENCEGATE" protect fenced --resource bench --database-url "$URL" >/dev/null
if "$FENCEGATE" grant --help >/dev/null 2>&1; then
  "$FENCEGATE" grant "$WRITER" --resource bench --database-url "$URL" >/dev/null
else # versions before `fencegate grant`: EXECUTE on fence() was all a writer needed
  psql "$URL" -qX -c "GRANT USAGE ON SCHEMA fencegate TO $WRITER" \
    -c "GRANT EXECUTE ON FUNCTION fencegate.fence(text, bigint) TO $WRITER" >/dev/null
fi
psql "$URL" -qX -c "SELECT fencegate.fence('bench', 7)" >/dev/null

update() { printf 'UPDATE %s SET v = v + 1 WHERE id = :id;\n' "$1"; }
for table in plain fenced; do
  { echo '\set id random(1, 10000)'; update "$table"; } >"$WORK/one-$table.sql"
  { echo '\set id random(1, 10000)'; echo 'BEGIN;'; for _ in 1 2 3 4 5; do update "$table"; done; echo 'COMMIT;'; } >"$WORK/five-$table.sql"
done
{ echo '\set id random(1, 10000)'; echo 'BEGIN;'; echo "SELECT fencegate.fence('bench', 7);"; update fenced; echo 'COMMIT;'; } >"$WORK/one-fence.sql"
{ echo '\set id random(1, 10000)'; echo 'BEGIN;'; echo "SELECT fencegate.fence('bench', 7);"; for _ in 1 2 3 4 5; do update fenced; done; echo 'COMMIT;'; } >"$WORK/five-fence.sql"
{ echo '\set id random(1, 10000)'; echo 'BEGIN;'; update plain; echo 'COMMIT;'; } >"$WORK/one-plain-tx.sql"

# run NAME SCRIPT CLIENTS OPTIONS: appends "name clients tps latency_ms" to results.
run() {
  local out
  out=$(PGOPTIONS="-c synchronous_commit=off $4" pgbench "$WURL" -n -M prepared \
        -c "$3" -j "$(( $3 < 2 ? $3 : 2 ))" -T "$SECONDS_PER_RUN" -f "$WORK/$2.sql" 2>&1)
  local tps lat
  tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out")
  lat=$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' <<<"$out")
  [ -n "$tps" ] || { echo "$out" >&2; exit 1; }
  echo "$1 $3 $tps $lat" >>"$WORK/results"
}

TOKEN="-c fencegate.token=7"
if [ "$ROUNDS" -gt 0 ]; then
for round in $(seq "$ROUNDS"); do
  echo "round $round of $ROUNDS" >&2
  for clients in 1 16; do
    run "1-statement unfenced" one-plain "$clients" ""
    run "1-statement fenced" one-fenced "$clients" "$TOKEN"
    run "1-statement fence()" one-fence "$clients" ""
    run "1-statement-in-BEGIN unfenced" one-plain-tx "$clients" ""
    run "5-statement unfenced" five-plain "$clients" ""
    run "5-statement fenced" five-fenced "$clients" "$TOKEN"
    run "5-statement fence()" five-fence "$clients" ""
  done
done

echo
echo "pgbench -M prepared, -T $SECONDS_PER_RUN, $ROUNDS interleaved rounds; median of the rounds"
echo
echo "| workload | clients | tps | latency avg (ms) |"
echo "|---|---|---|---|"
python3 - "$WORK/results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    *name, clients, tps, lat = line.split()
    rows.setdefault((" ".join(name), int(clients)), []).append((float(tps), float(lat)))
med = {k: (statistics.median(t for t, _ in v), statistics.median(l for _, l in v)) for k, v in rows.items()}
for (name, clients), (tps, lat) in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"| {name} | {clients} | {tps:,.0f} | {lat:.3f} |")
print()
for clients in (1, 16):
    one = (med[("1-statement fenced", clients)][1] - med[("1-statement unfenced", clients)][1]) * 1000
    five = (med[("5-statement fenced", clients)][1] - med[("5-statement unfenced", clients)][1]) * 1000
    call = (med[("1-statement fence()", clients)][1] - med[("1-statement-in-BEGIN unfenced", clients)][1]) * 1000
    print(f"clients {clients}: fence per transaction {one:+.1f} us (session token); "
          f"per further statement {(five - one) / 4:+.1f} us; "
          f"fence() call per transaction {call:+.1f} us (one more statement, round trip included)")
PY
fi

echo
echo "Inside the server, one session, no round trips (median and range of $IN_SERVER_RUNS interleaved runs):"
psql "$URL" -qX -v ON_ERROR_STOP=1 <<'SQL' >/dev/null
CREATE PROCEDURE tx_plain(n int) LANGUAGE plpgsql AS $$
BEGIN FOR i IN 1..n LOOP UPDATE plain SET v = v + 1 WHERE id = 1 + i % 10000; COMMIT; END LOOP; END $$;
CREATE PROCEDURE tx_fenced(n int) LANGUAGE plpgsql AS $$
BEGIN FOR i IN 1..n LOOP UPDATE fenced SET v = v + 1 WHERE id = 1 + i % 10000; COMMIT; END LOOP; END $$;
CREATE PROCEDURE tx_fence_call(n int) LANGUAGE plpgsql AS $$
BEGIN FOR i IN 1..n LOOP PERFORM fencegate.fence('bench', 7); UPDATE fenced SET v = v + 1 WHERE id = 1 + i % 10000; COMMIT; END LOOP; END $$;
CREATE PROCEDURE st_plain(n int) LANGUAGE plpgsql AS $$
BEGIN FOR i IN 1..n LOOP UPDATE plain SET v = v + 1 WHERE id = 1 + i % 10000; END LOOP; END $$;
CREATE PROCEDURE st_fenced(n int) LANGUAGE plpgsql AS $$
BEGIN FOR i IN 1..n LOOP UPDATE fenced SET v = v + 1 WHERE id = 1 + i % 10000; END LOOP; END $$;
SQL
{
  echo 'SET synchronous_commit = off;'
  echo 'SET fencegate.token = 7;'
  echo '\timing on'
  for _ in $(seq "$IN_SERVER_RUNS"); do
    echo "CALL tx_plain(5000);"
    echo "CALL tx_fenced(5000);"
    echo "CALL tx_fence_call(5000);"
    echo "CALL st_plain(20000);"
    echo "CALL st_fenced(20000);"
  done
} | psql "$WURL" -qX -v ON_ERROR_STOP=1 | sed -n 's/^Time: \([0-9.]*\) ms.*/\1/p' | paste - - - - - | python3 -c '
import statistics, sys
runs = [list(map(float, line.split())) for line in sys.stdin]
def per(i, j, n):  # us per unit of column j minus column i, over the runs
    deltas = [(r[j] - r[i]) * 1000 / n for r in runs]
    return f"{statistics.median(deltas):+.1f} us ({min(deltas):+.1f} to {max(deltas):+.1f})"
def base(i, n):
    return statistics.median(r[i] * 1000 / n for r in runs)
print(f"  a 1-statement transaction takes {base(0, 5000):.1f} us unfenced; the fence adds {per(0, 1, 5000)} "
      f"with a session token, {per(0, 2, 5000)} with a fence() call first")
print(f"  a further statement in a transaction takes {base(3, 20000):.1f} us unfenced; the fence adds {per(3, 4, 20000)}")
'
psql "$PGURL/postgres" -qX -c "DROP DATABASE $DB WITH (FORCE)" -c "DROP ROLE $WRITER"
