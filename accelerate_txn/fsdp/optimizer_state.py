"""Which optimizer state the protected FSDP path can checkpoint: a rule read from the state, not a class list.

Supported: every per-parameter value is a tensor shaped like its parameter, a 0-dim tensor, or a Python scalar
(``bool``/``int``/``float``) or ``None``. That covers torch.optim Adam/AdamW (amsgrad, foreach, fused), SGD,
Adagrad, RMSprop, NAdam, RAdam, Adamax, Adadelta, ASGD, Rprop and others of that form. Not supported: state of
another shape (an 8-bit optimizer's quantised blocks) or nested containers; under automatic dispatch such an
optimizer runs native Accelerate with a warning (``accelerate.patch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Accelerate's ``AcceleratedOptimizer`` wraps the real optimizer in ``.optimizer``."""
    return getattr(optimizer, "optimizer", optimizer)



_SCALARS = (bool, int, float, type(None))
_WHAT = "the protected path restores only state made of parameter-shaped tensors and scalars"


def _name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def unsupported_state(optimizer: torch.optim.Optimizer) -> str | None:
    """Why this live optimizer's state cannot be checkpointed by the protected path, or None.

    Local, no collective. An optimizer without state yet passes: its checkpoint is checked on load.
    """
    for index, group in enumerate(optimizer.param_groups):
        for parameter in group["params"]:
            for key, value in optimizer.state.get(parameter, {}).items():
                if isinstance(value, torch.Tensor):
                    if value.dim() == 0 or value.shape == parameter.shape:
                        continue
                    found = f"has shape {list(value.shape)} for a parameter (shard) of shape {list(parameter.shape)}"
                elif isinstance(value, _SCALARS):
                    continue
                else:
                    found = f"is a {_name(value)}"
                return f"{_name(optimizer)} state {key!r} (parameter group {index}) {found}; {_WHAT}"
    return None


def unsupported_checkpoint(metadata: Any, where: str) -> str | None:
    """Why a DCP optimizer checkpoint (its metadata) holds state the protected path cannot restore, or None:
    nested per-parameter entries (a container, not a tensor or scalar), as a native save of such an optimizer
    writes them. Shapes are not judged here: a per-parameter tensor of another shape cannot come from a native
    FSDP1 save (FSDP itself refuses it), and a mismatch with the live model is the restore's to refuse."""
    for key in metadata.state_dict_metadata:
        path = metadata.planner_data.get(key, ())
        if len(path) > 4 and path[0] == "optimizer" and path[1] == "state":
            return f"{where} holds nested optimizer state {key!r}; {_WHAT}"
    return None


@contextlib.contextmanager
def group_tuples_kept(optimizers: Iterable[Any]) -> Iterator[None]:
    """Around a full optimizer restore: give back the parameter-group tuples it turned into lists. FSDP2's
    ``FULL_STATE_DICT`` restore (torch's ``set_optimizer_state_dict`` with ``full_state_dict=True``, which Accelerate's
    ``load_fsdp_optimizer`` calls) flattens the state dict and rebuilds every tuple of a parameter group as a list:
    ``betas`` ``(0.9, 0.999)`` comes back ``[0.9, 0.999]``. The values are the saved ones either way; the saved file
    holds the tuple, and so does the optimizer after the restore."""
    raws = [raw_optimizer(optimizer) for optimizer in optimizers]
    keys = [[{key for key, value in group.items() if isinstance(value, tuple)} for group in raw.param_groups]
            for raw in raws]
    yield
    for raw, names in zip(raws, keys):
        for group, tuples in zip(raw.param_groups, names):
            for key in tuples:
                if isinstance(group.get(key), list):
                    group[key] = tuple(group[key])
