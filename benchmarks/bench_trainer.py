"""A transformers Trainer checkpoint save with and without accelerate-txn, in one invocation.

2 ranks, gloo, CPU, FSDP1 ``SHARDED_STATE_DICT`` forced onto the Trainer (``accelerate_txn.testing.force_fsdp_trainer``),
a Llama built from a config (no download; ``--size`` picks its width), AdamW after one training step. Each repeat
calls ``Trainer._save_checkpoint`` (what Trainer calls every ``save_steps``) twice, native (``ACCELERATE_TXN_PATCHES=0``
for that call, on every rank) and protected (staging, every file hashed with XXH3-128 and fsynced, manifest, rename),
in alternating order, each into its own ``checkpoint-N``. Reports rank 0's per-mode median wall time and the median of
the per-pair ratios protected/native (target: at most 1.10x).

    .venv/bin/python benchmarks/bench_trainer.py --size 50 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: ``--size`` (millions of parameters, about) -> (hidden size, layers); vocabulary 8192, MLP 4x hidden.
SHAPES = {10: (256, 8), 50: (512, 10), 200: (1024, 10)}


def worker(size: int, repeats: int, directory: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import accelerate_txn  # noqa: F401  (the import wraps Trainer)
    from accelerate_txn.testing import force_fsdp_trainer

    hidden, layers = SHAPES[size]
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=8192, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 8192, (8, 16))]
    args = TrainingArguments(output_dir=directory, use_cpu=True, per_device_train_batch_size=2, max_steps=1,
                             save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = force_fsdp_trainer(Trainer(model=model, args=args, train_dataset=data), fsdp_version=1,
                                 auto_wrap=LlamaDecoderLayer)
    trainer.train()  # one step: the optimizer has state, the model is wrapped
    times: dict[str, list[float]] = {"native": [], "protected": []}
    step = 100
    for repeat in range(repeats):
        for mode in (("native", "protected") if repeat % 2 == 0 else ("protected", "native")):
            step += 1
            trainer.state.global_step = step
            os.environ["ACCELERATE_TXN_PATCHES"] = "0" if mode == "native" else "1"
            dist.barrier()
            start = time.perf_counter()
            trainer._save_checkpoint(trainer.model_wrapped, None)
            dist.barrier()
            times[mode].append(time.perf_counter() - start)
            if dist.get_rank() == 0:
                shutil.rmtree(Path(directory) / f"checkpoint-{step}")  # keep the disk's state alike for every save
            dist.barrier()
    os.environ.pop("ACCELERATE_TXN_PATCHES", None)
    return {"parameters": parameters, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, choices=sorted(SHAPES), default=50,
                        help="model size in millions of parameters (about)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    options = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ranks import benchmarks.bench_trainer

    from accelerate_txn.testing import launch

    with tempfile.TemporaryDirectory(prefix="bench-trainer-", dir=".") as directory:
        results = launch("benchmarks.bench_trainer:worker", 2, args=(options.size, options.repeats, directory),
                         timeout=3600)
    times = results[0]["times"]
    ratios = [p / n for p, n in zip(times["protected"], times["native"])]
    summary = {"parameters": results[0]["parameters"], "native_s": statistics.median(times["native"]),
               "protected_s": statistics.median(times["protected"]), "ratio": statistics.median(ratios),
               "times": times}
    print(f"| {summary['parameters'] / 1e6:.0f}M | {summary['native_s']:.2f} | {summary['protected_s']:.2f} | "
          f"{summary['ratio']:.2f} |")
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
