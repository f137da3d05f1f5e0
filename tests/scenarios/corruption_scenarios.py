"""Code that runs inside launched ranks for tests/core/test_corruption.py (real 2-rank gloo FSDP1 groups).

One save, then many damaged copies of it, each tried with ``load_state`` in the same process group: every refused
case must leave every piece of live training state exactly as it was (parameters, optimizer state, scheduler,
gradient scaler, global RNG, a registered custom object, a registered private state, ``Accelerator.step``), on
every rank, with the same error everywhere. The pytest side asserts on the observations and runs the CLI on the
damaged copies, which stay on disk.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accelerate_txn import CheckpointError, configure_checkpointing, register_checkpoint_state
from accelerate_txn.accelerate.config import checkpoint_config, mark_failed
from accelerate_txn.core.manifest import MANIFEST, hash_file
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.support.log_records import WarningRecords

# The file classes of a protected FSDP1 checkpoint of ``_build`` (2 ranks), by case-name prefix.
FILES = {
    "model_payload_0": "pytorch_model_fsdp_0/__0_0.distcp",
    "model_payload_1": "pytorch_model_fsdp_0/__1_0.distcp",
    "model_metadata": "pytorch_model_fsdp_0/.metadata",
    "optim_payload_0": "optimizer_0/__0_0.distcp",
    "optim_payload_1": "optimizer_0/__1_0.distcp",
    "optim_metadata": "optimizer_0/.metadata",
    "rng_0": "random_states_0.pkl",
    "rng_1": "random_states_1.pkl",
    "scheduler": "scheduler.bin",
    "scaler": "scaler.pt",
    "custom": "custom_checkpoint_0.pkl",
    "private_0": "training_state_0.pt",
    "private_1": "training_state_1.pt",
    "manifest": MANIFEST,
}
DAMAGES = ("truncate", "flip", "delete", "symlink")
# Unlisted files a loader would read (copies of real files under names Accelerate, DCP or a registered state use).
EXTRA_READ = {
    "extra_custom_1": ("custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl"),
    "extra_custom_99": ("custom_checkpoint_0.pkl", "custom_checkpoint_99.pkl"),
    "extra_rng_7": ("random_states_0.pkl", "random_states_7.pkl"),
    "extra_scheduler_1": ("scheduler.bin", "scheduler_1.bin"),
    "extra_private_5": ("training_state_0.pt", "training_state_5.pt"),
    "extra_dcp_payload": ("pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__2_0.distcp"),
    "extra_weights": ("scheduler.bin", "model.safetensors"),
}
# Unlisted files no loader reads: accepted (and reported by verify_manifest as "extra").
EXTRA_IGNORED = {"extra_notes": "notes.txt", "extra_notes_in_dcp_dir": "optimizer_0/notes.txt"}
# Files replaced by a crafted pickle whose unpickling runs code, with the manifest rewritten to match.
CRAFTED_FILES = ("custom_checkpoint_0.pkl", "scheduler.bin", "scaler.pt", "random_states_1.pkl", "training_state_0.pt",
                 "optimizer_0/.metadata", "pytorch_model_fsdp_0/.metadata")


class Counter:
    """A custom object for ``register_for_checkpointing``: tensors and ints only (readable with weights_only)."""

    def __init__(self, seed: int) -> None:
        self.weights = torch.randn(5, generator=torch.Generator().manual_seed(seed))
        self.count = seed

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights.clone(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = state["weights"].clone()
        self.count = int(state["count"])


def warmup(step: int, steps: int = 3) -> float:
    return min(1.0, (step + 1) / steps)


@dataclass
class Run:
    acc: Any
    model: Any
    opt: Any
    sched: Any
    noise: torch.Generator
    progress: dict[str, int]
    counter: Counter
    width: int


def _rank() -> int:
    return int(os.environ["RANK"])


def _build(seed: int, *, width: int = 16, project_dir: Path | None = None, auto: bool = False) -> Run:
    """An FSDP1 run with a scheduler, a gradient scaler, a custom object and a registered private state."""
    acc = fsdp_accelerator(project_dir=project_dir, automatic_checkpoint_naming=auto)
    torch.manual_seed(seed)
    model = acc.prepare(TinyModel(width=width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup, steps=3))
    opt, sched = acc.prepare(opt, sched)
    noise = torch.Generator().manual_seed(100 + 10 * seed + _rank())
    progress = {"batches": 0}
    register_checkpoint_state(acc, {"noise": noise}, progress)
    counter = Counter(seed)
    acc.register_for_checkpointing(counter)
    # Accelerate creates a scaler only for fp16 on an accelerator device; on CPU attach a real CPU GradScaler so
    # Accelerate's save_state/load_state write and read scaler.pt exactly as they do on GPUs.
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (4 + seed % 7))
    return Run(acc, model, opt, sched, noise, progress, counter, width)


def _perturb(run: Run, salt: int) -> None:
    """Move every piece of live state away from anything saved: one optimizer step, new custom/private/scaler
    values, a new global RNG state and ``Accelerator.step``."""
    mark_failed(run.acc, False)  # if a (buggy) refused load marked it failed, keep observing the next cases
    generator = torch.Generator().manual_seed(10_000 + salt + 97 * _rank())
    run.model(torch.randn(4, run.width, generator=generator)).pow(2).mean().backward()
    run.opt.step()
    run.sched.step()
    run.sched.scheduler.last_epoch += 1000  # never the epoch of a saved scheduler
    run.opt.zero_grad(set_to_none=True)
    run.counter.weights = torch.randn(5, generator=generator)
    run.counter.count = 50_000 + salt
    run.progress["batches"] = 70_000 + salt
    run.noise.manual_seed(80_000 + salt + _rank())
    run.acc.scaler.load_state_dict({**run.acc.scaler.state_dict(), "scale": float(2 ** (salt % 20 + 1)) + 0.5})
    run.acc.step = 90_000 + salt
    torch.manual_seed(20_000 + salt + _rank())
    random.seed(30_000 + salt)
    np.random.seed(40_000 + salt)


def _train(run: Run, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + 1000 * _rank())
    for _ in range(steps):
        run.model(torch.randn(4, run.width, generator=generator)).pow(2).mean().backward()
        run.opt.step()
        run.sched.step()
        run.opt.zero_grad(set_to_none=True)
    run.counter.count += steps
    run.counter.weights = run.counter.weights + steps
    run.progress["batches"] += 4 * steps * (_rank() + 1)
    run.noise.manual_seed(555 + seed + _rank())
    run.acc.step += steps
    run.acc.scaler.load_state_dict({**run.acc.scaler.state_dict(), "scale": float(2 ** (seed % 10 + 3))})


def _local(value: Any) -> Any:
    """A detached copy of this rank's shard: the local tensor of a DTensor (FSDP2), the tensor itself otherwise."""
    if hasattr(value, "to_local"):
        return value.to_local().detach().clone()
    return value.detach().clone() if torch.is_tensor(value) else value


