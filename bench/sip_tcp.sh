#!/usr/bin/env bash
# SIP over TCP: fulcrum (sip-tcp) vs Kamailio with TCP enabled, in one run (see bench/sip.sh).
exec env TRANSPORT=tcp "$(dirname "$0")/sip.sh" "$@"
