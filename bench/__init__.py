"""Benchmarks of the outbox relay (``python -m bench``, ``make bench``).

Everything runs against services on 127.0.0.1 only (PostgreSQL, Redis, RabbitMQ; Kafka: a Tansu
process the bench starts), is bounded
in count and time, and cleans up after itself (a per-run table, exchange and queue, a spare
Redis db). Figures are printed as ratios to a baseline measured in the same run: nothing is a
timed assertion. See ``docs/benchmarks.md`` for the figures and what they mean.

Modules:

* ``bench.common``  the shared pieces in one import (the four modules below), the end of a
  phase (``teardown``), machine and version facts.
* ``bench.services`` the services on 127.0.0.1, per-run names (``Run``), the log line.
* ``bench.destination`` the RabbitMQ destination: exchange, queue and consumer thread
  (``Arrivals``, shared with ``bench.kafka``), the ordering rule checked on arrival.
* ``bench.backlog`` the run's outbox table (PostgreSQL unless ``Run.engine`` says otherwise):
  create, load (realistic events), count, drop.
* ``bench.engines`` what differs per database (PostgreSQL, MariaDB/MySQL, SQLite): connecting,
  loading a backlog, the raw loop's SQL (``python -m bench.drain --engine``).
* ``bench.procs``   process sampling from ``/proc`` (trees, RSS, threads, open files, TCP peers,
  CPU per group), stopping groups.
* ``bench.confirm`` publisher micro-benchmark: stop-and-wait confirms vs none, pipelined, tx.
* ``bench.drain``   backlog drain: in-process claim -> publish_chain -> mark_done loop
  (baseline), then a real ``celery -A outbox worker -c 2`` (prefork) with beat; ``python -m
  bench.drain [--engine ...]``: the raw loop against the relay, on PostgreSQL, MariaDB or SQLite.
* ``bench.hot``     one hot aggregate (10,000 events) drained strict and pipelined by a real
  worker: the ratio of the opt-in pipelined mode (``python -m bench.hot``).
* ``bench.kafka``   issue 24: the relay's drain to Kafka (Tansu by default) against a raw
  idempotent confluent-kafka producer and the same drain to RabbitMQ (``python -m bench.kafka``).
* ``bench.lease``   the store's lease-and-settle cycle alone on PostgreSQL: events/s, WAL bytes
  per event, HOT updates (``python -m bench.lease``).
* ``bench.live``    commit-to-arrival latency at a fixed write rate, with and without the
  post-commit wake.
* ``bench.loop``    the baseline loop as a subprocess entry point.
* ``bench.memory``  peak RSS of every worker process draining a backlog with 1 MB payloads
  mixed in (issue 11, target 7).
* ``bench.profiling`` py-spy on the worker's processes during a drain, summarised by where the
  time goes (the ``profile`` phase, ``bench.live --profile``).
* ``bench.report``  the report of ``python -m bench``: issue 11's targets, verdicts, the summary.
* ``bench.rawloop`` the raw unordered 2-process loop of issue 11, the drain's baseline.
* ``bench.soak``    leaks over time: every relay process's RSS, open fds, threads and connections
  sampled through a bounded run of steady traffic, slopes per hour and a verdict per measure
  (``python -m bench.soak``); ``--faults``: through cuts of its database, RabbitMQ and Redis
  connections (``bench.latency``'s proxies).
* ``bench.takeover`` one of two workers SIGKILLed mid-drain: the longest stand-still of any
  aggregate after the kill, next to the fault-free drain (``python -m bench.takeover``).
* ``bench.transport`` the database as Celery's broker (``outboxdb``) against Redis and kombu's
  SQLAlchemy transport (``python -m bench.transport``; figures in ``docs/transport.md``).
"""
