#!/usr/bin/env bash
# jemalloc's background thread (src/memory.rs) off and on, on the same SIP burst: fulcrum's
# RSS after the burst and after IDLE seconds idle, and its CPU per SIP message.
#
#   SIPp UAC (127.0.0.1:$BASE+10) -> fulcrum sip-udp 127.0.0.1:$BASE -> 3 SIPp UAS ($BASE+11..13)
#
# Modes, each a fresh fulcrum (the release build), alternating round by round:
#   off   MODE_OFF, jemalloc's options for the off run (default `background_thread:false`)
#   on    MODE_ON (default `background_thread:true`)
# passed in _RJEM_MALLOC_CONF, the environment variable the binary's jemalloc reads at start
# (tikv-jemalloc-sys builds it with the `_rjem_` prefix), so one binary runs both.
# Per run: RSS settled at start; `sipp -sn uac` at RATE calls/s for DUR s (6 SIP messages per
# call through fulcrum); RSS at the end of the burst (settled); fulcrum's CPU ticks over the
# burst per message (utime + stime of /proc/PID/stat, every thread, jemalloc's own included);
# then 2 x IDLE s without traffic: RSS after IDLE s and after 2 x IDLE s (past the 32 s a
# request outside a dialog stays pinned, docs/sip.md), and the CPU ticks fulcrum spent idle.
# Prints one line per run and the medians per mode.
#
# Every process runs under `timeout`; the EXIT trap ends those this script started, by PID.
# Usage: [ROUNDS=3 RATE=1500 DUR=10 IDLE=30] bench/jemalloc_bg.sh   (needs sipp)
. "$(dirname "$0")/lib.sh"
ROUNDS=${ROUNDS:-3}; RATE=${RATE:-1500}; DUR=${DUR:-10}; IDLE=${IDLE:-30}; BASE=${BASE:-26060}
MODE_OFF=${MODE_OFF:-background_thread:false}; MODE_ON=${MODE_ON:-background_thread:true}
command -v sipp >/dev/null || { echo "sipp not found (apt-get install sip-tester)" >&2; exit 2; }
build_fulcrum
HZ=$(getconf CLK_TCK)
cat > "$TMP/sip.yaml" <<YAML
admin: { listen: null }
logging: { level: warn }
services:
  - { name: uas1, address: 127.0.0.1:$((BASE + 11)), protocol: sip-udp }
  - { name: uas2, address: 127.0.0.1:$((BASE + 12)), protocol: sip-udp }
  - { name: uas3, address: 127.0.0.1:$((BASE + 13)), protocol: sip-udp }
vservers:
  - { name: sip-lb, protocol: sip-udp, bind: [127.0.0.1:$BASE], method: call_id_hash,
      services: [uas1, uas2, uas3] }
YAML
for port in $((BASE + 11)) $((BASE + 12)) $((BASE + 13)); do
  timeout 1800 sipp -sn uas -t u1 -i 127.0.0.1 -p "$port" -nostdin -buff_size 4194304 > /dev/null 2>&1 & PIDS+=($!)
  wait_port "$port" || exit 1
done
RES=$TMP/results
echo "# jemalloc_bg: RATE=$RATE DUR=$DUR IDLE=$IDLE ROUNDS=$ROUNDS off='$MODE_OFF' on='$MODE_ON'; $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
  order="off on"; [ $((r % 2)) = 0 ] && order="on off"
  for mode in $order; do
    conf=$MODE_OFF; [ "$mode" = on ] && conf=$MODE_ON
    export _RJEM_MALLOC_CONF=$conf
    start_fulcrum "$TMP/fulcrum-$mode-$r.log" --config "$TMP/sip.yaml" --drain-timeout 0s
    wait_port "$BASE" || exit 1
    sleep 1
    r0=$(settled "$FPID"); threads=$(grep -c jemalloc_bg "/proc/$FPID/task/"*/comm 2>/dev/null | awk -F: '{n += $2} END {print n + 0}')
    k0=$(tree_ticks "$FPID")
    timeout $((DUR * 3 + 30)) sipp -sn uac -t u1 "127.0.0.1:$BASE" -i 127.0.0.1 -p $((BASE + 10)) \
      -r "$RATE" -m $((RATE * DUR)) -nostdin -buff_size 4194304 -l $((RATE * 2 + 100)) \
      -trace_stat -stf "$TMP/uac-$mode-$r.csv" -fd 5 > "$TMP/uac-$mode-$r.log" 2>&1
    k1=$(tree_ticks "$FPID"); r1=$(settled "$FPID")
    succ=$(col "$TMP/uac-$mode-$r.csv" "SuccessfulCall(C)")
    sleep "$IDLE"; r2=$(rss "$FPID")
    sleep "$IDLE"; k2=$(tree_ticks "$FPID"); r3=$(rss "$FPID")
    us=$(awk -v d=$((k1 - k0)) -v hz="$HZ" -v s="${succ:-0}" 'BEGIN{printf "%.2f", (s > 0) ? d * 1e6 / hz / (s * 6) : 0}')
    echo "$r $mode $succ $us $r0 $r1 $r2 $r3 $((k2 - k1)) $threads" >> "$RES"
    echo "round $r $mode: calls=$succ us_per_msg=$us rss_kib start=$r0 burst=$r1 idle${IDLE}s=$r2 idle$((IDLE * 2))s=$r3 idle_cpu_ticks=$((k2 - k1)) jemalloc_bg_threads=$threads"
    stop_fulcrum; unset _RJEM_MALLOC_CONF
  done
done
awk '
  function median(a, n,   i, j, t) {
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  { n[$2]++; us[$2, n[$2]] = $4; r0[$2, n[$2]] = $5; r1[$2, n[$2]] = $6; r2[$2, n[$2]] = $7; r3[$2, n[$2]] = $8; ik[$2, n[$2]] = $9 }
  END {
    split("off on", ms, " ")
    for (k = 1; k <= 2; k++) {
      m = ms[k]; if (!n[m]) continue
      for (i = 1; i <= n[m]; i++) { a[i] = us[m, i]; b[i] = r0[m, i]; c[i] = r1[m, i]; d[i] = r2[m, i]; f[i] = r3[m, i]; e[i] = ik[m, i] }
      printf "%-3s median of %d: us_per_msg %.2f  rss_kib start %d burst %d idle %d idle2 %d  idle_cpu_ticks %d\n",
        m, n[m], median(a, n[m]), median(b, n[m]), median(c, n[m]), median(d, n[m]), median(f, n[m]), median(e, n[m])
    }
  }' "$RES"
echo "# end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
