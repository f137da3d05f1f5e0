"""The 2-rank authenticated-checkpoint scenarios (tests/core/test_signing_fsdp.py).

:func:`signed_restore` (FSDP1 or FSDP2, local): a checkpoint saved under an HMAC signing key; a copy forged
consistently without the key (its scheduler payload replaced by a real, loadable one and the manifest's rows rewritten
to match, the authenticator kept) is refused on every rank before anything changed, automatic selection skips it for
the genuine one, the genuine one restores exactly, and, with no verification key, the same forgery loads (what XXH3
alone cannot tell). :func:`signed_remote`: the same on ``s3://`` (the forgery written under another name in the
bucket: the manifest object is create-only). :func:`signed_trainer`: a Trainer saving under
``ACCELERATE_TXN_SIGNING_KEY_FILE``; a forged ``checkpoint-N`` refused by an explicit resume on every rank before
anything loads, and skipped for the genuine older one by ``resume_from_checkpoint=True``."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from accelerate_txn import configure_checkpointing, latest_training_checkpoint
from accelerate_txn.core.manifest import MANIFEST, hash_file
from tests.scenarios import corruption_fsdp2
from tests.scenarios.corruption_scenarios import _build, _error, _perturb, _rank, _train, differences, rewrite_rows, snapshot

FORGED_EPOCH = 4242


def forge_scheduler(case_dir: Path) -> None:
    """Replace the scheduler state with a loadable one of another epoch; rewrite its manifest row to match."""
    path = case_dir / "scheduler.bin"
    state = torch.load(path, weights_only=True)
    state["last_epoch"] = FORGED_EPOCH
    torch.save(state, path)
    rewrite_rows(case_dir, ["scheduler.bin"])


def _builder(fsdp_version: int) -> Any:
    return _build if fsdp_version == 1 else corruption_fsdp2.build  # FSDP2: model and optimizer prepared together


def signed_restore(root: str, key: str, fsdp_version: int = 1) -> dict[str, Any]:
    root_path = Path(root)
    build = _builder(fsdp_version)
    saver = build(0)
    configure_checkpointing(saver.acc, signing_key=key)
    _train(saver, 3, seed=1)
    genuine, forged = root_path / "run" / "checkpoint_0", root_path / "run" / "checkpoint_1"
    saver.acc.save_state(str(genuine))
    saved = snapshot(saver)
    if _rank() == 0:
        shutil.copytree(genuine, forged)
        forge_scheduler(forged)
    saver.acc.wait_for_everyone()

    loader = build(7)
    configure_checkpointing(loader.acc, verification_keys=[key])
    _train(loader, 1, seed=9)
    _perturb(loader, 1)
    before = snapshot(loader)
    refused = _error(lambda: loader.acc.load_state(str(forged)))
    obs: dict[str, Any] = {"refused": refused, "changed": differences(before, snapshot(loader)),
                           "same_as_saved": [k for k in saved if k not in differences(before, saved)],
                           "latest": latest_training_checkpoint(root_path / "run", loader.acc)}
    _perturb(loader, 2)
    obs["genuine"] = _error(lambda: loader.acc.load_state(str(genuine)))
    obs["genuine_differences"] = differences(saved, snapshot(loader))

    configure_checkpointing(loader.acc, verification_keys=())  # no key: the consistent forgery passes every hash
    _perturb(loader, 3)
    obs["unkeyed"] = _error(lambda: loader.acc.load_state(str(forged)))
    obs["unkeyed_epoch"] = loader.sched.scheduler.last_epoch
    return obs


def forge_remote(genuine: str, forged: str) -> None:
    """Copy every object of ``genuine`` to ``forged`` with its scheduler payload replaced (see
    :func:`forge_scheduler`) and the manifest's row rewritten to match, the authenticator kept: what anyone who can
    write the bucket, without the key, can do."""
    from accelerate_txn.core.remote import data_dir, join
    from accelerate_txn.store.s3 import S3Store

    store = S3Store()
    manifest = json.loads(store.fs.cat_file(join(genuine, MANIFEST)))
    prefix = data_dir(manifest)
    with tempfile.TemporaryDirectory() as scratch:
        local = Path(scratch)
        for name in store.list(genuine):
            if name != MANIFEST:
                (local / name).parent.mkdir(parents=True, exist_ok=True)
                (local / name).write_bytes(store.fs.cat_file(join(genuine, name)))
        state = torch.load(local / prefix / "scheduler.bin", weights_only=True)
        state["last_epoch"] = FORGED_EPOCH
        torch.save(state, local / prefix / "scheduler.bin")
        row = manifest["files"]["scheduler.bin"]
        algorithm = next(key for key in ("xxh3_128", "sha256") if key in row)
        size, digest = hash_file(local / prefix / "scheduler.bin", algorithm)
        row.update({"size": size, algorithm: digest})
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            store.fs.pipe_file(join(forged, path.relative_to(local).as_posix()), path.read_bytes())
    store.fs.pipe_file(join(forged, MANIFEST), json.dumps(manifest, sort_keys=True, indent=1).encode())


def signed_remote(parent: str, cache: str, key: str) -> dict[str, Any]:
    """FSDP1 on ``s3://``: a signed save to ``parent/checkpoint_1``; rank 0 forges ``parent/checkpoint_2`` from it;
    the forgery is refused on every rank before anything changed, the genuine one restores exactly, and with no
    verification key the forgery loads."""
    saver = _build(0)
    configure_checkpointing(saver.acc, signing_key=key, cache_dir=f"{cache}-save")
    _train(saver, 3, seed=1)
    genuine, forged = f"{parent}/checkpoint_1", f"{parent}/checkpoint_2"
    saver.acc.save_state(genuine)
    saved = snapshot(saver)
    if _rank() == 0:
        forge_remote(genuine, forged)
    saver.acc.wait_for_everyone()

    loader = _build(7)
    configure_checkpointing(loader.acc, verification_keys=[key], cache_dir=f"{cache}-load")
    _train(loader, 1, seed=9)
    _perturb(loader, 1)
    before = snapshot(loader)
    refused = _error(lambda: loader.acc.load_state(forged))
    obs: dict[str, Any] = {"refused": refused, "changed": differences(before, snapshot(loader)),
                           "downloaded": sorted(str(p) for p in Path(f"{cache}-load").rglob("*checkpoint_2*"))}
    _perturb(loader, 2)
    obs["genuine"] = _error(lambda: loader.acc.load_state(genuine))
    obs["genuine_differences"] = differences(saved, snapshot(loader))

    configure_checkpointing(loader.acc, verification_keys=(), cache_dir=f"{cache}-unkeyed")
    _perturb(loader, 3)
    obs["unkeyed"] = _error(lambda: loader.acc.load_state(forged))
    obs["unkeyed_epoch"] = loader.sched.scheduler.last_epoch
    return obs


def signed_trainer(output_dir: str, key: str) -> dict[str, Any]:
    """A Trainer (FSDP2) saving checkpoint-2 and checkpoint-4 under ``ACCELERATE_TXN_SIGNING_KEY_FILE``; rank 0
    forges checkpoint-4 (``scheduler.pt`` replaced by a loadable one, its manifest row rewritten, the authenticator
    kept); an explicit resume from it is refused on every rank before anything loads; ``resume_from_checkpoint=True``
    resumes from checkpoint-2."""
    import torch.distributed as dist

    from accelerate_txn.core.signing import SIGNING_KEY_ENV
    from tests.scenarios.trainer_scenarios import _generators, build, train

    os.environ[SIGNING_KEY_ENV] = key
    first = build(output_dir, 4)
    first.train()
    out = Path(output_dir)
    obs: dict[str, Any] = {"authenticators": {name: json.loads((out / name / MANIFEST).read_text()).get("authenticator")
                                              for name in ("checkpoint-2", "checkpoint-4")}}
    forged = out / "checkpoint-4"
    if _rank() == 0:
        path = forged / "scheduler.pt"
        state = torch.load(path, weights_only=True)
        state["last_epoch"] = FORGED_EPOCH
        torch.save(state, path)
        rewrite_rows(forged, ["scheduler.pt"])
    dist.barrier()

    trainer = build(output_dir, 6)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    generators = _generators()
    try:
        trainer.train(resume_from_checkpoint=str(forged))
        obs["refused"] = "loaded"
    except Exception as exc:
        obs["refused"] = f"{type(exc).__name__}: {exc}"
    obs["untouched"] = (trainer.state.global_step == 0 and trainer.optimizer is None
                        and all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
                        and _generators() == generators)
    resumed = train(output_dir, True, 3)  # from checkpoint-2; saves checkpoint-3 at the end
    obs["resumed_at"] = resumed["began"]["step"]
    obs["resumed_to"] = resumed["step"]
    return obs
