"""The commands. Each returns its exit status: 0 success, 1 a negative answer or a failed operation (invalid
checkpoint, no checkpoint, configurations differ), 2 a usage error (raised as :class:`click.UsageError`).

``list``, ``verify``, ``latest`` and ``prune`` do file work and never import torch themselves; ``inspect`` and
``diff`` read manifests only; ``export`` imports torch; ``doctor`` (:mod:`._doctor`) torch, Accelerate and
transformers. Every path naming a checkpoint or a run directory may be an object-store URL instead (``_remote``).
"""

from __future__ import annotations

import contextlib
import functools
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from ..errors import CheckpointError, CheckpointIntegrityError, NoCheckpointError
from . import _output as out
from . import _remote as remote
from ._doctor import doctor_command
from ._export_config import carried_config, given_config
from ._quarantine import mark_line, mark_of
from ._scan import (
    COMPLETE,
    CORRUPT,
    LEGACY,
    QUARANTINED,
    PathKindError,
    checkpoint_manifest,
    checkpoint_number,
    component_steps,
    is_trainer_run,
    optimizer_step_text,
    plural,
    progress_text,
    resume_call,
    run_directory_hint,
    scan_run_directory,
    step_text,
    verify_checkpoint,
)

JSON_HELP = "Print only JSON on stdout (messages and log lines go to stderr)."
#: Differences ``diff`` prints without --all.
DIFF_LINES = 20
_EXISTING_DIR = click.Path(exists=True, file_okay=True, dir_okay=True, path_type=Path)
#: A checkpoint or a run directory: an existing local path, or an object-store URL (a ``str``).
_LOCATION = remote.Location()
#: --dtype names: torch's own names and the usual short ones.
DTYPES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
    "fp64": "float64", "float64": "float64", "double": "float64",
}


def _json_option(function: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help=JSON_HELP)(function)


KEY_HELP = ("A verification key file (HMAC secret, or Ed25519 PEM key); repeat for several (key rotation). A "
            "checkpoint without a valid authenticator of one of them is refused. Default: the files "
            "ACCELERATE_TXN_VERIFY_KEYS lists (and ACCELERATE_TXN_SIGNING_KEY_FILE); none: no authenticator required.")


def _key_option(function: Callable[..., Any]) -> Callable[..., Any]:
    """``--key FILE`` (repeatable): the command's checks verify manifests' authenticators with these keys instead of
    the environment's (``core.signing``). A file that holds no key (missing, unreadable, too short) is a bad option
    value: a usage error (exit 2) naming the file and the fix, before the command does anything."""

    @functools.wraps(function)
    def run(*args: Any, keys: tuple[str, ...] = (), **kwargs: Any) -> Any:
        if not keys:
            return function(*args, **kwargs)
        from ..core.signing import keyring, using
        from ..errors import CheckpointConfigurationError

        try:
            keys_given = keyring(None, keys)
        except CheckpointConfigurationError as exc:
            raise click.BadParameter(str(exc), param_hint="'--key'") from None
        with using(keys_given):
            return function(*args, **kwargs)

    return click.option("--key", "keys", multiple=True, metavar="FILE", type=click.Path(dir_okay=False),
                        help=KEY_HELP)(run)


def _run_directory(path: Path, command: str) -> Path:
    """``path`` as a run directory, or a usage error saying what it is instead (a checkpoint; a project directory or
    a directory of runs, with the run directories below it)."""
    from ..core.manifest import MANIFEST

    if not path.is_dir():
        raise click.UsageError(f"{path} is a file, not a run directory (a directory of checkpoint_N)")
    if (path / MANIFEST).exists():
        raise click.UsageError(
            f"{path} is a checkpoint, not a run directory: check it with 'accelerate-txn verify {path}' or read it "
            f"with 'accelerate-txn inspect {path}'; list its run with 'accelerate-txn list {path.parent}'"
        )
    hint = run_directory_hint(path, command)
    if hint is not None:
        raise click.UsageError(hint)
    return path


def _would_load(root: Path, trainer: bool = False) -> str | None:
    """The checkpoint load_state() would resume from under ``root``, by the library's own selection
    (``core.select.latest_checkpoint``) with the default legacy policy (``ALLOW_LEGACY_DEFAULT``: the command line
    has no Accelerator): the newest complete checkpoint, else a legacy one; ``None`` for an empty directory.
    ``trainer``: a Trainer output directory, judged by the Trainer's rules (``trainer.layout.TrainerRules``: every file
    a resume reads present for every saving rank; a native Trainer checkpoint only when no complete one exists), as
    ``train(resume_from_checkpoint=True)`` judges it. Raises :class:`NoCheckpointError` when candidates exist but
    none would load."""
    from ..core.select import ALLOW_LEGACY_DEFAULT, latest_checkpoint

    if trainer:
        from ..trainer.layout import TrainerRules

        return latest_checkpoint(root, TrainerRules(None, offline=True), full=True)
    return latest_checkpoint(root, full=True, legacy=ALLOW_LEGACY_DEFAULT)


def _age(modified: float | None, now: float) -> str:
    return "-" if modified is None else out.age_text(now - modified)  # an object listing has no times


def _status_cell(status: str) -> Any:
    """The status for a table: corrupt in red, legacy and leftovers in yellow, complete in green (no colour when
    stdout is not a terminal)."""
    from rich.text import Text

    style = {COMPLETE: "green", CORRUPT: "bold red", LEGACY: "yellow", QUARANTINED: "magenta"}.get(status, "yellow")
    return Text(status, style=style)


