"""What the command line knows about directories: which kind a path is, what a run directory holds, and exactly
what a verification checked. File work only: no torch at import, no process group, nothing is modified.
"""

from __future__ import annotations

import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import manifest as _manifest
from ..core.manifest import MANIFEST, read_manifest, verify_manifest
from ..core.quarantine import local_mark
from ..errors import CheckpointError, CheckpointIntegrityError
from ..store.posix import (
    REPLACED_NAME,
    RETIRED_NAME,
    STAGING_NAME,
    replaced_leftovers,
    retired_leftovers,
    staging_leftovers,
    walk_tree,
)
from ..trainer import layout as trainer_layout

COMPLETE, STAGING, RETIRED, LEGACY, CORRUPT = "complete", "staging leftover", "retired leftover", "legacy", "corrupt"
REPLACED = "replaced leftover"
#: A complete checkpoint an operator set aside (``core.quarantine``): never selected, never pruned.
QUARANTINED = "quarantined"
_PAYLOAD_SUFFIXES = (".distcp", ".safetensors", ".bin")
_SMALL = 16 * 1024 * 1024  # payloads above this are size-checked only by a quick verification
_CHECKPOINT_NAME = re.compile(r"checkpoint[-_](\d+)\Z")  # as accelerate_txn._select (imported lazily: torch)


class PathKindError(CheckpointError):
    """The path exists but is not the kind of directory the command works on (a usage error, exit status 2)."""


# --------------------------------------------------------------------------------------------- classification


def looks_like_run_directory(path: Path) -> bool:
    """A directory holding ``checkpoint_N`` directories or a save's staging/retired leftovers."""
    from ..core.select import numbered_checkpoints

    return bool(numbered_checkpoints(path) or staging_leftovers(path) or retired_leftovers(path)
                or replaced_leftovers(path))


def nested_run_directories(path: Path, limit: int = 10_000) -> list[Path]:
    """Run directories one level below ``path`` (a directory of runs), or two where the level between is an
    Accelerate project directory (``<project_dir>/checkpoints/checkpoint_N``, automatic naming); sorted, empty when
    ``path`` is itself a run directory or holds none. Symbolic links are not followed; at most ``limit`` entries of
    ``path`` are looked at."""
    if not path.is_dir() or path.is_symlink() or looks_like_run_directory(path):
        return []
    found = []
    try:
        children = sorted(path.iterdir())[:limit]
    except OSError:
        return []
    for child in children:
        if child.is_symlink() or not child.is_dir() or _CHECKPOINT_NAME.fullmatch(child.name):
            continue
        project = child / "checkpoints"
        if looks_like_run_directory(child):
            found.append(child)
        elif project.is_dir() and not project.is_symlink() and looks_like_run_directory(project):
            found.append(project)
    return found


def run_directory_hint(path: Path, command: str) -> str | None:
    """For a directory that is not a run directory but holds run directories below it (a project directory, a
    directory of runs): where the checkpoints are and the command to run instead; else ``None``."""
    runs = nested_run_directories(path)
    if not runs:
        return None
    if runs == [path / "checkpoints"]:
        return (f"{path} is not a run directory: it looks like an Accelerate project directory, whose checkpoints "
                f"are in {runs[0]} (automatic naming saves <project_dir>/checkpoints/checkpoint_N). Run "
                f"'accelerate-txn {command} {runs[0]}'")
    shown = ", ".join(str(run) for run in runs[:5]) + (f" and {len(runs) - 5} more" if len(runs) > 5 else "")
    count = len(runs)
    return (f"{path} is not a run directory: it holds no checkpoint_N itself, but {count} "
            f"{plural(count, 'directory', 'directories')} below it {plural(count, 'holds', 'hold')} checkpoints: "
            f"{shown}. Pass one of them, e.g. 'accelerate-txn {command} {runs[0]}'")


