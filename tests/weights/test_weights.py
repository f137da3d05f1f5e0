"""Model-weight I/O (accelerate_txn.weights): export, validation of every rejection path, atomic re-export, DCP export.

Real models throughout: a tiny ``diffusers.UNet2DModel`` built from a config and ``DuckModel``, a plain module that
only offers the same ``load_config`` / ``from_config`` / ``save_config`` / ``from_pretrained`` methods.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from diffusers import UNet2DModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from accelerate_txn.core.manifest import PROTOCOL, build_inventory, write_manifest
from accelerate_txn.errors import (
    CheckpointConfigurationError,
    CheckpointExistsError,
    CheckpointIntegrityError,
    CheckpointLockedError,
    NoCheckpointError,
)
from accelerate_txn.store import posix
from accelerate_txn.store.posix import POSIX, DirectoryLock, staging_leftovers
from accelerate_txn.weights import (
    checkpoint_fingerprint,
    copy_diffusers_checkpoint,
    export_dcp_to_diffusers,
    is_complete_diffusers_checkpoint,
    load_diffusers_checkpoint,
    load_model_checkpoint,
    read_diffusers_state_dict,
    safetensor_checkpoint_files,
    save_diffusers_state_dict,
)
from accelerate_txn.weights._dcp import _read_dcp_metadata
from accelerate_txn.weights._publish import _recover_interrupted_export

REPO = Path(__file__).resolve().parents[2]
SHARD_NAME = re.compile(r"diffusion_pytorch_model-(\d{5})-of-(\d{5})\.safetensors\Z")
INDEX = "diffusion_pytorch_model.safetensors.index.json"
UNET_CONFIG: dict[str, Any] = {
    "sample_size": 8,
    "in_channels": 3,
    "out_channels": 3,
    "layers_per_block": 1,
    "block_out_channels": (8, 16),
    "down_block_types": ("DownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "UpBlock2D"),
    "norm_num_groups": 4,
}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class DuckModel(torch.nn.Module):
    """Not a Diffusers class: only the ``load_config``/``from_config``/``save_config``/``from_pretrained`` API."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.config = {"width": width, "depth": depth}
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    @classmethod
    def load_config(cls, path: str | os.PathLike[str], subfolder: str | None = None, **_: Any) -> dict[str, Any]:
        return json.loads((Path(path) / (subfolder or "") / "config.json").read_text())

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DuckModel:
        return cls(width=config["width"], depth=config["depth"])

    def save_config(self, directory: str | os.PathLike[str]) -> None:
        Path(directory, "config.json").write_text(json.dumps(self.config))

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        subfolder: str | None = None,
        low_cpu_mem_usage: bool = True,
        torch_dtype: torch.dtype | None = None,
        output_loading_info: bool = False,
    ) -> Any:
        directory = Path(path) / (subfolder or "")
        model = cls.from_config(cls.load_config(directory))
        state: dict[str, torch.Tensor] = {}
        for file in sorted(directory.glob("*.safetensors")):
            state.update(load_file(file))
        result = model.load_state_dict(state, strict=False)
        if torch_dtype is not None:
            model.to(torch_dtype)
        info = {"missing_keys": result.missing_keys, "unexpected_keys": result.unexpected_keys, "mismatched_keys": []}
        return (model, info) if output_loading_info else model


class ForgetfulDuck(DuckModel):
    """A model class whose ``from_pretrained`` drops the last layer's weights (and says so in its loading info)."""

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], **kwargs: Any) -> Any:
        model, info = super().from_pretrained(path, **{**kwargs, "output_loading_info": True})
        info["missing_keys"] = ["layers.2.weight"]
        return (model, info) if kwargs.get("output_loading_info") else model


class ConfigOnly:
    """The smallest config source an export accepts: an object with ``save_config``."""

    def save_config(self, directory: str | os.PathLike[str]) -> None:
        Path(directory, "config.json").write_text("{}")


class RemovesFileWhenUnpickled:
    """A pickle payload that would delete ``victim`` if anything ever unpickled it as an object."""

    def __init__(self, victim: Path) -> None:
        self.victim = victim

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.remove, (str(self.victim),)


# --------------------------------------------------------------------------------------------- helpers


def seeded(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for value in model.state_dict().values():
            if value.is_floating_point():
                value.copy_(torch.randn(value.shape, generator=generator))
            else:
                value.fill_(seed)
    return model


def unet(seed: int = 0, **overrides: Any) -> UNet2DModel:
    return seeded(UNet2DModel(**{**UNET_CONFIG, **overrides}), seed)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key


def mixed_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every dtype class an export must treat differently, with sizes that force several shards."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "encoder.weight": torch.randn(8, 16, generator=generator),
        "encoder.bias": torch.randn(32, generator=generator).to(torch.bfloat16),
        "decoder.weight": torch.randn(16, 16, generator=generator).to(torch.float16),
        "decoder.step": torch.tensor(seed, dtype=torch.int64),
        "decoder.mask": torch.arange(24) % 3 == 0,
        "embedding.ids": torch.arange(40, dtype=torch.int32),
        "empty": torch.empty(0, 4),
    }


def export(state: dict[str, torch.Tensor], path: Path, **kwargs: Any) -> Path:
    kwargs.setdefault("max_shard_size", 600)
    return save_diffusers_state_dict({key: value.clone() for key, value in state.items()}, ConfigOnly(), path, **kwargs)


def shard_files(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir() if SHARD_NAME.fullmatch(entry.name))


def rewrite_index(directory: Path, change: Any) -> None:
    index = json.loads((directory / INDEX).read_text())
    change(index["weight_map"])
    (directory / INDEX).write_text(json.dumps(index))


