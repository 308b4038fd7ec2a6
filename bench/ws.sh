#!/usr/bin/env bash
# SIP over secure WebSocket: fulcrum's sip-wss vserver beside Kamailio's websocket module
# (tls + xhttp + websocket, record-routing and forwarding statelessly) in front of the same
# registrar (Kamailio: registrar + usrloc, record-routing stateless proxy over UDP) and a SIPp
# UAS, in one run. `fulcrum-load ws-sip` opens CONNS wss:// connections; each REGISTERs once,
# then places calls back to back (INVITE, 180 and 200 from a SIPp UAS, ACK, BYE, 200) for DUR
# seconds. Prints, per proxy and round, calls/s and the proxy's CPU per call and per SIP
# message (6 per call through the front: INVITE, 180, 200, ACK, BYE, 200), proxy CPU from its
# process tree's utime + stime.
# Usage: [DUR=10] [CONNS=32] [ROUNDS=2] bench/ws.sh
#        (needs kamailio, kamailio-tls-modules, kamailio-websocket-modules, sipp, openssl)
. "$(dirname "$0")/lib.sh"
DUR=${DUR:-10}; CONNS=${CONNS:-32}; ROUNDS=${ROUNDS:-2}
REG=${REG:-15400}; UAS=${UAS:-15401}; KUDP=${KUDP:-15402}; FWS=${FWS:-15443}; KWS=${KWS:-15444}
MOD=/usr/lib/x86_64-linux-gnu/kamailio/modules
for m in websocket tls xhttp; do
  [ -f "$MOD/$m.so" ] || { echo "no Kamailio $m module (apt-get install kamailio-websocket-modules kamailio-tls-modules)" >&2; exit 1; }
done
build_fulcrum
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=127.0.0.1 \
  -keyout "$TMP/key.pem" -out "$TMP/cert.pem" 2>/dev/null || exit 1

head_cfg() {
  printf '#!KAMAILIO\ndebug=%s\nlog_stderror=yes\nfork=yes\nchildren=%s\nauto_aliases=no\ndns=no\nrev_dns=no\nmpath="%s/"\n' "${KDEBUG:-0}" "$1" "$MOD"
}
# The registrar and proxy toward the UAS, over UDP.
{ head_cfg 2; cat <<K
listen=udp:127.0.0.1:$REG
loadmodule "kex.so"
loadmodule "pv.so"
loadmodule "sl.so"
loadmodule "rr.so"
loadmodule "siputils.so"
loadmodule "usrloc.so"
loadmodule "registrar.so"
modparam("usrloc", "db_mode", 0)
modparam("registrar", "use_path", 1)
modparam("registrar", "path_mode", 0)
request_route {
  if (has_totag()) { if (loose_route()) { forward(); exit; } if (method == "ACK") { exit; } sl_send_reply("404", "No Route"); exit; }
  if (method == "REGISTER") { if (!save("location")) { sl_reply_error(); } exit; }
  if (method == "INVITE") { record_route(); \$du = "sip:127.0.0.1:$UAS"; forward(); exit; }
  sl_send_reply("404", "Not Here"); exit;
}
K
} > "$TMP/registrar.cfg"
# Kamailio's WebSocket front.
printf '[server:default]\nmethod = TLSv1.2+\ncertificate = %s\nprivate_key = %s\n' "$TMP/cert.pem" "$TMP/key.pem" > "$TMP/tls.cfg"
{ head_cfg 2; cat <<K
listen=udp:127.0.0.1:$KUDP
listen=tls:127.0.0.1:$KWS
enable_tls=yes
tcp_accept_no_cl=yes
loadmodule "kex.so"
loadmodule "pv.so"
loadmodule "sl.so"
loadmodule "tls.so"
loadmodule "xhttp.so"
loadmodule "websocket.so"
loadmodule "rr.so"
loadmodule "siputils.so"
loadmodule "path.so"
modparam("tls", "config", "$TMP/tls.cfg")
request_route {
  if (has_totag()) { if (loose_route()) { forward(); exit; } if (method == "ACK") { exit; } sl_send_reply("404", "No Route"); exit; }
  if (method == "REGISTER") { add_path_received(); \$du = "sip:127.0.0.1:$REG"; forward(); exit; }
  record_route(); \$du = "sip:127.0.0.1:$REG"; forward(); exit;
}
event_route[xhttp:request] {
  if (\$hdr(Upgrade) =~ "websocket" && \$hdr(Connection) =~ "Upgrade" && \$rm =~ "GET") {
    if (ws_handle_handshake()) { exit; }
  }
  xhttp_reply("404", "Not Found", "", "");
}
K
} > "$TMP/front.cfg"
cat > "$TMP/fulcrum.yaml" <<Y
admin: { listen: null }
services:
  - { name: reg, address: "127.0.0.1:$REG", protocol: sip-udp }
