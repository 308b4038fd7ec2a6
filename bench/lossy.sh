#!/usr/bin/env bash
# SIP through a lossy network: how many requests fail when LOSS % of the UDP datagrams are lost
# at every hop, through fulcrum (its default config: failover on, so transaction-stateful for
# the requests outside a dialog) and through Kamailio (tm + dispatcher failover), same load,
# same services. Target: through fulcrum at most 1 % of the requests fail, and at most
# Kamailio's count + 2.
#
#   SIPp UAC (127.0.0.1:$BASE+10) -> proxy 127.0.0.1:$BASE (sip-udp, Record-Route)
#     -> 3 SIPp UAS s0..s2 on 127.0.0.1:$BASE+11..13 (fixtures/sipp/lossy_uas_*.xml)
#
# The network: everything runs in a network namespace of its own (fulcrum-lossy-PID, only `lo`
# up, removed on exit; needs root), every process bound to 127.0.0.1 there. nftables in that
# namespace (this kernel has no netem) drops LOSS % of the UDP datagrams on arrival (input hook,
# `numgen random mod 100 < LOSS`), each datagram decided once, but only those from or to the
# SIP ports of the run (the proxy's, the UAC's and the services'; from or to: fulcrum may send
# to a service, or probe it, from a port of its own): DNS and anything else in the namespace
# is untouched. Every hop loses: UAC -> proxy, proxy -> service, and the answers back, the
# proxies' OPTIONS keep-alives too. nft counters give the datagrams seen and dropped during
# the load.
#
# Scenarios (one SIPp "call" = one request of the table, or the pair for `register`), CALLS
# of them at RATE/s, each in a run of its own per (LOSS, proxy):
#   refused   INVITE, the callee answers 486 Busy Here, the caller ACKs (same branch, hop by
#             hop; fixtures/sipp/lossy_refused.xml); fails when the 486 never comes (32 s)
#   answered  INVITE, 200, ACK and BYE along the Record-Route set, held HOLD ms: the messages
#             of fixtures/sipp/uac_rr.xml (gray.sh's) with SIPp transactions
#             (fixtures/sipp/lossy_answered.xml): with uac_rr.xml a retransmitted 200 of the
#             INVITE passes for the answer to a lost BYE, a success the service never saw
#             (ANSWERED_SF=fixtures/sipp/uac_rr.xml measures with it anyway)
#   message   MESSAGE outside a dialog, answered 200 (fixtures/sipp/lossy_message.xml)
#   register  REGISTER, 200, then its refresh (same Call-ID, CSeq + 1), 200
#             (fixtures/sipp/lossy_register.xml)
# The UAC retransmits its requests itself over UDP (SIPp, retrans="500": Timer A / E, T1
# 500 ms doubling, up to T2 4 s for non-INVITE; a 100 stops an INVITE's), fails a call that
# gets no expected answer within -recv_timeout 32 s (64*T1, Timer B / F) and ACKs again a
# 486 or 200 retransmitted to it. A request counts as failed when its SIPp call fails
# (FailedCall) or never ends (attempted - successful - failed: calls cut by -timeout).
#
# Services: SIPp as UAS, one process per service, with the scenario of the row
# (fixtures/sipp/lossy_uas_{refused,answered,message,register}.xml), not examples/strict_uas:
# strict_uas answers a retransmitted request again but never retransmits a response by itself
# (no Timer G for its non-2xx finals, no 2xx retransmission until the ACK, RFC 3261 §13.3.1.4,
# §17.2.1), so on a lossy network it would make both proxies fail calls a real UAS saves.
# The SIPp UAS retransmits its 486 / 200 at 500 ms doubling up to 4 s until the ACK (or BYE),
# for 31.5 s at most; sends its last response again when a request is retransmitted; keeps a
# finished transaction (5 s after the ACK of its 486, 32 s after a 200 to a non-INVITE / BYE)
# to answer copies. It is strict: one SIPp instance knows only its own calls, and a request of
# a call it did not set up starts a fresh instance of the scenario, whose top answers OPTIONS
# 200, a BYE or CANCEL of no dialog 481 (§12.2.2, §9.2; SIPp itself would answer an unknown
# BYE 200), leaves an ACK of no transaction unanswered (both logged, counted below), and
# aborts on anything else unexpected without an answer (SIPp's default; in its error log).
# Looser than strict_uas: SIPp matches a call on the Call-ID alone (not the tags, §12) and a
# retransmission on the whole message's bytes.
#
# Proxies (both hash the Call-ID over the three services, add Record-Route, and probe the
# services with OPTIONS every second):
#   fulcrum   release build (FULCRUM=PATH: another build, e.g. for an A/B; copied into $OUT
#             at the start, so a rebuild during the run changes nothing), the config an
#             operator writes: a sip-udp vserver, call_id_hash, record_route: true, a
#             sip-options monitor (interval 1 s, timeout 500 ms, the rest default) and nothing
#             about failover (on by default: docs/sip.md, "Failover")
#   kamailio  ../shared/bench/peers/kamailio/kamailio-failover.cfg (dispatcher alg 0 + tm,
#             fr_timer 2 s, a failure_route to ds_next_dst on a 5xx or no answer; in-dialog
#             requests relayed by tm too, so a BYE unanswered for 2 s gets Kamailio's 408),
#             its list file and listen port substituted, run in the namespace (-DD -E)
#   direct    no proxy: the UAC sends to s0 itself (a control: what the two SIPp endpoints
#             save on their own, over 2 lossy hops instead of 4). Not in the default PROXIES.
# Each run waits SETTLE s after the proxy is up (its first keep-alives) before the load.
#
# Output, in $OUT: summary.tsv, one line per (loss, scenario, proxy): requests attempted,
# successful, failed (SIPp's counts; why: no expected answer within 32 s / UDP retransmissions
# exhausted / unexpected message) and never ended; the UAC's retransmissions; SIP datagrams
# seen and dropped by nft during the load; kernel receive-buffer drops in the namespace (0
# expected); the services' retransmissions, failed calls (an unexpected message, or a final
# still unACKed after 31.5 s: only those the run lasted long enough to see), 481s sent and
# stray ACKs received; the run's seconds. Then a markdown table and, per (loss, scenario),
# whether fulcrum met the target (failed + never ended). Kept per run: SIPp's error logs
# (uac_TAG_errors.log, uas_TAG_sN_errors.log; the first lines of a UAC's with failures are
# printed), one line per message sent or received (uac_TAG_short.log, uas_TAG_sN_short.log:
# -trace_shortmsg), the UAS <log> lines (uas_TAG_sN_actions.log), the proxy's log, fulcrum's
# /metrics at the end of its runs (metrics_TAG.txt). TAG = LOSS_SCENARIO_PROXY.
#
# Every process runs under `timeout`; the EXIT trap ends those this script started, by PID,
# and deletes the namespace (its nft table with it). A run lasts the time to place the calls
# (CALLS / RATE, 8 s) plus its longest call: about 10 s when every call ends quickly, 40 s
# when one fails at the 32 s receive timeout (at most PLACE + 80 s, SIPp's -timeout). Whole
# run with the defaults (16 runs): about 5 minutes when no call fails, 13 at most.
#
# Usage (as root): bench/lossy.sh
#        LOSS="2 5 10" SCENARIOS="refused answered" PROXIES="fulcrum kamailio direct" \
#          CALLS=400 RATE=50 HOLD=500 FULCRUM=/tmp/fulcrum.old bench/lossy.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"   # ROOT, PEERS, PIDS, cleanup (on exit), child_of, stop_proxy, col
RATE=${RATE:-25}
CALLS=${CALLS:-200}
HOLD=${HOLD:-500}           # ms each answered call is held between ACK and BYE
LOSS=${LOSS:-"5 10"}        # % of the SIP datagrams dropped, one set of runs per value
SCENARIOS=${SCENARIOS:-"refused answered message register"}
PROXIES=${PROXIES:-"fulcrum kamailio"}
SETTLE=${SETTLE:-2}         # s between the proxy being up and the load
SIPP_ARGS=${SIPP_ARGS:-}    # more UAC options, e.g. -trace_msg (each message in full, in $OUT)
BASE=${BASE:-29060}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
FULCRUM=${FULCRUM:-$TARGET/release/fulcrum}
KAM_CFG=${KAM_CFG:-$PEERS/kamailio/kamailio-failover.cfg}
FIX=$ROOT/fixtures/sipp
ANSWERED_SF=${ANSWERED_SF:-$FIX/lossy_answered.xml}   # the UAC scenario of `answered`
OUT=${OUT:-${TMPDIR:-/tmp}/fulcrum-bench-lossy-$(date +%Y%m%d-%H%M%S)}
MAXT=900                    # hard bound for any background process
BUF=4194304                 # SIPp's -buff_size
RECV_TIMEOUT=32000          # ms: a call with no expected answer this long fails (64*T1)
PROXY_PORT=$BASE
UAC_PORT=$((BASE + 10))
ADMIN_PORT=$((BASE + 20))
UAS_NAMES="s0 s1 s2"
uas_port() { echo $((BASE + 11 + ${1#s})); }
PLACE=$(( (CALLS + RATE - 1) / RATE ))                 # s to place every call
NS=fulcrum-lossy-$$

for s in $SCENARIOS; do
  case $s in refused|answered|message|register) ;;
    *) echo "SCENARIOS: \`$s\` is not refused, answered, message or register" >&2; exit 2 ;; esac
done
for p in $PROXIES; do
  case $p in fulcrum|kamailio|direct) ;; *) echo "PROXIES: \`$p\` is not fulcrum, kamailio or direct" >&2; exit 2 ;; esac
