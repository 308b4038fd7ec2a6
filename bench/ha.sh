#!/usr/bin/env bash
# Calls lost when one of two fulcrum instances behind an ECMP route is killed under SIPp load,
# with and without `record_route` (and so `fc-svc`), per balancing method. The topology of
# tests/ha.rs, in network namespaces (root, iproute2, curl, sipp):
#   client (SIPp UACs) -- router (VIP /32 ECMP, L4 hash) -- instances A and B (VIP on lo)
#                                                       -- services (3 SIPp UAS)
# Each run: FLOWS UACs (half of them on ports the router hashes to A), RATE calls/s each, CALLS
# calls each, held HOLD_MS; instance A gets SIGKILL at KILL_AT s; its nexthop is withdrawn after
# its /readyz has failed FALL times INTERVAL s apart (a route announcer's `fall`). A call is lost when
# its UAC counts it failed. The services are the tests' strict UAS (examples/strict_uas.rs):
# a BYE for a dialog a service did not set up gets 481 (failing its call), an ACK is counted
# as stray; both are reported.
# Knobs: METHODS="call_id_hash round_robin" RRS="false true" FLOWS=4 RATE=10 CALLS=60
# HOLD_MS=2000 KILL_AT=3 FALL=3 INTERVAL=0.25 FUL=path/to/fulcrum UAS=path/to/strict_uas (default: release builds).
# Prints one table row per (method, record_route). Bounded: every process runs under
# `timeout`; namespaces and processes are removed on any exit (trap).
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
METHODS=${METHODS:-call_id_hash round_robin}
RRS=${RRS:-false true}
FLOWS=${FLOWS:-4}; RATE=${RATE:-10}; CALLS=${CALLS:-60}; HOLD_MS=${HOLD_MS:-2000}; KILL_AT=${KILL_AT:-3}
FALL=${FALL:-3}; INTERVAL=${INTERVAL:-0.25}
[ "$(id -u)" = 0 ] || { echo "bench/ha.sh: needs root (network namespaces)" >&2; exit 1; }
for t in ip curl sipp timeout sysctl; do command -v "$t" >/dev/null || { echo "bench/ha.sh: $t not found" >&2; exit 1; }; done
if [ -z "${FUL:-}" ]; then
  (cd "$ROOT" && cargo build --release -q --bin fulcrum --example strict_uas) || exit 1
  FUL=${CARGO_TARGET_DIR:-$ROOT/target}/release/fulcrum
fi
UAS=${UAS:-$(dirname "$FUL")/examples/strict_uas}
[ -x "$UAS" ] || { echo "bench/ha.sh: no $UAS (cargo build --example strict_uas)" >&2; exit 1; }

T=$$; VIP=10.99.0.1; CLI=10.98.1.2; A=10.98.2.2; B=10.98.3.2; SVC=(10.98.4.2 10.98.4.3 10.98.4.4)
TMP=$(mktemp -d); PIDS=()
ns() { echo "fcb-$1-$T"; }
teardown() {
  local p n
  # Each PID is a `timeout` wrapper (ip netns exec execs it): its child first, then itself.
  for p in "${PIDS[@]}"; do pkill -KILL -P "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  for n in cli rtr a b svc; do ip netns del "$(ns $n)" 2>/dev/null; done
  PIDS=()
}
trap 'teardown; [ -n "${KEEP:-}" ] && echo "kept $TMP" >&2 || rm -rf "$TMP"' EXIT
trap 'exit 130' INT TERM
R() { ip netns exec "$(ns rtr)" "$@"; }