@pytest.fixture
def exported(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = mixed_state()
    return export(state, tmp_path / "export"), state


# --------------------------------------------------------------------------------------------- export


def test_export_writes_bounded_shards_index_and_config_and_round_trips_exactly(tmp_path: Path) -> None:
    model = seeded(DuckModel(width=16, depth=4), 1)
    state = {**snapshot(model), **mixed_state()}
    given = {key: value.clone() for key, value in state.items()}
    out = save_diffusers_state_dict(given, model, tmp_path / "nested" / "export", max_shard_size=1500)

    assert given == {}, "the export consumes the state dict"
    shards = shard_files(out)
    assert len(shards) > 2 and {SHARD_NAME.fullmatch(name).group(2) for name in shards} == {f"{len(shards):05d}"}
    assert sorted(entry.name for entry in out.iterdir()) == sorted([*shards, INDEX, "config.json"])
    index = json.loads((out / INDEX).read_text())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(value.numel() * value.element_size() for value in state.values())
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as reader:
            assert sum(reader.get_tensor(key).nbytes for key in reader.keys()) <= 1500
    assert json.loads((out / "config.json").read_text()) == model.config
    assert_same(read_diffusers_state_dict(out), state)
    assert staging_leftovers(out.parent) == []


def test_export_casts_floating_tensors_only_when_dtype_is_given(tmp_path: Path) -> None:
    state = mixed_state()
    out = export(state, tmp_path / "half", dtype=torch.float16)
    cast = {key: value.to(torch.float16) if value.is_floating_point() else value for key, value in state.items()}
    assert_same(read_diffusers_state_dict(out), cast)
    total = json.loads((out / INDEX).read_text())["metadata"]["total_size"]
    assert total == sum(value.numel() * value.element_size() for value in cast.values())


def test_export_accepts_a_size_string_like_save_pretrained(tmp_path: Path) -> None:
    state = mixed_state()
    by_string = export(state, tmp_path / "string", max_shard_size="1KB")
    by_int = export(state, tmp_path / "int", max_shard_size=1000)
    assert json.loads((by_string / INDEX).read_text()) == json.loads((by_int / INDEX).read_text())
    assert len(shard_files(by_string)) == 2
    assert_same(read_diffusers_state_dict(by_string), state)


def test_export_rejects_an_empty_state_dict(tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigurationError, match=r"Cannot export an empty state dict to .*export"):
        save_diffusers_state_dict({}, ConfigOnly(), tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_export_rejects_a_tensor_larger_than_the_shard_limit_without_consuming_the_dict(tmp_path: Path) -> None:
    state = {"small": torch.zeros(4), "big.weight": torch.zeros(64)}
    with pytest.raises(
        CheckpointConfigurationError,
        match=r"1 tensor\(s\) exceed max_shard_size=100 bytes \(big\.weight \(256 bytes\)\).*at least 256",
    ):
        save_diffusers_state_dict(state, ConfigOnly(), tmp_path / "export", max_shard_size=100)
    assert list(state) == ["small", "big.weight"]
    assert not (tmp_path / "export").exists()


def test_shard_limit_counts_the_exported_dtype(tmp_path: Path) -> None:
    state = {"weight": torch.zeros(64)}  # 256 bytes as float32, 128 as bfloat16
    out = save_diffusers_state_dict(dict(state), ConfigOnly(), tmp_path / "e", max_shard_size=128, dtype=torch.bfloat16)
    assert read_diffusers_state_dict(out)["weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("state", "model", "kwargs", "message"),
    [
        ({"w": torch.zeros(2)}, ConfigOnly(), {"dtype": torch.int8}, r"dtype=torch\.int8 is not a floating"),
        ({"w": torch.zeros(2)}, ConfigOnly(), {"max_shard_size": 0}, r"max_shard_size=0 is not a positive size"),
        ({"w": torch.zeros(2)}, ConfigOnly(), {"max_shard_size": "lots"}, r"max_shard_size='lots' is not a positive"),
        ({"w": torch.zeros(2), "n": 3}, ConfigOnly(), {}, r"1 entr\(ies\) are not dense, materialised .*'n'"),
        ({"w": torch.empty(2, device="meta")}, ConfigOnly(), {}, r"not dense, materialised tensors .*'w'"),
        ({"w": torch.zeros(2)}, torch.nn.Linear(1, 1), {}, r"Linear has no save_config\(\)"),
    ],
    ids=["integer-dtype", "zero-shard-size", "bad-size-string", "non-tensor", "meta-tensor", "no-save-config"],
)
def test_export_rejects_bad_arguments_before_touching_anything(
    tmp_path: Path, state: dict[str, Any], model: Any, kwargs: dict[str, Any], message: str
) -> None:
    keys = list(state)
    with pytest.raises(CheckpointConfigurationError, match=message):
        save_diffusers_state_dict(state, model, tmp_path / "export", **kwargs)
    assert list(state) == keys
    assert not (tmp_path / "export").exists()


def test_export_writes_tied_weights(tmp_path: Path) -> None:
    shared = torch.arange(12, dtype=torch.float32)
    state = {"embed.weight": shared.view(3, 4), "head.weight": shared.view(3, 4), "bias": torch.ones(3)}
    out = export(state, tmp_path / "tied", max_shard_size=4096)
    assert len(shard_files(out)) == 1
    assert_same(read_diffusers_state_dict(out), {key: value.clone() for key, value in state.items()})


def test_reexport_replaces_the_previous_export_and_its_stale_shards(
    tmp_path: Path, exported: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    out, _old = exported
    assert len(shard_files(out)) > 2
    new = {"only.weight": torch.full((3,), 7.0)}
    assert export(new, out, max_shard_size=4096) == out.absolute()
    assert sorted(entry.name for entry in out.iterdir()) == sorted(
        ["diffusion_pytorch_model-00001-of-00001.safetensors", INDEX, "config.json"]
    )
    assert_same(read_diffusers_state_dict(out), new)
    hidden = [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(".export")]
    assert hidden == [], "no staging or set-aside copy is left behind"


def test_reexport_refuses_a_directory_holding_other_files(exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    out, old = exported
    (out / "notes.txt").write_text("mine")
    new = {"w": torch.ones(2)}
    message = r"Refusing to replace .*export: besides model weights it holds notes\.txt"
    with pytest.raises(CheckpointExistsError, match=message):
        save_diffusers_state_dict(new, ConfigOnly(), out)
    assert "w" in new
    assert (out / "notes.txt").read_text() == "mine"
    assert_same(read_diffusers_state_dict(out), old)


def test_export_refuses_to_replace_a_file(tmp_path: Path) -> None:
    (tmp_path / "export").write_text("not a directory")
    with pytest.raises(CheckpointExistsError, match=r"Refusing to export to .*export: it exists and is not a dir"):
        save_diffusers_state_dict({"w": torch.ones(2)}, ConfigOnly(), tmp_path / "export")
    assert (tmp_path / "export").read_text() == "not a directory"


def test_export_is_refused_while_another_writer_holds_the_directory_lock(tmp_path: Path) -> None:
    state = {"w": torch.ones(2)}
    with DirectoryLock(tmp_path), pytest.raises(CheckpointLockedError, match=r"Another writer holds the lock"):
        save_diffusers_state_dict(state, ConfigOnly(), tmp_path / "export")
    assert "w" in state and not (tmp_path / "export").exists()


KILLED_EXPORT = textwrap.dedent(
    """
    import signal
    import sys
    from pathlib import Path

    import torch

    from accelerate_txn.weights import save_diffusers_state_dict


    class ConfigOnly:
        def save_config(self, directory):
            Path(directory, "config.json").write_text("{}")


    class PausesAtTheThirdShard(dict):
        # The export pops each shard's tensors as it writes it: the first key of shard 3 is popped once shards 1
        # and 2 are complete on disk. There the export tells the test and waits to be killed: no clock decides
        # where the kill lands.
        def pop(self, key, *default):
            if key == "layer4.weight":
                print("two shards written", flush=True)
                while True:
                    signal.pause()
            return super().pop(key, *default)


    # 64 MiB in 4 MiB tensors and 8 MiB shards: two tensors a shard, eight shards.
    state = PausesAtTheThirdShard({f"layer{i}.weight": torch.full((1024, 1024), float(i)) for i in range(16)})
    save_diffusers_state_dict(state, ConfigOnly(), sys.argv[1], max_shard_size=8 * 1024**2)
    """
)


def test_killed_export_leaves_the_previous_export_intact(
    tmp_path: Path, exported: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    out, old = exported
    before = checkpoint_fingerprint(out)
    script = tmp_path / "export_big.py"
    script.write_text(KILLED_EXPORT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, str(script), str(out)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the synchronisation point (pytest-timeout bounds a hang)
        assert line == "two shards written\n", f"the export ended (rc={process.wait()}) before it could be killed"
        (staging,) = [path for path, _run in staging_leftovers(tmp_path)]
        assert len(shard_files(staging)) == 2, sorted(p.name for p in staging.iterdir())
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=120) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

    assert staging.exists(), "the kill happened mid-export: its staging directory is left behind"
    assert checkpoint_fingerprint(out) == before
    assert_same(read_diffusers_state_dict(out), old)

    # The next export cleans the dead writer's leftover and publishes normally.
    new = {"w": torch.full((2,), 3.0)}
    export(new, out)
    assert not staging.exists()
    assert_same(read_diffusers_state_dict(out), new)


def test_export_killed_between_the_fallback_renames_is_rolled_back_by_the_next_writer(
    tmp_path: Path, exported: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    # The state a kill leaves when RENAME_EXCHANGE is unavailable: the old export set aside, the final name
    # missing, and a complete staged export not yet renamed in.
    out, old = exported
    aside = tmp_path / ".export.replaced-0123abcd"
    os.rename(out, aside)
    staged = export({"w": torch.ones(2)}, tmp_path / "other")
    staging = tmp_path / ".export.staging-00ff-11ee"
    os.rename(staged, staging)
    with DirectoryLock(tmp_path):
        _recover_interrupted_export(out.absolute())
    assert_same(read_diffusers_state_dict(out), old)
    assert not aside.exists() and not staging.exists()


def test_reexport_without_rename_exchange_falls_back_to_two_renames(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, exported: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    # Simulates a filesystem or OS without renameat2(RENAME_EXCHANGE), the only way to reach the fallback here.
    monkeypatch.setattr(posix, "exchange", lambda _first, _second: False)
    out, _old = exported
    new = {"w": torch.full((4,), 2.0)}
    export(new, out)
    assert_same(read_diffusers_state_dict(out), new)
    assert [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(".export")] == []


def test_exchange_directories_swaps_two_directories_atomically(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "from_a").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "from_b").write_text("b")
    if not posix.exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported here; exports use the two-rename fallback")
    assert [entry.name for entry in (tmp_path / "a").iterdir()] == ["from_b"]
    assert [entry.name for entry in (tmp_path / "b").iterdir()] == ["from_a"]


# --------------------------------------------------------------------------------------------- validated reading


def test_read_rejects_an_index_naming_a_missing_shard(exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    out, _ = exported
    victim = shard_files(out)[1]
    (out / victim).unlink()
    message = rf"names 1 shard\(s\) that do not exist \({victim}\).*incomplete"
    with pytest.raises(CheckpointIntegrityError, match=message):
        read_diffusers_state_dict(out)


def test_read_rejects_a_stored_tensor_the_index_does_not_list(exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    out, _ = exported
    rewrite_index(out, lambda weight_map: weight_map.pop("decoder.mask"))
    message = r"not where the index .* says: decoder\.mask \(in .*index says nothing"
    with pytest.raises(CheckpointIntegrityError, match=message):
        read_diffusers_state_dict(out)


def test_read_rejects_an_index_entry_no_shard_holds(exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    out, _ = exported
    rewrite_index(out, lambda weight_map: weight_map.update(ghost=shard_files(out)[0]))
    with pytest.raises(CheckpointIntegrityError, match=r"the index lists 1 tensor\(s\) that no shard holds: ghost"):
        read_diffusers_state_dict(out)


def test_read_rejects_a_tensor_stored_in_two_shards(exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    out, state = exported
    last = out / shard_files(out)[-1]
    save_file({**load_file(last), "encoder.weight": state["encoder.weight"]}, last)
    with pytest.raises(CheckpointIntegrityError, match=r"1 tensor\(s\) stored twice: encoder\.weight \(in .* and "):
        read_diffusers_state_dict(out)


def test_read_rejects_an_index_pointing_outside_its_directory(exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    out, _ = exported
    rewrite_index(out, lambda weight_map: weight_map.update({"encoder.weight": "../elsewhere.safetensors"}))
    with pytest.raises(CheckpointIntegrityError, match=r"maps tensors to files outside its directory .*elsewhere"):
        read_diffusers_state_dict(out)


def test_read_rejects_a_malformed_index(exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    out, _ = exported
    (out / INDEX).write_text("{not json")
    with pytest.raises(CheckpointIntegrityError, match=r"unreadable or has no 'weight_map'"):
        read_diffusers_state_dict(out)


def test_read_rejects_a_truncated_shard(exported: tuple[Path, dict[str, torch.Tensor]]) -> None:
    out, _ = exported
    shard = out / shard_files(out)[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointIntegrityError, match=rf"{shard.name} is not a readable safetensors file .*truncated"):
        read_diffusers_state_dict(out)


def test_read_reports_missing_paths_and_directories_without_weights(tmp_path: Path) -> None:
    with pytest.raises(NoCheckpointError, match=r"No checkpoint at .*nowhere: the path does not exist"):
        read_diffusers_state_dict(tmp_path / "nowhere")
    with pytest.raises(NoCheckpointError, match=r"No model weights in .*: expected diffusion_pytorch_model"):
        read_diffusers_state_dict(tmp_path)


# --------------------------------------------------------------------------------------------- load_model_checkpoint


def duck_export(path: Path, seed: int = 1, **config: int) -> tuple[Path, dict[str, torch.Tensor]]:
    model = seeded(DuckModel(**config), seed)
    state = snapshot(model)
    return save_diffusers_state_dict(snapshot(model), model, path, max_shard_size=300), state


def test_load_model_checkpoint_loads_every_shard_exactly(tmp_path: Path) -> None:
    out, state = duck_export(tmp_path / "export")
    assert len(shard_files(out)) > 1
    model = seeded(DuckModel(), 2)
    assert load_model_checkpoint(model, out) == ([], [])
    assert_same(snapshot(model), state)


def test_load_model_checkpoint_rejects_a_partial_checkpoint_and_leaves_the_model_untouched(tmp_path: Path) -> None:
    _out, state = duck_export(tmp_path / "full")
    partial = {key: value for key, value in state.items() if not key.startswith("layers.2.")}
    out = save_diffusers_state_dict(partial, DuckModel(), tmp_path / "partial")
    model = seeded(DuckModel(), 2)
    before = snapshot(model)
    with pytest.raises(
        CheckpointIntegrityError,
        match=r"missing 2 of 7 model tensor\(s\): layers\.2\.bias, layers\.2\.weight\. The checkpoint is partial",
    ):
        load_model_checkpoint(model, out)
    assert_same(snapshot(model), before)


def test_load_model_checkpoint_rejects_a_lora_file_and_leaves_the_model_untouched(tmp_path: Path) -> None:
    lora = {
        f"layers.{i}.{name}.weight": torch.zeros(2, 8) for i in range(3) for name in ("lora_A", "lora_B")
    }
    save_file(lora, tmp_path / "pytorch_lora_weights.safetensors")
    model = seeded(DuckModel(), 2)
    before = snapshot(model)
    with pytest.raises(
        CheckpointIntegrityError,
        match=r"missing 7 of 7 .*6 unexpected tensor\(s\): layers\.0\.lora_A\.weight.*adapter \(LoRA\) file",
    ):
        load_model_checkpoint(model, tmp_path / "pytorch_lora_weights.safetensors")
    assert_same(snapshot(model), before)


def test_load_model_checkpoint_rejects_shape_mismatches(tmp_path: Path) -> None:
    out, _ = duck_export(tmp_path / "wide", width=8)
    model = DuckModel(width=4)
    before = snapshot(model)
    with pytest.raises(
        CheckpointIntegrityError, match=r"6 shape mismatch\(es\): layers\.0\.bias: checkpoint \[8\] vs model \[4\]"
    ):
        load_model_checkpoint(model, out)
    assert_same(snapshot(model), before)


def test_load_model_checkpoint_reads_bin_files_with_weights_only(tmp_path: Path) -> None:
    state = snapshot(seeded(DuckModel(), 3))
    torch.save({"state_dict": state}, tmp_path / "weights.bin")
    model = DuckModel()
    assert load_model_checkpoint(model, tmp_path / "weights.bin") == ([], [])
    assert_same(snapshot(model), state)


def test_bin_file_holding_code_is_refused_without_running_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("still here")
    evil = {"state_dict": {"w": torch.zeros(2)}, "payload": RemovesFileWhenUnpickled(victim)}
    torch.save(evil, tmp_path / "evil.bin")
    message = r"evil\.bin holds objects other than tensors.*weights_only=True"
    with pytest.raises(CheckpointIntegrityError, match=message):
        load_model_checkpoint(DuckModel(), tmp_path / "evil.bin")
    assert victim.read_text() == "still here"


def test_bin_file_that_is_not_a_flat_state_dict_is_refused(tmp_path: Path) -> None:
    torch.save({"model": {"w": torch.zeros(2)}, "epoch": 3}, tmp_path / "training.pt")
    message = r"training\.pt is not a flat state dict: 'epoch', 'model' are not name -> tensor entries.*state_dict_key"
    with pytest.raises(CheckpointIntegrityError, match=message):
        load_model_checkpoint(DuckModel(), tmp_path / "training.pt")


# --------------------------------------------------------------------------------------------- copy into a model


def test_copy_strips_the_prefix_and_copies_in_place(tmp_path: Path) -> None:
    state = snapshot(seeded(DuckModel(), 4))
    save_file({f"transformer.{key}": value for key, value in state.items()}, tmp_path / "model.safetensors")
    model = DuckModel()
    parameter = model.layers[0].weight
    copy_diffusers_checkpoint(model, tmp_path, None, strip_prefix="transformer.")
    assert model.layers[0].weight is parameter
    assert_same(snapshot(model), state)


def test_copy_rounds_floating_tensors_through_weight_dtype(tmp_path: Path) -> None:
    state = snapshot(seeded(DuckModel(), 4))
    save_file(state, tmp_path / "model.safetensors")
    model = DuckModel()
    copy_diffusers_checkpoint(model, tmp_path / "model.safetensors", torch.bfloat16)
    rounded = {k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v for k, v in state.items()}
    assert_same(snapshot(model), rounded)


def test_copy_rejects_unexpected_tensors_before_copying_any(tmp_path: Path) -> None:
    state = snapshot(seeded(DuckModel(), 4))
    save_file({**state, "extra.weight": torch.zeros(1)}, tmp_path / "model.safetensors")
    model = seeded(DuckModel(), 5)
    before = snapshot(model)
    message = r"does not match the model: 1 unexpected tensor\(s\): extra\.weight"
    with pytest.raises(CheckpointIntegrityError, match=message):
        copy_diffusers_checkpoint(model, tmp_path, None)
    assert_same(snapshot(model), before)


def test_copy_reads_a_nested_bin_state_dict(tmp_path: Path) -> None:
    state = snapshot(seeded(DuckModel(), 6))
    torch.save({"state_dict": {"ema": state, "step": torch.tensor(3)}}, tmp_path / "ema.pt")
    model = DuckModel()
    copy_diffusers_checkpoint(model, tmp_path / "ema.pt", None, state_dict_key="ema")
    assert_same(snapshot(model), state)


# --------------------------------------------------------------------------------------------- file discovery


def test_safetensor_checkpoint_files_follows_the_index_then_the_standard_names(
    tmp_path: Path, exported: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    out, _ = exported
    assert safetensor_checkpoint_files(out) == [str(out / name) for name in shard_files(out)]
    single = tmp_path / "single"
    single.mkdir()
    save_file({"w": torch.zeros(1)}, single / "diffusion_pytorch_model.safetensors")
    save_file({"w": torch.zeros(1)}, single / "other.safetensors")
    assert safetensor_checkpoint_files(single) == [str(single / "diffusion_pytorch_model.safetensors")]
    (single / "diffusion_pytorch_model.safetensors").unlink()
    save_file({"w": torch.zeros(1)}, single / "a.safetensors")
    assert safetensor_checkpoint_files(single) == [str(single / "a.safetensors"), str(single / "other.safetensors")]
    torch.save({"w": torch.zeros(1)}, tmp_path / "weights.bin")
    assert safetensor_checkpoint_files(tmp_path / "weights.bin") is None
    assert safetensor_checkpoint_files(single / "a.safetensors") == [str(single / "a.safetensors")]
    bins = tmp_path / "bins"
    bins.mkdir()
    torch.save({"w": torch.zeros(1)}, bins / "diffusion_pytorch_model.bin")
    assert safetensor_checkpoint_files(bins) is None
    with pytest.raises(NoCheckpointError, match=r"No checkpoint at .*missing"):
        safetensor_checkpoint_files(tmp_path / "missing")


# --------------------------------------------------------------------------------------------- Diffusers models


@pytest.fixture(scope="module")
def unet_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A base model saved with ``save_pretrained`` and a fine-tuned export of the same architecture."""
    root = tmp_path_factory.mktemp("unet")
    base = unet(seed=0)
    base.save_pretrained(root / "base")
    tuned = unet(seed=1)
    state = snapshot(tuned)
    save_diffusers_state_dict(snapshot(tuned), tuned, root / "tuned", max_shard_size=40_000)
    return root / "base", root / "tuned", state


def test_load_diffusers_checkpoint_loads_an_export_directory(unet_export: tuple[Path, Path, dict]) -> None:
    base, tuned, state = unet_export
    assert len(shard_files(tuned)) > 1
    model = load_diffusers_checkpoint(UNet2DModel, base, tuned, torch.float32)
    assert isinstance(model, UNet2DModel)
    assert_same(snapshot(model), state)
    half = load_diffusers_checkpoint(UNet2DModel, base, tuned, torch.bfloat16)
    assert_same(snapshot(half), {key: value.to(torch.bfloat16) for key, value in state.items()})


def test_load_diffusers_checkpoint_loads_a_single_file_over_the_base_model(
    tmp_path: Path, unet_export: tuple[Path, Path, dict]
) -> None:
    base, _tuned, state = unet_export
    save_file(state, tmp_path / "tuned.safetensors")
    model = load_diffusers_checkpoint(UNet2DModel, base, tmp_path / "tuned.safetensors", torch.float32)
    assert_same(snapshot(model), state)


def test_load_diffusers_checkpoint_rejects_lora_partial_and_missing_checkpoints(
    tmp_path: Path, unet_export: tuple[Path, Path, dict]
) -> None:
    base, tuned, state = unet_export
    lora = {key.replace(".weight", ".lora_A.weight"): value for key, value in state.items() if "conv1" in key}
    save_file(lora, tmp_path / "lora.safetensors")
    with pytest.raises(CheckpointIntegrityError, match=r"missing \d+ of \d+ model tensor.*adapter \(LoRA\) file"):
        load_diffusers_checkpoint(UNet2DModel, base, tmp_path / "lora.safetensors", torch.float32)

    partial = tmp_path / "partial"
    shutil.copytree(tuned, partial)
    shard = shard_files(partial)[-1]
    (partial / shard).unlink()
    rewrite_index(partial, lambda weight_map: [weight_map.pop(k) for k, v in list(weight_map.items()) if v == shard])
    message = r"missing \d+ of 114 model tensor\(s\).*The checkpoint is partial"
    with pytest.raises(CheckpointIntegrityError, match=message):
        load_diffusers_checkpoint(UNet2DModel, base, partial, torch.float32)

    (partial / "config.json").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"partial has no config\.json: it is not a complete Diffusers"):
        load_diffusers_checkpoint(UNet2DModel, base, partial, torch.float32)
    with pytest.raises(CheckpointConfigurationError, match=r"A full model checkpoint is required"):
        load_diffusers_checkpoint(UNet2DModel, base, None, torch.float32)


def test_load_diffusers_checkpoint_rejects_an_incomplete_from_pretrained(tmp_path: Path) -> None:
    out, _state = duck_export(tmp_path / "duck")
    with pytest.raises(CheckpointIntegrityError, match=r"ForgetfulDuck\.from_pretrained\(.*duck\) did not load every"):
        load_diffusers_checkpoint(ForgetfulDuck, out, out, torch.float32)


def test_is_complete_diffusers_checkpoint(tmp_path: Path, unet_export: tuple[Path, Path, dict]) -> None:
    base, tuned, _state = unet_export
    config = UNet2DModel.load_config(base)
    assert is_complete_diffusers_checkpoint(UNet2DModel, tuned, config)

    other = dict(config, block_out_channels=(8, 8))
    assert not is_complete_diffusers_checkpoint(UNet2DModel, tuned, other)

    broken = tmp_path / "broken"
    shutil.copytree(tuned, broken)
    (broken / shard_files(broken)[0]).unlink()
    assert not is_complete_diffusers_checkpoint(UNet2DModel, broken, config)

    no_config = tmp_path / "no_config"
    shutil.copytree(tuned, no_config)
    (no_config / "config.json").unlink()
    assert not is_complete_diffusers_checkpoint(UNet2DModel, no_config, config)


def test_duck_typed_model_class_works_like_a_diffusers_model(tmp_path: Path) -> None:
    out, state = duck_export(tmp_path / "duck", width=6)
    model = load_diffusers_checkpoint(DuckModel, out, out, torch.float32)
    assert_same(snapshot(model), state)
    assert is_complete_diffusers_checkpoint(DuckModel, out, {"width": 6, "depth": 3})
    assert not is_complete_diffusers_checkpoint(DuckModel, out, {"width": 6, "depth": 2})
    save_file(state, tmp_path / "duck.safetensors")
    from_file = load_diffusers_checkpoint(DuckModel, out, tmp_path / "duck.safetensors", torch.float32)
    assert_same(snapshot(from_file), state)


# --------------------------------------------------------------------------------------------- fingerprint


def test_fingerprint_is_content_identity_independent_of_location(
    tmp_path: Path, exported: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    out, _ = exported
    fingerprint = checkpoint_fingerprint(out)
    assert [entry["name"] for entry in fingerprint] == sorted(["config.json", INDEX, *shard_files(out)])
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(out, moved)
    assert checkpoint_fingerprint(moved) == fingerprint

    shard = moved / shard_files(moved)[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same names, same sizes, one payload byte changed
    shard.write_bytes(bytes(data))
    changed = checkpoint_fingerprint(moved)
    assert [(e["name"], e["size"]) for e in changed] == [(e["name"], e["size"]) for e in fingerprint]
    assert [e["name"] for e, f in zip(changed, fingerprint, strict=True) if e["sha256"] != f["sha256"]] == [shard.name]

    single = checkpoint_fingerprint(out / shard_files(out)[0])
    assert [entry["name"] for entry in single] == ["weights"]
    with pytest.raises(NoCheckpointError, match=r"No model weights in"):
        checkpoint_fingerprint(tmp_path / "elsewhere")


_CHANGED_WHEN_OPENED: set[str] = set()  # paths whose modification time the audit hook below moves on each open


def _change_when_opened(event: str, args: tuple[Any, ...]) -> None:
    """Audit hook: an ``open`` of a path in ``_CHANGED_WHEN_OPENED`` moves its modification time first, so a reader
    that opens a file after taking its identity sees it change, whatever the machine's speed."""
    if event != "open" or not _CHANGED_WHEN_OPENED or not args:
        return
    try:
        name = os.fsdecode(os.fspath(args[0]))
        if name in _CHANGED_WHEN_OPENED:
            now = os.stat(name)
            os.utime(name, ns=(now.st_atime_ns, now.st_mtime_ns + 1))
    except Exception:  # an audit hook must never break the opener
        pass


_AUDIT_HOOK: list[bool] = []  # audit hooks cannot be removed: installed once per process


@pytest.fixture
def touching(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB weight file that changes while it is read: each open of it moves its modification time (an audit
    hook: deterministic), and another thread keeps changing it until the test ends (whatever order of stat and
    open the reader uses)."""
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(16 * 1024**2)}, path)
    if not _AUDIT_HOOK:
        sys.addaudithook(_change_when_opened)
        _AUDIT_HOOK.append(True)
    started, stop = threading.Event(), threading.Event()

    def touch() -> None:
        tick = 0
        while not stop.is_set():
            tick += 1
            os.utime(path, ns=(tick, tick))
            started.set()

    thread = threading.Thread(target=touch, daemon=True)
    thread.start()
    assert started.wait(120)  # a hang guard only: the thread sets it on its first pass
    _CHANGED_WHEN_OPENED.add(str(path))
    try:
        yield path
    finally:
        _CHANGED_WHEN_OPENED.discard(str(path))
        stop.set()
        thread.join()


def test_fingerprint_rejects_a_file_changing_while_it_is_hashed(touching: Path) -> None:
    with pytest.raises(CheckpointIntegrityError, match=r"weights\.safetensors changed while it was being hashed"):
        checkpoint_fingerprint(touching)


# --------------------------------------------------------------------------------------------- DCP export


def dcp_save(state: dict[str, Any], directory: Path) -> None:
    """The layout Accelerate's FSDP SHARDED_STATE_DICT save writes: ``{"model": state}`` in a DCP directory."""
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)


def test_export_dcp_round_trips_exactly_with_the_model_validating_it(tmp_path: Path) -> None:
    tuned = unet(seed=3)
    state = snapshot(tuned)
    dcp_save(snapshot(tuned), tmp_path / "checkpoint_7" / "pytorch_model_fsdp_0")
    with torch.device("meta"):
        skeleton = UNet2DModel(**UNET_CONFIG)
    out = export_dcp_to_diffusers(tmp_path / "checkpoint_7", skeleton, tmp_path / "export", max_shard_size=40_000)
    assert len(shard_files(out)) > 1
    assert_same(read_diffusers_state_dict(out), state)
    assert_same(snapshot(load_diffusers_checkpoint(UNet2DModel, out, out, torch.float32)), state)


def test_export_dcp_with_a_config_path_and_dtype(tmp_path: Path) -> None:
    state = mixed_state()
    dcp_save({key: value.clone() for key, value in state.items()}, tmp_path / "dcp")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text('{"width": 3}')
    out = export_dcp_to_diffusers(tmp_path / "dcp", tmp_path / "config", tmp_path / "export", 512, dtype=torch.bfloat16)
    cast = {key: value.to(torch.bfloat16) if value.is_floating_point() else value for key, value in state.items()}
    assert_same(read_diffusers_state_dict(out), cast)
    assert json.loads((out / "config.json").read_text()) == {"width": 3}


def test_export_dcp_rejects_a_model_mismatch_before_writing(tmp_path: Path) -> None:
    dcp_save(snapshot(DuckModel(width=8)), tmp_path / "dcp")
    with pytest.raises(CheckpointIntegrityError, match=r"does not match the model: 6 shape mismatch\(es\)"):
        export_dcp_to_diffusers(tmp_path / "dcp", DuckModel(width=4), tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_export_dcp_rejects_missing_data_and_non_tensor_entries(tmp_path: Path) -> None:
    dcp_save({"w": torch.ones(3)}, tmp_path / "dcp")
    (tmp_path / "dcp" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"Missing DCP payload .*__0_0\.distcp \(named by .*metadata\)"):
        export_dcp_to_diffusers(tmp_path / "dcp", ConfigOnly(), tmp_path / "export")

    dcp_save({"w": torch.ones(3), "v": torch.zeros(2)}, tmp_path / "unrecorded")
    metadata = _read_dcp_metadata(tmp_path / "unrecorded")
    metadata.storage_data = {index: info for index, info in metadata.storage_data.items() if index.fqn != "model.v"}
    (tmp_path / "unrecorded" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointIntegrityError, match=r"incomplete or corrupt: model\.v: chunk at \[0\] has no"):
        export_dcp_to_diffusers(tmp_path / "unrecorded", ConfigOnly(), tmp_path / "export")

    dcp_save({"w": torch.ones(3), "note": "text"}, tmp_path / "bytes")
    with pytest.raises(CheckpointIntegrityError, match=r"1 non-tensor model entr\(ies\) \(model\.note\)"):
        export_dcp_to_diffusers(tmp_path / "bytes", ConfigOnly(), tmp_path / "export")
    with pytest.raises(CheckpointIntegrityError, match=r"no entries under the prefix 'ema\.' \(it has: model\.note"):
        export_dcp_to_diffusers(tmp_path / "bytes", ConfigOnly(), tmp_path / "export", prefix="ema.")
    with pytest.raises(NoCheckpointError, match=r"No torch\.distributed\.checkpoint model state in"):
        export_dcp_to_diffusers(tmp_path, ConfigOnly(), tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_export_dcp_verifies_a_protected_checkpoint_against_its_manifest(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint_7"
    state = {"w": torch.arange(6.0), "b": torch.ones(2)}
    dcp_save({key: value.clone() for key, value in state.items()}, checkpoint / "pytorch_model_fsdp_0")
    manifest = {
        "protocol": PROTOCOL,
        "status": "complete",
        "run_id": "0a",
        "transaction_id": "0b",
        "files": build_inventory(checkpoint, "metadata"),
    }
    write_manifest(checkpoint, manifest, store=POSIX)
    out = export_dcp_to_diffusers(checkpoint, ConfigOnly(), tmp_path / "export")
    assert_same(read_diffusers_state_dict(out), state)

    with (checkpoint / "pytorch_model_fsdp_0" / "__0_0.distcp").open("ab") as payload:
        payload.write(b"\0")  # still a readable DCP checkpoint, but not the one that was published
    with pytest.raises(CheckpointIntegrityError, match=r"__0_0\.distcp has \d+ bytes; the manifest recorded \d+"):
        export_dcp_to_diffusers(checkpoint, ConfigOnly(), tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_dcp_metadata_holding_code_is_refused_without_running_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("still here")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(RemovesFileWhenUnpickled(victim)))
    with pytest.raises(CheckpointIntegrityError, match=r"Unreadable DCP metadata .*posix\.remove is not allowed"):
        _read_dcp_metadata(tmp_path / "dcp")
    assert victim.read_text() == "still here"


TWO_RANK_SAVE = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor


    def full_state():
        generator = torch.Generator().manual_seed(0)
        return {
            "proj.weight": torch.randn(5, 3, generator=generator),
            "proj.bias": torch.randn(5, generator=generator).to(torch.bfloat16),
            "positions": torch.arange(7, dtype=torch.int64),
        }


    def worker(rank, directory):
        dist.init_process_group("gloo", init_method=f"file://{directory}.store", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        state = {key: distribute_tensor(value, mesh, [Shard(0)]) for key, value in full_state().items()}
        dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(directory))
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.start_processes(worker, args=(sys.argv[1],), nprocs=2, start_method="spawn")
        torch.save(full_state(), sys.argv[2])
    """
)


@pytest.mark.distributed
@pytest.mark.timeout(360)  # above the hang guard of its two-rank script
def test_export_dcp_reassembles_chunks_written_by_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "two_rank_save.py"
    script.write_text(TWO_RANK_SAVE)
    subprocess.run(
        [sys.executable, str(script), str(tmp_path / "dcp"), str(tmp_path / "expected.pt")], check=True, timeout=300
    )
    metadata = _read_dcp_metadata(tmp_path / "dcp")
    assert len(metadata.state_dict_metadata["model.proj.weight"].chunks) == 2
    out = export_dcp_to_diffusers(tmp_path / "dcp", ConfigOnly(), tmp_path / "export", max_shard_size=64)
    assert_same(read_diffusers_state_dict(out), torch.load(tmp_path / "expected.pt", weights_only=True))


# --------------------------------------------------------------------------------------------- review regressions


def test_state_dict_key_selects_a_sibling_of_state_dict_not_the_raw_weights(tmp_path: Path) -> None:
    raw, ema = snapshot(seeded(DuckModel(), 1)), snapshot(seeded(DuckModel(), 2))
    torch.save({"state_dict": raw, "ema": ema}, tmp_path / "ck.pt")
    model = DuckModel()
    copy_diffusers_checkpoint(model, tmp_path / "ck.pt", None, state_dict_key="ema")
    assert_same(snapshot(model), ema)


def test_state_dict_key_that_does_not_exist_is_refused_listing_the_keys(tmp_path: Path) -> None:
    raw = snapshot(seeded(DuckModel(), 1))
    torch.save({"state_dict": raw, "ema": raw}, tmp_path / "ck.pt")
    model = seeded(DuckModel(), 3)
    before = snapshot(model)
    message = r"ck\.pt has no state dict under 'emma'.*top level: 'ema', 'state_dict'; under 'state_dict': 'layers\.0\.bias'"
    with pytest.raises(CheckpointIntegrityError, match=message):
        copy_diffusers_checkpoint(model, tmp_path / "ck.pt", None, state_dict_key="emma")
    assert_same(snapshot(model), before)


def test_discovery_fingerprints_the_bin_weights_the_loader_reads_despite_a_stray_safetensors(tmp_path: Path) -> None:
    state = snapshot(seeded(DuckModel(), 1))
    DuckModel().save_config(tmp_path)
    torch.save(state, tmp_path / "diffusion_pytorch_model.bin")
    save_file({"x": torch.zeros(1)}, tmp_path / "notes.safetensors")
    fingerprint = checkpoint_fingerprint(tmp_path)
    assert [entry["name"] for entry in fingerprint] == ["config.json", "diffusion_pytorch_model.bin"]
    torch.save({key: value + 1 for key, value in state.items()}, tmp_path / "diffusion_pytorch_model.bin")
    assert checkpoint_fingerprint(tmp_path) != fingerprint


def test_discovery_is_complete_is_false_for_a_directory_the_loader_refuses(tmp_path: Path) -> None:
    model = seeded(DuckModel(), 1)
    model.save_config(tmp_path)
    save_file(snapshot(model), tmp_path / "model.safetensors")
    with pytest.raises(NoCheckpointError, match=r"No model weights in"):
        load_diffusers_checkpoint(DuckModel, tmp_path, tmp_path, torch.float32)
    assert not is_complete_diffusers_checkpoint(DuckModel, tmp_path, model.config)


def test_is_complete_returns_false_for_a_corrupt_config(tmp_path: Path, unet_export: tuple[Path, Path, dict]) -> None:
    out, _ = duck_export(tmp_path / "duck")
    (out / "config.json").write_text('{"width": 8, "dep')
    assert not is_complete_diffusers_checkpoint(DuckModel, out, {"width": 8, "depth": 3})
    (out / "config.json").write_text('{"width": 8}')
    assert not is_complete_diffusers_checkpoint(DuckModel, out, {"width": 8, "depth": 3})
    base, tuned, _state = unet_export
    broken = tmp_path / "unet"
    shutil.copytree(tuned, broken)
    (broken / "config.json").write_text('{"_class_name": "UNet2DModel", "sample')
    assert not is_complete_diffusers_checkpoint(UNet2DModel, broken, UNet2DModel.load_config(base))


def test_load_diffusers_checkpoint_refuses_a_directory_whose_config_differs_from_the_base(
    tmp_path: Path, unet_export: tuple[Path, Path, dict]
) -> None:
    base, _tuned, _state = unet_export
    other = unet(1, norm_eps=0.5, act_fn="relu")  # same keys and shapes, different behaviour
    save_diffusers_state_dict(snapshot(other), other, tmp_path / "other")
    message = r"config\.json differs from the base model's .*: act_fn, norm_eps"
    with pytest.raises(CheckpointConfigurationError, match=message):
        load_diffusers_checkpoint(UNet2DModel, base, tmp_path / "other", torch.float32)


class Wrapped(torch.Tensor):
    """A tensor subclass standing in for any wrapper (DTensor, FSDP flat parameters) an export cannot write."""


def test_export_refuses_a_tensor_subclass_and_leaves_the_dict_untouched(tmp_path: Path) -> None:
    state = {"a": torch.ones(4), "b": torch.ones(4, 4).as_subclass(Wrapped), "c": torch.ones(2)}
    with pytest.raises(CheckpointConfigurationError, match=r"'b' \(Wrapped\).*gather a full state dict first"):
        save_diffusers_state_dict(state, ConfigOnly(), tmp_path / "out", max_shard_size=70)
    assert list(state) == ["a", "b", "c"]
    assert not (tmp_path / "out").exists()


DTENSOR_EXPORT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from accelerate_txn.errors import CheckpointConfigurationError
    from accelerate_txn.weights import save_diffusers_state_dict

    class ConfigOnly:
        def save_config(self, directory):
            Path(directory, "config.json").write_text("{}")

    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        state = {"a": torch.ones(4), "b": distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]), "c": torch.ones(2)}
        try:
            save_diffusers_state_dict(state, ConfigOnly(), sys.argv[1], max_shard_size=70)
        except CheckpointConfigurationError as exc:
            print("REFUSED", exc)
        print("LEFT", sorted(state), os.path.exists(sys.argv[1]))
    finally:
        dist.destroy_process_group()
    """
)


@pytest.mark.distributed
@pytest.mark.timeout(360)  # above the hang guard of its two-rank script
def test_export_refuses_a_dtensor_and_leaves_the_dict_untouched(tmp_path: Path) -> None:
    script = tmp_path / "dtensor_export.py"
    script.write_text(DTENSOR_EXPORT)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out"), str(tmp_path / "rendezvous")],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"REFUSED .*'b' \(DTensor\).*gather a full state dict first", result.stdout), result.stdout
    assert "LEFT ['a', 'b', 'c'] False" in result.stdout


@pytest.mark.parametrize("content", [b"", b"hello world garbage", "truncated"], ids=["empty", "garbage", "truncated"])
def test_corrupt_bin_file_is_refused_as_unreadable_not_a_bare_key_error(tmp_path: Path, content: bytes | str) -> None:
    path = tmp_path / "weights.bin"
    torch.save(snapshot(seeded(DuckModel(), 1)), path)
    path.write_bytes(path.read_bytes()[:200] if content == "truncated" else content)
    with pytest.raises(CheckpointIntegrityError, match=r"weights\.bin is not a readable PyTorch file"):
        load_model_checkpoint(DuckModel(), path)


@pytest.mark.parametrize("max_shard_size", [300, 10**6], ids=["same_layout", "other_layout"])
@pytest.mark.parametrize("reader", ["load_model_checkpoint", "copy_diffusers_checkpoint", "read_diffusers_state_dict"])
def test_readers_never_mix_two_exports_when_a_reexport_swaps_the_directory_after_the_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str, max_shard_size: int
) -> None:
    """A real re-export runs between validation and reading; the reader returns the export it validated."""
    from accelerate_txn.weights import _loaders

    out, first = duck_export(tmp_path / "export", seed=1)
    second = seeded(DuckModel(), 9)
    scan = _loaders.scan
    reexports: list[Path] = []

    def scan_then_reexport(*args: Any, **kwargs: Any) -> Any:
        found = scan(*args, **kwargs)
        reexports.append(save_diffusers_state_dict(snapshot(second), second, out, max_shard_size=max_shard_size))
        return found

    monkeypatch.setattr(_loaders, "scan", scan_then_reexport)
    model = DuckModel()
    if reader == "load_model_checkpoint":
        assert load_model_checkpoint(model, out) == ([], [])
        result = snapshot(model)
    elif reader == "copy_diffusers_checkpoint":
        copy_diffusers_checkpoint(model, out, None)
        result = snapshot(model)
    else:
        result = read_diffusers_state_dict(out)
    assert reexports == [out]
    assert_same(result, first)
    assert_same(read_diffusers_state_dict(out), snapshot(second))


def test_fingerprint_refuses_to_describe_a_state_mixed_from_two_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real re-export with the same layout lands after the first file is hashed: the mix is refused, not returned."""
    from accelerate_txn.weights import _fingerprint

    out, _ = duck_export(tmp_path / "export", seed=1)
    second = seeded(DuckModel(), 9)
    hash_file = _fingerprint._hash_file
    hashed: list[Path] = []

    def hash_then_reexport(file: Path) -> tuple[int, str]:
        result = hash_file(file)
        hashed.append(file)
        if len(hashed) == 2:
            save_diffusers_state_dict(snapshot(second), second, out, max_shard_size=300)
        return result

    monkeypatch.setattr(_fingerprint, "_hash_file", hash_then_reexport)
    with pytest.raises(CheckpointIntegrityError, match=r"export changed while it was being fingerprinted"):
        checkpoint_fingerprint(out)


def test_fingerprint_wraps_a_shard_vanishing_under_a_reexport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_txn.weights import _fingerprint

    out, _ = duck_export(tmp_path / "export", seed=1)
    second = seeded(DuckModel(), 9)
    hash_file = _fingerprint._hash_file
    hashed: list[Path] = []

    def hash_then_reexport(file: Path) -> tuple[int, str]:
        hashed.append(file)
        if len(hashed) == 2:
            save_diffusers_state_dict(snapshot(second), second, out, max_shard_size=10**6)  # one shard now
        return hash_file(file)

    monkeypatch.setattr(_fingerprint, "_hash_file", hash_then_reexport)
    with pytest.raises(CheckpointIntegrityError, match=r"could not be read while .*export was being fingerprinted"):
        checkpoint_fingerprint(out)
