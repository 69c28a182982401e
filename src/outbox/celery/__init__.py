"""The relay on Celery: what ``celery -A outbox worker|beat`` loads. Celery's ``find_app`` finds no
``app`` on the ``outbox`` package, imports ``outbox.celery`` (this package), whatever the current
directory, and asks it for ``app``.

* ``application``: the Celery app, its configuration and ``send_relay_task``;
* ``redis_transport``: kombu's Redis transport made to drop garbage;
* ``runner``: the relay's runner on Celery (``outbox.relay.runner.Runner``); ``waker``: the
  writer-side wake through Celery (``outbox.relay.waker.Waker``);
* ``worker``: the worker process's relay (``outbox.relay.service.Relay``) and every Celery signal;
* ``tasks``: the task bodies; ``worker_logging``: quiet idle workers and their heartbeat line.

The first read of ``app`` (or any name below) loads ``worker`` and ``tasks``. Importing the package
or ``application`` alone connects no signal: Celery's signals are process-wide, and a web process that
wakes the relay (``outbox.wake``) while running a Celery app of its own must not get the relay
worker's handlers. Configuration, queues and the in-memory broker: docs/relay.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app", "relay_settings", "relay_options", "celery_config", "load_beat_schedule"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import application, tasks, worker  # noqa: F401  (the worker's wiring and the tasks, with the app)

    return getattr(application, name)
