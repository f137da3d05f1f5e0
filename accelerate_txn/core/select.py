"""Selecting the newest complete checkpoint, and retention. File logic only: callers run these on rank 0
(or every rank) and agree on the result themselves.

What a front end requires of a checkpoint beyond its manifest (the components of the live training objects and
the files its loader reads) comes in as :class:`CandidateRules`; deleting goes through a :class:`~..store.base.Store`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from ..errors import CheckpointIntegrityError, CheckpointLockedError, NoCheckpointError
from ..store.base import Store
from . import faults, quarantine
from .carry import find_user_files, shown
from .manifest import MANIFEST, READABLE_PROTOCOLS, list_tree, loader_may_read, read_manifest, verify_manifest
from .signing import Keyring, check_legacy

logger = logging.getLogger(__name__)
CHECKPOINT_NAME = re.compile(r"checkpoint[-_](\d+)\Z")
#: Whether a manifest-less (native Accelerate) checkpoint may be resumed from when the front end was not told
#: otherwise: the default of ``configure_checkpointing(allow_legacy=...)``, and what the command line, which has no
#: Accelerator, assumes.
ALLOW_LEGACY_DEFAULT = True


def legacy_resume(allowed: bool = ALLOW_LEGACY_DEFAULT) -> str:
    """What a resume does with a ``checkpoint_N`` that has no completion manifest but holds files a loader reads (a
    native Accelerate checkpoint, or a native save that did not finish), under ``allow_legacy=allowed``: the rule
    :func:`check_candidate` and :func:`checkpoint_candidates` apply, in the words the library and the command line
    both print."""
    if allowed:
        return ("load_state() resumes from it when no checkpoint with a manifest is selectable (it is never preferred "
                "over one), after checking every file the restore reads, and warns (RuntimeWarning) that its "
                "completeness cannot be proven; configure_checkpointing(allow_legacy=False) refuses it")
    return ("load_state() refuses it (allow_legacy=False): automatic selection skips it and an explicit load raises "
            "CheckpointIntegrityError; configure_checkpointing(allow_legacy=True), the default, resumes from it")


def legacy_files(path: Path) -> list[str]:
    """The files of a manifest-less directory that a loader would read (what makes it a legacy checkpoint rather
    than an empty or foreign directory), sorted; raises :class:`CheckpointIntegrityError` for a tree no checkpoint
    has (a symbolic link, a special file, nesting deeper than 64 levels)."""
    return sorted(name for name in list_tree(Path(path)) if loader_may_read(name))


def numbered_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(number, path)`` of every ``checkpoint_N`` directory under ``root``, oldest first, and of every symbolic link
    named ``checkpoint_N`` (whatever it points to): links are never followed, so selection skips one with its reason
    (:func:`check_candidate`), retention never counts or deletes one, and the CLI lists it as not a checkpoint."""
    if not Path(root).is_dir():
        return []
    found = []
    for path in Path(root).iterdir():
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match and (path.is_symlink() or path.is_dir()):
            found.append((int(match.group(1)), path))
    return sorted(found)


def symlink_reason(path: Path) -> str | None:
    """Why ``path`` is not a checkpoint if it is a symbolic link, else ``None``."""
    if not Path(path).is_symlink():
        return None
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return (f"a symbolic link (to {target}), not a checkpoint directory: links are not followed, so it is never "
            "selected, verified through or pruned. Copy the checkpoint in place of the link, or load its real path")


def complete_run_id(path: Path) -> str | None:
    """The run id of a published checkpoint with a readable manifest, else ``None`` (never raises for a corrupt
    or hostile sibling: one bad directory must not block saving or selection). A symbolic link is not a published
    checkpoint: ``None``."""
    if Path(path).is_symlink():
        return None
    try:
        manifest = read_manifest(path)
    except (CheckpointIntegrityError, OSError):
        return None
    if not manifest or manifest.get("protocol") not in READABLE_PROTOCOLS or manifest.get("status") != "complete":
        return None
    run_id = manifest.get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def _intact(path: Path, keys: Keyring | None = None) -> bool:
    """Whether a published checkpoint passes the quick check (authenticator, tree, sizes, control-file hashes):
    retention counts and deletes only those, so a corrupt or forged checkpoint never takes the place of a good one it
    would delete."""
    try:
        manifest = read_manifest(path)
        if manifest is None:
            return False
        verify_manifest(path, manifest, full=False, dcp=False, keys=keys)
    except (CheckpointIntegrityError, OSError) as exc:
        logger.warning("Retention: keeping %s out of the count (it is not intact: %s)", path, exc)
        return False
    return True


