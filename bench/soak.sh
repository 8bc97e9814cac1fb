#!/usr/bin/env bash
# bench/soak.sh: the example server (examples/server.rs) under a steady flood
# of mostly refused requests, to see that it does not degrade: requests per
# slice, the server's resident memory after each slice, and the size of its
# log. Bounded in time (SLICES x SLICE of load), on 127.0.0.1 only, over a
# private redis-server of its own.
#
#   bench/soak.sh                        # 3 slices of 20 s
#   SLICES=10 SLICE=60s bench/soak.sh    # longer
#   RUST_LOG=info,tower_ratelimit=debug bench/soak.sh   # a line per refusal
#
# Settings: SLICES (3), SLICE (20s, as wrk's -d), CONNECTIONS (64), THREADS
# (2, wrk's), CLIENTS (50: client addresses sent as X-Forwarded-For, which
# the server believes from 127.0.0.1 through TRUSTED_PROXIES; each gets far
# more than /api/hello's 10 per second, so most requests are refused),
# PROFILE (debug; release builds the example with --release), SERVER (a
# server binary built already, such as an older revision's: no build), OUT (a
# temporary folder: the server's log, wrk's output). RUST_LOG, when set, is
# the server's log filter; else its default.
# Needs wrk (apt-get install -y wrk), redis-server and curl.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOG_TAG=soak
. "$ROOT/bench/lib.sh"
need wrk wrk
need redis-server redis-server
need curl curl
need bc bc

SLICES=${SLICES:-3}
SLICE=${SLICE:-20s}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-2}
CLIENTS=${CLIENTS:-50}
PROFILE=${PROFILE:-debug}
OUT=${OUT:-$(mktemp -d -t soak.XXXXXX)}
mkdir -p "$OUT"

if [ -z "${SERVER:-}" ]; then
  release=()
  [ "$PROFILE" = release ] && release=(--release)
  log "building the example server ($PROFILE)"
  (cd "$ROOT" && cargo build -q "${release[@]}" --all-features --example server)
  SERVER=${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE/examples/server
fi

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --daemonize no --loglevel warning >"$OUT/redis.log" 2>&1 &
PIDS+=($!)

PORT=$(free_port)
TOKEN=soak-$RANDOM$RANDOM
env PORT="$PORT" REDIS_URL="redis://127.0.0.1:$REDIS_PORT/" \
  TRUSTED_PROXIES=127.0.0.1/32 INTERNAL_TOKEN="$TOKEN" \
  "$SERVER" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
PIDS+=("$SERVER_PID")
for _ in $(seq 200); do
  curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null

cat >"$OUT/flood.lua" <<'LUA'
-- GET /api/hello from CLIENTS addresses, one at random per request
local clients = tonumber(os.getenv("CLIENTS")) or 100
request = function()
  local n = math.random(clients)
  local ip = string.format("10.0.%d.%d", math.floor(n / 256), n % 256)
  return wrk.format("GET", "/api/hello", { ["X-Forwarded-For"] = ip })
end
LUA

rss_kib() { awk '/^VmRSS/ { print $2 }' "/proc/$SERVER_PID/status"; }
log_bytes() { stat -c %s "$OUT/server.log"; }
log "server pid $SERVER_PID on port $PORT, redis on $REDIS_PORT, output in $OUT"
printf '%-6s %10s %9s %9s %9s %12s\n' slice requests req/s refused RSS_MiB log_bytes
printf '%-6s %10s %9s %9s %9.1f %12s\n' start - - - "$(echo "$(rss_kib) / 1024" | bc -l)" "$(log_bytes)"
for slice in $(seq "$SLICES"); do
  CLIENTS=$CLIENTS wrk -t"$THREADS" -c"$CONNECTIONS" -d"$SLICE" -s "$OUT/flood.lua" \
    "http://127.0.0.1:$PORT" >"$OUT/wrk-$slice.txt"
  requests=$(awk '/requests in/ { print $1 }' "$OUT/wrk-$slice.txt")
  rate=$(awk '/^Requests\/sec/ { printf "%d", $2 }' "$OUT/wrk-$slice.txt")
  refused=$(awk '/Non-2xx or 3xx responses/ { print $5 }' "$OUT/wrk-$slice.txt")
  printf '%-6s %10s %9s %9s %9.1f %12s\n' "$slice" "$requests" "$rate" "${refused:-0}" \
    "$(echo "$(rss_kib) / 1024" | bc -l)" "$(log_bytes)"
done
# what the limiter counted (the internal token opens /metrics)
curl -fsS -H "Authorization: Bearer $TOKEN" "http://127.0.0.1:$PORT/metrics" \
  | grep '^tower_ratelimit_decisions_total' | sed 's/^/  /' || true