def is_trainer_run(root: Path) -> bool:
    """Whether ``root`` is the output directory of a transformers Trainer, decided by its newest checkpoint that says
    so: a readable manifest (a Trainer's, or another front end's), or, without one, a ``trainer_state.json`` (saved by
    native Trainer). Its checkpoints are then judged by the Trainer's rules (``trainer.layout.TrainerRules``), as
    ``train(resume_from_checkpoint=True)`` judges them. Reads about one manifest, not every one."""
    from ..core.select import numbered_checkpoints

    for _number, path in reversed(numbered_checkpoints(root)):
        if path.is_symlink():
            continue
        try:
            manifest = read_manifest(path)
        except (CheckpointIntegrityError, OSError):
            continue
        if manifest is not None:
            return trainer_layout.is_trainer_manifest(manifest)
        if (path / trainer_layout.TRAINER_STATE).is_file():
            return True
    return False


def resume_call(trainer: bool) -> str:
    """What resumes from a run directory, in words: ``load_state()``, or Trainer's resume."""
    return "train(resume_from_checkpoint=True)" if trainer else "load_state()"


def plural(count: int, one: str, many: str | None = None) -> str:
    """``one`` for a count of 1, else ``many`` (default: ``one`` + "s")."""
    return one if count == 1 else (many if many is not None else one + "s")


def _loader_files(path: Path) -> tuple[list[str], str | None]:
    """Files under ``path`` that a native Accelerate load would read (what makes a manifest-less directory a legacy
    checkpoint rather than an empty or foreign one), and why selection would not take it anyway: the library's own
    answer (``core.select.legacy_files``), or, for a tree no checkpoint has (a symbolic link, a special file, deeper
    than 64 levels), the loader files a tolerant walk finds and the library's reason."""
    from ..core.select import legacy_files

    if Path(path).is_symlink():  # never walked through
        return [], None
    try:
        return legacy_files(path), None
    except (CheckpointIntegrityError, OSError) as exc:
        error = str(exc)
    found = []
    for directory, entries in walk_tree(path, strict=False):  # iterative: any depth, links not followed
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                relative = Path(directory, entry.name).relative_to(path).as_posix()
                if _manifest.loader_may_read(relative):
                    found.append(relative)
    return sorted(found), error


#: Training state that a checkpoint holds beside its model (Accelerate's ``save_state``: optimizer, scheduler,
#: sampler, scaler, RNG states, custom objects; its FSDP layout's DCP directories; Trainer's ``trainer_state.json``,
#: ``rng_state*.pth``, ``training_args.bin``; the default file of ``register_checkpoint_state``) and that a directory of
#: model weights alone never holds.
_TRAINING_STATE = re.compile(
    r"(?:optimizer|scheduler|sampler|scaler|random_states|custom_checkpoint|dl_state_dict|dataloader_states|rng_state"
    r"|training_state)"
    r"(?:_\d+)?\.(?:bin|safetensors|pt|pth|pkl)\Z|\.metadata\Z|.*\.distcp\Z|trainer_state\.json\Z|training_args\.bin\Z"
)
#: The signature ``export --sign-key`` (OpenSSF model_signing) adds to an export (``weights.SIGNATURE_NAME``).
_SIGNATURE = "model.sig"


def weights_kind(names: list[str]) -> str | None:
    """What a manifest-less directory holding the files ``names`` (relative POSIX paths) is, in words, when it holds
    model weights and none of the training state any checkpoint holds (a PEFT adapter, a model directory for
    ``from_pretrained``, an export, bare weight files); ``None`` otherwise (a legacy checkpoint, an empty or foreign
    directory)."""
    if any(_TRAINING_STATE.fullmatch(name.rsplit("/", 1)[-1]) for name in names):
        return None
    weights = sorted(name for name in names if _manifest.loader_may_read(name))
    if not weights:
        return None
    top = set(names)
    shown = ", ".join(weights[:4]) + (f" and {len(weights) - 4} more" if len(weights) > 4 else "")
    if "adapter_config.json" in top:
        return (f"a PEFT adapter (adapter_config.json, {shown}), as PeftModel.save_pretrained and 'accelerate-txn export "
                "--format peft' write it: load it with PeftModel.from_pretrained(base_model, DIR)")
    if "model_index.json" in top:
        return f"a Diffusers pipeline (model_index.json, {shown}): load it with DiffusionPipeline.from_pretrained(DIR)"
    if "config.json" in top:
        return (f"a model directory (config.json, {shown}), as save_pretrained and 'accelerate-txn export' write it: "
                "load it with from_pretrained(DIR)")
    return f"a directory of model weights only ({shown})"


