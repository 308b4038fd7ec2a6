#!/usr/bin/env bash
# Legitimate calls under a one-source OPTIONS flood, fulcrum (allow list + flood control)
# against Kamailio (permissions + pike), side by side in the same run; then the cost of the
# checks on a plain SIP load, fulcrum with and without them (BENCHMARKS.md, "SIP: one
# flooding source").
#
# Phase "flood" (both proxies, one after the other, for each flood rate of FLOODS):
#
#   SIPp UAC 127.0.0.1:$BASE+10 ---\
#                                   > proxy 127.0.0.1:$BASE (sip-udp) -> 3 strict UAS
#   flooder  127.0.0.3 ------------/                     127.0.0.1:$BASE+11..13 (examples/strict_uas.rs)
#
#   legit    `sipp -sn uac` (INVITE / 180 / 200 / ACK / BYE / 200 = 6 messages through the
#            proxy per call, 0 ms calls) at RATE calls/s, RATE x DUR calls, -recv_timeout 5 s.
#   flood    examples/sip_flood.rs from 127.0.0.3: out-of-dialog OPTIONS, a fresh Call-ID each,
#            at the flood rate (token-bucket paced; `max` = as fast as it can), from 0.5 s
#            before the UAC until DUR + 1.5 s, at most FLOOD_MAX datagrams. Rate 0: no flooder.
#   fulcrum  release build, sip-udp vserver, call_id_hash, record_route false,
#            allow: [127.0.0.0/8], flood: { limit: LIMIT, window: 1s, ban: 60s }
#   kamailio dispatcher alg 0 (Call-ID hash) + stateless forward(), KCHILDREN workers, and
#            before it: allow_source_address("1") (permissions, address_file with group 1 =
#            127.0.0.0/8), then for requests without a To tag pike_check_req() (pike,
#            sampling_time_unit 1 s, reqs_density_per_unit LIMIT); a refused request is
#            dropped. Both proxies count only requests outside a dialog against the limit.
#   Per run: calls attempted / successful / failed (SIPp), proxy CPU (utime + stime of the
#   proxy and its children from /proc/PID/stat, from the flooder's start until both the UAC
#   and the flooder are done) in seconds and per legitimate message (6 x successful calls),
#   flood datagrams sent (the flooder's count), dropped by the proxy (fulcrum: /status
#   edge.dropped.flood + .acl; Kamailio: core:rcv_requests - core:fwd_requests), answered
#   (responses back at the flooder: OPTIONS a service answered), and the machine's UDP
#   receive-buffer overflows (datagrams the kernel dropped before any proxy saw them).
#
# Phase "ab" (fulcrum only, no flood): `sipp -sn uac` at AB_RATE calls/s for AB_DUR s against
# three `sipp -sn uas` (the bench/sip_udp.sh load), fulcrum without (A) and with (B) allow /
# deny / flood configured (a limit far above the load, so every INVITE is checked and none is
# refused), AB_REPEATS runs of each, alternating A B B A A B ...; CPU per SIP message per run,
# then the medians, spreads and the B/A ratio.
#
# Every process runs under `timeout` (or the UAS's own lifetime); the EXIT trap ends those this
# script started, by PID. Whole run with the defaults: about 4 minutes (214 s on the busy 2-core box).
#
# Usage: nice -n 5 bench/flood.sh
#        FLOODS="0 5000 20000 max" RATE=50 DUR=15 LIMIT=100 AB_RATE=2000 AB_DUR=12 AB_REPEATS=3 \
#          PHASES="flood ab" PROXIES="fulcrum kamailio" bench/flood.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"   # ROOT, PIDS, cleanup (on exit), child_of, wait_port, stop_proxy, tree_ticks, rcvbuf_errors, col, kamailio_head
FLOODS=${FLOODS:-"0 5000 20000 max"}
RATE=${RATE:-50}             # legitimate calls/s (INVITEs per second stay under LIMIT)
DUR=${DUR:-15}               # s of legitimate calls per flood run
LIMIT=${LIMIT:-100}          # new requests per source per second before a ban / block
FLOOD_MAX=${FLOOD_MAX:-3000000}
AB_RATE=${AB_RATE:-2000}
AB_DUR=${AB_DUR:-12}
AB_REPEATS=${AB_REPEATS:-3}
PHASES=${PHASES:-"flood ab"}
PROXIES=${PROXIES:-"fulcrum kamailio"}
KCHILDREN=${KCHILDREN:-1}    # as bench/sip.sh: Kamailio's best clean configuration
FWORKERS=${FWORKERS:-0}      # fulcrum workers (0 = one per core)
BASE=${BASE:-27060}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
FULCRUM=${FULCRUM:-$TARGET/release/fulcrum}
UAS_BIN=${UAS_BIN:-$TARGET/release/examples/strict_uas}
FLOOD_BIN=${FLOOD_BIN:-$TARGET/release/examples/sip_flood}
OUT=${OUT:-${TMPDIR:-/tmp}/fulcrum-bench-flood-$(date +%Y%m%d-%H%M%S)}
FLOODER_IP=127.0.0.3
BUF=4194304
MAXT=600                     # hard bound for any background process
PROXY_PORT=$BASE
UAC_PORT=$((BASE + 10))
ADMIN_PORT=$((BASE + 20))
UAS_PORTS="$((BASE + 11)) $((BASE + 12)) $((BASE + 13))"
HZ=$(getconf CLK_TCK)

