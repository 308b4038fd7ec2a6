#!/usr/bin/env bash
# Firewall pool: the machine's CPU per packet forwarded through the outside balancer of the
# sandwich of tests/common/fwbed.rs (client -- outside balancer -- 3 strict nftables
# firewalls -- inside balancer -- server, in network namespaces; docs/firewall.md).
# One fixed offered rate from one generator: the test binary's `fw-blast` role (UDP, 64-byte
# payloads over 64 source ports, paced in 1 ms steps) in the client's namespace, counted by a
# UDP sink in the server's. CPU is the whole machine's, from /proc/stat during the blast, less
# the background measured over 2 s just before, divided by the packets the sink received:
# all busy time (meaningless where other work keeps the machine saturated: the blast only
# displaces it), and softirq time, where the kernel forwards a packet crossing veth links
# (receive, routing, nftables hooks, `fwd`) and which other users hardly add to. Each packet
# crosses both balancers and a firewall: the figures are the sandwich's cost, alike in every
# row. /proc/stat counts in 10 ms ticks: at 20,000 packets/s for 5 s one tick is 100 ns a
# packet; raise RATE, SECS or ROUNDS for finer figures.
# Rows: `route` (plain kernel routing through firewall 1, no balancer), `symhash` (nftables
# netdev ingress `symhash mod 3` + `fwd` on both balancers). fulcrum's row joins when its
# packet data path does (tests/firewall.rs, `bench_forwarding`).
# Usage (root, nftables): RATE=20000 SECS=5 ROUNDS=2 MODES=route,symhash bench/firewall.sh
. "$(dirname "$0")/lib.sh"
RATE=${RATE:-20000}; SECS=${SECS:-5}; ROUNDS=${ROUNDS:-2}; MODES=${MODES:-route,symhash}
cd "$ROOT" || exit 1
echo "# firewall: rate=${RATE}/s dur=${SECS}s rounds=$ROUNDS modes=$MODES nproc=$(nproc) kernel=$(uname -r)"
# Built first, untimed (a cold release build takes minutes); the run itself is bounded.
cargo test --release --test firewall --no-run || exit 1
FWBENCH_RATE=$RATE FWBENCH_SECONDS=$SECS FWBENCH_ROUNDS=$ROUNDS FWBENCH_MODES=$MODES FULCRUM_REQUIRE_NETNS=1 \
  timeout 300 cargo test --release --test firewall -- --ignored --exact bench_forwarding \
  --nocapture --test-threads 1 2>&1 | grep -E 'BENCH|SKIP|panicked'