def not_a_checkpoint(where: str, names: list[str], command: str) -> PathKindError | None:
    """The usage error for ``where`` (a path or a URL) when its files ``names`` are model weights alone
    (:func:`weights_kind`): what it is and what to run instead; ``None`` when they are not."""
    kind = weights_kind(names)
    if kind is None:
        return None
    signed = (f"; its signature is checked with 'model_signing verify key {where} --signature {where}/{_SIGNATURE} "
              "--public_key PUBLIC_KEY'" if _SIGNATURE in names else "")
    return PathKindError(
        f"{where} is not a checkpoint: it is {kind}{signed}. It holds none of the training state a checkpoint holds "
        f"(optimizer, scheduler, RNG states, {MANIFEST}), so there is nothing to {command} and nothing load_state() "
        "or Trainer would resume. Pass a checkpoint directory (checkpoint_N, or Trainer's checkpoint-N); 'accelerate-txn "
        "list RUN_DIR' lists a run's")


def _file_names(path: Path) -> list[str]:
    """Every file below ``path`` (relative, POSIX; symbolic links not followed)."""
    return [Path(directory, entry.name).relative_to(path).as_posix()
            for directory, entries in walk_tree(path, strict=False) for entry in entries
            if not entry.is_dir(follow_symlinks=False)]


