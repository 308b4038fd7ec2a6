#!/usr/bin/env bash
# What HEP capture costs the SIP over UDP bench (BENCHMARKS.md, "SIP over UDP with HEP
# capture"): ROUNDS alternating rounds of bench/sip_udp.sh (fulcrum alone, FIXED calls/s for
# FIXED_DUR s) with capture off and toward five collectors on 127.0.0.1 (bench/hep_sink.py):
#   udp live (29060), udp dead (29061, nothing listening), tcp none (29062, nothing
#   listening), tcp stalled (29063, accepts and never reads), tcp live (29064, reads), and
#   udp-gso live (29060 with `udp_gso: true`). CASES picks some, e.g.
#   CASES="off udp:127.0.0.1:29060 udp-gso:127.0.0.1:29060 tcp:127.0.0.1:29064".
# One line per run: the CPU per SIP message, unexpected messages, whether it was clean, how
# many calls failed, and the capture sender thread's own user and kernel CPU per SIP message.
# Every sink runs under `timeout` and is ended by PID on exit.
#
# Usage: ROUNDS=10 bench/sip_capture.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROUNDS=${ROUNDS:-3}
FIXED=${FIXED:-4000}
FIXED_DUR=${FIXED_DUR:-15}
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done' EXIT
timeout 7200 python3 "$HERE/hep_sink.py" udp 29060 & PIDS+=($!)
timeout 7200 python3 "$HERE/hep_sink.py" tcp-stall 29063 & PIDS+=($!)
timeout 7200 python3 "$HERE/hep_sink.py" tcp-read 29064 & PIDS+=($!)
sleep 1
[ -n "${COUNT_DEV:-}" ] && before=$(cat "/sys/class/net/$COUNT_DEV/statistics/tx_dropped")
for r in $(seq 1 "$ROUNDS"); do
  for c in ${CASES:-off udp:127.0.0.1:29060 udp:127.0.0.1:29061 tcp:127.0.0.1:29062 tcp:127.0.0.1:29063 tcp:127.0.0.1:29064 udp-gso:127.0.0.1:29060}; do
    cap=$c; [ "$c" = off ] && cap=
    load=$(cut -d' ' -f1 /proc/loadavg)
    out=${TMPDIR:-/tmp}/fulcrum-bench-capture-$(date +%Y%m%d-%H%M%S)
    res=$(OUT=$out CAPTURE=$cap PROXIES=fulcrum RATES=$FIXED DUR=3 FIXED=$FIXED FIXED_DUR=$FIXED_DUR \
      timeout 300 "$HERE/sip_udp.sh" 2>&1 | grep "^fulcrum:.*us/msg")
    failed=$(awk -F'\t' '$2=="fixed"{print $6}' "$out/summary.tsv" 2>/dev/null)
    frames=
    sender=$(awk -F'\t' '$2=="fixed"{print " sender-user=" $3 " sender-kernel=" $4 " us/msg"}' "$out/capture_thread.tsv" 2>/dev/null)
    if [ -n "${COUNT_DEV:-}" ]; then   # frames the device took and dropped (bench/sip_capture_nic.sh)
      now=$(cat "/sys/class/net/$COUNT_DEV/statistics/tx_dropped")
      frames=" $COUNT_DEV-frames=$((now - ${before:-0}))"; before=$now
    fi
    echo "round $r $(date -u +%H:%M:%S) load $load $c: $res failed=$failed$frames$sender"
  done
done
