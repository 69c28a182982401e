"""Publishing claimed rows to the destination broker, in per-aggregate chains, so that what
reaches the broker is always a prefix of each chain (docs/publisher.md). ``contract``,
``message`` (building, poison checks), ``failures`` (classification), ``waves`` (the
chains' progress through waves, without I/O), ``kombu_publisher`` (the mechanism),
``frames`` (its AMQP frames). Every name keeps its ``outbox.publisher`` import path."""

from .contract import (
                       DEFAULT_MAX_MESSAGE_BYTES,
                       MAX_ERROR_HEADER_CHARS,
                       MAX_HEADER_BYTES,
                       MAX_SHORTSTR_BYTES,
                       OVERTAKEN_BY_HEADER,
                       OVERTAKEN_COUNT_HEADER,
                       RESERVED_HEADERS,
                       UNROUTABLE_POLICIES,
                       ChainResult,
                       DeadCopy,
                       FailureKind,
                       Overtaken,
                       Pipelined,
                       Publisher,
                       PublishFailure,
                       overtaken_headers,
)
from .failures import _connection_lost, classify, failure_from  # noqa: F401  (_connection_lost: tests)
from .kombu_publisher import KombuPublisher, refused_by_route
from .message import build_headers, checked_headers, encode_body, iso_utc, poison_check

__all__ = [
    "Publisher", "KombuPublisher", "ChainResult", "PublishFailure", "FailureKind", "Overtaken",
    "Pipelined", "DeadCopy",
    "classify", "failure_from", "poison_check", "checked_headers", "build_headers", "encode_body", "iso_utc",
    "refused_by_route", "RESERVED_HEADERS", "DEFAULT_MAX_MESSAGE_BYTES", "MAX_HEADER_BYTES", "MAX_SHORTSTR_BYTES",
    "MAX_ERROR_HEADER_CHARS", "UNROUTABLE_POLICIES", "OVERTAKEN_BY_HEADER", "OVERTAKEN_COUNT_HEADER",
    "overtaken_headers",
]