def checkpoint_manifest(path: Path, command: str) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``.

    Raises :class:`PathKindError` (usage) for a file or a directory that is not a checkpoint, with a hint (a run
    directory: use ``list``/``latest``), and :class:`CheckpointIntegrityError` (invalid) for a checkpoint-like
    directory that has no valid manifest: a staging leftover, a legacy checkpoint, an unfinished save.
    """
    if path.is_file():
        hint = f"; pass its directory: accelerate-txn {command} {path.parent}" if path.name == MANIFEST else ""
        raise PathKindError(f"{path} is a file, not a checkpoint directory{hint}")
    if any(pattern.fullmatch(path.name) for pattern in (STAGING_NAME, RETIRED_NAME, REPLACED_NAME)):
        # even with a manifest: unpublished
        raise CheckpointIntegrityError(
            f"{path} is a staging (or retired, or replaced) directory: a save that did not finish, a checkpoint being "
            f"deleted or set aside by a replacement, never a loadable checkpoint. See the run directory with "
            f"'accelerate-txn list {path.parent}'"
        )
    manifest = read_manifest(path)
    if manifest is not None:
        return manifest
    from ..core.select import legacy_resume

    if looks_like_run_directory(path):
        count = sum(1 for entry in path.iterdir() if _CHECKPOINT_NAME.fullmatch(entry.name) and entry.is_dir())
        raise PathKindError(
            f"{path} is a run directory ({count} checkpoint_N inside), not a checkpoint. See its checkpoints with "
            f"'accelerate-txn list {path}', or the one load_state() would resume with 'accelerate-txn latest {path}'"
        )
    hint = run_directory_hint(path, "list")
    if hint is not None:  # before the legacy check: the checkpoints below hold files a loader reads
        raise PathKindError(f"{hint}, or pass one checkpoint_N of it to '{command}'")
    if (path / (MANIFEST + ".tmp")).exists():
        raise CheckpointIntegrityError(f"{path} holds only a partly written manifest ({MANIFEST}.tmp): an interrupted save")
    if path.parent != path and (path.parent / MANIFEST).is_file():
        raise PathKindError(f"{path} is inside the checkpoint {path.parent}, not a checkpoint itself: pass the "
                            f"checkpoint, 'accelerate-txn {command} {path.parent}'")
    if not _CHECKPOINT_NAME.fullmatch(path.name):  # a checkpoint_N of weights alone: an unfinished native save
        weights = not_a_checkpoint(str(path), _file_names(path), command)
        if weights is not None:
            raise weights
    if (path / trainer_layout.TRAINER_STATE).is_file():
        raise CheckpointIntegrityError(
            f"{path} has no {MANIFEST}: saved by native Trainer (without accelerate-txn), or a save that did not "
            "finish. There is nothing to verify it against; train(resume_from_checkpoint=True) takes such a checkpoint "
            "only when no complete one exists, after checking that the files a resume reads are there")
    files, error = _loader_files(path)
    if files and error is None:
        raise CheckpointIntegrityError(
            f"{path} has no {MANIFEST}: a legacy (native Accelerate) checkpoint or an unfinished native save. There is "
            f"nothing to verify it against; {legacy_resume()}"
        )
    if files:
        raise CheckpointIntegrityError(f"{path} has no {MANIFEST}, and load_state() would not take it as a legacy "
                                       f"checkpoint: {error}")
    if _CHECKPOINT_NAME.fullmatch(path.name):
        raise CheckpointIntegrityError(f"{path} has no {MANIFEST} and no checkpoint files: not a complete checkpoint")
    raise PathKindError(f"{path} is not a checkpoint directory: it has no {MANIFEST} and no checkpoint_N inside")


# --------------------------------------------------------------------------------------------- verification


def private_patterns(manifest: dict[str, Any]) -> list[re.Pattern[str]]:
    """Name patterns of the per-rank files the manifest's components declare (for the extra-file check)."""
    templates = set(_manifest.RANK_FILES)
    components = manifest.get("components")
    for descriptor in components.values() if isinstance(components, dict) else ():
        states = descriptor.get("private_states") if isinstance(descriptor, dict) else None
        templates.update(name for name in states or {} if isinstance(name, str) and "{rank}" in name)
    if trainer_layout.is_trainer_manifest(manifest):  # the files a Trainer resume reads besides Accelerate's
        templates.update(trainer_layout.RANK_TEMPLATES)
        extra = list(trainer_layout.LOADER_PATTERNS)
    else:
        extra = []
    return [re.compile(re.escape(t).replace(re.escape("{rank}"), r"\d+")) for t in sorted(templates)] + extra


def _is_large_payload(name: str, size: int) -> bool:
    return name.endswith(_PAYLOAD_SUFFIXES) and size > _SMALL


def _hash_algorithm(row: dict[str, Any]) -> str | None:
    return next((key for key in ("xxh3_128", "sha256") if key in row), None)


