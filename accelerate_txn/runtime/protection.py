"""Whether a job's checkpoints are protected, said out loud: the native-fallback warning, strict mode, the answer.

Both front ends decide at each save and load whether the protected path takes it (``accelerate.patch``,
``trainer.patch``). Where an FSDP save or load runs native instead, :func:`say_native` logs one WARNING per process
and reason (logger ``accelerate_txn``, seen at Python's default logging level) saying why and the one change that
would protect it. With strict mode on (:data:`REQUIRE`, ``ACCELERATE_TXN_REQUIRE_PROTECTION=1``, or
``configure_checkpointing(acc, require_protection=True)``) :func:`refuse_native` raises
:class:`~accelerate_txn.errors.CheckpointUnprotectedError` instead, before anything is written or read. Every caller
raises it where the decision is the same on every rank (after the ranks agreed on it, or from settings every rank
reads alike), so no rank is left waiting. :class:`Protection` is the answer ``accelerate_txn.protection()`` gives a
script.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..compat.evidence import OVERRIDE_ENV
from ..core.environment import flag
from ..errors import CheckpointUnprotectedError

REQUIRE_ENV = "ACCELERATE_TXN_REQUIRE_PROTECTION"
#: ``1`` (or true, yes, on): a save or load that would run native raises instead (strict mode, for jobs that cannot
#: edit their code); ``configure_checkpointing(require_protection=...)`` decides for one Accelerator.
REQUIRE = flag(REQUIRE_ENV, False)

notices = logging.getLogger("accelerate_txn")
_SAID: set[str] = set()  # the reasons this process already warned about

#: The one change that protects an FSDP job whose state dict type is not protected (Accelerate's plugin, its config
#: file and environment, and the Trainer's ``fsdp_config`` name it differently).
STATE_DICT_FIX = ("set the FSDP state dict type to SHARDED_STATE_DICT (accelerate config: fsdp_state_dict_type: "
                  "SHARDED_STATE_DICT; environment: FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT; Trainer: "
                  "fsdp_config={'state_dict_type': 'SHARDED_STATE_DICT'}) or FULL_STATE_DICT")

#: The one change that protects a job whose installed releases the evidence does not protect (either front end).
VERSIONS_FIX = (f"install releases the evidence protects (accelerate-txn doctor, docs/versions.md) or set "
                f"{OVERRIDE_ENV}=1 at your own risk")


@dataclass(frozen=True)
class Protection:
    """Whether one Accelerator's (or Trainer's) checkpoints take the protected path now, and if not, why and what
    would change it. Truthy when protected. Decided on this process from the live setup (no collective): a save or
    load also agrees with the other ranks and checks its destination, which this answer cannot foresee."""

    protected: bool
    front_end: str  # "accelerate" or "trainer"
    path: str  # the protected path the setup takes or would take: "fsdp1", "fsdp2" or "common"
    reason: str | None = None  # why not (None when protected)
    fix: str | None = None  # the one change that would protect it, where there is one

    def __bool__(self) -> bool:
        return self.protected

    def __str__(self) -> str:
        if self.protected:
            return f"protected ({self.front_end}, {self.path} path)"
        return f"NOT protected ({self.front_end}): {self.reason}" + (f"; to protect it: {self.fix}" if self.fix else "")


def say_native(what: str, reason: str, fix: str | None = None, *, main: bool = True) -> None:
    """One WARNING per process and reason: ``what`` (e.g. "FSDP checkpoints of this Accelerator") runs native,
    unprotected, because of ``reason``; ``fix`` is the change that would protect it. ``main``: this process speaks
    for the job (the main process), so a job of W ranks says it once."""
    message = (f"accelerate-txn: {what} run native, NOT protected (no staging, no manifest, no verification before "
               f"restore): {reason}" + (f". To protect them: {fix}." if fix else "."))
    if not main or message in _SAID:
        return
    _SAID.add(message)
    notices.warning("%s", message)


def refuse_native(what: str, reason: str, fix: str | None = None, *, source: str | None = None) -> None:
    """Strict mode: raise :class:`CheckpointUnprotectedError` saying that ``what`` would run native, why, and the fix;
    ``source`` names where strict mode was asked for."""
    asked = source or f"{REQUIRE_ENV}=1"
    raise CheckpointUnprotectedError(
        f"accelerate-txn: {what} would run native, NOT protected, and protection is required ({asked}): {reason}"
        + (f". To protect them: {fix}." if fix else ".") + " Nothing was written or read.")
