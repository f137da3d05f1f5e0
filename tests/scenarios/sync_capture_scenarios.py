"""Synchronous protected FSDP1 saves that build their sharded state dicts collective-free from views of the live
local shards (``fsdp.capture`` with ``copy=False``), run inside launched ranks (real gloo, real Accelerate FSDP1,
real DCP files). Observations for tests/fsdp/test_sync_capture.py."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tests.scenarios.async_scenarios import _build_buffered, _entries, _first_error, _tensor_collectives
from tests.scenarios.scenarios import _local_state, _same, _train


@contextlib.contextmanager
def _copies() -> Iterator[list[int]]:
    """The element count of every host copy ``fsdp.capture`` makes while active (instrumentation: each call goes
    through to the real ``staged_tensor``)."""
    from accelerate_txn.fsdp import capture

    original = capture.staged_tensor
    seen: list[int] = []

    def counting(source: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.append(source.numel())
        return original(source, **kwargs)

    capture.staged_tensor = counting
    try:
        yield seen
    finally:
        capture.staged_tensor = original


def _digests(top: Path) -> dict[str, str]:
    return {str(p.relative_to(top)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(top.rglob("*")) if p.is_file()}


def _native_load(path: Path, use_orig_params: bool, expected: dict[str, Any]) -> tuple[list[str] | None, str | None]:
    """Native Accelerate's load_state of ``path`` into a fresh job (one step first: native restores optimizer
    state only into an optimizer that has state): the differences from ``expected``, or its error when
    Accelerate's native FSDP1 optimizer load fails (1.7-1.12 do on their own synchronous checkpoints too)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from accelerate_txn.accelerate.native import native_method

    acc, model, opt, sched = _build_buffered(8, use_orig_params)
    _train(acc, model, opt, sched, 1, seed=3)
    try:
        native_method(acc, "load_state")(str(path))
    except (RuntimeError, CheckpointException) as exc:  # DCP wraps the rank's error
        return None, _first_error(exc)
    return _same(expected, _local_state(model, opt)), None


def sync_capture(root: str, use_orig_params: bool) -> dict[str, Any]:
    """A synchronous protected FSDP1 save: no FSDP collective and no large copy in the caller, the DCP entries of
    a native save, exact restores (protected and native), files written before it returns; a declined layout
    still saves natively and exactly."""
    from accelerate_txn.accelerate.native import native_method

    base = Path(root)
    obs: dict[str, Any] = {}
    acc, model, opt, sched = _build_buffered(0, use_orig_params)
    _train(acc, model, opt, sched, 3, seed=1)
    expected = _local_state(model, opt)
    with _tensor_collectives() as seen, _copies() as copies:
        saved = acc.save_state(str(base / "sync"))
    obs["sync_type"] = type(saved).__name__
    obs["sync_collectives"] = seen
    obs["largest_copy"] = max(copies, default=0)  # only 0-dim state (step) is copied
    obs["copies"] = len(copies)
    written = _digests(base / "sync")
    # Training mutates the live parameters and optimizer state right after save_state returned.
    _train(acc, model, opt, sched, 1, seed=5)
    after_step = _local_state(model, opt)
    obs["files_unchanged"] = _digests(base / "sync") == written
    obs["training_moved"] = _same(expected, after_step) != []

    # The reference: native Accelerate's own save of the same state (restored into a fresh job), with FSDP's
    # gathers (the counter sees them: the empty list above is a measurement).
    acc_n = _build_buffered(5, use_orig_params)[0]
    acc_n.load_state(str(base / "sync"))
    with _tensor_collectives() as seen_native:
        native_method(acc_n, "save_state")(str(base / "native"))
    obs["native_collectives"] = len(seen_native)
    obs["dcp_differences"] = sorted(
        f"{folder}:{key}" for folder in ("pytorch_model_fsdp_0", "optimizer_0")
        for key in set(_entries(base / "sync" / folder)) | set(_entries(base / "native" / folder))
        if _entries(base / "sync" / folder).get(key) != _entries(base / "native" / folder).get(key))
    obs["dcp_entries"] = len(_entries(base / "sync" / "optimizer_0")) + len(
        _entries(base / "sync" / "pytorch_model_fsdp_0"))

    # The protected restore is exact, and the next step from it equals the original's next step.
    acc2, model2, opt2, sched2 = _build_buffered(7, use_orig_params)
    acc2.load_state(str(base / "sync"))
    obs["protected_differences"] = _same(expected, _local_state(model2, opt2))
    _train(acc2, model2, opt2, sched2, 1, seed=5)
    obs["next_step_differences"] = _same(after_step, _local_state(model2, opt2))

    # Native Accelerate's load_state reads the boxes too (or fails as it does on its own native files).
    obs["native_differences"], obs["native_error"] = _native_load(base / "sync", use_orig_params, expected)
    if obs["native_differences"] is None:
        obs["native_reference_error"] = _native_load(base / "native", use_orig_params, expected)[1]

    # Declined on one rank (a user state-dict hook on rank 1's model only): every rank builds the model state
    # dict natively, with FSDP's gathers, and the save is exact.
    acc3, model3, _opt3, _ = _build_buffered(9, use_orig_params)
    acc3.load_state(str(base / "sync"))
    if acc3.process_index == 1:
        model3._register_state_dict_hook(lambda module, state, prefix, local_metadata: None)
    with _tensor_collectives() as seen_declined:
        acc3.save_state(str(base / "declined"))
    obs["declined_collectives"] = len(seen_declined)
    acc4, model4, opt4, _ = _build_buffered(11, use_orig_params)
    acc4.load_state(str(base / "declined"))
    obs["declined_differences"] = _same(expected, _local_state(model4, opt4))
    return obs
