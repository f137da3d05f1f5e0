"""Plots of the checkpoint benchmark's JSON (``bench_checkpoint.py --json``), for docs/benchmarks.md.

Writes ``checkpoint_time.png`` (save and load wall time, native vs protected, by model size) and
``restore_memory.png`` (peak resident-memory growth of each restore next to the rank's own optimizer shard).

    .venv/bin/python benchmarks/plots.py benchmarks/results/checkpoint.json --out docs/img
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = json.loads(path.read_text())
    return sorted(rows, key=lambda row: row["million"])


def plot(results: Path, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = _rows(results)
    sizes = [f"{row['ranks'][0]['parameters'] / 1e6:.0f}M" for row in rows]
    out.mkdir(parents=True, exist_ok=True)
    written = []

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for axis, phase in zip(axes, ("save", "load")):
        native = [row["ranks"][0]["times"][f"{phase}_native"] for row in rows]
        protected = [row["ranks"][0]["times"][f"{phase}_protected"] for row in rows]
        positions = range(len(rows))
        axis.bar([p - 0.2 for p in positions], native, 0.4, label="native Accelerate")
        axis.bar([p + 0.2 for p in positions], protected, 0.4, label="accelerate-txn")
        for position, row in zip(positions, rows):
            ratio = row["ranks"][0].get("ratios", {}).get(phase)
            if ratio is not None:
                axis.annotate(f"{ratio:.2f}x", (position + 0.2, protected[position]), ha="center", va="bottom",
                              fontsize=8)
        axis.set_xticks(list(positions), sizes)
        axis.set_ylabel("seconds (median)")
        axis.set_title(f"{phase} ({'stepped optimizer' if phase == 'load' else 'FSDP1 sharded'})")
        axis.legend(fontsize=8)
    figure.suptitle("Checkpoint time, 2 ranks, gloo, CPU (ratio: median of alternating pairs)", fontsize=10)
    figure.tight_layout()
    written.append(out / "checkpoint_time.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    keys = (("load_native", "native, stepped"), ("load_protected", "protected, stepped"),
            ("load_fresh_protected", "protected, fresh optimizer"))
    positions = range(len(rows))
    for offset, (key, label) in zip((-0.27, 0.0, 0.27), keys):
        ratios = [max(rank["growth"][key] / rank["shard_bytes"] for rank in row["ranks"]) for row in rows]
        axis.bar([p + offset for p in positions], ratios, 0.27, label=label)
    axis.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axis.set_xticks(list(positions), sizes)
    axis.set_ylabel("peak RSS growth / own optimizer shard")
    axis.set_title("Restore memory (worst rank)", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    written.append(out / "restore_memory.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    for path in plot(args.results, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