vservers:
  - { name: wss, protocol: sip-wss, bind: "127.0.0.1:$FWS", tls: { cert: $TMP/cert.pem, key: $TMP/key.pem }, failover: off, max_per_source: off, services: [reg] }
Y

# SIPp's built-in UAS, but echoing Record-Route (RFC 3261 §12.1.1): the caller's ACK and BYE
# must go back through the front and the registrar.
cat > "$TMP/uas.xml" <<'X'
<?xml version="1.0" encoding="ISO-8859-1" ?>
<!DOCTYPE scenario SYSTEM "sipp.dtd">
<scenario name="uas with record-route">
  <recv request="INVITE" crlf="true"/>
  <send><![CDATA[
      SIP/2.0 180 Ringing
      [last_Via:]
      [last_Record-Route:]
      [last_From:]
      [last_To:];tag=[pid]SIPpTag01[call_number]
      [last_Call-ID:]
      [last_CSeq:]
      Contact: <sip:[local_ip]:[local_port];transport=[transport]>
      Content-Length: 0
    ]]></send>
  <send retrans="500"><![CDATA[
      SIP/2.0 200 OK
      [last_Via:]
      [last_Record-Route:]
      [last_From:]
      [last_To:];tag=[pid]SIPpTag01[call_number]
      [last_Call-ID:]
      [last_CSeq:]
      Contact: <sip:[local_ip]:[local_port];transport=[transport]>
      Content-Length: 0
    ]]></send>
  <recv request="ACK" optional="true" rtd="true" crlf="true"/>
  <recv request="BYE"/>
  <send><![CDATA[
      SIP/2.0 200 OK
      [last_Via:]
      [last_From:]
      [last_To:]
      [last_Call-ID:]
      [last_CSeq:]
      Content-Length: 0
    ]]></send>
</scenario>
X
sipp -sf "$TMP/uas.xml" -i 127.0.0.1 -p "$UAS" -nostdin -bg > /dev/null 2>&1
SIPP=$(pgrep -f "sipp -sf $TMP/uas.xml" | head -1); [ -n "$SIPP" ] && PIDS+=($SIPP)
kamailio -f "$TMP/registrar.cfg" -DD -E > "$TMP/registrar.log" 2>&1 & PIDS+=($!)
wait_port "$REG" u || { cat "$TMP/registrar.log" >&2; exit 1; }

measure() { # NAME PID URL
  local t0 t1 out calls
  t0=$(tree_ticks "$2")
  out=$("$LOAD" ws-sip "$3" --sockets "$CONNS" --secs "$DUR")
  t1=$(tree_ticks "$2")
  calls=$(sed -n 's/.*calls=\([0-9]*\).*/\1/p' <<<"$out")
  awk -v n="$1" -v r="$ROUND" -v c="${calls:-0}" -v t=$((t1 - t0)) -v d="$DUR" -v out="$out" -v hz="$(getconf CLK_TCK)" \
    'BEGIN{us = c ? t * 1e6 / hz / c : 0; printf "round %s %-8s %s  calls/s=%.0f  cpu_us_per_call=%.1f  cpu_us_per_msg=%.2f\n", r, n, out, c / d, us, us / 6}'
}

echo "# bench/ws.sh: $CONNS wss connections, ${DUR}s per run, $ROUNDS rounds; $(date -u +%H:%M) load $(cut -d' ' -f1-3 /proc/loadavg)"
for ROUND in $(seq 1 "$ROUNDS"); do
  start_fulcrum "$TMP/fulcrum.log" --config "$TMP/fulcrum.yaml"
  wait_port "$FWS" t || exit 1
  measure fulcrum "$FPID" "wss://127.0.0.1:$FWS/"
  stop_fulcrum
  kamailio -f "$TMP/front.cfg" -DD -E > "$TMP/front.log" 2>&1 & KPID=$!
  wait_port "$KWS" t || { tail "$TMP/front.log"; exit 1; }
  sleep 0.5
  measure kamailio "$KPID" "wss://127.0.0.1:$KWS/"
  kill "$KPID"; wait "$KPID" 2>/dev/null
  [ -n "${SHOW_LOGS:-}" ] && tail -n 60 "$TMP/front.log"; tail -n 30 "$TMP/registrar.log"
done