def snapshot(run: Run) -> dict[str, Any]:
    """This rank's complete live training state, copied (local shards of FSDP2 DTensors)."""
    names = {id(p): name for name, p in run.model.named_parameters()}
    raw = getattr(run.opt, "optimizer", run.opt)
    return copy.deepcopy({
        "parameters": {name: _local(p) for name, p in run.model.named_parameters()},
        "optimizer": {names[id(p)]: {k: _local(v) for k, v in s.items()} for p, s in raw.state.items() if s},
        "scheduler": run.sched.state_dict(),
        "scaler": run.acc.scaler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "custom object": run.counter.state_dict(),
        "private state": {"noise": run.noise.get_state(), "progress": dict(run.progress)},
        "step": run.acc.step,
    })


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a, b)))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The components (keys of :func:`snapshot`) whose values differ."""
    return [key for key in a if not _equal(a[key], b[key])]


def _error(function: Any) -> dict[str, Any] | None:
    try:
        function()
    except CheckpointError as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    except BaseException as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return None


# --- damage -----------------------------------------------------------------------------------------------------

def flip_middle_byte(path: Path) -> None:
    with path.open("r+b") as stream:
        stream.seek(path.stat().st_size // 2)
        byte = stream.read(1)
        stream.seek(-1, os.SEEK_CUR)
        stream.write(bytes([byte[0] ^ 0xFF]))


def damage(case_dir: Path, relative: str, kind: str, outside: Path) -> None:
    path = case_dir / relative
    if kind == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif kind == "flip":
        flip_middle_byte(path)
    elif kind == "delete":
        path.unlink()
    elif kind == "symlink":  # an identical copy outside the checkpoint: still not part of it
        outside.mkdir(parents=True, exist_ok=True)
        target = outside / path.name
        shutil.copy2(path, target)
        path.unlink()
        path.symlink_to(target)
    else:
        raise ValueError(kind)


def craft(path: Path, marker: Path) -> None:
    """Replace ``path`` by a torch archive whose unpickling creates ``marker`` (a plain dict around the payload)."""
    torch.save({"state": Exploit(str(marker)), "count": 1}, path)


class Exploit:
    """Unpickling this calls ``os.mkdir(marker)``: a stand-in for arbitrary code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.marker,)