@dataclass
class Verification:
    """The outcome of verifying one checkpoint, and exactly what was and was not checked."""

    path: Path | str  # a URL for a checkpoint in an object store
    manifest: dict[str, Any]
    full: bool
    dcp: bool
    error: str | None = None
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.error is None

    def not_checked(self) -> list[str]:
        """What this verification did not establish, in words."""
        files = self.manifest.get("files") if isinstance(self.manifest.get("files"), dict) else {}
        rows = [(name, row) for name, row in files.items() if isinstance(row, dict)]
        no_hash = sum(1 for _name, row in rows if _hash_algorithm(row) is None)
        large = sum(1 for name, row in rows if _hash_algorithm(row) and _is_large_payload(name, row.get("size", 0)))
        notes = []
        if large and not self.full:
            notes.append(f"content of {large} large payload {plural(large, 'file')}: size only (--full re-hashes "
                         f"{plural(large, 'it', 'them')})")
        if no_hash:
            notes.append(f"content of {no_hash} {plural(no_hash, 'file')} saved without a hash (integrity "
                         f"{self.manifest.get('integrity', 'metadata')!r}): size only")
        dcp = sum(1 for name, _row in rows if name.rsplit("/", 1)[-1] == ".metadata")
        if dcp and not self.dcp:
            notes.append(f"DCP .metadata of {dcp} {plural(dcp, 'directory', 'directories')} not re-read (the bytes "
                         "are hash-checked against the manifest; --dcp also re-reads schemas and payload lists, which "
                         "loads torch)")
        if self.report.get("extra") is None:
            notes.append("files present but not in the inventory (this version does not look for them)")
        if trainer_layout.is_trainer_manifest(self.manifest):
            notes.append("fit to the live Trainer (world size, model, optimizer groups): checked when "
                         "train(resume_from_checkpoint=...) loads it (see 'accelerate-txn inspect')")
        else:
            notes.append("fit to a training configuration: load_state() compares it with the live Accelerator "
                         "(see 'accelerate-txn inspect' and 'accelerate-txn diff')")
        return notes

    def full_effect(self) -> str | None:
        """What --full adds to this checkpoint's verification, in words; ``None`` when a quick verification's notes
        already say it (large payloads checked by size only, which --full re-hashes)."""
        files = self.manifest.get("files") if isinstance(self.manifest.get("files"), dict) else {}
        large = [row for name, row in files.items()
                 if isinstance(row, dict) and _is_large_payload(name, row.get("size", 0))]
        hashed = sum(1 for row in large if _hash_algorithm(row))
        payloads = "large payloads (.distcp, .safetensors, .bin over 16 MiB)"
        if hashed:  # without --full, not_checked() says what --full would re-hash
            return (f"--full re-hashed {hashed} large {plural(hashed, 'payload')} (over 16 MiB), which a quick "
                    "verification checks by size only") if self.full else None
        why = (f"its {len(large)} {plural(len(large), 'payload')} over 16 MiB {plural(len(large), 'was', 'were')} saved "
               f"without a hash (integrity {self.manifest.get('integrity', 'metadata')!r}): size only, with or "
               "without --full" if large else
               "it has none, so every file with a recorded hash is re-hashed either way")
        return (f"--full {'added' if self.full else 'would add'} nothing here: it re-hashes the {payloads} that a "
                f"quick verification checks by size only, and {why}")

    def as_json(self) -> dict[str, Any]:
        manifest = self.manifest
        return {
            "path": str(self.path),
            "valid": self.valid,
            "error": self.error,
            "run_id": manifest.get("run_id"),
            "transaction_id": manifest.get("transaction_id"),
            "protocol": manifest.get("protocol"),
            "integrity": manifest.get("integrity"),
            "components": component_steps(manifest),
            "checkpoint_number": checkpoint_number(manifest),
            "global_step": global_step(manifest),
            "versions": manifest.get("versions"),
            "checked": {**self.report, "full": self.full, "dcp": self.dcp} if self.valid else None,
            "not_checked": self.not_checked() if self.valid else None,
            "full_effect": self.full_effect() if self.valid else None,
        }


def verify_checkpoint(path: Path, manifest: dict[str, Any], *, full: bool, dcp: bool = False,
                      progress: Any = None) -> Verification:
    """Verify ``path`` against ``manifest``; never raises for an invalid checkpoint (see ``.error``).
    ``progress(nbytes)`` is called as files are re-hashed."""
    result = Verification(path, manifest, full, dcp)
    try:
        report = verify_manifest(path, manifest, full=full, dcp=dcp, private_patterns=private_patterns(manifest),
                                 progress=progress)
        if trainer_layout.is_trainer_manifest(manifest):  # every file a Trainer resume reads, for every saving rank
            record = trainer_layout.check_record(Path(path), manifest)
            report = {**report, "trainer_required": len(record["required"])}
    except CheckpointIntegrityError as exc:
        result.error = str(exc)
        return result
    result.report = dict(report)
    result.report.setdefault("integrity", manifest.get("integrity"))
    return result


