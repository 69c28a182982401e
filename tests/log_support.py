"""Python 3.13's logging, on any Python: while a thread handles a record, every logging call
it makes is ignored and ``Logger.isEnabledFor`` answers False (CPython's ``Logger.handle``
and ``Logger.isEnabledFor`` since 3.13). The relay's log filters must work under it
(``outbox.core.logs``); CI runs 3.11, so the tests of those filters run under this."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock


@contextmanager
def logging_as_in_python_313() -> Iterator[None]:
    """Within the block, ``logging.Logger`` behaves as 3.13's does; on 3.13 and later, as it is."""
    if sys.version_info >= (3, 13):
        yield
        return
    local = threading.local()
    handle, enabled = logging.Logger.handle, logging.Logger.isEnabledFor

    def guarded_handle(self: logging.Logger, record: logging.LogRecord) -> None:
        if getattr(local, "handling", False):
            return
        local.handling = True
        try:
            handle(self, record)
        finally:
            local.handling = False

    def guarded_enabled(self: logging.Logger, level: int) -> Any:
        return False if getattr(local, "handling", False) else enabled(self, level)

    with mock.patch.object(logging.Logger, "handle", guarded_handle), \
            mock.patch.object(logging.Logger, "isEnabledFor", guarded_enabled):
        yield
