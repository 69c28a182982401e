"""The storage under the state the relay's processes share (docs/internals.md, "Shared state"):
a few primitives with expiry, kept in Redis, in files of one directory, or in the process.

The policies over it (breaker, route gate, outage log, coalescer) are in ``relay.shared``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from typing import Any, Protocol

from ..core.names import is_redis_url

log = logging.getLogger("outbox.relay")


class SharedState(Protocol):
    """Keys with a time to live. A key is a string, or a map of fields (one TTL for the map)."""

    def get(self, key: str) -> str | None:
        """The value of ``key``; None when it is absent or expired."""

    def set(self, key: str, value: str, ttl_s: float) -> None:
        """Write ``key``; it expires ``ttl_s`` from now."""

    def set_if_absent(self, key: str, value: str, ttl_s: float) -> bool:
        """Write ``key`` only if no live value is there, atomically: True for the one caller that wrote it."""

    def delete(self, key: str) -> bool:
        """Remove ``key``; True when a live value was there."""

    def get_fields(self, key: str) -> dict[str, str]:
        """The fields of the map ``key``; empty when it is absent or expired."""

    def set_field(self, key: str, field: str, value: str, ttl_s: float) -> None:
        """Write one field of the map ``key``, leaving the others; the whole map expires ``ttl_s`` from now."""


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _text(raw: bytes | str) -> str:
    """A Redis reply as text (the client does not decode, so bytes in practice)."""
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw


class ProcessState:
    """In this process only (tests; Celery's in-memory broker runs in one process). Expiry on
    ``time.monotonic()``: on the wall clock, a clock stepped back an hour kept every key an hour
    longer (docs/internals.md, "Shared state")."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def _live(self, key: str, now: float) -> Any:
        item = self._items.get(key)
        if item is not None and item[0] <= now:
            del self._items[key]
            return None
        return None if item is None else item[1]

    def get(self, key: str) -> str | None:
        with self._lock:
            value = self._live(key, time.monotonic())
        return value if isinstance(value, str) else None

    def set(self, key: str, value: str, ttl_s: float) -> None:
        with self._lock:
            self._items[key] = (time.monotonic() + ttl_s, value)

    def set_if_absent(self, key: str, value: str, ttl_s: float) -> bool:
        with self._lock:
            now = time.monotonic()
            if self._live(key, now) is not None:
                return False
            self._items[key] = (now + ttl_s, value)
            return True

    def delete(self, key: str) -> bool:
        with self._lock:
            found = self._live(key, time.monotonic()) is not None
            self._items.pop(key, None)
        return found

    def get_fields(self, key: str) -> dict[str, str]:
        with self._lock:
            value = self._live(key, time.monotonic())
        return dict(value) if isinstance(value, dict) else {}

    def set_field(self, key: str, field: str, value: str, ttl_s: float) -> None:
        with self._lock:
            now = time.monotonic()
            fields = self._live(key, now)
            fields = dict(fields) if isinstance(fields, dict) else {}
            fields[field] = value
            self._items[key] = (now + ttl_s, fields)


class RedisState:
    """In Redis (the task runner's broker): every worker on every host; Redis expires the keys."""

    def __init__(self, url: str) -> None:
        from .redis_clients import relay_redis  # the redis extra; Celery's and Dramatiq's Redis brokers need it anyway

        # TLS as Celery's broker connects (docs/relay.md, "Garbage in Celery's Redis broker", TLS).
        self.client = relay_redis(url, socket_timeout=1.0, socket_connect_timeout=1.0)

    def get(self, key: str) -> str | None:
        raw = self.client.get(key)
        return None if raw is None else _text(raw)

    def set(self, key: str, value: str, ttl_s: float) -> None:
        self.client.set(key, value, px=_ms(ttl_s))

    def set_if_absent(self, key: str, value: str, ttl_s: float) -> bool:
        return bool(self.client.set(key, value, nx=True, px=_ms(ttl_s)))

    def delete(self, key: str) -> bool:
        return bool(self.client.delete(key))

    def get_fields(self, key: str) -> dict[str, str]:
        return {_text(f): _text(v) for f, v in self.client.hgetall(key).items()}

    def set_field(self, key: str, field: str, value: str, ttl_s: float) -> None:
        pipe = self.client.pipeline()
        pipe.hset(key, field, value)
        pipe.pexpire(key, _ms(ttl_s))
        pipe.execute()


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh)


