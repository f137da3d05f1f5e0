"""The user's own files in a checkpoint directory that a save replaces: which ones there are, and which ones the new
checkpoint carries. Pure naming logic over a local tree (no process group, no torch); rank 0 calls it under the
directory lock, and ``store.posix.carry_files`` moves the bytes.

Native ``save_state(output_dir)`` (and the Trainer's ``_save_checkpoint``) write *into* an existing directory, so a
file a person or a tool put there (``NOTES.md``, ``eval_samples/sample_0.txt``) survives a re-save. A protected save
replaces the directory as a whole, so it carries such files into the new checkpoint at the same relative paths,
outside its inventory: the manifest lists them under ``user_files`` with their sizes, never hashed as checkpoint
content, so no verification depends on them (one deleted or edited later changes nothing).

What belongs to the checkpoint being replaced (never carried; the new checkpoint has its own):

* a protected checkpoint (a readable manifest): its inventory and the manifest;
* any checkpoint: the files the native layout writes at each component root (``""``, or the manifest's components):
  every name a loader reads there (``core.manifest.loader_may_read``: Accelerate's model, optimizer, scheduler,
  sampler, scaler, RNG and custom-object files, anything ``.bin``/``.pt``/``.pth``/``.pkl``/``.safetensors``/
  ``.distcp``/``.metadata``, registered private states), the FSDP directories ``pytorch_model_fsdp_N/`` and
  ``optimizer_N/`` (whole), the manifest and its temporary, and the front end's own names (the Trainer's
  ``trainer_state.json``).

A file the new save writes at the same path wins (the old copy is the old checkpoint's), and so does a new file or
directory in the way of one; a file a loader could read that lies in a directory the new save wrote too is a stale
payload beside the new ones (a shard of another sharding), not carried. Empty directories are not carried.

A symbolic link or another non-regular entry among the user's files cannot be carried (a checkpoint holds no links:
verification refuses them), so such a directory is not replaced (``UserFiles.blocked``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import CheckpointExistsError, CheckpointIntegrityError
from .manifest import layout_owns, loader_may_read, read_manifest

logger = logging.getLogger(__name__)
MAX_DEPTH = 64  # as core.manifest.list_tree: no checkpoint is deeper
#: How many carried names a log line shows before "and N more".
SHOWN = 5


@dataclass
class UserFiles:
    """The user's files found in a directory a save replaces: ``files`` (relative name -> size, regular files to
    carry) and ``blocked`` (names that are not regular files or directories: links, pipes; too deep)."""

    files: dict[str, int] = field(default_factory=dict)
    blocked: list[str] = field(default_factory=list)


def _components(manifest: dict[str, Any] | None) -> list[str]:
    components = manifest.get("components") if manifest else None
    return ["", *sorted(c for c in components if isinstance(c, str) and c)] if isinstance(components, dict) else [""]


def find_user_files(old: Path, *, names: Iterable[str] = (),
                    private_patterns: Iterable[re.Pattern[str]] = ()) -> UserFiles:
    """The files of the directory ``old`` (a checkpoint a save replaces) that are not part of that checkpoint (see
    the module docstring). Never follows a symbolic link; a directory that cannot be listed raises ``OSError``."""
    old = Path(old)
    try:
        manifest = read_manifest(old)
    except CheckpointIntegrityError:  # unreadable: judged by the native layout alone
        manifest = None
    inventory = manifest.get("files") if manifest else None
    owned = set(inventory) if isinstance(inventory, dict) else set()
    roots, names, patterns = _components(manifest), list(names), list(private_patterns)
    found = UserFiles()
    stack: list[tuple[Path, str, int]] = [(old, "", 0)]
    while stack:
        folder, prefix, depth = stack.pop()
        with os.scandir(folder) as listing:
            entries = sorted(listing, key=lambda entry: entry.name)
        for entry in entries:
            name = f"{prefix}{entry.name}"
            is_directory = entry.is_dir(follow_symlinks=False)
            if name in owned or layout_owns(name, roots, names, patterns, directory=is_directory):
                continue
            if is_directory:
                if depth + 1 > MAX_DEPTH:
                    found.blocked.append(name + "/")
                else:
                    stack.append((Path(entry.path), f"{name}/", depth + 1))
            elif entry.is_file(follow_symlinks=False):
                found.files[name] = entry.stat(follow_symlinks=False).st_size
            else:
                found.blocked.append(name)
    found.files = dict(sorted(found.files.items()))
    found.blocked.sort()
    return found


def to_carry(user: dict[str, int], new: Path) -> tuple[dict[str, int], list[str]]:
    """Of ``user`` (:func:`find_user_files`), the files the new tree ``new`` takes, and those it does not (a file
    the new save wrote at the same path wins, or a file or directory of it in the way; a loader-readable file in a
    directory the new save wrote too is the old checkpoint's stale payload)."""
    new = Path(new)
    carried: dict[str, int] = {}
    dropped: list[str] = []
    for name, size in user.items():
        path = PurePosixPath(name)
        parents = [new.joinpath(*path.parts[:i]) for i in range(1, len(path.parts))]
        target = new / name
        if os.path.lexists(target) or any(os.path.lexists(p) and not os.path.isdir(p) for p in parents):
            dropped.append(name)
        elif loader_may_read(name) and parents and os.path.isdir(parents[-1]):
            dropped.append(name)
        else:
            carried[name] = size
    return carried, dropped


def shown(names: list[str]) -> str:
    """The first :data:`SHOWN` of ``names``, and how many more, for a log line."""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def carry_note(names: list[str]) -> str:
    """The end of the "Replacing" warning when the directory holds files of the user's."""
    if not names:
        return ""
    one = len(names) == 1
    return (f"; {len(names)} {'file' if one else 'files'} in it {'is' if one else 'are'} not part of the checkpoint "
            f"({shown(names)}): {'it is' if one else 'they are'} carried into the new one at the same "
            f"{'path' if one else 'paths'}, outside its inventory (its manifest lists them as user_files), unless the "
            "new save writes the same path itself")


def carry_user_files(final: Path, staging: Path, carry: Callable[[Path, Path, Iterable[str]], None], *,
                     names: Iterable[str] = (), private_patterns: Iterable[re.Pattern[str]] = ()) -> dict[str, int]:
    """Rank 0, under the lock, before the manifest of ``staging`` is written: carry the user's files of ``final``
    (the checkpoint being replaced) into ``staging`` through the store's ``carry`` (``store.posix.carry_files``: hard
    links or copies, fsynced). Returns ``{name: size}`` of the files carried. An entry that cannot be carried (a symbolic
    link that appeared during the save) fails the save before anything is published."""
    if not (final.is_dir() and not final.is_symlink()):
        return {}
    user = find_user_files(final, names=names, private_patterns=private_patterns)
    if user.blocked:
        raise CheckpointExistsError(
            f"Refusing to replace {final}: it now holds {shown(user.blocked)}, which is not a regular file (a symbolic "
            "link, or nested too deep): the new checkpoint could not carry it, and replacing the directory would lose "
            f"it. Nothing was published; {final} is unchanged. Move that entry out of {final}, or save to a new "
            "directory.")
    carried, dropped = to_carry(user.files, staging)
    carry(final, staging, carried)
    if carried:
        logger.info("Carried %d of your %s from %s into the new checkpoint (not checkpoint content): %s", len(carried),
                    "file" if len(carried) == 1 else "files", final, shown(list(carried)))
    if dropped:
        logger.info("Not carried from %s (the new checkpoint writes these paths itself): %s", final, shown(dropped))
    return carried


def user_file_rows(carried: dict[str, int]) -> dict[str, dict[str, int]]:
    """The manifest's ``user_files``: ``{name: {"size": bytes}}`` (sizes when carried; informational)."""
    return {name: {"size": size} for name, size in sorted(carried.items())}
