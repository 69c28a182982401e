"""``ApartPublisher``: each call published by a child process of its own, so that an
event whose publishing kills the process (a crash in a native library, memory exhausted)
kills that child and not the worker: how a Dramatiq worker, whose threads share a process,
publishes a row tried twice, and how a claim sends the dead-letter copies of the rows it found
dead on an expired lease (docs/relay.md, "An event that kills its worker")."""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import replace
from multiprocessing import forkserver, resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.process import AuthenticationString, BaseProcess  # type: ignore[attr-defined]
from typing import Any

from ..core.config import Settings
from ..core.model import FailureKind, OutboxMessage
from ..core.redact import install_filter, redact_error
from .contract import ChainResult, DeadCopy, Pipelined, Publisher, PublishFailure
from .select import publisher_for

log = logging.getLogger("outbox.publisher")

#: Never a plain fork() of a worker process whose threads hold locks and connections: a fork
#: of multiprocessing's fork server, a single-threaded process started (a fresh interpreter)
#: at the first call, which has imported this module (and what it imports) already, so a
#: child starts in about 20 ms instead of the 0.4 s of a fresh interpreter ("spawn", where
#: there is no fork server). The server exits with the worker. The preload and the signal mask
#: below hold only when this module starts the process's fork server: one that other code
#: started first (Python 3.14 makes the fork server the default) serves the children too, and
#: they then import this module themselves and start with the stop signals unblocked.
_CONTEXT = (multiprocessing.get_context("forkserver") if "forkserver" in multiprocessing.get_all_start_methods()
            else multiprocessing.get_context("spawn"))

#: What a warm shutdown sends: the child ignores them (``_publish_in_child``), and has them
#: blocked from its start until it does: a mask handed over the fork by the thread that starts
#: the fork server (or, with "spawn", the child). multiprocessing's resource tracker, started
#: at a process's first child, unblocks SIGINT and SIGTERM in the thread that starts it, so it is
#: started before the mask is set (docs/relay.md, "An event that kills its worker"). SIGHUP is
#: Dramatiq's reload, a warm stop too: sent to the worker's group it killed the child (review).
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())}

#: How often the parent looks whether its child is still alive while it waits for the answer;
#: short waits also let a task's time limit (raised in the waiting thread) land.
_POLL_S = 0.2

#: The parent waits at least this long for a child, whatever its deadline: less than a
#: child's start leaves it no chance to answer (``Relay.apart_publisher`` uses the same floor).
MIN_WAIT_S = 1.0

#: A dead-letter copy begun just before its publisher's ``copies_by`` is waited for this long
#: at least: a fork server's child connects and answers within it on a healthy host.
COPY_MIN_WAIT_S = 0.25

#: The child's own deadline comes this much before the parent's (a quarter of the parent's
#: wait when that is short), both counted from before the child's start: room for its answer
#: and the pipe, so that a broker that hangs is answered by the child (BACKPRESSURE, no attempt
#: spent) before the parent gives up on it (a retriable failure: docs/relay.md, "The
#: publish's deadline").
CHILD_MARGIN_S = 1.0


class ChildUnavailable(Exception):
    """No child process could be started (the fork server gone, too many open files, memory)."""


