"""The docs tell the truth about the code: every module is in docs/design.md's layout,
every setting and relay option is in the configuration reference, every CLI command and
option is in the README."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import click
from services import ROOT

from outbox.cli import main
from outbox.core.config import SESSION_BOUNDS, SETTING_NAMES
from outbox.relay import RelayOptions

README = (ROOT / "README.md").read_text()


def layout_entries() -> list[str]:
    design = (ROOT / "docs" / "design.md").read_text()
    table = design.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)`", table, re.MULTILINE)


def covers(entry: str, module: str) -> bool:
    if entry.endswith("/"):
        return module.startswith(entry)
    braces = re.match(r"(.*)\{([^}]+)\}(.*)", entry)
    if braces:
        return any(module == f"{braces.group(1)}{name}{braces.group(3)}" for name in braces.group(2).split(","))
    return module == entry


def test_the_layout_table_lists_every_module() -> None:
    entries = layout_entries()
    modules = sorted(str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "outbox").rglob("*.py"))
    missing = [m for m in modules if not any(covers(e, m) for e in entries)]
    assert not missing, f"docs/design.md's layout table does not list {missing}"
    for entry in entries:
        if entry.startswith("outbox/") and "{" not in entry:
            assert (ROOT / "src" / entry).exists(), f"docs/design.md lists {entry}, which does not exist"


def test_the_configuration_reference_lists_every_setting_and_relay_option() -> None:
    config = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    for name in SETTING_NAMES:
        assert f"`{name}`" in config or f"`{name}` /" in config or name in config, f"README lacks {name}"
    relay_doc = (ROOT / "docs" / "relay.md").read_text()
    for f in fields(RelayOptions):
        name = f"OUTBOX_RELAY_{f.name.upper()}"
        assert f"| `{name}` |" in relay_doc, f"docs/relay.md's options table lacks {name}"


def test_the_session_bounds_are_documented_with_their_defaults_and_ranges() -> None:
    relay_doc = (ROOT / "docs" / "relay.md").read_text()
    for name, (default, low, high) in SESSION_BOUNDS.items():
        assert f"| `{name}` | {default} | {low}–{high} |" in relay_doc, f"docs/relay.md's bounds table lacks {name}"
        assert f"`{name}`" in README, f"README lacks {name}"


def commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    found = []
    for name, command in group.commands.items():
        path = (*prefix, name)
        if isinstance(command, click.Group):
            found += commands(command, path)
        else:
            found.append((path, command))
    return found


def test_the_readme_command_table_lists_every_command_and_option() -> None:
    table = README.split("## Command line", 1)[1].split("```", 2)[1]
    for path, command in commands(main):
        if path[0] == "pipeline":  # listed as one group; the Spark jobs have their own docs
            assert "\noutbox pipeline " in table, "README's command table lacks `outbox pipeline`"
            continue
        line = f"outbox {' '.join(path)}"
        assert line in table, f"README's command table lacks `{line}`"
        for param in command.params:
            if isinstance(param, click.Option):
                assert any(opt in table for opt in param.opts), f"README lacks {param.opts} of `{line}`"


def _help_texts(command: click.Command, prefix: tuple[str, ...] = ()) -> list[str]:
    ctx = click.Context(command, info_name=" ".join(("outbox", *prefix)))
    texts = [command.get_help(ctx)]
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            texts += _help_texts(sub, (*prefix, name))
    return texts


def test_every_install_line_names_a_checkout_or_a_git_url() -> None:
    """The package is not on PyPI: ``pip install "outbox-relay[x]"`` would fetch whatever
    someone registered under that name. Docs, examples, ``--help`` and the package's own
    messages say ``<checkout>[x]`` or ``outbox-relay[x] @ git+<URL>``."""
    bare = re.compile(r"""pip install ['"]?outbox-relay(\[[^\]]*\])?(?!\S*\s*@\s*git\+)""")
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "src").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.py")), *sorted((ROOT / "examples").rglob("*.md")),
             *sorted((ROOT / "worker").rglob("*")), ROOT / "Makefile", ROOT / "docker-compose.yml"]
    found = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in files if path.is_file()
             for m in bare.finditer(path.read_text(errors="replace"))]
    found += [f"--help: {m.group(0)}" for text in _help_texts(main) for m in bare.finditer(text)]
    assert not found, found


