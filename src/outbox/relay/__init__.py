"""The relay's logic, free of Celery (docs/design.md, "How a row travels"): ``context``
(the collaborators, one argument), ``hooks`` (what it reports), ``claim``, ``drain`` (a claim task's drain slice),
``publish`` (sending, the trusted prefix, settling), ``policy`` (the failure policy),
``settle`` (store writes), ``foreign`` (a task of another outbox),
``shared`` (breaker, route gate, outage log, coalescer) over ``state`` (Redis, files
or the process), ``resources`` (what a worker process holds). Every name keeps its ``outbox.relay`` import path."""

from ..core.config import MAX_OPTION_S, RelayOptions
from ..core.model import message_from_dict, message_to_dict
from ..core.names import ACK_TASK, CLAIM_TASK, FAIL_TASK, PUBLISH_TASK, PURGE_TASK, RELEASE_TASK, Queues
from .claim import (
                      LEASE_EXPIRED,
                      Claimed,
                      ClaimFailed,
                      ClaimOutcome,
                      Dispatch,
                      hand_on,
                      handle_claim,
                      plan_tasks,
                      take_claim,
)
from .context import RelayContext
from .drain import DRAIN_SLICE_S, Ahead, Backlog, ClaimAhead, Drain, after_publish, drain_slice
from .foreign import ForeignTasks
from .hooks import RelayHooks
from .policy import STOP_POLICY
from .publish import (
                      BACKPRESSURE,
                      FATAL,
                      POISON,
                      RETRIABLE,
                      ChainOutcome,
                      handle_chain,
                      handle_publish,
                      still_held,
                      still_held_when_reachable,
                      trusted_prefix,
)
from .resources import ResourceHolder, Resources
from .settle import MAX_RETRY_S, Fallback, Settler, StoreLike, apply_fallback, purge_expired, retry_delay, send_dead
from .shared import (
                      Breaker,
                      Coalescer,
                      Outage,
                      RouteGate,
                      breaker_key,
                      make_breaker,
                      make_coalescer,
                      make_outage,
                      make_relay_outage,
                      make_route_gate,
)
from .sizing import ClaimSizer
from .state import FileState, ProcessState, RedisState, SharedState, open_shared_state

__all__ = [
    "RelayOptions", "MAX_OPTION_S", "retry_delay", "MAX_RETRY_S", "message_to_dict", "message_from_dict",
    "SharedState", "ProcessState", "RedisState", "FileState", "open_shared_state",
    "Breaker", "breaker_key", "make_breaker", "RouteGate", "make_route_gate",
    "Outage", "make_outage", "ClaimFailed", "Coalescer", "make_coalescer",
    "RelayContext", "STOP_POLICY", "trusted_prefix",
    "StoreLike", "Fallback", "Settler", "ChainOutcome", "handle_chain", "handle_publish", "still_held", "still_held_when_reachable",
    "ClaimOutcome", "ClaimSizer", "plan_tasks", "Dispatch", "handle_claim", "apply_fallback",
    "Claimed", "take_claim", "hand_on", "Ahead", "ClaimAhead",
    "DRAIN_SLICE_S", "Backlog", "Drain", "RelayHooks", "after_publish", "drain_slice", "send_dead",
    "make_relay_outage", "purge_expired", "ResourceHolder", "Resources",
    "RETRIABLE", "BACKPRESSURE", "POISON", "FATAL", "LEASE_EXPIRED",
    "CLAIM_TASK", "PUBLISH_TASK", "ACK_TASK", "FAIL_TASK", "RELEASE_TASK", "PURGE_TASK",
    "Queues", "ForeignTasks",
]