def craft_dcp_metadata(path: Path, marker: Path) -> None:
    """A DCP ``.metadata`` whose unpickling (plain ``pickle``, as DCP's reader does) creates ``marker``."""
    import pickle

    path.write_bytes(pickle.dumps(Exploit(str(marker))))


def rewrite_rows(case_dir: Path, names: list[str]) -> None:
    """Make the manifest match the current content of ``names`` (size and hash; everything else kept)."""
    manifest_path = case_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    for name in names:
        row = manifest["files"][name]
        algorithm = next(key for key in ("xxh3_128", "sha256") if key in row)
        size, digest = hash_file(case_dir / name, algorithm)
        row.update({"size": size, algorithm: digest})
    manifest_path.write_text(json.dumps(manifest, sort_keys=True, indent=1))


def _cases() -> list[tuple[str, Any]]:
    """(case name, rank-0 damage function of (case_dir, outside, markers)) in the order they are tried."""
    cases: list[tuple[str, Any]] = []
    for prefix, relative in FILES.items():
        for kind in DAMAGES:
            cases.append((f"{prefix}-{kind}", functools.partial(
                lambda d, o, m, relative, kind: damage(d, relative, kind, o), relative=relative, kind=kind)))
    for name, (source, target) in EXTRA_READ.items():
        cases.append((name, functools.partial(lambda d, o, m, s, t: shutil.copy2(d / s, d / t), s=source, t=target)))

    def model_dir_symlink(case_dir: Path, outside: Path, markers: Path) -> None:
        folder = case_dir / "pytorch_model_fsdp_0"
        outside.mkdir(parents=True, exist_ok=True)
        shutil.copytree(folder, outside / folder.name)
        shutil.rmtree(folder)
        folder.symlink_to(outside / folder.name, target_is_directory=True)

    def manifest_omits_scheduler(case_dir: Path, outside: Path, markers: Path) -> None:
        manifest = json.loads((case_dir / MANIFEST).read_text())
        del manifest["files"]["scheduler.bin"]  # the manifest no longer proves the scheduler state...
        (case_dir / MANIFEST).write_text(json.dumps(manifest))
        os.truncate(case_dir / "scheduler.bin", 7)  # ...which is then damaged (as a notes file, it is "unlisted")

    def crafted(name: str) -> Any:
        def make(case_dir: Path, outside: Path, markers: Path) -> None:
            marker = markers / name.replace("/", "_")
            if name.endswith(".metadata"):
                craft_dcp_metadata(case_dir / name, marker)
            else:
                craft(case_dir / name, marker)
            rewrite_rows(case_dir, [name])
        return make

    def manifest_omits_payload(case_dir: Path, outside: Path, markers: Path) -> None:
        manifest = json.loads((case_dir / MANIFEST).read_text())
        del manifest["files"]["optimizer_0/__1_0.distcp"]  # intact file, but no longer proven by the manifest
        (case_dir / MANIFEST).write_text(json.dumps(manifest))

    def metadata_names_outside(case_dir: Path, outside: Path, markers: Path) -> None:
        # A valid DCP Metadata whose payload lies outside its directory; the manifest rewritten to match it.
        import pickle

        from accelerate_txn.core.manifest import read_dcp_metadata

        folder = case_dir / "pytorch_model_fsdp_0"
        metadata = read_dcp_metadata(folder)
        for index, storage in list(metadata.storage_data.items()):
            if str(storage.relative_path) == "__1_0.distcp":
                storage.relative_path = "../../outside_payload.distcp"
                metadata.storage_data[index] = storage
        shutil.copy2(folder / "__1_0.distcp", case_dir.parent / "outside_payload.distcp")
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        rewrite_rows(case_dir, ["pytorch_model_fsdp_0/.metadata"])

    def matching_truncation(name: str) -> Any:
        def make(case_dir: Path, outside: Path, markers: Path) -> None:
            os.truncate(case_dir / name, (case_dir / name).stat().st_size // 2)
            rewrite_rows(case_dir, [name])  # a manifest that matches the damaged bytes: only parsing can tell
        return make

    cases += [("model_dir-symlink", model_dir_symlink), ("manifest_omits_scheduler", manifest_omits_scheduler),
              ("manifest_omits_payload", manifest_omits_payload), ("metadata_names_outside", metadata_names_outside)]
    for name in ("scheduler.bin", "scaler.pt", "custom_checkpoint_0.pkl", "random_states_1.pkl", "training_state_1.pt"):
        cases.append((f"matching-truncated-{name}", matching_truncation(name)))
    for name in CRAFTED_FILES:
        cases.append((f"crafted-{name.replace('/', '_')}", crafted(name)))
    return cases


def corruption_matrix(root: str) -> dict[str, Any]:
    """Save once; try every damaged copy; then the accepted cases. Returns this rank's observations."""
    root_path = Path(root)
    rank = _rank()
    saver = _build(0)
    _train(saver, 3, seed=1)
    good = root_path / "good"
    saver.acc.save_state(str(good))
    saved = snapshot(saver)
    markers = root_path / "markers"
    obs: dict[str, Any] = {"cases": {}, "listing": sorted(str(p.relative_to(good)) for p in good.rglob("*"))}

    loader = _build(7)
    _train(loader, 1, seed=9)
    for index, (name, make) in enumerate(_cases()):
        case_dir = root_path / "cases" / name
        if rank == 0:
            markers.mkdir(exist_ok=True)
            shutil.copytree(good, case_dir, symlinks=True)
            make(case_dir, root_path / "outside" / name, markers)
        loader.acc.wait_for_everyone()
        _perturb(loader, index)
        # Without its manifest the copy is a legacy directory, which allow_legacy (default True) would load after
        # checking every file: refused here with allow_legacy=False; the default is checked further down.
        configure_checkpointing(loader.acc, allow_legacy=name != "manifest-delete")
        before = snapshot(loader)
        error = _error(lambda case_dir=case_dir: loader.acc.load_state(str(case_dir)))
        after = snapshot(loader)
        configure_checkpointing(loader.acc, allow_legacy=True)
        obs["cases"][name] = {
            "error": error,
            "changed": differences(before, after),
            "marked_failed": checkpoint_config(loader.acc).failed,  # set only by a failure after a change
            # Components equal to the saved state already: a mutation of those could not show. Must be empty.
            "same_as_saved": [key for key in saved if key not in differences(before, saved)],
        }
    obs["markers"] = sorted(p.name for p in markers.iterdir()) if markers.exists() else []
    obs["components"] = list(saved)

    # Accepted: unlisted files no loader reads. Each load restores the saved state exactly.
    for offset, (name, relative) in enumerate(EXTRA_IGNORED.items()):
        case_dir = root_path / "cases" / name
        if rank == 0:
            shutil.copytree(good, case_dir)
            (case_dir / relative).write_text("operator notes: copied from the cluster on Monday\n")
        loader.acc.wait_for_everyone()
        _perturb(loader, 500 + offset)
        before = snapshot(loader)
        error = _error(lambda case_dir=case_dir: loader.acc.load_state(str(case_dir)))
        obs["cases"][name] = {"error": error, "changed": differences(before, snapshot(loader)),
                              "restored_differences": differences(saved, snapshot(loader))}

    # The manifest deleted: a manifest-less (legacy) directory, which by default loads with a warning after every
    # file it reads was checked and read safely.
    case_dir = root_path / "cases" / "manifest-delete"  # made by the matrix above
    _perturb(loader, 600)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = _error(lambda: loader.acc.load_state(str(case_dir)))
    obs["legacy_default"] = {"error": error, "restored_differences": differences(saved, snapshot(loader)),
                             "warned": any("no completion manifest" in str(w.message) for w in caught)}
    return obs


# --- selection, legacy, staging, large payloads ------------------------------------------------------------------

def selection(root: str) -> dict[str, Any]:
    """Automatic selection with a corrupt newest checkpoint, newer legacy directories, a staging directory, and
    a flipped byte in a payload over 16 MiB."""
    root_path = Path(root)
    rank = _rank()
    obs: dict[str, Any] = {}
    records = WarningRecords()
    logging.getLogger("accelerate_txn").addHandler(records)

    # Run 1: three complete checkpoints (automatic naming).
    run1 = root_path / "run1"
    saver = _build(0, project_dir=run1, auto=True)
    states = []
    for step in range(3):
        _train(saver, 1, seed=step)
        saver.acc.save_state()
        states.append(snapshot(saver))
    checkpoints = run1 / "checkpoints"
    run2 = root_path / "run2"
    if rank == 0:
        # Run 2: complete checkpoint_0 and _1, then newer manifest-less directories: checkpoint_2 with a
        # half-written scheduler.bin and checkpoint_3 intact (a native save of the newest state).
        for number in (0, 1):
            shutil.copytree(checkpoints / f"checkpoint_{number}", run2 / "checkpoints" / f"checkpoint_{number}")
        for number, half in ((2, True), (3, False)):
            legacy = run2 / "checkpoints" / f"checkpoint_{number}"
            shutil.copytree(checkpoints / "checkpoint_2", legacy)
            (legacy / MANIFEST).unlink()
            if half:
                os.truncate(legacy / "scheduler.bin", (legacy / "scheduler.bin").stat().st_size // 2)
        # Staging directories (with and without a manifest) of a later save that never finished.
        run_id = json.loads((checkpoints / "checkpoint_2" / MANIFEST).read_text())["run_id"]
        staged = checkpoints / f".checkpoint_3.staging-{run_id}-0123456789abcdef"
        shutil.copytree(checkpoints / "checkpoint_2", staged)
        unfinished = checkpoints / f".checkpoint_4.staging-{run_id}-fedcba9876543210"
        shutil.copytree(checkpoints / "checkpoint_2", unfinished)
        (unfinished / MANIFEST).unlink()
        # The newest complete checkpoint of run 1 gets one flipped byte in rank 1's model shard.
        flip_middle_byte(checkpoints / "checkpoint_2" / "pytorch_model_fsdp_0" / "__1_0.distcp")
    saver.acc.wait_for_everyone()
    obs["run1"] = sorted(p.name for p in checkpoints.iterdir())

    loader = _build(7, project_dir=run1, auto=True)
    _perturb(loader, 1)
    before = snapshot(loader)
    obs["explicit_corrupt"] = {"error": _error(lambda: loader.acc.load_state(str(checkpoints / "checkpoint_2"))),
                               "changed": differences(before, snapshot(loader))}
    for label, prefix in (("staging_with_manifest", ".checkpoint_3.staging-"),
                          ("staging_without_manifest", ".checkpoint_4.staging-")):
        target = next(p for p in checkpoints.iterdir() if p.name.startswith(prefix))
        _perturb(loader, 2)
        before = snapshot(loader)
        obs[label] = {"error": _error(lambda target=target: loader.acc.load_state(str(target))),
                      "changed": differences(before, snapshot(loader))}
    _perturb(loader, 3)
    records.messages.clear()
    obs["automatic"] = {"error": _error(lambda: loader.acc.load_state()),
                        "restored_differences": differences(states[1], snapshot(loader)),
                        "iteration": loader.acc.project_configuration.iteration,
                        "skipped": [m for m in records.messages if "checkpoint_2" in m and "Skipping" in m]}

    legacy_loader = _build(8, project_dir=run2, auto=True)
    _perturb(legacy_loader, 4)
    before = snapshot(legacy_loader)
    obs["legacy_explicit_half_written"] = {
        "error": _error(lambda: legacy_loader.acc.load_state(str(run2 / "checkpoints" / "checkpoint_2"))),
        "changed": differences(before, snapshot(legacy_loader))}
    _perturb(legacy_loader, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = _error(lambda: legacy_loader.acc.load_state())
    obs["legacy_automatic"] = {"error": error, "restored_differences": differences(states[1], snapshot(legacy_loader)),
                               "iteration": legacy_loader.acc.project_configuration.iteration,
                               "legacy_warning": any("no completion manifest" in str(w.message) for w in caught)}

    # A model whose per-rank shard is over 16 MiB (3 x 2048 x 2048 float32 over 2 ranks: about 25 MB each).
    run3 = root_path / "run3"
    wide = _build(0, width=2048, project_dir=run3, auto=True)
    wide_states = []
    for step in range(2):
        _train(wide, 1, seed=step)
        wide.acc.save_state()
        wide_states.append(snapshot(wide))
    newest = run3 / "checkpoints" / "checkpoint_1"
    shard = newest / "pytorch_model_fsdp_0" / "__1_0.distcp"
    obs["wide_shard_bytes"] = shard.stat().st_size
    if rank == 0:
        flip_middle_byte(shard)
    wide.acc.wait_for_everyone()
    wide_loader = _build(7, width=2048, project_dir=run3, auto=True)
    _perturb(wide_loader, 6)
    before = snapshot(wide_loader)
    obs["wide_explicit"] = {"error": _error(lambda: wide_loader.acc.load_state(str(newest))),
                            "changed": differences(before, snapshot(wide_loader))}
    _perturb(wide_loader, 7)
    records.messages.clear()
    obs["wide_automatic"] = {"error": _error(lambda: wide_loader.acc.load_state()),
                             "restored_differences": differences(wide_states[0], snapshot(wide_loader)),
                             "skipped": [m for m in records.messages if "checkpoint_1" in m and "Skipping" in m]}
    logging.getLogger("accelerate_txn").removeHandler(records)
    return obs
