"""How many rows the next claim asks for, so that it reads about the byte budget
(docs/relay.md, "Memory: claims sized by bytes")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.model import OutboxMessage


@dataclass
class ClaimSizer:
    """Per process: the bytes per row of recent claims, and from it the next claim's size.

    ``row_bytes`` follows a claim with bigger rows at once and one with smaller rows by
    half the difference, so one claim of small rows between large ones does not let the
    next claim read ``OUTBOX_BATCH_SIZE`` large rows."""

    row_bytes: float = 0.0
    #: ``row_bytes`` is an assumption, not an observation: the first claim's rows replace it.
    assumed: bool = False

    @classmethod
    def at_start(cls, max_payload_bytes: int) -> ClaimSizer:
        """A process's sizer before its first claim: rows assumed as large as the writers
        may make them, so a worker started on a backlog of large rows (restarted after
        running out of memory, say) does not read a whole batch of them at once. The first
        claim that returns rows replaces the assumption with what it read: small rows bring
        the next claim back to the full batch."""
        return cls(float(max_payload_bytes + 256), assumed=True)

    def rows(self, batch_size: int, max_bytes: int) -> int:
        """Rows to ask for: ``batch_size``, or fewer when that many recent rows would not
        fit in ``max_bytes``. At least one (the byte budget always lets the first row go)."""
        if self.row_bytes <= 0:
            return batch_size
        return max(1, min(batch_size, int(max_bytes // self.row_bytes)))

    def observe(self, messages: Sequence[OutboxMessage]) -> None:
        if not messages:
            return
        mean = sum(m.size for m in messages) / len(messages)
        self.row_bytes = mean if mean >= self.row_bytes or self.assumed else (self.row_bytes + mean) / 2
        self.assumed = False
