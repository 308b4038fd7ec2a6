#!/usr/bin/env python3
"""A stand-in HEP collector for bench/sip_capture.sh: MODE udp (recv and discard), tcp-read
(accept, read and discard) or tcp-stall (accept and never read; the connections are kept).

usage: bench/hep_sink.py MODE PORT   (on 127.0.0.1; ends when killed)
"""
import socket
import sys
import threading

mode, port = sys.argv[1], int(sys.argv[2])
if mode == "udp":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind(("127.0.0.1", port))
    while True:
        s.recv(70000)
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("127.0.0.1", port))
l.listen(16)
held = []


def drain(c):
    while c.recv(1 << 20):
        pass


while True:
    c, _ = l.accept()
    held.append(c)
    if mode == "tcp-read":
        threading.Thread(target=drain, args=(c,), daemon=True).start()