def _progress(manifest: dict[str, Any]) -> dict[str, Any]:
    progress = manifest.get("progress")
    return progress if isinstance(progress, dict) else {}


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def checkpoint_number(manifest: dict[str, Any]) -> int | None:
    """The ``N`` of the ``checkpoint_N`` the save wrote (``progress.checkpoint``), ``None`` when not recorded (an
    older manifest, or a save to a directory of another name)."""
    return _count(_progress(manifest).get("checkpoint"))


def component_steps(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per component: its name (``""`` is the checkpoint root: a single Accelerator), the
    ``Accelerator.step`` the manifest recorded (the gradient-accumulation counter load_state() restores) and the
    optimizer steps taken, one per optimizer (``progress.optimizer_steps``; ``None`` where not recorded)."""
    names = manifest.get("components") if isinstance(manifest.get("components"), dict) else {}
    steps = manifest.get("steps") if isinstance(manifest.get("steps"), dict) else {}
    counts = _progress(manifest).get("optimizer_steps")
    counts = counts if isinstance(counts, dict) else {}
    rows = []
    for name in sorted(set(names) | set(steps)):
        recorded = counts.get(name)
        optimizers = [_count(value) for value in recorded] if isinstance(recorded, list) else None
        rows.append({"component": name, "directory": name or ".", "accelerator_step": steps.get(name),
                     "optimizer_steps": optimizers})
    return rows


def step_text(manifest: dict[str, Any]) -> str:
    """``Accelerator.step`` for display: one number when every component agrees."""
    values = {row["accelerator_step"] for row in component_steps(manifest)}
    if not values:  # no Accelerate component (a Trainer checkpoint)
        return "-"
    if len(values) == 1:
        (value,) = values
        return "-" if value is None else str(value)
    return ", ".join(f"{row['directory']}={row['accelerator_step']}" for row in component_steps(manifest))


def optimizer_step_text(manifest: dict[str, Any]) -> str:
    """The optimizer steps taken, for display: one number when every optimizer of every component agrees, ``-``
    when none was recorded (an older manifest, or optimizers that keep no step count, such as plain SGD)."""
    if trainer_layout.is_trainer_manifest(manifest):  # Trainer's global step counts optimizer steps
        step = global_step(manifest)
        return "-" if step is None else str(step)
    rows = component_steps(manifest)
    values = {value for row in rows for value in row["optimizer_steps"] or [] if value is not None}
    if not values:
        return "-"
    if len(values) == 1:
        return str(values.pop())
    return ", ".join(f"{row['directory']}=" + "/".join("-" if v is None else str(v) for v in row["optimizer_steps"] or [])
                     for row in rows)


def global_step(manifest: dict[str, Any]) -> int | None:
    """A Trainer checkpoint's ``state.global_step`` (``None`` for other manifests)."""
    if not trainer_layout.is_trainer_manifest(manifest):
        return None
    record = manifest.get("trainer")
    return _count(record.get("global_step")) if isinstance(record, dict) else None


def progress_text(manifest: dict[str, Any]) -> str:
    """The numbers a person knows about a checkpoint: its checkpoint number, the optimizer steps taken and
    ``Accelerator.step`` (a Trainer checkpoint: its global step)."""
    number = checkpoint_number(manifest)
    if trainer_layout.is_trainer_manifest(manifest):
        step = global_step(manifest)
        return f"checkpoint {'-' if number is None else number}, Trainer global step {'-' if step is None else step}"
    return (f"checkpoint {'-' if number is None else number}, optimizer step {optimizer_step_text(manifest)}, "
            f"Accelerator step {step_text(manifest)}")


# --------------------------------------------------------------------------------------------- run directories


@dataclass
class Entry:
    """One checkpoint-like directory of a run directory."""

    path: Path  # a URL in a RemoteEntry (cli._remote)
    number: int
    status: str
    reason: str | None = None  # what is particular to this entry (``None``: nothing beyond its note)
    manifest: dict[str, Any] | None = None
    run_id: str | None = None
    selected: bool = False
    #: An explanation every entry of its kind shares (a native checkpoint's): ``list`` says it once per listing.
    note: str | None = None
    #: The quarantine mark that sets it aside (``core.quarantine.Mark.as_json``), ``None`` if none does.
    quarantine: dict[str, Any] | None = None

    def full_reason(self) -> str | None:
        """The reason and the note in one sentence (``--json``, where each entry stands alone)."""
        return ": ".join(part for part in (self.reason, self.note) if part) or None

    @property
    def name(self) -> str:
        return self.path.name

    def short_name(self, ellipsis: str = "\u2026") -> str:
        """The name for a table: leftovers' long random suffixes elided with ``ellipsis`` (the run id has its own
        column)."""
        for pattern, word in ((STAGING_NAME, "staging"), (RETIRED_NAME, "deleting"), (REPLACED_NAME, "replaced")):
            match = pattern.fullmatch(self.name)
            if match:
                return f".{match.group('name')}.{word}-{ellipsis}"
        return self.name

    def size(self) -> int:
        """Bytes of every regular file below (symbolic links are not followed; a link itself counts 0)."""
        total = 0
        if self.path.is_symlink():
            return total
        for _directory, entries in walk_tree(self.path, strict=False):  # iterative: any depth
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:  # deleted meanwhile (e.g. by a save's cleanup)
                    continue
                total += info.st_size if stat.S_ISREG(info.st_mode) else 0
        return total

    def modified(self) -> float | None:
        """When the manifest (or the directory) was written; ``None`` where it is not known."""
        if self.path.is_symlink():  # the link's own time: never followed
            return self.path.lstat().st_mtime
        target = self.path / MANIFEST if self.status == COMPLETE else self.path
        try:
            return target.stat().st_mtime
        except OSError:
            return self.path.lstat().st_mtime

    def as_json(self, now: float) -> dict[str, Any]:
        manifest = self.manifest or {}
        modified = self.modified()
        return {
            "name": self.name,
            "path": str(self.path),
            "number": self.number,
            "status": self.status,
            "reason": self.full_reason(),
            "run_id": self.run_id,
            "components": component_steps(manifest) if self.manifest else None,
            "checkpoint_number": checkpoint_number(manifest) if self.manifest else None,
            "global_step": global_step(manifest) if self.manifest else None,
            "integrity": manifest.get("integrity"),
            "size_bytes": self.size(),
            "modified": None if modified is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(modified)),
            "age_seconds": None if modified is None else round(max(0.0, now - modified), 1),
            "would_load": self.selected,
            "quarantine": self.quarantine,
        }