class ApartPublisher(Publisher):
    """``publisher_for(settings, **options)`` in a child process started for each call, which
    publishes and exits. A child that dies or does not answer within ``timeout_s`` (then it is
    killed) is reported as a retriable failure of the head of every chain it was given:
    the relay marks that row failed at once, an attempt spent, and nothing else.

    When no child can be started, the call goes to ``fallback`` (the worker thread's own
    publisher), with one WARNING: a fault of this host must not spend the rows' attempts, and
    publishing here is what the worker did before it published rows apart."""

    def __init__(self, settings: Settings, timeout_s: float, fallback: Publisher, *,
                 copies_by: float | None = None, **options: Any) -> None:
        """``copies_by`` (monotonic): the dead-letter copies (``publish_dead``) of this
        publisher share it, waited for until then and not sent once it has passed (a
        claim's copies, its deadline: docs/relay.md, "An event that kills its worker")."""
        self.settings = settings
        self.timeout_s = timeout_s
        self.fallback = fallback
        self.copies_by = copies_by
        self.options = options

    def publish_chains(self, chains: Sequence[Sequence[OutboxMessage]], *,
                       pipelined: Pipelined | None = None, deadline: float | None = None) -> list[ChainResult]:
        """The parent waits ``timeout_s`` for its child, less when ``deadline`` (monotonic)
        comes first (``MIN_WAIT_S`` at least), counted from this call, the child's start
        included; the child publishes with a deadline of its own ``CHILD_MARGIN_S`` before
        that, on the same clock."""
        batch = [list(chain) for chain in chains]
        # The predicate cannot cross to the child: the ids it holds true for do.
        ids = frozenset(m.id for chain in batch for m in chain if pipelined is not None and pipelined(m))
        since = time.monotonic()
        wait = self.timeout_s
        if deadline is not None:
            wait = min(wait, max(MIN_WAIT_S, deadline - since))
        try:
            answers, why = self._run(("chains", batch, ids, since + wait - min(CHILD_MARGIN_S, wait / 4)),
                                     wait, since)
        except ChildUnavailable as exc:
            _here(exc)
            return list(self.fallback.publish_chains(batch, pipelined=pipelined, deadline=deadline))
        if answers and not answers[0][0]:
            results: list[ChainResult] = answers[0][1]
            return results
        failure = PublishFailure(FailureKind.RETRIABLE, answers[0][1] if answers else str(why))
        return [ChainResult(failed_id=chain[0].id, failure=failure) for chain in batch if chain]

    def publish_dead(self, message: OutboxMessage, error: str, *,
                     headers: Mapping[str, Any] | None = None) -> PublishFailure | None:
        return self.publish_dead_all([(message, error, headers)])[0]

    def publish_dead_all(self, copies: Sequence[DeadCopy]) -> list[PublishFailure | None]:
        """The copies from one child, which answers each as it is sent: a copy that kills it
        fails alone (``died``) and those after it go to a new child, so a claim's copies cost
        one child, not one each (0.2 s a copy on a loaded host ran a claim's copies past its
        deadline: found in review). Each child is waited for ``timeout_s``, and not past
        ``copies_by`` (by ``COPY_MIN_WAIT_S`` at most); none is started once it has passed."""
        results: list[PublishFailure | None] = []
        while len(results) < len(copies):
            rest = [(message, error, dict(headers or {})) for message, error, headers in copies[len(results):]]
            wait = self.timeout_s
            if self.copies_by is not None:
                left = self.copies_by - time.monotonic()
                if left <= 0:
                    results += [PublishFailure(FailureKind.RETRIABLE, "not sent: the dead-letter copies' time ran "
                                               "out (the claim's deadline; the row stays dead in the table)")] * len(rest)
                    break
                wait = min(wait, max(left, COPY_MIN_WAIT_S))
            try:
                answers, why = self._run(("dead", rest), wait, count=len(rest))
            except ChildUnavailable as exc:
                _here(exc)
                return results + self.fallback.publish_dead_all(copies[len(results):])
            for raised, value in answers:
                if raised:  # no publisher to send any of them: each copy left fails so
                    return results + [PublishFailure(FailureKind.RETRIABLE, value)] * (len(copies) - len(results))
                results.append(value)
            if why is not None:  # the copy it was sending, if any, failed with it; the rest go on
                results.append(PublishFailure(FailureKind.RETRIABLE, why))
        return results

    def close(self) -> None:
        """Nothing to close: each child closes its own connection before it exits."""

    def _run(self, job: tuple[Any, ...], wait: float | None = None, since: float | None = None,
             count: int = 1) -> tuple[list[tuple[bool, Any]], str | None]:
        """Start a child for ``job`` and wait for its answers, ``count`` of them (one per copy of
        a dead-letter job, one otherwise), ``wait`` seconds at most (default ``timeout_s``)
        from ``since`` (monotonic; default now), its start included: the (raised, value)
        answers heard, and why there are fewer than ``count`` (None when all came, or the child
        raised, which ends its answers). A slow start (the fork server's, a loaded host) used
        to be added to the wait (docs/relay.md, "The publish's deadline")."""
        wait = self.timeout_s if wait is None else wait
        give_up = (time.monotonic() if since is None else since) + wait
        _preload()
        try:
            receive, send = _CONTEXT.Pipe(duplex=False)
        except OSError as exc:
            raise ChildUnavailable(f"{type(exc).__name__}: {exc}") from exc
        heard = False  # every answer, or EOF, from the child
        answers: list[tuple[bool, Any]] = []
        child = _CONTEXT.Process(target=_publish_in_child, args=(send, self.settings, self.options, job),
                                 name="outbox-publish-apart", daemon=True)
        try:
            _start(child)
            _kill_at_exit()
            if child.pid is not None:
                _RUNNING.add(child.pid)
            send.close()  # the child's end: EOF here once the child is gone, the only sure sign of it
            while len(answers) < count and not (answers and answers[-1][0]):
                while not receive.poll(_POLL_S):
                    if time.monotonic() > give_up:
                        return answers, f"the child process publishing it did not answer within {wait:.0f} s"
                try:
                    answers.append(receive.recv())
                except EOFError:  # closed without a word: it died
                    heard = True
                    return answers, _died(child)
            heard = True
            return answers, None
        finally:
            if child.pid is not None:
                _RUNNING.discard(child.pid)
                if not heard:
                    _kill(child.pid)  # neither its answers nor EOF: it runs, whatever its exit code says
                child.join()
            send.close()
            receive.close()


