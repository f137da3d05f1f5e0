"""The files a Trainer resume reads, read safely on every rank, in one rank phase, before Trainer loads anything.

Why: Trainer reads its checkpoint's files one at a time, interleaved with restoring them: the model first (FSDP: after
``prepare``), then ``optimizer``/``scheduler.pt``, ``scaler.pt``, and each rank its own ``rng_state_{rank}.pth`` only
when the resumed epoch starts. A file that cannot be read on one rank (truncated, forged, not what Trainer wrote) then
fails on that rank alone, after the model and optimizer were restored, while the other ranks wait for it in the next
collective (gloo: "Connection closed by peer" once it dies; NCCL: until the watchdog). The content hashes of a
manifest prove the files are the ones the manifest lists, not that they are readable (a manifest rewritten to match a
forged file verifies), and a native (manifest-less) checkpoint has no hashes at all.

:func:`check_resume_files` is collective: every rank calls it, after the checkpoint's manifest and hashes were
checked and before native ``train`` runs. In one phase (``core.ranks.run_phase``) each rank reads what its own
Trainer resume will read: ``trainer_state.json`` (``TrainerState.load_from_json``, Trainer's own reader), a
``config.json``, its own RNG file (the one Trainer picks: ``rng_state_{process_index}.pth``, or ``rng_state.pth`` with
``args.world_size == 1``), ``scheduler.pt``, ``scaler.pt``, a non-FSDP ``optimizer.pt``/``pytorch_model.bin``/
``model.safetensors``, and, in a native checkpoint, that every range its DCP metadata names is there in full. A file
unreadable on any rank becomes the same :class:`~accelerate_txn.errors.CheckpointIntegrityError` on every rank,
naming the file, the rank and the fix; nothing has been restored.

Nothing is unpickled as arbitrary objects: ``torch.load(weights_only=True)`` (the RNG files with exactly the NumPy
types Trainer's own RNG reader allows; the large files memory-mapped, so their tensors are not read twice), JSON with
``json``, safetensors by its header. Nothing is mutated: an RNG state is applied to this process's generators to
prove Trainer can apply it, and the previous states are put back whatever happens.
"""

from __future__ import annotations

import json
import random
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.manifest import check_dcp_payloads
from ..core.ranks import rank, run_phase
from ..errors import CheckpointIntegrityError
from ..fsdp.internals import numpy_reconstruct
from .layout import RNG_SINGLE, RNG_TEMPLATE, TRAINER_STATE

#: The keys Trainer's ``_load_rng_state`` reads (a missing one is a ``KeyError`` there, after the model was loaded).
RNG_KEYS = ("python", "numpy", "cpu")
#: Files read with ``torch.load(weights_only=True)`` when present, and what each is.
TORCH_FILES = {"scheduler.pt": "the learning-rate scheduler state", "scaler.pt": "the gradient scaler state",
               "optimizer.pt": "the optimizer state", "pytorch_model.bin": "the model weights"}
#: DCP directories of an FSDP ``SHARDED_STATE_DICT`` checkpoint.
DCP_DIRECTORIES = ("pytorch_model_fsdp_0", "optimizer_0")
_FIX = ("It is not a resumable checkpoint: restore an intact copy of the checkpoint, or resume from another one "
        "(resume_from_checkpoint=True skips it).")