class FileState:
    """One small JSON file per key in ``directory``: the worker processes of one host.

    A file holds ``{"expires": <time>, "ttl": <seconds>, "value": ...}``. Writes go to a temporary
    file that is then renamed over the key (``set``) or hard-linked to it (``set_if_absent``: the
    link fails if the key exists), so a reader never sees half a file. A value whose expiry lies
    further ahead than its TTL was written before the host's clock stepped back: it is as good as
    absent, rather than kept that much longer (docs/internals.md, "Shared state").
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def path(self, key: str) -> str:
        return os.path.join(self.directory, re.sub(r"[^A-Za-z0-9._-]", "-", key))

    def _read(self, key: str) -> Any:
        try:
            with open(self.path(key), encoding="utf-8") as fh:
                data = json.load(fh)
            left = float(data["expires"]) - time.time()
            if 0 < left <= float(data.get("ttl", left)):
                return data["value"]
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError):  # damaged: as good as absent
            pass
        return None

    def _staged(self, key: str, value: Any, ttl_s: float) -> str:
        tmp = f"{self.path(key)}.{os.getpid()}.{threading.get_ident()}"
        data = {"expires": time.time() + ttl_s, "ttl": ttl_s, "value": value}
        try:
            _write_json(tmp, data)
        except FileNotFoundError:  # a temp cleaner removed the user's directory: made again, checked
            if self.directory != private_dir():
                raise
            _write_json(tmp, data)
        return tmp

    def get(self, key: str) -> str | None:
        value = self._read(key)
        return value if isinstance(value, str) else None

    def set(self, key: str, value: Any, ttl_s: float) -> None:
        os.replace(self._staged(key, value, ttl_s), self.path(key))

    def set_if_absent(self, key: str, value: str, ttl_s: float) -> bool:
        tmp = self._staged(key, value, ttl_s)
        try:
            for _ in range(2):
                try:
                    os.link(tmp, self.path(key))
                    return True
                except FileExistsError:
                    if self._read(key) is not None:
                        return False
                    self._unlink(key)  # expired: its holder is gone
            return False
        finally:
            os.unlink(tmp)

    def _unlink(self, key: str) -> bool:
        try:
            os.unlink(self.path(key))
            return True
        except FileNotFoundError:
            return False

    def delete(self, key: str) -> bool:
        live = self._read(key) is not None
        return self._unlink(key) and live

    def get_fields(self, key: str) -> dict[str, str]:
        value = self._read(key)
        return dict(value) if isinstance(value, dict) else {}

    def set_field(self, key: str, field: str, value: str, ttl_s: float) -> None:
        # Read, change, replace: two processes writing at once may lose one field, which
        # then lives on in the process that wrote it (each process keeps its own copy).
        fields = self.get_fields(key)
        fields[field] = value
        self.set(key, fields, ttl_s)


_redis: dict[tuple[int, str], RedisState] = {}
_redis_lock = threading.Lock()


def open_shared_state(url: str) -> SharedState:
    """Where the state lives, chosen from the task runner's broker URL: Redis when it is
    Redis (one client per process and URL, so one connection pool), the process for
    ``memory://`` (a new one each call, as nothing outside it could share it), else files
    in this user's own directory of the temp directory (one host: ``private_dir``)."""
    if is_redis_url(url):
        try:
            with _redis_lock:
                key = (os.getpid(), url)
                if key not in _redis:
                    _redis[key] = RedisState(url)
                return _redis[key]
        except ImportError:
            pass
    if url.startswith("memory://"):
        return ProcessState()
    directory = private_dir()
    if directory is None:
        return ProcessState()
    return FileState(directory)