def is_transient(path: Path) -> bool:
    """A staging directory (a save in progress or killed), one being deleted by retention, or the old tree of a
    replacement set aside: never loadable."""
    name = Path(path).name
    return name.startswith(".") and any(part in name for part in (".staging-", ".deleting-", ".replaced-"))


#: What a directory written by ``save_state`` holds at its top level (whatever the backend: every save writes the
#: RNG state of each rank; FSDP writes these directories), or a published checkpoint's manifest.
_CHECKPOINT_MARKER = re.compile(rf"random_states_\d+\.pkl|(?:pytorch_model_fsdp|optimizer)_\d+|{re.escape(MANIFEST)}")


def replace_refusal(path: Path, protected: dict[str, Path] | None = None) -> str | None:
    """Why a new checkpoint must not replace the existing ``path`` as a whole, or ``None`` if it may.

    It may replace an empty directory, or one a save wrote (a published checkpoint, or a native Accelerate
    checkpoint: RNG files, FSDP model/optimizer directories at its top level). Never a symbolic link, a file, a run
    directory (one that holds checkpoints or saves in progress of its own), a directory with none of those files
    (someone's other data), nor one of ``protected`` (``{what: path}``: the working directory, the project directory,
    ...) or a directory that contains one of them. Looks at the top level only (no walk of a large tree)."""
    path = Path(path)
    if path.is_symlink():
        return "it is a symbolic link"
    if not path.is_dir():
        return "it is not a directory"
    resolved = path.resolve()
    for what, other in (protected or {}).items():
        target = Path(other).resolve()
        if resolved == target or resolved in target.parents:
            return f"it is {what}" if resolved == target else f"it contains {what} ({target})"
    try:
        names = sorted(entry.name for entry in path.iterdir())
    except OSError as exc:
        return f"it cannot be listed ({exc.strerror})"
    if not names:
        return None
    if numbered_checkpoints(path) or any(is_transient(path / name) for name in names):
        return "it holds checkpoints (or saves in progress) of its own: it is a run directory, not a checkpoint"
    if any(_CHECKPOINT_MARKER.fullmatch(name) for name in names):
        return _uncarried(path)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"it holds {shown} and none of the files a save_state() writes"


def _uncarried(path: Path) -> str | None:
    """Why the user's files in the checkpoint directory ``path`` could not all be carried into a replacement
    (``core.carry``: a symbolic link or another entry that is not a regular file among them), or ``None``."""
    try:
        blocked = find_user_files(path).blocked
    except OSError as exc:
        return f"it cannot be listed ({exc.strerror})"
    if not blocked:
        return None
    return (f"it holds {shown(blocked)} beside the checkpoint: not a regular file (a symbolic link, or nested too "
            "deep), which a replacement could not carry into the new checkpoint, so it would be lost")


def refuse_transient(path: Path) -> None:
    if is_transient(path):
        raise CheckpointIntegrityError(
            f"{path} is a staging (or retired) directory of accelerate-txn: a save that did not finish, or a checkpoint "
            "being deleted. It is never loadable; load a published checkpoint_N (accelerate-txn list shows them)."
        )
    if (Path(path) / (MANIFEST + ".tmp")).exists() and not (Path(path) / MANIFEST).exists():
        raise CheckpointIntegrityError(
            f"{path} holds a partly written manifest ({MANIFEST}.tmp): a save was interrupted. It is not loadable."
        )


class CandidateRules(Protocol):
    """What a front end requires of a candidate beyond its manifest, for the live objects it would restore."""

    #: The components (sub-directories, ``""`` for the root) a checkpoint must hold, exactly.
    components: set[str]

    def private_patterns(self) -> list[re.Pattern[str]]:
        """Names of registered private files the loader reads (allowed in the tree, checked by the manifest)."""
        ...

    def allow_legacy(self) -> bool:
        """Whether a manifest-less (native) checkpoint may be resumed from."""
        ...

    def check_required(self, path: Path, manifest: dict[str, Any] | None) -> None:
        """Every file the loader will read is present for every saved rank; raises
        :class:`~accelerate_txn.errors.CheckpointIntegrityError`."""
        ...


def _keys(rules: CandidateRules | None) -> Keyring | None:
    """The verification keys of a front end's rules (``rules.keys()``, when they have one), else ``None``: the
    environment's (``core.signing.active_keyring``)."""
    keys = getattr(rules, "keys", None)
    return keys() if callable(keys) else None


