#!/usr/bin/env bash
# TLS termination of HTTP: fulcrum `http` vserver with `tls` vs HAProxy (`bind ... ssl crt`,
# mode tcp, balance source, nbthread 1), in one run, with the same certificate (EC P-256, made
# here by the openssl CLI) in front of the same 3 plain nginx HTTP backends (peers' configs,
# moved to free ports). fulcrum runs one worker thread, as HAProxy runs one. Load: wrk over
# https on loopback, keep-alive ("ka": requests/s on established TLS connections) and
# `Connection: close` ("close": one new TLS handshake per request, so requests/s = handshakes/s).
# Usage: DUR=10 CONNS=64 bench/tls.sh   (needs nginx, haproxy, wrk, openssl)
. "$(dirname "$0")/lib.sh"
DUR=${DUR:-10}; CONNS=${CONNS:-64}
B1=${B1:-18081}; HA=${HA:-19443}; FU=${FU:-19543}
for tool in nginx haproxy wrk openssl; do
  command -v "$tool" > /dev/null || { echo "bench/tls.sh needs $tool (apt-get install -y $tool)" >&2; exit 1; }
done
build_fulcrum
tcp_peer_configs
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=www.test \
  -keyout "$TMP/www.key" -out "$TMP/www.crt" > "$TMP/openssl.log" 2>&1 || { cat "$TMP/openssl.log"; exit 1; }
cat "$TMP/www.crt" "$TMP/www.key" > "$TMP/www.pem"
cat > "$TMP/haproxy-tls.cfg" <<CFG
global
    nbthread 1
    maxconn 9000
defaults
    mode tcp
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend fe_tls
    bind 127.0.0.1:$HA ssl crt $TMP/www.pem
    default_backend be_tcp
backend be_tcp
    balance source
    hash-type consistent
    server s1 127.0.0.1:$B1
    server s2 127.0.0.1:$((B1 + 1))
    server s3 127.0.0.1:$((B1 + 2))
CFG
cat > "$TMP/tls.yaml" <<YAML
admin: { listen: null }
logging: { level: warn }
services:
  - { name: b1, address: 127.0.0.1:$B1, protocol: http }
  - { name: b2, address: 127.0.0.1:$((B1 + 1)), protocol: http }
  - { name: b3, address: 127.0.0.1:$((B1 + 2)), protocol: http }
vservers:
  - { name: t, protocol: http, bind: [127.0.0.1:$FU], method: source_ip_hash, max_sessions: 100000,
      workers: 1, tls: { cert: $TMP/www.crt, key: $TMP/www.key }, services: [b1, b2, b3] }
YAML
timeout 900 nginx -c "$TMP/backends.conf" > "$TMP/backends.log" 2>&1 & BPID=$!; PIDS+=($BPID)
timeout 900 haproxy -db -f "$TMP/haproxy-tls.cfg" > "$TMP/haproxy.log" 2>&1 & HPID=$!; PIDS+=($HPID)
start_fulcrum "$TMP/fulcrum.log" --config "$TMP/tls.yaml"
sleep 1
for port in $HA $FU; do
  curl -sk --max-time 5 "https://127.0.0.1:$port/" | grep -q hello || { echo "no answer over TLS on $port" >&2; cat "$TMP/fulcrum.log" "$TMP/haproxy.log" >&2; exit 1; }
done
echo "# tls: wrk -t2 -c$CONNS -d${DUR}s --latency https://127.0.0.1:PORT/ ($(haproxy -v | head -1 | awk '{print $1, $2, $3}'), $(nproc) cores)"
declare -A R
for mode in ka close; do
  hdr=(); [ $mode = close ] && hdr=(-H "Connection: close")
  for tgt in haproxy fulcrum; do
    case $tgt in haproxy) port=$HA; proxy=($HPID);; fulcrum) port=$FU; proxy=($FPID);; esac
    b0=$(busy_ticks); p0=$(tree_ticks "${proxy[@]}")
    out=$(timeout $((DUR + 30)) wrk -t2 -c"$CONNS" -d"${DUR}s" --latency "${hdr[@]}" "https://127.0.0.1:$port/" 2>&1)
    b1=$(busy_ticks); p1=$(tree_ticks "${proxy[@]}")
    rps=$(awk '/Requests\/sec/{print $2}' <<<"$out"); p99=$(awk '/^ +99%/{print $2}' <<<"$out")
    se=$(grep -o "Socket errors:.*" <<<"$out" || echo "socket errors: none")
    R[$tgt.$mode]=$rps
    cpu=$(awk -v b=$((b1 - b0)) -v p=$((p1 - p0)) -v hz="$(getconf CLK_TCK)" -v n="$rps" -v d="$DUR" 'BEGIN{
      r = n * d; if (r == 0) r = 1; k = 1e6 / hz / r
      printf "cpu_us_per_req=%.1f proxy=%.1f", b * k, p * k }')
    echo "$mode $tgt req_s=$rps p99=$p99 $se $cpu"
  done
  awk -v h="${R[haproxy.$mode]}" -v f="${R[fulcrum.$mode]}" -v m=$mode 'BEGIN{
    printf "%s fulcrum/haproxy %.2fx\n", m, f/h }'
done
