"""Finite checks of training state (opt-in: ``check_finite=True`` or ``ACCELERATE_TXN_CHECK_FINITE=1``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..errors import NonFiniteStateError

_CHUNK = 1 << 20  # bounded temporary memory while checking


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def check_finite_state(value: Any, what: str = "training state") -> None:
    """Raise :class:`NonFiniteStateError` if any floating tensor in ``value`` holds NaN or Inf."""
    from ..fsdp.internals import local_tensors

    for tensor in _tensors(value):
        for local in local_tensors(tensor):
            if not (local.is_floating_point() or local.is_complex()):
                continue
            for chunk in local.detach().reshape(-1).split(_CHUNK):
                if not bool(torch.isfinite(chunk).all()):
                    raise NonFiniteStateError(
                        f"The {what} contains NaN or Inf: refusing to checkpoint diverged training. Resume from the "
                        "last good checkpoint (or disable check_finite)."
                    )


def check_finite_training_value(value: Any, name: str) -> None:
    """Raise :class:`NonFiniteStateError` naming ``name`` if ``value`` (a number or tensor) is not finite."""
    if value is not None and not bool(torch.isfinite(torch.as_tensor(value)).all()):
        raise NonFiniteStateError(f"Training value {name!r} is not finite ({value!r}): stop before checkpointing it.")
