"""kombu's transport-agnostic integration base classes (``t/integration/common.py`` of
kombu's sdist) bound to the ``outboxdb`` transport, as kombu binds them to its own
transports in ``t/integration/test_<transport>.py``. Not collected by the project's
suite: ``bench.suites`` copies it next to kombu's sources and runs it with pytest.

Environment: ``OUTBOXDB_SUITE_URL`` (a database URL), ``OUTBOXDB_SUITE_TABLE`` (the
queue table of the run), ``OUTBOXDB_SUITE_INVALID_URL`` (a database that refuses).
"""

from __future__ import annotations

import os

import kombu
import pytest
from t.integration.common import (
    BaseEventLoop,
    BaseExchangeTypes,
    BaseMessage,
    BasePriority,
    BaseTimeToLive,
    BasicFunctionality,
)

import outbox.transport  # noqa: F401 - registers outboxdb+...

OPTIONS = {"queue_table": os.environ["OUTBOXDB_SUITE_TABLE"], "visibility_timeout": 30}


def get_connection() -> kombu.Connection:
    return kombu.Connection(f"outboxdb+{os.environ['OUTBOXDB_SUITE_URL']}", transport_options=dict(OPTIONS))


@pytest.fixture()
def connection() -> kombu.Connection:
    return get_connection()


@pytest.fixture()
def invalid_connection() -> kombu.Connection:
    return kombu.Connection(f"outboxdb+{os.environ['OUTBOXDB_SUITE_INVALID_URL']}",
                            transport_options={**OPTIONS, "max_retries": 1})


class test_OutboxdbBasicFunctionality(BasicFunctionality):
    pass


class test_OutboxdbBaseExchangeTypes(BaseExchangeTypes):
    pass


class test_OutboxdbBaseTimeToLive(BaseTimeToLive):
    pass


class test_OutboxdbBaseMessage(BaseMessage):
    pass


class test_OutboxdbPriority(BasePriority):
    """Priorities are not supported (docs/transport.md): expected to fail."""
    PRIORITY_ORDER = "asc"


class test_OutboxdbEventLoop(BaseEventLoop):
    """The transport polls; it is not evented (docs/transport.md): expected to fail."""