#: A pointer to a section of a page: `docs/relay.md, "Lost workers"`, `[relay.md](relay.md), "Lost
#: workers"` or `relay.md "Lost workers"`, possibly broken over a comment's lines.
POINTER = re.compile(r'(?<![\w/-])(?:docs/)?([\w-]+)\.md(?:\]\([^)]*\))?\)?'  # the page, maybe a link
                     r'(?:,?[ \t]+|,|[ \t]*\n[ \t]*(?:#:?|//)?[ \t]*)'  # then a comma, a space or a new line
                     r'"([^"\n]+(?:\n[ \t]*(?:#:?|//)?[ \t]*[^"\n]+)?)"')  # the section, at most two lines


def _sections(page: Path) -> list[str]:
    """A page's headings, and the bold words that open a paragraph or an item (`**Failures**`)."""
    text = page.read_text()
    found = re.findall(r"^#{1,4} (.+)$", text, re.MULTILINE)
    found += re.findall(r"^(?:- )?\*\*([^*]+)\*\*", text, re.MULTILINE)
    return [re.sub(r"\s+", " ", s).strip().lower() for s in found]


def test_every_pointer_to_a_section_names_one_that_exists() -> None:
    """`docs/X.md, "Section"` in the code, the docs and the README names a heading of that page
    (or a paragraph's bold opening; part of one is enough: "Pipelined chains" for "Pipelined
    chains (opt-in)")."""
    files = [ROOT / "README.md", ROOT / "beat_schedule.py", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
             *sorted((ROOT / "bench").rglob("*.py")), *sorted((ROOT / "examples").rglob("*.py"))]
    files.remove(Path(__file__).resolve())  # its own examples above
    stale = []
    for path in files:
        for m in POINTER.finditer(path.read_text()):
            page = ROOT / "README.md" if m.group(1) == "README" else ROOT / "docs" / f"{m.group(1)}.md"
            if not page.exists():
                continue
            section = re.sub(r"\s+(?:(?:#:?|//)\s+)?", " ", m.group(2)).strip()
            if not any(section.lower() in s for s in _sections(page)):
                stale.append(f"{path.relative_to(ROOT)}: {m.group(1)}.md, \"{section}\"")
    assert not stale, stale


def test_the_flask_quick_start_points_the_relay_at_the_examples_database() -> None:
    """docs/flask.md's quick start once wrote events to shop.db while `outbox status` and the
    workers read ./outbox.db."""
    app = (ROOT / "examples" / "flask" / "app.py").read_text()
    default = re.search(r'os\.environ\.get\("DATABASE_URL", "([^"]+)"\)', app)
    assert default is not None
    export = f"export OUTBOX_DATABASE_URL={default.group(1)}"
    assert export in (ROOT / "docs" / "flask.md").read_text() and export in app
    assert f"sqlalchemy.url = {default.group(1)}" in (ROOT / "examples" / "flask" / "alembic.ini").read_text()


def test_the_dramatiq_page_says_which_broker_outbox_check_checks() -> None:
    from outbox.commands import doctor

    # What the check does (tests/test_check.py runs it), and what the page says it does.
    assert "Dramatiq's (``OUTBOX_DRAMATIQ_BROKER_URL``) when it is set" in " ".join((doctor.__doc__ or "").split())
    page = " ".join((ROOT / "docs" / "dramatiq.md").read_text().split())
    assert "`outbox check`'s broker checks read Celery's settings" not in page
    assert "with `OUTBOX_DRAMATIQ_BROKER_URL` set, Dramatiq's broker" in page


def test_the_help_of_outbox_and_outbox_check_says_what_the_readme_says() -> None:
    """`outbox --help` gave the settings' order without the Celery config module, which the
    README ("Configuration") reads first, and `outbox check --help` said it checks Celery's
    broker, where it checks Dramatiq's when OUTBOX_DRAMATIQ_BROKER_URL is set (found in the
    first-hour review)."""
    assert "the relay's Celery config keys (a module given with `celery -A outbox --config mymodule` or " \
           "`CELERY_CONFIG_MODULE`; explicit overrides), then the environment, then Django settings" in \
           " ".join(README.split())
    top = " ".join(main.get_help(click.Context(main, info_name="outbox")).split())
    assert "CELERY_CONFIG_MODULE's keys first, then the environment, then Django settings" in top, top
    check = main.commands["check"]
    text = " ".join(check.get_help(click.Context(check, info_name="outbox check")).split())
    assert "the task runner's broker (Dramatiq's when OUTBOX_DRAMATIQ_BROKER_URL is set, else Celery's)" in text, text


def test_the_install_block_names_the_database_before_outbox_migrate() -> None:
    """The README's Install block went from `pip install "./outbox-relay[postgres]"` straight to
    `outbox migrate`, which, with no OUTBOX_DATABASE_URL, migrates ./outbox.db (SQLite): a new
    user's first table was not in their database."""
    block = README.split("## Install", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert "outbox migrate" in lines, block
    assert any(line.startswith("export OUTBOX_DATABASE_URL=") for line in lines[:lines.index("outbox migrate")]), block


def test_every_sqlalchemy_snippet_flushes_before_it_enqueues_a_new_rows_id() -> None:
    """docs/waking-and-metrics.md's Flask snippet added an order and enqueued `order.id` with no
    flush: the id of a new row is None until then, and enqueue refused it (EnqueueError)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unflushed = []
    for page in pages:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL):
            added = block.find("session.add(")
            enqueued = block.find("enqueue(", added)
            if added >= 0 and enqueued >= 0 and "flush()" not in block[added:enqueued]:
                unflushed.append(f"{page.name}: {block[added:enqueued + 60]!r}")
    assert not unflushed, unflushed


def test_every_publish_url_in_the_docs_is_one_start_up_accepts_and_every_database_broker_snippet_sets_one() -> None:
    """transport.md said events could go to the database transport (refused at start-up),
    and its SQL Server snippet set no OUTBOX_PUBLISH_URL: copied as printed, events went
    to memory://, in the relay's process, and were marked done (found in review)."""
    from outbox.core.checks import validate_publish_url

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```(?:sh|bash)\n(.*?)```", page.read_text(), re.S):
            for url in re.findall(r"^export OUTBOX_PUBLISH_URL=['\"]?([^'\"\s#]+)", block, re.M):
                if "<" not in url and "$" not in url:
                    validate_publish_url(url)  # raises ConfigError, naming the setting
            if re.search(r"^export OUTBOX_CELERY_BROKER_URL=outboxdb", block, re.M):
                assert re.search(r"^export OUTBOX_PUBLISH_URL=", block, re.M), f"{page.name}:\n{block}"


def test_the_queue_names_upgrade_note_says_how_to_empty_the_old_queues_on_redis() -> None:
    """Found in the upgrade review: the note said the old queues' ticks expire and to delete the
    queues "once they are empty"; on Redis an expired message stays in the list until a worker
    takes it (kombu; Dramatiq's Redis broker likewise), and no worker reads the old names, so the
    old claim queue never empties. The note gives the commands that purge them."""
    note = README.split("**Upgrade note (queue names).**", 1)[1].split("**Upgrade note", 1)[0]
    assert "celery -A outbox purge -f -Q" in note and ".claim,<old>.purge" in note
    assert ".flush(" in note  # Dramatiq on Redis
    assert "once they are empty" not in note


def test_the_upgrade_path_says_that_remote_control_needs_the_workers_outbox_settings() -> None:
    """Found in review: since the relay's app answers remote control on its outbox namespace's
    exchange, ``celery -A outbox inspect ping`` (a monitor's, Flower's) run with the broker URL
    alone, which answered before the upgrade, says ``No nodes replied`` while every worker runs."""
    operations = (ROOT / "docs" / "operations.md").read_text()
    upgrading = operations.split("## Upgrading", 1)[1].split("\n## ", 1)[0]
    assert "**Remote control and monitoring.**" in upgrading and "OUTBOX_NAMESPACE" in upgrading
    assert "No nodes replied within time constraint" in operations.split("## Troubleshooting by symptom", 1)[1]


def test_the_readmes_rabbitmqadmin_binding_declares_what_it_binds_first() -> None:
    """The README's alternative to the kombu snippet, `rabbitmqadmin declare binding ...` alone,
    is refused on a fresh broker (404 NOT_FOUND: the relay declares its exchange only at its
    first publish, and nothing had declared the queue), where the README says to bind before
    the first event (found in the first-hour review)."""
    commands = re.findall(r"rabbitmqadmin declare (\w+) ([^`;&]+)", " ".join(README.split()))
    assert any(kind == "binding" for kind, _ in commands), "the README no longer shows rabbitmqadmin"
    declared: set[tuple[str, str]] = set()
    for kind, args in commands:
        values = dict(re.findall(r"(\w+)=('[^']*'|\S+)", args))
        if kind == "binding":
            assert ("exchange", values["source"]) in declared, f"binding before its exchange: {args}"
            assert ("queue", values["destination"]) in declared, f"binding before its queue: {args}"
        else:
            declared.add((kind, values["name"]))
