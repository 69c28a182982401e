"""A TLS front for the local RabbitMQ, signed by a throwaway CA (``trustme``): what the tests of
``amqps://`` (tests/test_amqp_tls.py) connect to. The proxy ends TLS with a certificate for the
names it is given, may require a client certificate signed by the same CA, and passes the
bytes on to RabbitMQ's plain port."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

from publisher_support import amqp_hostport


class Pki:
    """A throwaway CA and the files of what it signs, in ``where``."""

    def __init__(self, where: Path) -> None:
        import trustme

        self.where = where
        self.ca = trustme.CA()
        self.ca_file = where / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))

    def issue(self, name: str, *hosts: str) -> tuple[Path, Path]:
        """A certificate for ``hosts`` (its chain file, its key file), named ``name`` on disk."""
        cert = self.ca.issue_cert(*hosts)
        chain, key = self.where / f"{name}.pem", self.where / f"{name}.key"
        chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(str(key))
        return chain, key


class TlsProxy:
    """TLS on a free local port in front of RabbitMQ (or ``target``, host and port). ``hosts``:
    the names its certificate carries; ``client_ca``: require a client certificate that this CA
    signed. ``peers``: the subject of each client certificate presented, in order (None: none
    presented)."""

    def __init__(self, pki: Pki, *hosts: str, client_ca: Path | None = None,
                 target: tuple[str, int] | None = None) -> None:
        self.target = target
        chain, key = pki.issue(f"server-{'-'.join(hosts)}", *hosts)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(str(chain), str(key))
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(str(client_ca))
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.peers: list[Any] = []
        self.handshakes_failed = 0
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, host: str = "localhost", **query: str) -> str:
        """RabbitMQ's ``amqps://`` URL through the proxy, with ``query`` as its parameters."""
        params = "&".join(f"{k}={v}" for k, v in query.items())
        return f"amqps://guest:guest@{host}:{self.port}//" + (f"?{params}" if params else "")

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(10)
        try:
            tls = self.context.wrap_socket(client, server_side=True)
        except (OSError, ssl.SSLError):
            self.handshakes_failed += 1
            client.close()
            return
        cert = tls.getpeercert()
        self.peers.append(dict(item[0] for item in cert["subject"]) if cert else None)
        tls.settimeout(None)
        upstream = socket.create_connection(self.target or amqp_hostport(), timeout=10)
        upstream.settimeout(None)
        self.sockets += [tls, upstream]
        threading.Thread(target=self._pump, args=(upstream, tls), daemon=True).start()
        self._pump(tls, upstream)

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        for sock in (source, target):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Down: connections refused from now on, those made cut."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone leaves it listening)
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()
