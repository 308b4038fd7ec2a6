#!/usr/bin/env bash
# The Debian package under a real systemd (Debian 12's 252 here): systemd booted as PID 1 of fresh PID, mount,
# network, UTS, IPC and cgroup namespaces, on an overlay of this machine's root (writes land
# in a tmpfs that dies with the namespaces, so the host's packages and network are untouched).
# Inside: `dpkg -i` of the package packaging/check-deb.sh built, `systemctl start fulcrum`
# with the shipped /etc/fulcrum/fulcrum.yaml, and checks that
#   - the start completed only after fulcrum's READY=1 (Type=notify), with its STATUS text;
#   - the hardened unit (DynamicUser, SystemCallFilter, ...) binds the configured ports, and
#     SIP flows through them: three SIPp services answer OPTIONS on 5071-5073, fulcrum's
#     monitors bring them UP, /readyz says 200 and a SIPp client's OPTIONS through 5060 is
#     answered;
#   - the watchdog is petted (WATCHDOG=1 at READY and again half of WatchdogSec later);
#   - `systemctl reload` goes RELOADING=1 -> READY=1 and the same process stays active;
#   - `systemctl stop` sends STOPPING=1 and ends with exit 0, inactive, not failed.
# systemd logs at debug level to its journal, every notify message it receives included; the
# checks read those lines (journalctl -u fulcrum) and print them on failure.
#
# Usage: packaging/check-systemd.sh [PACKAGE.deb]   (default: the target dir's debian/fulcrum_*.deb)
# Needs root, unshare/nsenter (util-linux), /lib/systemd/systemd, a cgroup2 mount, overlayfs,
# SIPp and curl. Without one of them it prints SKIP and exits 0, unless FULCRUM_REQUIRE_SYSTEMD
# is set (CI), where it fails. The whole run is bounded (timeout, 240 s).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${FULCRUM_CHECK_SYSTEMD_BOUNDED:-}" ]; then
  export FULCRUM_CHECK_SYSTEMD_BOUNDED=1
  exec timeout --kill-after=20 240 "$0" "$@"
fi

say() { echo "check-systemd: $*"; }
skip() {
  if [ -n "${FULCRUM_REQUIRE_SYSTEMD:-}" ]; then
    echo "check-systemd: FAIL (FULCRUM_REQUIRE_SYSTEMD is set): $*" >&2
    exit 1
  fi
  say "SKIP: $*"
  exit 0
}

[ "$(id -u)" = 0 ] || skip "needs root (namespaces, overlayfs, cgroups)"
sd=/lib/systemd/systemd
[ -x "$sd" ] || skip "$sd not installed (Debian package systemd)"
for tool in unshare nsenter findmnt sipp curl dpkg-deb; do
  command -v "$tool" >/dev/null 2>&1 || skip "$tool not installed"
done

deb=${1:-}
if [ -z "$deb" ]; then
  version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
  deb=$(find "${CARGO_TARGET_DIR:-target}/debian" -name "fulcrum_$version-*.deb" 2>/dev/null | sort | tail -n 1 || true)
fi
[ -f "$deb" ] || { echo "check-systemd: no package (run packaging/check-deb.sh first)" >&2; exit 1; }
deb=$(readlink -f "$deb")

cg2=$(findmnt -n -t cgroup2 -o TARGET | head -n 1 || true)
[ -n "$cg2" ] || skip "no cgroup2 hierarchy mounted on this host"

work=$(mktemp -d /tmp/fulcrum-check-systemd.XXXXXX)
cg="$cg2/fulcrum-check-systemd.$$"
log="$work/setup.log"
upid=""
pid1=""

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # SIGKILL to the namespace's PID 1 ends every process in it; the mounts (overlay, tmpfs)
  # go with the mount namespace.
  if [ -n "$pid1" ]; then kill -KILL "$pid1" 2>/dev/null || true; fi
  if [ -n "$upid" ]; then
    kill -KILL "$upid" 2>/dev/null || true
    wait "$upid" 2>/dev/null || true
  fi
  # The cgroups the container's systemd made, deepest first (empty once PID 1 is gone).
  if [ -d "$cg" ]; then
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
      [ -d "$cg" ] || break
      sleep 0.2
    done
    [ -d "$cg" ] && echo "check-systemd: cgroup $cg left behind" >&2
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 124' INT TERM

dump() {
  if [ -n "$pid1" ]; then
    echo "---- journalctl -u fulcrum.service (systemd's and fulcrum's lines) ----" >&2
    unitlog | grep -v -e cgroup -e bpf -e BPF -e unit-root -e ounting -e 'system call' \
      -e 'is made redundant' -e 'Followed source symlinks' | tail -n 60 >&2 || true
  fi
}
fail() {
  echo "check-systemd: FAIL: $*" >&2
  dump
  exit 1
}

