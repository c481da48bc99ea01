#!/usr/bin/env bash
# The gateway's memory under an overload of large writes: 300 concurrent 1 MiB PUTs to a
# resource whose fence row another session holds locked for 20 s, so that every write
# waits with its body in memory. Run with the default --max-body-memory (64MiB) and
# with 1GiB (in effect, no bound); prints the peak RSS and the answers.
#
#   tests/bench/overload-memory.sh
#
# Needs psql, python3, Postgres at $PGURL (default postgres://postgres@127.0.0.1:5432)
# and a release build (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/../.."
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432}
BIN=target/release/fencegate
[ -x "$BIN" ] || { echo "build first: cargo build --release" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT

for memory in 64MiB 1GiB; do
  DB=fg_bench_overload
  psql "$PGURL/postgres" -qX -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" 2>/dev/null
  "$BIN" --listen 127.0.0.1:0 --database-url "$PGURL/$DB" --log-format json \
    --max-body-memory "$memory" --backend-timeout 25s >/dev/null 2>"$WORK/log" &
  PID=$!
  until grep -q '"fencegate ready"' "$WORK/log" 2>/dev/null; do sleep 0.05; done
  PORT=$(sed -n 's/.*"addr":"127.0.0.1:\([0-9]*\)".*/\1/p' "$WORK/log" | head -1)
  curl -s -X PUT "http://127.0.0.1:$PORT/v1/kv/big/warm" -H 'Fencing-Token: 1' -d warm >/dev/null
  psql "$PGURL/$DB" -qX -c "BEGIN; SELECT 1 FROM fencegate.fences WHERE resource = 'big' FOR UPDATE; SELECT pg_sleep(20); COMMIT;" >/dev/null &
  sleep 0.5
  python3 - "$PORT" "$PID" "$memory" <<'PY'
import http.client, sys, threading, time
port, pid, memory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
before, peak, statuses, lock = rss(), 0, {}, threading.Lock()
body = b"x" * (1 << 20)
def write(i):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("PUT", f"/v1/kv/big/k{i}", body=body, headers={"Fencing-Token": "1"})
        status = conn.getresponse().status
    except Exception as error:
        status = type(error).__name__
    with lock:
        statuses[status] = statuses.get(status, 0) + 1
threads = [threading.Thread(target=write, args=(i,)) for i in range(300)]
for t in threads: t.start()
while any(t.is_alive() for t in threads):
    peak = max(peak, rss()); time.sleep(0.05)
print(f"--max-body-memory {memory}: RSS {before} MiB before, {peak} MiB at the peak; answers {statuses}")
PY
  kill "$PID"; wait "$PID" 2>/dev/null || true
  psql "$PGURL/postgres" -qX -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" 2>/dev/null
done
