"""A database and a broker at a distance: TCP proxies on 127.0.0.1 that hold every chunk of
data for half a round trip each way, so a bench run can measure the relay where round
trips, not the machine's cores, bound a worker (``python -m bench.drain --rtt-ms``); and that
can cut, so a bench run can watch the relay live through network blips (``python -m bench.soak
--faults``).

One asyncio loop serves every proxy of a run, in a process of its own (``ProxyProcess``:
in the bench's process its loop would wait for the GIL behind the bench's consumer and add
that wait to every round trip); each connection's two directions keep their order (a chunk
leaves ``one_way_s`` after it arrived, and never before the chunk ahead of it; with a round
trip of 0 each chunk is written on as it is read, no queue, no timer). The proxy's own CPU is
small next to the drain's: it copies chunks, it does not parse them.

A cut (``DelayProxies.cut``, ``ProxyProcess.cut``) resets every live connection through one
proxy, both sides, and for the cut's seconds resets every new one as soon as it is accepted;
then the proxy accepts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit


@dataclass
class Route:
    """One proxy: ``original`` (a URL) reached through ``local_port``; its live connections
    (client side, server side) and until when (``time.monotonic()``) it refuses new ones."""

    original: str
    host: str
    port: int
    local_port: int = 0
    links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = field(default_factory=set)
    refuse_until: float = 0.0

    def matches(self, target: str) -> bool:
        """``target`` names this proxy: its original URL, its port or the proxy's own (a bare
        number or in a URL)."""
        if target == self.original:
            return True
        port = int(target) if target.isdigit() else urlsplit(target).port
        return port in (self.port, self.local_port)

    def refusing(self) -> bool:
        return time.monotonic() < self.refuse_until


def reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with a reset (RST), not a FIN: the proxy's cut stands for a network
    blip (a middlebox or peer that lost the connection's state), which a client sees as
    ``ECONNRESET`` on its next read or write, an error, rather than as the orderly close a FIN
    would make of it (a server that hung up, which clients take on another path). Both
    servers and clients drop the connection at once, the proxy keeps nothing in TIME_WAIT,
    and whatever either side had in flight is lost, as in a real cut. (A silent cut, where
    packets vanish and only keepalives or timeouts notice, is another fault: not this one.)"""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class DelayProxies:
    """``url(original)`` -> the same URL through a proxy holding each chunk ``rtt_ms / 2`` (none
    at 0); ``cut(target, seconds)`` cuts one of them."""

    def __init__(self, rtt_ms: float) -> None:
        self.one_way_s = rtt_ms / 2000.0
        #: Chunks forwarded, per proxied port and direction ("up" to the server, "down" back):
        #: each is one write the client or the server made, so a count of round trips' halves.
        self.chunks: dict[tuple[int, str], int] = {}
        self.loop = asyncio.new_event_loop()
        self.servers: list[asyncio.base_events.Server] = []
        self.routes: list[Route] = []
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-delay-proxies", daemon=True)
        self.thread.start()

    def url(self, original: str) -> str:
        """Start a proxy to ``original``'s host and port; return ``original`` pointing at it."""
        parts = urlsplit(original)
        host, port = parts.hostname or "127.0.0.1", parts.port
        if port is None:
            raise ValueError(f"a delayed URL needs an explicit port: {original!r}")
        route = Route(original, host, port)
        server = asyncio.run_coroutine_threadsafe(self._serve(route), self.loop).result(timeout=10)
        self.servers.append(server)
        route.local_port = server.sockets[0].getsockname()[1]
        self.routes.append(route)
        netloc = parts.netloc.rsplit("@", 1)
        hostport = f"127.0.0.1:{route.local_port}"
        return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{hostport}" if len(netloc) == 2 else hostport))

    def cut(self, target: str, seconds: float) -> int:
        """Reset every live connection through the proxy ``target`` names (``Route.matches``)
        and every new one for ``seconds``; returns how many live ones were reset."""
        route = next((r for r in self.routes if r.matches(target)), None)
        if route is None:
            raise KeyError(f"no proxy for {target!r}")

        async def cut() -> int:
            route.refuse_until = time.monotonic() + seconds
            links, route.links = route.links, set()
            for link in links:
                for writer in link:
                    reset(writer)
            return len(links)

        return asyncio.run_coroutine_threadsafe(cut(), self.loop).result(timeout=10)

    async def _serve(self, route: Route) -> asyncio.base_events.Server:
        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if route.refusing():
                reset(writer)
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(route.host, route.port)
            except OSError:
                writer.close()
                return
            if route.refusing():  # cut while this one was connecting: it must not outlive the cut
                reset(writer)
                reset(up_writer)
                return
            link = (writer, up_writer)
            route.links.add(link)
            try:
                await asyncio.gather(self._pump(reader, up_writer, (route.port, "up")),
                                     self._pump(up_reader, writer, (route.port, "down")))
            finally:
                route.links.discard(link)

        return await asyncio.start_server(connected, "127.0.0.1", 0)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: tuple[int, str]) -> None:
        """Copy ``reader`` to ``writer``, each chunk ``one_way_s`` after it arrived (at once at
        0), in order."""
        if self.one_way_s <= 0:
            await self._copy(reader, writer, key)
        else:
            await self._copy_delayed(reader, writer, key)

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: tuple[int, str]) -> None:
        try:
            while data := await reader.read(65536):
                self.chunks[key] = self.chunks.get(key, 0) + 1
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _copy_delayed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            key: tuple[int, str]) -> None:
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
            # The connections still open end with the proxy (their tasks too, not left pending).
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(self.servers), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class ProxyProcess:
    """``DelayProxies`` in a process of its own (``python -m bench.latency``): ``url(original)``
    as there; ``chunks()`` reads its counters; ``cut(target, seconds)`` cuts one proxy (returns
    how many live connections it reset); ``close()`` ends it. ``pid``: the process's (its
    sockets tell which server connections are whose)."""

    def __init__(self, rtt_ms: float, urls: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.latency", str(rtt_ms), *urls],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.lock = threading.Lock()  # one question and its answer at a time
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("bench.latency: the proxy process did not start")
        self.urls: dict[str, str] = json.loads(line)

    def url(self, original: str) -> str:
        return self.urls[original]

    def _ask(self, line: str) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"bench.latency: the proxy process ended (exit code {self.proc.poll()})")
        return json.loads(answer)

    def chunks(self) -> dict[str, int]:
        return dict(self._ask("chunks"))

    def cut(self, target: str, seconds: float) -> int:
        """Cut the proxy ``target`` names (its original URL, or a port: ``Route.matches``)."""
        answer = self._ask(f"cut {target} {seconds:g}")
        if "error" in answer:
            raise KeyError(answer["error"])
        return int(answer["reset"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def answer(proxies: DelayProxies, line: str) -> dict[str, Any] | None:
    """The JSON answer to one command line: ``chunks`` (the counters), ``cut TARGET SECONDS``
    (``{"reset": n}``, or ``{"error": ...}`` for a target no proxy matches); None: no command."""
    words = line.split()
    if words == ["chunks"]:
        return {f"{port} {way}": n for (port, way), n in proxies.chunks.items()}
    if len(words) == 3 and words[0] == "cut":
        try:
            return {"reset": proxies.cut(words[1], float(words[2]))}
        except (KeyError, ValueError) as exc:
            return {"error": str(exc.args[0]) if exc.args else repr(exc)}
    return None


def main(argv: list[str]) -> int:
    """``python -m bench.latency RTT_MS URL...``: print {url: proxied url} as one JSON line,
    then answer each command line on stdin (``answer``) with one JSON line; end at end of input."""
    proxies = DelayProxies(float(argv[0]))
    print(json.dumps({url: proxies.url(url) for url in argv[1:]}), flush=True)
    for line in sys.stdin:
        reply = answer(proxies, line)
        if reply is not None:
            print(json.dumps(reply), flush=True)
    proxies.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
