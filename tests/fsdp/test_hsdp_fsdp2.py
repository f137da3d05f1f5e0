"""FSDP2 on a 2-D mesh (HSDP: Accelerate's ``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)``), protected.

Real 4-rank gloo jobs on CPU (the harness builds the mesh: ``fsdp_accelerator(parallelism_config=...)``). Chain:
save A on 2 x 2; resume A on the same mesh (a damaged copy, one ``.distcp`` of the second replica's rank, is refused
first, before anything changes) and re-save S; resume A on a 1-D mesh of 4 (refused without ``allow_reshard``, naming
the mesh change; then resharded) and re-save B4; resume B4 (1-D) on 2 x 2, re-save B22; resume A on 2 ranks (1-D),
re-save B2. Each re-save is the restored live state, so its consolidated model and optimizer state must equal A's
exactly. ``dp_replicate_size=2, dp_shard_size=1`` (2 x 1) cannot be built: Accelerate refuses an FSDP2 mesh without
a shard dimension. Then a ``kill -9`` of a replica's rank in the middle of a save: the newest complete checkpoint
stays selected and restores exactly (tests/scenarios/hsdp_scenarios.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import accelerate_txn
from accelerate_txn.testing import LaunchError, launch
from tests.accelerate.test_elastic import _same_state

TIMEOUT = 300  # a hang guard per launch: each takes about 20 s on 2 idle cores (4 ranks)
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(8 * TIMEOUT + 60)]

HSDP = {"dp_replicate_size": 2, "dp_shard_size": 2}


def _damage(source: Path, target: Path) -> str:
    """A copy of ``source`` with one byte of the model's ``.distcp`` written by rank 3 (second replica) changed."""
    shutil.copytree(source, target)
    victim = target / "pytorch_model_fsdp_0" / "__3_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return "pytorch_model_fsdp_0/__3_0.distcp"


@pytest.fixture(scope="module")
def chain(tmp_path_factory: Any) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hsdp")
    paths = {name: root / name for name in ("A", "S", "B4", "B22", "B2", "D")}
    saved = launch("tests.scenarios.elastic_scenarios:save", 4, args=(2, str(paths["A"]), False, "adamw", False, HSDP),
                   timeout=TIMEOUT)
    victim = _damage(paths["A"], paths["D"])
    same = launch("tests.scenarios.elastic_scenarios:resume", 4,
                  args=(2, str(paths["A"]), str(paths["S"]), False, None, "adamw", HSDP, str(paths["D"])),
                  timeout=TIMEOUT)
    flat = launch("tests.scenarios.elastic_scenarios:resume", 4, args=(2, str(paths["A"]), str(paths["B4"]), True),
                  timeout=TIMEOUT)
    back = launch("tests.scenarios.elastic_scenarios:resume", 4,
                  args=(2, str(paths["B4"]), str(paths["B22"]), True, None, "adamw", HSDP), timeout=TIMEOUT)
    two = launch("tests.scenarios.elastic_scenarios:resume", 2, args=(2, str(paths["A"]), str(paths["B2"]), False),
                 timeout=TIMEOUT)
    return {"paths": paths, "saved": saved, "same": same, "flat": flat, "back": back, "two": two, "victim": victim}


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / accelerate_txn.MANIFEST).read_text())


def test_the_manifest_records_the_mesh_and_every_rank_hashed_its_own_files(chain: dict[str, Any]) -> None:
    manifest = _manifest(chain["paths"]["A"])
    (unit,) = manifest["components"][""]["models"][0]["fsdp"]
    assert unit == {"fsdp_version": 2, "mesh": [2, 2], "mesh_dims": ["dp_replicate", "dp_shard_cp"]}
    parameters = manifest["components"][""]["models"][0]["parameters"]
    assert {tuple(entry["placements"]) for entry in parameters.values()} == {("R", "S(0)")}
    payloads = sorted(name for name in manifest["files"] if name.endswith(".distcp"))
    assert payloads == [f"{folder}/__{rank}_0.distcp" for folder in ("optimizer_0", "pytorch_model_fsdp_0")
                        for rank in range(4)]
    assert sorted(name for name in manifest["files"] if name.startswith("random_states_")) == \
        [f"random_states_{rank}.pkl" for rank in range(4)]


