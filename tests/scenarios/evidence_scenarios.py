"""Rank code for tests/compat/test_evidence_shadow.py and tests/test_evidence_file.py: real 2-rank FSDP1 jobs (gloo, CPU)
under a changed release of Accelerate (a shadow copy of its sources first on ``sys.path``) or a damaged evidence
file, where every path must run native with one warning and restore as native does.

Nothing here imports Accelerate or the library at module level: a rank puts the shadow first on ``sys.path``
before either is imported, so the sources Python imports (and the evidence check reads) are the changed ones.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

NOT_PROTECTED = "NOT protected"


@contextmanager
def _counted() -> Iterator[dict[str, list[str]]]:
    """What a user sees at Python's default logging level inside the block: every warning (``warnings.warn``, each
    call, repeats included) and every log record at WARNING or above, of any logger, that says ``NOT protected``."""
    seen: dict[str, list[str]] = {"warnings": [], "records": []}

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if NOT_PROTECTED in record.getMessage():
                seen["records"].append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield seen
        seen["warnings"] = [str(w.message) for w in caught if NOT_PROTECTED in str(w.message)]
    finally:
        root.removeHandler(handler)


def _model_state(model: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters as the model exposes them (the local shards)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(name for name in a if not torch.equal(a[name], b[name]))


def _mixed_precision_fsdp1(seed: int) -> tuple[Any, Any, Any]:
    """An FSDP1 Accelerator under a ``MixedPrecision`` policy (bf16 parameters: the direct model read declines such
    a layout, so a protected restore runs Accelerate's ``load_fsdp_model``), a model and its optimizer, prepared."""
    from torch.distributed.fsdp import MixedPrecision

    from accelerate_txn.testing import TinyModel, fsdp_accelerator

    accelerator = fsdp_accelerator()
    accelerator.state.fsdp_plugin.mixed_precision_policy = MixedPrecision(param_dtype=torch.bfloat16)
    torch.manual_seed(seed)
    model = accelerator.prepare(TinyModel())
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _train(accelerator: Any, model: Any, optimizer: Any, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + accelerator.process_index)
    for _ in range(steps):
        loss = model(torch.randn(4, 16, generator=generator)).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def mixed_precision_restore(root: str, shadow: str | None) -> dict[str, Any]:
    """Save an FSDP1 model under a MixedPrecision policy, then restore it into a fresh one through ``load_state``
    and, for comparison, through native Accelerate's own ``load_state``. ``shadow``: a changed Accelerate (put first
    on ``sys.path``); None: the installed one."""
    if shadow is not None:
        sys.path.insert(0, shadow)
    import accelerate

    from accelerate_txn import MANIFEST
    from accelerate_txn.accelerate.native import native_method
    from accelerate_txn.accelerate.patch import _protected
    from accelerate_txn.fsdp import fsdp1_model

    base = Path(root)
    obs: dict[str, Any] = {"accelerate_file": accelerate.__file__}
    accelerator, model, optimizer = _mixed_precision_fsdp1(0)
    _train(accelerator, model, optimizer, 2, seed=1)
    saved = _model_state(model)
    with _counted() as seen:
        obs["protected"] = _protected(accelerator, output_dir=str(base / "checkpoint"))
        accelerator.save_state(str(base / "checkpoint"))
        accelerator.save_state(str(base / "checkpoint_again"))
        fresh, fresh_model, _fresh_optimizer = _mixed_precision_fsdp1(1)
        before = _model_state(fresh_model)
        direct = len(fsdp1_model.DIRECT_LOADS)
        fresh.load_state(str(base / "checkpoint"))
        obs["direct_loads"] = len(fsdp1_model.DIRECT_LOADS) - direct
    obs["warnings"], obs["records"] = seen["warnings"], seen["records"]
    restored = _model_state(fresh_model)
    obs["manifest"] = (base / "checkpoint" / MANIFEST).is_file()
    obs["restored_differences"] = _differences(saved, restored)
    obs["unchanged_by_load"] = _differences(before, restored) == []
    native, native_model, _native_optimizer = _mixed_precision_fsdp1(1)
    native_method(native, "load_state")(str(base / "checkpoint"))
    obs["native_differences"] = _differences(restored, _model_state(native_model))
    return obs


def native_under_damage(root: str) -> dict[str, Any]:
    """Run under ``accelerate_txn.testing``'s script launcher (FSDP1 forced on the Accelerator) with a copy of the
    library whose evidence file is damaged first on ``PYTHONPATH``: train, save twice, train on, load the first
    checkpoint back; what was warned and logged, whether a manifest was written, what the load restored."""
    from importlib import resources

    from accelerate import Accelerator

    import accelerate_txn
    from accelerate_txn.testing import TinyModel

    base = Path(root)
    obs: dict[str, Any] = {"library": accelerate_txn.__file__,
                           "evidence": str(resources.files("accelerate_txn").joinpath("evidence.json"))}
    with _counted() as seen:
        accelerator = Accelerator()
        torch.manual_seed(0)
        model = accelerator.prepare(TinyModel())
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
        _train(accelerator, model, optimizer, 2, seed=1)
        saved = _model_state(model)
        accelerator.save_state(str(base / "checkpoint"))
        accelerator.save_state(str(base / "checkpoint_again"))
        _train(accelerator, model, optimizer, 1, seed=2)
        obs["changed_by_training"] = _differences(saved, _model_state(model)) != []
        accelerator.load_state(str(base / "checkpoint"))
    obs["warnings"], obs["records"] = seen["warnings"], seen["records"]
    obs["distributed_type"] = accelerator.distributed_type.name
    obs["manifest"] = (base / "checkpoint" / accelerate_txn.MANIFEST).is_file()
    obs["model_saved"] = (base / "checkpoint" / "pytorch_model_fsdp_0" / ".metadata").is_file()
    obs["restored_differences"] = _differences(saved, _model_state(model))
    return obs


if __name__ == "__main__":  # a training script for the launcher: python tests/scenarios/evidence_scenarios.py ROOT
    print("OBSERVED " + json.dumps(native_under_damage(sys.argv[1])), flush=True)