def private_dir(create: bool = True) -> str | None:
    """``outbox-<uid>`` in the temp directory, mode 0700, made if absent (``create``; else None
    when absent): where the files the processes of one host share live (``FileState``, the
    worker's stop marker), out of the reach of other local users. The temp directory must be
    one no other user can rename things in (``_unsafe``), else ``$XDG_RUNTIME_DIR`` is used on
    the same terms, else the temp directory with a warning (``_safe_base``). One that others
    may list or enter, but not write, is made 0700 (``_make_private``). None, with a warning,
    when the directory is not this user's alone (docs/internals.md, "Shared state")."""
    base = _safe_base(tempfile.gettempdir(), os.environ.get("XDG_RUNTIME_DIR", ""))
    path = os.path.join(base, f"outbox-{os.getuid()}")
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            _refused(path, f"cannot make it ({exc})")
            return None
    try:
        info = os.lstat(path)
    except FileNotFoundError:  # not made, as asked
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        _refused(path, f"not a directory only this user (uid {os.getuid()}) can write (uid {info.st_uid}, mode "
                       f"{stat.S_IMODE(info.st_mode):04o}): remove it")
        return None
    if info.st_mode & 0o077:
        why = _make_private(path, stat.S_IMODE(info.st_mode))
        if why is not None:
            _refused(path, why)
            return None
    return path


def _make_private(path: str, mode: int) -> str | None:
    """Make ``path``, this user's directory that others may list or enter but not write (so
    nothing in it can be theirs), mode 0700: None when done, else why not. Through a descriptor
    of the directory itself, checked again, never a symbolic link."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        return f"mode {mode:04o} and could not be made 0700 ({exc.strerror}): make it 0700 or remove it"
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            return f"mode {stat.S_IMODE(info.st_mode):04o}, not a directory only this user can write: remove it"
        os.fchmod(fd, 0o700)
        now = stat.S_IMODE(os.fstat(fd).st_mode)
    except OSError as exc:
        return f"mode {mode:04o} and could not be made 0700 ({exc.strerror}): make it 0700 or remove it"
    finally:
        os.close(fd)
    if now & 0o077:  # a file system that keeps its own modes
        return f"mode {mode:04o} and could not be made 0700 (it is {now:04o} after chmod): make it 0700 or remove it"
    log.info("outbox: made %s mode 0700 (it was %04o: others could list it)", path, mode)
    return None


#: ``_safe_base``'s verdicts: no other user can change one (``_unsafe``), and the stop marker's
#: look-up asks at every task (a check of the whole path took 80 us).
_bases: dict[tuple[str, str], str] = {}


def _safe_base(temp: str, runtime: str) -> str:
    """The real path of ``temp``, else of ``runtime`` ($XDG_RUNTIME_DIR), that ``_unsafe``
    passes; when neither does, ``temp``'s all the same, with a warning: a container's scratch
    ``/tmp`` (Kubernetes' emptyDir: mode 0777, not sticky) has no other user to fear, and its
    workers need the shared state (docs/internals.md, "Shared state")."""
    if (temp, runtime) not in _bases:
        base = os.path.realpath(temp)  # no symbolic link left to swap
        why = _unsafe(base)
        if why is not None:
            if runtime and _unsafe(os.path.realpath(runtime)) is None:
                base = os.path.realpath(runtime)
            else:
                log.warning("outbox: %s is not safe for this user's files (%s): another local user could "
                            "swap outbox-%d for a directory of their own; used all the same (set TMPDIR or "
                            "XDG_RUNTIME_DIR to a directory of your own)", base, why, os.getuid())
        _bases[(temp, runtime)] = base
    return _bases[(temp, runtime)]


def _unsafe(path: str) -> str | None:
    """Why another local user could rename or replace what lies in ``path`` (an absolute path
    without symbolic links), or None: each directory from the root down must belong to root or
    this user, and be writable by no one else or sticky. Checked once, ``outbox-<uid>`` can then
    neither be swapped for another directory nor moved away (docs/internals.md, "Shared state")."""
    uid, current = os.getuid(), os.sep
    for part in ["", *[p for p in path.split(os.sep) if p]]:
        current = os.path.join(current, part)
        try:
            info = os.lstat(current)
        except OSError as exc:
            return f"{current}: {exc.strerror}"
        if not stat.S_ISDIR(info.st_mode):
            return f"{current} is not a directory"
        if info.st_uid not in (0, uid):
            return f"{current} belongs to uid {info.st_uid}"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return f"{current} is writable by others and not sticky"
    return None


_refusals: set[str] = set()


def _refused(path: str, why: str) -> None:
    if path not in _refusals:  # once per process: the stop marker asks at every task
        _refusals.add(path)
        log.warning("outbox: %s is %s; each process keeps its shared state alone and pool processes "
                    "are not told of a warm shutdown", path, why)


__all__ = ["SharedState", "ProcessState", "RedisState", "FileState", "open_shared_state", "private_dir"]