command -v sipp >/dev/null || { echo "sipp not found (apt-get install sip-tester)" >&2; exit 2; }
case " $PROXIES " in *" kamailio "*)
  if ! command -v kamailio >/dev/null || ! command -v kamcmd >/dev/null; then
    echo "kamailio / kamcmd not found (apt-get install kamailio)" >&2; exit 2
  fi ;;
esac
if [ ! -x "$FULCRUM" ] || [ ! -x "$UAS_BIN" ] || [ ! -x "$FLOOD_BIN" ]; then
  (cd "$ROOT" && nice -n 10 cargo build --release --quiet --bin fulcrum --example strict_uas --example sip_flood) || exit 2
fi
mkdir -p "$OUT"; cd "$OUT" || exit 2

# wait (bounded, 10 s) until file $1 has a line matching $2
wait_line() {
  local i
  for i in $(seq 1 100); do grep -q -- "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "no '$2' in $1" >&2; return 1
}
# number under key $1 in the JSON file $2 (the only vserver's /status: keys are unique there)
jnum() { grep -o "\"$1\": *[0-9]*" "$2" | head -1 | grep -o '[0-9]*$' || echo 0; }
kam() { timeout 5 kamcmd -s "unix:$OUT/kamailio.ctl" "$@"; }
# value of Kamailio statistic $1 (e.g. core:rcv_requests), 0 when absent
kstat() { kam stats.get_statistics core: 2>/dev/null | awk -v n="$1" '$1==n {v=$3} END{print v + 0}'; }

# --- configs -------------------------------------------------------------------------
# fulcrum_config EDGE: EDGE = extra vserver keys (a flow mapping's inner text, may be empty)
fulcrum_config() {
  {
    echo "# generated by bench/flood.sh"
    echo "admin: { listen: \"127.0.0.1:$ADMIN_PORT\" }"
    echo "logging: { level: warn }"
    echo "services:"
    local i=0 port
    for port in $UAS_PORTS; do
      echo "  - { name: s$i, address: \"127.0.0.1:$port\", protocol: sip-udp }"
      i=$((i + 1))
    done
    echo "vservers:"
    echo "  - { name: v, protocol: sip-udp, bind: [\"127.0.0.1:$PROXY_PORT\"], method: call_id_hash,"
    if [ -n "$1" ]; then
      echo "      record_route: false, workers: $FWORKERS, services: [s0, s1, s2],"
      echo "      $1 }"
    else
      echo "      record_route: false, workers: $FWORKERS, services: [s0, s1, s2] }"
    fi
  } > fulcrum.yaml
  "$FULCRUM" check fulcrum.yaml > fulcrum_check.log 2>&1 || { echo "generated fulcrum.yaml is invalid:" >&2; cat fulcrum_check.log >&2; exit 2; }
}
FLOOD_EDGE="allow: [127.0.0.0/8], flood: { limit: $LIMIT, window: 1s, ban: 60s }"
AB_EDGE="allow: [127.0.0.0/8], deny: [10.0.0.0/8, 192.0.2.0/24, \"2001:db8::/32\"], flood: { limit: 1000000, window: 1s, ban: 60s }"

for port in $UAS_PORTS; do echo "1 sip:127.0.0.1:$port"; done > dispatcher.list
echo "1 127.0.0.0 8 0" > address.list
{ kamailio_head "generated by bench/flood.sh: permissions (group 1 = 127.0.0.0/8) and pike in front of dispatcher alg 0 (Call-ID hash) + stateless forward()" \
    "$KCHILDREN" "udp:127.0.0.1:$PROXY_PORT" yes "$BUF"
  cat <<EOF
loadmodule "kex.so"
loadmodule "sl.so"
loadmodule "maxfwd.so"
loadmodule "pv.so"
loadmodule "siputils.so"
loadmodule "ctl.so"
loadmodule "permissions.so"
loadmodule "pike.so"
loadmodule "dispatcher.so"
modparam("ctl", "binrpc", "unix:$OUT/kamailio.ctl")
modparam("permissions", "address_file", "$OUT/address.list")
modparam("pike", "sampling_time_unit", 1)
modparam("pike", "reqs_density_per_unit", $LIMIT)
modparam("dispatcher", "list_file", "$OUT/dispatcher.list")
modparam("dispatcher", "ds_ping_interval", 0)
modparam("dispatcher", "flags", 2)
request_route {
    if (!allow_source_address("1")) { drop; }
    if (!has_totag() && !pike_check_req()) { drop; }
    if (!mf_process_maxfwd_header("10")) { sl_send_reply("483", "Too Many Hops"); exit; }
    if (!ds_select_dst("1", "0")) { sl_send_reply("503", "No destination"); exit; }
    forward();
    exit;
}
EOF
} > kamailio.cfg

# --- processes -----------------------------------------------------------------------
UAS_PIDS=()
start_strict_uas() {   # $1 = run tag
  local i=0 port
  UAS_PIDS=()
  for port in $UAS_PORTS; do
    "$UAS_BIN" "s$i" "127.0.0.1:$port" udp $MAXT > "uas_${1}_s$i.log" 2>&1 &
    UAS_PIDS+=("$!"); PIDS+=("$!")
    i=$((i + 1))
  done
  for i in 0 1 2; do wait_line "uas_${1}_s$i.log" '^ready' || return 1; done
}
start_sipp_uas() {   # $1 = run tag
  local port
  UAS_PIDS=()
  for port in $UAS_PORTS; do
    timeout $MAXT sipp -sn uas -t u1 -i 127.0.0.1 -p "$port" -nostdin -buff_size $BUF \
      > "uas_${1}_${port}.log" 2>&1 &
    UAS_PIDS+=("$!"); PIDS+=("$!")
  done
  for port in $UAS_PORTS; do wait_port "$port" || return 1; done
}
stop_uas() {
  local p
  for p in "${UAS_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${UAS_PIDS[@]}"; do wait "$p" 2>/dev/null; done
  UAS_PIDS=()
}

PROXY_PID=""; PROXY_WRAP=""
start_proxy() {   # $1 = fulcrum | kamailio, $2 = log
  case $1 in
    fulcrum)  timeout $MAXT "$FULCRUM" run --config fulcrum.yaml --drain-timeout 1s > "$2" 2>&1 & ;;
    kamailio) timeout $MAXT kamailio -f kamailio.cfg -DD -E -m 128 -M 16 > "$2" 2>&1 & ;;
  esac
  PROXY_WRAP=$!; PIDS+=("$PROXY_WRAP")
  PROXY_PID=$(child_of "$PROXY_WRAP") || { echo "$1 did not start" >&2; return 1; }
  PIDS+=("$PROXY_PID")
  wait_port "$PROXY_PORT" || return 1
  if [ "$1" = kamailio ]; then
    local i; for i in $(seq 1 50); do kam core.version >/dev/null 2>&1 && break; sleep 0.1; done
  else
    local i; for i in $(seq 1 50); do timeout 2 curl -sf "127.0.0.1:$ADMIN_PORT/status" >/dev/null && break; sleep 0.1; done
  fi
}

# --- phase flood ---------------------------------------------------------------------
FSUM=flood.tsv
printf "flood\tproxy\tflood_sent\tflood_rate\tattempted\tsuccessful\tfailed\tcpu_s\tus_per_legit_msg\tproxy_dropped\tflood_answered\tbanned\trcvbuf_drops\tuas_requests\n" > $FSUM

