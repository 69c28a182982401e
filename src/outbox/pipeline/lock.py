"""One archive run at a time: an exclusive lock per archive, held by the run's own
session of the outbox database, so it ends when its holder does (docs/pipeline.md,
"One run at a time", says why the lock lives in the database and not in the archive).

The lock's statements are the engine's (``Engine.session_lock_statements``: PostgreSQL's
``pg_try_advisory_lock``, MySQL/MariaDB's ``GET_LOCK``, SQL Server's ``sp_getapplock``
owned by the session), on a connection of its own that the run keeps open. SQLite has
no sessions: an OS lock (``flock``) on a file beside the database, which the kernel
releases when the process ends. No Spark here: the archive's name comes in as a string.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from typing import Any

from ..core.config import session_bounds
from ..storage.engines.sqlite import sqlite_path
from ..storage.store import OutboxStore
from .common import PipelineError

log = logging.getLogger("outbox.pipeline.lock")

#: Seconds between two pings of the lock's connection: they keep it from looking idle to
#: the server (MySQL's ``wait_timeout`` is the relay's 5 s bound, docs/relay.md, "A network
#: cut"). Whether the lock is still held is asked live by ``check``, not read from them.
PING_EVERY_S = 2.0


def idle_bound_s(url: str) -> int:
    """A server that ends silent sessions may end the lock's when it is silent this long:
    the time TCP takes to find a silent peer (``tcp_timeout_s``), and at least three pings."""
    return max(session_bounds(url)["tcp_timeout_s"], int(3 * PING_EVERY_S))


def lock_name(archive: str) -> str:
    """The lock's name for an archive (its key: the archive's id): a digest, so that any key fits
    GET_LOCK's 64 characters and sp_getapplock's 255."""
    return "outbox archive " + hashlib.sha1(archive.encode("utf-8")).hexdigest()


class ArchiveLock:
    """The exclusive lock of one archive. ``try_acquire`` takes it or says it is held;
    ``check`` raises when the session holding it has ended; ``release`` gives it back."""

    def __init__(self, store: OutboxStore, archive: str, key: str | None = None) -> None:
        self.store = store
        self.archive = archive  # as messages name it
        self.name = lock_name(key or archive)
        self._conn: Any = None
        self._file: Any = None
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._pinger: threading.Thread | None = None
        self._lost: str | None = None
        self._lock_path = ""

    # -- taking it -----------------------------------------------------------------------
    def try_acquire(self) -> bool:
        statements = self.store.engine.session_lock_statements(self.name, idle_bound_s(self.store.url))
        if statements is None:
            return self._flock()
        conn = self.store.engine.connect(self.store.url)
        try:
            for statement in statements[:-1]:
                self._statement(conn, statement)
            granted = self._statement(conn, statements[-1], first=True)
        except BaseException:
            self._close(conn)
            raise
        if not granted:
            self._close(conn)
            return False
        self._conn = conn
        self._pinger = threading.Thread(target=self._ping, name="outbox-archive-lock", daemon=True)
        self._pinger.start()
        return True

    def _statement(self, conn: Any, sql: tuple[str, list[Any]], *, first: bool = False, answer: bool = False) -> Any:
        """Run one statement on the lock's connection and commit at once: the session holds
        the lock, never a transaction (the server ends a session idle in one). ``first``:
        the taking statement's row says whether the lock was granted; ``answer``: the row
        is a yes or no (``session_lock_held_statement``)."""
        cursor = conn.cursor()
        try:
            self.store.engine.execute(cursor, sql[0], sql[1])
            value = None
            if first:
                value = self.store.engine.session_lock_granted(cursor.fetchone()[0])
            elif answer:
                row = cursor.fetchone()
                value = row is not None and row[0] is not None and bool(int(row[0]))
        finally:
            cursor.close()
        conn.commit()
        return value

    def _flock(self) -> bool:
        path = sqlite_path(self.store.url)
        if path == ":memory:":
            return True  # a database of this process alone: no other run can reach it
        lock_path = f"{os.path.abspath(path)}-archive-{self.name.rsplit(' ', 1)[1][:12]}.lock"
        handle = open(lock_path, "a+")  # noqa: SIM115 - held open for as long as the lock
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        self._file = handle
        self._lock_path = lock_path
        return True

    # -- holding it ----------------------------------------------------------------------
    def _ping(self) -> None:
        while not self._stop.wait(PING_EVERY_S):
            with self._guard:
                if self._conn is None:
                    return
                try:
                    self._statement(self._conn, ("SELECT 1", []))
                except Exception as exc:  # noqa: BLE001 - any failure means the session, and its lock, may be gone
                    self._lost = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                    return

    def check(self, before: str) -> None:
        """Raise ``PipelineError`` when this run no longer holds the lock, asked now (the
        lock's session, or the lock file): another run may hold it, so this one stops
        ``before`` its next step. A live answer, not the last ping's, which may be two
        seconds old (docs/pipeline.md, "One run at a time")."""
        lost = self._lost_now()
        if lost is not None:
            raise PipelineError(f"lost the lock of the archive {self.archive} ({lost}); stopped before {before}: "
                                "run again")

    def _lost_now(self) -> str | None:
        """Why the lock is no longer held, or None while it is."""
        if self._file is not None:
            # The flock lives as long as the open file; a lock file removed (and made again by
            # another run, which then holds a lock of its own on it) is no longer this lock.
            try:
                here, there = os.fstat(self._file.fileno()), os.stat(self._lock_path)
            except FileNotFoundError:
                return f"its lock file {self._lock_path} was removed"
            if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
                return f"its lock file {self._lock_path} was replaced"
            return None
        with self._guard:
            if self._lost is None and self._conn is not None:
                try:
                    if not self._statement(self._conn, self.store.engine.session_lock_held_statement(self.name),
                                           answer=True):
                        return "its database session no longer holds it"
                except Exception as exc:  # noqa: BLE001 - any failure means the session, and its lock, may be gone
                    self._lost = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return None if self._lost is None else f"its database session ended: {self._lost}"

    # -- giving it back ------------------------------------------------------------------
    def release(self) -> None:
        self._stop.set()
        if self._pinger is not None:
            self._pinger.join(PING_EVERY_S * 2)
        with self._guard:
            conn, self._conn = self._conn, None
        if conn is not None:
            try:
                self._statement(conn, self.store.engine.session_unlock_statement(self.name))
            except Exception:  # closing the session below releases it anyway
                log.debug("outbox: cannot release the archive lock; closing its session", exc_info=True)
            self._close(conn)
        if self._file is not None:
            self._file.close()  # closing the file releases its flock
            self._file = None

    @staticmethod
    def _close(conn: Any) -> None:
        try:
            conn.close()
        except Exception:  # a broken connection is closed as far as it goes
            log.debug("outbox: cannot close the archive lock's connection", exc_info=True)
