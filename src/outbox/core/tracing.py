"""Capture the W3C ``traceparent`` of the current OpenTelemetry span, if there is one.

OpenTelemetry is optional: without it (or without an active, valid span) nothing is
captured and enqueue carries on.
"""

from __future__ import annotations


def current_traceparent() -> str | None:
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
