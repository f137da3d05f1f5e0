"""Code that runs inside launched ranks (real gloo process groups). Each scenario performs several checks in
one process group to amortise start-up, and returns observations that the pytest side asserts on."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn import CheckpointError, configure_checkpointing, register_checkpoint_state
from accelerate_txn.testing import TinyModel, fsdp_accelerator


def warmup_lambda(step: int, warmup: int = 3) -> float:
    return min(1.0, (step + 1) / warmup)


@contextlib.contextmanager
def held_dcp_writes() -> Iterator[threading.Event]:
    """While the yielded event is cleared, DCP writes (an asynchronous save's background thread looks up
    ``state_dict_saver.save`` at each write) wait for it: a deterministic window between ``save_state`` returning
    and the first byte written, with no sleep. On exit the event is set and DCP's ``save`` restored."""
    from torch.distributed.checkpoint import state_dict_saver

    gate = threading.Event()
    gate.set()
    original = state_dict_saver.save

    def held(*args: Any, **kwargs: Any) -> Any:
        gate.wait()
        return original(*args, **kwargs)

    state_dict_saver.save = held
    try:
        yield gate
    finally:
        gate.set()
        state_dict_saver.save = original


def _local_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's shards of the parameters and optimizer state, keyed stably."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): name for name, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for p, s in opt.state.items() if s}
    return {"params": params, "optim": state}


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of entries that differ (bitwise) between two _local_state results."""
    bad = [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    if set(a["optim"]) != set(b["optim"]):
        bad.append(f"optimizer state keys {sorted(a['optim'])} vs {sorted(b['optim'])}")
    for name in set(a["optim"]) & set(b["optim"]):
        for key, value in a["optim"][name].items():
            other = b["optim"][name].get(key)
            if not (torch.is_tensor(value) and torch.is_tensor(other) and torch.equal(value, other)):
                bad.append(f"optim {name}.{key}")
    return bad


def _train(accelerator: Any, model: Any, optimizer: Any, scheduler: Any | None, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + accelerator.process_index)
    for _ in range(steps):
        batch = torch.randn(4, 16, generator=generator)
        loss = model(batch).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _build(seed: int, *, width: int = 16, lr: float = 1e-2, use_orig_params: bool = True, **kwargs: Any) -> tuple:
    accelerator = fsdp_accelerator(use_orig_params=use_orig_params, **kwargs)
    torch.manual_seed(seed)
    model = accelerator.prepare(TinyModel(width=width))  # FSDP1: build the optimizer on the wrapped model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_lambda, warmup=3))
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def _error(function: Any) -> dict[str, Any] | None:
    try:
        function()
    except CheckpointError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "failures": sorted(exc.failures)}
    except BaseException as exc:
        return {"type": type(exc).__name__, "message": str(exc), "failures": None}
    return None


def roundtrip(root: str, use_orig_params: bool) -> dict[str, Any]:
    """Patched save_state/load_state round trip into a fresh model and optimizer, then rejections."""
    root_path = Path(root)
    rank = int(os.environ["RANK"])
    obs: dict[str, Any] = {}
    acc, model, opt, sched = _build(0, use_orig_params=use_orig_params)
    noise = torch.Generator().manual_seed(100 + rank)
    progress = {"batches": 0}
    register_checkpoint_state(acc, {"noise": noise}, progress)
    _train(acc, model, opt, sched, 3, seed=1)
    progress["batches"] = 3 * (rank + 1)
    noise.manual_seed(555 + rank)
    # A path containing the directory names Accelerate 1.7-1.14 match by substring.
    path = root_path / "run_optimizer_pytorch_model_fsdp" / "ckpt"
    saved_at = acc.save_state(str(path))
    obs["saved_at"] = str(saved_at)
    obs["listing"] = sorted(os.listdir(path))
    import json

    import accelerate

    manifest = json.loads((path / accelerate_txn.MANIFEST).read_text())
    obs["manifest_versions"] = manifest["versions"]
    obs["installed_versions"] = {"accelerate": accelerate.__version__, "torch": torch.__version__}
    obs["no_staging_left"] = not [p for p in path.parent.iterdir() if ".staging-" in p.name]
    expected = _local_state(model, opt)
    expected_rng = torch.rand(3)
    expected_noise = torch.rand(3, generator=noise)
    expected_lr = sched.get_last_lr()
    expected_step = acc.step

    # A fresh model (other initial values) and a fresh optimizer: the normal resume.
    acc2, model2, opt2, sched2 = _build(7, use_orig_params=use_orig_params)
    noise2 = torch.Generator().manual_seed(999)
    progress2 = {"batches": -1}
    register_checkpoint_state(acc2, {"noise": noise2}, progress2)
    torch.manual_seed(12345)
    acc2.load_state(str(path))
    got = _local_state(model2, opt2)
    obs["roundtrip_differences"] = _same(expected, got)
    obs["optimizer_entries"] = len(got["optim"])
    obs["rng_restored"] = torch.equal(torch.rand(3), expected_rng)
    obs["private_generator_restored"] = torch.equal(torch.rand(3, generator=noise2), expected_noise)
    obs["progress_restored"] = progress2 == progress
    obs["scheduler_restored"] = sched2.get_last_lr() == expected_lr
    obs["step_restored"] = acc2.step == expected_step

    # Rejections: each leaves the live model untouched.
    before = _local_state(model2, opt2)

    def corrupted(name: str, damage: Any) -> str:
        target = root_path / f"bad_{name}"
        if rank == 0:
            shutil.copytree(path, target)
            damage(target)
        acc2.wait_for_everyone()
        return str(target)

    def truncate(target: Path) -> None:
        payload = next((target / "pytorch_model_fsdp_0").glob("*.distcp"))
        with payload.open("r+b") as stream:
            stream.truncate(payload.stat().st_size // 2)

    def flip(target: Path) -> None:
        rng_file = target / "random_states_1.pkl"
        data = bytearray(rng_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        rng_file.write_bytes(bytes(data))

    def drop_rank_file(target: Path) -> None:
        (target / "random_states_1.pkl").unlink()

    rejections = {}
    for name, damage in (("truncated", truncate), ("flipped", flip), ("missing_rank_file", drop_rank_file)):
        bad = corrupted(name, damage)
        rejections[name] = _error(lambda bad=bad: acc2.load_state(bad))
        rejections[name]["unchanged"] = not _same(before, _local_state(model2, opt2))
    # A different model (wider layers): rejected before any change.
    acc3, model3, opt3, _ = _build(7, use_orig_params=use_orig_params, width=24)
    register_checkpoint_state(acc3, {"noise": torch.Generator()}, {"batches": 0})
    before3 = _local_state(model3, opt3)
    rejections["configuration"] = _error(lambda: acc3.load_state(str(path)))
    rejections["configuration"]["unchanged"] = not _same(before3, _local_state(model3, opt3))
    obs["rejections"] = rejections

    # A save hook that raises on rank 1 only: every rank raises, nothing is published.
    def failing_hook(models: Any, weights: Any, output_dir: str) -> None:
        if rank == 1:
            raise RuntimeError("hook exploded on rank 1")

    handle = acc2.register_save_state_pre_hook(failing_hook)
    hook_target = root_path / "hooked"
    iteration = acc2.project_configuration.iteration
    obs["hook_failure"] = _error(lambda: acc2.save_state(str(hook_target)))
    acc2.wait_for_everyone()  # rank 0 removes the staging directory before it returns
    obs["hook_nothing_published"] = not hook_target.exists() and not [
        p for p in root_path.iterdir() if ".staging-" in p.name]
    obs["hook_iteration_restored"] = acc2.project_configuration.iteration == iteration
    handle.remove()
    # overwrite="refuse" refuses an existing checkpoint; the default replaces it atomically (native overwrites).
    configure_checkpointing(acc2, overwrite="refuse")
    obs["overwrite"] = _error(lambda: acc2.save_state(str(path)))
    configure_checkpointing(acc2, overwrite="replace")
    replaced_from = json.loads((path / accelerate_txn.MANIFEST).read_text())["transaction_id"]
    obs["replace"] = _error(lambda: acc2.save_state(str(path)))
    acc2.wait_for_everyone()
    obs["replaced"] = json.loads((path / accelerate_txn.MANIFEST).read_text())["transaction_id"] != replaced_from
    obs["replaced_listing"] = sorted(p.name for p in path.parent.iterdir())
    return obs


def retention(root: str) -> dict[str, Any]:
    """Automatic naming + total_limit: older checkpoints go only after the new one is published."""
    obs: dict[str, Any] = {}
    acc, model, opt, sched = _build(0, project_dir=root, automatic_checkpoint_naming=True, total_limit=2)
    checkpoints = Path(root) / "checkpoints"
    seen_during_save: list[list[str]] = []

    def observe(models: Any, weights: Any, output_dir: str) -> None:
        seen_during_save.append(sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("checkpoint_")))

    acc.register_save_state_pre_hook(observe)
    states = []
    for _ in range(3):
        _train(acc, model, opt, sched, 1, seed=len(states))
        acc.save_state()
        states.append(_local_state(model, opt))
    obs["seen_during_save"] = seen_during_save
    obs["after"] = sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith("."))
    obs["iteration"] = acc.project_configuration.iteration
    # Resume with automatic selection into a fresh accelerator: picks the newest and continues numbering.
    acc2, model2, opt2, _ = _build(3, project_dir=root, automatic_checkpoint_naming=True, total_limit=2)
    acc2.register_save_state_pre_hook(lambda *a: None)
    acc2.load_state()
    obs["resumed_differences"] = _same(states[-1], _local_state(model2, opt2))
    obs["resumed_iteration"] = acc2.project_configuration.iteration
    return obs


def dispatch_toggles(root: str) -> dict[str, Any]:
    """Env toggle off = native; per-instance opt-in/out."""
    obs: dict[str, Any] = {}
    acc, model, opt, sched = _build(0)
    _train(acc, model, opt, sched, 1, seed=0)
    acc.save_state(os.path.join(root, "auto"))
    obs["auto_has_manifest"] = os.path.exists(os.path.join(root, "auto", accelerate_txn.MANIFEST))
    accelerate_txn.unpatch_accelerate_fsdp(acc)
    acc.save_state(os.path.join(root, "unpatched"))
    obs["unpatched_has_manifest"] = os.path.exists(os.path.join(root, "unpatched", accelerate_txn.MANIFEST))
    accelerate_txn.patch_accelerate_fsdp(acc)
    acc.save_state(os.path.join(root, "repatched"))
    obs["repatched_has_manifest"] = os.path.exists(os.path.join(root, "repatched", accelerate_txn.MANIFEST))
    # A native (legacy) checkpoint loads through the protected path with a warning and checked files.
    acc2, model2, opt2, _ = _build(5)
    configure_checkpointing(acc2, allow_legacy=True)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc2.load_state(os.path.join(root, "unpatched"))
    obs["legacy_warned"] = any("no completion manifest" in str(w.message) for w in caught)
    obs["legacy_differences"] = _same(_local_state(model, opt), _local_state(model2, opt2))
    # An opted-in instance routes even a native (unwrapped) load_state's FSDP optimizer load through the
    # accelerate-txn loader: a fresh optimizer gets its state back, where native Accelerate restores none.
    from accelerate_txn.accelerate.native import native_method

    acc3, model3, opt3, _ = _build(6)
    accelerate_txn.patch_accelerate_fsdp(acc3)
    native_method(acc3, "load_state")(os.path.join(root, "unpatched"))
    obs["opted_in_native_differences"] = _same(_local_state(model, opt), _local_state(model3, opt3))
    configure_checkpointing(acc2, allow_legacy=False)
    obs["legacy_refused"] = _error(lambda: acc2.load_state(os.path.join(root, "unpatched")))
    return obs


def env_off(root: str) -> dict[str, Any]:
    """ACCELERATE_TXN_PATCHES=0: native unless opted in."""
    acc, model, opt, sched = _build(0)
    _train(acc, model, opt, sched, 1, seed=0)
    acc.save_state(os.path.join(root, "native"))
    native = os.path.exists(os.path.join(root, "native", accelerate_txn.MANIFEST))
    accelerate_txn.patch_accelerate_fsdp(acc)
    acc.save_state(os.path.join(root, "opted_in"))
    opted = os.path.exists(os.path.join(root, "opted_in", accelerate_txn.MANIFEST))
    return {"native_has_manifest": native, "opted_in_has_manifest": opted}


def killable_save(root: str, block_at_save: int) -> None:
    """Save every step; at save number ``block_at_save`` rank 0 signals and blocks inside the save (to be killed)."""
    import signal

    acc, model, opt, sched = _build(0, project_dir=root, automatic_checkpoint_naming=True, total_limit=3)
    saves = {"count": 0}

    def block(models: Any, weights: Any, output_dir: str) -> None:
        saves["count"] += 1
        if saves["count"] == block_at_save and acc.process_index == 0:
            # Written whole, then renamed: the test polls for the name and reads it at once (an open-then-write
            # could be read empty in between).
            Path(root, "blocked-in-save.tmp").write_text(output_dir)
            os.replace(Path(root, "blocked-in-save.tmp"), Path(root, "blocked-in-save"))
            while True:  # stay inside the save until SIGKILL
                signal.pause()

    acc.register_save_state_pre_hook(block)
    for step in range(block_at_save):
        _train(acc, model, opt, sched, 1, seed=step)
        acc.save_state()


def resume_after_kill(root: str) -> dict[str, Any]:
    """After a kill -9 mid-save: resume selects the last complete checkpoint; the next save is not blocked."""
    checkpoints = Path(root) / "checkpoints"
    obs: dict[str, Any] = {"before": sorted(p.name for p in checkpoints.iterdir() if p.name != ".accelerate-txn.lock")}
    acc, model, opt, sched = _build(3, project_dir=root, automatic_checkpoint_naming=True, total_limit=3)
    acc.register_save_state_pre_hook(lambda *args: None)  # same hook count as the killed run
    acc.load_state()
    obs["next_iteration"] = acc.project_configuration.iteration
    _train(acc, model, opt, sched, 1, seed=99)
    acc.save_state()
    acc.wait_for_everyone()
    obs["after"] = sorted(p.name for p in checkpoints.iterdir() if p.name != ".accelerate-txn.lock")
    return obs


def disagreement_and_native_gap(root: str) -> dict[str, Any]:
    """Ranks that disagree raise the same explained error; the post-restore check catches an empty optimizer."""
    from accelerate_txn.accelerate.optimizers import verify_restored

    obs: dict[str, Any] = {}
    rank = int(os.environ["RANK"])
    acc, model, opt, sched = _build(0)
    _train(acc, model, opt, sched, 2, seed=0)
    path = Path(root) / "ckpt"
    acc.save_state(str(path))
    configure_checkpointing(acc, metadata={"dataset": "laion" if rank == 0 else "coyo"})
    obs["disagreement"] = _error(lambda: acc.save_state(str(Path(root) / "never")))
    obs["disagreement_published_nothing"] = not (Path(root) / "never").exists()
    # Native Accelerate (instance opted out) loading into a fresh optimizer restores no optimizer state,
    # silently; the verification the protected path runs after every restore catches exactly that.
    acc2, model2, opt2, _ = _build(5)
    accelerate_txn.unpatch_accelerate_fsdp(acc2)
    acc2.load_state(str(path))
    obs["native_optimizer_entries"] = sum(1 for s in getattr(opt2, "optimizer", opt2).state.values() if s)
    obs["verify_native"] = _error(lambda: verify_restored(model2, opt2, path / "optimizer_0"))

    # DCP's CheckpointException derives from BaseException: raised on rank 1 only, every rank still raises.
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.utils import _wrap_exception

    from accelerate_txn.core.ranks import run_phase

    def dcp_failure() -> None:
        if rank == 1:
            try:
                raise OSError("disk full")
            except OSError as exc:
                raise CheckpointException("simulated storage failure", {1: _wrap_exception(exc)}) from exc

    obs["dcp_exception"] = _error(lambda: run_phase(dcp_failure, "Reading shards"))

    # A restore that fails part-way (a load hook raising after the FSDP state was loaded) marks the Accelerator
    # failed: optimizer.step() and saving raise until a load succeeds.
    acc3, model3, opt3, sched3 = _build(9)

    def broken_load_hook(models: Any, input_dir: str) -> None:
        raise RuntimeError("load hook failed")

    handle = acc3.register_load_state_pre_hook(broken_load_hook)
    obs["partial_restore"] = _error(lambda: acc3.load_state(str(path)))
    loss = model3(torch.randn(2, 16)).sum()
    acc3.backward(loss)
    obs["step_after_failed_restore"] = _error(opt3.step)
    opt3.zero_grad(set_to_none=True)
    obs["save_after_failed_restore"] = _error(lambda: acc3.save_state(str(Path(root) / "after_failure")))
    handle.remove()
    acc3.register_load_state_pre_hook(lambda models, input_dir: None)  # same hook count as the saver
    acc3.load_state(str(path))
    obs["recovered_differences"] = _same(_local_state(model, opt), _local_state(model3, opt3))
    _train(acc3, model3, opt3, sched3, 1, seed=3)
    obs["step_after_recovery"] = True
    return obs


def multi_cpu_explicit(root: str) -> dict[str, Any]:
    """The explicit API also protects a plain MULTI_CPU (DDP on CPU) Accelerator."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    _train(acc, model, opt, None, 2, seed=0)
    # The patch adds no collective for other backends: a main-process-only native save_state must not hang.
    if acc.is_main_process:
        acc.save_state(str(Path(root) / "main_only"))
    acc.wait_for_everyone()
    main_only = sorted(os.listdir(Path(root) / "main_only"))
    path = accelerate_txn.save_training_checkpoint(acc, Path(root) / "ddp")
    expected = _local_state(model, opt)
    torch.manual_seed(1)
    model2 = TinyModel()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    acc2 = Accelerator(cpu=True)
    model2, opt2 = acc2.prepare(model2, opt2)
    accelerate_txn.load_training_checkpoint(acc2, path)
    return {"backend": acc2.distributed_type.name, "manifest": (path / accelerate_txn.MANIFEST).is_file(),
            "main_only": main_only,
            "differences": _same(expected, _local_state(model2, opt2))}