def _checkpoint(path: Path | str, command: str) -> dict[str, Any]:
    try:
        if remote.is_url(path):
            return remote.checkpoint_manifest(str(path), command)
        return checkpoint_manifest(path, command)  # type: ignore[arg-type]
    except PathKindError as exc:
        raise click.UsageError(str(exc)) from None


# --------------------------------------------------------------------------------------------- list


@click.command("list", short_help="List a run directory's checkpoints and the one load_state() would pick.")
@click.argument("directory", type=_LOCATION)
@_json_option
@_key_option
def list_command(directory: Path | str, as_json: bool) -> int:
    """List every checkpoint of a run directory (or an s3:// prefix), newest first.

    In a transformers Trainer output directory (checkpoint-N), the step is Trainer's global step and the mark is
    the one train(resume_from_checkpoint=True) would take.

    Exit 1 if there is nothing to list (no checkpoint, no leftover; the message goes to stderr, --json still prints
    the empty listing).

    Shows each checkpoint_N and leftover with its status (complete, staging leftover, retired leftover, legacy,
    corrupt, with the reason; under a URL also unfinished upload), optimizer step, Accelerator step, run id, size,
    age and integrity mode, and marks the one load_state() would resume from (the newest complete checkpoint, else
    a legacy one; load_state() also checks that it fits the live Accelerator).
    """

    root: Path | str
    trainer = False
    if remote.is_url(directory):
        root = remote.run_prefix(str(directory), "list")
        entries: list[Any] = remote.scan(root)
        pick = next((str(entry.path) for entry in entries if entry.status == COMPLETE), None)
    else:
        root = _run_directory(Path(directory), "list")
        trainer = is_trainer_run(root)
        entries = scan_run_directory(root, trainer)
        try:
            with out.quiet("accelerate_txn.core.select"):  # its skip reasons are in the table already
                pick = _would_load(root, trainer)
        except NoCheckpointError:
            pick = None
    for entry in entries:
        entry.selected = pick is not None and str(entry.path) == pick
    now = time.time()
    if as_json:
        out.emit_json({"directory": str(root), "trainer": trainer, "would_load": pick,
                       "checkpoints": [entry.as_json(now) for entry in entries]})
    if not entries:  # nothing there: exit 1, as ``latest`` (a script tells an empty listing apart by the status)
        out.say(f"{root}: no checkpoints", err=True)
        return 1
    if as_json:
        return 0
    rows = []
    arrow, ellipsis = out.symbol(out.ARROW), out.symbol(out.ELLIPSIS)  # ASCII where stdout cannot encode them
    for entry in entries:
        manifest = entry.manifest or {}
        rows.append([arrow if entry.selected else "", entry.short_name(ellipsis), _status_cell(entry.status),
                     optimizer_step_text(manifest) if entry.manifest else "-",
                     step_text(manifest) if entry.manifest else "-", (entry.run_id or "-")[:8],
                     out.size_text(entry.size()), _age(entry.modified(), now),
                     str(manifest.get("integrity", "-"))])
    console = out.console()
    console.print(out.table(f"{root}", [("", "left"), ("checkpoint", "left"), ("status", "left"), ("step", "right"),
                                        ("acc.step", "right"), ("run", "left"), ("size", "right"), ("age", "right"),
                                        ("integrity", "left")], rows))
    for entry in entries:
        if entry.reason:
            out.say(f"  {entry.name}: {entry.reason}")
    for note, names in _shared_notes(entries).items():  # once per listing, not once per checkpoint
        out.say(f"  {names}: {note}")
    picked = next((entry for entry in entries if entry.selected), None)
    if remote.is_url(root):
        out.say(f"newest complete checkpoint: {remote.name_of(pick)}, the one a resume from this prefix takes (as a "
                "mirror); large payloads were checked by size only here, 'accelerate-txn latest' downloads and "
                "hashes every file" if pick else "no complete checkpoint here: a resume from this prefix finds none")
    elif pick is None:
        out.say(f"{resume_call(trainer)} would find no checkpoint to resume from here (a resume raises "
                "NoCheckpointError).")
    elif picked is not None and picked.status == LEGACY:  # what that means is the note above
        out.say(f"{resume_call(trainer)} would resume from {Path(pick).name}, which has no completion manifest (see "
                "above)")
    else:
        out.say(f"{resume_call(trainer)} would resume from {Path(pick).name}")
    return 0


def _shared_notes(entries: list[Any], shown: int = 5) -> dict[str, str]:
    """Each note entries share (``Entry.note``: a native checkpoint's explanation), with the names of the entries it
    applies to (the first ``shown``, then how many more), in listing order."""
    groups: dict[str, list[str]] = {}
    for entry in entries:
        if entry.note:
            groups.setdefault(entry.note, []).append(entry.name)
    return {note: ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
            for note, names in groups.items()}


# --------------------------------------------------------------------------------------------- verify


