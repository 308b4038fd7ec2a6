#!/usr/bin/env python3
"""Hold N silent TLS connections to HOST:PORT, each from its own loopback source address
(127.3.x.y), until stdin closes; print `ready=<n>` once they are up (handshakes complete).
Used by bench/exhaust.sh. Standard library only."""
import asyncio
import ssl
import sys


async def one(i, host, port, ctx, held):
    src = f"127.3.{i // 250}.{i % 250 + 1}"
    try:
        r, w = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, local_addr=(src, 0)), 20)
        held.append(w)
    except Exception:
        pass


async def main():
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    held = []
    sem = asyncio.Semaphore(200)

    async def bounded(i):
        async with sem:
            await one(i, host, port, ctx, held)

    await asyncio.gather(*(bounded(i) for i in range(n)))
    print(f"ready={len(held)}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    for w in held:
        w.transport.abort()
    print("closed", flush=True)


asyncio.run(main())
