#!/usr/bin/env bash
# Calls lost to service churn under SIP load: fulcrum vs Kamailio, side by side, same load,
# strict services (BENCHMARKS.md, "SIP: calls lost to service churn").
#
#   SIPp UAC (127.0.0.1:$BASE+10) -> proxy 127.0.0.1:$BASE (sip-udp)
#     -> 4 strict UAS s0..s3 on 127.0.0.1:$BASE+11..14 (examples/strict_uas.rs)
#
# The services are the tests' strict UAS (tests/common/strict_uas.rs, run as a process by
# examples/strict_uas.rs): a BYE (or any in-dialog request) for a dialog the UAS did not set
# up is answered 481, so a dialog a proxy moves to another service fails at SIPp instead of
# being answered 200 by a lenient peer. Each UAS prints its counts (dialogs, BYE 200, 481).
#
# Load: `sipp -sn uac` (INVITE / 180 / 200 / ACK, pause HOLD ms, BYE / 200: every request
# goes through the proxy) at RATE calls/s, CALLS calls (-m), -recv_timeout 5 s.
# Churn, during the load, every EVERY s from FIRST s after the UAC starts, on s3:
#   reload   fulcrum: rewrite the config without / with s3, SIGHUP (confirmed by its log line)
#            kamailio: rewrite dispatcher.list without / with s3, `kamcmd dispatcher.reload`
#   kill     SIGKILL s3's process / start it again (same port, empty dialog table)
#   disable  fulcrum: POST /services/s3/disable / enable
#            kamailio: `kamcmd dispatcher.set_state d 1 sip:s3` / `... a ...`
# Events alternate (remove, restore, ...); their number is even, so the run ends restored.
#
# Proxies (both health-check the services every second with OPTIONS, so a killed service is
# found dead the same way; neither adds Record-Route):
#   fulcrum   release build, sip-udp vserver, call_id_hash (carp), record_route false,
#             sip-options monitor (1 s, timeout 500 ms, 1 failure to DOWN, 1 success to UP)
#   kamailio  dispatcher set 1, ds_select_dst("1", "0") (alg 0 = hash over Call-ID),
#             stateless forward(), 1 worker; tm loaded only for the dispatcher's OPTIONS pings
#             (ds_ping_interval 1, probing mode 1, thresholds 1, tm fr_timer 1 s);
#             reload_delta 1 (its default 5 s refuses a reload 3 s after the last one)
#
# Output: one line per (churn kind, proxy) in $OUT/summary.tsv and a table: calls attempted,
# successful, failed (SIPp), and at the services: dialogs set up, BYEs answered 200, 481s
# sent, stray ACKs (summed over every UAS process, a killed one's last printed counts, at
# most 200 ms old).
#
# Every process runs bounded in time (timeout, or the UAS's own lifetime); the EXIT trap
# ends those this script started, by PID. Whole run with the defaults: about 3 minutes.
#
# Usage: bench/churn.sh
#        RATE=150 CALLS=1800 HOLD=2000 KINDS="reload kill disable" PROXIES="fulcrum kamailio" bench/churn.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
RATE=${RATE:-150}
CALLS=${CALLS:-1800}
HOLD=${HOLD:-2000}          # ms each call is held between ACK and BYE
FIRST=${FIRST:-2}           # s after the UAC starts: first churn event
EVERY=${EVERY:-3}           # s between churn events
KINDS=${KINDS:-"reload kill disable"}
PROXIES=${PROXIES:-"fulcrum kamailio"}
BASE=${BASE:-26060}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
FULCRUM=${FULCRUM:-$TARGET/release/fulcrum}
UAS_BIN=${UAS_BIN:-$TARGET/release/examples/strict_uas}
OUT=${OUT:-${TMPDIR:-/tmp}/fulcrum-bench-churn-$(date +%Y%m%d-%H%M%S)}
MAXT=600                    # hard bound for any background process
PROXY_PORT=$BASE
UAC_PORT=$((BASE + 10))
ADMIN_PORT=$((BASE + 20))
UAS_NAMES="s0 s1 s2 s3"
uas_port() { echo $((BASE + 11 + ${1#s})); }
PLACE=$(( (CALLS + RATE - 1) / RATE ))                 # s to place every call
EVENTS=$(( (PLACE - FIRST) / EVERY + 1 )); EVENTS=$(( EVENTS - EVENTS % 2 ))

command -v sipp >/dev/null || { echo "sipp not found (apt-get install sip-tester)" >&2; exit 2; }
case " $PROXIES " in *" kamailio "*)
  if ! command -v kamailio >/dev/null || ! command -v kamcmd >/dev/null; then
    echo "kamailio / kamcmd not found (apt-get install kamailio)" >&2; exit 2
  fi ;;
esac
if [ ! -x "$FULCRUM" ] || [ ! -x "$UAS_BIN" ]; then
  (cd "$ROOT" && nice -n 10 cargo build --release --quiet --bin fulcrum --example strict_uas) || exit 2
fi
mkdir -p "$OUT"; cd "$OUT" || exit 2

PIDS=()
cleanup() {
  local p i alive
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for i in $(seq 1 30); do   # at most 3 s for them to end
    alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  PIDS=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# poll (bounded, 10 s) until something listens on UDP port $1
wait_port() {
  local i
  for i in $(seq 1 100); do
    ss -Hulnp "sport = :$1" 2>/dev/null | grep -q . && return 0
    sleep 0.1
  done
  echo "nothing bound udp port $1" >&2; return 1
}
# wait (bounded, 10 s) until file $1 has at least $2 lines matching $3
wait_lines() {
  local i c
  for i in $(seq 1 100); do
    c=$(grep -c -- "$3" "$1" 2>/dev/null)
    [ "${c:-0}" -ge "$2" ] && return 0
    sleep 0.1
  done
  echo "no $2 x '$3' in $1" >&2; return 1
}
# PID of the first child of $1 (a timeout wrapper's command), waiting at most 5 s
child_of() {
  local i c
  for i in $(seq 1 100); do c=$(pgrep -P "$1" | head -1); [ -n "$c" ] && { echo "$c"; return 0; }; sleep 0.05; done
  return 1
}
# column $2 (by header name) of the last line of SIPp stat file $1
col() {
  awk -F';' -v name="$2" 'NR==1{for(i=1;i<=NF;i++) if($i==name) c=i; next} NF{last=$0}
    END{split(last, a, ";"); print (c ? a[c] + 0 : "NA")}' "$1"
}

# --- configs -------------------------------------------------------------------------
fulcrum_config() {   # $1 = members, comma-separated
  local s
  {
    echo "# generated by bench/churn.sh"
    echo "admin: { listen: \"127.0.0.1:$ADMIN_PORT\" }"
    echo "logging: { level: info }"
    echo "monitors:"
    echo "  - { name: opt, type: sip-options, interval: 1s, timeout: 500ms, failures_to_down: 1, successes_to_up: 1 }"
    echo "services:"
    for s in $UAS_NAMES; do
      echo "  - { name: $s, address: \"127.0.0.1:$(uas_port "$s")\", protocol: sip-udp, monitor: opt }"
    done
    echo "vservers:"
    echo "  - { name: v, protocol: sip-udp, bind: [\"127.0.0.1:$PROXY_PORT\"], method: call_id_hash,"
    echo "      record_route: false, services: [$1] }"
  } > fulcrum.yaml.new
  mv fulcrum.yaml.new fulcrum.yaml
}
dispatcher_list() {   # $1 = members, space-separated
  local s
  for s in $1; do echo "1 sip:127.0.0.1:$(uas_port "$s")"; done > dispatcher.list.new
  mv dispatcher.list.new dispatcher.list
}
cat > kamailio.cfg <<EOF
#!KAMAILIO
# generated by bench/churn.sh: dispatcher alg 0 (Call-ID hash) + stateless forward()
debug=0
log_stderror=yes
memdbg=5
memlog=5
fork=yes
children=1
listen=udp:127.0.0.1:$PROXY_PORT
disable_tcp=yes
auto_aliases=no
dns=no
rev_dns=no
use_dns_cache=no
mpath="/usr/lib/x86_64-linux-gnu/kamailio/modules/"
loadmodule "kex.so"
loadmodule "sl.so"
loadmodule "tm.so"
loadmodule "maxfwd.so"
loadmodule "ctl.so"
loadmodule "dispatcher.so"
modparam("ctl", "binrpc", "unix:$OUT/kamailio.ctl")
modparam("tm", "fr_timer", 1000)
modparam("dispatcher", "list_file", "$OUT/dispatcher.list")
modparam("dispatcher", "reload_delta", 1)
modparam("dispatcher", "flags", 2)
modparam("dispatcher", "ds_ping_interval", 1)
modparam("dispatcher", "ds_probing_mode", 1)
modparam("dispatcher", "ds_probing_threshold", 1)
modparam("dispatcher", "ds_inactive_threshold", 1)
request_route {
    if (!mf_process_maxfwd_header("10")) { sl_send_reply("483", "Too Many Hops"); exit; }
    if (!ds_select_dst("1", "0")) { sl_send_reply("503", "No destination"); exit; }
    forward();
    exit;
}
EOF
kam() { timeout 5 kamcmd -s "unix:$OUT/kamailio.ctl" "$@"; }

# --- processes -----------------------------------------------------------------------
declare -A UAS_PID UAS_RUN
start_uas() {   # $1 = run tag, $2 = name
  local n=$(( ${UAS_RUN[$2]:-0} + 1 ))
  UAS_RUN[$2]=$n
  "$UAS_BIN" "$2" "127.0.0.1:$(uas_port "$2")" udp $MAXT > "uas_${1}_${2}_${n}.log" 2>&1 &
  UAS_PID[$2]=$!; PIDS+=("$!")
  wait_lines "uas_${1}_${2}_${n}.log" 1 '^ready'
}

PROXY_PID=""; PROXY_WRAP=""
start_proxy() {   # $1 = fulcrum | kamailio
  case $1 in
    fulcrum)
      fulcrum_config "s0, s1, s2, s3"
      timeout $MAXT "$FULCRUM" run --config fulcrum.yaml --drain-timeout 1s > "fulcrum_$TAG.log" 2>&1 & ;;
    kamailio)
      dispatcher_list "$UAS_NAMES"
      timeout $MAXT kamailio -f kamailio.cfg -DD -E -m 64 -M 8 > "kamailio_$TAG.log" 2>&1 & ;;
  esac
  PROXY_WRAP=$!; PIDS+=("$PROXY_WRAP")
  PROXY_PID=$(child_of "$PROXY_WRAP") || { echo "$1 did not start" >&2; return 1; }
  PIDS+=("$PROXY_PID")
  wait_port "$PROXY_PORT" || return 1
  if [ "$1" = kamailio ]; then
    local i; for i in $(seq 1 50); do kam core.version >/dev/null 2>&1 && break; sleep 0.1; done
  fi
}
stop_proxy() {
  local i
  kill -TERM "$PROXY_PID" 2>/dev/null
  for i in $(seq 1 50); do kill -0 "$PROXY_PID" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$PROXY_PID" 2>/dev/null
  wait "$PROXY_WRAP" 2>/dev/null
}

# churn event $3 (0, 1, ...) of kind $1 on proxy $2: even = take s3 away, odd = give it back
RELOADS=0
churn() {
  local kind=$1 proxy=$2 away=$(( $3 % 2 == 0 )) s3 op
  s3="sip:127.0.0.1:$(uas_port s3)"
  case $kind/$proxy in
    reload/fulcrum)
      if [ $away = 1 ]; then fulcrum_config "s0, s1, s2"; else fulcrum_config "s0, s1, s2, s3"; fi
      kill -HUP "$PROXY_PID"; RELOADS=$((RELOADS + 1))
      wait_lines "fulcrum_$TAG.log" "$RELOADS" 'SIGHUP: reloaded' ;;
    reload/kamailio)
      if [ $away = 1 ]; then dispatcher_list "s0 s1 s2"; else dispatcher_list "$UAS_NAMES"; fi
      kam dispatcher.reload >> "kamcmd_$TAG.log" 2>&1 ;;
    kill/*)
      if [ $away = 1 ]; then kill -KILL "${UAS_PID[s3]}"; wait "${UAS_PID[s3]}" 2>/dev/null
      else start_uas "$TAG" s3; fi ;;
    disable/fulcrum)
      if [ $away = 1 ]; then op=disable; else op=enable; fi
      timeout 5 curl -s -XPOST "127.0.0.1:$ADMIN_PORT/services/s3/$op" >> "admin_$TAG.log" 2>&1
      echo >> "admin_$TAG.log" ;;
    disable/kamailio)
      if [ $away = 1 ]; then kam dispatcher.set_state d 1 "$s3"; else kam dispatcher.set_state a 1 "$s3"; fi \
        >> "kamcmd_$TAG.log" 2>&1 ;;
  esac
  echo "$(date +%T.%N | cut -c1-12) event $3 ($kind, s3 $([ $away = 1 ] && echo away || echo back))" >> "events_$TAG.log"
}

SUMMARY=summary.tsv
printf "kind\tproxy\tattempted\tsuccessful\tfailed\tdialogs\tbye_200\tr481\tstray_acks\tuas_processes\n" > $SUMMARY

run_one() {   # $1 = kind, $2 = proxy
  local kind=$1 proxy=$2 s i t0 uac
  TAG="${kind}_${proxy}"; RELOADS=0; UAS_RUN=()
  for s in $UAS_NAMES; do start_uas "$TAG" "$s" || return 1; done
  start_proxy "$proxy" || return 1
  [ "$proxy" = kamailio ] && kam dispatcher.list > "dslist_${TAG}_start.txt" 2>&1
  t0=$(date +%s.%N)
  timeout $((PLACE + HOLD / 1000 + 40)) sipp -sn uac -t u1 "127.0.0.1:$PROXY_PORT" -i 127.0.0.1 -p $UAC_PORT \
    -r "$RATE" -m "$CALLS" -d "$HOLD" -l $((RATE * (HOLD / 1000 + 6))) -nostdin \
    -timeout $((PLACE + HOLD / 1000 + 30))s -recv_timeout 5000 \
    -trace_stat -stf "uac_$TAG.csv" -fd 1 -trace_err -error_file "uac_${TAG}_errors.log" > "uac_$TAG.log" 2>&1 &
  uac=$!; PIDS+=("$uac")
  for i in $(seq 0 $((EVENTS - 1))); do
    sleep "$(awk -v t0="$t0" -v at=$((FIRST + i * EVERY)) -v now="$(date +%s.%N)" 'BEGIN{d=t0+at-now; printf "%.3f", (d > 0) ? d : 0}')"
    churn "$kind" "$proxy" "$i"
  done
  wait "$uac"
  [ "$proxy" = kamailio ] && kam dispatcher.list > "dslist_${TAG}_end.txt" 2>&1
  if grep -qi error "kamcmd_$TAG.log" "admin_$TAG.log" 2>/dev/null; then
    echo "WARNING: a churn command failed (kamcmd_$TAG.log / admin_$TAG.log)" >&2
  fi
  sleep 0.5
  for s in $UAS_NAMES; do kill -TERM "${UAS_PID[$s]}" 2>/dev/null; wait "${UAS_PID[$s]}" 2>/dev/null; done
  stop_proxy
  local f="uac_$TAG.csv" att ok fail
  att=$(col "$f" "TotalCallCreated"); ok=$(col "$f" "SuccessfulCall(C)"); fail=$(col "$f" "FailedCall(C)")
  # last counts line of every UAS process of this run
  local sums
  sums=$(for l in uas_"${TAG}"_*.log; do grep '^counts' "$l" | tail -1; done |
    awk '{for(i=2;i<=NF;i++){split($i,kv,"="); v[kv[1]]+=kv[2]} n++}
         END{printf "%d\t%d\t%d\t%d\t%d", v["dialogs"], v["byes_ok"], v["r481"], v["stray_acks"], n}')
  printf "%s\t%s\t%s\t%s\t%s\t%s\n" "$kind" "$proxy" "$att" "$ok" "$fail" "$sums" | tee -a $SUMMARY
}

echo "# results in $OUT"
echo "# RATE=$RATE CALLS=$CALLS HOLD=$HOLD ms, $EVENTS churn events every ${EVERY}s from ${FIRST}s; $(kamailio -v 2>/dev/null | head -1); $(sipp -v 2>/dev/null | grep -o 'SIPp v[0-9.]*' | head -1)"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
head -1 $SUMMARY
for kind in $KINDS; do
  for proxy in $PROXIES; do
    run_one "$kind" "$proxy" || { echo "$kind / $proxy: run failed (logs in $OUT)" >&2; cleanup; }
  done
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| churn | proxy | calls attempted | failed | 481s at services | dialogs / BYE 200 at services |"
echo "|---|---|---|---|---|---|"
awk -F'\t' 'NR>1{printf "| %s | %s | %s | %s | %s | %s / %s |\n", $1, $2, $3, $5, $8, $6, $7}' $SUMMARY
