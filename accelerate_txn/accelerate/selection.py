"""Automatic checkpoint selection for live Accelerators: the core's selection (:mod:`..core.select`) with the
Accelerate front end's rules (the components of the Accelerators, the files Accelerate's loader reads, whether
each allows a legacy checkpoint)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..core import select
from ..core.signing import Keyring


class AcceleratorRules:
    """:class:`..core.select.CandidateRules` of ``{component: Accelerator}``. Loads torch (only selection
    without owners stays torch-free, as the offline CLI needs)."""

    def __init__(self, owners: Any) -> None:
        from .descriptor import participants

        self.group = participants(owners)
        self.components = set(self.group)

    def private_patterns(self) -> list[re.Pattern[str]]:
        from .required import private_patterns

        return [pattern for owner in self.group.values() for pattern in private_patterns(owner)]

    def allow_legacy(self) -> bool:
        from .config import checkpoint_config

        return all(checkpoint_config(owner).allow_legacy for owner in self.group.values())

    def keys(self) -> Keyring:
        """The verification keys of the Accelerators (``configure_checkpointing``, else the environment's)."""
        from .config import group_keys

        return group_keys(self.group)

    def check_required(self, path: Path, manifest: dict[str, Any] | None) -> None:
        from .required import check_required_files, saved_world_size

        for name, owner in self.group.items():  # every saved rank's files (the world size may have changed)
            check_required_files(owner, path / name, range(saved_world_size(manifest, name, path / name)),
                                 read_custom=False)


def _rules(owners: Any) -> AcceleratorRules | None:
    return None if owners is None else AcceleratorRules(owners)


def checkpoint_candidates(output_dir: str | Path, owners: Any = None) -> tuple[list[Path], list[str]]:
    """Loadable candidates under ``output_dir``, best first, and the reasons others were skipped
    (:func:`..core.select.checkpoint_candidates`); ``owners``: an Accelerator or ``{component: Accelerator}``."""
    return select.checkpoint_candidates(output_dir, _rules(owners))


def latest_training_checkpoint(output_dir: str | Path, owners: Any = None, *, full: bool = False) -> str | None:
    """The newest complete checkpoint under ``output_dir`` (a directory of ``checkpoint_N``), or ``None``.

    Candidates are tried newest first; a broken one (no or invalid manifest, missing, truncated or extra files,
    a wrong control-file hash) is skipped with a log line saying why. Pass ``owners`` (an Accelerator or
    ``{component: Accelerator}``) to also require that the checkpoint holds their components and required files,
    and to consider legacy (manifest-less) checkpoints, after every complete one, when every owner allows them.
    Uses no collectives. Large payload hashes are checked by the restore itself (every rank its own files), which
    skips a candidate that fails them; ``full=True`` checks them here too (one process: the CLI), so the answer is
    the checkpoint ``load_state()`` would resume from.
    Raises :class:`~accelerate_txn.errors.NoCheckpointError` if candidates exist but none is complete.
    """
    return select.latest_checkpoint(output_dir, _rules(owners), full=full)
