#!/usr/bin/env bash
# What HEP capture costs per SIP message in instructions of the whole fulcrum process (every
# thread: the data-path workers, the capture sender, tokio's), counted by callgrind, so that a
# difference of a few percent is not lost in the noise of a shared box (BENCHMARKS.md, "HEP
# capture: instructions per SIP message"). User-space instructions only: the kernel's work
# (the datagram sends) is not in them; bench/sip_capture.sh measures CPU time with it.
#
#   SIPp UAC -> fulcrum sip-udp 127.0.0.1:$BASE (under callgrind) -> 3 SIPp UAS $BASE+11..13
#
# PROTO=sip-tcp runs the same over TCP: the vserver and its services sip-tcp, SIPp over one
# TCP connection each (`-t t1`). Failover is on (the default), so fulcrum holds each INVITE
# and sends its own 100 Trying: a 7th message sent per call, not counted in the 6.
#
# For each round and each case of CASES, a fresh fulcrum under `valgrind --tool=callgrind`:
# WARM calls at RATE calls/s (caches, tables and the capture sender's state settle: a dead
# collector found down), the counters zeroed (`callgrind_control -z`), CALLS calls at RATE,
# the counters dumped (`callgrind_control -d`), fulcrum stopped. One line per run:
# instructions per SIP message through fulcrum (6 per call) and the ratio to the `off` run
# of the same round; the SIPp counts say whether the run was clean (every call successful,
# no retransmission: each message went through once).
#
# Cases (collectors on 127.0.0.1, ports from HEP=29060; the script starts the sinks,
# bench/hep_sink.py):
#   off        capture off
#   udp-dead   UDP to HEP+1, nothing listening (ICMP port unreachable)
#   tcp-none   TCP to HEP+2, nothing listening (connect refused, backoff)
#   tcp-stall  TCP to HEP+3, accepts and never reads
#   udp-live   UDP to HEP, a sink that reads
#   tcp-live   TCP to HEP+4, a sink that reads
#   udp-gso    UDP to HEP with `udp_gso: true` (the padding is user-space work; the kernel
#              work it saves is not counted here)
#
# Usage: bench/sip_capture_instr.sh
#        ROUNDS=2 CASES="off udp-dead tcp-none" CALLS=2000 RATE=100 bench/sip_capture_instr.sh
#        PROTO=sip-tcp CASES="off udp-live tcp-live" bench/sip_capture_instr.sh
# Keeps every callgrind dump in OUT (callgrind_annotate --inclusive=yes FILE for a breakdown).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"   # ROOT, PIDS, cleanup (on exit), child_of, wait_port, col
ROUNDS=${ROUNDS:-1}
CASES=${CASES:-"off udp-dead tcp-none tcp-stall udp-live tcp-live"}
CALLS=${CALLS:-2000}
WARM=${WARM:-300}
RATE=${RATE:-100}
BASE=${BASE:-26060}
PROTO=${PROTO:-sip-udp}
HEP=${HEP:-29060}
case $PROTO in
  sip-udp) SIPP_T=u1; PORT_T=u ;;
  sip-tcp) SIPP_T=t1; PORT_T=t ;;
  *) echo "PROTO: sip-udp or sip-tcp" >&2; exit 2 ;;
esac
FULCRUM=${FULCRUM:-$ROOT/target/release/fulcrum}
OUT=${OUT:-${TMPDIR:-/tmp}/fulcrum-bench-capture-instr-$(date +%Y%m%d-%H%M%S)}
MAXT=900
UAS_PORTS="$((BASE + 11)) $((BASE + 12)) $((BASE + 13))"

for t in valgrind callgrind_control sipp python3; do
  command -v $t >/dev/null || { echo "$t not found" >&2; exit 2; }
done
if [ ! -x "$FULCRUM" ]; then
  (cd "$ROOT" && cargo build --release --quiet --bin fulcrum) || exit 2
fi
mkdir -p "$OUT"; cd "$OUT" || exit 2

case " $CASES " in *" udp-live "*|*" udp-gso "*) timeout $MAXT python3 "$HERE/hep_sink.py" udp $HEP & PIDS+=($!) ;; esac
case " $CASES " in *" tcp-stall "*) timeout $MAXT python3 "$HERE/hep_sink.py" tcp-stall $((HEP + 3)) & PIDS+=($!) ;; esac
case " $CASES " in *" tcp-live "*) timeout $MAXT python3 "$HERE/hep_sink.py" tcp-read $((HEP + 4)) & PIDS+=($!) ;; esac

collector() {
  case $1 in
    off) ;;
    udp-dead) echo udp:127.0.0.1:$((HEP + 1)) ;;
    tcp-none) echo tcp:127.0.0.1:$((HEP + 2)) ;;
    tcp-stall) echo tcp:127.0.0.1:$((HEP + 3)) ;;
    udp-live) echo udp:127.0.0.1:$HEP ;;
    tcp-live) echo tcp:127.0.0.1:$((HEP + 4)) ;;
    udp-gso) echo udp-gso:127.0.0.1:$HEP ;;
    *) echo "unknown case $1" >&2; exit 2 ;;
  esac
}

