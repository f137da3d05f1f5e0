"""Rank functions of tests/trainer/test_trainer.py: a real transformers Trainer (a tiny Llama built from a config, no
download) training with FSDP on CPU (gloo) through ``accelerate_txn.testing.force_fsdp_trainer``.

* :func:`train` runs under ``accelerate_txn.testing.launch`` and returns what the test compares;
* :func:`main` is the entry of a crash-harness job (``tests.scenarios.crash_harness.Job``: separate interpreters the test
  kills), which writes what it observed under the job's ``obs`` directory;
* :func:`refuse_each` damages one file class at a time and checks that the explicit resume refuses it on every rank
  before anything is loaded, in one process group; :func:`refuse_other_optimizer` resumes with an optimizer that
  does not match the checkpoint's.

Kill points inside Trainer's own save (:data:`NATIVE_POINTS`). The library wraps ``Trainer._save_checkpoint`` as one
unit, so none of its code runs between Trainer's own writes; to kill a rank there, the Trainer of these scenarios
(:func:`_trainer_class`) calls ``accelerate_txn.core.faults.point`` between them, through the same
``ACCELERATE_TXN_KILL_AT`` variable as the library's points. Test instrumentation only: the library never names them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: Instants inside Trainer's native save, in order: the model's DCP shards written; the optimizer's shards and
#: ``scheduler.pt`` written; every rank's ``rng_state_{rank}.pth`` written (``trainer_state.json`` not yet).
NATIVE_POINTS = ("trainer:after-model", "trainer:after-optimizer", "trainer:after-rng")


def _trainer_class() -> type:
    from transformers import Trainer

    from accelerate_txn.core import faults

    class KillPointTrainer(Trainer):
        """Trainer with :data:`NATIVE_POINTS` between its own writes (no-ops unless a kill is armed)."""

        def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
            faults.point("trainer:after-model")
            super()._save_optimizer_and_scheduler(output_dir)
            faults.point("trainer:after-optimizer")

        def _save_rng_state(self, output_dir: str) -> None:
            super()._save_rng_state(output_dir)
            faults.point("trainer:after-rng")

    return KillPointTrainer


def tiny_llama(samples: int) -> tuple[Any, list[dict[str, Any]]]:
    """A tiny Llama built from a config (no download) and ``samples`` token sequences: the same on every run."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    return model, [{"input_ids": ids, "labels": ids}
                   for ids in torch.randint(0, 128, (samples, 16), generator=generator)]


def build(output_dir: str, max_steps: int, fsdp_version: int = 2, save_total_limit: int | None = None,
          state_dict_type: str = "SHARDED_STATE_DICT") -> Any:
    """This rank's Trainer (FSDP forced on with ``state_dict_type``, saving every 2 steps), its model and data the same
    on every run."""
    from transformers import TrainingArguments
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import accelerate_txn  # noqa: F401  (the import protects Trainer checkpoints)
    from accelerate_txn.testing import force_fsdp_trainer

    model, data = tiny_llama(64)
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=4, max_steps=max_steps,
                             save_strategy="steps", save_steps=2, save_total_limit=save_total_limit, logging_steps=1,
                             report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True)
    return force_fsdp_trainer(_trainer_class()(model=model, args=args, train_dataset=data), fsdp_version=fsdp_version,
                              auto_wrap=LlamaDecoderLayer, state_dict_type=state_dict_type)


