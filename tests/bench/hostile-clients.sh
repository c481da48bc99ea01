#!/usr/bin/env bash
# Honest writers next to hostile clients: wrk's throughput and p99 for small fenced PUTs
# from 127.0.0.1, alone and while other peers
#   - ask for a 1 MiB object on 200 connections and never read (HTTP/1.1);
#   - declare 1 MiB bodies on 64 connections from 127.0.0.2, send one byte and stall;
#   - declare bodies on 64 connections from 127.0.0.3 and send nothing;
# each hostile connection is replaced by a new one every 5 s.
# Interleaved rounds, embedded store, with CPU per honest request and the gateway's RSS
# at rest and at its peak.
#
#   tests/bench/hostile-clients.sh [ROUNDS] [SECONDS]     (defaults: 3 rounds of 8 s)
#   HOSTILE=get tests/bench/hostile-clients.sh            (one kind of hostile client)
#   GATEWAY_FLAGS="--max-response-memory 32MiB" tests/bench/hostile-clients.sh
#
# Needs wrk, python3 and a release build (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}
SECONDS_PER_RUN=${2:-8}
HOSTILE=${HOSTILE:-get,slow,idle}   # which hostile clients run: any of get, slow, idle
BIN=${FENCEGATE:-target/release/fencegate}
[ -x "$BIN" ] || { echo "build first: cargo build --release" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT

cat >"$WORK/put.lua" <<'LUA'
local n = 0
request = function()
  n = n + 1
  return wrk.format("PUT", "/v1/kv/honest/k" .. (n % 1000), {["Fencing-Token"] = "1"}, string.rep("v", 256))
end
LUA

"$BIN" --listen 127.0.0.1:0 --data-dir "$WORK/data" --log-format json --max-body 2MiB ${GATEWAY_FLAGS:-} \
  >/dev/null 2>"$WORK/log" &
PID=$!
until grep -q '"fencegate ready"' "$WORK/log" 2>/dev/null; do sleep 0.05; done
PORT=$(sed -n 's/.*"addr":"127.0.0.1:\([0-9]*\)".*/\1/p' "$WORK/log" | head -1)
head -c 1048576 /dev/zero | curl -s -X PUT "http://127.0.0.1:$PORT/v1/kv/big/obj" \
  -H 'Fencing-Token: 1' --data-binary @- >/dev/null

cat >"$WORK/hostile.py" <<'PY'
import socket, sys, threading, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
until = time.time() + seconds
def keep(source, request, count):
    # Each connection sends its request, reads nothing, and is replaced by a new one
    # every 5 s (or as soon as it fails).
    def one():
        while time.time() < until:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            try:
                s.bind((source, 0)); s.connect(("127.0.0.1", port)); s.sendall(request)
                time.sleep(min(5.0, max(0.0, until - time.time())))
            except OSError:
                time.sleep(0.1)
            finally:
                s.close()
    return [threading.Thread(target=one, daemon=True) for _ in range(count)]
get = b"GET /v1/kv/big/obj HTTP/1.1\r\nhost: gw\r\n\r\n"
slow = b"PUT /v1/kv/victim/k HTTP/1.1\r\nhost: gw\r\nfencing-token: 1\r\ncontent-length: 1048576\r\n\r\nx"
idle = b"PUT /v1/kv/victim/k HTTP/1.1\r\nhost: gw\r\nfencing-token: 1\r\ncontent-length: 1000\r\n\r\n"
kinds = sys.argv[3].split(",")
threads = ((keep("127.0.0.1", get, 200) if "get" in kinds else [])
           + (keep("127.0.0.2", slow, 64) if "slow" in kinds else [])
           + (keep("127.0.0.3", idle, 64) if "idle" in kinds else []))
for t in threads: t.start()
time.sleep(seconds)
PY

rss() { awk '/VmRSS/ {print int($2 / 1024)}' "/proc/$PID/status"; }
cpu() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
TICKS=$(getconf CLK_TCK)
echo "RSS at rest: $(rss) MiB"
run() { # run NAME [hostile]: one wrk round; prints its figures
  local name=$1 hostile=${2:-}
  local peak=0 before after out rate p99 requests hpid=
  if [ -n "$hostile" ]; then
    python3 "$WORK/hostile.py" "$PORT" "$((SECONDS_PER_RUN + 3))" "$HOSTILE" &
    hpid=$!
    sleep 2
  fi
  before=$(cpu)
  ( while sleep 0.1; do rss; done ) >"$WORK/rss" 2>/dev/null &
  local spid=$!
  out=$(wrk -t2 -c32 -d"${SECONDS_PER_RUN}s" --latency -s "$WORK/put.lua" "http://127.0.0.1:$PORT")
  after=$(cpu)
  kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null || true
  [ -n "$hpid" ] && { wait "$hpid" 2>/dev/null || true; }
  peak=$(sort -n "$WORK/rss" | tail -1)
  rate=$(echo "$out" | sed -n 's/^Requests\/sec: *\([0-9.]*\)/\1/p')
  p99=$(echo "$out" | sed -n 's/^ *99% *\([0-9.]*[a-z]*\)/\1/p')
  requests=$(echo "$out" | sed -n 's/^ *\([0-9]*\) requests in.*/\1/p')
  local errors
  errors=$(echo "$out" | sed -n 's/^ *Non-2xx or 3xx responses: *\([0-9]*\)/\1/p')
  awk -v n="$name" -v r="$rate" -v p="$p99" -v c="$((after - before))" -v q="$requests" \
      -v t="$TICKS" -v m="$peak" -v e="${errors:-0}" \
    'BEGIN { printf "%-8s %10.0f req/s  p99 %8s  %6.1f us CPU/req  peak RSS %4d MiB  non-2xx %s\n", n, r, p, c / t / q * 1e6, m, e }'
}
for round in $(seq "$ROUNDS"); do
  echo "round $round"
  run alone
  run hostile yes
done
echo "RSS at the end: $(rss) MiB"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^fencegate_(limit_rejections_total|connections_closed_total|response_bytes_pending)' || true
