"""Commands' failures as one line on stderr and exit status 1, passwords masked: the
decorator of every ``outbox`` command, ``outbox pipeline``'s too."""

from __future__ import annotations

import functools
import os
import select
import sys
from collections.abc import Callable
from typing import Any

import click

from ..core.errors import OutboxError
from ..core.redact import redact


def _one_line(text: str, first_line: bool) -> str:
    if first_line:  # Spark's errors run to pages: the first line says what failed
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return (lines[0] if lines else "")[:300]
    return " ".join(text.split())


def one_line_errors(command: Callable[..., Any] | None = None, *,
                    explain: Callable[[Exception], str | None] | None = None,
                    first_line: bool = False) -> Any:
    """Turn any failure of ``command`` into ``error: ...`` on stderr and exit status 1.

    ``explain`` may put a driver error in the user's terms (None: it cannot);
    ``first_line`` keeps only an error's first line."""
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return command(*args, **kwargs)
            except (click.exceptions.Exit, click.ClickException, click.Abort):
                raise
            except OutboxError as exc:
                click.echo(redact(f"error: {_one_line(str(exc), first_line)}"), err=True)
            except Exception as exc:  # noqa: BLE001 - driver errors: explained when we can, else the type in one line
                if isinstance(exc, BrokenPipeError) and _stdout_is_gone():
                    sys.exit(1)  # `outbox status | head -1`: the reader left; nothing to say
                hint = None
                if explain is not None:
                    try:
                        hint = explain(exc)
                    except Exception:  # noqa: BLE001 - explaining must never hide the original error
                        hint = None
                detail = _one_line(str(exc), first_line) or type(exc).__name__
                click.echo(redact(f"error: {hint}" if hint else f"error: {type(exc).__name__}: {detail}"), err=True)
            sys.exit(1)
        return wrapper
    return decorate if command is None else decorate(command)


def _stdout_is_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (poll says POLLERR; a
    socket's broken pipe is then told apart, and said as any failure). Standard output is
    then pointed at /dev/null, so that the interpreter's flush at exit prints no traceback
    (as the Python docs' "Note on SIGPIPE" does it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, ValueError, OSError):  # no poll() (Windows), or no descriptor behind stdout
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


__all__ = ["one_line_errors"]