done
for l in $LOSS; do
  case $l in ''|*[!0-9]*) echo "LOSS: \`$l\` is not a whole percentage" >&2; exit 2 ;; esac
  [ "$l" -le 100 ] || { echo "LOSS: $l > 100" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "needs root (ip netns, nft)" >&2; exit 2; }
for c in ip nft sipp; do
  command -v $c >/dev/null || { echo "$c not found (apt-get install -y iproute2 nftables sip-tester)" >&2; exit 2; }
done
case " $PROXIES " in *" kamailio "*)
  command -v kamailio >/dev/null || { echo "kamailio not found (apt-get install -y kamailio)" >&2; exit 2; }
  [ -r "$KAM_CFG" ] || { echo "no Kamailio recipe at $KAM_CFG (PEERS=$PEERS)" >&2; exit 2; } ;;
esac
case " $PROXIES " in *" fulcrum "*)
  if [ ! -x "$FULCRUM" ]; then
    (cd "$ROOT" && nice -n 10 cargo build --release --quiet --bin fulcrum) || exit 2
  fi ;;
esac
case $ANSWERED_SF in /*) ;; *) ANSWERED_SF=$PWD/$ANSWERED_SF ;; esac   # before the cd
case $FULCRUM in /*) ;; *) FULCRUM=$PWD/$FULCRUM ;; esac
[ -r "$ANSWERED_SF" ] || { echo "no scenario $ANSWERED_SF" >&2; exit 2; }
mkdir -p "$OUT"; cd "$OUT" || exit 2
FULCRUM_SRC=$FULCRUM
case " $PROXIES " in *" fulcrum "*)   # every run measures the same build, whatever cargo does meanwhile
  cp "$FULCRUM" "$OUT/fulcrum.bin" && FULCRUM=$OUT/fulcrum.bin || exit 2 ;;
esac

# --- the namespace and its lossy input hook -----------------------------------------------
ip netns add "$NS" || exit 2
trap 'cleanup; ip netns del "$NS" 2>/dev/null; rm -rf "$TMP"' EXIT
nsx() { ip netns exec "$NS" "$@"; }
nsx ip link set lo up || exit 2
SIP_PORTS="$PROXY_PORT, $UAC_PORT"
for s in $UAS_NAMES; do SIP_PORTS="$SIP_PORTS, $(uas_port "$s")"; done

lossy() {   # $1 = LOSS: (re)make the table, counters at 0
  nsx nft delete table inet lossy 2>/dev/null
  nsx nft -f - <<NFT
table inet lossy {
  set sip { type inet_service; elements = { $SIP_PORTS } }
  counter seen { }
  counter dropped { }
  chain lose {
    counter name seen
    numgen random mod 100 < $1 counter name dropped drop
    accept
  }
  chain input {
    type filter hook input priority 0; policy accept;
    udp dport @sip jump lose
    udp sport @sip jump lose
  }
}
NFT
}
packets() { nsx nft list counter inet lossy "$1" | awk '/packets/{print $2}'; }
ns_rcvbuf() { nsx awk '/^Udp:/{if(!h){for(i=1;i<=NF;i++) c[$i]=i; h=1} else print $c["RcvbufErrors"]}' /proc/net/snmp; }
# ns_wait_port PORT: until something in the namespace listens on UDP PORT (at most 10 s)
ns_wait_port() {
  local i
  for i in $(seq 1 100); do
    nsx ss -Hulnp "sport = :$1" 2>/dev/null | grep -q . && return 0
    sleep 0.1
  done
  echo "nothing bound udp port $1 in $NS" >&2; return 1
}

# --- configs -------------------------------------------------------------------------
{
  echo "# generated by bench/lossy.sh: what an operator writes (failover is on by default)"
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
declare -A UAS_WRAP
start_uas() {   # $1 = run tag, $2 = name, $3 = scenario
  local f="uas_${1}_$2"
  timeout $MAXT ip netns exec "$NS" sipp -sf "$FIX/lossy_uas_$3.xml" -t u1 -i 127.0.0.1 -p "$(uas_port "$2")" \
    -nostdin -buff_size $BUF -trace_stat -stf "$f.csv" -fd 1 -trace_err -error_file "${f}_errors.log" \
    -trace_logs -log_file "${f}_actions.log" -trace_shortmsg -shortmessage_file "${f}_short.log" \
    > /dev/null 2> "$f.stderr" &
  UAS_WRAP[$2]=$!; PIDS+=("$!")
  ns_wait_port "$(uas_port "$2")"
}

PROXY_PID=""; PROXY_WRAP=""
start_proxy() {   # $1 = fulcrum | kamailio
  case $1 in
    fulcrum)
      timeout $MAXT ip netns exec "$NS" "$FULCRUM" run --config fulcrum.yaml --drain-timeout 1s > "fulcrum_$TAG.log" 2>&1 & ;;
    kamailio)
      timeout $MAXT ip netns exec "$NS" kamailio -f kamailio.cfg -DD -E -m 64 -M 8 > "kamailio_$TAG.log" 2>&1 & ;;
  esac
  PROXY_WRAP=$!; PIDS+=("$PROXY_WRAP")
  PROXY_PID=$(child_of "$PROXY_WRAP") || { echo "$1 did not start" >&2; return 1; }
  PIDS+=("$PROXY_PID")
  ns_wait_port "$PROXY_PORT" || return 1
}

SUMMARY=summary.tsv
printf "loss\tscenario\tproxy\tattempted\tsuccessful\tfailed\tfail_no_answer\tfail_max_retrans\tfail_unexpected\tnever_ended\tuac_retrans\tdatagrams\tdropped\trcvbuf_drops\tuas_retrans\tuas_failed\tuas_481\tuas_stray_acks\tseconds\n" > $SUMMARY

run_one() {   # $1 = loss, $2 = scenario, $3 = proxy
  local loss=$1 scen=$2 proxy=$3 s sf dest t0 t1 seen0 drop0 rb0 seen1 drop1 rb1
  TAG="${loss}_${scen}_${proxy}"
  lossy "$loss" || return 1
  for s in $UAS_NAMES; do start_uas "$TAG" "$s" "$scen" || return 1; done
  dest=127.0.0.1:$PROXY_PORT
  if [ "$proxy" = direct ]; then dest=127.0.0.1:$(uas_port s0); else start_proxy "$proxy" || return 1; fi
  sleep "$SETTLE"
  sf=$FIX/lossy_$scen.xml; [ "$scen" = answered ] && sf=$ANSWERED_SF
  seen0=$(packets seen); drop0=$(packets dropped); rb0=$(ns_rcvbuf); t0=$(date +%s)
  timeout $((PLACE + 90)) ip netns exec "$NS" sipp -sf "$sf" -t u1 "$dest" -i 127.0.0.1 -p $UAC_PORT \
    -r "$RATE" -m "$CALLS" -l "$CALLS" -d "$HOLD" -nostdin -buff_size $BUF \
    -recv_timeout $RECV_TIMEOUT -timeout $((PLACE + 80))s -default_behaviors all,-bye \
    -trace_stat -stf "uac_$TAG.csv" -fd 1 -trace_err -error_file "uac_${TAG}_errors.log" \
    -trace_shortmsg -shortmessage_file "uac_${TAG}_short.log" \
    ${SIPP_ARGS:+$SIPP_ARGS} -message_file "uac_${TAG}_messages.log" > "uac_$TAG.log" 2>&1
  t1=$(date +%s); seen1=$(packets seen); drop1=$(packets dropped); rb1=$(ns_rcvbuf)
  [ "$proxy" = fulcrum ] && nsx timeout 5 curl -s "127.0.0.1:$ADMIN_PORT/metrics" > "metrics_$TAG.txt" 2>&1
  sleep 1.2   # the services' statistics files are written every second
  for s in $UAS_NAMES; do kill -TERM "${UAS_WRAP[$s]}" 2>/dev/null; wait "${UAS_WRAP[$s]}" 2>/dev/null; done
  [ "$proxy" != direct ] && stop_proxy
  local f="uac_$TAG.csv" att ok fail nend uas n481 stray
  att=$(col "$f" "TotalCallCreated"); ok=$(col "$f" "SuccessfulCall(C)"); fail=$(col "$f" "FailedCall(C)")
  nend=$(awk -v a="$att" -v o="$ok" -v f="$fail" 'BEGIN{print (a == "NA" || o == "NA" || f == "NA") ? "NA" : a - o - f}')
  # the services' retransmissions and failed calls, summed (their last statistics line)
  uas=$(for s in $UAS_NAMES; do echo "$(col "uas_${TAG}_$s.csv" "Retransmissions(C)") $(col "uas_${TAG}_$s.csv" "FailedCall(C)")"; done |
    awk '{r+=$1; f+=$2} END{printf "%d\t%d", r, f}')
  n481=$(cat uas_"${TAG}"_s?_actions.log 2>/dev/null | grep -c '^481 ')
  stray=$(cat uas_"${TAG}"_s?_actions.log 2>/dev/null | grep -c '^stray-ack ')
  printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n" "$loss" "$scen" "$proxy" \
    "$att" "$ok" "$fail" "$(col "$f" "FailedTimeoutOnRecv(C)")" "$(col "$f" "FailedMaxUDPRetrans(C)")" \
    "$(col "$f" "FailedUnexpectedMessage(C)")" "$nend" "$(col "$f" "Retransmissions(C)")" \
    $((seen1 - seen0)) $((drop1 - drop0)) $((rb1 - rb0)) "$uas" "$n481" "$stray" $((t1 - t0)) | tee -a $SUMMARY
  if { [ "${fail:-0}" != 0 ] || [ "$nend" != 0 ]; } && [ -s "uac_${TAG}_errors.log" ]; then
    echo "  $TAG: first SIPp error lines (uac_${TAG}_errors.log):" >&2
    grep -E 'Aborting|timeout|retrans' "uac_${TAG}_errors.log" | head -4 | cut -c1-220 | sed "s/^'\?/    /" >&2
  fi
}

echo "# results in $OUT"
echo "# fulcrum $(git -C "$ROOT" rev-parse HEAD 2>/dev/null), \`git status --short\`: $(git -C "$ROOT" status --short 2>/dev/null | wc -l) lines" \
  "($(git -C "$ROOT" status --short -- src Cargo.toml Cargo.lock 2>/dev/null | wc -l) in src/, Cargo.*);" \
  "binary $FULCRUM_SRC ($( [ -x "$FULCRUM" ] && echo "built $(stat -c %y "$FULCRUM_SRC" | cut -d. -f1), sha256 $(sha256sum "$FULCRUM" | cut -c1-12); run as a copy, $FULCRUM" || echo "not used"))"
echo "# LOSS=\"$LOSS\" % per hop, CALLS=$CALLS at RATE=$RATE/s, HOLD=$HOLD ms, SETTLE=$SETTLE s;" \
  "$(kamailio -v 2>/dev/null | head -1); $(sipp -v 2>/dev/null | grep -o 'SIPp v[0-9.]*' | head -1); nftables $(nft -v | awk '{print $2}'); kernel $(uname -r)"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
head -1 $SUMMARY
for loss in $LOSS; do
  for scen in $SCENARIOS; do
    for proxy in $PROXIES; do
      run_one "$loss" "$scen" "$proxy" || echo "$loss% / $scen / $proxy: run failed (logs in $OUT)" >&2
      cleanup
    done
  done
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| loss per hop | scenario | proxy | requests | successful | failed (no answer in 32 s / retransmissions exhausted / unexpected message) | never ended | UAC retransmissions | SIP datagrams / dropped | services: retransmissions / failed / 481s sent / stray ACKs | time |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
awk -F'\t' 'NR>1{printf "| %s %% | %s | %s | %s | %s | **%s** (%s / %s / %s) | %s | %s | %s / %s | %s / %s / %s / %s | %s s |\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $15, $16, $17, $18, $19}' $SUMMARY
echo
# the target: through fulcrum, failed + never ended <= 1 % of the requests and <= Kamailio's + 2
awk -F'\t' 'NR>1{k=$1 FS $2; bad[k FS $3]=$6+$10; att[k FS $3]=$4; keys[k]=1}
  END{for (k in keys) { if (!((k FS "fulcrum") in bad)) continue
        f=bad[k FS "fulcrum"]; a=att[k FS "fulcrum"]; split(k, x, FS)
        line=sprintf("target %s%% %s: fulcrum %d of %d failed", x[1], x[2], f, a)
        ok=(f <= a/100)
        if ((k FS "kamailio") in bad) { line=line sprintf(", Kamailio %d", bad[k FS "kamailio"]); ok=ok && f <= bad[k FS "kamailio"]+2 }
        print line ": " (ok ? "met" : "NOT met") }}' $SUMMARY | sort -t' ' -k2,2n -k3,3
