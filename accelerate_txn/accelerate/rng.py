"""RNG files and private per-rank state.

Accelerate writes ``random_states_<rank>.pkl`` with ``torch.save`` (Python, NumPy and torch generators). We
read it with ``weights_only=True`` and an allowlist of exactly the NumPy types it needs, validate it by
applying it through the public setters and putting the caller's state back, and apply it ourselves after a
restore, raising on failure (native Accelerate swallows RNG errors).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointConfigurationError, CheckpointIntegrityError
from ..fsdp.internals import numpy_reconstruct
from .config import checkpoint_config

RNG_FILE = "random_states_{rank}.pkl"
_REQUIRED = ("step", "random_state", "numpy_random_seed", "torch_manual_seed")


def _numpy_globals() -> list[Any]:
    import codecs

    allowed: list[Any] = [np.ndarray, np.dtype, numpy_reconstruct(), codecs.encode]  # as Accelerate's own reader
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None and hasattr(dtypes, "UInt32DType"):
        allowed.append(dtypes.UInt32DType)
    return allowed


def load_weights_only(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True`` plus the NumPy RNG types: never arbitrary objects."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointIntegrityError(f"Missing checkpoint file {path}") from None
    except Exception as exc:
        # torch's message suggests weights_only=False: exactly what must not be done with untrusted files.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = next((line for line in lines if "GLOBAL" in line.upper() and "weights_only" not in line),
                     lines[0] if lines else type(exc).__name__)
        raise CheckpointIntegrityError(
            f"Unreadable checkpoint file {path}: {first}. accelerate-txn reads it with weights_only=True and never "
            "unpickles arbitrary objects; a file that needs more was not written by Accelerate or was altered."
        ) from exc


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return state


def apply_rng(state: Mapping[str, Any]) -> None:
    random.setstate(state["random_state"])
    np.random.set_state(state["numpy_random_seed"])
    torch.set_rng_state(state["torch_manual_seed"])
    if "torch_cuda_manual_seed" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda_manual_seed"])


def read_rng_file(directory: Path, rank: int) -> dict[str, Any]:
    """Read and validate one rank's RNG file without changing this process's generators."""
    path = Path(directory) / RNG_FILE.format(rank=rank)
    state = load_weights_only(path)
    if not isinstance(state, dict):
        raise CheckpointIntegrityError(f"{path} is not an Accelerate RNG state")
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        raise CheckpointIntegrityError(f"{path} lacks RNG state {missing}")
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in state:
        saved = len(state["torch_cuda_manual_seed"])
        if saved != torch.cuda.device_count():
            raise CheckpointConfigurationError(
                f"{path} holds CUDA RNG states for {saved} devices; this process sees {torch.cuda.device_count()}. "
                "Resume with the same number of visible GPUs per process."
            )
    previous = capture_rng()
    try:
        apply_rng(state)
    except Exception as exc:
        raise CheckpointIntegrityError(f"{path} holds an RNG state that cannot be applied: {exc}") from exc
    finally:
        apply_rng(previous)
    return state


def register_checkpoint_state(
    accelerator: Any,
    generators: Mapping[str, torch.Generator],
    progress: MutableMapping[str, Any],
    *,
    filename: str = "training_state_{rank}.pt",
    progress_keys: Iterable[str] | None = None,
) -> tuple[Any, Any]:
    """Save private per-rank generators and consumed-batch progress with every checkpoint.

    Each rank writes ``filename.format(rank=...)`` (tensors and plain values only, read back with
    ``weights_only=True``). On an elastic resume (``allow_reshard``) a rank restores the state of the saved rank
    the policy of ``accelerate.elastic`` assigns it (a new rank: progress copied, generators derived). The schema
    (generator names and devices, progress keys) is part of the training-configuration descriptor; on load every
    rank's file is validated before anything is restored.
    Returns the save and load hook handles (``handle.remove()`` unregisters).
    """
    if "{rank}" not in filename:
        raise CheckpointConfigurationError(
            f"register_checkpoint_state(filename={filename!r}): the name must contain '{{rank}}' so ranks do not "
            "overwrite each other's state"
        )
    keys = tuple(progress) if progress_keys is None else tuple(progress_keys)
    missing = [key for key in keys if key not in progress]
    if missing:
        raise CheckpointConfigurationError(f"register_checkpoint_state: progress lacks keys {missing}")
    config = checkpoint_config(accelerator)
    if filename in config.private_states:
        raise CheckpointConfigurationError(f"register_checkpoint_state: {filename!r} is already registered")
    config.private_states[filename] = {
        "schema_version": 1,
        "generators": {name: generator.device.type for name, generator in sorted(generators.items())},
        "progress_keys": sorted(keys),
    }

    def read_state(directory: Path, rank: int) -> dict[str, Any]:
        path = Path(directory) / filename.format(rank=rank)
        state = load_weights_only(path)
        if (not isinstance(state, dict) or not isinstance(state.get("generators"), dict)
                or not isinstance(state.get("progress"), dict)):
            raise CheckpointIntegrityError(f"{path} is not a registered checkpoint state")
        if set(state["generators"]) != set(generators) or set(keys) - set(state["progress"]):
            raise CheckpointConfigurationError(
                f"{path} holds generators {sorted(state['generators'])} and progress {sorted(state['progress'])}; "
                f"this run registered generators {sorted(generators)} and progress {sorted(keys)}"
            )
        for name, generator in generators.items():
            previous = generator.get_state()
            try:
                generator.set_state(state["generators"][name])
            except Exception as exc:
                raise CheckpointIntegrityError(f"{path}: generator {name!r} state cannot be applied: {exc}") from exc
            finally:
                generator.set_state(previous)
        return state

    config.validators[filename] = read_state

    def save_hook(models: Any, weights: Any, output_dir: str) -> None:
        path = Path(output_dir) / filename.format(rank=accelerator.process_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"generators": {name: g.get_state() for name, g in generators.items()},
                    "progress": {key: progress[key] for key in keys}}, path)

    def load_hook(models: Any, input_dir: str) -> None:
        # Elastic resume (``accelerate.elastic``): the saved rank this rank takes its state from; a new rank derives its
        # generators from that rank's instead of replaying its streams.
        me, plan = accelerator.process_index, checkpoint_config(accelerator).rank_plan
        source = plan.source(me) if plan is not None else me
        state = read_state(Path(input_dir), source)
        for name, generator in generators.items():
            if plan is not None and me in plan.derived:
                generator.manual_seed(derived_seed(state["generators"][name], me, name))
            else:
                generator.set_state(state["generators"][name])
        progress.update(state["progress"])

    return accelerator.register_save_state_pre_hook(save_hook), accelerator.register_load_state_pre_hook(load_hook)


# --- elastic resume: generators of a new rank, derived from a saved one -------------------------------------

def derived_seed(saved_state: torch.Tensor, rank: int, salt: str = "") -> int:
    """A 63-bit seed from a saved generator state (a ``ByteTensor``), the new rank's index and ``salt``
    (deterministic: the same checkpoint and rank always give the same seed)."""
    digest = hashlib.blake2b(digest_size=8, person=b"acctxn-reshard1")
    digest.update(bytes(saved_state.contiguous().view(torch.uint8).numpy()))
    digest.update(f"{rank}/{salt}".encode())
    return int.from_bytes(digest.digest(), "little") >> 1


def derive_rng(saved: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """An Accelerate RNG state for new rank ``rank``, derived from a saved rank's (``step`` kept). The process's
    own generators are left as they were."""
    seed = derived_seed(saved["torch_manual_seed"], rank, "accelerate")
    previous = capture_rng()
    try:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # every device's generator, CUDA included
        state = capture_rng()
    finally:
        apply_rng(previous)
    return {**state, "step": saved["step"]}

