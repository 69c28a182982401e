"""A database and a broker at a distance: TCP proxies on 127.0.0.1 that hold every chunk of
data for half a round trip each way, so a bench run can measure the relay where round
trips, not the machine's cores, bound a worker (``python -m bench.drain --rtt-ms``).

One asyncio loop serves every proxy of a run, in a process of its own (``ProxyProcess``:
in the bench's process its loop would wait for the GIL behind the bench's consumer and add
that wait to every round trip); each connection's two directions keep their order (a chunk
leaves ``one_way_s`` after it arrived, and never before the chunk ahead of it). The proxy's
own CPU is small next to the drain's: it copies chunks, it does not parse them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit


class DelayProxies:
    """``url(original)`` -> the same URL through a proxy holding each chunk ``rtt_ms / 2``."""

    def __init__(self, rtt_ms: float) -> None:
        self.one_way_s = rtt_ms / 2000.0
        #: Chunks forwarded, per proxied port and direction ("up" to the server, "down" back):
        #: each is one write the client or the server made, so a count of round trips' halves.
        self.chunks: dict[tuple[int, str], int] = {}
        self.loop = asyncio.new_event_loop()
        self.servers: list[asyncio.base_events.Server] = []
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-delay-proxies", daemon=True)
        self.thread.start()

    def url(self, original: str) -> str:
        """Start a proxy to ``original``'s host and port; return ``original`` pointing at it."""
        parts = urlsplit(original)
        host, port = parts.hostname or "127.0.0.1", parts.port
        if port is None:
            raise ValueError(f"a delayed URL needs an explicit port: {original!r}")
        server = asyncio.run_coroutine_threadsafe(self._serve(host, port), self.loop).result(timeout=10)
        self.servers.append(server)
        local_port = server.sockets[0].getsockname()[1]
        netloc = parts.netloc.rsplit("@", 1)
        hostport = f"127.0.0.1:{local_port}"
        return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{hostport}" if len(netloc) == 2 else hostport))

    async def _serve(self, host: str, port: int) -> asyncio.base_events.Server:
        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(host, port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(self._pump(reader, up_writer, (port, "up")), self._pump(up_reader, writer, (port, "down")))

        return await asyncio.start_server(connected, "127.0.0.1", 0)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: tuple[int, str]) -> None:
        """Copy ``reader`` to ``writer``, each chunk ``one_way_s`` after it arrived, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while data := await reader.read(65536):
                self.chunks[key] = self.chunks.get(key, 0) + 1
                queue.put_nowait((time.monotonic() + self.one_way_s, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(ConnectionError, OSError):
                await sender
            writer.close()

    def close(self) -> None:
        async def stop(servers: list[Any]) -> None:
            for server in servers:
                server.close()

        asyncio.run_coroutine_threadsafe(stop(self.servers), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class ProxyProcess:
    """``DelayProxies`` in a process of its own (``python -m bench.latency``): ``url(original)``
    as there; ``chunks()`` reads its counters; ``close()`` ends it."""

    def __init__(self, rtt_ms: float, urls: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.latency", str(rtt_ms), *urls],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("bench.latency: the proxy process did not start")
        self.urls: dict[str, str] = json.loads(line)

    def url(self, original: str) -> str:
        return self.urls[original]

    def chunks(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("chunks\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main(argv: list[str]) -> int:
    """``python -m bench.latency RTT_MS URL...``: print {url: proxied url} as one JSON line,
    then answer each ``chunks`` line on stdin with the counters; end at end of input."""
    proxies = DelayProxies(float(argv[0]))
    print(json.dumps({url: proxies.url(url) for url in argv[1:]}), flush=True)
    for line in sys.stdin:
        if line.strip() == "chunks":
            print(json.dumps({f"{port} {way}": n for (port, way), n in proxies.chunks.items()}), flush=True)
    proxies.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
