"""The AMQP frames of a ``basic.publish``, built with what is the same for every message
encoded once (docs/publisher.md, "Fast path"). The bytes are those py-amqp writes for the
same message through kombu, so they go on py-amqp's own connection and channel."""

from __future__ import annotations

from struct import pack
from typing import Any

#: basic.publish's method frame: class 60, method 40, a reserved short; then the exchange and
#: the routing key (short strings) and the mandatory/immediate bits.
_BASIC_PUBLISH = pack(">HHH", 60, 40, 0)
_FRAME_END = b"\xce"

#: The properties every message carries, in py-amqp's order (``amqp.Message.PROPERTIES``):
#: content_type, content_encoding, application_headers, delivery_mode, priority, message_id.
_FLAGS = 0x8000 | 0x4000 | 0x2000 | 0x1000 | 0x0800 | 0x0080
_PERSISTENT_PRIORITY_0 = b"\x02\x00"  # delivery_mode 2 (persistent), priority 0

#: Bounds of the per-encoder caches (routing keys, header names): plenty for real topologies,
#: and a process that sees unbounded distinct names just encodes them each time.
_CACHE_LIMIT = 4096

_TRUE, _FALSE, _VOID = b"t\x01", b"t\x00", b"V"


def shortstr(text: str) -> bytes:
    """An AMQP short string, as py-amqp encodes it (UTF-8 with surrogatepass). Over 255
    bytes it raises ``struct.error`` exactly as py-amqp's encoder does."""
    raw = text.encode("utf-8", "surrogatepass")
    return pack("B", len(raw)) + raw


class PublishFrames:
    """The frames of ``basic.publish`` messages for one channel, exchange and ``mandatory``
    flag: the method frame per routing key is encoded once and cached, the content header's
    constant properties once; per message only the body size, the header table, the
    ``message_id`` and the body are encoded."""

    def __init__(self, channel_id: int, frame_max: int, exchange: str, mandatory: bool) -> None:
        self.channel_id = channel_id
        self.chunk = frame_max - 8  # a body frame's payload at most (py-amqp's chunk size)
        self._method_head = _BASIC_PUBLISH + shortstr(exchange)
        self._bits = b"\x01" if mandatory else b"\x00"  # immediate is never set
        self._methods: dict[str, bytes] = {}
        self._names: dict[str, bytes] = {}
        self._body_head = pack(">BH", 3, channel_id)
        self._constant_properties = pack(">H", _FLAGS) + shortstr("application/json") + shortstr("utf-8")

    def method(self, routing_key: str) -> bytes:
        """The whole method frame for ``routing_key`` (cached)."""
        frame = self._methods.get(routing_key)
        if frame is None:
            payload = self._method_head + shortstr(routing_key) + self._bits
            frame = pack(">BHI", 1, self.channel_id, len(payload)) + payload + _FRAME_END
            if len(self._methods) < _CACHE_LIMIT:
                self._methods[routing_key] = frame
        return frame

    def publish(self, routing_key: str, headers: dict[str, Any], message_id: str,
                body: bytes) -> list[bytes | memoryview]:
        """The frames of one message, as parts to be joined: method, content header, body
        frames (none for an empty body, several for a body above ``frame_max - 8``, as
        py-amqp does). Raises what py-amqp's encoder would raise for the same message."""
        table = self.table(headers)
        mid = shortstr(message_id)
        size = len(body)
        header_size = 12 + len(self._constant_properties) + len(table) + 2 + len(mid)
        parts: list[bytes | memoryview] = [  # a large body's frames are slices of it, not copies
            self.method(routing_key), pack(">BHIHHQ", 2, self.channel_id, header_size, 60, 0, size),
            self._constant_properties, table, _PERSISTENT_PRIORITY_0, mid, _FRAME_END]
        if size <= self.chunk:
            if size:
                parts += (self._body_head, pack(">I", size), body, _FRAME_END)
        else:
            view = memoryview(body)
            for start in range(0, size, self.chunk):
                piece = view[start:start + self.chunk]
                parts += (self._body_head, pack(">I", len(piece)), piece, _FRAME_END)
        return parts

    def table(self, headers: dict[str, Any]) -> bytes:
        """The header table (AMQP ``F``) with py-amqp's encoding of each value: str as
        ``S``, bool ``t``, int ``I`` (``L`` outside +-2147483647), float ``d``, None ``V``.
        Any other type (or a non-str name) is left to py-amqp's own encoder, whole table."""
        names = self._names
        parts: list[bytes] = []
        append = parts.append
        for name, value in headers.items():
            key = names.get(name)
            if key is None:
                if type(name) is not str:
                    return _amqp_table(headers)
                key = shortstr(name)
                if len(names) < _CACHE_LIMIT:
                    names[name] = key
            append(key)
            kind = type(value)
            if kind is str:
                raw = value.encode("utf-8", "surrogatepass")
                append(b"S" + pack(">I", len(raw)))
                append(raw)
            elif kind is int:
                append(pack(">cq", b"L", value) if value > 2147483647 or value < -2147483647
                       else pack(">ci", b"I", value))
            elif kind is bool:
                append(_TRUE if value else _FALSE)
            elif value is None:
                append(_VOID)
            elif kind is float:
                append(pack(">cd", b"d", value))
            else:
                return _amqp_table(headers)
        data = b"".join(parts)
        return pack(">I", len(data)) + data


def _amqp_table(headers: dict[str, Any]) -> bytes:
    """py-amqp's own table encoder: for the values the fast one does not know."""
    from amqp.serialization import dumps

    return dumps("F", [headers])