flood_run() {   # $1 = proxy, $2 = flood rate (0, N or max)
  local proxy=$1 frate=$2 tag="flood_${1}_${2}" calls=$((RATE * DUR)) fl="" fpid=""
  local k0 k1 d0 d1 s0 s1 f0 f1
  start_strict_uas "$tag" || return 1
  start_proxy "$proxy" "${proxy}_$tag.log" || return 1
  if [ "$proxy" = kamailio ]; then f0=$(kstat core:fwd_requests); s0=$(kstat core:rcv_requests); fi
  d0=$(rcvbuf_errors); k0=$(tree_ticks "$PROXY_PID")
  if [ "$frate" != 0 ]; then
    fl=$frate; [ "$fl" = max ] && fl=0
    timeout $((DUR + 20)) "$FLOOD_BIN" $FLOODER_IP "127.0.0.1:$PROXY_PORT" "$fl" "$(awk -v d="$DUR" 'BEGIN{print d + 2}')" \
      "$FLOOD_MAX" > "flooder_$tag.log" 2>&1 &
    fpid=$!; PIDS+=("$fpid")
    sleep 0.5
  fi
  timeout $((DUR * 3 + 40)) sipp -sn uac -t u1 "127.0.0.1:$PROXY_PORT" -i 127.0.0.1 -p $UAC_PORT \
    -r "$RATE" -m "$calls" -l $((RATE * 10)) -nostdin -buff_size $BUF \
    -timeout $((DUR * 3 + 30))s -recv_timeout 5000 \
    -trace_stat -stf "uac_$tag.csv" -fd 1 > "uac_$tag.log" 2>&1
  [ -n "$fpid" ] && wait "$fpid"
  k1=$(tree_ticks "$PROXY_PID"); d1=$(rcvbuf_errors)
  local dropped banned="no"
  if [ "$proxy" = kamailio ]; then
    f1=$(kstat core:fwd_requests); s1=$(kstat core:rcv_requests)
    dropped=$(( (s1 - s0) - (f1 - f0) ))
    kam pike.top > "pike_$tag.txt" 2>&1
    grep -q 'status: HOT' "pike_$tag.txt" && banned="yes (pike HOT)"
  else
    timeout 5 curl -s "127.0.0.1:$ADMIN_PORT/status" > "status_$tag.json"
    dropped=$(( $(jnum flood "status_$tag.json") + $(jnum acl "status_$tag.json") ))
    banned=$(jnum bans_total "status_$tag.json")
  fi
  stop_proxy
  sleep 0.3
  stop_uas
  local f="uac_$tag.csv" att ok fail cpu us sent=0 srate=0 answered=0 uasreq
  att=$(col "$f" "TotalCallCreated"); ok=$(col "$f" "SuccessfulCall(C)"); fail=$(col "$f" "FailedCall(C)")
  cpu=$(awk -v d=$((k1 - k0)) -v hz="$HZ" 'BEGIN{printf "%.2f", d/hz}')
  us=$(awk -v c="$cpu" -v s="$ok" 'BEGIN{printf "%.1f", (s>0)? c*1e6/(s*6) : 0}')
  if [ -n "$fpid" ]; then
    sent=$(sed -n 's/.*sent=\([0-9]*\).*/\1/p' "flooder_$tag.log")
    srate=$(sed -n 's/.* rate=\([0-9]*\).*/\1/p' "flooder_$tag.log")
    answered=$(sed -n 's/.*answered=\([0-9]*\).*/\1/p' "flooder_$tag.log")
  fi
  uasreq=$(for l in uas_"${tag}"_s*.log; do grep '^counts' "$l" | tail -1; done |
    awk '{for(i=2;i<=NF;i++){split($i,kv,"="); if(kv[1]=="requests") r+=kv[2]}} END{print r+0}')
  printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n" "$frate" "$proxy" "${sent:-0}" "${srate:-0}" \
    "$att" "$ok" "$fail" "$cpu" "$us" "$dropped" "${answered:-0}" "$banned" "$((d1 - d0))" "$uasreq" | tee -a $FSUM
}

# --- phase ab ------------------------------------------------------------------------
ABSUM=ab.tsv
printf "run\tconfig\tcalls\tsuccessful\tfailed\tretrans\tcpu_s\tus_per_msg\n" > $ABSUM
ab_run() {   # $1 = run number, $2 = A | B
  local tag="ab_$1_$2" n=$((AB_RATE * AB_DUR)) k0 k1
  if [ "$2" = A ]; then fulcrum_config ""; else fulcrum_config "$AB_EDGE"; fi
  cp fulcrum.yaml "fulcrum_$tag.yaml"
  start_proxy fulcrum "fulcrum_$tag.log" || return 1
  k0=$(tree_ticks "$PROXY_PID")
  timeout $((AB_DUR * 3 + 30)) sipp -sn uac -t u1 "127.0.0.1:$PROXY_PORT" -i 127.0.0.1 -p $UAC_PORT \
    -r "$AB_RATE" -m "$n" -l $((AB_RATE * 2 + 100)) -nostdin -buff_size $BUF \
    -timeout $((AB_DUR * 3 + 20))s -trace_stat -stf "uac_$tag.csv" -fd 5 > "uac_$tag.log" 2>&1
  k1=$(tree_ticks "$PROXY_PID")
  if [ "$2" = B ]; then timeout 5 curl -s "127.0.0.1:$ADMIN_PORT/status" > "status_$tag.json"; fi
  stop_proxy
  local f="uac_$tag.csv" ok fail retr cpu us
  ok=$(col "$f" "SuccessfulCall(C)"); fail=$(col "$f" "FailedCall(C)"); retr=$(col "$f" "Retransmissions(C)")
  cpu=$(awk -v d=$((k1 - k0)) -v hz="$HZ" 'BEGIN{printf "%.2f", d/hz}')
  us=$(awk -v c="$cpu" -v s="$ok" 'BEGIN{printf "%.3f", (s>0)? c*1e6/(s*6) : 0}')
  printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n" "$1" "$2" "$n" "$ok" "$fail" "$retr" "$cpu" "$us" | tee -a $ABSUM
}

