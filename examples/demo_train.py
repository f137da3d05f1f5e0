"""One rank of the demo's training job: FSDP1 on CPU (gloo), checkpointed with accelerate-txn.

Started by ``examples/demo.py`` once per job, with the environment torchrun would give (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``). Modes:

* ``reference``: train ``--steps`` steps from scratch and never save: what the training computes when nothing
  interrupts it (a save that changed the training would show as a difference);
* ``crash``: the same steps with ``save_state()`` every ``--save-every`` steps; at save number ``--crash-at-save``
  a save pre-hook on rank 0 writes ``--marker`` and blocks until it is killed, so the save stays in progress until
  the demo kills the job;
* ``resume``: ``load_state()`` with no argument (the newest complete checkpoint), then train on to ``--steps``.

Every mode writes ``--result`` with this rank's final parameter shards, optimizer state, scheduler state,
RNG states, the loss of every step it trained and what it observed about its saves.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

BATCH = 8
WIDTH = 16
OUTPUTS = 5


def warmup(step: int) -> float:
    """Linear learning-rate warm-up over 4 steps (a plain function: the checkpoint descriptor records it)."""
    return min(1.0, (step + 1) / 4)


def parse_args() -> argparse.Namespace:
    """Command-line options of one rank."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("reference", "crash", "resume"), required=True)
    parser.add_argument("--project", type=Path, required=True, help="ProjectConfiguration.project_dir")
    parser.add_argument("--result", type=Path, required=True, help="file this rank writes its final state into")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--crash-at-save", type=int, default=3, help="crash mode: the save that never finishes")
    parser.add_argument("--marker", type=Path, help="crash mode: written by rank 0 once the save is in progress")
    return parser.parse_args()


def local_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's parameter shards and optimizer state, keyed by parameter name."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    raw = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): name for name, p in model.named_parameters()}
    optim = {names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for p, s in raw.state.items() if s}
    return {"params": params, "optim": optim}


def blocking_hook(rank: int, marker: Path | None, crash_at: int) -> Any:
    """A save pre-hook that, at save number ``crash_at``, makes rank 0 announce itself and block until killed."""
    calls = {"n": 0}

    def hook(models: Any, weights: Any, output_dir: str) -> None:
        calls["n"] += 1
        if rank != 0 or calls["n"] != crash_at or marker is None:
            return
        info = {"pid": os.getpid(), "save_dir": output_dir, "save_number": calls["n"]}
        partial = marker.with_name(marker.name + ".tmp")
        partial.write_text(json.dumps(info))
        os.replace(partial, marker)  # the demo never sees a half-written marker
        # The save is now in progress (staging exists, no manifest): wait for SIGKILL. Give up only if the demo
        # itself is gone, so an interrupted demo never leaves this rank blocked forever.
        parent = os.getppid()
        while os.getppid() == parent:
            time.sleep(0.1)
        os._exit(3)

    return hook


def main() -> None:
    """Build the FSDP job, optionally resume, train, save, and write this rank's result file."""
    args = parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(name)s %(levelname)s: %(message)s")

    import accelerate_txn  # importing it protects Accelerator.save_state/load_state
    from accelerate_txn import register_checkpoint_state
    from accelerate_txn.testing import TinyModel, fsdp_accelerator

    accelerator = fsdp_accelerator(project_dir=args.project, automatic_checkpoint_naming=True, total_limit=2)
    torch.manual_seed(0)  # identical initial weights on every rank (no sync_module_states)
    model = accelerator.prepare(TinyModel(width=WIDTH, odd_rows=OUTPUTS))  # FSDP1: optimizer on the wrapped model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    torch.manual_seed(1000 + rank)  # dropout masks differ per rank: the RNG restore matters
    data = torch.Generator().manual_seed(2000 + rank)  # this rank's data stream, one draw per step
    progress = {"step": 0}
    register_checkpoint_state(accelerator, {"data": data}, progress)
    # Registered on every rank (ranks must agree on the hooks); it only ever blocks on rank 0.
    accelerator.register_save_state_pre_hook(
        blocking_hook(rank, args.marker, args.crash_at_save if args.mode == "crash" else -1))

    result: dict[str, Any] = {"mode": args.mode, "rank": rank, "losses": {}, "saves": []}
    loaded: list[str] = []  # load_state() returns None, as native Accelerate: a load hook sees the directory
    accelerator.register_load_state_pre_hook(lambda models, input_dir: loaded.append(input_dir))
    if args.mode == "resume":
        accelerator.load_state()  # no argument: automatic naming selects the newest complete checkpoint
        restored = loaded[-1]
        result["resumed_from"] = str(restored)
        result["start_step"] = progress["step"]
        result["next_save_iteration"] = accelerator.save_iteration
        if accelerator.is_main_process:
            print(f"resumed from {Path(restored).name} at step {progress['step']}", flush=True)

    model.train()
    while progress["step"] < args.steps:
        inputs = torch.randn(BATCH, WIDTH, generator=data)
        targets = torch.randn(BATCH, OUTPUTS, generator=data)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)  # the protected save refuses pending gradients
        progress["step"] += 1
        result["losses"][progress["step"]] = loss.item()
        if args.mode != "reference" and progress["step"] % args.save_every == 0:
            saved = accelerator.save_state()
            checkpoints = Path(saved).parent
            result["saves"].append({
                "step": progress["step"],
                "path": str(saved),
                "manifest": (Path(saved) / accelerate_txn.MANIFEST).is_file(),
                "listing": sorted(p.name for p in checkpoints.iterdir() if p.name != ".accelerate-txn.lock"),
            })
            if accelerator.is_main_process:
                print(f"step {progress['step']}: saved {Path(saved).name}", flush=True)

    result.update(local_state(model, optimizer))
    result["scheduler"] = scheduler.state_dict()
    result["torch_rng"] = torch.get_rng_state()
    result["data_rng"] = data.get_state()
    result["final_step"] = progress["step"]
    args.result.parent.mkdir(parents=True, exist_ok=True)
    partial = args.result.with_name(args.result.name + ".tmp")
    torch.save(result, partial)
    os.replace(partial, args.result)
    accelerator.wait_for_everyone()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def end_without_teardown(finished: list[bool]) -> None:
    """The last ``atexit`` handler: once ``main`` finished (result written, process group destroyed, every other exit
    handler run), end without the interpreter's teardown, where PyTorch's gloo worker threads can abort a process that
    finished ("terminate called without an active exception", SIGABRT, at random: pytorch/pytorch#179291). A run
    that raised ends as usual."""
    if finished:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    finished: list[bool] = []
    atexit.register(end_without_teardown, finished)  # first registered, so it runs after every other handler
    main()
    finished.append(True)
