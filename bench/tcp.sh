#!/usr/bin/env bash
# TCP: fulcrum `tcp` vservers vs HAProxy (mode tcp, balance source, hash-type consistent,
# nbthread HA_THREADS, default 2 like fulcrum's one worker per core), in one run, in front of
# the same 3 nginx HTTP backends (peers' configs, moved to free ports). Targets: direct (wrk
# to a backend), haproxy and fulcrum. ROUNDS rounds, the order of the targets alternating, each target
# `wrk -t2 -cCONNS -dDUR`, keep-alive ("ka") and `Connection: close` ("close").
#
# Per target and round: req/s, p99, the whole machine's CPU per request (busy ticks of
# /proc/stat: user, system, irq and softirq of every CPU, so kernel work done outside the
# proxy's threads counts: softirqs, kworkers) and the proxy's whole cost per request: that
# figure through the proxy minus the same figure direct to the backends in the same round
# (wrk's and nginx's share cancels out). Then medians over the rounds and each fulcrum's cost
# as a ratio of HAProxy's. Last, idle-connection memory: N connections opened and held through
# fulcrum, RSS growth / N.
# Usage: DUR=10 ROUNDS=5 CONNS=64 IDLE=8000 bench/tcp.sh   (needs nginx, haproxy, wrk)
. "$(dirname "$0")/lib.sh"
DUR=${DUR:-10}; CONNS=${CONNS:-64}; IDLE=${IDLE:-8000}; ROUNDS=${ROUNDS:-5}; HA_THREADS=${HA_THREADS:-2}
B1=${B1:-18081}; HA=${HA:-19000}; FU=${FU:-19100}
build_fulcrum
tcp_peer_configs
sed -i "s/nbthread 1/nbthread $HA_THREADS/" "$TMP/haproxy.cfg"
tcp_yaml info "t:$FU" > "$TMP/tcp.yaml"
timeout 1800 nginx -c "$TMP/backends.conf" > "$TMP/backends.log" 2>&1 & BPID=$!; PIDS+=($BPID)
timeout 1800 haproxy -db -f "$TMP/haproxy.cfg" > "$TMP/haproxy.log" 2>&1 & HPID=$!; PIDS+=($HPID)
start_fulcrum "$TMP/fulcrum.log" --config "$TMP/tcp.yaml"
sleep 1
echo "# tcp: wrk -t2 -c$CONNS -d${DUR}s, $ROUNDS rounds, haproxy nbthread $HA_THREADS; $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
RES=$TMP/results
for r in $(seq 1 "$ROUNDS"); do
  order="direct haproxy fulcrum"; [ $((r % 2)) = 0 ] && order="fulcrum haproxy direct"
  for mode in ka close; do
    hdr=(); [ $mode = close ] && hdr=(-H "Connection: close")
    for tgt in $order; do
      case $tgt in direct) port=$B1;; haproxy) port=$HA;; fulcrum) port=$FU;; esac
      b0=$(busy_ticks)
      out=$(timeout $((DUR + 30)) wrk -t2 -c"$CONNS" -d"${DUR}s" --latency "${hdr[@]}" "http://127.0.0.1:$port/" 2>&1)
      b1=$(busy_ticks)
      rps=$(awk '/Requests\/sec/{print $2}' <<<"$out"); p99=$(awk '/^ +99%/{print $2}' <<<"$out")
      se=$(grep -o "Socket errors:.*" <<<"$out" | tr -d ' ')
      host=$(awk -v b=$((b1 - b0)) -v hz="$(getconf CLK_TCK)" -v n="${rps:-0}" -v d="$DUR" 'BEGIN{
        r = n * d; if (r == 0) r = 1; printf "%.2f", b * 1e6 / hz / r }')
      echo "$r $mode $tgt $rps $host $p99 ${se:-}" >> "$RES"
    done
    # The proxies' cost in this round: host µs per request minus direct's.
    awk -v r="$r" -v m="$mode" '$1 == r && $2 == m { rps[$3] = $4; host[$3] = $5; p99[$3] = $6; se[$3] = $7 }
      END {
        printf "round %d %-5s", r, m
        for (i = 1; i <= 3; i++) {
          t = (i == 1) ? "direct" : (i == 2) ? "haproxy" : "fulcrum"
          printf "  %s %.0f req/s %.2f us/req", t, rps[t], host[t]
          if (t != "direct") printf " (cost %.2f)", host[t] - host["direct"]
          if (se[t] != "") printf " [%s]", se[t]
        }
        printf "\n"
      }' "$RES"
  done
done
# Medians over the rounds: req/s, host µs per request, cost (through minus direct, same round).
# (ROUNDS=0 measures idle memory only.)
[ "$ROUNDS" -gt 0 ] && for mode in ka close; do
  awk -v m="$mode" '
    function median(a, n,   i, j, t) {
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
      return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    $2 == m { rps[$3, $1] = $4; host[$3, $1] = $5; if ($1 > R) R = $1 }
    END {
      split("direct haproxy fulcrum", ts, " ")
      for (k = 1; k <= 3; k++) {
        t = ts[k]; delete a; delete b; delete c
        for (r = 1; r <= R; r++) { a[r] = rps[t, r]; b[r] = host[t, r]; c[r] = host[t, r] - host["direct", r] }
        mr[t] = median(a, R); mh[t] = median(b, R); mc[t] = median(c, R)
      }
      printf "%-5s median of %d rounds:", m, R
      for (k = 1; k <= 3; k++) {
        t = ts[k]; printf "  %s %.0f req/s %.2f us/req", t, mr[t], mh[t]
        if (t != "direct") printf " cost %.2f", mc[t]
      }
      printf "\n%-5s cost / haproxy: fulcrum %.2f; req/s / haproxy: fulcrum %.2f\n",
        m, mc["fulcrum"] / mc["haproxy"], mr["fulcrum"] / mr["haproxy"]
    }' "$RES"
done
echo "# end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
[ "$IDLE" -gt 0 ] || exit 0
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
