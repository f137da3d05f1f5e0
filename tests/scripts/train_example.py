"""An example-style training script, written the way public example scripts are (Diffusers'
``train_unconditional.py``, Accelerate's ``examples/by_feature/checkpointing.py``): its own ``checkpoint-N``
directories every ``--checkpointing_steps``, its own rotation on the main process before each save
(``--checkpoints_total_limit``), ``--resume_from_checkpoint latest`` by the highest number, ``first_epoch`` and
``resume_step`` from the global step, and either ``accelerator.skip_first_batches`` or ``continue`` to skip what
the resumed epoch already trained. Each step draws noise from the global torch RNG (as a diffusion model's training
step does) and the data loader shuffles.

The only line that concerns accelerate-txn is ``import accelerate_txn``. The tests run it under
``python -m accelerate_txn.testing run`` (FSDP forced on, CPU), kill it, resume it, and compare.

What it writes besides checkpoints (for the tests): ``--log_dir/rank<R>.jsonl``, one line per optimizer step with
the global step and the sample indices of the batch; and, at the end, ``--output_dir/final_rank<R>.pt``, this rank's
parameters.
"""

import argparse
import json
import math
import os
import shutil

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from diffusers.optimization import get_scheduler

import accelerate_txn  # noqa: F401  (the one line added to the script)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--log_dir", default=None)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--train_batch_size", type=int, default=4)
    parser.add_argument("--num_samples", type=int, default=40)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--lr_scheduler", default="cosine")
    parser.add_argument("--lr_warmup_steps", type=int, default=2)
    parser.add_argument("--checkpointing_steps", type=int, default=3)
    parser.add_argument("--checkpoints_total_limit", type=int, default=None)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip_style", choices=["skip_first_batches", "continue"], default="skip_first_batches")
    parser.add_argument("--save_on_main_process_only", action="store_true",
                        help="the common FSDP mistake of Diffusers' examples: save_state under is_main_process")
    parser.add_argument("--width", type=int, default=16)
    return parser.parse_args()


class Denoiser(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                       torch.nn.Linear(2 * width, width))

    def forward(self, x, t):
        return self.net(x * (1.0 + t[:, None]))


class Samples(torch.utils.data.Dataset):
    def __init__(self, count, width):
        self.data = torch.randn(count, width, generator=torch.Generator().manual_seed(1234))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return {"index": index, "x": self.data[index]}


def main():
    args = parse_args()
    project_config = ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs"))
    accelerator = Accelerator(gradient_accumulation_steps=1, project_config=project_config)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    set_seed(args.seed)
    model = Denoiser(args.width)
    dataset = Samples(args.num_samples, args.width)
    train_dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.train_batch_size, shuffle=True)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader))
    max_train_steps = args.num_epochs * num_update_steps_per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    # As Diffusers' examples: the prepared scheduler steps once per process at every optimizer step.
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
                                 num_training_steps=max_train_steps * accelerator.num_processes)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader))

    global_step = 0
    first_epoch = 0
    resume_step = 0
    if args.resume_from_checkpoint:
        if args.resume_from_checkpoint != "latest":
            path = os.path.basename(args.resume_from_checkpoint)
        else:
            dirs = os.listdir(args.output_dir) if os.path.isdir(args.output_dir) else []
            dirs = [d for d in dirs if d.startswith("checkpoint")]
            dirs = sorted(dirs, key=lambda x: int(x.split("-")[1]))
            path = dirs[-1] if len(dirs) > 0 else None
        if path is None:
            accelerator.print(f"Checkpoint '{args.resume_from_checkpoint}' does not exist. Starting a new training run.")
            args.resume_from_checkpoint = None
        else:
            accelerator.print(f"Resuming from checkpoint {path}")
            accelerator.load_state(os.path.join(args.output_dir, path))
            global_step = int(path.split("-")[1])
            first_epoch = global_step // num_update_steps_per_epoch
            resume_step = global_step % num_update_steps_per_epoch

    log = None
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        log = open(os.path.join(args.log_dir, f"rank{accelerator.process_index}.jsonl"), "a")
    for epoch in range(first_epoch, args.num_epochs):
        model.train()
        active = train_dataloader
        if args.resume_from_checkpoint and epoch == first_epoch and args.skip_style == "skip_first_batches":
            active = accelerator.skip_first_batches(train_dataloader, resume_step)
        for step, batch in enumerate(active):
            if (args.resume_from_checkpoint and epoch == first_epoch and args.skip_style == "continue"
                    and step < resume_step):
                continue
            clean = batch["x"]
            noise = torch.randn(clean.shape)
            timesteps = torch.randint(0, 1000, (clean.shape[0],)).float() / 1000.0
            prediction = model(clean + noise * timesteps[:, None], timesteps)
            loss = torch.nn.functional.mse_loss(prediction, noise)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if log is not None:
                log.write(json.dumps({"step": global_step, "epoch": epoch,
                                      "indices": batch["index"].tolist()}) + "\n")
                log.flush()
            if global_step % args.checkpointing_steps == 0:
                # Diffusers' examples rotate on the main process, then save (there: on the main process only).
                if accelerator.is_main_process and args.checkpoints_total_limit is not None:
                    checkpoints = [d for d in os.listdir(args.output_dir) if d.startswith("checkpoint")]
                    checkpoints = sorted(checkpoints, key=lambda x: int(x.split("-")[1]))
                    if len(checkpoints) >= args.checkpoints_total_limit:
                        for removing in checkpoints[: len(checkpoints) - args.checkpoints_total_limit + 1]:
                            shutil.rmtree(os.path.join(args.output_dir, removing))
                if accelerator.is_main_process or not args.save_on_main_process_only:
                    save_path = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                    accelerator.save_state(save_path)
    accelerator.wait_for_everyone()
    state = {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()  # FSDP2: the local shard
             for name, p in model.named_parameters()}
    torch.save(state, os.path.join(args.output_dir, f"final_rank{accelerator.process_index}.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
