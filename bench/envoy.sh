#!/usr/bin/env bash
# bench/envoy.sh: our rate limit service (`ratelimit`, release) against
# Limitador's `limitador-server`, each in turn on a fresh redis-server with the
# same limits, under bench/rls-load's gRPC load (one client, one HTTP/2
# connection). Per server and descriptor count it prints decisions/s, server
# CPU per decision and decisions per server CPU second (/proc/PID/stat),
# Redis CPU per decision (INFO cpu) and Redis commands per decision (INFO
# commandstats), p50/p99; with one descriptor also p50/p99 at a fixed rate.
#
# Environment (defaults in brackets):
#   SERVERS ["ours limitador"]   DESCRIPTORS ["1 2 5"]   DURATION [10] seconds
#   INFLIGHT [50]   RATE [5000] decisions/s for the fixed-rate run   VALUES [100]
#   CPU_SERVER [0]  CPU_CLIENT [1]  CPU_REDIS [1]   (taskset cores)
#   OURS: a `ratelimit` binary (else this tree's, built in release)
#   LIMITADOR: a `limitador-server` binary, else built from LIMITADOR_GIT (a
#     clone of Kuadrant/limitador) into $OUT: its files copied out with git,
#     trimmed to build in minutes on a small shared machine: its RocksDB disk
#     storage (the `limitador` dependency without default features,
#     `redis_storage` only, the `disk` command made to exit) and its vendored
#     OpenSSL (the system's libssl-dev instead); the Redis path is untouched.
#     Built with its own release profile (LTO, one codegen unit). Never a
#     dependency of this repository, nothing of it kept here.
#   OUT [/tmp/ratelimit-envoy-bench]: logs, configs, builds.
# Everything listens on 127.0.0.1; every run stops by itself.
set -euo pipefail
LOG_TAG=envoy-bench
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"

SERVERS=${SERVERS:-ours limitador}
DESCRIPTORS=${DESCRIPTORS:-1 2 5}
DURATION=${DURATION:-10}
INFLIGHT=${INFLIGHT:-50}
RATE=${RATE:-5000}
VALUES=${VALUES:-100}
CPU_SERVER=${CPU_SERVER:-0}
CPU_CLIENT=${CPU_CLIENT:-1}
CPU_REDIS=${CPU_REDIS:-1}
OUT=${OUT:-/tmp/ratelimit-envoy-bench}
mkdir -p "$OUT"

need redis-server redis-server
need redis-cli redis-tools
need taskset util-linux

log "building bench/rls-load (release)"
(cd "$ROOT/bench/rls-load" && cargo build --release --quiet)
LOAD="$ROOT/bench/rls-load/target/release/rls-load"

if [[ " $SERVERS " == *" ours "* && -z "${OURS:-}" ]]; then
  log "building ratelimit (release)"
  (cd "$ROOT" && cargo build --release --quiet -p tower-ratelimit-server --bin ratelimit)
  OURS="$ROOT/target/release/ratelimit"
fi

build_limitador() {
  local src="$OUT/limitador-src"
  [ -n "${LIMITADOR_GIT:-}" ] || { echo "set LIMITADOR or LIMITADOR_GIT (a Kuadrant/limitador clone)" >&2; exit 1; }
  need protoc protobuf-compiler
  need pkg-config pkg-config
  [ -e /usr/include/openssl/ssl.h ] || { echo "missing OpenSSL headers: apt-get install -y libssl-dev" >&2; exit 1; }
  log "copying Kuadrant/limitador at $(git -C "$LIMITADOR_GIT" rev-parse --short HEAD) to $src"
  rm -rf "$src"; mkdir -p "$src"
  # File by file: a mirror may lack large blobs the build does not need.
  git -C "$LIMITADOR_GIT" ls-tree -r HEAD | while read -r _ _ sha path; do
    mkdir -p "$src/$(dirname "$path")"
    git -C "$LIMITADOR_GIT" cat-file blob "$sha" >"$src/$path" 2>/dev/null || rm -f "$src/$path"
  done
  python3 - "$src" <<'EOF'
import re, sys
src = sys.argv[1]
def edit(path, old, new):
    p = f"{src}/{path}"; s = open(p).read()
    if old not in s: sys.exit(f"trim: {old!r} not in {path}")
    open(p, "w").write(s.replace(old, new))
edit("limitador-server/Cargo.toml", 'limitador = { path = "../limitador" }',
     'limitador = { path = "../limitador", default-features = false, features = ["redis_storage"] }')
p = f"{src}/limitador-server/Cargo.toml"; s = open(p).read()
s, n = re.subn(r'(openssl = \{ version = "[^"]+"), features = \["vendored"\] \}', r'\1 }', s)
if n != 1: sys.exit("trim: the vendored openssl line not found")
open(p, "w").write(s)
edit("limitador-server/src/main.rs", "use limitador::storage::disk::DiskStorage;\n", "")
p = f"{src}/limitador-server/src/main.rs"; s = open(p).read()
start = s.index("    fn disk_limiter(cfg: DiskStorageConfiguration) -> Self {")
end = s.index("    fn in_memory_limiter")
s = s[:start] + ("    fn disk_limiter(cfg: DiskStorageConfiguration) -> Self {\n"
    "        eprintln!(\"disk storage trimmed from this build ({})\", cfg.path);\n"
    "        process::exit(1)\n    }\n\n") + s[end:]
s = s.replace("storage::disk::OptimizeFor::Space", "()").replace("storage::disk::OptimizeFor::Throughput", "()")
open(p, "w").write(s)
edit("limitador-server/src/config.rs", "pub optimization: storage::disk::OptimizeFor,", "pub optimization: (),")
# The Redis keys use the `bin` module, gated on the disk storage feature.
edit("limitador/src/storage/keys.rs", '#[cfg(feature = "disk_storage")]\npub mod bin {', "pub mod bin {")
edit("limitador/src/counter.rs", '#[cfg(feature = "disk_storage")]\n    pub(crate) fn variables_for_key',
     "pub(crate) fn variables_for_key")
EOF
  log "building limitador-server (release, its own profile: LTO, one codegen unit; long)"
  (cd "$src" && nice -n 19 cargo build --release --quiet -p limitador-server)
  LIMITADOR="$src/target/release/limitador-server"
}
if [[ " $SERVERS " == *" limitador "* && -z "${LIMITADOR:-}" ]]; then
  build_limitador
fi

# CPU seconds (user + system) of process $1 from /proc/PID/stat.
cpu_of() { awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); print ($12 + $13) / hz }' "/proc/$1/stat"; }
# Redis: CPU seconds so far, and commands executed since the last reset.
redis_cpu() { redis-cli -p "$1" info cpu | tr -d '\r' | awk -F: '/^used_cpu_(sys|user):/ { s += $2 } END { printf "%.6f\n", s }'; }
redis_calls() { redis-cli -p "$1" info commandstats | tr -d '\r' | sed -n 's/.*:calls=\([0-9]*\),.*/\1/p' | awk '{ s += $1 } END { print s + 0 }'; }
# Value of `name=` in an rls-load line.
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<" $2"; }
# Arithmetic expression $1 over $2 with $3 decimals ("-" when $2 is 0).
div() { awk "BEGIN { b = $2; if (b == 0) print \"-\"; else printf \"%.${3:-1}f\\n\", ($1) / b }"; }

wait_port() {
  for _ in $(seq 1 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on 127.0.0.1:$1" >&2; return 1
}

# The same limits for both: per descriptor d<i> a fixed window of a minute per
# value, far above the load (every decision is OK).
write_ours_config() { # dir descriptors
  mkdir -p "$1/ratelimit/config"
  { echo "domain: bench"; echo "descriptors:"
    for i in $(seq 0 $(($2 - 1))); do
      printf '  - key: d%s\n    rate_limit:\n      unit: minute\n      requests_per_unit: 1000000000\n' "$i"
    done; } >"$1/ratelimit/config/bench.yaml"
}
write_limitador_limits() { # file descriptors
  for i in $(seq 0 $(($2 - 1))); do
    printf -- '- namespace: bench\n  max_value: 1000000000\n  seconds: 60\n  conditions: []\n  variables: ["descriptors[%s].d%s"]\n' "$i" "$i"
  done >"$1"
}

start_server() { # name descriptors redis_port -> SERVER_PID, GRPC
  GRPC=$(free_port); local http; http=$(free_port)
  local dir="$OUT/$1-$2"; rm -rf "$dir"; mkdir -p "$dir"
  case "$1" in
    ours)
      write_ours_config "$dir/runtime" "$2"
      HOST=127.0.0.1 GRPC_HOST=127.0.0.1 DEBUG_HOST=127.0.0.1 PORT="$http" GRPC_PORT="$GRPC" \
        DEBUG_PORT="$(free_port)" REDIS_SOCKET_TYPE=tcp REDIS_URL="127.0.0.1:$3" USE_STATSD=false \
        LOG_LEVEL=warn RUNTIME_ROOT="$dir/runtime" RUNTIME_SUBDIRECTORY=ratelimit RUNTIME_WATCH_ROOT=false \
        taskset -c "$CPU_SERVER" "$OURS" >"$dir/server.log" 2>&1 &
      ;;
    limitador)
      write_limitador_limits "$dir/limits.yaml" "$2"
      taskset -c "$CPU_SERVER" "$LIMITADOR" --rls-port "$GRPC" --http-port "$http" \
        "$dir/limits.yaml" redis "redis://127.0.0.1:$3" >"$dir/server.log" 2>&1 &
      ;;
  esac
  SERVER_PID=$!; PIDS+=("$SERVER_PID")
  wait_port "$GRPC" || { cat "$dir/server.log" >&2; exit 1; }
}

RESULTS="$OUT/results.tsv"
printf 'server\tdescriptors\tdecisions/s\tserver µs CPU/decision\tdecisions per server CPU s\tRedis µs CPU/decision\tRedis commands/decision\tp50 µs\tp99 µs\n' >"$RESULTS"
FIXED="$OUT/fixed-rate.tsv"
printf 'server\trate\tdecisions/s\tp50 µs\tp99 µs\tserver µs CPU/decision\tsender late p99/max µs\n' >"$FIXED"

for server in $SERVERS; do
  for d in $DESCRIPTORS; do
    redis_port=$(free_port)
    taskset -c "$CPU_REDIS" redis-server --port "$redis_port" --bind 127.0.0.1 --save '' \
      --appendonly no --daemonize no --loglevel warning >"$OUT/redis.log" 2>&1 &
    redis_pid=$!; PIDS+=("$redis_pid")
    wait_port "$redis_port"
    start_server "$server" "$d" "$redis_port"
    log "$server, $d descriptor(s): warming up"
    taskset -c "$CPU_CLIENT" "$LOAD" --addr "127.0.0.1:$GRPC" --descriptors "$d" \
      --inflight "$INFLIGHT" --values "$VALUES" --duration 2 >/dev/null

    redis-cli -p "$redis_port" config resetstat >/dev/null
    s0=$(cpu_of "$SERVER_PID"); r0=$(redis_cpu "$redis_port")
    line=$(taskset -c "$CPU_CLIENT" "$LOAD" --addr "127.0.0.1:$GRPC" --descriptors "$d" \
      --inflight "$INFLIGHT" --values "$VALUES" --duration "$DURATION")
    s1=$(cpu_of "$SERVER_PID"); r1=$(redis_cpu "$redis_port"); calls=$(redis_calls "$redis_port")
    log "$server d=$d: $line"
    n=$(field requests "$line"); rate=$(field decisions_per_s "$line")
    scpu=$(awk -v a="$s0" -v b="$s1" 'BEGIN { print b - a }')
    rcpu=$(awk -v a="$r0" -v b="$r1" 'BEGIN { print b - a }')
    # The INFO and CONFIG calls above count 2 or 3 commands: negligible.
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$server" "$d" "$rate" \
      "$(div "$scpu*1e6" "$n")" "$(div "$n" "$scpu" 0)" "$(div "$rcpu*1e6" "$n" 2)" \
      "$(div "$calls" "$n" 2)" "$(field p50_us "$line")" "$(field p99_us "$line")" >>"$RESULTS"

    if [ "$d" = 1 ]; then
      log "$server: fixed rate $RATE/s"
      s0=$(cpu_of "$SERVER_PID")
      line=$(taskset -c "$CPU_CLIENT" "$LOAD" --addr "127.0.0.1:$GRPC" --descriptors 1 \
        --inflight 1000 --values "$VALUES" --rate "$RATE" --duration "$DURATION")
      s1=$(cpu_of "$SERVER_PID")
      log "$server fixed: $line"
      n=$(field requests "$line")
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$server" "$RATE" "$(field decisions_per_s "$line")" \
        "$(field p50_us "$line")" "$(field p99_us "$line")" \
        "$(div "($s1-$s0)*1e6" "$n")" "$(field late_p99_us "$line")/$(field late_max_us "$line")" >>"$FIXED"
    fi
    kill "$SERVER_PID" "$redis_pid" 2>/dev/null || true
    wait "$SERVER_PID" "$redis_pid" 2>/dev/null || true
  done
done

echo "== closed loop: $INFLIGHT in flight, one HTTP/2 connection, ${DURATION}s; server on core $CPU_SERVER, client on $CPU_CLIENT, Redis on $CPU_REDIS"
column -t -s $'\t' "$RESULTS"
echo "== fixed rate (open loop, latency from each request's dispatch, a wait for a slot included)"
column -t -s $'\t' "$FIXED"