def with_mark(entry: Entry, mark: Any) -> Entry:
    """``entry`` set aside by ``mark`` (``core.quarantine.Mark``, or ``None``: unchanged): a complete checkpoint becomes
    :data:`QUARANTINED` with the mark as its reason; a corrupt one stays corrupt, the mark said after its reason."""
    if mark is None:
        return entry
    entry.quarantine = mark.as_json()
    if entry.status == COMPLETE:
        entry.status = QUARANTINED
        entry.reason = f"{mark.describe()} (never selected nor pruned; 'accelerate-txn release' undoes it)"
    else:
        entry.reason = "; ".join(part for part in (entry.reason, mark.describe()) if part)
    return entry


def _trainer_legacy_entry(number: int, path: Path) -> Entry:
    """A manifest-less ``checkpoint-N`` of a Trainer run: legacy when it holds every file a Trainer resume reads
    (``TrainerRules``), else corrupt with the reason."""
    try:
        trainer_layout.TrainerRules(None, offline=True).check_required(path, None)
    except CheckpointIntegrityError as exc:
        return Entry(path, number, CORRUPT, f"no completion manifest, and not a complete native Trainer checkpoint "
                     f"either: {exc}")
    return Entry(path, number, LEGACY, note="no completion manifest: saved by native Trainer (or an unfinished native "
                 "save); train(resume_from_checkpoint=True) takes it only when no complete checkpoint exists")


