"""``celery -A bench.patched_app worker``: the relay's own Celery app with the prototypes of
``bench.proto`` installed, chosen by OUTBOX_BENCH_PROTO (comma-separated: ``waves``,
``batched_ack``, ``inline``). Used by ``python -m bench`` to measure the proposed fixes; never in production."""

from __future__ import annotations

import os

from outbox.celery import app  # noqa: F401  (what `celery -A` looks for)
import outbox.tasks  # noqa: F401  (register the tasks before patching their module)

from .proto import install

_choice = {c.strip() for c in os.environ.get("OUTBOX_BENCH_PROTO", "waves,batched_ack").split(",") if c.strip()}
install(waves="waves" in _choice, batched_ack="batched_ack" in _choice, inline="inline" in _choice)

__all__ = ["app"]