def multi_cpu_protect_all(root: str) -> dict[str, Any]:
    """With ACCELERATE_TXN_PROTECT=all (set by the test), a plain MULTI_CPU (DDP on CPU) save_state/load_state takes
    the protected path: published with a manifest, a corrupt copy refused on every rank before any change."""
    from accelerate import Accelerator

    def build(seed: int) -> tuple:
        acc = Accelerator(cpu=True)
        torch.manual_seed(seed)
        model = TinyModel()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        return acc, model, opt

    acc, model, opt = build(0)
    _train(acc, model, opt, None, 2, seed=0)
    path = Path(root) / "checkpoint-1"
    acc.save_state(str(path))
    expected = _local_state(model, opt)
    acc2, model2, opt2 = build(1)
    bad = Path(root) / "checkpoint-2"
    if acc2.is_main_process:
        shutil.copytree(path, bad)
        (bad / "random_states_1.pkl").write_bytes(b"garbage")
    acc2.wait_for_everyone()
    before = _local_state(model2, opt2)
    corrupt = _error(lambda: acc2.load_state(str(bad)))
    unchanged = not _same(before, _local_state(model2, opt2))
    acc2.load_state(str(path))
    return {"backend": acc2.distributed_type.name, "manifest": (path / accelerate_txn.MANIFEST).is_file(),
            "differences": _same(expected, _local_state(model2, opt2)), "corrupt": corrupt,
            "corrupt_unchanged": unchanged}


def own_files(root: str) -> dict[str, Any]:
    """A protected save, then each rank's share of the hash-and-fsync pass over a copy of the published tree."""
    import json

    from accelerate_txn.core.manifest import list_tree
    from accelerate_txn.core.transaction import own_rows

    acc, model, opt, sched = _build(0)
    register_checkpoint_state(acc, {"noise": torch.Generator().manual_seed(1)}, {"batches": 0})
    _train(acc, model, opt, sched, 2, seed=1)
    path = Path(root) / "ckpt"
    acc.save_state(str(path))
    templates = ["random_states_{rank}.pkl", "training_state_{rank}.pt"]
    rows = own_rows(path, templates, "full")
    recorded = json.loads((path / accelerate_txn.MANIFEST).read_text())["files"]
    return {"mine": sorted(rows), "tree": sorted(list_tree(path)),
            # the manifest adds a DCP schema to .metadata rows; size and hash must be exactly this rank's
            "rows_match_manifest": all({k: recorded[name][k] for k in row} == row for name, row in rows.items())}