def check_candidate(path: Path, rules: CandidateRules | None, *, legacy: bool | None = None
                    ) -> dict[str, Any] | None:
    """Quick check of one candidate (no collectives): the manifest and the tree against its inventory, the hashes
    of control files and small payloads, every rank's files and, with ``rules`` (live training objects: torch is
    loaded; unless the rules set ``dcp_coverage = False``), the DCP chunk coverage, the components and every required
    file. Returns the manifest (``None`` for a legacy directory that is allowed); raises :class:`CheckpointIntegrityError`.

    A legacy (manifest-less) directory is allowed by ``rules.allow_legacy()``; without rules by ``legacy`` (default
    False; the command line passes :data:`ALLOW_LEGACY_DEFAULT` to answer as ``load_state()`` does), and then only
    if it holds files a loader reads (:func:`legacy_files`: rules check every required file instead)."""
    refuse_transient(path)
    reason = symlink_reason(path)
    if reason is not None:
        raise CheckpointIntegrityError(f"it is {reason}")
    manifest = read_manifest(path)
    patterns = rules.private_patterns() if rules is not None else []
    if manifest is not None:
        dcp = rules is not None and getattr(rules, "dcp_coverage", True)
        verify_manifest(path, manifest, full=False, dcp=dcp, private_patterns=patterns, keys=_keys(rules))
        if rules is not None and set(manifest.get("components", {})) != set(rules.components):
            raise CheckpointIntegrityError(
                f"it holds components {sorted(manifest.get('components', {}))}, not {sorted(rules.components)}"
            )
    else:
        if rules is not None or legacy:  # with verification keys, nothing authenticates a manifest-less directory
            check_legacy(path, _keys(rules))
        if rules is not None and not rules.allow_legacy():
            raise CheckpointIntegrityError(f"it has no completion manifest, and {legacy_resume(False)}")
        if rules is None and not legacy:
            raise CheckpointIntegrityError("it has no completion manifest")
        if rules is None and not legacy_files(path):
            raise CheckpointIntegrityError("it has no completion manifest and no checkpoint files")
    if rules is not None:
        rules.check_required(path, manifest)
    return manifest


def checkpoint_candidates(output_dir: str | Path, rules: CandidateRules | None = None, *,
                          legacy: bool | None = None) -> tuple[list[Path], list[str]]:
    """Loadable candidates under ``output_dir``, best first, and the reasons others were skipped.

    Published checkpoints with a manifest come first (newest first); manifest-less (legacy) directories follow,
    only when ``rules`` (or, without rules, ``legacy``: see :func:`check_candidate`) allow them, so a legacy
    directory is never preferred over a complete checkpoint (:func:`legacy_resume` says so in words). A checkpoint
    an operator set aside (``core.quarantine``: its mark beside it) is skipped with the mark as its reason.
    """
    complete: list[Path] = []
    manifest_less: list[Path] = []
    reasons: list[str] = []
    for _number, path in reversed(numbered_checkpoints(Path(output_dir))):
        mark = None if path.is_symlink() else quarantine.local_mark(path)
        if mark is not None:
            reasons.append(f"{path.name}: {quarantine.skip_reason(mark, str(path))}")
            logger.warning("Skipping checkpoint %s: %s", path, quarantine.skip_reason(mark, str(path)))
            continue
        try:
            manifest = check_candidate(path, rules, legacy=legacy)
        except CheckpointIntegrityError as exc:  # configuration errors are not a reason to pick an older one
            reasons.append(f"{path.name}: {exc}")
            logger.warning("Skipping checkpoint %s: %s", path, exc)
            continue
        (complete if manifest is not None else manifest_less).append(path)
    return complete + manifest_less, reasons


def latest_checkpoint(output_dir: str | Path, rules: CandidateRules | None = None, *, full: bool = False,
                      legacy: bool | None = None) -> str | None:
    """The newest complete checkpoint under ``output_dir`` (a directory of ``checkpoint_N``), or ``None``.

    Candidates are tried newest first; a broken one (no or invalid manifest, missing, truncated or extra files,
    a wrong control-file hash) is skipped with a log line saying why. With ``rules`` (a front end's, for live
    training objects) it also requires their components and required files, and considers legacy
    (manifest-less) checkpoints, after every complete one, when the rules allow them.
    Uses no collectives. Large payload hashes are checked by the restore itself (every rank its own files), which
    skips a candidate that fails them; ``full=True`` checks them here too (one process: the CLI), so the answer is
    the checkpoint ``load_state()`` would resume from. ``legacy``: whether, without ``rules``, a legacy directory
    counts (:func:`check_candidate`).
    Raises :class:`NoCheckpointError` if candidates exist but none is complete.
    """
    candidates, reasons = checkpoint_candidates(output_dir, rules, legacy=legacy)
    for path in candidates:
        if full:
            try:
                manifest = read_manifest(path)
                if manifest is not None:
                    verify_manifest(path, manifest, full=True, dcp=False, keys=_keys(rules))
            except CheckpointIntegrityError as exc:
                reasons.append(f"{path.name}: {exc}")
                logger.warning("Skipping checkpoint %s: %s", path, exc)
                continue
        return str(path)
    if reasons:
        raise NoCheckpointError(
            f"No complete checkpoint in {output_dir}; skipped " + "; ".join(reasons)
            + ". Restore an intact copy or start a new run directory."
        )
    return None


