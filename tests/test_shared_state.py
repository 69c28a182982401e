"""The shared-state primitives (``outbox.relay.state``), the same tests over every backend:
in the process, in files of a directory, in a real Redis; and the breaker shared through
them. The other policies over them (route gate, outage log, coalescer) are tested in
tests/test_route_backpressure.py, tests/test_claim.py and tests/test_wake.py."""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from services import REDIS_URL, reachable, require

import outbox.celery.worker as w
from outbox.relay import Breaker, FileState, ProcessState, RedisState, SharedState, make_coalescer, open_shared_state


@pytest.fixture(params=["process", "file", "redis"])
def state(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SharedState]:
    if request.param == "process":
        yield ProcessState()
    elif request.param == "file":
        yield FileState(str(tmp_path))
    else:
        require("Redis", "127.0.0.1", 6379)
        yield RedisState(REDIS_URL)


@pytest.fixture
def key() -> str:
    return f"outbox-test:{uuid.uuid4().hex[:12]}"


def test_set_get_delete(state: SharedState, key: str) -> None:
    assert state.get(key) is None
    state.set(key, "one", 30)
    assert state.get(key) == "one"
    state.set(key, "two", 30)
    assert state.get(key) == "two"
    assert state.delete(key) is True
    assert state.get(key) is None
    assert state.delete(key) is False


def test_values_expire(state: SharedState, key: str) -> None:
    state.set(key, "soon gone", 0.2)
    assert state.set_if_absent(key + ":nx", "x", 0.2) is True
    state.set_field(key + ":map", "f", "v", 0.2)
    time.sleep(0.3)
    assert state.get(key) is None
    assert state.get_fields(key + ":map") == {}
    assert state.delete(key + ":nx") is False  # expired: nothing live to delete
    assert state.set_if_absent(key + ":nx", "again", 30) is True
    state.delete(key + ":nx")


def test_set_if_absent_lets_one_caller_in(state: SharedState, key: str) -> None:
    assert state.set_if_absent(key, "first", 30) is True
    assert state.set_if_absent(key, "second", 30) is False
    assert state.get(key) == "first"
    assert state.delete(key) is True
    assert state.set_if_absent(key, "third", 30) is True
    state.delete(key)


def test_set_if_absent_is_atomic_across_threads(state: SharedState, key: str) -> None:
    wins: list[bool] = []
    start = threading.Barrier(8)

    def race() -> None:
        start.wait()
        wins.append(state.set_if_absent(key, threading.current_thread().name, 30))

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == [False] * 7 + [True]
    state.delete(key)


def test_map_fields_are_written_one_at_a_time(state: SharedState, key: str) -> None:
    assert state.get_fields(key) == {}
    state.set_field(key, "orders.a", "1", 30)
    state.set_field(key, "orders.b", "2", 30)
    state.set_field(key, "orders.a", "3", 30)
    assert state.get_fields(key) == {"orders.a": "3", "orders.b": "2"}
    assert state.delete(key) is True
    assert state.get_fields(key) == {}


