"""The package's imports run one way, downward (docs/design.md, "Layout").

Pure source analysis (``ast``): every ``import`` of a package module, at module level or
inside a function, is an arrow. The layers are written here once, top to bottom
(docs/design.md, "Layout", explains them); a module must sit in one, may import only
modules of lower layers (or, inside one package such as ``outbox.storage.engines``, modules
of the same layer), and the graph must have no cycle. A new module fails the test until it is
placed, which is the point: someone decides where it belongs.
"""

from __future__ import annotations

import ast
from pathlib import Path

from services import ROOT

SRC = ROOT / "src"

#: The wings, top to bottom, each with its layers top to bottom. ``pkg.*`` places every module
#: of a package. A module may import modules of lower layers, in its wing or below it.
WINGS: list[tuple[str, list[tuple[str, tuple[str, ...]]]]] = [
    ("entry points", [
        ("Django management commands", ("outbox.contrib.django.management", "outbox.contrib.django.management.*")),
        ("command line", ("outbox.cli",)),
        ("demo, checks, data pipeline and framework helpers",
         ("outbox.commands", "outbox.commands.demo", "outbox.commands.doctor", "outbox.pipeline", "outbox.pipeline.*",
          "outbox.contrib", "outbox.contrib.*")),
        ("commands' one-line errors", ("outbox.commands.oneline",)),
    ]),
    ("runners", [
        ("package face, `celery -A outbox`, `dramatiq outbox.dramatiq` and its scheduler",
         ("outbox", "outbox.celery", "outbox.dramatiq", "outbox.dramatiq.scheduler")),
        ("each runner's task bodies: Celery's tasks, Dramatiq's actors", ("outbox.celery.tasks", "outbox.dramatiq.actors")),
        ("Celery's worker process wiring", ("outbox.celery.worker",)),
        ("each runner as the relay's Runner", ("outbox.celery.runner", "outbox.dramatiq.runner")),
        ("writer-side API: enqueue, the post-commit wake and its choice of runner", ("outbox.enqueue", "outbox.wake")),
        ("each runner's Waker", ("outbox.celery.waker", "outbox.dramatiq.waker")),
        ("task runner apps: Celery's app, its Redis transport, logging and beat's scheduler; Dramatiq's brokers "
         "and consumers' log",
         ("outbox.celery.application", "outbox.celery.redis_transport", "outbox.celery.worker_logging",
          "outbox.celery.beat",
          "outbox.dramatiq.brokers", "outbox.dramatiq.consumer_log")),
        ("the schedule's loader", ("outbox.schedule",)),
        ("schedule", ("beat_schedule",)),
    ]),
    ("relay", [
        ("relay logic and worker services", ("outbox.relay", "outbox.relay.*")),
        ("publisher", ("outbox.publisher", "outbox.publisher.*")),
    ]),
    ("storage", [
        ("Celery's database broker", ("outbox.transport", "outbox.transport.channel", "outbox.transport.send",
                                         "outbox.transport.prefork")),
        ("the broker's database and messages", ("outbox.transport.database", "outbox.transport.messages",
                                                "outbox.transport.options")),
        ("the broker's queue tables", ("outbox.transport.tables", "outbox.transport.tables.*")),
        ("the store", ("outbox.storage", "outbox.storage.store")),
        ("connections", ("outbox.storage.connections",)),
        ("engines", ("outbox.storage.engines", "outbox.storage.engines.*")),
    ]),
    ("domain", [
        ("events and chains", ("outbox.domain", "outbox.domain.*")),
    ]),
    ("foundation", [
        ("configuration: the option families and the one order", ("outbox.core.config",)),
        ("the option reader, the sources, the validators", ("outbox.core.options", "outbox.core.sources",
                                                             "outbox.core.checks")),
        ("model and names", ("outbox.core", "outbox.core.model", "outbox.core.names", "outbox.core.errors",
                             "outbox.core.redact", "outbox.core.tls", "outbox.core.logs", "outbox.core.tracing", "outbox.core.handoff")),
    ]),
]

#: Every layer, top to bottom, named ``wing: layer``.
LAYERS: list[tuple[str, tuple[str, ...]]] = [(f"{wing}: {name}", patterns)
                                             for wing, layers in WINGS for name, patterns in layers]


def module_files() -> dict[str, Path]:
    files = {"beat_schedule": ROOT / "beat_schedule.py"}
    for path in sorted((SRC / "outbox").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports, wherever the import statement stands."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # ``from . import x`` names a module; ``from .m import f`` a name of m: both
            # resolve below to the longest module name they start with.
            targets = [f"{stem}.{alias.name}" for alias in node.names]
        for target in targets:
            # The longest known module the name starts with is what gets imported.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


def layer_of(module: str) -> int | None:
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-1])):
                return index
    return None


def family(module: str) -> str:
    """The package of the package's top level a module belongs to (``outbox.storage.engines``)."""
    return ".".join(module.split(".")[:2])


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in graph() if layer_of(m) is None]
    assert not unplaced, f"place these modules in LAYERS (and in docs/design.md): {unplaced}"


def test_imports_run_downward() -> None:
    wrong = []
    for module, targets in graph().items():
        here = layer_of(module)
        for target in targets:
            there = layer_of(target)
            if here is None or there is None:
                continue
            # Inside one package (``outbox.storage.engines``, ``outbox.contrib``...) modules of one
            # layer may use each other; the cycle test still holds them.
            siblings = here == there and family(module) == family(target) != "outbox"
            if there <= here and not siblings:
                wrong.append(f"{module} ({LAYERS[here][0]}) -> {target} ({LAYERS[there][0]})")
    assert not wrong, "imports that do not run downward:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle() -> None:
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(g):
        if start not in state:
            cycle = visit(start)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_lazy_and_relative_imports() -> None:
    """The analysis itself: a function-level relative import is an arrow, so a lazy
    upward import cannot hide from the checks above."""
    g = graph()
    assert "beat_schedule" in g["outbox.schedule"]  # imported inside a function
    assert "outbox.relay.service" in g["outbox.celery.worker"] and "outbox.core.names" in g["outbox.celery.tasks"]
    assert "outbox.storage.engines.base" in g["outbox.storage.engines.postgres"]
