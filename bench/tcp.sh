#!/usr/bin/env bash
# TCP: fulcrum `tcp` vserver vs HAProxy (mode tcp, balance source, hash-type consistent,
# nbthread 1), in one run, in front of the same 3 nginx HTTP backends (peers' configs, moved to
# free ports), wrk -t2 -cCONNS through each, keep-alive ("ka") and `Connection: close`
# ("close"). Then idle-connection memory: N connections opened and held, RSS growth / N.
# Usage: DUR=10 CONNS=64 IDLE=8000 bench/tcp.sh   (needs nginx, haproxy, wrk)
. "$(dirname "$0")/lib.sh"
DUR=${DUR:-10}; CONNS=${CONNS:-64}; IDLE=${IDLE:-8000}
B1=${B1:-18081}; HA=${HA:-19000}; FU=${FU:-19100}
build_fulcrum
tcp_peer_configs
cat > "$TMP/tcp.yaml" <<YAML
admin: { listen: null }
logging: { level: warn }
services:
  - { name: b1, address: 127.0.0.1:$B1, protocol: tcp }
  - { name: b2, address: 127.0.0.1:$((B1 + 1)), protocol: tcp }
  - { name: b3, address: 127.0.0.1:$((B1 + 2)), protocol: tcp }
vservers:
  - { name: t, protocol: tcp, bind: [127.0.0.1:$FU], method: source_ip_hash, max_sessions: 100000,
      services: [b1, b2, b3] }
YAML
timeout 900 nginx -c "$TMP/backends.conf" > "$TMP/backends.log" 2>&1 & BPID=$!; PIDS+=($BPID)
timeout 900 haproxy -db -f "$TMP/haproxy.cfg" > "$TMP/haproxy.log" 2>&1 & HPID=$!; PIDS+=($HPID)
start_fulcrum "$TMP/fulcrum.log" --config "$TMP/tcp.yaml"
sleep 1
echo "# tcp: wrk -t2 -c$CONNS -d${DUR}s --latency"
declare -A R
for mode in ka close; do
  hdr=(); [ $mode = close ] && hdr=(-H "Connection: close")
  for tgt in direct haproxy fulcrum; do
    case $tgt in direct) port=$B1; proxy=();; haproxy) port=$HA; proxy=($HPID);; fulcrum) port=$FU; proxy=($FPID);; esac
    b0=$(busy_ticks); s0=$(tree_ticks "$BPID"); p0=$(tree_ticks "${proxy[@]}")
    out=$(timeout $((DUR + 30)) wrk -t2 -c"$CONNS" -d"${DUR}s" --latency "${hdr[@]}" "http://127.0.0.1:$port/" 2>&1)
    b1=$(busy_ticks); s1=$(tree_ticks "$BPID"); p1=$(tree_ticks "${proxy[@]}")
    rps=$(awk '/Requests\/sec/{print $2}' <<<"$out"); p99=$(awk '/^ +99%/{print $2}' <<<"$out")
    se=$(grep -o "Socket errors:.*" <<<"$out" || echo "socket errors: none")
    R[$tgt.$mode]=$rps
    # CPU per request (µs): the whole machine, the proxy, the nginx backends, the rest (wrk).
    cpu=$(awk -v b=$((b1 - b0)) -v sv=$((s1 - s0)) -v p=$((p1 - p0)) -v hz="$(getconf CLK_TCK)" -v n="$rps" -v d="$DUR" 'BEGIN{
      r = n * d; if (r == 0) r = 1; k = 1e6 / hz / r
      printf "cpu_us_per_req=%.2f proxy=%.2f backends=%.2f rest=%.2f", b * k, p * k, sv * k, (b - p - sv) * k }')
    echo "$mode $tgt req_s=$rps p99=$p99 $se $cpu"
  done
  awk -v d="${R[direct.$mode]}" -v h="${R[haproxy.$mode]}" -v f="${R[fulcrum.$mode]}" -v m=$mode 'BEGIN{
    printf "%s ratio to direct: fulcrum %.2f, haproxy %.2f; fulcrum/haproxy %.2fx\n", m, f/d, h/d, f/h }'
done
# Idle connections: a fresh fulcrum, N connections opened and held (each costs fulcrum 2 fds).
stop_fulcrum
start_fulcrum "$TMP/fulcrum2.log" --config "$TMP/tcp.yaml" --drain-timeout 0s
sleep 1
r0=$(settled $FPID)
"$LOAD" tcp-idle 127.0.0.1:$FU --sockets "$IDLE" --secs 120 > "$TMP/idle.out" 2>&1 & PIDS+=($!)
wait_ready "$TMP/idle.out"
# Wait until fulcrum has connected every one upstream (its RSS stops growing).
r1=$(settled $FPID)
echo "idle connections: $(cat "$TMP/idle.out") rss_before_kib=$r0 rss_after_kib=$r1 per_connection_bytes=$(( (r1 - r0) * 1024 / IDLE ))"
