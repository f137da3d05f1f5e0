"""Output of the command line: JSON (only JSON on stdout), human text and rich tables, log lines on stderr.

rich is imported only for human output, so ``--json`` and plain lines stay cheap.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True, default=str))


def say(text: str = "", *, err: bool = False) -> None:
    click.echo(text, err=err)


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
        click.echo(f"{record.levelname.lower()}: {record.getMessage()}", err=True)


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
