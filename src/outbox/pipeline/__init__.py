"""The batch half of outbox-relay: Spark jobs over the outbox's history.

``outbox pipeline archive`` moves finished rows into a Parquet archive, ``report``
summarises archive plus live table, ``replay`` enqueues archived events again.
Nothing in this package imports PySpark at import time, so the ``outbox`` command
works without the ``spark`` extra; the jobs import it when they run. How it works
and what it guarantees: docs/pipeline.md.
"""

from .common import PipelineError, parse_duration

__all__ = ["PipelineError", "parse_duration"]
