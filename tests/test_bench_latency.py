"""``bench.latency``'s proxies: no added delay at a round trip of 0, the delay as before above it,
and the cut (``--faults`` of ``bench.soak``): live connections reset, new ones refused for the
cut's seconds, then accepted again. In process against a local echo server, and once for real:
a ``ProxyProcess`` in front of Redis."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest
from services import REDIS_URL, require

from bench.latency import DelayProxies, ProxyProcess, Route, answer


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):  # the proxy's cut resets this side too
            while data := self.request.recv(65536):
                self.request.sendall(data)


@pytest.fixture
def echo_url() -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"tcp://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def round_trip(sock: socket.socket, data: bytes = b"ping") -> float:
    started = time.perf_counter()
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(65536)
        assert chunk, "closed"
        got += chunk
    assert got == data
    return time.perf_counter() - started


def refused(port: int) -> bool:
    """A connection the proxy accepts and resets at once: the connect, the first write or the
    first read fails, or the read sees the end (the reset can come before ``connect`` returns)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"ping")
            return sock.recv(100) == b""
    except ConnectionError:
        return True


def test_a_route_is_named_by_its_url_or_either_port() -> None:
    route = Route("redis://127.0.0.1:6379/13", "127.0.0.1", 6379, local_port=40001)
    assert route.matches("redis://127.0.0.1:6379/13") and route.matches("6379") and route.matches("40001")
    assert route.matches("redis://127.0.0.1:40001/13") and not route.matches("5432")
    assert not route.matches("amqp://guest:guest@127.0.0.1:5672//")


def test_no_delay_at_zero_and_half_a_round_trip_each_way_above(echo_url: str) -> None:
    for rtt_ms, low, high in ((0.0, 0.0, 0.05), (100.0, 0.1, 1.0)):
        proxies = DelayProxies(rtt_ms)
        try:
            with socket.create_connection(("127.0.0.1", port_of(proxies.url(echo_url))), timeout=5) as sock:
                best = min(round_trip(sock) for _ in range(5))
            assert low <= best < high, (rtt_ms, best)
            assert proxies.chunks == {(port_of(echo_url), "up"): 5, (port_of(echo_url), "down"): 5}
        finally:
            proxies.close()


def test_a_cut_resets_the_live_connections_refuses_new_ones_then_accepts(echo_url: str) -> None:
    proxies = DelayProxies(0.0)
    try:
        port = port_of(proxies.url(echo_url))
        live = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        for sock in live:
            round_trip(sock)
        assert proxies.cut(echo_url, 1.0) == 2
        for sock in live:
            with pytest.raises(ConnectionResetError):  # a reset, not an orderly end of stream
                sock.sendall(b"ping")
                sock.recv(100)
            sock.close()
        assert refused(port)
        time.sleep(1.1)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            round_trip(sock)
            assert proxies.cut(str(port), 0.0) == 1 and proxies.routes[0].links == set()
    finally:
        proxies.close()


def test_the_command_protocol(echo_url: str) -> None:
    proxies = DelayProxies(0.0)
    try:
        proxies.url(echo_url)
        assert answer(proxies, "chunks\n") == {}
        assert answer(proxies, f"cut {echo_url} 0.5\n") == {"reset": 0}
        assert answer(proxies, "cut 1 0.5\n") == {"error": "no proxy for '1'"}
        assert "error" in (answer(proxies, "cut 1 soon\n") or {})
        assert answer(proxies, "\n") is None
    finally:
        proxies.close()


def test_a_proxy_process_in_front_of_redis_cuts_for_real() -> None:
    require("Redis", "127.0.0.1", 6379)
    proxies = ProxyProcess(0.0, [REDIS_URL])
    try:
        port = port_of(proxies.url(REDIS_URL))
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"PING\r\n")
        assert sock.recv(100) == b"+PONG\r\n"
        assert proxies.cut(REDIS_URL, 1.5) == 1
        with pytest.raises(ConnectionResetError):
            sock.sendall(b"PING\r\n")
            sock.recv(100)
        sock.close()
        assert refused(port)
        deadline = time.monotonic() + 10
        while True:  # the cut ends 1.5 s after it began: Redis answers again through the proxy
            time.sleep(0.25)
            with contextlib.suppress(ConnectionError), socket.create_connection(("127.0.0.1", port), timeout=5) as again:
                again.sendall(b"PING\r\n")
                if again.recv(100) == b"+PONG\r\n":
                    break
            assert time.monotonic() < deadline, "the proxy still refuses 10 s after a 1.5 s cut"
        with pytest.raises(KeyError):
            proxies.cut("9", 1.0)
    finally:
        proxies.close()
