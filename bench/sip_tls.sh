#!/usr/bin/env bash
# SIP over TLS: fulcrum (sip-tls) vs Kamailio (tls module), side by side in one run.
#
#   sip_tls_load (CONNS TLS connections) -> proxy 127.0.0.1:$BASE (TLS)
#     -> 3 strict UAS over TLS 127.0.0.1:$BASE+11..13
#
# Debian's SIPp has no TLS, so the load is examples/sip_tls_load.rs: whole calls (INVITE,
# 100 / 180 / 200, ACK, BYE, 200) paced to a total call rate, unique Call-IDs, the route set
# from Record-Route, the proxy's certificate verified against the run's CA; a call fails on a
# final status >= 300 (481 counted apart), on no answer within CALL_TIMEOUT_MS, or on a closed
# connection. The services are examples/strict_uas.rs over TLS: a BYE for a dialog the UAS
# did not set up (a misrouted one) gets 481.
# Certificates: made here with openssl in the run's directory (a CA; the proxies' certificate
# for proxy.bench and 127.0.0.1; the services' for uas.bench and 127.0.0.1; EC P-256).
#
# Proxies (both record-route, both verify the services' certificates against the CA):
#   fulcrum   release build, a sip-tls vserver (call_id_hash, record_route) over sip-tls
#             services, FWORKERS workers (0 = one per core)
#   kamailio  tls module (listen=tls:), dispatcher alg 0 (Call-ID hash) toward
#             `;transport=tls` destinations + stateless forward(), record_route() and
#             loose_route() for the in-dialog requests: bench/sip.sh's configuration with
#             TLS and the rr module; KCHILDREN workers.
#
# For each proxy, on a fresh proxy and fresh services (so no backlog of an overloaded ladder
# step is counted):
# 1. Fixed rate FIXED for FIXED_DUR seconds: proxy CPU time (utime + stime of the proxy and
#    its children, /proc) per SIP message through the proxy: 7 per call (INVITE, 100, 180,
#    200, ACK, BYE, 200; the strict UAS sends a 100, SIPp's UAS in bench/sip.sh does not, so
#    that script counts 6).
# 2. Ladder: every rate of RATES for DUR seconds until the first unclean run.
#    Clean = every call completed, 0 failed (481, other status, timeout, closed, unstarted),
#    0 late responses (a provisional after the 200: reordering), 0 stray messages, 0 481s
#    sent by the services, completed calls/s >= 97% of the target. load_cpu_pct is the load
#    generator's own CPU (one thread: near 100% it, not the proxy, is the ceiling);
#    proxy_rss_kib the proxy's main process after the run.
# 3. Burst (BURST calls/s, 0 = skipped): BURST_DUR seconds with the load generator stopped
#    (SIGSTOP) STALL_AT seconds in for STALL_FOR seconds, after which it sends every call it
#    owes at once (at 4 000 calls/s and 3 s, 3 000 INVITEs on each of 4 connections): a trunk
#    that bursts. Calls may be late (BURST_TIMEOUT_MS); clean = every call completed, none
#    lost to a closed connection.
# Prints both highest clean rates, their ratio, the CPU per message and its ratio, the burst's
# outcome, and the proxies' resident memory before and after (a leak would show as growth).
#
# Every process runs under `timeout`; the EXIT trap terminates the processes this script
# started, by PID.
#
# Usage: bench/sip_tls.sh   (defaults below; about 3 minutes)
#        RATES="1000 2000 4000" DUR=5 FIXED=2000 FIXED_DUR=10 CONNS=4 PROXIES="fulcrum kamailio" bench/sip_tls.sh
#        RATES=1000 DUR=2 FIXED=1000 FIXED_DUR=2 BURST=4000 bench/sip_tls.sh   (mostly the burst)
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"   # ROOT, PIDS, cleanup (on exit), child_of, wait_port, tree_ticks, kamailio_head, print_ladder, stop_proxy
RATES=${RATES:-"1000 2000 3000 4000 6000 8000 12000 16000"}
DUR=${DUR:-8}
FIXED=${FIXED:-2000}
FIXED_DUR=${FIXED_DUR:-15}
PROXIES=${PROXIES:-"fulcrum kamailio"}
CONNS=${CONNS:-4}             # TLS connections of the load generator
CALL_TIMEOUT_MS=${CALL_TIMEOUT_MS:-2000}
BURST=${BURST:-0}             # burst phase's call rate (0 = no burst phase)
BURST_DUR=${BURST_DUR:-10}
STALL_AT=${STALL_AT:-2}       # the load generator is stopped STALL_AT s into the burst run...
STALL_FOR=${STALL_FOR:-3}     # ... for STALL_FOR s
BURST_TIMEOUT_MS=${BURST_TIMEOUT_MS:-15000}
KCHILDREN=${KCHILDREN:-2}     # Kamailio workers (TLS is done in them): one per core, as fulcrum
FWORKERS=${FWORKERS:-0}       # fulcrum workers (0 = one per core)
BASE=${BASE:-25160}
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
FULCRUM=${FULCRUM:-$TARGET_DIR/release/fulcrum}
LOAD=$TARGET_DIR/release/examples/sip_tls_load
UAS=$TARGET_DIR/release/examples/strict_uas
OUT=${OUT:-${TMPDIR:-/tmp}/fulcrum-bench-sip-tls-$(date +%Y%m%d-%H%M%S)}
MAXT=1800                     # hard bound for any background process
PROXY_PORT=$BASE
UAS_PORTS="$((BASE + 11)) $((BASE + 12)) $((BASE + 13))"
MSGS_PER_CALL=7

