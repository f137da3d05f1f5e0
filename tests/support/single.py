"""A one-process Accelerator that took one optimizer step: the subject of the single-process tests."""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator


def stepped_accelerator(seed: int | None = 0, **project: Any) -> tuple[Accelerator, Any, Any]:
    """``Accelerator(cpu=True)`` (with ``ProjectConfiguration(**project)`` if given) with a prepared ``Linear(4, 3)``
    and Adam that took one step; ``seed`` seeds the model's initial values (``None``: the RNG as it is)."""
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(**project) if project else None)
    if seed is not None:
        torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return accelerator, model, optimizer
