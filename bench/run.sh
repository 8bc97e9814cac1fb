#!/usr/bin/env bash
# bench/run.sh: tower-ratelimit side by side with its peers on this machine,
# in one run, as ratios. Run it from anywhere in the checkout:
#
#   bench/run.sh                        # 3 interleaved rounds and the slices, about 15 minutes
#   ROUNDS=1 DUR=3 SLICES=4 bench/run.sh  # a quick look
#
# HTTP: `wrk -t1 -c50` against bench/peers in each mode (see its main.rs),
# the modes of a round interleaved, Redis pinned to REDIS_CPU and the server
# and wrk to LOAD_CPU; per mode, req/s and the Redis time per decision
# (the usec of FCALL/EVALSHA in INFO commandstats over the decisions made:
# a call of ours may carry a batch of decisions). API: Limiter::check
# over RedisStore and rate-limiter-flexible (Node) on the same Redis, 50 in
# flight. Prints every figure, then medians and ratios.
#
# Like for like: tower_governor sends headers only with use_headers()
# (mode governor-headers), so it is compared so with ours with the RateLimit
# fields on, and with its default with ours with them off;
# tower-rate-limit-redis sends no fields on a grant, so it is compared with
# ours with them off (ours with them on is reported beside it).
#
# Then, for the HTTP targets and the Redis time of each algorithm, paired
# slices: both servers up, 1 s wrk runs alternating between them, a ratio
# per pair of runs (see below).
#
# Fleet: FLEET (4) processes of each side at once, FLEET_IN_FLIGHT (50)
# decisions in flight each, on the one Redis: decisions/s and the Redis
# server's CPU time (used_cpu_user + used_cpu_sys) per decision.
# Then the same fleet on one hot key, with and without batches
# (HOT_PERMITS, 1000; 0 skips it): decisions/s and Redis calls per decision.
#
# Redis CPU (issue 25): per round, for each CPU_CONNS (50 500) and each of
# CPU_MODES (trlr ours-redis-noheaders ours-redis, interleaved), a fresh
# server, 1 s of warm-up, then `wrk -c<conns> -d$DUR`: the Redis server's
# CPU time (used_cpu_user + used_cpu_sys of INFO cpu) over the run divided
# by the requests wrk made (each one decision), and the decisions per
# FCALL/EVALSHA (the batch size reached; 1 for the peer's one EVALSHA a
# decision). Then latency at one in flight: `wrk -c1 --latency` per mode,
# p50 and p99. BASE_REV (a git revision, e.g. main) also builds that
# revision's bench/peers and runs its ours-* modes as base:<mode> beside
# them: before and after in one run, and in paired slices (ours-mem,
# ours-mem-noheaders, ours-redis-noheaders, ours-redis against their base).
#
# Environment: ROUNDS (3), DUR (5 s per run), REDIS_CPU (0), LOAD_CPU (1),
# FLEET (4; 0 skips it), FLEET_IN_FLIGHT (50), API (1; 0 skips the API
# comparison), CPU_CONNS ("50 500"; empty skips the Redis CPU part),
# CPU_MODES, LAT_MODES (trlr ours-redis-noheaders ours-redis; empty skips
# the latency part), BASE_REV (unset: no base),
# MODES (the HTTP modes), SLICES (16 per pair; 0 skips them), OUT (a folder
# for the raw outputs; default a new temporary one), CARGO_TARGET_DIR (where
# bench/peers builds; default bench/peers/target). Needs redis-server, wrk,
# node/npm, taskset, cargo, git; it says which apt package installs what is
# missing. Everything it starts it stops; every load run is bounded in time
# and targets 127.0.0.1 only.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS=$ROOT/bench/peers
ROUNDS=${ROUNDS:-3}
DUR=${DUR:-5}
REDIS_CPU=${REDIS_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
FLEET=${FLEET:-4}
FLEET_IN_FLIGHT=${FLEET_IN_FLIGHT:-50}
HOT_PERMITS=${HOT_PERMITS:-1000}
API_RUNS=${API:-1}
CPU_CONNS=${CPU_CONNS-50 500}
CPU_MODES=${CPU_MODES-trlr ours-redis-noheaders ours-redis}
LAT_MODES=${LAT_MODES-trlr ours-redis-noheaders ours-redis}
BASE_REV=${BASE_REV:-}
MODES=${MODES-bare governor governor-headers ours-mem ours-mem-noheaders trlr ours-redis ours-redis-noheaders ours-redis-tb ours-redis-fw ours-redis-sw ours-redis-log ours-redis-flood}
OUT=${OUT:-$(mktemp -d -t tower-ratelimit-bench.XXXXXX)}
mkdir -p "$OUT"

LOG_TAG=bench
# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"
need redis-server redis-server
need redis-cli redis-tools
need wrk wrk
need node nodejs
need npm npm
need taskset util-linux
need cargo "rustup (https://rustup.rs)"
need git git

TARGET=$(peers_target "$PEERS")
mkdir -p "$OUT/bin"
# the base first: its binary is copied out before this tree's build
# replaces it in the shared target folder
if [ -n "$BASE_REV" ]; then build_base_server "$BASE_REV"; fi
log "building bench/peers (release) and the Node peer"
(cd "$PEERS" && CARGO_TARGET_DIR=$TARGET cargo build --release --quiet)
cp "$TARGET/release/tower-ratelimit-peers" "$OUT/bin/server"
cp "$TARGET/release/api" "$OUT/bin/api"
(cd "$PEERS/node" && npm ci --no-audit --no-fund --silent)
SERVER=$OUT/bin/server
API_BIN=$OUT/bin/api

REDIS_PORT=$(free_port)
taskset -c "$REDIS_CPU" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --daemonize no --loglevel warning >"$OUT/redis.log" 2>&1 &
PIDS+=($!)
URL=redis://127.0.0.1:$REDIS_PORT/
rc() { redis-cli -p "$REDIS_PORT" "$@"; }
for _ in $(seq 50); do rc PING >/dev/null 2>&1 && break; sleep 0.1; done
log "Redis on port $REDIS_PORT (CPU $REDIS_CPU); load on CPU $LOAD_CPU; results in $OUT"

# Redis time (us) of the decision commands since the last RESETSTAT, per
# decision: divided by $1, the decisions made (a call of ours may carry a
# batch of them, see coalesce_decisions), else per call
decision_usec() {
  rc INFO commandstats | tr -d '\r' | awk -F'[:,=]' -v d="${1:-0}" '/^cmdstat_(fcall|evalsha):/ {calls+=$3; usec+=$5} END {if (d > 0) printf "%.2f", usec/d; else if (calls) printf "%.2f", usec/calls; else printf "-"}'
}
decision_calls() {
  rc INFO commandstats | tr -d '\r' | awk -F'[:,=]' '/^cmdstat_(fcall|evalsha):/ {calls+=$3} END {print calls+0}'
}

http_round() {
  local round=$1 mode port pid rps non2xx
  for mode in $MODES; do
    port=$(free_port)
    taskset -c "$LOAD_CPU" "$SERVER" "$mode" "$port" "$URL" >"$OUT/server-$mode.log" 2>&1 &
    pid=$!; PIDS+=($pid)
    for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.05; done
    taskset -c "$LOAD_CPU" wrk -t1 -c50 -d1s "http://127.0.0.1:$port/" >/dev/null 2>&1 # warm-up
    rc CONFIG RESETSTAT >/dev/null
    taskset -c "$LOAD_CPU" wrk -t1 -c50 -d"${DUR}s" "http://127.0.0.1:$port/" >"$OUT/wrk-$mode-$round.txt" 2>&1
    rps=$(awk '/^Requests\/sec/ {print $2}' "$OUT/wrk-$mode-$round.txt")
    requests=$(awk '/requests in/ {print $1}' "$OUT/wrk-$mode-$round.txt")
    non2xx=$(awk '/Non-2xx/ {print $NF}' "$OUT/wrk-$mode-$round.txt")
    echo "http $mode round=$round rps=$rps redis_usec=$(decision_usec "$requests") redis_calls=$(decision_calls) non2xx=${non2xx:-0}" | tee -a "$OUT/results.txt"
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
}

api_round() {
  local round=$1 ours theirs
  rc CONFIG RESETSTAT >/dev/null
  ours=$(taskset -c "$LOAD_CPU" "$API_BIN" "$URL" "$DUR" 50 | awk '{print $2}')
  local usec; usec=$(decision_usec "$(awk -v r="$ours" -v d="$DUR" 'BEGIN {printf "%d", r * d}')")
  theirs=$(cd "$PEERS/node" && taskset -c "$LOAD_CPU" node bench.js "$URL" "$DUR" 50 | awk '{print $2}')
  echo "api ours round=$round dps=$ours redis_usec=$usec" | tee -a "$OUT/results.txt"
  echo "api rate-limiter-flexible round=$round dps=$theirs" | tee -a "$OUT/results.txt"
}

# The Redis server's CPU time so far (s): used_cpu_user + used_cpu_sys.
redis_cpu() { rc INFO cpu | tr -d '\r' | awk -F: '/^used_cpu_(user|sys):/ {s += $2} END {printf "%.6f", s}'; }

# A fleet, as users run one: FLEET processes of a side at once on the one
# Redis, each with its own connections and FLEET_IN_FLIGHT decisions in
# flight (so each connection's pipelining depth is what one instance
# makes); decisions/s summed, and the Redis server's CPU time over the run
# per decision. Ours, then rate-limiter-flexible run the same way.
fleet_round() {
  local round=$1 side i cpu0 total pids
  for side in ours rate-limiter-flexible; do
    pids=()
    cpu0=$(redis_cpu)
    for i in $(seq "$FLEET"); do
      if [ "$side" = ours ]; then
        taskset -c "$LOAD_CPU" "$API_BIN" "$URL" "$DUR" "$FLEET_IN_FLIGHT" >"$OUT/fleet-$side-$round-$i.txt" &
      else
        (cd "$PEERS/node" && taskset -c "$LOAD_CPU" node bench.js "$URL" "$DUR" "$FLEET_IN_FLIGHT") >"$OUT/fleet-$side-$round-$i.txt" &
      fi
      pids+=($!)
    done
    wait "${pids[@]}"
    total=$(cat "$OUT"/fleet-"$side"-"$round"-*.txt | awk '{s += $2} END {printf "%d", s}')
    echo "fleet $side round=$round dps=$total redis_cpu_us=$(awk -v a="$cpu0" -v b="$(redis_cpu)" -v t="$total" -v d="$DUR" 'BEGIN {if (t > 0) printf "%.2f", (b - a) * 1e6 / (t * d); else printf "-"}')" | tee -a "$OUT/results.txt"
  done
}

# A hot key (issue: one global limit), as a fleet: FLEET processes on one
# key, first each decision in Redis (coalesced: the most one primary
# decides of one key), then the key hot (`Limit::hot`, batches of
# HOT_PERMITS held 100 ms); decisions/s summed, and the library's calls
# per decision.
fcalls() { rc INFO commandstats | tr -d '\r' | awk -F'[=,]' '/^cmdstat_fcall:/ {print $2}'; }
hot_round() {
  local round=$1 side permits i c0 total pids
  for side in one-key hot; do
    permits=0; [ "$side" = hot ] && permits=$HOT_PERMITS
    pids=()
    c0=$(fcalls)
    for i in $(seq "$FLEET"); do
      taskset -c "$LOAD_CPU" "$API_BIN" "$URL" "$DUR" "$FLEET_IN_FLIGHT" 1 "$permits" >"$OUT/hot-$side-$round-$i.txt" &
      pids+=($!)
    done
    wait "${pids[@]}"
    total=$(cat "$OUT"/hot-"$side"-"$round"-*.txt | awk '{s += $2} END {printf "%d", s}')
    echo "hot $side round=$round dps=$total calls_per_decision=$(awk -v a="${c0:-0}" -v b="$(fcalls)" -v t="$total" -v d="$DUR" 'BEGIN {if (t > 0) printf "%.5f", (b - a) / (t * d); else printf "-"}')" | tee -a "$OUT/results.txt"
  done
}

# The binary and mode of the server of `mode` (base:<mode> for the base's).
server_of() {
  if [[ $1 == base:* ]]; then echo "$OUT/bin/base-server ${1#base:}"; else echo "$SERVER $1"; fi
}

# Starts the server of `mode` (base:<mode> for the base's) on a free port;
# sets `port` and `pid`.
start_server() {
  local bin mode
  read -r bin mode <<<"$(server_of "$1")"
  port=$(free_port)
  taskset -c "$LOAD_CPU" "$bin" "$mode" "$port" "$URL" >"$OUT/server-${1//:/-}.log" 2>&1 &
  pid=$!; PIDS+=($pid)
  for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.05; done
}

# The modes of the Redis CPU and latency parts, with the base's ours-* modes.
with_base() {
  local mode
  for mode in "$@"; do
    echo "$mode"
    if [ -n "$BASE_REV" ] && [[ $mode == ours-* ]]; then echo "base:$mode"; fi
  done
}

# A wrk latency figure ("1.23ms", "870.00us", "1.01s") in microseconds.
to_usec() { awk '{v = $1 + 0; if ($1 ~ /us$/) print v; else if ($1 ~ /ms$/) print v * 1e3; else if ($1 ~ /s$/) print v * 1e6; else print "-"}'; }

# Redis CPU per decision over HTTP, at each of CPU_CONNS connections (each
# one request, so one decision, in flight): the Redis server's CPU time
# over the run (used_cpu_user + used_cpu_sys) over the requests made.
cpu_round() {
  local round=$1 conns mode cpu0 cpu1 requests rps non2xx calls clients file
  for conns in $CPU_CONNS; do
    for mode in $(with_base $CPU_MODES); do
      start_server "$mode"
      taskset -c "$LOAD_CPU" wrk -t1 -c"$conns" -d1s "http://127.0.0.1:$port/" >/dev/null 2>&1 # warm-up
      rc CONFIG RESETSTAT >/dev/null
      cpu0=$(redis_cpu)
      file="$OUT/wrk-cpu-${mode//:/-}-c$conns-$round.txt"
      taskset -c "$LOAD_CPU" wrk -t1 -c"$conns" -d"${DUR}s" "http://127.0.0.1:$port/" >"$file" 2>&1
      cpu1=$(redis_cpu)
      # the connections the server holds to Redis (less redis-cli's own)
      clients=$(rc INFO clients | tr -d '\r' | awk -F: '/^connected_clients:/ {print $2 - 1}')
      rps=$(awk '/^Requests\/sec/ {print $2}' "$file")
      requests=$(awk '/requests in/ {print $1}' "$file")
      non2xx=$(awk '/Non-2xx/ {print $NF}' "$file")
      calls=$(decision_calls)
      echo "cpu $mode@$conns round=$round rps=$rps redis_cpu_us=$(awk -v a="$cpu0" -v b="$cpu1" -v n="$requests" 'BEGIN {if (n > 0) printf "%.2f", (b - a) * 1e6 / n; else printf "-"}') redis_usec=$(decision_usec "$requests") per_call=$(awk -v n="$requests" -v c="$calls" 'BEGIN {if (c > 0) printf "%.1f", n / c; else printf "-"}') redis_conns=$clients non2xx=${non2xx:-0}" | tee -a "$OUT/results.txt"
      kill "$pid"; wait "$pid" 2>/dev/null || true
    done
  done
}

# Latency at one request in flight: wrk -c1 --latency, p50 and p99.
latency_round() {
  local round=$1 mode file
  for mode in $(with_base $LAT_MODES); do
    start_server "$mode"
    taskset -c "$LOAD_CPU" wrk -t1 -c1 -d1s "http://127.0.0.1:$port/" >/dev/null 2>&1 # warm-up
    file="$OUT/wrk-lat-${mode//:/-}-$round.txt"
    taskset -c "$LOAD_CPU" wrk -t1 -c1 -d"${DUR}s" --latency "http://127.0.0.1:$port/" >"$file" 2>&1
    echo "lat $mode round=$round rps=$(awk '/^Requests\/sec/ {print $2}' "$file") p50_us=$(awk '$1 == "50%" {print $2}' "$file" | to_usec) p99_us=$(awk '$1 == "99%" {print $2}' "$file" | to_usec)" | tee -a "$OUT/results.txt"
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
}

: >"$OUT/results.txt"
for round in $(seq "$ROUNDS"); do
  log "round $round of $ROUNDS"
  http_round "$round"
  if [ -n "$CPU_CONNS" ]; then cpu_round "$round"; fi
  if [ -n "$LAT_MODES" ]; then latency_round "$round"; fi
  if (( API_RUNS > 0 )); then api_round "$round"; fi
  if (( FLEET > 0 )); then fleet_round "$round"; fi
  if (( FLEET > 0 && HOT_PERMITS > 0 )); then hot_round "$round"; fi
  rc FLUSHALL >/dev/null
done

# Paired slices. The HTTP targets compare two servers a few percent apart,
# less than a shared host drifts between runs seconds apart (in one run
# here, bare served 26k req/s and governor 42k in the next run). So for
# each pair both servers stay up, and 1 s wrk slices alternate between
# them (A B, then B A, and so on): each slice's ratio compares runs at
# most a second apart. The same for the Redis time per decision of each
# algorithm against the peer's. SLICES per pair (0 skips this part).
slices_pair() {
  local a=$1 b=$2 pa pb ida idb i ra rb ua ub sa sb bin mode
  pa=$(free_port); pb=$(free_port)
  read -r bin mode <<<"$(server_of "$a")"
  taskset -c "$LOAD_CPU" "$bin" "$mode" "$pa" "$URL" >"$OUT/server-slices-${a//:/-}.log" 2>&1 &
  ida=$!; PIDS+=($ida)
  read -r bin mode <<<"$(server_of "$b")"
  taskset -c "$LOAD_CPU" "$bin" "$mode" "$pb" "$URL" >"$OUT/server-slices-${b//:/-}.log" 2>&1 &
  idb=$!; PIDS+=($idb)
  for port in "$pa" "$pb"; do
    for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.05; done
    taskset -c "$LOAD_CPU" wrk -t1 -c50 -d1s "http://127.0.0.1:$port/" >/dev/null 2>&1 # warm-up
  done
  # req/s, then the Redis time per decision during the slice ("-" without Redis)
  slice() {
    local out
    rc CONFIG RESETSTAT >/dev/null
    out=$(taskset -c "$LOAD_CPU" wrk -t1 -c50 -d1s "http://127.0.0.1:$1/" 2>&1)
    awk '/^Requests\/sec/ {printf "%s ", $2}' <<<"$out"
    decision_usec "$(awk '/requests in/ {print $1}' <<<"$out")"
  }
  for i in $(seq "$SLICES"); do
    if (( i % 2 )); then sa=$(slice "$pa"); sb=$(slice "$pb"); else sb=$(slice "$pb"); sa=$(slice "$pa"); fi
    read -r ra ua <<<"$sa"; read -r rb ub <<<"$sb"
    echo "slice $b vs=$a slice=$i a_rps=$ra b_rps=$rb a_usec=$ua b_usec=$ub" | tee -a "$OUT/results.txt"
  done
  kill "$ida" "$idb"; wait "$ida" "$idb" 2>/dev/null || true
}
SLICES=${SLICES:-16}
if (( SLICES > 0 )); then
  log "paired slices: $SLICES per pair"
  slices_pair governor-headers ours-mem
  slices_pair governor ours-mem-noheaders
  slices_pair trlr ours-redis-noheaders
  slices_pair trlr ours-redis
  # the Redis time of the other algorithms, against the same peer
  for mode in ours-redis-tb ours-redis-fw ours-redis-sw ours-redis-log; do
    slices_pair trlr "$mode"
  done
  # before and after: this tree against the base revision
  if [ -n "$BASE_REV" ]; then
    for mode in ours-mem ours-mem-noheaders ours-redis-noheaders ours-redis; do
      slices_pair "base:$mode" "$mode"
    done
  fi
  rc FLUSHALL >/dev/null
fi

python3 - "$OUT/results.txt" <<'PY'
import re, statistics, sys
rows = [dict(kv.split('=') for kv in line.split()[2:]) | {'kind': line.split()[0], 'mode': line.split()[1]}
        for line in open(sys.argv[1]) if line.strip()]
def by_round(kind, mode, field):
    return {r['round']: float(r[field]) for r in rows
            if r['kind'] == kind and r['mode'] == mode and r.get(field, '-') not in ('-', '')}
def med(kind, mode, field):
    xs = list(by_round(kind, mode, field).values())
    return statistics.median(xs) if xs else float('nan')
kinds = {r['kind'] for r in rows}
if 'http' in kinds:
    print()
    print('| mode | req/s | x bare | Redis us per decision |')
    print('|---|---|---|---|')
    bare = med('http', 'bare', 'rps')
    for mode in dict.fromkeys(r['mode'] for r in rows if r['kind'] == 'http'):
        print(f"| {mode} | {med('http', mode, 'rps'):,.0f} | {med('http', mode, 'rps') / bare:.2f} | {med('http', mode, 'redis_usec')} |")
print()
def ratio(a, b): return a / b if b else float('nan')
# Each ratio is the median over rounds of that round's ratio: the modes of a
# round run back to back, so a machine that slows down for a minute (a
# shared host) slows both sides of the round's ratio alike, where it would
# skew a ratio of medians taken over different minutes.
def round_ratios(kind, a, b, field):
    xa, xb = by_round(kind, a, field), by_round(kind, b, field)
    return [ratio(xa[k], xb[k]) for k in sorted(xa, key=int) if k in xb]
def paired(kind, a, b, field):
    xs = round_ratios(kind, a, b, field)
    return statistics.median(xs) if xs else float('nan')
def rounds(kind, a, b, field):
    return ' '.join(f"{x:.2f}" for x in round_ratios(kind, a, b, field))
if 'cpu' in kinds:
    print('Redis CPU over HTTP (medians over rounds): the server\'s used_cpu_user + used_cpu_sys over the run per decision')
    print()
    print('| mode @ in flight | req/s | Redis CPU us per decision | decisions per call | Redis connections |')
    print('|---|---|---|---|---|')
    for mode in dict.fromkeys(r['mode'] for r in rows if r['kind'] == 'cpu'):
        print(f"| {mode} | {med('cpu', mode, 'rps'):,.0f} | {med('cpu', mode, 'redis_cpu_us'):.2f} | {med('cpu', mode, 'per_call'):.1f} | {med('cpu', mode, 'redis_conns'):.0f} |")
    print()
if 'lat' in kinds:
    print('Latency at 1 in flight (wrk -c1 --latency; medians over rounds)')
    print()
    print('| mode | req/s | p50 us | p99 us |')
    print('|---|---|---|---|')
    for mode in dict.fromkeys(r['mode'] for r in rows if r['kind'] == 'lat'):
        print(f"| {mode} | {med('lat', mode, 'rps'):,.0f} | {med('lat', mode, 'p50_us'):.0f} | {med('lat', mode, 'p99_us'):.0f} |")
    print()
print('| target | figure (medians) | ratio (median of the rounds\' ratios) | each round |')
print('|---|---|---|---|')
def row(what, kind, a, b, field, unit, goal):
    print(f"| {what} | {med(kind, a, field):,.2f} vs {med(kind, b, field):,.2f} {unit} | {paired(kind, a, b, field):.2f} ({goal}) | {rounds(kind, a, b, field)} |")
# like for like: tower_governor sends its x-ratelimit-* headers only with
# use_headers(), so ours with the RateLimit fields on is compared with it so,
# and ours without them with its default; tower-rate-limit-redis sends no
# fields on a grant, so ours over Redis is compared with its fields off
def have(kind, a, b): return any(r['kind'] == kind and r['mode'] == a for r in rows) and any(r['kind'] == kind and r['mode'] == b for r in rows)
_row = row
def row(what, kind, a, b, field, unit, goal):
    if have(kind, a, b): _row(what, kind, a, b, field, unit, goal)
# Redis CPU per decision over HTTP (issue 25): the server's CPU time over
# the run over the decisions, ours (fields off, like the peer; fields on
# beside it) against tower-rate-limit-redis, and against the base
for conns in dict.fromkeys(r['mode'].split('@')[1] for r in rows if r['kind'] == 'cpu'):
    row(f'Redis CPU us per decision at {conns} in flight, no fields on grants, vs tower-rate-limit-redis', 'cpu', f'ours-redis-noheaders@{conns}', f'trlr@{conns}', 'redis_cpu_us', 'us', 'target <= 0.5')
    row(f'Redis CPU us per decision at {conns} in flight, our fields on, vs tower-rate-limit-redis', 'cpu', f'ours-redis@{conns}', f'trlr@{conns}', 'redis_cpu_us', 'us', 'for comparison')
    row(f'Redis CPU us per decision at {conns} in flight, base, no fields, vs tower-rate-limit-redis', 'cpu', f'base:ours-redis-noheaders@{conns}', f'trlr@{conns}', 'redis_cpu_us', 'us', 'the base')
    row(f'Redis CPU us per decision at {conns} in flight, no fields, vs the base', 'cpu', f'ours-redis-noheaders@{conns}', f'base:ours-redis-noheaders@{conns}', 'redis_cpu_us', 'us', 'lower is better')
    row(f'HTTP req/s at {conns} in flight, no fields on grants, vs tower-rate-limit-redis', 'cpu', f'ours-redis-noheaders@{conns}', f'trlr@{conns}', 'rps', 'req/s', 'for comparison')
row('p99 latency at 1 in flight, no fields, vs tower-rate-limit-redis', 'lat', 'ours-redis-noheaders', 'trlr', 'p99_us', 'us', 'for comparison')
row('p99 latency at 1 in flight, no fields, vs the base', 'lat', 'ours-redis-noheaders', 'base:ours-redis-noheaders', 'p99_us', 'us', 'target <= 1.0')
row('p99 latency at 1 in flight, fields on, vs the base', 'lat', 'ours-redis', 'base:ours-redis', 'p99_us', 'us', 'target <= 1.0')
row('HTTP in memory vs tower_governor, both with headers', 'http', 'ours-mem', 'governor-headers', 'rps', 'req/s', 'target >= 1.0')
row('HTTP in memory vs tower_governor, both without headers', 'http', 'ours-mem-noheaders', 'governor', 'rps', 'req/s', 'target >= 1.0')
row('HTTP over Redis vs tower-rate-limit-redis, no fields on grants', 'http', 'ours-redis-noheaders', 'trlr', 'rps', 'req/s', 'target >= 1.0')
row('HTTP over Redis with our fields on, vs tower-rate-limit-redis', 'http', 'ours-redis', 'trlr', 'rps', 'req/s', 'for comparison, no target')
for mode, limit in [('ours-redis', 1.0), ('ours-redis-tb', 1.0), ('ours-redis-fw', 1.0), ('ours-redis-sw', 1.0), ('ours-redis-log', 2.0)]:
    row(f'Redis us per decision, {mode} vs tower-rate-limit-redis', 'http', mode, 'trlr', 'redis_usec', 'us', f'target <= {limit}')
row('API decisions/s vs rate-limiter-flexible', 'api', 'ours', 'rate-limiter-flexible', 'dps', '', 'target >= 3')
if any(r['kind'] == 'fleet' for r in rows):
    row('Fleet: decisions/s vs rate-limiter-flexible, the same processes', 'fleet', 'ours', 'rate-limiter-flexible', 'dps', '', 'target >= 3')
    row('Fleet: Redis CPU us per decision vs rate-limiter-flexible', 'fleet', 'ours', 'rate-limiter-flexible', 'redis_cpu_us', 'us', 'lower is better')
if any(r['kind'] == 'hot' for r in rows):
    row('Hot key: decisions/s of one key, batches vs each in Redis', 'hot', 'hot', 'one-key', 'dps', '', 'target >= 10')
    print(f"| Hot key: library calls per decision, with batches | {med('hot', 'hot', 'calls_per_decision'):.5f} | (target <= 0.02) | |")
slices = [r for r in rows if r['kind'] == 'slice']
if slices:
    print()
    print('Paired slices (1 s each, the two servers alternating): median of the slices\' ratios, and their quartiles')
    print()
    print('| target | ratio | quartiles | slices |')
    print('|---|---|---|---|')
    for what, a, b, goal in [('HTTP in memory vs tower_governor, both with headers', 'governor-headers', 'ours-mem', '>= 1.0'),
                             ('HTTP in memory vs tower_governor, both without headers', 'governor', 'ours-mem-noheaders', '>= 1.0'),
                             ('HTTP over Redis vs tower-rate-limit-redis, no fields on grants', 'trlr', 'ours-redis-noheaders', '>= 1.0'),
                             ('HTTP over Redis with our fields on, vs tower-rate-limit-redis', 'trlr', 'ours-redis', 'none')]:
        xs = sorted(float(r['b_rps']) / float(r['a_rps']) for r in slices
                    if r['mode'] == b and r['vs'] == a and float(r.get('a_rps') or 0) > 0 and r.get('b_rps'))
        if len(xs) >= 4:
            q = statistics.quantiles(xs, n=4)
            print(f"| {what} | {statistics.median(xs):.2f} (target {goal}) | {q[0]:.2f} to {q[2]:.2f} | {len(xs)} |")
    for mode, limit in [('ours-redis', 1.0), ('ours-redis-tb', 1.0), ('ours-redis-fw', 1.0), ('ours-redis-sw', 1.0), ('ours-redis-log', 2.0)]:
        xs = sorted(float(r['b_usec']) / float(r['a_usec']) for r in slices
                    if r['mode'] == mode and r['vs'] == 'trlr'
                    and r.get('a_usec', '-') not in ('-', '') and r.get('b_usec', '-') not in ('-', '') and float(r['a_usec']) > 0)
        if len(xs) >= 4:
            q = statistics.quantiles(xs, n=4)
            print(f"| Redis us per decision, {mode} vs tower-rate-limit-redis | {statistics.median(xs):.2f} (target <= {limit}) | {q[0]:.2f} to {q[2]:.2f} | {len(xs)} |")
    for mode in ['ours-mem', 'ours-mem-noheaders', 'ours-redis-noheaders', 'ours-redis']:
        pairs = [r for r in slices if r['mode'] == mode and r['vs'] == f'base:{mode}' and float(r.get('a_rps') or 0) > 0 and r.get('b_rps')]
        xs = sorted(float(r['b_rps']) / float(r['a_rps']) for r in pairs)
        if len(xs) >= 4:
            q = statistics.quantiles(xs, n=4)
            print(f"| HTTP {mode} vs the base revision | {statistics.median(xs):.2f} (target >= 0.98) | {q[0]:.2f} to {q[2]:.2f} | {len(xs)} |")
        us = sorted(float(r['b_usec']) / float(r['a_usec']) for r in pairs
                    if r.get('a_usec', '-') not in ('-', '') and r.get('b_usec', '-') not in ('-', '') and float(r['a_usec']) > 0)
        if len(us) >= 4:
            q = statistics.quantiles(us, n=4)
            print(f"| Redis us per decision, {mode} vs the base revision | {statistics.median(us):.2f} (target <= 1.02) | {q[0]:.2f} to {q[2]:.2f} | {len(us)} |")
flood = [r for r in rows if r['kind'] == 'http' and r['mode'] == 'ours-redis-flood']
if flood:
    local = [1 - float(r['redis_calls']) / float(r['non2xx']) for r in flood if float(r.get('non2xx', 0) or 0) > 0]
    if local:
        print(f"| flood: 429s answered without Redis | {statistics.median(local):.1%} | (target >= 90%) |")
PY
