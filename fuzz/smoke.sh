#!/usr/bin/env bash
# Build every fuzz target on the stable toolchain (the coverage instrumentation cargo-fuzz
# adds, given by hand: stable rustc takes these codegen flags) and run each for SECONDS
# seconds from its seeds. Exit 1 on any crash, failed assertion, leak or timeout; the
# failing input is left in $OUT/artifacts. Used by .ci/run (a smoke, not a campaign: see
# docs/fuzzing.md for the long runs).
#
# Usage: fuzz/smoke.sh [SECONDS] [TARGET...]     (default 10 s, every target)
set -euo pipefail
cd "$(dirname "$0")"
SECONDS_EACH=${1:-10}; shift || true
TARGETS=${*:-"sip_message sip_stream http_head client_hello proxy_v2 config slow_start_scenario admin_request"}
OUT=${OUT:-${TMPDIR:-/tmp}/fulcrum-fuzz-smoke}
TRIPLE=$(rustc -vV | awk '/^host:/{print $2}')
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
cargo build --release --quiet --target "$TRIPLE" --bins
# Seeds: the repository's own fixtures where they fit, else fuzz/seeds/TARGET.
seeds() {
  case $1 in
    sip_message) echo ../fixtures/sip ;;
    config) echo ../config ../fixtures/config ;;
    slow_start_scenario) echo ../fixtures/slowstart ;;
    sip_stream) echo seeds/sip_stream ../fixtures/sip ;;
    *) echo "seeds/$1" ;;
  esac
}
status=0
for t in $TARGETS; do
  mkdir -p "$OUT/corpus/$t" "$OUT/artifacts/$t"
  # shellcheck disable=SC2046
  if "./target/$TRIPLE/release/$t" "$OUT/corpus/$t" $(seeds "$t") \
      -max_total_time="$SECONDS_EACH" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$OUT/artifacts/$t/" -print_final_stats=1 > "$OUT/$t.log" 2>&1; then
    echo "fuzz $t: $(grep -o 'Done [0-9]* runs in [0-9]* second(s)' "$OUT/$t.log")"
  else
    echo "fuzz $t: FAILED (log $OUT/$t.log, input in $OUT/artifacts/$t)"; tail -30 "$OUT/$t.log"; status=1
  fi
done
exit $status