echo "# results in $OUT"
echo "# FLOODS=\"$FLOODS\" RATE=$RATE DUR=$DUR LIMIT=$LIMIT AB_RATE=$AB_RATE AB_DUR=$AB_DUR AB_REPEATS=$AB_REPEATS KCHILDREN=$KCHILDREN FWORKERS=$FWORKERS"
echo "# $(kamailio -v 2>/dev/null | head -1); $(sipp -v 2>/dev/null | grep -o 'SIPp v[0-9.]*' | head -1); $(nproc) CPUs"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# foreign CPU users at start: $(ps -eo pcpu,comm --sort=-pcpu --no-headers | awk '$1>20{printf "%s(%s%%) ", $2, $1}')"
T0=$(date +%s)

case " $PHASES " in *" flood "*)
  fulcrum_config "$FLOOD_EDGE"
  head -1 $FSUM
  for frate in $FLOODS; do
    for proxy in $PROXIES; do
      flood_run "$proxy" "$frate" || { echo "flood $frate / $proxy: run failed (logs in $OUT)" >&2; stop_proxy; stop_uas; }
    done
  done
  echo "# load average after the flood phase: $(cut -d' ' -f1-3 /proc/loadavg)"
  ;;
esac

case " $PHASES " in *" ab "*)
  start_sipp_uas ab || exit 1
  head -1 $ABSUM
  for r in $(seq 1 "$AB_REPEATS"); do
    if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
    for c in $order; do ab_run "$r" "$c" || { echo "ab $r $c: run failed (logs in $OUT)" >&2; stop_proxy; }; done
  done
  stop_uas
  echo "# load average after the A/B phase: $(cut -d' ' -f1-3 /proc/loadavg)"
  ;;
esac
echo "# elapsed: $(( $(date +%s) - T0 )) s"

echo
if [ "$(wc -l < $FSUM)" -gt 1 ]; then
  echo "| flood (target/s) | proxy | flood sent (achieved/s) | legit calls attempted / ok / failed | proxy CPU s | µs CPU / legit msg | flood dropped by proxy | flood answered | kernel rcvbuf drops |"
  echo "|---|---|---|---|---|---|---|---|---|"
  awk -F'\t' 'NR>1{printf "| %s | %s | %s (%s) | %s / %s / %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $13}' $FSUM
fi
if [ "$(wc -l < $ABSUM)" -gt 1 ]; then
  echo
  echo "| config | runs | µs CPU / SIP msg, each run (in run order) | median | spread (max-min)/median | failed calls |"
  echo "|---|---|---|---|---|---|"
  declare -A MED
  for c in A B; do
    vals=$(awk -F'\t' -v c="$c" 'NR>1 && $2==c {print $8}' $ABSUM)
    [ -n "$vals" ] || continue
    MED[$c]=$(echo "$vals" | sort -g | awk '{v[NR]=$1} END{print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}')
    echo "$vals" | sort -g | awk -v c="$c" -v m="${MED[$c]}" -v l="$(echo "$vals" | paste -sd, | sed 's/,/, /g')" \
      -v f="$(awk -F'\t' -v c="$c" 'NR>1 && $2==c {f+=$5} END{print f+0}' $ABSUM)" \
      '{v[NR]=$1} END{printf "| %s | %d | %s | %.3f | %.1f%% | %d |\n", (c=="A"?"A: no checks":"B: allow + deny + flood"), NR, l, m, (m>0)?100*(v[NR]-v[1])/m:0, f}'
  done
  if [ -n "${MED[A]:-}" ] && [ -n "${MED[B]:-}" ]; then
    awk -v a="${MED[A]}" -v b="${MED[B]}" 'BEGIN{if(a>0) printf "B/A (medians): %.3f (%+.1f%%)\n", b/a, 100*(b/a-1)}'
  fi
fi