command -v openssl >/dev/null || { echo "openssl not found (apt-get install openssl)" >&2; exit 2; }
case " $PROXIES " in *" kamailio "*)
  command -v kamailio >/dev/null || { echo "kamailio not found (apt-get install kamailio kamailio-tls-modules)" >&2; exit 2; }
  [ -e /usr/lib/x86_64-linux-gnu/kamailio/modules/tls.so ] ||
    { echo "Kamailio's tls module not found (apt-get install kamailio-tls-modules)" >&2; exit 2; } ;;
esac
(cd "$ROOT" && cargo build --release --quiet --bin fulcrum --example sip_tls_load --example strict_uas) || exit 2
mkdir -p "$OUT"; cd "$OUT" || exit 2
HZ=$(getconf CLK_TCK)

# --- certificates ----------------------------------------------------------------------
EC="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $EC -keyout ca.key -out ca.crt -days 2 -subj "/CN=fulcrum bench CA" 2>/dev/null || exit 2
issue() {   # issue STEM CN SAN
  openssl req -new $EC -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null || return 1
  printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
}
issue proxy proxy.bench "DNS:proxy.bench,IP:127.0.0.1" || exit 2
issue uas uas.bench "DNS:uas.bench,IP:127.0.0.1" || exit 2

# --- configs ---------------------------------------------------------------------------
{
  echo "# generated by bench/sip_tls.sh"
  echo "admin: { listen: null }"
  echo "logging: { level: info }   # the stream path's exceptional events (a client closed, a framing error) are info"
  echo "services:"
  i=0; for port in $UAS_PORTS; do i=$((i + 1))
    echo "  - { name: uas$i, address: 127.0.0.1:$port, protocol: sip-tls, tls: { ca: $OUT/ca.crt, server_name: uas.bench } }"
  done
  cat <<EOF
vservers:
  - name: sip-lb
    protocol: sip-tls
    bind: [127.0.0.1:$PROXY_PORT]
    method: call_id_hash
    record_route: true
    workers: $FWORKERS
    tls: { cert: $OUT/proxy.crt, key: $OUT/proxy.key }
    services: [uas1, uas2, uas3]
EOF
} > fulcrum.yaml
"$FULCRUM" check fulcrum.yaml >/dev/null || { echo "generated fulcrum.yaml is invalid" >&2; exit 2; }

