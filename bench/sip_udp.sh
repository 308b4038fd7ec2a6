#!/usr/bin/env bash
# SIP over UDP: fulcrum vs Kamailio in one run (see bench/sip.sh for knobs and output).
exec env TRANSPORT=udp "$(dirname "$0")/sip.sh" "$@"
