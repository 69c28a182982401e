"""What ``celery -A outbox worker|beat`` loads: Celery's ``find_app`` finds no ``app`` on the
``outbox`` package and imports ``outbox.celery``, whatever the current directory. It brings
the app (``outbox.celery_app``), the worker's wiring (``outbox.worker``) and the tasks
(``outbox.tasks``). Configuration, queues and the in-memory broker: docs/relay.md.
"""

from __future__ import annotations

from .celery_app import app, celery_config, load_beat_schedule
from .core.config import relay_options, relay_settings
# The worker's wiring (per-process resources, every Celery signal) and the task bodies:
# loaded with the app, so `celery -A outbox worker|beat` has them all.
from . import worker as _worker, tasks as _tasks  # noqa: F401,E402


__all__ = ["app", "relay_settings", "relay_options", "celery_config",
           "load_beat_schedule"]