for port in $UAS_PORTS; do echo "1 sip:127.0.0.1:$port;transport=tls"; done > dispatcher.list
cat > tls.cfg <<EOF
[server:default]
method = TLSv1.2+
verify_certificate = no
require_certificate = no
certificate = $OUT/proxy.crt
private_key = $OUT/proxy.key

[client:default]
method = TLSv1.2+
verify_certificate = yes
require_certificate = yes
ca_list = $OUT/ca.crt
EOF
{ kamailio_head "generated by bench/sip_tls.sh: TLS, dispatcher alg 0 (Call-ID hash) + stateless forward(), record_route" \
    "$KCHILDREN" "tls:127.0.0.1:$PROXY_PORT" no
  cat <<EOF
enable_tls=yes
tcp_connection_lifetime=3605
loadmodule "tls.so"
modparam("tls", "config", "$OUT/tls.cfg")
loadmodule "kex.so"
loadmodule "sl.so"
loadmodule "maxfwd.so"
loadmodule "rr.so"
loadmodule "dispatcher.so"
modparam("dispatcher", "list_file", "$OUT/dispatcher.list")
modparam("dispatcher", "ds_ping_interval", 0)
modparam("dispatcher", "flags", 2)
request_route {
    if (!mf_process_maxfwd_header("10")) { sl_send_reply("483", "Too Many Hops"); exit; }
    # in-dialog (ACK, BYE): the Route set names this proxy; on to the request URI (the UAS's Contact)
    if (loose_route()) { forward(); exit; }
    record_route();
    if (!ds_select_dst("1", "0")) { sl_send_reply("503", "No destination"); exit; }
    forward();
    exit;
}
EOF
} > kamailio.cfg

# --- processes -------------------------------------------------------------------------
PROXY_PID=""
start_proxy() {   # $1 = fulcrum | kamailio
  case $1 in
    fulcrum)  timeout $MAXT "$FULCRUM" run --config fulcrum.yaml --drain-timeout 1s > fulcrum.log 2>&1 & ;;
    kamailio) timeout $MAXT kamailio -f kamailio.cfg -DD -E -m 256 -M 16 > kamailio.log 2>&1 & ;;
  esac
  PROXY_PID=$!; PIDS+=($PROXY_PID)
  wait_port "$PROXY_PORT" t || return 1
  PROXY_PID=$(child_of "$PROXY_PID") || return 1
}

# The services stay up for all of one proxy's runs (a restart would cut the proxy's TLS
# connections to them between runs); each run reads the change of their counters.
UAS_PIDS=()
start_uas() {   # $1 = proxy
  UAS_PIDS=()
  local port i=0
  for port in $UAS_PORTS; do i=$((i + 1))
    timeout $MAXT "$UAS" "s$i" "127.0.0.1:$port" tls uas.crt uas.key $MAXT > "uas_${1}_$port.log" 2>&1 &
    UAS_PIDS+=($!); PIDS+=($!)
  done
  for port in $UAS_PORTS; do wait_port "$port" t || return 1; done
}
stop_uas() {
  local p
  for p in "${UAS_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${UAS_PIDS[@]}"; do wait "$p" 2>/dev/null; done
  UAS_PIDS=()
}
# uas_sum PROXY FIELD: FIELD of the last counts line of each service, summed
uas_sum() {
  local port s=0 v
  for port in $UAS_PORTS; do
    v=$(grep '^counts ' "uas_${1}_$port.log" 2>/dev/null | tail -1 | tr ' ' '\n' | awk -F= -v f="$2" '$1==f{print $2}')
    s=$((s + ${v:-0}))
  done
  echo "$s"
}
# kv FILE KEY: the value of KEY= on the load generator's result line
kv() { tr ' ' '\n' < "$1" | awk -F= -v k="$2" '$1==k{v=$2} END{print (v == "" ? "NA" : v)}'; }