def _rng_globals() -> list[Any]:
    """The NumPy types Trainer allows when it reads an RNG file (``trainer_pt_utils.safe_globals``)."""
    return [numpy_reconstruct(), np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _first_line(exc: BaseException) -> str:
    """The telling line of a ``torch.load`` failure (never torch's advice to retry with ``weights_only=False``)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    telling = [line for line in lines if "GLOBAL" in line.upper() and "weights_only" not in line]
    text = (telling[0] if telling else (lines[0] if lines else "")).split(" This is an internal miniz error")[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _refuse(path: Path, what: str, reason: str) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(
        f"{path} ({what}, which Trainer's resume reads on rank {rank()}) cannot be read: {reason}. Nothing was "
        f"restored (natively, Trainer would fail only on reaching it, after restoring the model). {_FIX}")


def _torch_load(path: Path, what: str, allowed: list[Any] | None = None, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of ``path`` (with ``allowed`` globals; memory-mapped when ``mmap`` and the
    file is a zip archive); the value must be a dict."""
    try:
        mapped = mmap and zipfile.is_zipfile(path)
        with torch.serialization.safe_globals(allowed or []):
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as exc:
        reason = _first_line(exc)
        if "GLOBAL" in reason.upper() or "weights_only" in str(exc):
            reason += (" (accelerate-txn reads it with torch.load(weights_only=True) and never unpickles arbitrary "
                       "objects: a file that needs more was not written by Trainer, or was forged)")
        else:
            reason += " (the file is truncated or corrupt)"
        raise _refuse(path, what, reason) from exc
    if not isinstance(value, dict):
        raise _refuse(path, what, f"it holds a {type(value).__name__}, not the dict Trainer wrote")
    return value


def _check_rng(path: Path) -> None:
    """``path`` is an RNG state Trainer can apply: read safely, its keys there, each applied to this process's
    generators (and the previous states put back)."""
    what = "this rank's RNG state"
    state = _torch_load(path, what, _rng_globals())
    missing = [key for key in RNG_KEYS if key not in state]
    if missing:
        raise _refuse(path, what, f"it lacks {missing} (Trainer reads {list(RNG_KEYS)})")
    previous = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    try:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.random.set_rng_state(state["cpu"])
    except Exception as exc:
        raise _refuse(path, what, f"its state cannot be applied ({_first_line(exc)})") from exc
    finally:
        random.setstate(previous[0])
        np.random.set_state(previous[1])
        torch.random.set_rng_state(previous[2])


def _check_json(path: Path, what: str, reader: Callable[[Path], Any] | None = None) -> None:
    try:
        value = json.loads(path.read_bytes())
        if not isinstance(value, dict):
            raise ValueError(f"it holds a JSON {type(value).__name__}, not an object")
        if reader is not None:
            reader(path)
    except Exception as exc:
        raise _refuse(path, what, _first_line(exc)) from exc


def _trainer_state(path: Path) -> None:
    from transformers import TrainerState

    TrainerState.load_from_json(str(path))


def _check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            list(handle.keys())
    except Exception as exc:
        raise _refuse(path, "the model weights", _first_line(exc)) from exc


def rng_file(trainer: Any) -> str:
    """The RNG file this rank's Trainer reads on resume (as ``Trainer._load_rng_state`` picks it)."""
    args = trainer.args
    return RNG_TEMPLATE.format(rank=args.process_index) if args.world_size > 1 else RNG_SINGLE


def read_own_files(trainer: Any, path: Path, manifest: dict[str, Any] | None) -> None:
    """This rank: read every file of ``path`` its Trainer resume reads, safely (see the module docstring); raises
    :class:`CheckpointIntegrityError` naming the first that cannot be read. Not collective."""
    state = path / TRAINER_STATE
    if not state.is_file():
        raise CheckpointIntegrityError(f"{state} is missing (Trainer's resume reads it on every rank). {_FIX}")
    _check_json(state, "the Trainer state", _trainer_state)
    if (path / "config.json").is_file():
        _check_json(path / "config.json", "the model configuration")
    rng = path / rng_file(trainer)
    if rng.is_file():  # Trainer treats a missing one as optional; the checkpoint's own checks require it
        _check_rng(rng)
    for name, what in TORCH_FILES.items():
        if (path / name).is_file():
            _torch_load(path / name, what, mmap=name in ("optimizer.pt", "pytorch_model.bin"))
    if (path / "model.safetensors").is_file():
        _check_safetensors(path / "model.safetensors")
    if manifest is None:  # a manifest's sizes and hashes already cover every DCP payload
        for folder in DCP_DIRECTORIES:
            if (path / folder / ".metadata").is_file():
                try:
                    check_dcp_payloads(path / folder)
                except CheckpointIntegrityError as exc:
                    raise CheckpointIntegrityError(f"{exc}. {_FIX}") from exc


def check_resume_files(trainer: Any, path: Path, manifest: dict[str, Any] | None) -> None:
    """Collective: every rank reads the files its Trainer resume reads (:func:`read_own_files`); a file unreadable on
    any rank raises the same :class:`CheckpointIntegrityError` on every rank, naming the rank(s)."""
    run_phase(lambda: read_own_files(trainer, path, manifest),
              f"Reading the files a Trainer resume reads from {path}")
