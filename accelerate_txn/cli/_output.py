"""Output of the command line: JSON (only JSON on stdout), human text and rich tables, log lines on stderr.

rich is imported only for human output, so ``--json`` and plain lines stay cheap.

Any stream encoding works: :func:`tolerant_streams` (around every command) makes a stream that cannot encode a
character write an escape (``\\u2192``) instead of raising ``UnicodeEncodeError``, every line goes to the current
``sys.stdout``/``sys.stderr`` in that stream's own encoding (an ASCII stream gets ASCII), and the few symbols the
output uses fall back to ASCII (:func:`symbol`: "->" for the arrow, "..." for an ellipsis) where the stream cannot
encode them.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

ARROW = ("\u2192", "->")
ELLIPSIS = ("\u2026", "...")


def _stream(err: bool) -> Any:
    return sys.stderr if err else sys.stdout


def symbol(choice: tuple[str, str], *, err: bool = False) -> str:
    """``choice[0]`` if the stream (stdout, or stderr with ``err``) can encode it, else its ASCII ``choice[1]``."""
    fancy, plain = choice
    try:
        fancy.encode(getattr(_stream(err), "encoding", None) or "ascii")
    except (UnicodeError, LookupError):
        return plain
    return fancy


@contextmanager
def tolerant_streams() -> Iterator[None]:
    """While a command runs, stdout and stderr write an escape for a character their encoding lacks (a path with
    non-ASCII or undecodable bytes on an ASCII or strict stream) instead of raising; restored afterwards."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (OSError, ValueError, TypeError, AttributeError):  # a stream that cannot change: left as it is
                continue
            changed.append(stream)
    try:
        yield
    finally:
        for stream in changed:
            try:
                stream.reconfigure(errors="strict")
            except (OSError, ValueError, TypeError, AttributeError):
                pass


def emit_json(value: Any) -> None:
    say(json.dumps(value, indent=2, sort_keys=True, default=str))  # ensure_ascii: plain ASCII on any stream


def say(text: str = "", *, err: bool = False) -> None:
    # The stream itself, not click's default: for an ASCII stream click substitutes a UTF-8 writer of its own, so
    # output would not be in the encoding the environment asked for.
    click.echo(text, file=_stream(err))


def console(*, err: bool = False) -> Any:
    """A rich console on the current stdout (or stderr); plain text when it is not a terminal."""
    from rich.console import Console

    stream = sys.stderr if err else sys.stdout
    result = Console(file=stream, highlight=False)
    # Not a terminal (a pipe, a file, a test): rich would assume 80 columns and fold long names.
    return result if result.is_terminal else Console(file=stream, highlight=False, width=160)


def table(title: str | None, columns: list[tuple[str, str]], rows: list[list[str]]) -> Any:
    """A compact rich table; ``columns`` are ``(header, justify)``."""
    from rich import box
    from rich.table import Table

    result = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, show_edge=False)
    for header, justify in columns:
        result.add_column(header, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for row in rows:
        result.add_row(*row)
    return result


def size_text(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def age_text(seconds: float) -> str:
    whole = max(0, int(seconds))
    for limit, divisor, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if whole < limit:
            return f"{whole // divisor}{unit}"
    return f"{whole // 86400}d"


class _EchoHandler(logging.Handler):
    """Library log lines (e.g. why a candidate was skipped) on the current stderr, however often it is replaced."""

    def emit(self, record: logging.LogRecord) -> None:
        say(f"{record.levelname.lower()}: {record.getMessage()}", err=True)


@contextmanager
def library_logs(level: int = logging.WARNING) -> Iterator[None]:
    """Show the library's log lines of ``level`` and above on stderr while a command runs."""
    logger = logging.getLogger("accelerate_txn")
    handler = _EchoHandler(level)
    previous = logger.level
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@contextmanager
def quiet(name: str) -> Iterator[None]:
    """Silence one library logger (its messages are shown another way, e.g. in a table)."""
    logger = logging.getLogger(name)
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled
