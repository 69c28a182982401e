"""The ``outbox`` command line under ``manage.py``: each management command runs one
``outbox`` subcommand with Django's settings loaded (OUTBOX_* in settings.py, and the
database of ``DATABASES["default"]`` when OUTBOX_DATABASE_URL is not set), with the same
options, output and exit codes."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

import click
from django.core.management.base import BaseCommand, CommandError


class OutboxCommand(BaseCommand):
    #: The ``outbox`` subcommand (and fixed leading arguments) this command runs.
    cli_args: list[str] = []

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        """For ``call_command``: Django's parser takes its own options; everything it does
        not know, in order, goes to the ``outbox`` command as ``outbox_args``."""
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        known = parser.parse_known_args

        def parse_args(args: Any = None, namespace: Any = None) -> argparse.Namespace:
            options, rest = known(args, namespace)
            options.outbox_args = list(rest)
            return options

        parser.parse_args = parse_args
        return parser

    def run_from_argv(self, argv: list[str]) -> None:
        # Django's own argument parsing would eat --help and --json: hand everything to
        # the click command, which prints its own usage and exits with its own code, as
        # `outbox` does (-h, usage errors in one line: outbox.cli.run_as_program).
        from django.conf import settings

        from outbox.cli import run_as_program

        settings.INSTALLED_APPS  # noqa: B018  (fail here, clearly, if settings do not import)
        run_as_program(_command(self.cli_args), _without_django_options(argv[2:]),
                       f"{os.path.basename(argv[0])} {argv[1]}")

    def handle(self, *args: Any, **options: Any) -> None:
        """``call_command("outbox_status", "--json")``: output to ``self.stdout`` and
        ``self.stderr``; a failure raises ``CommandError`` with the command's message."""
        from outbox.cli import main

        err = _Capture()
        with contextlib.redirect_stdout(self.stdout), contextlib.redirect_stderr(err):
            try:
                # A usage error is one `error:` line and exit status 2 (outbox.cli.OneLineGroup),
                # which click, not standalone, returns rather than raises.
                returned = main.main(args=[*self.cli_args, *options.get("outbox_args", [])], prog_name="outbox",
                                     standalone_mode=False)
                code = returned if isinstance(returned, int) else 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except click.ClickException as exc:  # usage errors, with standalone_mode off
                raise CommandError(exc.format_message()) from None
        if err.text:
            self.stderr.write(err.text, ending="")
        if code:
            errors = [line for line in err.text.splitlines() if line.startswith("error:")]
            raise CommandError(errors[-1][len("error: "):] if errors else f"exit status {code}", returncode=code)


#: Django's standard options (every management command takes them): manage.py acts on
#: --settings and --pythonpath before running any command; the others are accepted and
#: have nothing to change in the outbox commands, whose output is their own.
_DJANGO_VALUE_OPTIONS = ("--settings", "--pythonpath", "--verbosity", "-v")
_DJANGO_FLAGS = ("--traceback", "--no-color", "--force-color", "--skip-checks")


def _without_django_options(args: list[str]) -> list[str]:
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in _DJANGO_VALUE_OPTIONS:
            skip = True
        elif arg in _DJANGO_FLAGS or arg.startswith(tuple(f"{o}=" for o in _DJANGO_VALUE_OPTIONS)) or arg.startswith("-v") and arg[2:].isdigit():
            continue
        else:
            kept.append(arg)
    return kept


def _command(path: list[str]) -> click.Command:
    """The click command at ``path`` under ``outbox`` (``["dead"]`` is the dead group)."""
    from outbox.cli import main

    command: click.Command = main
    for name in path:
        assert isinstance(command, click.Group)
        command = command.commands[name]
    return command


class _Capture:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass
