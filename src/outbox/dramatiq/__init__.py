"""The relay on Dramatiq: what ``dramatiq outbox.dramatiq`` loads.

* ``actors``: the actors, their middleware and the process's relay; loading it installs Dramatiq's
  global broker;
* ``runner``: the relay's runner on Dramatiq (``outbox.relay.runner.Runner``); ``waker``: the
  writer-side wake through Dramatiq;
* ``brokers``: Dramatiq's broker from the settings, and sending without touching the global broker;
* ``scheduler``: ``outbox-dramatiq-scheduler``, beat's ticks for Dramatiq.

Importing the package or a submodule other than ``actors`` installs nothing: a Django process whose
global broker is django-dramatiq's sends its wakes through ``brokers`` and keeps its own. The actors
load on the first read of one of the names below, or at once when Dramatiq's command line names this
package as its broker (``dramatiq outbox.dramatiq``): that command imports the package and takes
Dramatiq's global broker, reading no attribute.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["OUTBOX_NAMESPACE", "QUEUES", "relay",
           "broker", "claim", "publish", "ack", "fail", "release", "purge", "request_claim", "resources",
           "close_resources", "shared", "stopping", "STOPPING", "OutboxMiddleware", "MetricsMiddleware",
           "queued_publish_tasks"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import actors

    return getattr(actors, name)


def _named_by_dramatiq_command() -> bool:
    """True in a process of ``dramatiq outbox.dramatiq[:broker] ...`` (its main and worker processes)."""
    return "dramatiq.cli" in sys.modules and any(arg.partition(":")[0] == __name__ for arg in sys.argv[1:])


if _named_by_dramatiq_command():
    from . import actors  # noqa: F401  (declares the actors and installs their broker)