# A command inside the container, bounded.
inside() { timeout 30 nsenter --target "$pid1" --all --root --wd=/ env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
prop() { inside systemctl show -P "$1" fulcrum.service; }
# The unit's journal: systemd's debug lines about it (each notify message) and fulcrum's output.
unitlog() { inside journalctl --no-pager -o cat -u fulcrum.service; }
# logged ERE: whether the unit's journal holds a line matching ERE, waiting up to 5 s for
# journald to write it (it may lag behind the systemctl call that caused it).
logged() {
  local i
  for i in $(seq 1 25); do
    unitlog | grep -qE "$1" && return 0
    sleep 0.2
  done
  return 1
}

mkdir "$cg" || skip "cannot create a cgroup under $cg2"
mkdir "$work/ns"
# Runs as PID 1 of the new namespaces: the overlay root, API file systems, then systemd.
setup=$(
  cat <<'EOF'
set -eu
t="$WORK/ns"
mount -t tmpfs -o mode=755,size=1g fulcrum-check "$t"
mkdir "$t/upper" "$t/work" "$t/root"
R="$t/root"
mount -t overlay fulcrum-check -o "lowerdir=/,upperdir=$t/upper,workdir=$t/work" "$R"
mount -t proc proc "$R/proc"
mount -t sysfs -o ro sysfs "$R/sys"
mount -t cgroup2 cgroup2 "$R/sys/fs/cgroup"
mount -t tmpfs -o mode=755 dev "$R/dev"
for d in null zero full random urandom tty; do
  touch "$R/dev/$d"
  mount --bind "/dev/$d" "$R/dev/$d"
done
# PrivateDevices= builds the service's /dev from these, /dev/ptmx included.
mkdir "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=755 run "$R/run"
mount -t tmpfs -o mode=1777 tmp "$R/tmp"
cp "$DEB" "$R/root/"
# Boot only this target (journald, no host services); fulcrum is started by hand.
cat >"$R/etc/systemd/system/fulcrum-check.target" <<'UNIT'
[Unit]
Description=fulcrum package check
Wants=systemd-journald.service
UNIT
hostname fulcrum-check
mkdir -p "$R/oldroot"
cd "$R"
pivot_root . oldroot
umount -l /oldroot
exec env -i container=fulcrum-check PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  /lib/systemd/systemd --system --unit=fulcrum-check.target \
  --log-target=journal --log-level=debug --show-status=no
EOF
)

t0=$SECONDS
(
  echo "$BASHPID" >"$cg/cgroup.procs"
  WORK="$work" DEB="$deb" exec unshare --pid --fork --mount --net --uts --ipc --cgroup \
    bash -c "$setup"
) </dev/null >"$log" 2>&1 &
upid=$!

# PID 1 of the namespace is unshare's only child.
for _ in $(seq 50); do
  pid1=$(awk '{print $1}' "/proc/$upid/task/$upid/children" 2>/dev/null || true)
  [ -n "$pid1" ] && break
  kill -0 "$upid" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$pid1" ]; then
  cat "$log" >&2
  skip "could not start systemd in new namespaces (unshare failed; see above)"
fi

# Booted: systemd answers and its target is reached.
deadline=$((SECONDS + 60))
until state=$(inside systemctl is-system-running 2>/dev/null) || [ "$state" = degraded ]; do
  if ! kill -0 "$pid1" 2>/dev/null; then
    tail -n 40 "$log" >&2
    skip "systemd did not come up as PID 1 in the namespaces (log above)"
  fi
  [ "$SECONDS" -lt "$deadline" ] || fail "systemd not running after 60 s (state: ${state:-none})"
  sleep 0.3
done
[ "$state" = running ] || {
  inside systemctl --failed --no-pager >&2 || true
  fail "system state is $state"
}
say "systemd $(inside systemctl --version | head -n 1 | awk '{print $2}') booted as PID 1 in $((SECONDS - t0)) s"

inside dpkg -i "/root/$(basename "$deb")" >/dev/null || fail "dpkg -i failed"
inside systemctl daemon-reload
[ "$(prop Type)" = notify ] || fail "unit Type is $(prop Type), not notify"

# SIP services answering OPTIONS (fulcrum's sip-options monitor), run as transient units.
cat >"/proc/$pid1/root/root/options-uas.xml" <<'EOF'
<?xml version="1.0" encoding="ISO-8859-1" ?>
<scenario name="answer OPTIONS">
  <recv request="OPTIONS"/>
  <send>
    <![CDATA[
      SIP/2.0 200 OK
      [last_Via:]
      [last_From:]
      [last_To:];tag=[pid]uas[call_number]
      [last_Call-ID:]
      [last_CSeq:]
      Content-Length: 0

    ]]>
  </send>
</scenario>
EOF
cat >"/proc/$pid1/root/root/options-uac.xml" <<'EOF'
<?xml version="1.0" encoding="ISO-8859-1" ?>
<scenario name="send OPTIONS">
  <send>
    <![CDATA[
      OPTIONS sip:probe@[remote_ip]:[remote_port] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: <sip:check@[local_ip]:[local_port]>;tag=[pid]uac[call_number]
      To: <sip:probe@[remote_ip]:[remote_port]>
      Call-ID: [call_id]
      CSeq: 1 OPTIONS
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <recv response="200"/>
</scenario>
EOF
for port in 5071 5072 5073; do
  inside systemd-run --quiet --unit="sip-$port" --working-directory=/root \
    sipp -sf /root/options-uas.xml -i 127.0.0.1 -p "$port" -t u1 -nostdin >/dev/null ||
    fail "cannot start the SIPp service on $port"
done

# A tcp vserver added to the shipped config, in front of the admin API as its service: the
# tcp relay serves under the unit's hardening.
conf="/proc/$pid1/root/etc/fulcrum/fulcrum.yaml"
sed -i 's/^vservers:$/  - { name: admin-api, address: "127.0.0.1:9090", protocol: tcp }\n\nvservers:/' "$conf"
cat >>"$conf" <<'EOF'
  - { name: tcp-lb, protocol: tcp, bind: [127.0.0.1:8080], method: round_robin,
      services: [admin-api] }
EOF

# Start: returns once the unit is active, which for Type=notify is after READY=1.
start0=$SECONDS
inside systemctl start fulcrum.service || fail "systemctl start fulcrum failed"
say "systemctl start fulcrum: $((SECONDS - start0)) s"
[ "$(inside systemctl is-active fulcrum.service)" = active ] || fail "fulcrum is not active"
main=$(prop MainPID)
[ "$main" -gt 0 ] 2>/dev/null || fail "MainPID is '$main'"
show=$(inside systemctl show -p Type,StatusText,MainPID,NRestarts,Result,WatchdogUSec fulcrum.service)
say "$(tr '\n' ' ' <<<"$show")"
[ "$(prop StatusText)" = serving ] || fail "StatusText is '$(prop StatusText)', not 'serving'"
[ "$(prop NRestarts)" = 0 ] || fail "NRestarts is $(prop NRestarts)"
ready_re="fulcrum.service: Got notification message from PID $main \(READY=1, STATUS=serving\)"
running_re="fulcrum.service: Changed start -> running"
journal=$(unitlog)
ready_line=$(grep -nE "$ready_re" <<<"$journal" | head -n 1 | cut -d: -f1)
running_line=$(grep -nE "$running_re" <<<"$journal" | head -n 1 | cut -d: -f1)
[ -n "$ready_line" ] || fail "systemd got no READY=1 from PID $main"
[ -n "$running_line" ] || fail "systemd never moved fulcrum from start to running"
[ "$ready_line" -lt "$running_line" ] || fail "fulcrum was running before its READY=1"
say "READY=1 from PID $main, then start -> running"

# The hardening in force on the running process, and its sockets bound.
uid=$(awk '/^Uid:/ {print $2}' "/proc/$pid1/root/proc/$main/status" 2>/dev/null || true)
if [ -z "$uid" ] || [ "$uid" = 0 ]; then
  fail "fulcrum runs as uid '$uid' (DynamicUser=yes expects a dynamic one)"
fi
[ "$(awk '/^Seccomp:/ {print $2}' "/proc/$pid1/root/proc/$main/status")" = 2 ] ||
  fail "fulcrum runs without a seccomp filter (SystemCallFilter)"
inside ss -H -lnup | grep -q "127.0.0.1:5060 .*pid=$main," || fail "fulcrum does not hold udp 127.0.0.1:5060"
inside ss -H -lntp | grep -q "127.0.0.1:9090 .*pid=$main," || fail "fulcrum does not hold tcp 127.0.0.1:9090"
nofile=$(awk '/^Max open files/ {print $4 "/" $5}' "/proc/$pid1/root/proc/$main/limits")
say "fulcrum (uid $uid, seccomp on, open files $nofile) holds udp 127.0.0.1:5060 and tcp 127.0.0.1:9090"

# The monitors bring the three services UP (2 successes, 5 s apart): /readyz turns 200.
deadline=$((SECONDS + 30))
until body=$(inside curl -fsS -m 2 http://127.0.0.1:9090/readyz 2>/dev/null); do
  [ "$SECONDS" -lt "$deadline" ] || fail "/readyz not 200 after 30 s: $(inside curl -sS -m 2 http://127.0.0.1:9090/readyz || true)"
  sleep 0.5
done
say "/readyz: $body"
through=$(inside curl -fsS -m 5 http://127.0.0.1:8080/readyz) || fail "the tcp vserver does not relay"
say "the tcp vserver relays under the unit (/readyz through tcp 8080: $through)"
inside sipp -sf /root/options-uac.xml -i 127.0.0.1 -p 5090 -t u1 -m 3 -timeout 10 -nostdin \
  127.0.0.1:5060 >/dev/null 2>&1 || fail "SIPp's OPTIONS through fulcrum's 127.0.0.1:5060 were not answered"
say "3 OPTIONS through 127.0.0.1:5060 answered 200"

# The watchdog: WatchdogSec=30s; fulcrum pets at once, then every 15 s (half of it).
pets() { unitlog | grep -cE "fulcrum.service: Got notification message from PID $main \(WATCHDOG=1\)" || true; }
deadline=$((SECONDS + 20))
until [ "$(pets)" -ge 2 ]; do
  [ "$SECONDS" -lt "$deadline" ] || fail "$(pets) WATCHDOG=1 from PID $main in 20 s (2 expected)"
  sleep 0.5
done
say "WATCHDOG=1 twice, $((SECONDS - start0)) s after the start"

# Reload (SIGHUP through ExecReload): RELOADING=1 then READY=1 from the same process.
mark=$(unitlog | wc -l)
inside systemctl reload fulcrum.service || fail "systemctl reload fulcrum failed"
deadline=$((SECONDS + 10))
while :; do
  since=$(unitlog | tail -n +"$((mark + 1))")
  reloading=$(grep -nE "fulcrum.service: Got notification message from PID $main \(RELOADING=1" <<<"$since" |
    head -n 1 | cut -d: -f1)
  if [ -n "$reloading" ]; then
    tail -n +"$((reloading + 1))" <<<"$since" | grep -qE "$ready_re" && break
  fi
  [ "$SECONDS" -lt "$deadline" ] || fail "no RELOADING=1 then READY=1 from PID $main after the reload"
  sleep 0.2
done
deadline=$((SECONDS + 10))
until [ "$(prop SubState)" = running ]; do
  [ "$SECONDS" -lt "$deadline" ] || fail "fulcrum is $(prop SubState) 10 s after the reload"
  sleep 0.2
done
[ "$(inside systemctl is-active fulcrum.service)" = active ] || fail "fulcrum not active after the reload"
[ "$(prop MainPID)" = "$main" ] || fail "MainPID changed over the reload ($main -> $(prop MainPID))"
[ "$(prop StatusText)" = serving ] || fail "StatusText is '$(prop StatusText)' after the reload"
say "reload: RELOADING=1 then READY=1 from PID $main, still active"

# Stop: SIGTERM, STOPPING=1, the drain, exit 0.
stop0=$SECONDS
inside systemctl stop fulcrum.service || fail "systemctl stop fulcrum failed"
say "systemctl stop fulcrum: $((SECONDS - stop0)) s"
logged "fulcrum.service: Got notification message from PID $main \(STOPPING=1" ||
  fail "no STOPPING=1 from PID $main"
# The unit is unloaded once inactive (its ExecMain* properties reset), so the exit is read
# from systemd's own lines: exited by itself with 0 (not killed by SIGKILL), then dead.
state=$(inside systemctl is-active fulcrum.service || true)
[ "$state" = inactive ] || fail "fulcrum is $state after the stop, not inactive"
logged "fulcrum.service: Main process exited, code=exited, status=0/SUCCESS" ||
  fail "fulcrum's main process did not exit with 0"
logged "fulcrum.service: Changed stop-sigterm -> dead" ||
  fail "fulcrum did not go from stop-sigterm to dead (a failed or SIGKILLed stop)"
say "stop: STOPPING=1, main process exited 0, stop-sigterm -> dead, inactive"

# The evidence, as systemd logged it: what fulcrum told it and the states it went through.
unitlog | grep -E -e 'Got notification message' -e 'Changed [a-z-]+ -> [a-z-]+' | sed 's/^/  /'
say "ok: package $(basename "$deb") started, reloaded and stopped under systemd in $((SECONDS - t0)) s"