SUMMARY=summary.tsv
printf "proxy\tphase\ttarget_cps\tcalls\tcompleted\tfailed\tfailed_481\ttimeout\tlate\tstray\tuas_481\tachieved_cps\tsetup_p50_us\tsetup_p99_us\tproxy_cpu_s\tproxy_cpu_pct\tus_per_msg\tload_cpu_pct\tproxy_rss_kib\tclean\n" > $SUMMARY

# one run: $1 proxy, $2 phase (fixed, ladder, burst), $3 rate, $4 duration; returns 0 when
# clean. A burst run stops the load generator as BURST_* say.
run_one() {
  local proxy=$1 phase=$2 rate=$3 dur=$4 n=$(( $3 * $4 )) call_timeout=$CALL_TIMEOUT_MS
  [ "$phase" = burst ] && call_timeout=$BURST_TIMEOUT_MS
  local tag="${proxy}_${phase}_${rate}" f
  f="load_${tag}.log"
  local k0 k1 t0 t1 r0 r1 lp
  r0=$(uas_sum "$proxy" r481); k0=$(tree_ticks "$PROXY_PID"); t0=$(date +%s.%N)
  timeout $((dur * 3 + 30 + call_timeout / 1000)) "$LOAD" "127.0.0.1:$PROXY_PORT" --ca ca.crt --name proxy.bench \
    --conns "$CONNS" --rate "$rate" --secs "$dur" --timeout-ms "$call_timeout" \
    --tag "$tag-$$" > "$f" 2>&1 &
  lp=$!
  if [ "$phase" = burst ]; then
    local gen; gen=$(child_of "$lp")
    sleep "$STALL_AT"; kill -STOP "$gen"; sleep "$STALL_FOR"; kill -CONT "$gen"
  fi
  wait "$lp"
  t1=$(date +%s.%N); k1=$(tree_ticks "$PROXY_PID")
  sleep 0.5   # the services print their counts every 200 ms
  r1=$(uas_sum "$proxy" r481)
  local comp fail f481 tmo late stray ach wall cpu pct us lpct clean=yes
  comp=$(kv "$f" completed); fail=$(kv "$f" failed); f481=$(kv "$f" failed_481)
  tmo=$(kv "$f" failed_timeout); late=$(kv "$f" late); stray=$(kv "$f" stray); ach=$(kv "$f" cps)
  wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}')
  cpu=$(awk -v d=$((k1 - k0)) -v hz="$HZ" 'BEGIN{printf "%.2f", d/hz}')
  pct=$(awk -v c="$cpu" -v w="$wall" 'BEGIN{printf "%.0f", 100*c/w}')
  lpct=$(awk -v c="$(kv "$f" load_cpu_s)" -v w="$wall" 'BEGIN{printf "%.0f", 100*c/w}')
  us=$(awk -v c="$cpu" -v s="$comp" -v m=$MSGS_PER_CALL 'BEGIN{printf "%.2f", (s+0>0)? c*1e6/(s*m) : 0}')
  if [ "$comp" != "$n" ] || [ "$fail" != 0 ] || [ "$late" != 0 ] || [ "$stray" != 0 ] || \
     [ "$((r1 - r0))" != 0 ]; then clean=no; fi
  # A burst run's rate is the generator's to catch up, not the proxy's to keep.
  if [ "$phase" != burst ] && awk -v a="$ach" -v r="$rate" 'BEGIN{exit !(a+0 < 0.97*r)}'; then clean=no; fi
  [ "$phase" = burst ] && BURST_OUT[$proxy]="completed $comp of $n, failed $fail (closed connection $(kv "$f" failed_closed), timeout $tmo), connections lost $(kv "$f" conns_lost), setup p50 $(kv "$f" setup_p50_us) us, p99 $(kv "$f" setup_p99_us) us, clean $clean"
  printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n" "$proxy" "$phase" "$rate" "$n" \
    "$comp" "$fail" "$f481" "$tmo" "$late" "$stray" "$((r1 - r0))" "$ach" "$(kv "$f" setup_p50_us)" \
    "$(kv "$f" setup_p99_us)" "$cpu" "$pct" "$us" "$lpct" "$(rss "$PROXY_PID")" "$clean" | tee -a $SUMMARY
  [ "$clean" = yes ]
}

declare -A MAX FIXED_US FIXED_CLEAN RSS BURST_OUT
echo "# results in $OUT"
echo "# RATES=\"$RATES\" DUR=$DUR FIXED=$FIXED FIXED_DUR=$FIXED_DUR CONNS=$CONNS KCHILDREN=$KCHILDREN FWORKERS=$FWORKERS"
echo "# foreign CPU users at start: $(ps -eo pcpu,comm --sort=-pcpu --no-headers | awk '$1>20{printf "%s(%s%%) ", $2, $1}')"
head -1 $SUMMARY
for proxy in $PROXIES; do
  start_uas "$proxy" || { echo "the services did not start" >&2; exit 1; }
  start_proxy "$proxy" || { echo "$proxy did not start (log: $OUT/$proxy.log)" >&2; exit 1; }
  rss0=$(rss "$PROXY_PID")
  if run_one "$proxy" fixed "$FIXED" "$FIXED_DUR"; then FIXED_CLEAN[$proxy]=yes; else FIXED_CLEAN[$proxy]=no; fi
  rss1=$(rss "$PROXY_PID")
  FIXED_US[$proxy]=$(awk -F'\t' -v p="$proxy" '$1==p && $2=="fixed"{v=$17} END{print v}' $SUMMARY)
  MAX[$proxy]=0
  for rate in $RATES; do
    if run_one "$proxy" ladder "$rate" "$DUR"; then MAX[$proxy]=$rate; else break; fi
  done
  if [ "$BURST" != 0 ]; then run_one "$proxy" burst "$BURST" "$BURST_DUR"; fi
  RSS[$proxy]="started ${rss0} KiB, after the fixed run ${rss1}, at the end (ladder and burst) $(rss "$PROXY_PID")"
  stop_proxy
  stop_uas
done

echo
print_ladder "SIP over TLS: highest clean call rate (ladder $RATES, ${DUR}s per step, $CONNS connections)"
echo "== at $FIXED calls/s for ${FIXED_DUR}s: proxy CPU per SIP message ($MSGS_PER_CALL per call) =="
for proxy in $PROXIES; do
  echo "$proxy: ${FIXED_US[$proxy]} us/msg, clean ${FIXED_CLEAN[$proxy]}"
done
for proxy in $PROXIES; do
  [ "${FIXED_CLEAN[$proxy]}" = yes ] || echo "NOTE: $FIXED calls/s was not clean on $proxy: rerun with a lower FIXED"
done
if [ "$BURST" != 0 ]; then
  echo "== burst: $BURST calls/s for ${BURST_DUR}s, the load generator stopped ${STALL_FOR}s at ${STALL_AT}s, then all it owes at once =="
  for proxy in $PROXIES; do echo "$proxy: ${BURST_OUT[$proxy]}"; done
fi
echo "== resident memory of the proxy's main process (Kamailio's workers not included) =="
for proxy in $PROXIES; do echo "$proxy: ${RSS[$proxy]}"; done
if [ -n "${FIXED_US[fulcrum]:-}" ] && [ -n "${FIXED_US[kamailio]:-}" ]; then
  r=$(awk -v a="${FIXED_US[fulcrum]}" -v b="${FIXED_US[kamailio]}" 'BEGIN{printf "%.2f", (b>0)?a/b:0}')
  met=no; awk -v r="$r" 'BEGIN{exit !(r > 0 && r <= 0.5)}' && met=yes
  echo "CPU ratio fulcrum/kamailio: $r (goal <= 0.50: $met)"
fi