def train(output_dir: str, resume: Any, max_steps: int, fsdp_version: int = 2,
          save_total_limit: int | None = None, began_file: str | None = None,
          saved_file: str | None = None, state_dict_type: str = "SHARDED_STATE_DICT") -> dict[str, Any]:
    """Train to ``max_steps`` saving every 2 steps (``resume``: ``train(resume_from_checkpoint=...)``); returns this
    rank's local parameter shards, its optimizer state (at the end, when training began and at each save), the global
    step when training began and at the end, the output directory's entries, and the seconds from the start of the
    training loop to its end (``loop_seconds``: what the random-instant kill draws its window from). For a job that is
    killed later: ``began_file`` is written (``torch.save``) when training begins; ``saved_file`` (JSON, replaced
    atomically) names the global step of the last save that returned."""
    import time

    import torch
    from transformers import TrainerCallback

    from accelerate_txn.fsdp import dcp_writer

    trainer = build(output_dir, max_steps, fsdp_version, save_total_limit, state_dict_type)
    began: dict[str, Any] = {}
    saved: dict[int, Any] = {}

    class Record(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # after a restore
            began.update(step=state.global_step, optimizer=optimizer_state(trainer.optimizer), at=time.monotonic())
            if began_file:
                torch.save(began, began_file)

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # what each save wrote
            saved[state.global_step] = optimizer_state(trainer.optimizer)
            if saved_file:  # after _save_checkpoint returned: published and rotated
                Path(saved_file + ".tmp").write_text(json.dumps({"returned": state.global_step}))
                os.replace(saved_file + ".tmp", saved_file)

    trainer.add_callback(Record())
    trainer.train(resume_from_checkpoint=resume)
    loop_seconds = time.monotonic() - began["at"]
    local = [getattr(p, "_local_tensor", p).detach().clone() for p in trainer.model.parameters()]
    return {"weights": local, "step": trainer.state.global_step, "entries": sorted(os.listdir(output_dir)),
            "best": trainer.state.best_model_checkpoint, "optimizer": optimizer_state(trainer.optimizer),
            "began": began, "optimizer_at_save": saved, "loop_seconds": loop_seconds,
            "direct_writes": dcp_writer.DirectWriteCounts.direct}


def train_keeping_best(output_dir: str, max_steps: int) -> dict[str, Any]:
    """Train with ``save_total_limit=1`` and checkpoint-2 recorded as the best model (``state.best_global_step``, what
    Trainer's metric comparison sets; no evaluation needed), so the run ends with Trainer's end-of-training removal of
    every checkpoint but the best. Returns the global step, the best checkpoint and the output directory's entries."""
    from transformers import TrainerCallback

    trainer = build(output_dir, max_steps, save_total_limit=1)

    class BestIsTwo(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # before that step's save
            if state.global_step >= 2:
                state.best_global_step = 2

    trainer.add_callback(BestIsTwo())
    trainer.train()
    return {"step": trainer.state.global_step, "best": trainer.state.best_model_checkpoint,
            "entries": sorted(os.listdir(output_dir))}


def optimizer_state(optimizer: Any) -> list[tuple[int, str, Any]]:
    """This rank's optimizer state as ``(parameter position, key, value)`` in parameter order (tensors: their local
    shard, cloned)."""
    raw = getattr(optimizer, "optimizer", optimizer)
    parameters = [p for group in raw.param_groups for p in group["params"]]
    rows = []
    for position, parameter in enumerate(parameters):
        for key, value in sorted(raw.state.get(parameter, {}).items()):
            value = getattr(value, "_local_tensor", value)
            rows.append((position, key, value.detach().clone() if hasattr(value, "detach") else value))
    return rows


def refuse_each(output_dir: str, cases: dict[str, str]) -> dict[str, Any]:
    """One Trainer tries ``train(resume_from_checkpoint=path)`` for each damaged checkpoint of ``cases`` (name ->
    path) in turn; returns this rank's error per case (``type: message``, or ``"loaded"`` if none was raised) and
    whether the live model, optimizer, Trainer state and this process's generators (Python, NumPy, torch) were
    untouched after every attempt."""
    import torch

    trainer = build(output_dir, 6)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    generators = _generators()
    errors: dict[str, str] = {}
    untouched: dict[str, bool] = {}
    for name, path in cases.items():
        try:
            trainer.train(resume_from_checkpoint=path)
            errors[name] = "loaded"
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
        untouched[name] = (trainer.state.global_step == 0 and trainer.optimizer is None
                           and all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
                           and _generators() == generators)
    return {"errors": errors, "untouched": untouched}


def _generators() -> tuple[Any, ...]:
    """This process's Python, NumPy and torch CPU generator states, comparable with ``==``."""
    import random

    import numpy as np
    import torch

    kind, keys, position, has_gauss, gauss = np.random.get_state()
    return (random.getstate(), (kind, keys.tolist(), position, has_gauss, gauss), torch.get_rng_state().tolist())


def refuse_other_optimizer(output_dir: str, checkpoint: str) -> dict[str, Any]:
    """An FSDP2 Trainer whose optimizer trains fewer parameters than the one that saved ``checkpoint`` (the embedding
    frozen) resumes from it; returns this rank's error (``type: message``, or ``"loaded"``) and whether the model is
    untouched afterwards (every parameter, gathered whole, equal to the freshly built model's)."""
    import torch

    trainer = build(output_dir, 6)
    trainer.model.model.embed_tokens.weight.requires_grad_(False)
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
        error = "loaded"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    fresh = dict(tiny_llama(0)[0].named_parameters())
    whole = {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in trainer.model.named_parameters()}
    untouched = set(whole) == set(fresh) and all(torch.equal(whole[name].detach(), fresh[name].detach())
                                                 for name in fresh)
    return {"error": error, "untouched": untouched}


def crash_entry(spec_path: str, run: Any) -> None:
    """Entry of one rank of a crash-harness job: reads ``spec``, arms ``spec["kill"]`` (``ACCELERATE_TXN_KILL_AT``;
    none: the harness kills the job at an instant of its own), calls ``run(spec, obs, rank)`` (a result with ``step``
    and ``entries``) and writes ``obs/rank{R}.pt`` and ``obs/rank{R}.json`` with it; then, with ``spec["hold"]``,
    waits to be killed (the instant the harness drew may come after a fast run's end: the kill then lands after
    everything was saved), else ends as ``tests.scenarios.crash_scenarios.main`` does, without the interpreter's teardown once
    everything is written."""
    import torch

    from tests.scenarios.crash_scenarios import main as crash_main

    def scenario(spec: dict[str, Any]) -> None:
        if spec.get("kill"):
            from accelerate_txn.core.faults import KILL_ENV

            os.environ[KILL_ENV] = spec["kill"]
        obs = Path(spec["obs"])
        obs.mkdir(parents=True, exist_ok=True)
        rank = os.environ["RANK"]
        result = run(spec, obs, rank)
        torch.save(result, obs / f"rank{rank}.pt")
        (obs / f"rank{rank}.json").write_text(json.dumps({"step": result["step"], "entries": result["entries"]}))
        if spec.get("hold"):  # a job the harness kills at an instant of its own: alive until then, however fast
            import threading

            threading.Event().wait()

    crash_main(spec_path, scenario)


def main(spec_path: str) -> None:
    """Entry of one rank (:func:`crash_entry`): ``spec`` = ``{"output_dir", "resume", "max_steps", "fsdp_version",
    "save_total_limit", "kill", "obs"}`` and optionally ``"state_dict_type"``; trains, writing
    ``obs/rank{R}.began.pt`` when training begins and ``obs/rank{R}.saved.json`` after each save returns."""
    crash_entry(spec_path, lambda spec, obs, rank: train(
        spec["output_dir"], spec.get("resume"), spec["max_steps"], spec.get("fsdp_version", 1),
        spec.get("save_total_limit"), began_file=str(obs / f"rank{rank}.began.pt"),
        saved_file=str(obs / f"rank{rank}.saved.json"),
        state_dict_type=spec.get("state_dict_type", "SHARDED_STATE_DICT")))


def train_reporting_the_error(output_dir: str, max_steps: int, release: str) -> dict[str, Any]:
    """With ``release`` first on ``sys.path`` (a changed transformers, tests/support/overlay.py: the ranks are spawned with
    the parent's path), train to ``max_steps`` saving every 2 steps; this rank's error (type and message, ``None`` if
    none), the RNG files of ``checkpoint-2`` if published, and the output directory's entries, hidden ones included."""
    import sys

    assert "transformers" not in sys.modules
    sys.path.insert(0, release)
    import transformers.trainer

    assert transformers.trainer.__file__.startswith(release)
    try:
        train(output_dir, None, max_steps)
        error = None
    except Exception as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    return {"error": error, "entries": sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []}


def protection_by_state_dict_type(output_dir: str) -> dict[str, Any]:
    """``accelerate_txn.protection`` of an FSDP1 Trainer with each state dict type (no training)."""
    import accelerate_txn

    found = {}
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT", "LOCAL_STATE_DICT"):
        answer = accelerate_txn.protection(build(f"{output_dir}/{kind}", 2, fsdp_version=1, state_dict_type=kind))
        found[kind] = {"protected": answer.protected, "reason": answer.reason, "fix": answer.fix}
    return found
