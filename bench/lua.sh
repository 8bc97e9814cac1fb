#!/usr/bin/env bash
# bench/lua.sh: Redis server time per decision of the lua/ library, next to
# tower-rate-limit-redis' script (the "peer"), without HTTP around it.
#
#   bench/lua.sh                     # the work tree's lua/, 3 interleaved rounds
#   bench/lua.sh main HEAD~3         # also the library of these git revisions
#   bench/lua.sh /tmp/variant        # or of a folder holding the lua/ files
#   ROUNDS=5 ALGS="gcra log" bench/lua.sh
#   CALLGRIND=1 N=20000 bench/lua.sh # instructions per call instead of time
#   BATCH=32 CALLGRIND=1 N=2000 bench/lua.sh main # batches of 32 decisions a call
#
# One private redis-server (pinned to REDIS_CPU, no persistence) gets the
# library of each version exactly as RedisStore loads it (what
# `cargo run --example lua_library` prints: lua/ assembled by build.rs, as
# Function `tower_ratelimit_<sha16>`, flagged allow-oom before 0.2.0), only one at a time (the
# Lua garbage collector's work grows with the code loaded), the peer's
# script (SCRIPT LOAD), and, as floors, an empty Function and an empty
# script.
# bench/lua_load.py (pinned to LOAD_CPU) then sends N calls from C clients,
# one in flight each, over a pool of KEYS keys, after N/10 calls of warm-up
# on a flushed server:
#
#   peer:  EVALSHA <sha> 1 k<i> 65535 1          (capacity 65535, 1 ms)
#   gcra:  FCALL <fn> 1 bench:{k<i>}:hello:gcra 3:65535:1:1000:0:1
#   tb:    ... :tb   2:65535:1:1000:0:1           (65535, 1000 per s)
#   fw:    ... :fw   4:65535:1000000:0:0:1        (65535 per s)
#   sw:    ... :sw   5:65535:1000000:1:0:1        (65535 per s)
#   log:   FCALL <fn> 2 ...:log ...:meta 1:1000:1000000:0:0:1 (1000 per s)
#   gcra-stored: FCALL <fn> 2 ...:gcra bench:q:hello c3:65535:1:1000:0:1
#          (the GCRA limit with `Limit::quota_from_store`, nothing kept)
#   gcra-kept: the same with its quota kept in the hash bench:q:hello
#   gcra-override: the same with overrides kept for 100 keys (a hash the
#          Lua VM mirrors whole), gcra-override-all: for every key (a hash
#          too large to mirror: each decision reads its key's override)
#
# the quotas of bench/peers (`ours-redis*` modes), the arguments as
# `Limit::wire()` and `RedisStore::encode` write them for one check of cost
# 1, in the wire of each version: shown as before the wire's fourth
# parameter slot went (always 0); a library with `OPT_NOW` in it (its wire
# written from src/algorithm/wire.rs) gets them without it,
# `3:65535:1:1000:1`. Each round runs peer, then each algorithm for each version, with the
# peer again before every algorithm, so that every figure has a peer figure
# measured just before it. Reported: usec_per_call of FCALL or EVALSHA in
# INFO commandstats per run, then per mode the median over rounds, the
# median of its ratios to the peer run before it, and the lowest figure with
# its ratio to the peer's lowest (other load on the machine only ever adds).
#
# With CALLGRIND=1 the server runs under valgrind's callgrind, collecting
# only inside fcallCommand and evalShaCommand, and the figure is instructions
# per call: slow (use a small N) but insensitive to the other load on the
# machine.
#
# Environment: ROUNDS (3), N (200000), C (50), KEYS (10000), BATCH (1: one
# decision a call; see batched below), ALGS (gcra tb fw
# sw log; gcra-stored, gcra-kept, gcra-override and gcra-override-all on
# request), FLOOR (1:
# also the empty Function and script), REDIS_CPU (0),
# LOAD_CPU (1), OUT (raw outputs; default a new temporary folder). Needs
# redis-server, redis-cli, python3, taskset, and valgrind for CALLGRIND.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-3}
N=${N:-200000}
C=${C:-50}
KEYS=${KEYS:-10000}
ALGS=${ALGS:-gcra tb fw sw log}
FLOOR=${FLOOR:-1}
REDIS_CPU=${REDIS_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
CALLGRIND=${CALLGRIND:-0}
OUT=${OUT:-$(mktemp -d -t tower-ratelimit-lua.XXXXXX)}
mkdir -p "$OUT"
PEER_SCRIPT=${PEER_SCRIPT:-$(ls ~/.cargo/registry/src/*/tower-rate-limit-redis-1.0.2/scripts/rate_limit.lua 2>/dev/null | head -1 || true)}
[ -f "$PEER_SCRIPT" ] || { echo "the peer's rate_limit.lua is missing: set PEER_SCRIPT, or run cargo fetch in bench/peers" >&2; exit 1; }
FILES="common sliding_log token_bucket gcra fixed_window sliding_window wire driver"

log() { printf '[lua %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

PORT=$(free_port)
SERVER_PID=
cleanup() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null || true; }
trap cleanup EXIT
if [ "$CALLGRIND" = 1 ]; then
  taskset -c "$REDIS_CPU" valgrind --tool=callgrind --collect-atstart=no \
    --toggle-collect=fcallCommand --toggle-collect=evalShaCommand \
    --callgrind-out-file="$OUT/callgrind.%p" \
    redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --loglevel warning >"$OUT/redis.log" 2>&1 &
else
  taskset -c "$REDIS_CPU" redis-server --port "$PORT" --bind 127.0.0.1 --save '' \
    --appendonly no --loglevel warning >"$OUT/redis.log" 2>&1 &
fi
SERVER_PID=$!
rc() { redis-cli -p "$PORT" "$@"; }
for _ in $(seq 300); do rc PING >/dev/null 2>&1 && break; sleep 0.1; done
rc PING >/dev/null

# The library of a version ("work": the work tree; a git revision; or a
# folder: a checkout, or one holding the lua/ files), as RedisStore loads it
# (`cargo run --example lua_library` prints it), in $OUT/<version>.lib;
# prints the function's name. Revisions from before build.rs assembled the
# library are the lua/ files concatenated, as RedisStore did then.
make_library() {
  local rev=$1 lib tree
  lib=$OUT/$(echo "$rev" | tr -c 'A-Za-z0-9_.\n-' _).lib
  if [ "$rev" = work ]; then tree=$ROOT
  elif [ -d "$rev" ]; then tree=$rev
  else
    tree=$OUT/tree-$(echo "$rev" | tr -c 'A-Za-z0-9_.\n-' _)
    mkdir -p "$tree"
    git -C "$ROOT" archive "$rev" | tar -x -C "$tree"
  fi
  if [ -f "$tree/build.rs" ]; then
    # each tree builds in a target folder of its own: one shared with the
    # work tree can give every tree the work tree's library
    local target=$ROOT/target
    [ "$tree" = "$ROOT" ] || target=$ROOT/target/lua-bench/$(basename "$lib" .lib)
    (cd "$tree" && CARGO_TARGET_DIR=$target cargo run -q --example lua_library) >"$lib"
  else
    local code=${lib%.lib}.code name dir=$tree
    [ -d "$tree/lua" ] && dir=$tree/lua
    # (revisions before lua/wire.lua have no such file)
    for f in $FILES; do cat "$dir/$f.lua" 2>/dev/null || true; done >"$code"
    name=tower_ratelimit_$(sha1sum "$code" | cut -c1-16)
    { printf '#!lua name=%s\n' "$name"; cat "$code"; printf '\n'
      printf "redis.register_function{function_name = '%s', callback = decide, flags = { 'allow-oom' }}\n" "$name"
    } >"$lib"
  fi
  sed -n '1s/^#!lua name=//p' "$lib"
}

VERSIONS=(work "$@")
declare -A FN LIB WIRE
for v in "${VERSIONS[@]}"; do
  FN[$v]=$(make_library "$v")
  LIB[$v]=$OUT/$(echo "$v" | tr -c 'A-Za-z0-9_.\n-' _).lib
  WIRE[$v]=1
  grep -q OPT_NOW "${LIB[$v]}" && WIRE[$v]=2
  log "version $v: ${FN[$v]} (wire ${WIRE[$v]})"
done

# the arguments in the wire of version $1 (see the top): without the
# fourth parameter slot for wire 2
in_wire() {
  if [ "${WIRE[$1]}" = 2 ]; then
    sed -E 's/(^| )(c?[1-5]:[0-9]+:[0-9]+:[0-9]+):0:([0-9]*)( |$)/\1\2:\3\4/g'
  else
    cat
  fi
}
printf "#!lua name=bench_empty\nredis.register_function{function_name = 'bench_empty', callback = function() return '' end, flags = { 'allow-oom' }}\n" >"$OUT/empty.lib"
PEER_SHA=$(rc -x SCRIPT LOAD <"$PEER_SCRIPT")
EMPTY_SHA=$(rc SCRIPT LOAD "return ''")

# Only the library a run calls is loaded while it runs, as on a server of
# one deployment: the Lua garbage collector's work grows with what is loaded.
load_only() {
  rc FUNCTION FLUSH >/dev/null
  [ -n "$1" ] && rc -x FUNCTION LOAD <"$1" >/dev/null
  return 0
}

# the command of a mode, {k} standing for the key number
command_of() {
  local mode=$1 alg fn
  case $mode in
    peer) echo "EVALSHA $PEER_SHA 1 k{k} 65535 1"; return ;;
    empty-fcall) echo "FCALL bench_empty 1 bench:{k{k}}:hello:gcra 3:65535:1:1000:0:1"; return ;;
    empty-eval) echo "EVALSHA $EMPTY_SHA 1 bench:{k{k}}:hello:gcra 3:65535:1:1000:0:1"; return ;;
  esac
  alg=${mode##*/}
  fn=${FN[${mode%/*}]}
  case $alg in
    gcra) echo "FCALL $fn 1 bench:{k{k}}:hello:gcra 3:65535:1:1000:0:1" ;;
    tb) echo "FCALL $fn 1 bench:{k{k}}:hello:tb 2:65535:1:1000:0:1" ;;
    fw) echo "FCALL $fn 1 bench:{k{k}}:hello:fw 4:65535:1000000:0:0:1" ;;
    sw) echo "FCALL $fn 1 bench:{k{k}}:hello:sw 5:65535:1000000:1:0:1" ;;
    log) echo "FCALL $fn 2 bench:{k{k}}:hello:log bench:{k{k}}:hello:meta 1:1000:1000000:0:0:1" ;;
    gcra-stored | gcra-kept | gcra-override | gcra-override-all) echo "FCALL $fn 2 bench:{k{k}}:hello:gcra bench:q:hello c3:65535:1:1000:0:1" ;;
    *) echo "unknown algorithm $alg" >&2; exit 1 ;;
  esac | in_wire "${mode%/*}" | batched
}

# With BATCH=B above 1, the call of one decision becomes a batch of B
# decisions of its limit (op 7, as the coalescer sends them), each on keys
# of its own: `FCALL fn <B*nk> <keys 1>..<keys B> o:0:0:0:0:7 #<nk>:1:<B>
# <limit>`; the figures are then per call (per B decisions).
batched() {
  local line
  read -r line
  if [ "${BATCH:-1}" -le 1 ] || [[ $line != FCALL* ]]; then echo "$line"; return; fi
  python3 -c '
import sys
b = int(sys.argv[1]); words = sys.argv[2].split()
fn, nk = words[1], int(words[2])
keys, spec = words[3:3 + nk], words[3 + nk:]
batch = [k.replace("}:", "}:%d:" % j, 1) for j in range(b) for k in keys]
print(" ".join(["FCALL", fn, str(b * nk)] + batch + ["o:0:0:0:0:7", "#%d:%d:%d" % (nk, len(spec), b)] + spec))
' "$BATCH" "$line"
}

# usec_per_call (or, under callgrind, instructions per call) of FCALL and
# EVALSHA since the last reset
figure() {
  if [ "$CALLGRIND" = 1 ]; then
    local calls dump
    calls=$(rc INFO commandstats | tr -d '\r' | awk -F'[:,=]' '/^cmdstat_(fcall|evalsha):/ {c+=$3} END {print c+0}')
    callgrind_control -d "$SERVER_PID" >/dev/null 2>&1
    dump=$(ls -t "$OUT"/callgrind.* | head -1)
    awk -v calls="$calls" '/^(summary|totals):/ {ir=$2} END {printf "%.0f", ir/calls}' "$dump"
    [ -n "${KEEP_DUMPS:-}" ] && mv "$dump" "$OUT/kept.$(date +%s%N)" || rm -f "$dump"
  else
    rc INFO commandstats | tr -d '\r' |
      awk -F'[:,=]' '/^cmdstat_(fcall|evalsha):/ {c+=$3; u+=$5} END {if (c) printf "%.3f", u/c; else printf "-"}'
  fi
}

run() {
  local mode=$1 round=$2 cmd rps fig
  cmd=$(command_of "$mode")
  case $mode in
    peer | empty-eval) load_only "" ;;
    empty-fcall) load_only "$OUT/empty.lib" ;;
    *) load_only "${LIB[${mode%/*}]}" ;;
  esac
  rc FLUSHALL >/dev/null
  # the quota a `gcra-kept` limit finds kept (its own, as `stored_form` writes it)
  case $mode in
    */gcra-kept) echo "HSET bench:q:hello '' 3:65535:1:1000:0:" | in_wire "${mode%/*}" | rc >/dev/null ;;
    */gcra-override | */gcra-override-all)
      local n=100
      [ "${mode##*/}" = gcra-override-all ] && n=$KEYS
      for i in $(seq 0 $((n - 1))); do
        echo "HSET bench:q:hello bench:{k$i}:hello:gcra 3:65535:1:1000:0:"
      done | in_wire "${mode%/*}" | rc >/dev/null ;;
  esac
  # shellcheck disable=SC2086
  taskset -c "$LOAD_CPU" python3 "$ROOT/bench/lua_load.py" "$PORT" $((N / 10)) "$C" "$KEYS" $cmd >/dev/null
  rc CONFIG RESETSTAT >/dev/null
  [ "$CALLGRIND" = 1 ] && callgrind_control -z "$SERVER_PID" >/dev/null 2>&1
  # shellcheck disable=SC2086
  rps=$(taskset -c "$LOAD_CPU" python3 "$ROOT/bench/lua_load.py" "$PORT" "$N" "$C" "$KEYS" $cmd)
  fig=$(figure)
  printf '%s %s %s %s\n' "$round" "$mode" "$fig" "$rps" >>"$OUT/runs.txt"
  log "round $round $mode: $fig per call ($rps calls/s)"
}

MODES=()
[ "$FLOOR" = 1 ] && MODES+=(empty-eval empty-fcall)
for alg in $ALGS; do for v in "${VERSIONS[@]}"; do MODES+=("$v/$alg"); done; done
: >"$OUT/runs.txt"
for round in $(seq "$ROUNDS"); do
  for mode in "${MODES[@]}"; do
    run peer "$round"
    run "$mode" "$round"
  done
done

# per mode: the median figure and the median of its ratios to the peer run
# just before; and, less sensitive to other load on the machine, the lowest
# figure and its ratio to the peer's lowest
python3 - "$OUT/runs.txt" <<'EOF'
import statistics, sys
runs = [line.split() for line in open(sys.argv[1])]
figures, ratios, order = {}, {}, []
peer = None
for _, mode, fig, _ in runs:
    fig = float(fig)
    if mode == "peer":
        peer = fig
    else:
        ratios.setdefault(mode, []).append(fig / peer)
    if mode not in figures:
        order.append(mode)
    figures.setdefault(mode, []).append(fig)
low_peer = min(figures["peer"])
print("%-16s %6s %10s %8s %10s %8s" % ("mode", "runs", "median", "x peer", "lowest", "x peer"))
for mode in order:
    f = figures[mode]
    r = statistics.median(ratios[mode]) if mode in ratios else 1.0
    print("%-16s %6d %10.3f %8.2f %10.3f %8.2f" % (mode, len(f), statistics.median(f), r, min(f), min(f) / low_peer))
EOF
log "raw figures in $OUT/runs.txt"
