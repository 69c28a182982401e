"""What a logging filter may ask of a logger.

Python 3.13 guards ``Logger.handle`` against recursion: while a thread handles a record,
every logging call it makes is ignored, and ``Logger.isEnabledFor`` answers False, whatever
the levels. A filter (``outbox.dramatiq.consumer_log``, ``outbox.celery.worker_logging``)
therefore neither logs a line of its own nor asks ``isEnabledFor``: it rewrites the record it
was given, and asks ``shows``.
"""

from __future__ import annotations

import logging


def shows(logger: logging.Logger, level: int) -> bool:
    """``logger.isEnabledFor(level)`` as it would answer outside the handling of a record:
    the logger not disabled, the level not disabled process-wide, and at or above the
    logger's effective level."""
    return not logger.disabled and logger.manager.disable < level and level >= logger.getEffectiveLevel()


__all__ = ["shows"]
