"""The ``accelerate-txn`` group and :func:`main`: exit statuses and errors without tracebacks.

Exit status: 0 success; 1 a negative answer or a failed operation (the library's error message on stderr);
2 a usage error (a missing path, the wrong kind of directory, a bad option value).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from ..errors import CheckpointError
from . import _output as out
from ._commands import COMMANDS
from ._quarantine import COMMANDS as QUARANTINE_COMMANDS
from ._remote import client_error

PROG = "accelerate-txn"


def _version() -> str:
    from .. import __version__

    return __version__


@click.group(name=PROG, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(version=_version(), prog_name=PROG, message="%(prog)s %(version)s")
def app() -> None:
    """Inspect, verify, prune and export accelerate-txn checkpoints (offline, one CPU process).

    Every command takes --json to print only JSON on stdout. Exit status: 0 success, 1 a negative answer or a
    failed operation (invalid checkpoint, no checkpoint, configurations differ), 2 a usage error.
    """


for _command in (*COMMANDS, *QUARANTINE_COMMANDS):
    app.add_command(_command)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``) and return the exit status; never raises
    for a user error and never prints a traceback for one."""
    args = list(sys.argv[1:] if argv is None else argv)
    with out.tolerant_streams():  # any stream encoding (LC_ALL=C, PYTHONIOENCODING=ascii): never UnicodeEncodeError
        return _run(args)


def _run(args: list[str]) -> int:
    try:
        with out.library_logs():
            result = app.main(args=args, prog_name=PROG, standalone_mode=False)
    except click.exceptions.Exit as exc:  # --help, --version
        return int(exc.exit_code)
    except click.ClickException as exc:  # usage errors: exit status 2
        exc.show(file=sys.stderr)
        return int(exc.exit_code)
    except click.exceptions.Abort:
        out.say("aborted", err=True)
        return 1
    except CheckpointError as exc:
        out.say(f"{PROG}: {exc}", err=True)
        return 1
    except OSError as exc:  # e.g. permission denied on a checkpoint file
        out.say(f"{PROG}: {client_error(exc) or exc}", err=True)
        return 1
    except KeyboardInterrupt:
        out.say("interrupted", err=True)
        return 130
    except Exception as exc:  # an object-store client's own error (no credentials, endpoint unreachable)
        message = client_error(exc)
        if message is None:
            raise
        out.say(f"{PROG}: {message}", err=True)
        return 1
    return int(result or 0)
