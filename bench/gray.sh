#!/usr/bin/env bash
# A sick service (gray failure) under SIP load: fulcrum vs Kamailio, side by side, same load,
# strict services (BENCHMARKS.md, "SIP: a sick service (gray failure)").
#
#   SIPp UAC (127.0.0.1:$BASE+10) -> proxy 127.0.0.1:$BASE (sip-udp, Record-Route)
#     -> 3 strict UAS s0..s2 on 127.0.0.1:$BASE+11..13 (examples/strict_uas.rs)
#
# One row per way of being sick; in each, s1 (SICK) is sick from the start for the whole run
# (`strict_uas --sick`), the way a service fails while its keep-alive may still pass:
#   busy     INVITE answered 503 + Retry-After, OPTIONS 200
#   down     INVITE and OPTIONS answered 503 + Retry-After
#   silent   INVITE never answered, OPTIONS 200
#   none     every service healthy (the baseline: s1's share is its hash share)
#
# Load: SIPp with fixtures/sipp/uac_rr.xml (`-sf`: INVITE, then ACK and BYE along the
# Record-Route set and to the callee's Contact, as a real phone; docs/sip.md "Failover"), RATE
# calls/s, CALLS calls (-m), each held HOLD ms between ACK and BYE, -recv_timeout 5 s, socket
# buffers BUF (4 MiB; SIPp's default, 64 KiB, overflows when a loaded box stalls it).
#
# Proxies (both hash the Call-ID over the three services, add Record-Route, and probe the
# services with OPTIONS every second):
#   fulcrum   release build, the config an operator writes: a sip-udp vserver, call_id_hash,
#             record_route: true, a sip-options monitor (interval 1 s, timeout 500 ms, the
#             rest default) and nothing about failover (on by default: docs/sip.md, "Failover")
#   kamailio  ../shared/bench/peers/kamailio/kamailio-failover.cfg (dispatcher alg 0 + tm, a
#             failure_route that marks the destination and relays to ds_next_dst on a 5xx or
#             no answer within fr_timer), its list file and listen port substituted
#
# Output: one line per (row, proxy) in $OUT/summary.tsv and a table: calls attempted,
# successful, failed and the mean time from INVITE to its 200 (SIPp's -trace_stat file); the
# INVITE transactions each service received (its `invites` count: a retransmission is not
# counted again, a proxy's next attempt is) and the sick service's share of them; 481s and
# stray ACKs at the services (a request for a call the service did not answer: 0 expected);
# datagrams the kernel dropped for a full receive buffer during the run (whole machine: a load
# generator starved by a busy box shows here; the strict UAS does not retransmit its 200, so a
# lost 200 is a failed call); the load average at the start of each run. SIPp's error lines
# of a row with failed calls are printed and kept in $OUT/uac_ROW_PROXY_errors.log; fulcrum's
# /metrics at the end of each run in $OUT/metrics_ROW_fulcrum.txt.
#
# Every process runs bounded in time (timeout, or the UAS's own lifetime); the EXIT trap
# ends those this script started, by PID. Whole run with the defaults: about 2.5 minutes.
#
# Usage: bench/gray.sh
#        RATE=100 CALLS=1500 HOLD=1000 ROWS="busy down silent none" PROXIES="fulcrum kamailio" bench/gray.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"   # ROOT, PEERS, PIDS, cleanup (on exit), child_of, wait_port, wait_lines, stop_proxy, col, rcvbuf_errors
RATE=${RATE:-100}
CALLS=${CALLS:-1500}
HOLD=${HOLD:-1000}          # ms each call is held between ACK and BYE
ROWS=${ROWS:-"busy down silent none"}
PROXIES=${PROXIES:-"fulcrum kamailio"}
SICK=${SICK:-s1}            # the service made sick
SIPP_ARGS=${SIPP_ARGS:-}    # more SIPp options, e.g. -trace_msg (each message, timed, in $OUT)
BASE=${BASE:-28060}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
FULCRUM=${FULCRUM:-$TARGET/release/fulcrum}
UAS_BIN=${UAS_BIN:-$TARGET/release/examples/strict_uas}
SCENARIO=${SCENARIO:-$ROOT/fixtures/sipp/uac_rr.xml}
KAM_CFG=${KAM_CFG:-$PEERS/kamailio/kamailio-failover.cfg}
OUT=${OUT:-${TMPDIR:-/tmp}/fulcrum-bench-gray-$(date +%Y%m%d-%H%M%S)}
MAXT=600                    # hard bound for any background process
BUF=4194304                 # SIPp's -buff_size
PROXY_PORT=$BASE
UAC_PORT=$((BASE + 10))
ADMIN_PORT=$((BASE + 20))
UAS_NAMES="s0 s1 s2"
uas_port() { echo $((BASE + 11 + ${1#s})); }
PLACE=$(( (CALLS + RATE - 1) / RATE ))                 # s to place every call

for r in $ROWS; do
  case $r in busy|down|silent|none) ;; *) echo "ROWS: \`$r\` is not busy, down, silent or none" >&2; exit 2 ;; esac
done
command -v sipp >/dev/null || { echo "sipp not found (apt-get install sip-tester)" >&2; exit 2; }
case " $PROXIES " in *" kamailio "*)
  command -v kamailio >/dev/null || { echo "kamailio not found (apt-get install kamailio)" >&2; exit 2; }
  [ -r "$KAM_CFG" ] || { echo "no Kamailio recipe at $KAM_CFG (PEERS=$PEERS)" >&2; exit 2; } ;;
esac
if [ ! -x "$FULCRUM" ] || [ ! -x "$UAS_BIN" ]; then
  (cd "$ROOT" && nice -n 10 cargo build --release --quiet --bin fulcrum --example strict_uas) || exit 2
fi
mkdir -p "$OUT"; cd "$OUT" || exit 2

# mean_ms FILE: SIPp's mean INVITE-to-200 time (ResponseTime1(C), hh:mm:ss:usec) in ms
mean_ms() {
  awk -F';' 'NR==1{for(i=1;i<=NF;i++) if($i=="ResponseTime1(C)") c=i; next} NF{last=$0}
    END{split(last, a, ";"); n=split(a[c], t, ":"); if (!c || n != 4) {print "NA"; exit}
        printf "%.0f", (t[1]*3600 + t[2]*60 + t[3])*1000 + t[4]/1000}' "$1"
}

# --- configs -------------------------------------------------------------------------
{
  echo "# generated by bench/gray.sh: what an operator writes (failover is on by default)"
  echo "admin: { listen: \"127.0.0.1:$ADMIN_PORT\" }"
  echo "logging: { level: info }"
  echo "monitors:"
  echo "  - { name: opt, type: sip-options, interval: 1s, timeout: 500ms }"
  echo "services:"
  for s in $UAS_NAMES; do
    echo "  - { name: $s, address: \"127.0.0.1:$(uas_port "$s")\", protocol: sip-udp, monitor: opt }"
  done
  echo "vservers:"
  echo "  - { name: v, protocol: sip-udp, bind: [\"127.0.0.1:$PROXY_PORT\"], method: call_id_hash,"
  echo "      record_route: true, services: [${UAS_NAMES// /, }] }"
} > fulcrum.yaml
for s in $UAS_NAMES; do echo "1 sip:127.0.0.1:$(uas_port "$s")"; done > dispatcher.list
if [ -r "$KAM_CFG" ]; then
  sed -e "s#DISPATCHER_LIST_FILE#$OUT/dispatcher.list#; s#^listen=.*#listen=udp:127.0.0.1:$PROXY_PORT#" \
    "$KAM_CFG" > kamailio.cfg
  if ! grep -q "^listen=udp:127.0.0.1:$PROXY_PORT\$" kamailio.cfg || ! grep -q "$OUT/dispatcher.list" kamailio.cfg; then
    echo "could not substitute the listen port / list file in $KAM_CFG" >&2; exit 2
  fi
fi

# --- processes -----------------------------------------------------------------------
declare -A UAS_PID
start_uas() {   # $1 = run tag, $2 = name, $3 = sick (none: healthy)
  local sick=()
  [ "$3" != none ] && sick=(--sick "$3")
  "$UAS_BIN" "${sick[@]}" "$2" "127.0.0.1:$(uas_port "$2")" udp $MAXT > "uas_${1}_${2}.log" 2>&1 &
  UAS_PID[$2]=$!; PIDS+=("$!")
  wait_lines "uas_${1}_${2}.log" 1 '^ready'
}

PROXY_PID=""; PROXY_WRAP=""
start_proxy() {   # $1 = fulcrum | kamailio
  case $1 in
    fulcrum)
      timeout $MAXT "$FULCRUM" run --config fulcrum.yaml --drain-timeout 1s > "fulcrum_$TAG.log" 2>&1 & ;;
    kamailio)
      timeout $MAXT kamailio -f kamailio.cfg -DD -E -m 64 -M 8 > "kamailio_$TAG.log" 2>&1 & ;;
  esac
  PROXY_WRAP=$!; PIDS+=("$PROXY_WRAP")
  PROXY_PID=$(child_of "$PROXY_WRAP") || { echo "$1 did not start" >&2; return 1; }
  PIDS+=("$PROXY_PID")
  wait_port "$PROXY_PORT" || return 1
}

SUMMARY=summary.tsv
printf "row\tproxy\tattempted\tsuccessful\tfailed\tsetup_ms\tinvites_s0\tinvites_s1\tinvites_s2\tsick_share_pct\tr481\tstray_acks\trcvbuf_drops\tload1\n" > $SUMMARY

run_one() {   # $1 = row, $2 = proxy
  local row=$1 proxy=$2 s load1 d0 d1
  TAG="${row}_${proxy}"
  load1=$(cut -d' ' -f1 /proc/loadavg)
  for s in $UAS_NAMES; do
    if [ "$s" = "$SICK" ]; then start_uas "$TAG" "$s" "$row" || return 1
    else start_uas "$TAG" "$s" none || return 1; fi
  done
  start_proxy "$proxy" || return 1
  d0=$(rcvbuf_errors)
  timeout $((PLACE + HOLD / 1000 + 40)) sipp -sf "$SCENARIO" -t u1 "127.0.0.1:$PROXY_PORT" -i 127.0.0.1 -p $UAC_PORT \
    -r "$RATE" -m "$CALLS" -d "$HOLD" -l $((RATE * (HOLD / 1000 + 8))) -nostdin -buff_size $BUF \
    -timeout $((PLACE + HOLD / 1000 + 30))s -recv_timeout 5000 \
    -trace_stat -stf "uac_$TAG.csv" -fd 1 -trace_err -error_file "uac_${TAG}_errors.log" \
    ${SIPP_ARGS:+$SIPP_ARGS} -message_file "uac_${TAG}_messages.log" > "uac_$TAG.log" 2>&1
  d1=$(rcvbuf_errors)
  [ "$proxy" = fulcrum ] && timeout 5 curl -s "127.0.0.1:$ADMIN_PORT/metrics" > "metrics_$TAG.txt" 2>&1
  sleep 0.5   # each UAS prints its counts when they change, at most every 200 ms
  for s in $UAS_NAMES; do kill -TERM "${UAS_PID[$s]}" 2>/dev/null; wait "${UAS_PID[$s]}" 2>/dev/null; done
  stop_proxy
  local f="uac_$TAG.csv" att ok fail uas
  att=$(col "$f" "TotalCallCreated"); ok=$(col "$f" "SuccessfulCall(C)"); fail=$(col "$f" "FailedCall(C)")
  # the last counts line of each UAS, in the order of UAS_NAMES
  uas=$(for s in $UAS_NAMES; do grep '^counts' "uas_${TAG}_$s.log" | tail -1; done |
    awk -v sick="$SICK" '{for(i=2;i<=NF;i++){split($i,kv,"="); v[kv[1]]=kv[2]}
         inv[NR]=v["invites"]; tot+=v["invites"]; r481+=v["r481"]; stray+=v["stray_acks"]
         if (v["name"]==sick) mine=v["invites"]}
         END{printf "%d\t%d\t%d\t%.1f\t%d\t%d", inv[1], inv[2], inv[3], tot ? 100*mine/tot : 0, r481, stray}')
  printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n" "$row" "$proxy" "$att" "$ok" "$fail" "$(mean_ms "$f")" "$uas" $((d1 - d0)) "$load1" | tee -a $SUMMARY
  if [ "${fail:-0}" != 0 ] && [ -s "uac_${TAG}_errors.log" ]; then
    echo "  $TAG: first SIPp error lines (uac_${TAG}_errors.log):" >&2
    grep -v '^\s*$' "uac_${TAG}_errors.log" | head -6 | sed 's/^/    /' >&2
  fi
}

echo "# results in $OUT"
echo "# RATE=$RATE CALLS=$CALLS HOLD=$HOLD ms, sick service $SICK; $(kamailio -v 2>/dev/null | head -1); $(sipp -v 2>/dev/null | grep -o 'SIPp v[0-9.]*' | head -1)"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
head -1 $SUMMARY
for row in $ROWS; do
  for proxy in $PROXIES; do
    run_one "$row" "$proxy" || echo "$row / $proxy: run failed (logs in $OUT)" >&2
    cleanup
  done
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| sick ($SICK) | proxy | calls attempted | successful | failed | mean INVITE to 200 | INVITE transactions s0 / s1 / s2 | $SICK's share | 481s / stray ACKs at services | kernel rcvbuf drops | load (1 min) at start |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
awk -F'\t' 'NR>1{printf "| %s | %s | %s | %s | %s | %s ms | %s / %s / %s | %s%% | %s / %s | %s | %s |\n", $1, $2, $3, $4, $5, ($6 == "0" ? "< 1" : $6), $7, $8, $9, $10, $11, $12, $13, $14}' $SUMMARY
