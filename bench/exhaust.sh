#!/usr/bin/env bash
# Exhaustion and memory: N silent TLS connections (handshakes complete, one loopback source
# address each, bench/exhaust.py) held against a sip-tls vserver, then closed. Prints fulcrum's
# open files and VmRSS before, while held and after the close (settled), and its file budget
# (the pool and how much of it the connections took; docs/limits.md), and the trims of freed
# memory it logged. The vserver has
# `max_per_source: off`, `max_sessions` above N, and a service nobody needs (the connections
# never send a message).
# Usage: [N=20000] bench/exhaust.sh        (needs python3, openssl; root or CAP_SYS_RESOURCE
# for more than the hard open-file limit)
. "$(dirname "$0")/lib.sh"
N=${N:-20000}
prlimit --pid $$ --nofile=200000:200000 2>/dev/null || true
ulimit -Sn "$(ulimit -Hn)"
build_fulcrum
PORT=${PORT:-15261}; ADMIN=${ADMIN:-19291}
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=fulcrum.test \
  -keyout "$TMP/key.pem" -out "$TMP/cert.pem" 2>/dev/null || exit 1
cat > "$TMP/exhaust.yaml" <<YAML
admin: { listen: "127.0.0.1:$ADMIN" }
services:
  - { name: p1, address: 127.0.0.1:9, protocol: sip-tcp }
vservers:
  - { name: s, protocol: sip-tls, bind: [127.0.0.1:$PORT], max_sessions: 200000,
      max_per_source: off, tls: { cert: $TMP/cert.pem, key: $TMP/key.pem }, services: [p1] }
YAML
start_fulcrum "$TMP/fulcrum.log" --config "$TMP/exhaust.yaml"
wait_port "$PORT" t
sleep 1
fds() { ls "/proc/$FPID/fd" | wc -l; }
files() { curl -fsS "http://127.0.0.1:$ADMIN/metrics" | awk '/^fulcrum_open_files\{kind="(pool|used)"\}/{printf "%s ", $0}'; }
r0=$(settled "$FPID"); f0=$(fds)
mkfifo "$TMP/hold"
python3 "$(dirname "$0")/exhaust.py" 127.0.0.1 "$PORT" "$N" < "$TMP/hold" > "$TMP/client.out" 2>&1 & CPID=$!; PIDS+=($CPID)
exec 3> "$TMP/hold"
wait_ready "$TMP/client.out" 1800
held=$(sed -n 's/.*ready=\([0-9]*\).*/\1/p' "$TMP/client.out")
r1=$(settled "$FPID"); f1=$(fds); b1=$(files)
exec 3>&-
for _ in $(seq 1 100); do grep -q closed "$TMP/client.out" && break; sleep 0.1; done
sleep 2
r2=$(settled "$FPID"); f2=$(fds)
sleep "${SETTLE:-10}"
r3=$(rss "$FPID"); f3=$(fds); b3=$(files)
echo "# exhaust: $N TLS connections wanted, ${held:-0} held (open-file limit $(awk '/Max open files/{print $4}' /proc/$FPID/limits))"
echo "before:        fds=$f0 rss_kib=$r0"
echo "held:          fds=$f1 rss_kib=$r1 $b1"
echo "closed +2s:    fds=$f2 rss_kib=$r2"
echo "closed +$((2 + ${SETTLE:-10}))s:   fds=$f3 rss_kib=$r3 $b3"
echo "after/before:  $(awk -v a="$r3" -v b="$r0" 'BEGIN{printf "%.2f", a/b}')"
# The trims of freed memory fulcrum ran after the close (src/memory.rs), with what each took.
grep "given back" "$TMP/fulcrum.log" || echo "no trim logged"
# Where the resident memory is at the end: the five largest mappings (KiB resident, then the
# mapping: [heap], [stack], an anonymous one, a file).
echo "largest resident mappings:"
awk '/^[0-9a-f]+-[0-9a-f]+ /{m=$1" "$6} /^Rss:/{print $2, m}' "/proc/$FPID/smaps" | sort -rn | head -5
stop_fulcrum