def _forget_inherited_server() -> None:
    """In a child forked by ``os.fork`` (a Celery worker's main process forks its pool
    processes): forget the parent's fork server and children. multiprocessing checks that its
    server runs with ``waitpid``, which fails in any process but the one that started it, so
    the child could start no child of its own (each row published without isolation), and a
    fork taken while another thread started the server left its lock held. The server's
    state is made afresh (the child starts its own on demand), its preload kept."""
    server = forkserver._forkserver
    preload = list(getattr(server, "_preload_modules", []))
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        with suppress(OSError):
            os.close(alive)  # the parent's server exits with the parent, not with the last of its forks
    server.__init__()  # type: ignore[misc]
    server._preload_modules = preload  # type: ignore[attr-defined]
    _RUNNING.clear()  # the parent's children: not this process's to kill at its exit


def _preload() -> None:
    if _CONTEXT.get_start_method() == "forkserver":  # before the server starts, else no effect
        _CONTEXT.set_forkserver_preload(["__main__", __name__])


def _masked(start: Callable[[], object]) -> None:
    """``start()`` with the stop signals blocked (``_STOP_SIGNALS``), the resource tracker
    started first (not under the mask: its start unblocks the stop signals)."""
    resource_tracker.ensure_running()
    unmasked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unmasked)


def _start(child: BaseProcess) -> None:
    """Start ``child`` with the stop signals blocked (``_STOP_SIGNALS``), from a daemonic
    process too (``_as_parent``)."""
    try:
        with _as_parent(child):
            _masked(child.start)
    except Exception as exc:
        raise ChildUnavailable(f"{type(exc).__name__}: {exc}") from exc


@contextmanager
def _as_parent(child: BaseProcess) -> Iterator[None]:
    """This process, while it starts ``child``, neither daemonic nor holding (nor handing
    ``child``) an authentication key of another library's type. A Celery pool process is a
    daemonic billiard process, which billiard makes multiprocessing's current process:
    multiprocessing refuses a daemonic process children ("daemonic processes are not allowed
    to have children"), and billiard's key, which the child's start hands over, refuses to
    be pickled by multiprocessing, so a claim or ``outbox.fail`` task there published every
    dead-letter copy itself, and a copy that killed its publisher killed the pool process and
    the copies behind it (found in review). The flag keeps a daemonic process from leaving
    orphans behind; these children do not outlive their call (answered, or killed). The key
    keeps its value."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    child.authkey = bytes(child.authkey)  # copied from this process's when made: the same value
    was = {name: config[name] for name in ("daemon", "authkey") if name in config}
    if was.get("daemon"):
        config["daemon"] = False
    if "authkey" in was and type(was["authkey"]) is not AuthenticationString:
        config["authkey"] = AuthenticationString(was["authkey"])
    try:
        yield
    finally:
        config.update(was)


def start_server() -> None:
    """Start this process's fork server now, if it has none (a fresh interpreter that imports
    the relay: seconds on a loaded host), so that the child of a row tried twice is then a
    fork of it (about 20 ms). ``Relay.publish`` calls it before it renews the row's lease: the
    server's start used to be taken from that lease, which ran out while the first child of a
    worker process started, and the row, tried twice, went dead though its child published it
    (review, 7 December). A failure is left to the call, which reports it (``ChildUnavailable``)."""
    if _CONTEXT.get_start_method() != "forkserver":
        return
    _preload()
    with suppress(Exception):
        _masked(forkserver.ensure_running)


def _here(exc: ChildUnavailable) -> None:
    log.warning("outbox: no child process to publish apart (a row tried twice, a dead row's copy) (%s); publishing it in this "
                "worker process, as without isolation (docs/relay.md, \"An event that kills its worker\")", exc)


#: The pids of this process's children not yet heard from (an answer or EOF).
_RUNNING: set[int] = set()


@functools.cache
def _kill_at_exit() -> None:
    """Registered once per process, when its first child has started: multiprocessing has
    registered its own exit hook by then, and atexit runs the last registered first. A
    process that exits with a child still publishing kills it. Without this, multiprocessing's
    hook sends the child SIGTERM, which it ignores, and waits for it: a Dramatiq worker's
    second signal ("Killing worker process...") or ``sys.exit`` waited for the child's whole
    publish (found in review). A child killed so leaves its row to the lease or the
    takeover, as the worker's own death does."""
    atexit.register(_kill_children)


