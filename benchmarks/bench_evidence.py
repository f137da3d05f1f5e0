"""What the evidence gate costs: checking the installed releases' private pieces against accelerate_txn/evidence.json.

Each sample is a fresh interpreter that imports what a training job has imported before its first checkpoint
(torch's FSDP, ``accelerate.accelerator``, ``transformers.trainer``, then ``accelerate_txn``), and times:

* ``first``: the first check of every path (Accelerate FSDP1, FSDP2, one-process/DDP, and the Trainer's pieces
  with the FSDP1 path): each piece's source is read and parsed, its value computed, compared with the evidence;
* ``again``: the same checks once more (cached for the process: what every later dispatch costs).

``import accelerate_txn`` itself is not changed by the gate (nothing of ``accelerate_txn.compat`` is imported then:
benchmarks/bench_import.py).

    .venv/bin/python benchmarks/bench_evidence.py --repeats 10 [--json benchmarks/results/evidence.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SAMPLE = """\
import json, sys, time
sys.path.insert(0, {root!r})
import torch.distributed.fsdp, accelerate.accelerator, transformers.trainer
import accelerate_txn
from accelerate_txn.runtime.versions import PATHS, differing
from accelerate_txn.trainer.versions import differing as trainer_differing
def check():
    found = [differing(path) for path in PATHS] + [trainer_differing(None, "fsdp1")]
    assert not any(found), found
start = time.perf_counter(); check(); first = time.perf_counter() - start
start = time.perf_counter(); check(); again = time.perf_counter() - start
from accelerate_txn.runtime.versions import PATHS as P
from accelerate_txn.trainer.internals import trainer_pieces
pieces = len(set(piece for path in P.values() for piece in path) | set(trainer_pieces()))
print(json.dumps({{"first_ms": first * 1e3, "again_ms": again * 1e3, "pieces": pieces}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    samples = []
    for _ in range(args.repeats):
        done = subprocess.run([sys.executable, "-c", _SAMPLE.format(root=str(ROOT))], capture_output=True,
                              text=True, check=True, timeout=300)
        samples.append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = {
        "repeats": args.repeats,
        "pieces": samples[0]["pieces"],
        "first_ms_median": statistics.median(s["first_ms"] for s in samples),
        "first_ms_range": [min(s["first_ms"] for s in samples), max(s["first_ms"] for s in samples)],
        "again_ms_median": statistics.median(s["again_ms"] for s in samples),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
