"""Elastic resume: restoring a checkpoint saved on N ranks into a run on M ranks (opt-in, ``allow_reshard``).

Model and optimizer state are resharded by DCP: each rank reads the boxes of the saved (original-shape)
tensors its new shard covers, FSDP1 and FSDP2 alike. Shared state (scheduler, scaler, sampler, custom objects,
the step counter) is restored unchanged. Per-rank state (Accelerate's RNG file, the per-rank data-loader state,
registered private per-rank state) follows one policy, :data:`POLICY`, recorded in the manifest of every save
and, after an elastic resume, in the next save's ``resharded_from``:

* a rank present in both runs (``r < min(N, M)``) keeps its own saved state exactly;
* a new rank (``r >= N``) takes the data-loader state and private progress of saved rank ``r % N``, and random
  generators *derived* from that rank's and its own index (``rng.derived_seed``), so it neither replays another
  rank's random stream nor depends on anything outside the checkpoint: the same resume gives the same streams;
* a saved rank that no longer exists (``r >= M``) is dropped, and the restore says so (one warning on rank 0);
* ``reshard_rank_map={new_rank: saved_rank}`` overrides the default for the ranks it names: they take that saved
  rank's state exactly, random generators included.

Without ``allow_reshard`` a world-size change is refused before anything is restored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointConfigurationError

#: Name of the per-rank state policy, recorded in every manifest (``rank_state.policy``).
POLICY = "keep-or-derive/1"


@dataclass(frozen=True)
class RankPlan:
    """Where each current rank's per-rank state comes from."""

    saved_world: int
    world: int
    sources: tuple[int, ...]  # current rank -> saved rank whose per-rank state it takes
    derived: frozenset[int]  # current ranks whose random generators are derived rather than copied

    @property
    def resharded(self) -> bool:
        return self.saved_world != self.world

    @property
    def dropped(self) -> list[int]:
        """Saved ranks whose per-rank state no current rank takes."""
        return sorted(set(range(self.saved_world)) - set(self.sources))

    def source(self, rank: int) -> int:
        return self.sources[rank]

    def record(self) -> dict[str, Any]:
        """JSON for a manifest's ``resharded_from``."""
        return {"policy": POLICY, "saved_world_size": self.saved_world, "world_size": self.world,
                "sources": list(self.sources), "derived": sorted(self.derived), "dropped": self.dropped}

    def describe(self) -> str:
        parts = [f"saved on {self.saved_world} ranks, restored on {self.world} ({POLICY})"]
        if self.derived:
            parts.append("new ranks " + ", ".join(f"{r} (from saved rank {self.sources[r]}, random generators derived)"
                                                  for r in sorted(self.derived)))
        copied = [r for r in range(self.world) if r not in self.derived and self.sources[r] != r]
        if copied:
            parts.append("mapped ranks " + ", ".join(f"{r} <- saved rank {self.sources[r]}" for r in copied))
        if self.dropped:
            parts.append(f"per-rank state (RNG, data-loader position, private state) of saved ranks {self.dropped} "
                         "is not restored")
        return "; ".join(parts)


def plan_ranks(saved_world: int, world: int, rank_map: Mapping[int, int] | None = None) -> RankPlan:
    """The per-rank state plan for restoring ``saved_world`` ranks' state on ``world`` ranks (``rank_map`` as
    validated by ``config.check_rank_map``; its ranges are checked here)."""
    rank_map = dict(rank_map or {})
    if saved_world < 1:
        raise CheckpointConfigurationError(f"The checkpoint records a world size of {saved_world}")
    bad = {new: old for new, old in rank_map.items() if not (0 <= new < world and 0 <= old < saved_world)}
    if bad:
        raise CheckpointConfigurationError(
            f"configure_checkpointing(reshard_rank_map=...) maps {bad}: keys must be ranks of this run "
            f"(0..{world - 1}) and values ranks of the checkpoint (0..{saved_world - 1})."
        )
    sources, derived = [], set()
    for rank in range(world):
        if rank in rank_map:
            sources.append(rank_map[rank])
        elif rank < saved_world:
            sources.append(rank)
        else:
            sources.append(rank % saved_world)
            derived.add(rank)
    return RankPlan(saved_world, world, tuple(sources), frozenset(derived))


