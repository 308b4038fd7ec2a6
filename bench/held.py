#!/usr/bin/env python3
"""Hold PER silent TLS connections from each of SOURCES loopback source addresses
(127.3.0.1, 127.3.0.2, ...) to HOST:PORT until stdin closes. Prints `ready=<open>` once every
attempt has ended (handshake complete or failed), then, every second while held, `open=<n>`:
how many of them fulcrum has not closed (an evicted connection reads EOF). Used by
bench/held.sh. Standard library only."""
import asyncio
import ssl
import sys


async def one(src, host, port, ctx, held):
    try:
        r, w = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, local_addr=(src, 0)), 30)
        held.append((r, w))
    except Exception:
        pass


async def watch(r, alive):
    # Silent: nothing is sent, so anything but EOF is unexpected; EOF or an error is a close.
    try:
        await r.read(1)
    except Exception:
        pass
    alive[0] -= 1


async def main():
    host, port = sys.argv[1], int(sys.argv[2])
    sources, per = int(sys.argv[3]), int(sys.argv[4])
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    held = []
    sem = asyncio.Semaphore(200)

    async def bounded(src):
        async with sem:
            await one(src, host, port, ctx, held)

    srcs = [f"127.3.0.{s + 1}" for s in range(sources)]
    # Interleaved, so that every source ramps up at once.
    await asyncio.gather(*(bounded(srcs[i % sources]) for i in range(sources * per)))
    alive = [len(held)]
    watchers = [asyncio.ensure_future(watch(r, alive)) for r, _ in held]
    print(f"ready={len(held)}", flush=True)
    loop = asyncio.get_running_loop()
    done = loop.run_in_executor(None, sys.stdin.read)
    while not done.done():
        print(f"open={alive[0]}", flush=True)
        await asyncio.wait([done], timeout=1)
    for _, w in held:
        w.transport.abort()
    for t in watchers:
        t.cancel()
    print(f"closed open_at_end={alive[0]}", flush=True)


asyncio.run(main())
