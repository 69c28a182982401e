"""``ApartPublisher``: each call published by a child process of its own, so that an event
that kills its publisher kills the child alone (docs/relay.md, "An event that kills its
worker"). Real child processes and a real RabbitMQ; the event that kills or hangs its
publisher is ``publisher_support.KILLER_HOOK``'s."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from publisher_support import install_killer, make_message, raw_body
from services import AMQP_URL

from outbox.core.config import Settings
from outbox.core.model import FailureKind
from outbox.publisher import ChainResult
from outbox.publisher.apart import ApartPublisher


def apart(broker: dict[str, Any], timeout_s: float = 60.0) -> ApartPublisher:
    settings = Settings(publish_url=AMQP_URL, exchange=broker["exchange"], dead_letter_exchange=broker["dead"])
    return ApartPublisher(settings, timeout_s)


@pytest.fixture
def killer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The children started from now on run ``KILLER_HOOK`` (they inherit PYTHONPATH)."""
    install_killer(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))


def test_chains_and_dead_letter_copies_are_published_by_the_child(broker: dict[str, Any]) -> None:
    first = [make_message(1, aggregate_id="a"), make_message(2, aggregate_id="a")]
    second = [make_message(3, aggregate_id="b")]
    results = apart(broker).publish_chains([first, second])
    assert results == [ChainResult(published=(1, 2)), ChainResult(published=(3,))]
    arrived = [m.headers["outbox_id"] for m in broker["live"]()]
    assert sorted(arrived) == [1, 2, 3] and arrived.index(1) < arrived.index(2)  # chains share waves
    dead = make_message(4, attempts=2)
    assert apart(broker).publish_dead(dead, "retriable: it kept failing") is None
    [copy] = broker["dead_letters"]()
    assert raw_body(copy) == dead.payload.encode() and copy.headers["x-outbox-error"] == "retriable: it kept failing"


def test_a_child_killed_by_its_event_is_a_retriable_failure_of_that_event(broker: dict[str, Any],
                                                                          killer: None) -> None:
    """The child dies (SIGKILL); the caller, alive, learns that the head of the chain failed."""
    [result] = apart(broker).publish_chains([[make_message(7, payload='{"KILLER": true}'), make_message(8)]])
    assert result.published == () and result.failed_id == 7
    assert result.failure is not None and result.failure.kind == FailureKind.RETRIABLE
    assert result.failure.reason == "the child process publishing it died (signal SIGKILL)"
    assert broker["live"]() == []
    # The next call has a child of its own.
    assert apart(broker).publish_chains([[make_message(9)]]) == [ChainResult(published=(9,))]


def test_a_child_that_does_not_answer_in_time_is_killed_and_its_event_failed(broker: dict[str, Any],
                                                                            killer: None) -> None:
    started = time.monotonic()
    [result] = apart(broker, timeout_s=3.0).publish_chains([[make_message(5, payload='{"HANG": true}')]])
    assert time.monotonic() - started < 10  # 3 s, the start-up of a child on a loaded machine, the kill
    assert result.failed_id == 5 and result.failure is not None and result.failure.kind == FailureKind.RETRIABLE
    assert result.failure.reason == "the child process publishing it did not answer within 3 s"
