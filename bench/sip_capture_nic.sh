#!/usr/bin/env bash
# What a UDP HEP collector costs the sender when the collector is on another host: the SIP
# bench of bench/sip_capture.sh run inside a network namespace of its own, where capture goes
# to 10.254.0.2 through a veth device whose peer is down. The kernel builds each datagram (or
# each GSO send) and hands it to the device, which drops it: the sender's whole part of a
# send, with none of the receiving that loopback runs in the sender's context (BENCHMARKS.md,
# "HEP capture: UDP toward another host"). veth advertises UDP segmentation offload, so a GSO
# send reaches it whole, as it reaches a NIC with USO; USO=off turns the offload off and the
# kernel cuts each GSO send into datagrams in software first, as in front of a NIC without it.
# A static neighbour entry stands for the collector's (or its router's) MAC address. SIPp and
# fulcrum talk over the namespace's own loopback; nothing leaves the namespace.
#
# Usage: ROUNDS=3 bench/sip_capture_nic.sh
#        USO=off CASES="off udp-gso:10.254.0.2:29060" bench/sip_capture_nic.sh
# Needs root (ip netns) and ethtool for USO=off. One line per run, as bench/sip_capture.sh
# prints them, with the frames the device took (v0-frames: datagrams, or GSO sends with USO).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
NS=fulcrum-bench-nic-$$
trap 'ip netns del "$NS" 2>/dev/null' EXIT
ip netns add "$NS"
ip -n "$NS" link set lo up
ip -n "$NS" link add v0 type veth peer name v1
ip -n "$NS" addr add 10.254.0.1/24 dev v0
ip -n "$NS" link set v0 up                     # v1 stays down: nothing receives
ip -n "$NS" neigh add 10.254.0.2 lladdr 02:00:00:00:00:02 dev v0 nud permanent
if [ "${USO:-on}" = off ]; then
  ip netns exec "$NS" ethtool -K v0 tx-udp-segmentation off >/dev/null
fi
echo "# $NS: v0 $(ip netns exec "$NS" ethtool -k v0 2>/dev/null | grep -o 'tx-udp-segmentation: [a-z]*')"
ip netns exec "$NS" env COUNT_DEV=v0 \
  CASES="${CASES:-off udp:10.254.0.2:29060 udp-gso:10.254.0.2:29060 tcp:127.0.0.1:29064}" \
  ROUNDS="${ROUNDS:-3}" "$HERE/sip_capture.sh"
