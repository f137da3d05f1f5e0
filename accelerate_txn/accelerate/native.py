"""Calling native Accelerate from inside the protected path.

* :func:`native_method` returns the *unpatched* ``Accelerator.save_state``/``load_state`` (so the protected
  path never re-enters its own wrapper).
* :func:`synchronized_hooks` makes each user save/load pre-hook a rank phase: a hook that raises on one rank
  raises the same error on every rank before the next collective, instead of leaving the others waiting.
* :func:`fsdp_routing` marks an Accelerator whose FSDP1 sharded model/optimizer loads must go through
  accelerate-txn's loaders (see ``accelerate.patch``: the wrapped ``load_fsdp_model``/``load_fsdp_optimizer`` read it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from weakref import WeakSet

from ..core.ranks import run_phase
from ..runtime.accelerate_internals import load_state_pre_hooks, save_state_pre_hooks

_ROUTED: WeakSet = WeakSet()  # Accelerators whose FSDP loads we route (protected load in progress)
OPTED_IN: WeakSet = WeakSet()  # patch_accelerate_fsdp(acc)
OPTED_OUT: WeakSet = WeakSet()  # unpatch_accelerate_fsdp(acc)


# Unwrapped Accelerate functions, filled by ``patch.install()``: name -> original function.
ORIGINALS: dict[str, Callable[..., Any]] = {}


def native_method(accelerator: Any, name: str) -> Callable[..., Any]:
    """The original (unwrapped) ``Accelerator.<name>``, bound to ``accelerator``."""
    function = ORIGINALS.get(f"Accelerator.{name}") or getattr(type(accelerator), name)
    return function.__get__(accelerator, type(accelerator))


def routed(accelerator: Any) -> bool:
    return accelerator in _ROUTED or (accelerator in OPTED_IN and accelerator not in OPTED_OUT)


@contextlib.contextmanager
def fsdp_routing(accelerator: Any) -> Iterator[None]:
    added = accelerator not in _ROUTED
    _ROUTED.add(accelerator)
    try:
        yield
    finally:
        if added:
            _ROUTED.discard(accelerator)


@contextlib.contextmanager
def synchronized_hooks(accelerator: Any) -> Iterator[None]:
    changes = []
    for hooks, kind in ((save_state_pre_hooks(accelerator), "save"), (load_state_pre_hooks(accelerator), "load")):
        for key, function in list(hooks.items()):
            def synchronized(*args: Any, _function: Callable[..., Any] = function, _kind: str = kind) -> Any:
                name = getattr(_function, "__qualname__", repr(_function))
                return run_phase(lambda: _function(*args), f"{_kind}_state pre-hook {name}")

            changes.append((hooks, key, function))
            hooks[key] = synchronized
    try:
        yield
    finally:
        for hooks, key, function in changes:
            if key in hooks:  # a hook may have removed itself meanwhile
                hooks[key] = function


@contextlib.contextmanager
def automatic_naming_off(accelerator: Any) -> Iterator[None]:
    """Native save/load with automatic naming would choose its own directory and prune by itself."""
    project = accelerator.project_configuration
    previous = project.automatic_checkpoint_naming
    project.automatic_checkpoint_naming = False
    try:
        yield
    finally:
        project.automatic_checkpoint_naming = previous