@contextlib.contextmanager
def _hash_progress(manifest: dict[str, Any], full: bool, *, enabled: bool) -> Iterator[Any]:
    """A progress bar on stderr over the bytes to re-hash, only on a terminal and for more than 256 MiB."""
    from ..core.manifest import hashed_names

    try:
        files = manifest["files"]
        total = sum(files[name]["size"] for name in hashed_names(manifest, full=full))
    except (KeyError, TypeError, AttributeError):  # a malformed manifest: verify reports it, no bar
        total = 0
    if not enabled or total < 256 * 2**20 or not sys.stderr.isatty():
        yield None
        return
    import threading

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, TimeRemainingColumn
    from rich.text import Text

    class SpeedColumn(ProgressColumn):  # rich's TransferSpeedColumn has decimal units only: MiB/s, as `list` sizes
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{out.size_text(int(speed))}/s", style="progress.data.speed")

    lock = threading.Lock()
    with Progress("re-hashing", BarColumn(), DownloadColumn(binary_units=True), SpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("hash", total=total)

        def advance(nbytes: int) -> None:  # called from the hashing threads
            with lock:
                bar.update(task, advance=nbytes)

        yield advance


@click.command("verify", short_help="Check a checkpoint against its manifest (exit 0 valid, 1 invalid).")
@click.argument("checkpoint", type=_LOCATION)
@click.option("--full", is_flag=True, help="Re-hash every file that has a recorded hash, large payloads included "
              "(for a URL: download every file into a temporary directory).")
@click.option("--dcp", is_flag=True, help="Also re-read DCP .metadata files (schemas, payload lists); loads torch.")
@_json_option
@_key_option
def verify_command(checkpoint: Path | str, full: bool, dcp: bool, as_json: bool) -> int:
    """Check a checkpoint against its manifest: exit 0 valid, 1 invalid, 2 usage error.

    Checks the manifest, that the directory holds exactly the files of its inventory with their recorded sizes,
    and the content hashes of control files and small payloads (of every hashed file with --full). Says what it
    did not check. For an s3:// checkpoint the objects are checked from a listing, and the files to hash are
    downloaded into a temporary directory (removed afterwards).
    """
    from ..core.select import symlink_reason

    url = remote.is_url(checkpoint)
    try:
        link = None if url else symlink_reason(checkpoint)  # type: ignore[arg-type]
        if link is not None:  # never verified through the link
            raise CheckpointIntegrityError(f"it is {link}")
        manifest = _checkpoint(checkpoint, "verify")
    except CheckpointIntegrityError as exc:
        if as_json:
            out.emit_json({"path": str(checkpoint), "valid": False, "error": str(exc)})
        out.say(f"{checkpoint}: NOT a valid checkpoint: {exc}", err=True)
        return 1
    with _hash_progress(manifest, full, enabled=not as_json) as progress:
        check = remote.verify if url else verify_checkpoint
        result = check(checkpoint, manifest, full=full, dcp=dcp, progress=progress)  # type: ignore[operator]
    mark = mark_of(checkpoint, manifest)  # verified all the same: a quarantine is an operator's, not a defect
    if as_json:
        out.emit_json({**result.as_json(), "quarantine": None if mark is None else mark.as_json()})
    if not result.valid:
        out.say(f"{checkpoint}: NOT a valid checkpoint: {result.error}", err=True)
        return 1
    if as_json:
        return 0
    report = result.report
    out.say(f"{checkpoint}: valid (run {manifest.get('run_id')}, protocol {manifest.get('protocol')}, integrity "
            f"{report.get('integrity')}, {progress_text(manifest)})")
    if mark is not None:
        out.say(mark_line(checkpoint, mark))
    out.say("checked:")
    files, hashed = report["files"], report["hashed"]
    out.say(f"  {files} {plural(files, 'file')} present with {plural(files, 'its', 'their')} recorded "
            f"{plural(files, 'size')}" + (" (objects of one listing)" if url else ", no symbolic links"))
    out.say(f"  content of {hashed} {plural(hashed, 'file')} {'downloaded and ' if url else 're-'}hashed "
            f"({report.get('algorithm')}) and equal to the manifest")
    extra = report.get("extra")
    if extra is not None:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        out.say("  no unlisted file that a loader would read" + (
            f"; {len(extra)} unlisted {plural(len(extra), 'file')} no loader reads: {', '.join(extra[:5])}{more}"
            if extra else ""))
    carried = report.get("user_files")
    if carried:
        out.say(f"  {len(carried)} user {plural(len(carried), 'file')} carried from the checkpoint it replaced, outside "
                "the inventory (not verified): " + ", ".join(carried[:5])
                + (f" and {len(carried) - 5} more" if len(carried) > 5 else ""))
    if report.get("trainer_required"):
        count = report["trainer_required"]
        out.say(f"  the {count} {plural(count, 'file')} a Trainer resume reads (trainer_state.json, every saving rank's "
                "RNG state, the scheduler, the DCP metadata) in the inventory")
    if report.get("signed_by"):
        out.say(f"  the manifest's authenticator, made with key {report['signed_by']}")
    if report.get("dcp_metadata"):
        count = report["dcp_metadata"]
        out.say(f"  DCP metadata of {count} {plural(count, 'directory', 'directories')}: schemas and payload lists")
    out.say("not checked:")
    for note in result.not_checked():
        out.say(f"  {note}")
    effect = result.full_effect()
    if effect:
        out.say(effect)
    return 0


# --------------------------------------------------------------------------------------------- inspect


def _model_line(model: dict[str, Any]) -> str:
    fsdp = f", {model['fsdp_units']} FSDP units ({', '.join(model['sharding'])})" if model["fsdp_units"] else ""
    frozen = model["parameters"] - model["trainable"]
    return (f"{model['id']!r}: {model['class']}, {model['parameters']:,} parameters"
            + (f" ({frozen:,} frozen)" if frozen else "") + f" in {model['tensors']} tensors, "
            + "/".join(dtype.removeprefix("torch.") for dtype in model["dtypes"]) + fsdp)


def _inspect_lines(name: str, summary: dict[str, Any]) -> list[str]:
    lines = [f"component {name!r}:" if name else "training configuration:",
             f"  world size {summary['world_size']}, backend {summary['backend']}, mixed precision "
             f"{summary['mixed_precision']}, gradient accumulation {summary['accumulation_steps']}"]
    lines += [f"  model {_model_line(model)}" for model in summary["models"]]
    for index, optimizer in enumerate(summary["optimizers"]):
        count = len(optimizer["groups"])
        sizes = " + ".join(str(n) for n in optimizer["groups"]) or "0"
        lines.append(f"  optimizer {index}: {optimizer['class']}, {count} group{'s' if count != 1 else ''} "
                     f"({sizes} parameter tensors)")
    for scheduler in summary["schedulers"]:
        functions = f" ({', '.join(scheduler['functions'])})" if scheduler["functions"] else ""
        lines.append(f"  scheduler: {scheduler['class']} on optimizer {scheduler['optimizer']}{functions}")
    for loader in summary["dataloaders"]:
        order = "".join(f", {label} {loader[key]}" for key, label in (("batch_size", "batch size"),
                                                                      ("dataset_length", "dataset length"))
                        if loader.get(key) is not None)  # recorded since the order settings are (else unknown)
        lines.append(f"  dataloader: {loader.get('class')} over {loader.get('dataset')}, {loader.get('workers')} "
                     f"workers{', stateful' if loader.get('stateful') else ''}{order}")
    if summary["custom_objects"]:
        lines.append(f"  custom objects: {', '.join(map(str, summary['custom_objects']))}")
    if summary["scaler"]:
        lines.append(f"  gradient scaler: {summary['scaler']}")
    for filename, state in summary["private_states"].items():
        lines.append(f"  registered state {filename}: generators {', '.join(state['generators']) or '-'}; "
                     f"progress {', '.join(map(str, state['progress_keys'])) or '-'}")
    training = summary["training"]
    lines.append("  training metadata: " + (", ".join(f"{k}={v!r}" for k, v in sorted(training.items())) or "none"))
    return lines


@click.command("inspect", short_help="Show the training configuration a checkpoint was saved for.")
@click.argument("checkpoint", type=_LOCATION)
@_json_option
def inspect_command(checkpoint: Path | str, as_json: bool) -> int:
    """Show what a checkpoint was saved for: models and parameter counts, optimizers and their groups,
    schedulers, precision, world size, versions and training metadata (read from its manifest, not verified)."""
    from ._describe import summarize

    manifest = _checkpoint(checkpoint, "inspect")
    components = manifest.get("components") if isinstance(manifest.get("components"), dict) else {}
    summaries = {name: summarize(descriptor) for name, descriptor in sorted(components.items())}
    mark = mark_of(checkpoint, manifest)
    if as_json:
        out.emit_json({"path": str(checkpoint), "run_id": manifest.get("run_id"), "protocol": manifest.get("protocol"),
                       "integrity": manifest.get("integrity"), "versions": manifest.get("versions"),
                       "steps": component_steps(manifest), "checkpoint_number": checkpoint_number(manifest),
                       "frontend": manifest.get("frontend"), "trainer": manifest.get("trainer"),
                       "components": summaries,
                       "rank_state": manifest.get("rank_state"), "resharded_from": manifest.get("resharded_from"),
                       "user_files": _user_files(manifest), "quarantine": None if mark is None else mark.as_json()})
        return 0
    versions = manifest.get("versions") if isinstance(manifest.get("versions"), dict) else {}
    out.say(f"{checkpoint} (run {manifest.get('run_id')}, protocol {manifest.get('protocol')}, integrity "
            f"{manifest.get('integrity')}; not verified here: see 'accelerate-txn verify')")
    out.say("saved with " + (", ".join(f"{k} {v}" for k, v in sorted(versions.items())) or "unknown versions")
            + f"; {progress_text(manifest)}")
    if mark is not None:
        out.say(mark_line(checkpoint, mark))
    trainer = manifest.get("trainer") if isinstance(manifest.get("trainer"), dict) else None
    if trainer is not None:
        for line in _trainer_lines(trainer):
            out.say(line)
    elif not summaries:
        out.say("the manifest records no training configuration")
    for name, summary in summaries.items():
        for line in _inspect_lines(name, summary):
            out.say(line)
    for line in _rank_lines(manifest):
        out.say(line)
    user = _user_files(manifest)
    if user:
        out.say(f"{len(user)} user {plural(len(user), 'file')} carried from the checkpoint this one replaced (not "
                "checkpoint content: not hashed, not verified):")
        for name, size in user.items():
            out.say(f"  {name} ({out.size_text(size)})")
    return 0


def _user_files(manifest: dict[str, Any]) -> dict[str, int]:
    """The manifest's ``user_files`` as ``{name: size}`` (an unreadable list: none; ``verify`` reports it)."""
    rows = manifest.get("user_files")
    if not isinstance(rows, dict):
        return {}
    return {str(name): row["size"] for name, row in sorted(rows.items())
            if isinstance(row, dict) and isinstance(row.get("size"), int)}


def _trainer_lines(record: dict[str, Any]) -> list[str]:
    """What a Trainer manifest records of the saving Trainer (``trainer.layout.training_record``)."""
    arguments = record.get("arguments") if isinstance(record.get("arguments"), dict) else {}
    required = record.get("required") if isinstance(record.get("required"), list) else []
    return [
        "saved by transformers.Trainer:",
        f"  world size {record.get('world_size')}, backend {record.get('backend')}, state dict type "
        f"{record.get('state_dict_type') or '-'}, global step {record.get('global_step')}"
        + (", model only (save_only_model)" if record.get("save_only_model") else ""),
        "  arguments: " + (", ".join(f"{k}={v!r}" for k, v in sorted(arguments.items())) or "none"),
        f"  files a resume reads: {', '.join(map(str, required)) or '-'}",
    ]


def _rank_lines(manifest: dict[str, Any]) -> list[str]:
    """The per-rank state policy (elastic resume) and, after one, where this checkpoint's run was resharded from."""
    lines = []
    rank_state = manifest.get("rank_state")
    if isinstance(rank_state, dict):
        files = rank_state.get("files") if isinstance(rank_state.get("files"), list) else []
        lines.append(f"per-rank state policy {rank_state.get('policy')} (files {', '.join(map(str, files)) or '-'})")
    lineage = manifest.get("resharded_from")
    for name, record in sorted(lineage.items()) if isinstance(lineage, dict) else ():
        if isinstance(record, dict):
            lines.append(f"{'component ' + repr(name) + ' ' if name else ''}resumed elastically from "
                         f"{record.get('checkpoint')}: {record.get('saved_world_size')} -> {record.get('world_size')} "
                         f"ranks, state sources {record.get('sources')}, derived {record.get('derived')}, dropped "
                         f"{record.get('dropped')}")
    return lines


# --------------------------------------------------------------------------------------------- diff


@click.command("diff", short_help="Explain why a run configured like B could not resume from A.")
@click.argument("saved", metavar="A", type=_LOCATION)
@click.argument("other", metavar="B", type=_LOCATION)
@click.option("--allow-reshard", is_flag=True,
              help="Compare as a run with configure_checkpointing(allow_reshard=True): a world-size change is allowed.")
@click.option("--all", "show_all", is_flag=True,
              help=f"Print every difference (without it, the first {DIFF_LINES}; --json always has every one).")
@_json_option
def diff_command(saved: Path | str, other: Path | str, allow_reshard: bool, show_all: bool, as_json: bool) -> int:
    """Explain why a run configured like B could not resume from A: exit 0 if it could, 1 if not.

    Compares the training configurations both manifests record, as load_state() compares a checkpoint's saved
    configuration with the live Accelerator ("saved" is A, "live" is B).
    """
    from ._describe import resume_blockers

    first, second = _checkpoint(saved, "diff"), _checkpoint(other, "diff")
    blockers = resume_blockers(first, second, allow_reshard=allow_reshard)
    versions = [first.get("versions"), second.get("versions")]
    same_run = first.get("run_id") == second.get("run_id")
    lines = [line for blocker in blockers for line in blocker["differences"] or [blocker["message"]]]
    if as_json:  # every difference, always
        out.emit_json({"a": str(saved), "b": str(other), "would_resume": not blockers, "same_run": same_run,
                       "versions": {"a": versions[0], "b": versions[1]}, "blockers": blockers,
                       "differences_total": sum(len(blocker["differences"]) for blocker in blockers)})
        return 1 if blockers else 0
    if not same_run:
        out.say(f"note: different training runs ({first.get('run_id')} vs {second.get('run_id')})")
    if versions[0] != versions[1]:
        out.say(f"note: saved with other versions: {versions[0]} (A) vs {versions[1]} (B)")
    if not blockers:
        out.say(f"{other} records the same training configuration as {saved}: a run configured like B would resume A")
        return 0
    out.say(f"a run configured like {other} would not resume {saved} (saved = A, live = B):")
    shown = lines if show_all or len(lines) <= DIFF_LINES + 1 else lines[:DIFF_LINES]
    for line in shown:
        out.say(f"  {line}")
    if len(shown) < len(lines):
        out.say(f"  ... and {len(lines) - len(shown)} more (use --all)")
    return 1


# --------------------------------------------------------------------------------------------- prune


def _best_model(root: Path, entries: list[Any], run_id: str | None) -> list[Path]:
    """A Trainer run's ``best_model_checkpoint`` (as its newest complete checkpoint's ``trainer_state.json`` records
    it) when it is a checkpoint of ``root``: save-time retention never deletes it, nor does ``prune``."""
    import json

    from ..trainer.layout import TRAINER_STATE

    newest = max((e for e in entries if e.status == COMPLETE and e.run_id == run_id), key=lambda e: e.number,
                 default=None)
    if newest is None:
        return []
    try:
        best = json.loads((newest.path / TRAINER_STATE).read_text(encoding="utf-8")).get("best_model_checkpoint")
    except (OSError, ValueError, AttributeError):
        return []
    return [root / Path(best).name] if isinstance(best, str) and best and (root / Path(best).name).is_dir() else []


def _prune_plan(entries: list[Any], run_id: str, keep: int, spared: list[Path] = ()) -> tuple[list[Any], list[Any]]:  # type: ignore[assignment]
    """(deleted, kept) complete checkpoints of ``run_id`` under retention ``keep``, oldest first: the rule of
    ``accelerate_txn._select.prune`` (``retention_victims``: oldest first, never the newest listed nor ``spared``)."""
    from ..core.select import retention_victims

    ours = sorted((e for e in entries if e.status == COMPLETE and e.run_id == run_id), key=lambda e: e.number)
    doomed = set(retention_victims([entry.path for entry in ours], keep, keep=spared))
    return [e for e in ours if e.path in doomed], [e for e in ours if e.path not in doomed]


def _prune_run(root: Path | str, entries: list[Any], run_id: str | None,
               published_run: Callable[[Any], str | None] | None = None) -> str | None:
    """The run to prune (usage error if it is ambiguous or absent); refuses while a published checkpoint of it fails
    verification. ``published_run(entry)``: the run id its manifest commits (default: a local directory's)."""
    from ..core.select import complete_run_id

    published_run = published_run or (lambda entry: complete_run_id(entry.path))
    runs = sorted({entry.run_id for entry in entries if entry.status == COMPLETE and entry.run_id})
    if run_id is None and len(runs) > 1:
        raise click.UsageError(f"{root} holds complete checkpoints of {len(runs)} runs ({', '.join(runs)}): "
                               "choose one with --run-id")
    if run_id is not None and run_id not in runs:
        raise click.UsageError(f"{root} holds no complete checkpoint of run {run_id!r} (runs: {', '.join(runs) or 'none'})")
    run = run_id or (runs[0] if runs else None)
    suspect = [entry.name for entry in entries if entry.status not in (COMPLETE, QUARANTINED) and entry.run_id == run
               and entry.manifest is not None and published_run(entry) == run]
    if run and suspect:
        # Retention counts every published checkpoint of the run, verified or not: a corrupt one would count
        # toward --keep and good ones would go instead.
        one = len(suspect) == 1
        raise CheckpointIntegrityError(
            f"Refusing to prune {root}: {', '.join(suspect)} of run {run} {'is' if one else 'are'} published but "
            f"{'its' if one else 'their'} contents fail verification (see 'accelerate-txn list'), and retention would count "
            f"{'it as a checkpoint' if one else 'them as checkpoints'} to keep. Restore or remove "
            f"{'it' if one else 'them'} first."
        )
    return run


def _prune_decision(root: Path | str, entries: list[Any], run_id: str | None, keep: int,
                    published_run: Callable[[Any], str | None] | None = None,
                    spared: list[Path] = ()) -> tuple[str | None, list[Any], list[Any]]:  # type: ignore[assignment]
    """(run, deleted, kept) by the rules of save-time retention (:func:`_prune_run`, :func:`_prune_plan`);
    ``spared``: checkpoints never deleted (a Trainer's best model)."""
    run = _prune_run(root, entries, run_id, published_run)
    doomed, kept = _prune_plan(entries, run, keep, spared) if run else ([], [])
    return run, doomed, kept


def _local_prune_decision(root: Path, run_id: str | None, keep: int) -> tuple[list[Any], str | None, list[Any],
                                                                               list[Any], list[Path]]:
    """(entries, run, deleted, kept, spared) for a local run directory; in a Trainer run the best model is spared."""
    trainer = is_trainer_run(root)
    entries = scan_run_directory(root, trainer)
    spared: list[Path] = []
    if trainer:
        spared = _best_model(root, entries, _prune_run(root, entries, run_id))
    run, doomed, kept = _prune_decision(root, entries, run_id, keep, spared=spared)
    return entries, run, doomed, kept, spared


@click.command("prune", short_help="Delete a run's oldest complete checkpoints, keeping --keep.")
@click.argument("directory", type=_LOCATION)
@click.option("--keep", type=click.IntRange(min=1), required=True, help="How many complete checkpoints to keep.")
@click.option("--run-id", help="The run to prune, when the directory holds checkpoints of several runs.")
@click.option("--dry-run", is_flag=True,
              help="Only say what would be deleted now (takes no lock: a save publishing meanwhile changes the answer).")
@_json_option
@_key_option
def prune_command(directory: Path | str, keep: int, run_id: str | None, dry_run: bool, as_json: bool) -> int:
    """Delete the oldest complete checkpoints of one run, keeping the newest --keep.

    The rules of save-time retention: only complete checkpoints of that run are counted and deleted, never the
    newest; leftovers, corrupt, legacy and other runs' checkpoints are left alone. Takes the directory's lock first
    and decides from what it lists while holding it, so it never races a save (it fails at once if a save is in
    progress). Under an s3:// prefix (no lock there) it decides again from its own listing when it deletes, never
    deletes the newest complete checkpoint of the run nor one committed meanwhile, and lists again before each
    deletion (each manifest first). With verification keys (--key, or the environment's), a checkpoint without a
    valid authenticator of one of them is not complete: never counted, never deleted.
    """
    from ..core.select import prune
    from ..store.posix import POSIX, DirectoryLock

    root: Path | str
    if remote.is_url(directory):  # no lock on an object store: core.remote.prune decides again from its own listing
        root = remote.run_prefix(str(directory), "prune")
        entries: list[Any] = remote.scan(root)
        run, doomed, kept = _prune_decision(root, entries, run_id, keep, remote.published_run)
        deleted = remote.prune(root, run, keep, kept[-1].path) if run and doomed and not dry_run else None
    elif dry_run:  # no lock: the same rule applied to what is there now
        root = _run_directory(Path(directory), "prune")
        entries, run, doomed, kept, _spared = _local_prune_decision(root, run_id, keep)
        deleted = None
    else:
        root = _run_directory(Path(directory), "prune")
        lock = DirectoryLock(root)
        lock.acquire()  # first: a save publishing between a scan and the lock would make that scan stale
        try:
            entries, run, doomed, kept, spared = _local_prune_decision(root, run_id, keep)
            # prune lists the directory again (still under the lock) and never deletes the newest it lists.
            deleted = (prune(root, run, keep, kept[-1].path, store=POSIX, keep=spared)  # type: ignore[arg-type]
                       if run and doomed else [])
        finally:
            lock.release()
    if deleted is None:  # a dry run, or nothing to delete under a URL: what the rule takes
        deleted = [entry.path for entry in doomed]
    kept_paths = [e.path for e in sorted(kept + doomed, key=lambda e: e.number) if e.path not in deleted]
    if as_json:  # a dry run deleted nothing: what would go is under "would_delete", and "deleted" is empty
        out.emit_json({"directory": str(root), "run_id": run, "keep": keep, "dry_run": dry_run,
                       "deleted": [] if dry_run else [str(p) for p in deleted],
                       "would_delete": [str(p) for p in deleted] if dry_run else [],
                       "kept": [str(p) for p in kept_paths]})
        return 0
    verb = "would delete" if dry_run else "deleted"
    out.say(f"{verb}: {', '.join(map(remote.name_of, deleted)) or 'nothing'}")
    out.say(f"kept: {', '.join(map(remote.name_of, kept_paths)) or 'nothing'}" + (f" (run {run})" if run else ""))
    aside = [e.name for e in entries if e.status == QUARANTINED]
    if aside:
        out.say(f"quarantined (never counted nor deleted): {', '.join(aside)}")
    others = [e.name for e in entries if not (e.status == COMPLETE and e.run_id == run) and e.status != QUARANTINED]
    if others:
        out.say(f"left alone (not complete checkpoints of this run): {', '.join(others)}")
    return 0


# --------------------------------------------------------------------------------------------- latest


@click.command("latest", short_help="Print the checkpoint load_state() would resume from.")
@click.argument("directory", type=_LOCATION)
@_json_option
@_key_option
def latest_command(directory: Path | str, as_json: bool) -> int:
    """Print the checkpoint load_state() would resume from: the newest complete checkpoint_N, else a legacy
    (manifest-less) one, as load_state() with the default allow_legacy=True would. In a transformers Trainer output
    directory: the checkpoint-N train(resume_from_checkpoint=True) would resume from, by the Trainer's rules. Under
    an s3:// prefix: the newest checkpoint there that verifies fully (every file downloaded and hashed), the one a
    resume from it takes.

    Exit 1 if the directory holds no checkpoint load_state() would resume from; why each newer one was skipped goes
    to stderr.
    """
    from ..core.manifest import read_manifest
    from ..core.select import legacy_resume

    url = remote.is_url(directory)
    root = remote.run_prefix(str(directory), "latest") if url else _run_directory(Path(directory), "latest")
    trainer = not url and is_trainer_run(root)  # type: ignore[arg-type]
    try:
        found = remote.latest(str(root)) if url else _would_load(root, trainer)  # type: ignore[arg-type]
        error = None if found else f"{root}: no checkpoints"
    except NoCheckpointError as exc:
        found, error = None, str(exc)
    legacy = found is not None and not url and read_manifest(Path(found)) is None
    if as_json:
        out.emit_json({"directory": str(root), "latest": found, "error": error, "legacy": legacy, "trainer": trainer})
    elif found:
        out.say(found)
    if legacy and trainer:
        out.say(f"note: {Path(found).name} has no completion manifest (saved by native Trainer): "  # type: ignore[arg-type]
                "train(resume_from_checkpoint=True) takes it only because no complete checkpoint exists", err=True)
    elif legacy:
        out.say(f"note: {Path(found).name} has no completion manifest (a native Accelerate checkpoint): "  # type: ignore[arg-type]
                f"{legacy_resume()}", err=True)
    if error:
        out.say(error, err=True)
        return 1
    return 0


# --------------------------------------------------------------------------------------------- export


def _dtype_name(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    name = DTYPES.get(value.strip().lower().removeprefix("torch."))
    if name is None:
        raise click.BadParameter(f"{value!r} is not a floating dtype; use one of {', '.join(DTYPES)}")
    return name


#: --format values: "auto" decides from the config (``weights.config_layout``).
FORMATS = ("auto", "transformers", "diffusers", "peft")


def _export_layout(chosen: str, config: Path) -> str:
    """The export's file names: the --format given, or (auto) the one ``config`` asks for; an adapter config with a
    model layout is refused (its adapter is exported with --format peft)."""
    import json

    from ..weights import config_layout

    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"{config} is not a readable JSON config ({exc}): pass the model's config.json") from None
    asked = config_layout(parsed)
    if chosen == "auto":
        return asked
    if asked == "peft" and chosen != "peft":
        raise click.UsageError(f"{config} is a PEFT adapter's config: export the adapter with --format peft, or pass "
                               f"the base model's config.json for --format {chosen}")
    return chosen


@click.command("export", short_help="Export a checkpoint's model (or LoRA adapter) to safetensors for from_pretrained.")
@click.argument("checkpoint", type=_LOCATION)
@click.argument("paths", nargs=-1, required=True, metavar="[CONFIG] OUTPUT",
                type=remote.Location(local=click.Path(path_type=Path)))
@click.option("--format", "layout", type=click.Choice(FORMATS), default="auto", show_default=True,
              help="File names: transformers (model.safetensors, or model-0000i-of-0000n.safetensors + "
              "model.safetensors.index.json), diffusers (diffusion_pytorch_model-*) or peft (a LoRA adapter: "
              "adapter_model.safetensors + adapter_config.json, for PeftModel.from_pretrained). auto: peft for an "
              "adapter_config.json (given, or carried by the checkpoint), transformers when the config has model_type "
              "and no _class_name, else diffusers.")
@click.option("--max-shard-size", default="5GiB", show_default=True,
              help="Bytes per shard: a number, or with a unit: 5GiB = 5*2**30 (the API default), 5GB = 5*10**9. "
              "Not for --format peft (an adapter is one file).")
@click.option("--dtype", callback=_dtype_name,
              help="Cast floating tensors: bf16, fp16, fp32 (or bfloat16, float16, half, float32, float, ...).")
@click.option("--adapter-name", default="default", show_default=True,
              help="peft: the adapter to export from a checkpoint holding the whole PEFT model (its live names, "
              "e.g. lora_A.default.weight).")
@click.option("--config", "config_option", metavar="PATH|MODEL_ID",
              help="The model's config, shipped with the weights: a config.json, the directory holding it (the model "
              "directory the training loaded), or a model id in the local Hugging Face cache (never downloaded); for "
              "--format peft the adapter's adapter_config.json or its directory. Needed unless the checkpoint carries "
              "one (a Trainer checkpoint saved under FSDP with SHARDED_STATE_DICT, or by save_state(), does not). The "
              "same as CONFIG.")
@click.option("--sign-key", metavar="FILE", type=click.Path(dir_okay=False, path_type=Path),
              help="Sign the export with this private key (PEM, ECDSA P-256/384/521): OUTPUT/model.sig, published with "
              "the export, which OpenSSF's model_signing verifies (model_signing verify key OUTPUT --signature "
              "OUTPUT/model.sig --public_key PUBLIC_KEY). Needs pip install 'accelerate-txn[model-signing]'.")
@_json_option
@click.pass_context
def export_command(ctx: click.Context, checkpoint: Path | str, paths: tuple[Path | str, ...], layout: str,
                   max_shard_size: str, dtype: str | None, adapter_name: str, config_option: str | None,
                   sign_key: Path | None, as_json: bool) -> int:
    """Export a checkpoint's model to sharded safetensors that from_pretrained loads (transformers or Diffusers), or
    a PEFT model's LoRA adapter to the files PeftModel.from_pretrained loads.

    CHECKPOINT is a checkpoint directory (with pytorch_model_fsdp_0/), a DCP directory, or an s3:// checkpoint (its
    model state is downloaded into a temporary directory first, each file verified); CONFIG (or --config) the model's
    config.json (or its directory), or the adapter's adapter_config.json, shipped with the weights: without it, the
    one the checkpoint carries (a Trainer checkpoint of a full model save; not one saved under FSDP with
    SHARDED_STATE_DICT, nor an Accelerate save_state() checkpoint); OUTPUT the export directory (replaced atomically).
    CONFIG and OUTPUT are local.
    """
    import torch

    from ..errors import CheckpointConfigurationError
    from ..weights import (
        SIGNATURE_NAME,
        export_dcp_to_diffusers,
        export_dcp_to_peft,
        export_dcp_to_transformers,
        export_signer,
        resolve_shard_size,
    )

    if len(paths) > 2:
        raise click.UsageError(f"export takes CHECKPOINT [CONFIG] OUTPUT: got {len(paths) + 1} paths")
    config, output = (None, paths[0]) if len(paths) == 1 else paths
    if config is not None and config_option is not None:
        raise click.UsageError(f"the config is given twice (CONFIG {config} and --config {config_option}): pass one")
    if config is not None and not Path(config).exists():
        raise click.UsageError(f"CONFIG {config} does not exist")
    given_file = (None if config is None and config_option is None else  # checked before anything is downloaded
                  given_config(config or config_option, layout, "CONFIG" if config is not None else "--config"))  # type: ignore[arg-type]
    try:
        size = resolve_shard_size(int(max_shard_size) if max_shard_size.strip().isdigit() else max_shard_size)
    except CheckpointConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="'--max-shard-size'") from None
    cast = getattr(torch, dtype) if dtype else None
    given = ctx.get_parameter_source("max_shard_size") != click.core.ParameterSource.DEFAULT
    export_signer(sign_key)  # a key that cannot sign fails now, before an object-store checkpoint is downloaded
    with remote.model_copy(str(checkpoint)) if remote.is_url(checkpoint) else contextlib.nullcontext(checkpoint) as source:
        config_file = given_file or carried_config(checkpoint, Path(source), output, layout)
        chosen = _export_layout(layout, config_file)
        if chosen == "peft":
            if given:
                raise click.UsageError("--max-shard-size does not apply to --format peft: PEFT loads an adapter from "
                                       "one adapter_model.safetensors, never from shards")
            result = export_dcp_to_peft(source, config_file, output, adapter_name=adapter_name, dtype=cast,
                                        sign_key=sign_key)
        else:
            exporter = export_dcp_to_transformers if chosen == "transformers" else export_dcp_to_diffusers
            result = exporter(source, config_file, output, size, dtype=cast, sign_key=sign_key)
    files = sorted(p.name for p in Path(result).iterdir())
    shown_config = str(config_file) if given_file is not None else f"{checkpoint}/{config_file.name}"
    signature = Path(output) / SIGNATURE_NAME if sign_key is not None else None
    if as_json:
        out.emit_json({"checkpoint": str(checkpoint), "output": str(result), "format": chosen, "config": shown_config,
                       "max_shard_size": None if chosen == "peft" else size, "dtype": dtype, "files": files,
                       "adapter_name": adapter_name if chosen == "peft" else None,
                       "signature": None if signature is None else str(signature)})
        return 0
    if chosen == "peft":
        out.say(f"exported {checkpoint} -> {result} (PEFT adapter {adapter_name!r}: {', '.join(files)}; config from "
                f"{shown_config})")
    else:
        out.say(f"exported {checkpoint} -> {result} ({chosen} file names, {len(files)} files, shards of at most "
                f"{size:,} bytes; config from {shown_config})")
    if signature is not None:
        out.say(f"signed with {sign_key}: {signature}; verify with: model_signing verify key {shlex.quote(str(output))} "
                f"--signature {shlex.quote(str(signature))} --public_key PUBLIC_KEY")
    return 0


COMMANDS = (list_command, verify_command, inspect_command, diff_command, prune_command, latest_command, export_command,
            doctor_command)
__all__ = ["COMMANDS", "DTYPES", "CheckpointError"]
