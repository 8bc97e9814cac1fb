# bench/lib.sh: what bench/run.sh and bench/instr.sh share, sourced by both
# (set LOG_TAG first: the tag of log lines).

# Exits with the apt package to install when command $1 is missing.
need() { command -v "$1" >/dev/null || { echo "missing $1: apt-get install -y $2" >&2; exit 1; }; }

# A free TCP port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

log() { printf '[%s %s] %s\n' "$LOG_TAG" "$(date +%H:%M:%S)" "$*" >&2; }

# Every process started goes in PIDS; all of them are stopped on exit.
PIDS=()
cleanup() { for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

# Where bench/peers ($1) builds: CARGO_TARGET_DIR, else its own target folder.
peers_target() { (cd "$1" && mkdir -p "${CARGO_TARGET_DIR:-target}" && cd "${CARGO_TARGET_DIR:-target}" && pwd); }

# Builds the peers server of git revision $1 (release, in the target folder
# $TARGET) as $OUT/bin/base-server. Run it before this tree's build: the
# sources of this tree are touched after it, since cargo copies a binary out
# of its build folder only when it builds it, and the base's build left its
# own in the same place.
build_base_server() {
  log "building bench/peers of $1 (release)"
  rm -rf "$OUT/base-src"; mkdir -p "$OUT/base-src" "$OUT/bin"
  git -C "$ROOT" archive "$1" | tar -x -C "$OUT/base-src"
  (cd "$OUT/base-src/bench/peers" && CARGO_TARGET_DIR=$TARGET cargo build --release --quiet --bin tower-ratelimit-peers)
  cp "$TARGET/release/tower-ratelimit-peers" "$OUT/bin/base-server"
  touch "$PEERS/src/main.rs" "$PEERS/src/bin/api.rs"
}
