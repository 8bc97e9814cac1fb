#!/usr/bin/env bash
# bench/model.sh: more cases of tests/model.rs (random layers against the
# reference model) than the default test run draws: CASES memory-store
# cases (default 20000) and REDIS_CASES Redis cases (default 2000), in a
# release build. The Redis cases run on a redis-server the test starts on a
# free port of 127.0.0.1; the run ends by itself.
#
#   bench/model.sh
#   CASES=100000 REDIS_CASES=0 bench/model.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODEL_CASES=${CASES:-20000} MODEL_REDIS_CASES=${REDIS_CASES:-2000} \
  cargo test --release --all-features --test model -- --nocapture
