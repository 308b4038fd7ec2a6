#!/usr/bin/env bash
# Idle memory: RSS growth of fulcrum per idle UDP session, per idle TCP connection and per
# idle SIP-over-TCP client. One config with a `udp` vserver (3 UDP echo services), a `tcp`
# vserver (3 TCP services that accept and hold, `fulcrum-load tcp-sink`) and a `sip-tcp`
# vserver (clients that connect and stay silent); for each, a fresh fulcrum, N flows opened
# by `fulcrum-load udp-idle` / `tcp-idle` (one source address 127.0.x.y per flow), then
# VmRSS from /proc/PID/status before and after, sampled until it stops growing (<= 10 s).
# The script first tries to raise the open-file hard limit to 200,000 (needs
# CAP_SYS_RESOURCE); N is 50,000 or, if the limit stays lower, what fits under it (a UDP
# session holds one descriptor in fulcrum, a TCP connection two). The load generator's flows
# all use source port 29999 (one address each), leaving the ephemeral range to fulcrum's
# session sockets; more than ~28,000 UDP sessions would also need a wider
# net.ipv4.ip_local_port_range than the default 32768-60999 (one ephemeral port per session).
# Usage: [N=50000] bench/idle.sh        (needs gcc; CAP_SYS_RESOURCE to go past the hard limit)
. "$(dirname "$0")/lib.sh"
WANT=${N:-50000}
if prlimit --pid $$ --nofile=200000:200000 2>/dev/null; then
  echo "open-file limit raised to 200000"
else
  echo "cannot raise the open-file hard limit (no CAP_SYS_RESOURCE): $(ulimit -Hn)"
fi
ulimit -Sn "$(ulimit -Hn)"
LIMIT=$(ulimit -Hn)
SPARE=200   # descriptors fulcrum uses besides sessions (listeners, epoll, logs, tokio)
UDP_N=$(( WANT < LIMIT - SPARE ? WANT : LIMIT - SPARE ))
TCP_N=$(( WANT < (LIMIT - SPARE) / 2 ? WANT : (LIMIT - SPARE) / 2 ))
build_fulcrum
gcc -O2 -o "$TMP/udp_echo" "$PEERS/tools/udp_echo.c" || exit 1
E1=${E1:-17101}; B1=${B1:-18181}; FU=${FU:-16200}; FT=${FT:-19200}; FS=${FS:-15200}
cat > "$TMP/idle.yaml" <<YAML
admin: { listen: null }
logging: { level: info }
services:
  - { name: e1, address: 127.0.0.1:$E1, protocol: udp }
  - { name: e2, address: 127.0.0.1:$((E1 + 1)), protocol: udp }
  - { name: e3, address: 127.0.0.1:$((E1 + 2)), protocol: udp }
  - { name: b1, address: 127.0.0.1:$B1, protocol: tcp }
  - { name: b2, address: 127.0.0.1:$((B1 + 1)), protocol: tcp }
  - { name: b3, address: 127.0.0.1:$((B1 + 2)), protocol: tcp }
  - { name: p1, address: 127.0.0.1:$((B1 + 3)), protocol: sip-tcp }
vservers:
  - { name: u, protocol: udp, bind: [127.0.0.1:$FU], method: source_ip_hash, workers: 2,
      idle_timeout: 600s, max_sessions: 100000, services: [e1, e2, e3] }
  - { name: t, protocol: tcp, bind: [127.0.0.1:$FT], method: source_ip_hash, idle_timeout: 600s,
      max_sessions: 100000, services: [b1, b2, b3] }
  - { name: s, protocol: sip-tcp, bind: [127.0.0.1:$FS], idle_timeout: 600s, max_sessions: 100000,
      services: [p1] }
YAML
# measure KIND N LOADMODE PORT: start fulcrum, open N flows, print RSS growth per flow.
measure() {
  local kind=$1 n=$2 mode=$3 port=$4 fpid lpid r0 r1 ready
  # $fpid is fulcrum itself (its RSS is read), under a `timeout` wrapper.
  start_fulcrum "$TMP/fulcrum-$kind.log" --config "$TMP/idle.yaml" --drain-timeout 0s; fpid=$FPID
  sleep 1
  r0=$(settled $fpid)
  # Holds its flows for 120 s at most (killed as soon as the figure is taken).
  "$LOAD" "$mode" 127.0.0.1:$port --sockets "$n" --secs 120 > "$TMP/$kind.out" 2>&1 & lpid=$!; PIDS+=($lpid)
  wait_ready "$TMP/$kind.out" 600
  r1=$(settled $fpid)
  ready=$(sed -n 's/.*ready=\([0-9]*\).*/\1/p' "$TMP/$kind.out")
  echo "$kind: flows=$n ready=${ready:-0} fulcrum_fds=$(ls /proc/$fpid/fd | wc -l) rss_before_kib=$r0 rss_after_kib=$r1 per_flow_bytes=$(( (r1 - r0) * 1024 / ${ready:-1} ))"
  grep -m1 -o '"open-file limit[^"]*"\|open-file limit.*' "$TMP/fulcrum-$kind.log" | head -1 | sed "s/^/$kind fulcrum log: /"
  grep -i "max_sessions need" "$TMP/fulcrum-$kind.log" | sed "s/^/$kind fulcrum log: /"
  [ "${ready:-0}" = 0 ] && { echo "$kind: load generator said:"; cat "$TMP/$kind.out"; }
  kill -KILL $lpid 2>/dev/null; wait $lpid 2>/dev/null
  stop_fulcrum KILL
}
echo "# idle: open-file limit $LIMIT; udp sessions $UDP_N, tcp connections $TCP_N, sip-tcp clients $UDP_N (wanted $WANT)"
for port in $E1 $((E1 + 1)) $((E1 + 2)); do timeout -s KILL 300 "$TMP/udp_echo" 127.0.0.1 $port & PIDS+=($!); done
for port in $B1 $((B1 + 1)) $((B1 + 2)); do "$LOAD" tcp-sink 127.0.0.1:$port --sockets "$TCP_N" --secs 240 > /dev/null & PIDS+=($!); done
sleep 0.5
measure udp "$UDP_N" udp-idle $FU
measure tcp "$TCP_N" tcp-idle $FT
# sip-tcp: idle client connections (one descriptor each; no service connection until a request).
measure sip-tcp "$UDP_N" tcp-idle $FS
