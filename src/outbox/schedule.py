"""Loading the relay's schedule, the top-level ``beat_schedule`` module, for Celery's app
and the Dramatiq scheduler. A user's own ``beat_schedule.py`` earlier on ``sys.path`` (the
project's directory: ``python -m celery``, ``PYTHONPATH=.``) replaces it (README, "Running the
relay"): without ``build_schedule`` it is refused here, naming the file."""

from __future__ import annotations

from typing import Any

from .core.errors import ConfigError


def load_beat_schedule(settings: Any, options: Any) -> dict[str, Any]:
    """The schedule, from the top-level ``beat_schedule`` module (the one definition)."""
    import beat_schedule

    build = getattr(beat_schedule, "build_schedule", None)
    if not callable(build):
        where = getattr(beat_schedule, "__file__", None) or repr(beat_schedule)
        raise ConfigError(f"{where} shadows the relay's schedule (the top-level module beat_schedule installed "
                          "with outbox-relay) and has no build_schedule(settings, options): rename it")
    schedule: dict[str, Any] = build(settings, options)
    return schedule


__all__ = ["load_beat_schedule"]