def _checkpoint_entry(number: int, path: Path, trainer: bool = False) -> Entry:
    from ..core.select import symlink_reason

    link = symlink_reason(path)
    if link is not None:  # listed, never followed: no manifest, run id or size read through it
        return Entry(path, number, CORRUPT, link)
    try:
        manifest = read_manifest(path)
    except (CheckpointIntegrityError, OSError) as exc:
        return Entry(path, number, CORRUPT, str(exc))
    if manifest is None:
        if (path / (MANIFEST + ".tmp")).exists():
            return Entry(path, number, CORRUPT, f"only a partly written {MANIFEST}.tmp: an interrupted save")
        if trainer:
            return _trainer_legacy_entry(number, path)
        files, error = _loader_files(path)
        if files and error is None:
            from ..core.select import legacy_resume

            return Entry(path, number, LEGACY, note="no completion manifest: a native Accelerate checkpoint or an "
                         f"unfinished native save; {legacy_resume()}")
        if files:
            return Entry(path, number, CORRUPT, f"no completion manifest, and not a legacy checkpoint either: {error}")
        return Entry(path, number, CORRUPT, "no completion manifest and no checkpoint files")
    run_id = manifest.get("run_id") if isinstance(manifest.get("run_id"), str) else None
    result = verify_checkpoint(path, manifest, full=False)
    status = COMPLETE if result.valid else CORRUPT
    return with_mark(Entry(path, number, status, result.error, manifest, run_id), local_mark(path, manifest))


def _leftover_number(name: str) -> int:
    match = _CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else -1


def scan_run_directory(root: Path, trainer: bool | None = None) -> list[Entry]:
    """Every checkpoint and leftover of ``root``, newest first (a leftover of ``checkpoint_9`` ranks as 9).
    ``trainer``: whether ``root`` is a Trainer output directory (``None``: :func:`is_trainer_run` decides)."""
    from ..core.select import numbered_checkpoints

    trainer = is_trainer_run(root) if trainer is None else trainer
    entries = [_checkpoint_entry(number, path, trainer) for number, path in numbered_checkpoints(root)]
    for path, run in staging_leftovers(root):
        target = STAGING_NAME.fullmatch(path.name).group("name")  # type: ignore[union-attr]
        entries.append(Entry(path, _leftover_number(target), STAGING,
                             f"unpublished save of {target}: in progress, or left by a writer that died (the next "
                             "save of this run removes it)", run_id=run))
    for path in retired_leftovers(root):
        match = RETIRED_NAME.fullmatch(path.name)
        target = match.group("name") if match else path.name
        entries.append(Entry(path, _leftover_number(target), RETIRED,
                             f"{target} taken out of service by retention, deletion interrupted (the next save "
                             "removes it)", run_id=match.group("run") if match else None))
    for path in replaced_leftovers(root):
        target = REPLACED_NAME.fullmatch(path.name).group("name")  # type: ignore[union-attr]
        present = (root / target).exists()
        entries.append(Entry(path, _leftover_number(target), REPLACED,
                             f"the tree a replacement of {target} set aside: "
                             + ("the replacement committed (the next save removes it)" if present else
                                f"killed between its two renames, {target} is missing (the next save puts it back)")))
    order = {COMPLETE: 0, QUARANTINED: 0, LEGACY: 1, CORRUPT: 1, STAGING: 2, RETIRED: 3, REPLACED: 3}
    return sorted(entries, key=lambda entry: (-entry.number, order[entry.status], entry.name))
