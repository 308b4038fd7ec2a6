#!/usr/bin/env bash
# Held silent TLS connections against legitimate calls: SOURCES loopback source addresses
# (127.3.0.x) each hold PER silent TLS connections (handshakes complete, nothing sent;
# bench/held.py) to a sip-tls vserver, while calls go on through the same fulcrum over
# sip-tls (examples/sip_tls_load.rs, certificate verified) and over sip-udp (SIPp's uac
# scenario), each to strict UAS services (examples/strict_uas.rs: a misrouted BYE gets 481).
# fulcrum runs with an open-file limit of NOFILE, below what the held connections want, so
# its file budget evicts silent connections (docs/limits.md) rather than refuse or drop
# callers. The calls start first and last CALL_SECS seconds, the holders' ramp-up and hold
# (HOLD_SECS once all attempts ended) inside them.
# Prints: connections the holders opened, how many fulcrum closed (evicted) while held, the
# metrics of refusals, evictions and open files, and per transport the calls attempted,
# completed and failed (sip-tls: the load generator's counts; sip-udp: SIPp's statistics),
# with the 481s the services sent.
# Usage: [SOURCES=24 PER=1000 NOFILE=16384 RATE=50 CALL_SECS=120 HOLD_SECS=20] bench/held.sh
#        (needs python3, openssl, sipp; root for the open-file limits)
. "$(dirname "$0")/lib.sh"
SOURCES=${SOURCES:-24}; PER=${PER:-1000}; NOFILE=${NOFILE:-16384}
RATE=${RATE:-50}; CALL_SECS=${CALL_SECS:-120}; HOLD_SECS=${HOLD_SECS:-20}
BASE=${BASE:-25400}; ADMIN=$((BASE + 1)); PT=$((BASE + 2)); PU=$((BASE + 3)); UAC_PORT=$((BASE + 4))
TLS_UAS="$((BASE + 11)) $((BASE + 12))"; UDP_UAS="$((BASE + 21)) $((BASE + 22))"
MAXT=1800
command -v sipp >/dev/null || { echo "sipp not found (apt-get install sip-tester)" >&2; exit 2; }
command -v openssl >/dev/null || { echo "openssl not found" >&2; exit 2; }
prlimit --pid $$ --nofile=200000:200000 2>/dev/null || true
ulimit -Sn "$(ulimit -Hn)"
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
(cd "$ROOT" && cargo build --release --quiet --bin fulcrum --example sip_tls_load --example strict_uas) || exit 2
FUL=$TARGET_DIR/release/fulcrum; LOADG=$TARGET_DIR/release/examples/sip_tls_load
UAS=$TARGET_DIR/release/examples/strict_uas
cd "$TMP" || exit 2

EC="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $EC -keyout ca.key -out ca.crt -days 2 -subj "/CN=fulcrum bench CA" 2>/dev/null || exit 2
issue() {   # issue STEM CN SAN
  openssl req -new $EC -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null || return 1
  printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
}
issue proxy proxy.bench "DNS:proxy.bench,IP:127.0.0.1" || exit 2
issue uas uas.bench "DNS:uas.bench,IP:127.0.0.1" || exit 2

{
  echo "admin: { listen: \"127.0.0.1:$ADMIN\" }"
  echo "services:"
  i=0; for p in $TLS_UAS; do i=$((i + 1))
    echo "  - { name: t$i, address: 127.0.0.1:$p, protocol: sip-tls, tls: { ca: $TMP/ca.crt, server_name: uas.bench } }"
  done
  i=0; for p in $UDP_UAS; do i=$((i + 1))
    echo "  - { name: u$i, address: 127.0.0.1:$p, protocol: sip-udp }"
  done
  cat <<YAML
vservers:
  - { name: tls, protocol: sip-tls, bind: [127.0.0.1:$PT], max_per_source: $PER, max_sessions: 200000,
      record_route: true, tls: { cert: $TMP/proxy.crt, key: $TMP/proxy.key }, services: [t1, t2] }
  - { name: udp, protocol: sip-udp, bind: [127.0.0.1:$PU], services: [u1, u2] }
YAML
} > held.yaml
"$FUL" check held.yaml > /dev/null || { echo "invalid held.yaml" >&2; exit 2; }

i=0; for p in $TLS_UAS; do i=$((i + 1))
  timeout $MAXT "$UAS" "t$i" "127.0.0.1:$p" tls uas.crt uas.key $MAXT > "uas_$p.log" 2>&1 & PIDS+=($!)