# sipp_calls TAG N: N calls of `sipp -sn uac` at RATE through fulcrum; prints
# "successful failed retransmissions".
sipp_calls() {
  timeout $(($2 / RATE * 3 + 60)) sipp -sn uac -t $SIPP_T 127.0.0.1:$BASE -i 127.0.0.1 -p $((BASE + 10)) \
    -r "$RATE" -m "$2" -nostdin -trace_stat -stf "uac_$1.csv" -fd 5 > "uac_$1.log" 2>&1
  echo "$(col "uac_$1.csv" "SuccessfulCall(C)") $(col "uac_$1.csv" "FailedCall(C)") $(col "uac_$1.csv" "Retransmissions(C)")"
}

# one CASE ROUND: sets LINE (the run's line) and IPM (instructions per message); in this
# shell, not a subshell, so that the exit trap knows every process it starts
one() {
  local c=$1 r=$2 cap tag="$1_r$2" w fpid uas=() p port
  cap=$(collector "$c")
  cat > "fulcrum_$tag.yaml" <<EOF
admin: { listen: null }
logging: { level: warn }
$( [ -n "$cap" ] && case ${cap%%:*} in
    udp-gso) echo "capture: { hep: { address: \"${cap#*:}\", transport: udp, udp_gso: true, id: 1 } }" ;;
    *) echo "capture: { hep: { address: \"${cap#*:}\", transport: ${cap%%:*}, id: 1 } }" ;;
  esac )
services:
  - { name: uas1, address: 127.0.0.1:$((BASE + 11)), protocol: $PROTO }
  - { name: uas2, address: 127.0.0.1:$((BASE + 12)), protocol: $PROTO }
  - { name: uas3, address: 127.0.0.1:$((BASE + 13)), protocol: $PROTO }
vservers:
  - name: sip-lb
    protocol: $PROTO
    bind: [127.0.0.1:$BASE]
    method: call_id_hash
    services: [uas1, uas2, uas3]
EOF
  for port in $UAS_PORTS; do
    timeout $MAXT sipp -sn uas -t $SIPP_T -i 127.0.0.1 -p "$port" -nostdin > "uas_${tag}_$port.log" 2>&1 &
    uas+=($!); PIDS+=($!)
  done
  timeout $MAXT valgrind --tool=callgrind --callgrind-out-file="$OUT/cg_$tag.%p" \
    "$FULCRUM" run --config "fulcrum_$tag.yaml" --drain-timeout 1s > "fulcrum_$tag.log" 2>&1 &
  w=$!; PIDS+=($w)
  fpid=$(child_of "$w") || { echo "fulcrum did not start" >&2; return 1; }
  PIDS+=($fpid)
  for port in $BASE $UAS_PORTS; do wait_port "$port" $PORT_T || return 1; done
  local warm calls load
  warm=$(sipp_calls "${tag}_warm" "$WARM")
  sleep 1
  callgrind_control -z "$fpid" > /dev/null 2>&1 || return 1
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  calls=$(sipp_calls "$tag" "$CALLS")
  callgrind_control -d "$fpid" > /dev/null 2>&1 || return 1
  kill -TERM "$fpid" 2>/dev/null
  for p in $(seq 1 100); do kill -0 "$fpid" 2>/dev/null || break; sleep 0.1; done
  for p in "${uas[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${uas[@]}" "$w"; do wait "$p" 2>/dev/null; done
  local dump ir succ fail retr clean=yes
  dump=$(ls "$OUT/cg_$tag.$fpid".1 2>/dev/null) || { echo "no dump for $tag" >&2; return 1; }
  ir=$(awk '/^totals:/{print $2}' "$dump")
  read -r succ fail retr <<<"$calls"
  [ "$succ" = "$CALLS" ] && [ "$fail" = 0 ] && [ "$retr" = 0 ] || clean=no
  IPM=$(awk -v i="$ir" -v s="$succ" 'BEGIN{printf "%.0f", (s>0)? i/(s*6) : 0}')
  LINE="round $r $(date -u +%H:%M:%S) load $load $c: $IPM instr/msg ($ir over $succ calls; warm-up $warm) failed=$fail retrans=$retr clean=$clean"
}

echo "# results in $OUT; PROTO=$PROTO CALLS=$CALLS WARM=$WARM RATE=$RATE, $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null), $FULCRUM"
for r in $(seq 1 "$ROUNDS"); do
  base=""
  for c in $CASES; do
    one "$c" "$r" || { echo "round $r $c: failed (files in $OUT)"; exit 1; }
    [ "$c" = off ] && base=$IPM
    vs=""; [ -n "$base" ] && [ "$c" != off ] && vs=$(awk -v a="$IPM" -v b="$base" 'BEGIN{printf " (%+.1f%% vs off)", 100*(a/b-1)}')
    echo "$LINE$vs"
  done
done
