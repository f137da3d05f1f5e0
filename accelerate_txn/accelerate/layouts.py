"""How a descriptor's FSDP units read in refusals and listings: ``FULL_SHARD``, ``HYBRID_SHARD (2 replicas x 2
ranks)``, ``FSDP2 mesh dp_replicate=2 x dp_shard_cp=2``. Standard library only: the offline CLI imports it."""

from __future__ import annotations

from typing import Any


def mesh_text(unit: dict[str, Any]) -> str:
    """An FSDP2 unit's device mesh: its dimensions by name where recorded (N-D meshes), else its shape."""
    shape, names = unit.get("mesh"), unit.get("mesh_dims")
    if isinstance(shape, list) and isinstance(names, list) and len(names) == len(shape):
        return " x ".join(f"{name}={size}" for name, size in zip(names, shape))
    return str(shape)


def unit_text(unit: dict[str, Any]) -> str:
    """An FSDP1 unit's sharding strategy (a hybrid one with its grid), or an FSDP2 unit's version and mesh."""
    if unit.get("sharding") is not None:
        grid = unit.get("hybrid")
        if isinstance(grid, dict):
            return f"{unit['sharding']} ({grid.get('replicate')} replicas x {grid.get('shard')} ranks)"
        return str(unit["sharding"])
    return f"FSDP{unit.get('fsdp_version', '?')} mesh {mesh_text(unit)}"