def _acquire(url: str, directory: str, key: str, wins: multiprocessing.Queue[bool]) -> None:
    state = FileState(directory) if url == "file" else open_shared_state(url)
    wins.put(state.set_if_absent(key, "x", 30))


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_file_and_redis_are_shared_between_processes(backend: str, tmp_path: Path, key: str) -> None:
    if backend == "redis":
        require("Redis", "127.0.0.1", 6379)
    url = REDIS_URL if backend == "redis" else "file"
    wins: multiprocessing.Queue[bool] = multiprocessing.get_context("spawn").Queue()
    procs = [multiprocessing.get_context("spawn").Process(target=_acquire, args=(url, str(tmp_path), key, wins))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(wins.get(timeout=5) for _ in procs) == [False, False, True]
    state = FileState(str(tmp_path)) if backend == "file" else RedisState(REDIS_URL)
    assert state.delete(key) is True


def test_the_url_chooses_the_backend(tmp_path: Path) -> None:
    assert isinstance(open_shared_state("memory://"), ProcessState)
    assert isinstance(open_shared_state("amqp://guest@localhost//"), FileState)
    assert isinstance(open_shared_state("redis://127.0.0.1:6379/7"), RedisState)
    # Two objects of one URL share a token (files of one host); memory:// keeps one per object.
    key = f"outbox-test:{uuid.uuid4().hex[:12]}"
    one, two = make_coalescer("amqp://x//", key, 30), make_coalescer("amqp://x//", key, 30)
    assert one.acquire() is True and two.acquire() is False
    one.clear()
    assert two.acquire() is True
    two.clear()
    assert make_coalescer("memory://", key, 30).acquire() and make_coalescer("memory://", key, 30).acquire()


# -- the breaker, shared between instances -------------------------------------------------

def test_file_breaker_is_shared_between_instances(tmp_path: Path) -> None:
    one, two = Breaker(FileState(str(tmp_path)), "outbox:breaker:t"), Breaker(FileState(str(tmp_path)), "outbox:breaker:t")
    assert one.open_for() == 0 and two.open_for() == 0
    one.trip(30, "backpressure: down")
    two._checked = 0  # skip the read cache
    assert two.open_for() > 29 and two.reason == "backpressure: down"
    two.reset()
    one._until, one._checked = 0, 0
    assert one.open_for() == 0


def test_redis_breaker_is_shared_and_expires() -> None:
    if not reachable("127.0.0.1", 6379):
        pytest.skip("Redis is not reachable on 127.0.0.1:6379")
    import uuid

    key = f"outbox:breaker:test-{uuid.uuid4().hex}"
    one, two = Breaker(RedisState(REDIS_URL), key), Breaker(RedisState(REDIS_URL), key)
    try:
        one.trip(0.5, "backpressure: down")
        assert 0 < two.open_for() <= 0.5 and two.reason == "backpressure: down"
        time.sleep(0.6)
        three = Breaker(RedisState(REDIS_URL), key)
        assert three.open_for() == 0 and one.state.client.get(key) is None
    finally:
        one.reset()


def test_a_pause_shared_by_a_host_whose_clock_runs_ahead_lasts_no_longer_than_itself(state: SharedState,
                                                                                     key: str) -> None:
    """Pauses are shared as the instant they end; a host whose clock is 120 s ahead tripped
    a 5 s pause, which another host read as 125 s (and released its rows for as long).
    Each pause now lasts at most its own length on every host."""
    from outbox.relay import RouteGate

    ahead = time.time() + 120
    Breaker(state, key).trip(5, "backpressure: blocked", now=ahead)
    assert 4 < Breaker(state, key).open_for() <= 5
    RouteGate(state, key + ":routes").refuse("orders.created", 2, 60, now=ahead)
    assert 1 < RouteGate(state, key + ":routes").paused("orders.created") <= 2


def test_a_pause_lasts_no_longer_than_itself_when_this_hosts_clock_steps_back(state: SharedState, key: str) -> None:
    """Each process keeps its pauses as the wall-clock instant they end. NTP stepping the host's
    clock back an hour (a restored VM, a host that booted ahead) during a 5 s back-pressure pause
    left that process paused for an hour: it claimed nothing, released every row in hand with an
    hour's delay (next_retry_at an hour ahead in the table), and no longer read the pauses other
    processes shared. A route's pause likewise. Each now lasts at most its own length from now,
    and a step back takes the shared state up again."""
    from outbox.relay import RouteGate

    now = time.time()
    breaker = Breaker(state, key)
    breaker.trip(5, "backpressure: blocked", now=now)
    assert 4 < breaker.open_for(now=now - 3600) <= 5
    routes = RouteGate(state, key + ":routes")
    routes.refuse("orders.created", 2, 60, now=now)
    assert 1 < routes.paused("orders.created", now=now - 3600) <= 2

    # Stepped back, this process still reads what another process shares (not only after an hour).
    stepped = Breaker(state, key + ":2")
    assert stepped.open_for(now=now) == 0
    Breaker(state, key + ":2").trip(30, "backpressure: blocked", now=now)
    assert 29 < stepped.open_for(now=now - 3600) <= 30


class SteppedClock:
    """``time`` as ``outbox.relay.state`` reads it, the wall clock stepped by hand."""

    def __init__(self) -> None:
        self.wall, self.mono = time.time(), time.monotonic()

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def passes(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


@pytest.mark.parametrize("backend", ["process", "file"])
def test_a_step_back_of_the_clock_keeps_no_value_of_the_process_or_the_hosts_files_longer(
        backend: str, tmp_path: Path, key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis expires its keys by its own clock; the process's and the host's files expired them by
    the wall clock, so a 5 s pause written before a step back of an hour was read back, as a pause
    of its length from now, for the whole hour. Now it lasts no longer than its length (the files
    drop a value written before the step, whose expiry lies further ahead than its TTL)."""
    import outbox.relay.state as state_module

    clock = SteppedClock()
    monkeypatch.setattr(state_module, "time", clock)
    state: SharedState = ProcessState() if backend == "process" else FileState(str(tmp_path))
    Breaker(state, key).trip(5, "backpressure: blocked", now=clock.wall)
    state.set(key + ":token", "1", 5)
    clock.wall -= 3600
    breaker = Breaker(state, key)
    assert breaker.open_for(now=clock.wall) <= 5
    clock.passes(6)
    assert breaker.open_for(now=clock.wall) == 0
    assert state.get(key + ":token") is None and state.set_if_absent(key + ":token", "2", 5)


def test_expired_claims_are_said_once_they_go_on_for_ten_intervals_and_not_for_a_queued_burst(
        caplog: pytest.LogCaptureFixture) -> None:
    """``LateClaims``: a worker host whose clock runs ahead of the scheduler's drops every tick
    as expired, which was a DEBUG line each (tests/test_relay_e2e.py runs the workers). A burst of
    ticks queued while the workers were down, taken in a moment, says nothing; drops going on for
    ten claim intervals (at least 10 s) with none in time say one WARNING, and the first claim in
    time after it one INFO line."""
    import logging

    from outbox.relay.shared import LateClaims

    late = LateClaims(logging.getLogger("outbox.test"), claim_interval_s=0.5)
    assert late.window_s == 10.0
    with caplog.at_level(logging.INFO, logger="outbox.test"):
        for n in range(100):  # a full claim queue after an outage, taken in 2 s
            late.dropped(40.0, now=1000.0 + n * 0.02)
        late.in_time()
        assert not caplog.records
        for n in range(25):  # a clock 120 s ahead: every tick, every 0.5 s
            late.dropped(90.0, now=2000.0 + n * 0.5)
        assert [r.getMessage() for r in caplog.records] == [
            "outbox: every claim tick and claim request that reached this worker for 10 s had expired (the last "
            "90 s past its expiry, by this host's clock) and was dropped: rows are claimed here on post-commit "
            "wake-ups only. Unless old ticks that waited in the claim queue are being worked off, this host's clock "
            "is ahead of the scheduler's by more than the ticks' expiry (30 s at least): synchronise the clocks "
            "(NTP). Docs: relay.md, \"Ticks, expiry and clocks\""]
        assert caplog.records[0].levelno == logging.WARNING
        late.in_time()
        late.in_time()
        assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
    assert LateClaims(logging.getLogger("outbox.test"), claim_interval_s=5).window_s == 50.0


def test_files_of_one_host_live_where_no_other_user_can_write(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """In the world-writable temp directory any local user could write the relay's files: a
    breaker open for good, a claim always "requested", a stop marker that halts a worker's
    pool (found in review: ``touch /tmp/outbox-worker-stopping-<pid>`` by user nobody stalled
    a root worker's delivery). They live in the user's own ``outbox-<uid>``, mode 0700."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tmp_path.chmod(0o1777)
    state = open_shared_state("amqp://guest@localhost//")
    assert isinstance(state, FileState)
    for directory in (Path(state.directory), w._stopping_marker(1, create=True).parent):
        info = directory.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.getuid(), 0o700), directory


def test_a_directory_another_user_could_write_is_not_trusted(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone else's ``outbox-<uid>`` (or one others may write) is refused: the processes keep
    their state alone, and a marker placed there stops nothing."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    squatted = tmp_path / f"outbox-{os.getuid()}"
    squatted.mkdir()
    squatted.chmod(0o777)
    (squatted / "outbox-worker-stopping-1").touch()
    assert isinstance(open_shared_state("amqp://guest@localhost//"), ProcessState)
    monkeypatch.setattr(w, "_parent_pid", 1)
    assert w.stopping() is False


def test_the_users_directory_others_may_list_is_made_private_or_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: an ``outbox-<uid>`` of this user at mode 0755 (made by hand, or by a
    ``mkdir`` under umask 022) was used as it was, so any local user could list it and read the
    state's files (the breaker's reason, the stop markers). It is made 0700 now; when it cannot
    be (a file system that ignores the mode), it is refused with a warning naming it and its
    mode. One others may write stays refused: its files may be theirs."""
    import outbox.relay.state as state_module

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(state_module, "_refusals", set())
    tmp_path.chmod(0o1777)
    listed = tmp_path / f"outbox-{os.getuid()}"
    listed.mkdir()
    listed.chmod(0o755)
    assert state_module.private_dir() == str(listed)
    assert stat.S_IMODE(listed.stat().st_mode) == 0o700
    state = open_shared_state("amqp://guest@localhost//")
    assert isinstance(state, FileState) and state.directory == str(listed)

    listed.chmod(0o750)
    monkeypatch.setattr(state_module.os, "fchmod", lambda fd, mode: None)  # a mode the file system ignores
    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        assert state_module.private_dir() is None
        assert isinstance(open_shared_state("amqp://guest@localhost//"), ProcessState)
    assert f"{listed} is mode 0750" in caplog.text and "could not be made 0700" in caplog.text, caplog.text


def test_a_temp_directory_where_others_could_swap_the_users_directory_is_used_only_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A temp directory others may write without the sticky bit (or under a directory like
    that) lets another local user rename ``outbox-<uid>`` away after it was checked and put a
    directory of their own in its place, whose files the relay would then trust (found in
    review). ``$XDG_RUNTIME_DIR`` is used instead when it is safe; else the temp directory all
    the same, with a warning: a container's scratch ``/tmp`` (Kubernetes' emptyDir, 0777) is
    like that, and refusing it kept each process's state alone (found in the day's review)."""
    import outbox.relay.state as state_module

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(state_module, "_bases", {})  # the verdicts this process keeps
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # not sticky
    (open_dir / "inner").mkdir(mode=0o700)
    for base in (open_dir, open_dir / "inner"):
        monkeypatch.setattr(tempfile, "tempdir", str(base))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="outbox.relay"):
            assert state_module.private_dir() == str(base / f"outbox-{os.getuid()}"), base
            state = open_shared_state("amqp://guest@localhost//")
            assert isinstance(state, FileState) and state.directory == str(base / f"outbox-{os.getuid()}")
        assert f"{open_dir} is writable by others and not sticky" in caplog.text and "used all the same" in caplog.text
    monkeypatch.setattr(state_module, "_bases", {})
    monkeypatch.setattr(tempfile, "tempdir", str(open_dir / "inner"))
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    state = open_shared_state("amqp://guest@localhost//")
    assert isinstance(state, FileState) and state.directory == str(runtime / f"outbox-{os.getuid()}")
    assert w._stopping_marker(1, create=True) == runtime / f"outbox-{os.getuid()}" / "outbox-worker-stopping-1"
    open_dir.chmod(0o1777)  # sticky: the temp directory again, for a process started now
    monkeypatch.setattr(state_module, "_bases", {})
    assert state_module.private_dir() == str(open_dir / "inner" / f"outbox-{os.getuid()}")


def test_the_users_directory_is_made_again_when_a_temp_cleaner_removed_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A cleaner of the temp directory (systemd-tmpfiles' 10 days, tmpwatch) removes an ``outbox-<uid>``
    that a quiet relay left untouched: every write of the state a process opened then failed,
    FileNotFoundError, for the rest of its life, each process pausing and requesting claims alone
    (found in review). The directory is made again, on the same terms, at the next write."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tmp_path.chmod(0o1777)
    state = open_shared_state("amqp://guest@localhost//")
    assert isinstance(state, FileState)
    Path(state.directory).rmdir()
    assert state.set_if_absent("k", "1", 60)
    assert state.get("k") == "1"
    info = Path(state.directory).stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.getuid(), 0o700)