def _kill_children() -> None:
    for pid in list(_RUNNING):
        _kill(pid)


def _kill(pid: int) -> None:
    """SIGKILL a child that still holds its end of the pipe open. Not ``child.kill()``: when
    the fork server is gone, multiprocessing reports its children dead (exit code 255) and
    signals them no more, though they run on and may yet publish (found in review)."""
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _died(child: BaseProcess) -> str:
    """Why a child that is gone did not answer: what ``last_error`` records."""
    child.join()
    code = child.exitcode
    how = f"exit code {code}"
    if code is not None and code < 0:
        try:
            how = f"signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"signal {-code}"
    return f"the child process publishing it died ({how})"


def _publish_in_child(answer: Connection, settings: Settings, options: dict[str, Any], job: tuple[Any, ...]) -> None:
    """The child: publish ``job``, send (raised, value) to the parent, close, exit. A worker's
    warm shutdown (SIGTERM, or SIGINT to the terminal's process group) lets it finish its one
    publish: the parent waits for it, within its timeout. Its warnings go to the worker's
    stderr, passwords masked. A job of chains carries the deadline the child publishes by
    (``CHILD_MARGIN_S`` before its parent gives up), on the parent's ``time.monotonic()``:
    CLOCK_MONOTONIC, one clock for every process of the host.

    Whatever it raises, making its publisher included, is answered (a failure of the chains)
    or logged, never left to multiprocessing, which prints a traceback unmasked (docs/relay.md,
    "Secrets in output")."""
    for stop in _STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked since the start: now ignored
    logging.basicConfig(level=logging.WARNING,
                        format="[%(asctime)s] [PID %(process)d] [outbox-publish-apart] [%(name)s] [%(levelname)s] "
                               "%(message)s")
    install_filter()
    settings.register_passwords()  # unpickled: its passwords are not known to this process yet
    try:
        _answer(answer, settings, options, job)
    except Exception:  # through the masking handler, then the exit code the parent reports
        log.exception("outbox: the child process publishing apart failed")
        raise SystemExit(1) from None


def _answer(answer: Connection, settings: Settings, options: dict[str, Any], job: tuple[Any, ...]) -> None:
    """Make the publisher, publish ``job`` and send the parent (raised, value), a failure's text
    masked: one answer for chains, one per copy of a dead-letter job, as each is sent."""
    publisher: Publisher | None = None
    try:
        publisher = publisher_for(settings, size_warning=False, **options)  # the worker warned already
        if job[0] == "chains":
            _, chains, ids, deadline = job
            results = publisher.publish_chains(chains, pipelined=_among(ids) if ids else None, deadline=deadline)
            _send(answer, (False, [_portable(result) for result in results]))
        else:
            for message, error, headers in job[1]:
                try:
                    failure = publisher.publish_dead(message, error, headers=headers or None)
                except Exception as exc:  # noqa: BLE001 - this copy's failure; the next ones go on
                    failure = PublishFailure(FailureKind.RETRIABLE, redact_error(exc))
                _send(answer, (False, failure and replace(failure, exception=None)))
    except Exception as exc:  # noqa: BLE001 - told to the parent, which reports it as a failure of the chains
        _send(answer, (True, redact_error(exc)))
    finally:
        if publisher is not None:
            publisher.close()
    answer.close()


def _send(answer: Connection, reply: tuple[bool, Any]) -> None:
    with suppress(OSError):  # the parent is gone (killed): nobody to tell
        answer.send(reply)


def _among(ids: Collection[int]) -> Pipelined:
    return lambda message: message.id in ids


def _portable(result: ChainResult) -> ChainResult:
    """``result`` without the exceptions its failures carry for logs: they may not pickle."""
    failure = result.failure and replace(result.failure, exception=None)
    overtaken = tuple(replace(o, failure=replace(o.failure, exception=None)) for o in result.overtaken)
    return replace(result, failure=failure, overtaken=overtaken)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_server)


__all__ = ["ApartPublisher", "start_server"]