def test_a_replicated_shard_is_written_once_and_every_tensor_is_covered_exactly(chain: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        directory = chain["paths"]["A"] / folder
        metadata = FileSystemReader(str(directory)).read_metadata()
        stored: dict[str, list[tuple[int, ...]]] = {}
        for index in metadata.storage_data:
            if index.offset is not None:  # a tensor chunk (a pickled value has none)
                stored.setdefault(index.fqn, []).append(tuple(index.offset))
        for fqn, entry in metadata.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                continue
            offsets = [tuple(chunk.offsets) for chunk in entry.chunks]
            assert len(set(offsets)) == len(offsets), f"{folder}/{fqn}: a chunk stored twice"
            covered = sum(chunk.sizes.numel() for chunk in entry.chunks)
            assert covered == entry.size.numel(), f"{folder}/{fqn}: chunks cover {covered} of {entry.size.numel()}"
            assert sorted(stored[fqn]) == sorted(offsets), f"{folder}/{fqn}: stored chunks differ from its chunks"
        # No payload byte outside what the metadata references: nothing written twice.
        referenced = sum(info.length for info in metadata.storage_data.values())
        assert referenced == sum(path.stat().st_size for path in directory.glob("*.distcp"))


def test_the_same_mesh_restores_exactly_and_a_damaged_replica_file_is_refused_first(chain: dict[str, Any]) -> None:
    saved = {entry["rank"]: entry for entry in chain["saved"]}
    for rank, entry in enumerate(chain["same"]):
        refusal = entry["damaged_refusal"]
        assert refusal is not None and refusal["type"] == "CheckpointIntegrityError", refusal
        assert chain["victim"] in refusal["message"]
        assert entry["untouched_after_damaged"], f"rank {rank}: the refused restore changed the model"
        assert entry["rng"].equal(saved[rank]["rng"]) and entry["noise"].equal(saved[rank]["noise"])
        assert entry["progress"] == saved[rank]["progress"] and entry["next_batch"] == saved[rank]["next_batch"]
        assert entry["step"] == saved[rank]["step"] and entry["lr"] == saved[rank]["lr"]
    assert _same_state(chain["paths"]["A"], chain["paths"]["S"]) == []


def test_a_mesh_change_is_refused_without_the_opt_in_naming_both_meshes(chain: dict[str, Any]) -> None:
    for entry in chain["flat"]:
        refusal = entry["refusal"]
        assert refusal["type"] == "CheckpointConfigurationError"
        assert "dp_replicate=2 x dp_shard_cp=2" in refusal["message"] and "[4]" in refusal["message"]
        assert "allow_reshard=True" in refusal["message"]
        assert entry["untouched"]
    for entry in chain["back"]:
        assert "[4]" in entry["refusal"]["message"] and "dp_replicate=2 x dp_shard_cp=2" in entry["refusal"]["message"]


@pytest.mark.parametrize("resharded", ["B4", "B22", "B2"])
def test_elastic_resume_across_mesh_shapes_is_exact(chain: dict[str, Any], resharded: str) -> None:
    assert _same_state(chain["paths"]["A"], chain["paths"][resharded]) == []


def test_a_world_size_change_across_meshes_is_recorded_in_the_next_manifest(chain: dict[str, Any]) -> None:
    record = _manifest(chain["paths"]["B2"])["resharded_from"][""]
    assert record["checkpoint"] == str(chain["paths"]["A"])
    assert (record["saved_world_size"], record["world_size"], record["dropped"]) == (4, 2, [2, 3])
    assert "resharded_from" not in _manifest(chain["paths"]["B4"])  # 4 ranks on both sides: no rank state moved


def test_per_rank_state_follows_the_policy_across_meshes(chain: dict[str, Any]) -> None:
    saved = {entry["rank"]: entry for entry in chain["saved"]}
    for entry in [*chain["flat"], *chain["two"]]:  # ranks present in both runs keep their own state
        rank = entry["rank"]
        assert entry["rng"].equal(saved[rank]["rng"]) and entry["progress"] == saved[rank]["progress"]
        assert entry["finite_after_step"]


def test_kill_9_of_a_replica_rank_mid_save_keeps_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "project"
    root.mkdir()
    with pytest.raises(LaunchError, match="died"):
        launch("tests.scenarios.hsdp_scenarios:save_twice", 4, args=(str(root),), timeout=TIMEOUT,
               env={"ACCELERATE_TXN_KILL_AT": "save:after-native-save@3#2"})
    published = sorted(path.name for path in (root / "checkpoints").iterdir() if not path.name.startswith("."))
    assert published == ["checkpoint_0"]
    results = launch("tests.scenarios.hsdp_scenarios:resume_newest", 4, args=(str(root),), timeout=TIMEOUT)
    for entry in results:
        assert entry["selected"] == "checkpoint_0", entry
        assert entry["differences"] == [], entry
