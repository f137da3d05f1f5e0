"""Protected saves written by fsdp.dcp_writer, inside launched ranks (real gloo, real Accelerate FSDP1/FSDP2):
the files load with native Accelerate (library switched off) and with the protected restore, exactly."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from accelerate_txn.fsdp import dcp_writer
from accelerate_txn.fsdp.dcp_reader import plain_tensor_span
from tests.scenarios import fsdp2_scenarios, scenarios


def _not_direct_readable(directory: Path) -> list[str]:
    """Every stored tensor of this rank's files is a plain archive the direct reader reads straight."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    rank = int(os.environ["RANK"])
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    bad = []
    for index, info in metadata.storage_data.items():
        if not info.relative_path.startswith(f"__{rank}_"):
            continue
        if not isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            continue
        fd = os.open(directory / info.relative_path, os.O_RDONLY)
        try:
            if plain_tensor_span(fd, info.offset, info.length) is None:
                bad.append(f"{directory.name}:{index.fqn}")
        finally:
            os.close(fd)
    return bad


def written_directly(root: str, fsdp_version: int) -> dict[str, Any]:
    from accelerate_txn.accelerate.native import native_method

    build = scenarios._build if fsdp_version == 1 else fsdp2_scenarios._build
    base = Path(root) / "checkpoint"
    obs: dict[str, Any] = {}
    acc, model, opt, sched = build(0)
    scenarios._train(acc, model, opt, sched, 3, seed=1)
    expected = scenarios._local_state(model, opt)
    counts = dcp_writer.DirectWriteCounts
    before = (counts.direct, counts.delegated, counts.files_direct_io + counts.files_buffered)
    acc.save_state(str(base))
    obs["direct_items"] = counts.direct - before[0]
    obs["delegated_items"] = counts.delegated - before[1]
    obs["files_written"] = counts.files_direct_io + counts.files_buffered - before[2]
    obs["not_direct_readable"] = [name for folder in sorted(base.iterdir()) if folder.is_dir()
                                  for name in _not_direct_readable(folder)]
    # Native Accelerate (this library switched off for the instance) restores the optimizer into one that has
    # already stepped (FSDP1 on Accelerate 1.13+; FSDP2 on every release).
    acc2, model2, opt2, sched2 = build(5)
    scenarios._train(acc2, model2, opt2, sched2, 1, seed=9)
    native_method(acc2, "load_state")(str(base))
    obs["native_differences"] = scenarios._same(expected, scenarios._local_state(model2, opt2))
    acc3, model3, opt3, _ = build(6)
    acc3.load_state(str(base))
    obs["protected_differences"] = scenarios._same(expected, scenarios._local_state(model3, opt3))
    return obs
