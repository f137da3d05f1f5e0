"""One transaction, written once: every protected save of every front end publishes through :class:`Transaction`.

The steps (docs/protocol.md), in the order rank 0 runs them under the directory lock of the destination's parent:

1. **reserve** (:meth:`Transaction.open`): create the parent, take its writers' lock, put back a checkpoint whose
   replacement was killed between its two renames, decide about an existing destination (refused, or replaced as a
   whole once the new one is complete: never a run directory, a protected directory, someone else's data, nor a
   directory holding entries that could not be carried), remove dead writers' leftovers (staging directories of this
   run, or of runs that published nothing here; another run's are reported, not touched), create the hidden staging
   sibling;
2. the front end's native save writes into staging; **every rank hashes and fsyncs the files it wrote**
   (:func:`own_rows`: the flush and the content hash cost one read of each file, spread over the ranks);
3. **publish** (:meth:`Transaction.publish`): rank 0 checks that the gathered rows cover exactly the staged tree,
   runs the front end's own publish proof, checks every DCP tensor is covered, carries the user's files of the
   checkpoint being replaced, fsyncs the directories, writes the manifest last, renames the tree into place (or
   swaps it with the checkpoint it replaces), fsyncs the parent;
4. **retention** (:func:`retain`): the oldest complete checkpoints of the same run beyond the limit, each renamed
   aside before it is deleted; a failure there is reported, never a failed save (the checkpoint is published);
5. **close** (:meth:`Transaction.close`): staging discarded if still there, the lock released (never raises).

What differs between the front ends is data, not steps: :class:`Terms` (the front end's own file names and
per-rank patterns, how its refusals read, whether the native save writes into staging itself or into a directory
of the destination's name inside it, whether another run's checkpoints beside this one are worth a word). The
bytes go through a :class:`~..store.base.LocalStore` (``store.local_store()``); the object-store commit of a save
to a URL (``core.remote``) runs after this publish, from the local copy it made.

Which process runs what is the caller's: the methods of :class:`Transaction` run on rank 0 inside a rank phase
(``core.ranks.on_main``), :func:`own_rows` on every rank, :func:`retain` is collective. ``core.faults.point`` marks
the instants the crash-consistency tests kill a rank at.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointExistsError
from ..store.base import HASH, LocalStore
from . import faults, quarantine
from .carry import carry_note, carry_user_files, find_user_files, shown, user_file_rows
from .manifest import (
    MANIFEST,
    PROTOCOL,
    check_dcp_inventory,
    complete_rows,
    hash_rows,
    list_tree,
    write_manifest,
    writer_rank,
)
from .ranks import on_main, rank, world_size
from .select import complete_run_id, numbered_checkpoints, prune, replace_refusal
from .signing import Key, Keyring

logger = logging.getLogger(__name__)

#: ``check(tree, rows)``: a front end's publish proof over the staged tree and the gathered rows (raises to refuse).
Check = Callable[[Path, dict[str, dict[str, Any]]], None]


@dataclass(frozen=True)
class Terms:
    """What one front end decides about its transactions; the steps are the same for all (module docstring)."""

    #: Who writes a checkpoint without a manifest here, for the warning naming what a save replaces.
    native: str
    #: What to do instead of replacing a directory that is not replaced (the end of the refusal).
    instead: str
    #: Where else to save, for the refusal of a directory holding entries that cannot be carried.
    elsewhere: str
    #: The front end's own top-level files beyond what a loader reads (never carried: the new checkpoint has its own).
    names: tuple[str, ...] = ()
    #: A directory this front end recognises as one of its checkpoints (``None``: judged by ``core.select``
    #: alone): replaced without the other checks, the user's files in it carried.
    own_checkpoint: Callable[[Path], bool] | None = None
    #: Said after the reason when ``own_checkpoint`` does not recognise a refused directory.
    not_own: str = ""
    #: Whether the native save writes ``STAGING/<destination name>/`` (the Trainer's run directory redirected into
    #: staging) rather than into staging itself.
    nested: bool = False
    #: Whether a parent holding another run's checkpoints is said (once per directory and run), and refused with
    #: ``overwrite="refuse"``.
    other_runs: bool = True
    #: Whether replacing the destination is a WARNING (``False``: the local copy of an object-store save, DEBUG).
    loud: bool = True


@dataclass
class Policy:
    """The per-save choices of the user: what an existing destination means and which directories are never
    replaced."""

    overwrite: str = "replace"  # or "refuse": an existing destination is refused
    automatic: bool = False  # Accelerate's automatic naming: an existing destination is refused, as native does
    protected: Mapping[str, Path] = field(default_factory=dict)  # never replaced, nor a directory containing one
    private_patterns: tuple[re.Pattern[str], ...] = ()  # registered per-rank files: the old checkpoint's, not carried


_WARNED_BESIDE: set[tuple[Path, str]] = set()  # (directory, run id) told that it saves beside another run


def what_is_replaced(path: Path, run_id: str, native: str) -> str:
    """The directory a save replaces, in words: whose checkpoint it is (and that it was quarantined)."""
    owner = complete_run_id(path)
    mark = quarantine.local_mark(path) if owner is not None else None
    aside = f"; it was {mark.describe()}, and that mark does not apply to the new checkpoint" if mark else ""
    if owner == run_id:
        return "a checkpoint of this run" + aside
    if owner is not None:
        return f"a checkpoint of another run, {owner}" + aside
    if (path / MANIFEST).exists():
        return "a directory whose manifest is not readable"
    return f"a checkpoint without a manifest ({native})" if any(path.iterdir()) else "an empty directory"


class Transaction:
    """Rank 0's side of one save: the lock of the destination's parent and the staged directory (module docstring).
    Construct it inside a rank phase; :meth:`close` it in a ``finally`` outside one."""

    def __init__(self, final: Path, run_id: str, *, store: LocalStore, terms: Terms, lock_timeout: float,
                 policy: Policy | None = None) -> None:
        self.store = store
        self.terms = terms
        self.policy = policy or Policy()
        self.lock = store.lock(final.parent, lock_timeout)
        self.staged = store.staged(final, run_id)
        self.replacing = False

    @property
    def final(self) -> Path:
        return self.staged.final

    @property
    def run_id(self) -> str:
        return self.staged.run_id

    @property
    def txid(self) -> str:
        return self.staged.txid

    @property
    def staging(self) -> Path:
        return self.staged.staging

    @property
    def tree(self) -> Path:
        """The directory the native save writes and the publish renames: staging, or ``STAGING/<name>`` (nested)."""
        return self.staging / self.final.name if self.terms.nested else self.staging

    # --- 1. reserve -------------------------------------------------------------------------------------------------

    def open(self) -> Path:
        """Lock, recover, decide about an existing destination, clean leftovers, create staging; returns the tree
        the native save writes into. On failure the lock is released and nothing was created."""
        final, parent = self.final, self.final.parent
        self.store.create_directory(parent)  # a parent that is a file: one library error, on every rank (a phase)
        self.lock.acquire()
        try:
            self.store.recover_replaced(parent)  # a replacement killed between its two renames: the old one goes back
            if final.exists() or final.is_symlink():
                self._decide_replacement()
            runs = {complete_run_id(path) for _, path in numbered_checkpoints(parent)} - {None}
            if self.terms.other_runs:
                self._beside_other_runs(runs - {self.run_id})
            # Under the lock no other writer is alive: leftovers of this run, or of runs that never published here,
            # are dead writers'. Another run's leftovers (it owns checkpoints here) are reported, not touched.
            abandoned = {run for _, run in self.store.staging_leftovers(parent)} - runs
            self.store.remove_leftovers(parent, abandoned | {self.run_id})
            self.staged.create_beside() if self.replacing else self.staged.create()
            if self.terms.nested:
                self.tree.mkdir()
            return self.tree
        except BaseException:
            self.lock.release()
            raise

    def _decide_replacement(self) -> None:
        final, terms, policy = self.final, self.terms, self.policy
        if policy.overwrite == "refuse" or policy.automatic:
            fix = ("with automatic naming, set accelerator.project_configuration.iteration past it" if policy.automatic
                   else "or let it be replaced atomically: configure_checkpointing(accelerator, overwrite='replace')")
            raise CheckpointExistsError(f"Refusing to overwrite {final}: it already exists. Resume from it, or save to "
                                        f"a new directory ({fix}).")
        own = terms.own_checkpoint is not None and terms.own_checkpoint(final)
        why = None if own else replace_refusal(final, dict(policy.protected))
        if why is not None:
            raise CheckpointExistsError(f"Refusing to replace {final}: {why}"
                                        f"{terms.not_own if terms.own_checkpoint is not None else ''}. {terms.instead}")
        user = find_user_files(final, names=terms.names, private_patterns=policy.private_patterns)
        if user.blocked:
            raise CheckpointExistsError(
                f"Refusing to replace {final}: it holds {shown(user.blocked)} beside the checkpoint, which is not a "
                "regular file (a symbolic link, or nested too deep): the new checkpoint could not carry it, and "
                f"replacing the directory would lose it. Move it out of {final}, or {terms.elsewhere}.")
        self.replacing = True
        (logger.warning if terms.loud else logger.debug)(
            "Replacing %s (%s): the new checkpoint is published atomically in its place, and the old one is deleted "
            "only after that%s", final, what_is_replaced(final, self.run_id, terms.native), carry_note(list(user.files)))

    def _beside_other_runs(self, strangers: set[str]) -> None:
        parent = self.final.parent
        if strangers and self.policy.overwrite == "refuse":
            raise CheckpointExistsError(
                f"{parent} holds checkpoints of another training run ({sorted(strangers)[0]}); resume that run with "
                "load_state() first, or save into a new directory (configure_checkpointing(accelerator, "
                "overwrite='replace') saves beside them).")
        if strangers and (parent, self.run_id) not in _WARNED_BESIDE:
            _WARNED_BESIDE.add((parent, self.run_id))
            logger.warning("%s also holds checkpoints of another training run (%s): saving beside them; retention "
                           "(total_limit) prunes only this run's checkpoints", parent, ", ".join(sorted(strangers)))

    # --- 3. publish -------------------------------------------------------------------------------------------------

    def publish(self, rows: dict[str, dict[str, Any]], fields: Mapping[str, Any], *, integrity: str,
                signer: Key | None = None, check: Check | None = None) -> Path:
        """Check the staged tree against the gathered ``rows`` (and the front end's ``check``), carry the user's
        files of a replaced checkpoint, write the manifest last (``fields``: the front end's part of it) and rename
        the tree into place. Returns the published path."""
        tree = self.tree
        complete_rows(tree, rows, integrity=integrity)
        if check is not None:
            check(tree, rows)
        check_dcp_inventory(tree, {"files": rows})  # every tensor of every DCP .metadata covered by listed files
        # The user's own files in the directory being replaced go into the new one (outside its inventory). The old
        # tree is not touched: it stays complete until the swap.
        carried = carry_user_files(self.final, tree, self.store.carry_files, names=self.terms.names,
                                   private_patterns=self.policy.private_patterns) if self.replacing else {}
        self.store.fsync_directories(tree)
        manifest: dict[str, Any] = {"protocol": PROTOCOL, "status": "complete", "run_id": self.run_id,
                                    "transaction_id": self.txid, **fields, "integrity": integrity, "hash": HASH,
                                    "files": dict(sorted(rows.items()))}
        if carried:  # the user's own files carried from the checkpoint this one replaces (not checkpoint content)
            manifest["user_files"] = user_file_rows(carried)
        write_manifest(tree, manifest, store=self.store, signer=signer)
        faults.point("save:after-manifest")
        if self.replacing:
            faults.point("save:replace-before-swap")
        # Every file and directory was fsynced above.
        published = self.staged.publish(synced=True, replace=self.replacing, tree=tree,
                                        between=lambda: faults.point("save:replace-old-aside"),
                                        committed=lambda: faults.point("save:replace-after-swap"))
        if self.terms.nested:
            self.staged.discard()  # the staging directory the tree was renamed out of, now empty
        return published

    # --- 4. retention -----------------------------------------------------------------------------------------------

    def prune(self, limit: int, *, keep: Iterable[Path] = (), keys: Keyring | None = None,
              newest: bool = True) -> list[Path]:
        """The oldest complete checkpoints of this run beside the published one beyond ``limit`` (``core.select``);
        rank 0, under the lock this transaction holds."""
        return prune(self.final.parent, self.run_id, limit, self.final, store=self.store, keep=keep, keys=keys,
                     keep_newest=newest)

    # --- 5. close ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Rank 0, outside any rank phase (after the ranks agreed on the outcome): never raises."""
        try:
            self.staged.discard_quietly()
        finally:
            self.lock.release()


def prune_outside_a_save(parent: Path, run_id: str, limit: int, *, store: LocalStore, lock_timeout: float,
                         keep: Iterable[Path] = (), newest: bool = True, keys: Keyring | None = None) -> list[Path]:
    """Retention with no save (the Trainer's end-of-training removal): rank 0 takes the lock of ``parent`` as a
    save does and prunes the run's complete checkpoints beyond ``limit`` (``core.select.prune``: each renamed aside
    before it is deleted; ``newest=False``: the newest may go when one of ``keep`` stays)."""
    lock = store.lock(parent, lock_timeout)
    lock.acquire()
    try:
        return prune(parent, run_id, limit, None, store=store, keep=keep, keep_newest=newest, keys=keys)
    finally:
        lock.release()


def relative(written: Mapping[Path, tuple[int, str]] | None, tree: Path) -> dict[str, tuple[int, str]]:
    """``written`` (hashed while written, by absolute path) keyed by inventory names under ``tree``; others dropped."""
    root = tree.absolute()
    return {path.relative_to(root).as_posix(): value for path, value in (written or {}).items()
            if path.is_relative_to(root)}


def own_rows(tree: Path, rank_templates: Iterable[str], integrity: str,
             written: Mapping[Path, tuple[int, str]] | None = None) -> dict[str, dict[str, Any]]:
    """Every rank: hash and fsync the staged files this rank wrote (``core.manifest.writer_rank``: its DCP shards
    and per-rank files; rank 0 also the shared ones). Files hashed while DCP wrote them (``written``) are only
    fsynced and their size checked. Each rank lists the staged tree but stats only its own files."""
    world, me = world_size(), rank()
    bases = [template.rsplit("/", 1)[-1] for template in rank_templates]
    mine = list(list_tree(tree, keep=lambda name: writer_rank(name, world, bases) == me))
    return hash_rows(tree, mine, algorithm=HASH, integrity=integrity, flush=True,
                     after_first=lambda: faults.point("save:during-flush"), written=relative(written, tree))


def retain(transaction: Transaction | None, published: str, limit: int | None, *, keep: Iterable[Path] = (),
           keys: Keyring | None = None, newest: bool = True, group: Any = None, what: str = "Retention") -> list[str]:
    """Collective: :meth:`Transaction.prune` on rank 0 (``transaction`` is ``None`` elsewhere). The checkpoint is
    published: a failure is a WARNING, not a failed save, unless a rank went away or fell out of step (the job
    cannot go on: raised on every rank). Returns the deleted paths (rank 0)."""
    if limit is None:
        return []
    try:
        return on_main(lambda: [str(path) for path in transaction.prune(limit, keep=list(keep), keys=keys,  # type: ignore[union-attr]
                                                                          newest=newest)], what, group) or []
    except CheckpointError as exc:
        if getattr(exc, "out_of_step", False):
            raise
        if rank() == 0:
            logger.warning("Checkpoint %s is published, but retention failed: %s", published, exc)
        return []
