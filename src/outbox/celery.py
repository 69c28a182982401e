"""The relay's Celery app: ``celery -A outbox worker`` and ``celery -A outbox beat``.

``celery -A outbox`` finds this module by itself: ``celery.app.utils.find_app`` looks for
an ``app`` or ``celery`` attribute on the ``outbox`` package and, finding neither, imports
``outbox.celery`` and takes its ``app``. Nothing depends on the current directory.

Configuration
-------------
Everything comes from the OUTBOX_* settings (``outbox.config``). The same names also work
as Celery config keys (a module passed with ``celery -A outbox --config mymodule``, or
``app.conf.update(...)`` before the app is used) and win over the environment there.
Relay tuning that is not (yet) a contract setting is read from ``OUTBOX_RELAY_*`` the
same way (see ``outbox.relay.RelayOptions``). The Celery settings below are *defaults*: a
config module may still set any Celery key, ``broker_url`` included.

The configuration is computed lazily, the first time Celery reads ``app.conf`` (worker or
beat start-up, or the first ``send_task``), so an invalid setting stops start-up with a
``ConfigError`` that names it.

Queues
------
Each task has its own queue, so each can be scaled and routed on its own
(``celery -A outbox worker -Q outbox.publish -c 8``, ``... -Q outbox.claim,outbox.ack,outbox.purge -c 2``).
A worker started without ``-Q`` consumes all four.

Operations
----------
Every log record of the worker and beat passes ``outbox.redact.RedactingFilter`` (no
password is ever logged). With a ``redis://`` Celery broker the transport is
``outbox.celery_redis:Transport``, which drops a message it cannot decode instead of
stopping the worker (docs/relay.md, "Garbage in Celery's Redis broker").

The in-memory Celery broker
---------------------------
``memory://`` (the default next to SQLite) only exists inside one process. The worker then
runs a thread pool instead of prefork and runs the schedule itself (Celery's beat in a
thread, with the same ``beat_schedule``), so ``celery -A outbox worker`` alone relays the
embedded default. A separate ``celery -A outbox beat`` cannot reach it; use Redis for that.
"""

from __future__ import annotations

from .celery_app import app, celery_config, load_beat_schedule
from .config import relay_options, relay_settings, reset_relay_settings
# The worker's wiring (per-process resources, every Celery signal) and the task bodies:
# loaded with the app, so `celery -A outbox worker|beat` has them all.
from . import worker as _worker, tasks as _tasks  # noqa: F401,E402


__all__ = ["app", "relay_settings", "relay_options", "reset_relay_settings", "celery_config",
           "load_beat_schedule"]
