"""``quarantine CHECKPOINT --reason TEXT`` and ``release CHECKPOINT``: set a complete checkpoint aside from automatic
selection and retention, and back (``runtime.quarantine``; the record and who reads it: ``core.quarantine``).

Also what the other commands show of a mark: :func:`mark_of` and :func:`mark_line` (``verify``, ``inspect``). File
work only: no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..core.remote import split
from ..errors import CheckpointConfigurationError, CheckpointIntegrityError
from . import _output as out
from . import _remote as remote
from ._scan import PathKindError, checkpoint_manifest

JSON_HELP = "Print only JSON on stdout (messages and log lines go to stderr)."


def _checked(checkpoint: Path | str, reason: str) -> None:
    """A usage error (exit 2) naming what ``checkpoint`` is instead of a complete checkpoint (a run directory or a
    prefix of checkpoints: the command to run instead), or what is wrong with ``reason``."""
    from ..core.quarantine import check_reason
    from ..runtime.quarantine import checked_local, checked_remote

    try:
        check_reason(reason)
        (remote.checkpoint_manifest if remote.is_url(checkpoint) else checkpoint_manifest)(checkpoint, "quarantine")  # type: ignore[operator]
    except PathKindError as exc:
        raise click.UsageError(str(exc)) from None
    except CheckpointIntegrityError:  # a staging or legacy directory, an unfinished upload: said below, for a quarantine
        pass
    except CheckpointConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        if remote.is_url(checkpoint):
            checked_remote(str(checkpoint))
        else:
            checked_local(Path(checkpoint).absolute())
    except CheckpointConfigurationError as exc:
        raise click.UsageError(str(exc)) from None


def mark_of(checkpoint: Path | str, manifest: dict[str, Any] | None = None) -> Any:
    """The mark that sets ``checkpoint`` aside (``core.quarantine.Mark``), ``None`` if none does."""
    from ..runtime.quarantine import mark_of as find

    return find(checkpoint, manifest)


def mark_line(checkpoint: Path | str, mark: Any) -> str:
    """What ``verify`` and ``inspect`` say of a quarantined checkpoint."""
    return (f"{mark.describe()}. Automatic selection skips it and retention keeps it; an explicit load still loads it. "
            f"'accelerate-txn release {checkpoint}' undoes it")


@click.command("quarantine", short_help="Set a complete checkpoint aside: selection skips it, retention keeps it.")
@click.argument("checkpoint", type=remote.Location())
@click.option("--reason", required=True, help="Why (a line for the listing and the logs), e.g. 'loss NaN 3 steps "
              "after resume'.")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def quarantine_command(checkpoint: Path | str, reason: str, as_json: bool) -> int:
    """Set a complete checkpoint aside: load_state() without a path, train(resume_from_checkpoint=True) and 'latest'
    skip it and fall back to the previous complete checkpoint; retention (total_limit, save_total_limit, 'prune')
    neither counts nor deletes it. An explicit load of its path still loads it, with a warning.

    Nothing inside the checkpoint changes (it still verifies): the mark is a small JSON file beside it,
    .NAME.quarantine.json (an object beside the prefix in a bucket), holding the reason, the time, the user and the
    host. Exit 2 for a path that is not a complete checkpoint (a staging directory, a legacy checkpoint without a
    manifest, something else). 'release' undoes it.
    """
    from ..runtime.quarantine import set_aside

    _checked(checkpoint, reason)
    with out.quiet("accelerate_txn.runtime.quarantine"):  # its log line says what is printed below
        mark, changed = set_aside(checkpoint, reason)
    if as_json:
        out.emit_json({"checkpoint": str(checkpoint), "quarantined": True, "changed": changed, "mark": mark.as_json()})
        return 0
    parent = split(str(checkpoint))[0] if remote.is_url(checkpoint) else Path(checkpoint).parent
    if changed:
        out.say(f"{checkpoint}: {mark.describe()}")
    else:
        out.say(f"{checkpoint}: already {mark.describe()} (unchanged)")
    out.say(f"automatic selection skips it and retention keeps it; 'accelerate-txn latest {parent}' shows the checkpoint "
            f"a resume takes now; 'accelerate-txn release {checkpoint}' undoes it")
    return 0


@click.command("release", short_help="Undo 'quarantine': selection and retention treat the checkpoint as before.")
@click.argument("checkpoint", type=remote.Location())
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def release_command(checkpoint: Path | str, as_json: bool) -> int:
    """Undo 'quarantine': automatic selection may take the checkpoint again and retention counts it. The mark stays
    beside it as the record of the quarantine and of who released it (until retention deletes the checkpoint).
    A checkpoint that is not quarantined is left as it is (exit 0).
    """
    from ..runtime.quarantine import lift

    with out.quiet("accelerate_txn.runtime.quarantine"):
        mark = lift(checkpoint)
    if as_json:
        out.emit_json({"checkpoint": str(checkpoint), "released": mark is not None,
                       "mark": None if mark is None else mark.as_json()})
        return 0
    if mark is None:
        out.say(f"{checkpoint} is not quarantined: nothing to release")
        return 0
    by = mark.released or {}
    out.say(f"{checkpoint}: released by {by.get('user')}@{by.get('host')} at {by.get('time')} (it was quarantined by "
            f"{mark.user}@{mark.host} at {mark.time}: {mark.reason}); automatic selection may take it again")
    return 0


COMMANDS = (quarantine_command, release_command)