build() {
  local n role end rend addr gw
  for n in cli rtr a b svc; do ip netns add "$(ns $n)" && ip -n "$(ns $n)" link set lo up || exit 1; done
  while read -r role end rend addr gw; do
    ip link add "$end$T" netns "$(ns $role)" type veth peer name "$rend$T" netns "$(ns rtr)" || exit 1
    ip -n "$(ns $role)" addr add "$addr/24" dev "$end$T"; ip -n "$(ns rtr)" addr add "$gw/24" dev "$rend$T"
    ip -n "$(ns $role)" link set "$end$T" up; ip -n "$(ns rtr)" link set "$rend$T" up
    ip -n "$(ns $role)" route add default via "$gw"
  done <<EOF
cli hc rc $CLI 10.98.1.1
a ha ra $A 10.98.2.1
b hb rb $B 10.98.3.1
svc hs rs ${SVC[0]} 10.98.4.1
EOF
  ip -n "$(ns svc)" addr add "${SVC[1]}/24" dev "hs$T"; ip -n "$(ns svc)" addr add "${SVC[2]}/24" dev "hs$T"
  ip -n "$(ns a)" addr add "$VIP/32" dev lo; ip -n "$(ns b)" addr add "$VIP/32" dev lo
  R sysctl -qw net.ipv4.ip_forward=1 net.ipv4.fib_multipath_hash_policy=1 net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
  ip -n "$(ns rtr)" route replace "$VIP/32" nexthop via $A weight 1 nexthop via $B weight 1
}

# The instance (A or B) the router sends a client flow from PORT to.
hop() { ip -n "$(ns rtr)" route get $VIP from $CLI iif "rc$T" ipproto udp sport "$1" dport 5060 | grep -q "via $A " && echo A || echo B; }
ready() { R curl -fsS -m 1 -o /dev/null "http://$1:9090/readyz" 2>/dev/null; }

# UAC: INVITE, 200 with its Record-Route set kept; ACK and BYE with [routes] (RFC 3261 §12.2.1.1).
cat > "$TMP/uac.xml" <<'EOF'
<?xml version="1.0" encoding="ISO-8859-1" ?>
<scenario name="ha uac">
  <send retrans="500"><![CDATA[
      INVITE sip:uas@[remote_ip]:[remote_port] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: uas <sip:uas@[remote_ip]:[remote_port]>
      Call-ID: [call_id]
      CSeq: 1 INVITE
      Contact: <sip:sipp@[local_ip]:[local_port]>
      Max-Forwards: 70
      Content-Length: 0

    ]]></send>
  <recv response="100" optional="true"/>
  <recv response="180" optional="true"/>
  <recv response="200" rrs="true"/>
  <send><![CDATA[
      ACK [next_url] SIP/2.0
      [routes]
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: uas <sip:uas@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 1 ACK
      Max-Forwards: 70
      Content-Length: 0

    ]]></send>
  <pause milliseconds="HOLD"/>
  <send retrans="500"><![CDATA[
      BYE [next_url] SIP/2.0
      [routes]
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: uas <sip:uas@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 2 BYE
      Max-Forwards: 70
      Content-Length: 0

    ]]></send>
  <recv response="200" crlf="true"/>
</scenario>
EOF
sed -i "s/HOLD/$HOLD_MS/" "$TMP/uac.xml"
# one METHOD RR: prints a table row.
one() {
  local method=$1 rr=$2 i p inst run=$TMP/$1-$2 fails tk tw
  mkdir -p "$run"; build
  for i in 0 1 2; do
    ip netns exec "$(ns svc)" timeout -s KILL 120 "$UAS" "s$i" "${SVC[$i]}:5060" udp 110 > "$run/uas-s$i.txt" 2>&1 &
    PIDS+=($!)
  done
  for inst in a b; do
    local addr=$A; [ $inst = b ] && addr=$B
    cat > "$run/$inst.yaml" <<EOF
admin: { listen: "$addr:9090" }
services:
  - { name: s0, address: "${SVC[0]}:5060", protocol: sip-udp }
  - { name: s1, address: "${SVC[1]}:5060", protocol: sip-udp }
  - { name: s2, address: "${SVC[2]}:5060", protocol: sip-udp }
vservers:
  - name: v
    protocol: sip-udp
    bind: ["$VIP:5060"]
    freebind: true
    advertise: "$VIP:5060"
    method: $method
    record_route: $rr
    workers: 1
    services: [s0, s1, s2]
EOF
    ip netns exec "$(ns $inst)" timeout -s KILL 120 "$FUL" run --drain-timeout 1s --config "$run/$inst.yaml" > "$run/$inst.log" 2>&1 &
    PIDS+=($!); eval "PID_$inst=$!"
  done
  for i in $(seq 1 100); do ready $A && ready $B && break; sleep 0.1; done
  ready $A && ready $B || { echo "instances not ready (logs in $run)" >&2; exit 1; }
  # FLOWS client ports, alternately hashed to A and to B.
  local ports=() na=0 nb=0 want; declare -A HOP=()
  for p in $(seq 5100 5400); do
    [ ${#ports[@]} -ge "$FLOWS" ] && break
    want=A; [ $na -gt $nb ] && want=B
    [ "$(hop "$p")" = $want ] || continue
    ports+=("$p"); HOP[$p]=$want
    if [ $want = A ]; then na=$((na + 1)); else nb=$((nb + 1)); fi
  done
  local lim=$((CALLS / RATE + HOLD_MS / 1000 + 45)) flows=()
  for p in "${ports[@]}"; do
    (cd "$run" && exec ip netns exec "$(ns cli)" timeout -s KILL $lim sipp -sf "$TMP/uac.xml" $VIP:5060 -i $CLI -p "$p" -t u1 \
      -r "$RATE" -m "$CALLS" -nostdin -timeout ${lim}s -recv_timeout 20000 -trace_stat -stf "$run/uac-$p.csv" -trace_err -error_file "$run/uac-$p.err" >/dev/null 2>&1) &
    flows+=($!); PIDS+=($!)
  done
  sleep "$KILL_AT"
  pkill -KILL -P "$PID_a"; tk=$(date +%s.%N)
  fails=0
  for i in $(seq 1 100); do
    if ready $A; then fails=0; else fails=$((fails + 1)); fi
    [ $fails -ge "$FALL" ] && break; sleep "$INTERVAL"
  done
  ip -n "$(ns rtr)" route replace "$VIP/32" via $B; tw=$(date +%s.%N)
  for p in "${flows[@]}"; do wait "$p"; done
  sleep 0.5   # each UAS prints its counts when they change, at most every 200 ms
  local r481=0 stray=0 a b
  for i in 0 1 2; do
    read -r a b < <(grep '^counts ' "$run/uas-s$i.txt" | tail -1 | sed 's/.* r481=\([0-9]*\) stray_acks=\([0-9]*\).*/\1 \2/')
    r481=$((r481 + ${a:-0})); stray=$((stray + ${b:-0}))
  done
  local ok_a=0 f_a=0 ok_b=0 f_b=0 ok f
  for p in "${ports[@]}"; do
    read -r ok f < <(awk -F';' 'NR==1{for(i=1;i<=NF;i++){if($i=="SuccessfulCall(C)")s=i; if($i=="FailedCall(C)")x=i}} NF>1{o=$s; q=$x} END{print o+0, q+0}' "$run/uac-$p.csv")
    if [ "${HOP[$p]}" = A ]; then ok_a=$((ok_a + ok)); f_a=$((f_a + f)); else ok_b=$((ok_b + ok)); f_b=$((f_b + f)); fi
  done
  printf '| %s | %s | %d | %d / %d | %d / %d | **%d** | %d / %d | %.1f s |\n' "$method" "$rr" $((FLOWS * CALLS)) \
    $((ok_a + f_a)) $((ok_b + f_b)) "$f_a" "$f_b" $((f_a + f_b)) "$r481" "$stray" "$(awk "BEGIN{print $tw - $tk}")"
  teardown
}

echo "FLOWS=$FLOWS RATE=$RATE CALLS=$CALLS HOLD_MS=$HOLD_MS KILL_AT=$KILL_AT FALL=$FALL INTERVAL=$INTERVAL fulcrum=$FUL ($(cd "$ROOT" && git rev-parse --short HEAD))"
echo "| method | record_route | calls | calls on flows to A / B | lost on A's / B's flows | lost | 481s / stray ACKs at the services | kill to withdrawal |"
echo "|---|---|---|---|---|---|---|---|"
for m in $METHODS; do for rr in $RRS; do one "$m" "$rr"; done; done