done
i=0; for p in $UDP_UAS; do i=$((i + 1))
  timeout $MAXT "$UAS" "u$i" "127.0.0.1:$p" udp $MAXT > "uas_$p.log" 2>&1 & PIDS+=($!)
done
for p in $TLS_UAS; do wait_port "$p" t || exit 1; done
for p in $UDP_UAS; do wait_port "$p" u || exit 1; done
timeout $MAXT prlimit --nofile="$NOFILE:$NOFILE" "$FUL" run --config held.yaml > fulcrum.log 2>&1 & FW=$!; PIDS+=($FW)
wait_port "$PT" t || exit 1
FPID=$(child_of "$FW") || exit 1   # prlimit execs fulcrum
sleep 1
# The file budget, the tls vserver's refusals at accept, clients accepted and evicted.
metrics() {
  curl -fsS "http://127.0.0.1:$ADMIN/metrics" |
    grep -E '^fulcrum_(open_files|refused_total|transport_events_total)' |
    grep -E 'open_files|refused|clients_(accepted|evicted)' | grep -v ' 0$'
}
uas_sum() {   # uas_sum PORTS FIELD: FIELD of the last counts line of each service, summed
  local p s=0 v
  for p in $1; do
    v=$(grep '^counts ' "uas_$p.log" 2>/dev/null | tail -1 | tr ' ' '\n' | awk -F= -v f="$2" '$1==f{print $2}')
    s=$((s + ${v:-0}))
  done
  echo "$s"
}
kv() { tr ' ' '\n' < "$1" | awk -F= -v k="$2" '$1==k{v=$2} END{print (v == "" ? "NA" : v)}'; }

echo "# held: $SOURCES sources x $PER silent TLS connections, fulcrum nofile $NOFILE, calls $RATE/s per transport for ${CALL_SECS}s; $(date -u +%FT%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "fulcrum open files before: $(ls /proc/$FPID/fd | wc -l)"
N=$((RATE * CALL_SECS))
timeout $((CALL_SECS * 3 + 60)) "$LOADG" "127.0.0.1:$PT" --ca ca.crt --name proxy.bench --conns 4 \
  --rate "$RATE" --secs "$CALL_SECS" --timeout-ms 5000 --tag "held-$$" > load_tls.log 2>&1 & LT=$!
timeout $((CALL_SECS * 3 + 60)) sipp -sn uac 127.0.0.1:$PU -i 127.0.0.1 -p $UAC_PORT -r "$RATE" -m "$N" \
  -nostdin -trace_stat -stf uac.csv -fd 5 > uac.log 2>&1 & LU=$!
sleep 3
mkfifo hold
python3 "$ROOT/bench/held.py" 127.0.0.1 "$PT" "$SOURCES" "$PER" < hold > holders.out 2>&1 & HP=$!; PIDS+=($HP)
exec 3> hold
t0=$(date +%s)
wait_ready holders.out $(((CALL_SECS - 10) * 10)); grep -q ready= holders.out || echo "the holders were not ready in time"
opened=$(sed -n 's/^ready=//p' holders.out)
echo "holders: $opened of $((SOURCES * PER)) connections opened in $(( $(date +%s) - t0 )) s"
echo "while held: fulcrum open files $(ls /proc/$FPID/fd | wc -l); metrics:"; metrics | sed 's/^/  /'
sleep "$HOLD_SECS"
echo "after ${HOLD_SECS}s held: holders' connections still open $(grep '^open=' holders.out | tail -1 | cut -d= -f2) of $opened"
wait "$LT"; wait "$LU"
exec 3>&-
for _ in $(seq 1 50); do grep -q closed holders.out && break; sleep 0.1; done
echo "calls ended $(( $(date +%s) - t0 )) s after the holders began (holders ended with the calls' end)"
echo "metrics at the end:"; metrics | sed 's/^/  /'
sleep 0.5
echo "sip-tls: attempted $N, completed $(kv load_tls.log completed), failed $(kv load_tls.log failed) (481 $(kv load_tls.log failed_481), timeout $(kv load_tls.log failed_timeout), closed $(kv load_tls.log failed_closed), unstarted $(kv load_tls.log unstarted)), connections lost $(kv load_tls.log conns_lost), setup p99 $(kv load_tls.log setup_p99_us) us; services sent 481: $(uas_sum "$TLS_UAS" r481)"
echo "sip-udp: attempted $N, successful $(col uac.csv 'SuccessfulCall(C)'), failed $(col uac.csv 'FailedCall(C)'), retransmissions $(col uac.csv 'Retransmissions(C)'), unexpected $(col uac.csv 'FailedUnexpectedMessage(C)'); services sent 481: $(uas_sum "$UDP_UAS" r481)"
