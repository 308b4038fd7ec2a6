#!/usr/bin/env bash
# UDP: fulcrum `udp` vserver vs nginx stream UDP (hash $remote_addr consistent), in one run,
# same 3 echo services (peers' tools/udp_echo.c, 127.0.0.1:7001-7003), same load generator
# (fulcrum's own `fulcrum-load udp`, closed loop, SOCKS sockets from 127.0.1.x, one datagram
# in flight each). Then idle-session memory: N sessions opened and held, RSS growth / N.
# Usage: DUR=10 SOCKS=256 SIZE=64 WORKERS=1 IDLE=15000 bench/udp.sh   (needs gcc, nginx + libnginx-mod-stream)
. "$(dirname "$0")/lib.sh"
DUR=${DUR:-10}; SOCKS=${SOCKS:-256}; SIZE=${SIZE:-64}; WORKERS=${WORKERS:-1}; IDLE=${IDLE:-15000}
build_fulcrum
gcc -O2 -o "$TMP/udp_echo" "$PEERS/tools/udp_echo.c" || exit 1
# Ports apart from the peers' defaults (other benchmarks may hold those on a shared box).
E1=${E1:-17001}; NG=${NG:-16000}; FU=${FU:-16100}
for port in $E1 $((E1 + 1)) $((E1 + 2)); do timeout 900 "$TMP/udp_echo" 127.0.0.1 $port & PIDS+=($!); done
sed -e "s/127.0.0.1:6000/127.0.0.1:$NG/; s/127.0.0.1:7001/127.0.0.1:$E1/; s/127.0.0.1:7002/127.0.0.1:$((E1 + 1))/; s/127.0.0.1:7003/127.0.0.1:$((E1 + 2))/; s#/tmp/peers-nginx-udp#$TMP/nginx-udp#g" \
  "$PEERS/nginx/nginx-udp.conf" > "$TMP/nginx-udp.conf"
cat > "$TMP/udp.yaml" <<YAML
admin: { listen: null }
logging: { level: warn }
services:
  - { name: e1, address: 127.0.0.1:$E1, protocol: udp }
  - { name: e2, address: 127.0.0.1:$((E1 + 1)), protocol: udp }
  - { name: e3, address: 127.0.0.1:$((E1 + 2)), protocol: udp }
vservers:
  - { name: u, protocol: udp, bind: [127.0.0.1:$FU], method: source_ip_hash, workers: $WORKERS,
      idle_timeout: 600s, max_sessions: 100000, services: [e1, e2, e3] }
YAML
start_fulcrum "$TMP/fulcrum.log" --config "$TMP/udp.yaml"
timeout 900 nginx -c "$TMP/nginx-udp.conf" > "$TMP/nginx.log" 2>&1 & NPID=$!; PIDS+=($NPID)
sleep 1
echo "# udp: sockets=$SOCKS size=$SIZE dur=${DUR}s fulcrum workers=$WORKERS"
declare -A RPS P99
ECHOS=("${PIDS[@]:0:3}")
HZ=$(getconf CLK_TCK)
for tgt in direct nginx fulcrum; do
  case $tgt in direct) port=$E1; proxy=();; nginx) port=$NG; proxy=($NPID);; fulcrum) port=$FU; proxy=($FPID);; esac
  b0=$(busy_ticks); e0=$(tree_ticks "${ECHOS[@]}"); p0=$(tree_ticks "${proxy[@]}")
  line=$("$LOAD" udp 127.0.0.1:$port --sockets "$SOCKS" --secs "$DUR" --size "$SIZE")
  b1=$(busy_ticks); e1=$(tree_ticks "${ECHOS[@]}"); p1=$(tree_ticks "${proxy[@]}")
  rps=$(sed -n 's/.*rps=\([0-9]*\).*/\1/p' <<<"$line")
  # CPU per round trip (µs): the whole machine, the proxy, the echo services, the rest (the load
  # generator and whatever else ran).
  cpu=$(awk -v b=$((b1 - b0)) -v e=$((e1 - e0)) -v p=$((p1 - p0)) -v hz="$HZ" -v n="$rps" -v d="$DUR" 'BEGIN{
    rt = n * d; if (rt == 0) rt = 1; k = 1e6 / hz / rt
    printf "cpu_us_per_rt=%.2f proxy=%.2f echo=%.2f rest=%.2f", b * k, p * k, e * k, (b - p - e) * k }')
  echo "$tgt $line $cpu"
  RPS[$tgt]=$rps; P99[$tgt]=$(sed -n 's/.*p99_us=\([0-9]*\).*/\1/p' <<<"$line")
done
awk -v d="${RPS[direct]}" -v n="${RPS[nginx]}" -v f="${RPS[fulcrum]}" -v pn="${P99[nginx]}" -v pf="${P99[fulcrum]}" 'BEGIN{
  printf "ratio to direct: fulcrum %.2f, nginx %.2f; fulcrum/nginx %.2fx; p99 fulcrum %d us vs nginx %d us\n", f/d, n/d, f/n, pf, pn }'
# Idle sessions: a fresh fulcrum, N flows opened and answered, then held.
stop_fulcrum
start_fulcrum "$TMP/fulcrum2.log" --config "$TMP/udp.yaml"
sleep 1
r0=$(settled $FPID)
"$LOAD" udp-idle 127.0.0.1:$FU --sockets "$IDLE" --secs 120 > "$TMP/idle.out" 2>&1 & LPID=$!; PIDS+=($LPID)
wait_ready "$TMP/idle.out"
r1=$(settled $FPID)
echo "idle sessions: $(cat "$TMP/idle.out") rss_before_kib=$r0 rss_after_kib=$r1 per_session_bytes=$(( (r1 - r0) * 1024 / IDLE ))"
