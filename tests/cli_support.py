"""The ``outbox`` command run as a user runs it, in a child process (tests/test_cli.py,
test_cli_requeue.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def run(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "outbox.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout)


@contextmanager
def silent_server(accepted: list[socket.socket] | None = None) -> Iterator[int]:
    """A local port whose server accepts every connection and never sends a byte (a
    PostgreSQL port to a MySQL client, a hung process): yields the port. The connections it
    accepted go to ``accepted`` when given."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    accepted = [] if accepted is None else accepted

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:  # the listener closed: the test is over
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
        for sock in accepted:
            sock.close()