def _set_aside(path: Path, limit: int) -> bool:
    """Whether retention leaves ``path`` out (quarantined), saying so."""
    mark = quarantine.local_mark(path)
    if mark is not None:
        logger.info("Retention (total_limit=%d): keeping %s out of the count and never deleting it: %s. Release it "
                    "('accelerate-txn release %s') to count it again, or delete it by hand", limit, path,
                    mark.describe(), path)
    return mark is not None


def retention_victims(checkpoints: list[Path], limit: int, newest: Path | None = None,
                      keep: Iterable[Path] = (), keep_newest: bool = True) -> list[Path]:
    """The checkpoints retention deletes: ``checkpoints`` are the complete, intact checkpoints of one run, oldest
    first, as listed under the lock; the oldest go until ``limit`` remain, but never the newest of them (the last) nor
    ``newest`` (the one a save just published), so a caller's stale idea of "newest" can never cost the real one.
    ``keep``: checkpoints the caller must keep too (the Trainer's best model): they count toward ``limit`` and are
    never deleted, so more than ``limit`` remain when the kept ones alone exceed it. ``keep_newest=False`` (the end of
    a Trainer run with ``save_total_limit=1``: only the best model stays) lets the last listed go too, when ``keep``
    names one of ``checkpoints``; otherwise the newest stays."""
    if not checkpoints:
        return []
    kept = {Path(path).resolve() for path in keep}
    listed = {Path(path).resolve() for path in checkpoints}
    newest_stays = keep_newest or not (kept & listed)  # never leave a run without a complete checkpoint
    protected = {*kept, *([Path(checkpoints[-1]).resolve()] if newest_stays else [])}
    if newest is not None:
        protected.add(Path(newest).resolve())
    excess = max(0, len(checkpoints) - limit)
    return [path for path in checkpoints if Path(path).resolve() not in protected][:excess]


def prune(root: Path, run_id: str, limit: int, newest: Path | None = None, *, store: Store,
          keep: Iterable[Path] = (), keep_newest: bool = True, keys: Keyring | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints of ``run_id`` beyond ``limit`` (counting ``newest``).

    Decides from what it lists itself (call while holding the parent's ``DirectoryLock``: no save publishes
    meanwhile, and a save in progress holds it). Never deletes the newest complete, intact checkpoint of the run it
    lists, ``newest`` (the one a save just published), an incomplete directory (a save may be in progress, or it is
    evidence), another run's checkpoint, anything through a symlink, or one of ``keep`` (see
    :func:`retention_victims`; ``keep_newest=False``: the newest may go when one of ``keep`` stays). Returns the
    deleted paths.

    Each checkpoint is first renamed aside to a hidden ``.checkpoint_N.deleting-<run>-<txid>`` (parent fsynced),
    then deleted: a crash mid-delete leaves a retired leftover that the next save's cleanup removes, never a
    manifest-less ``checkpoint_N`` that selection would skip and retention never prune. A checkpoint a restore holds
    in use (the store's ``retire`` refuses it) is kept this time and deleted by a later retention. ``keys``: the
    verification keys (default: the environment's): a checkpoint whose authenticator fails is not intact.

    A quarantined checkpoint (``core.quarantine``) is neither counted nor deleted: ``limit`` selectable checkpoints
    stay besides it, and each retention says so (INFO). The mark is checked again while the store claims a victim,
    so a quarantine written after this listing still keeps it.
    """
    ours = [path for _number, path in numbered_checkpoints(root)
            if not path.is_symlink() and complete_run_id(path) == run_id and not _set_aside(path, limit)
            and _intact(path, keys)]
    deleted = []
    for path in retention_victims(ours, limit, newest, keep, keep_newest):
        try:
            aside = store.retire(path, run_id, keep_if=quarantine.set_aside_reason)
        except CheckpointLockedError as exc:  # a restore reads it now: it goes at the next retention
            logger.info("Retention (total_limit=%d): keeping %s this time: %s", limit, path, exc)
            continue
        logger.info("Retention (total_limit=%d): deleting %s", limit, path)
        faults.point("save:during-retention")
        store.remove_tree(aside)
        store.remove_tree(quarantine.mark_path(path))  # a released (or stale) mark goes with its checkpoint
        deleted.append(path)
    return deleted
