#!/usr/bin/env bash
# bench/instr.sh: the CPU instructions each server of bench/peers spends per
# HTTP request, counted under valgrind's callgrind: a figure that the other
# load on a shared virtual machine does not move (its req/s swing by half
# from one second to the next), and the same for each side of a comparison.
#
#   bench/instr.sh                                  # the default modes
#   MODES="bare governor ours-mem-noheaders" bench/instr.sh
#   BASE_REV=main bench/instr.sh                    # also that revision's ours-* modes
#
# For each mode: the server (bench/peers, release) runs under callgrind on
# REDIS_CPU's neighbour core; `wrk -t1 -c50` warms it up for 2 s, the
# counters are dumped and dropped, `wrk` runs DUR more seconds, and the
# instructions of every thread of the server over that run are divided by
# the requests wrk made. The `bare` mode (no limiter) is the floor: a
# limiter's own cost per request is its mode's figure less bare's. Printed:
# each mode's instructions per request, its cost over bare, and the
# like-for-like ratios of bench/run.sh's HTTP targets, both as whole
# requests (what req/s follows, less wrk's own share) and as the limiters'
# own cost. Redis modes use a private redis-server (its instructions are not
# counted here: see bench/lua.sh and bench/run.sh's Redis CPU part).
#
# Environment: MODES (bare governor governor-headers ours-mem
# ours-mem-noheaders trlr ours-redis-noheaders ours-redis), DUR (4 s),
# BASE_REV (unset: none), SERVER_CPU (1), LOAD_CPU (0), OUT (a folder for
# the raw outputs; default a new temporary one), CARGO_TARGET_DIR (where
# bench/peers builds; default bench/peers/target). Needs valgrind, wrk,
# redis-server, cargo, git; every run is bounded in time and targets
# 127.0.0.1 only, and everything it starts it stops.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS=$ROOT/bench/peers
MODES=${MODES-bare governor governor-headers ours-mem ours-mem-noheaders trlr ours-redis-noheaders ours-redis}
DUR=${DUR:-4}
SERVER_CPU=${SERVER_CPU:-1}
LOAD_CPU=${LOAD_CPU:-0}
BASE_REV=${BASE_REV:-}
OUT=${OUT:-$(mktemp -d -t tower-ratelimit-instr.XXXXXX)}
mkdir -p "$OUT/bin"

LOG_TAG=instr
# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"
need valgrind valgrind
need callgrind_control valgrind
need wrk wrk
need redis-server redis-server
need redis-cli redis-tools
need cargo "rustup (https://rustup.rs)"
need git git
need curl curl

TARGET=$(peers_target "$PEERS")
if [ -n "$BASE_REV" ]; then build_base_server "$BASE_REV"; fi
log "building bench/peers (release)"
(cd "$PEERS" && CARGO_TARGET_DIR=$TARGET cargo build --release --quiet --bin tower-ratelimit-peers)
cp "$TARGET/release/tower-ratelimit-peers" "$OUT/bin/server"

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --daemonize no --loglevel warning >"$OUT/redis.log" 2>&1 &
PIDS+=($!)
URL=redis://127.0.0.1:$REDIS_PORT/
for _ in $(seq 50); do redis-cli -p "$REDIS_PORT" PING >/dev/null 2>&1 && break; sleep 0.1; done

# instructions per request of one server binary in one mode
measure() {
  local bin=$1 mode=$2 name=$3 port vp dir res n ir f x
  port=$(free_port)
  dir=$OUT/cg-$name; rm -rf "$dir"; mkdir -p "$dir"
  taskset -c "$SERVER_CPU" valgrind --tool=callgrind --callgrind-out-file="$dir/cg.%p" \
    "$bin" "$mode" "$port" "$URL" >"$dir/server.log" 2>&1 &
  vp=$!; PIDS+=($vp)
  for _ in $(seq 600); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
  taskset -c "$LOAD_CPU" wrk -t1 -c50 -d2s "http://127.0.0.1:$port/" >/dev/null 2>&1
  # what came before (start-up, warm-up) is dumped and dropped
  callgrind_control -d "$vp" >/dev/null 2>&1; sleep 0.5
  mkdir -p "$dir/before"; mv "$dir"/cg.* "$dir/before/" 2>/dev/null || true
  res=$(taskset -c "$LOAD_CPU" wrk -t1 -c50 -d"${DUR}s" "http://127.0.0.1:$port/" 2>&1)
  callgrind_control -d "$vp" >/dev/null 2>&1; sleep 0.5
  kill "$vp" 2>/dev/null || true; wait "$vp" 2>/dev/null || true
  n=$(awk '/requests in/ {print $1}' <<<"$res")
  ir=0
  for f in "$dir"/cg.*.[0-9]*; do
    [ -f "$f" ] || continue
    x=$(awk '/^(summary|totals):/ {ir=$2} END {print ir+0}' "$f"); ir=$((ir + x))
  done
  if [ -z "$n" ] || [ "$n" = 0 ] || [ "$ir" = 0 ]; then
    echo "instr $name failed: see $dir" >&2; return 1
  fi
  echo "instr $name requests=$n non2xx=$(awk '/Non-2xx/ {print $NF}' <<<"$res" | grep . || echo 0) per_request=$((ir / n))" | tee -a "$OUT/results.txt"
}

: >"$OUT/results.txt"
for mode in $MODES; do
  log "$mode"
  measure "$OUT/bin/server" "$mode" "$mode"
  if [ -n "$BASE_REV" ] && [[ $mode == ours-* ]]; then
    measure "$OUT/bin/base-server" "$mode" "base:$mode"
  fi
done

python3 - "$OUT/results.txt" <<'PY'
import re, sys
per = {}
for line in open(sys.argv[1]):
    m = re.match(r'instr (\S+) requests=(\d+) non2xx=(\d+) per_request=(\d+)', line)
    if m:
        per[m.group(1)] = int(m.group(4))
print()
print('Instructions per HTTP request, server side (callgrind, wrk -t1 -c50)')
print()
bare = per.get('bare')
print('| mode | per request | over bare |')
print('|---|---|---|')
for mode, v in per.items():
    print(f'| {mode} | {v:,} | {v - bare:,} |' if bare else f'| {mode} | {v:,} | |')
pairs = [
    ('in memory, both with headers', 'governor-headers', 'ours-mem'),
    ('in memory, both without headers', 'governor', 'ours-mem-noheaders'),
    ('over Redis, no fields on grants', 'trlr', 'ours-redis-noheaders'),
    ('over Redis, our fields on', 'trlr', 'ours-redis'),
]
pairs += [(f'{m} against the base revision', f'base:{m}', m) for m in per if f'base:{m}' in per]
rows = [(what, a, b) for what, a, b in pairs if a in per and b in per]
if rows:
    print()
    print('| comparison | ours / theirs per request | limiter alone (over bare) |')
    print('|---|---|---|')
    for what, a, b in rows:
        alone = f'{(per[b] - bare) / (per[a] - bare):.2f}' if bare and per[a] > bare else ''
        print(f'| {what}: {b} / {a} | {per[b] / per[a]:.3f} | {alone} |')
PY
log "raw outputs in $OUT"
