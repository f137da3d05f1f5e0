"""Plots of the benchmarks' JSON for docs/benchmarks.md, with the targets the text names drawn as labelled lines.

Each JSON file given is recognised by its contents and named after its file stem ``S``:

* ``bench_checkpoint.py --json`` (FSDP1 or FSDP2): ``S_time.png``, save and load time of the protected path in
  multiples of native Accelerate's (median of the alternating pairs' ratios, rank 0; target lines: save at most
  0.6x, load at most 0.5x native), and ``S_memory.png``, each restore's peak resident-memory growth in multiples
  of the rank's own optimizer shard (worst rank; target line: at most 1.25x for the protected restores);
* ``bench_async.py --json``: ``S.png``, the asynchronous save's blocking time and time to publication in
  multiples of a native synchronous save (targets: at most 0.05x and 1.15x), by default and with reused staging
  memory, and the training step time during the background write in multiples of an idle step (target: at most
  1.10x): three panels stacked, as wide as the docs page (``PAGE_WIDTH_PX``), so the text is shown at its size.

The x axis is the model size in million parameters (``parameters`` of rank 0, global).

    .venv/bin/python benchmarks/plots.py benchmarks/results/checkpoint.json --out docs/img
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SIZE_LABEL = "model size (million parameters)"
TIME_LABEL = "time (x native)"
# The targets docs/benchmarks.md names, as (value, label) per quantity.
CHECKPOINT_TARGETS = {"save": (0.6, "target: save at most 0.6x native"),
                      "load": (0.5, "target: load at most 0.5x native")}
MEMORY_TARGET = (1.25, "target: protected restore at most 1.25x the shard")
ASYNC_TARGETS = {"blocking": (0.05, "target: blocking at most 0.05x native"),
                 "total": (1.15, "target: publication at most 1.15x native"),
                 "step": (1.10, "target: step at most 1.10x idle")}
#: Resolution of the PNGs, and the width (pixels) of the docs page's content column, at which a figure is shown
#: unscaled: a wider figure is shrunk to it, and its text with it.
DPI = 100
PAGE_WIDTH_PX = 720
FONT = {"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "xtick.labelsize": 11, "ytick.labelsize": 10,
        "legend.fontsize": 10, "figure.titlesize": 13}
_TARGET_STYLE = {"color": "#c0392b", "linestyle": "--", "linewidth": 1.6}
_REFERENCE_STYLE = {"color": "#555555", "linestyle": "-", "linewidth": 1.0}
_COLOURS = ("#4c72b0", "#dd8452", "#55a868")


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of one result file (one per model size), smallest model first."""
    return load_rows_from(json.loads(path.read_text()), str(path))


def load_rows_from(rows: Any, source: str = "result") -> list[dict[str, Any]]:
    """The rows (one per model size) of a decoded result, checked and sorted, smallest model first."""
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) and row.get("ranks") and "million" in row
                                                         for row in rows):
        raise ValueError(f"{source}: not a bench_checkpoint.py or bench_async.py --json result (a list of rows)")
    return sorted(rows, key=lambda row: row["million"])


def kind(rows: list[dict[str, Any]]) -> str:
    """``"checkpoint"`` or ``"async"``, from the keys the benchmarks write."""
    rank = rows[0]["ranks"][0]
    if "growth" in rank and "shard_bytes" in rank:
        return "checkpoint"
    if "steps_during" in rank:
        return "async"
    raise ValueError(f"unknown benchmark result (rank keys: {sorted(rank)})")


def _sizes(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{row['ranks'][0]['parameters'] / 1e6:.0f}" for row in rows]


def _target(axis: Axes, value: float, label: str) -> None:
    """A labelled horizontal line: in the legend, and its value written at the right end of the line."""
    axis.axhline(value, label=label, zorder=3, **_TARGET_STYLE)
    axis.annotate(f"{value:.2f}x", (1.0, value), xycoords=("axes fraction", "data"), xytext=(3, 0),
                  textcoords="offset points", va="center", ha="left", color=_TARGET_STYLE["color"], fontsize=10)


def _bars(axis: Axes, series: list[tuple[str, list[float | None]]], labels: list[list[str]] | None = None) -> None:
    """Grouped bars (one group per model size), each labelled above with its value (``n/a`` where missing), on a
    white ground that a reference or target line passes behind."""
    count = len(series)
    width = 0.8 / count
    for index, (name, values) in enumerate(series):
        positions = [p + (index - (count - 1) / 2) * width for p in range(len(values))]
        heights = [0.0 if value is None else value for value in values]
        axis.bar(positions, heights, width * 0.92, label=name, color=_COLOURS[index % len(_COLOURS)], zorder=2)
        for bar_index, (position, value) in enumerate(zip(positions, values)):
            text = "n/a" if value is None else f"{value:.2f}x"
            if labels is not None and value is not None:
                text += labels[index][bar_index]
            axis.annotate(text, (position, 0.0 if value is None else value), xytext=(0, 3),
                          textcoords="offset points", ha="center", va="bottom", fontsize=10, zorder=5,
                          bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                                "alpha": 0.85})


def _axes(axis: Axes, sizes: list[str], ylabel: str, highest: float) -> None:
    """Labels both axes; the y axis reaches above the highest bar or line."""
    axis.set_xticks(list(range(len(sizes))), sizes)
    axis.set_xlabel(SIZE_LABEL)
    axis.set_ylabel(ylabel)
    axis.set_ylim(0, highest * 1.3)  # room for the labels above the highest bar
    axis.grid(axis="y", alpha=0.3, zorder=0)


def _legend(axis: Axes) -> None:
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=1, frameon=False)


def _setup(rows: list[dict[str, Any]]) -> str:
    rank = rows[0]["ranks"][0]
    fsdp = rank.get("fsdp_version", rows[0].get("fsdp_version", 1))
    ranks = rows[0].get("world_size", len(rows[0]["ranks"]))
    optimizer = rank.get("optimizer")
    return f"FSDP{fsdp}, {ranks} rank{'s' if ranks != 1 else ''}" + (f", {optimizer}" if optimizer else "")


def checkpoint_figures(rows: list[dict[str, Any]]) -> dict[str, Figure]:
    """``{"time": ..., "memory": ...}`` figures of one ``bench_checkpoint.py --json`` result."""
    import matplotlib.pyplot as plt

    sizes = _sizes(rows)
    setup = _setup(rows)
    figures = {}
    with plt.rc_context(FONT):
        figure, axes = plt.subplots(1, 2, figsize=(10, 5.6), layout="constrained")
        for axis, phase in zip(axes, ("save", "load")):
            times = [row["ranks"][0]["times"] for row in rows]
            ratios = [row["ranks"][0].get("ratios", {}).get(phase) for row in rows]
            seconds = [f"\n{t[f'{phase}_protected']:.2f} s vs {t[f'{phase}_native']:.2f} s" for t in times]
            value, label = CHECKPOINT_TARGETS[phase]
            _axes(axis, sizes, TIME_LABEL, max([1.0, value, *(r for r in ratios if r is not None)]))
            _bars(axis, [("accelerate-txn (protected)", ratios)], [seconds])
            axis.axhline(1.0, label="native Accelerate (1.0x)", zorder=1.5, **_REFERENCE_STYLE)
            _target(axis, value, label)
            axis.set_title(phase + (" (into a stepped optimizer)" if phase == "load" else ""))
            _legend(axis)
        figure.suptitle(f"Checkpoint time, protected vs native Accelerate ({setup}, gloo, CPU)")
        figures["time"] = figure

        figure, axis = plt.subplots(figsize=(8, 5.4), layout="constrained")
        keys = (("load_native", "native, stepped optimizer"), ("load_protected", "protected, stepped optimizer"),
                ("load_fresh_protected", "protected, fresh optimizer"))
        series: list[tuple[str, list[float | None]]] = [
            (label, [max(rank["growth"][key] / rank["shard_bytes"] for rank in row["ranks"]) for row in rows])
            for key, label in keys]
        _axes(axis, sizes, "peak RSS growth (x own optimizer shard)",
                    max([MEMORY_TARGET[0], *(value for _, values in series for value in values if value is not None)]))
        _bars(axis, series)
        axis.axhline(1.0, label="one optimizer shard (1.0x)", zorder=1.5, **_REFERENCE_STYLE)
        _target(axis, *MEMORY_TARGET)
        axis.set_title(f"Restore memory, worst rank ({setup})")
        axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2, frameon=False)
        figures["memory"] = figure
    return figures


def async_figure(rows: list[dict[str, Any]]) -> Figure:
    """The figure of one ``bench_async.py --json`` result (rank 0's medians, as its table)."""
    import matplotlib.pyplot as plt

    sizes = _sizes(rows)
    ranks = [row["ranks"][0] for row in rows]
    with plt.rc_context(FONT):
        # Stacked, one column as wide as the docs page shows it (PAGE_WIDTH_PX): side by side, the three panels
        # were shrunk to about half size there and their text was about 6 px tall.
        figure, axes = plt.subplots(3, 1, figsize=(PAGE_WIDTH_PX / DPI, 14), layout="constrained")
        for axis, quantity, title in zip(axes[:2], ("blocking", "total"),
                                         ("blocking (until save_state returns)", "until published")):
            series = [("async save", [rank["ratios"][quantity] for rank in ranks]),
                      ("async, reused staging memory", [rank["ratios"][f"{quantity}_reuse"] for rank in ranks])]
            value, label = ASYNC_TARGETS[quantity]
            _axes(axis, sizes, TIME_LABEL,
                        max([1.0, value, *(v for _, values in series for v in values if v is not None)]))
            _bars(axis, series)
            axis.axhline(1.0, label="native synchronous save (1.0x)", zorder=1.5, **_REFERENCE_STYLE)
            _target(axis, value, label)
            axis.set_title(title)
            _legend(axis)
        axis = axes[2]
        steps = [rank["ratios"]["step"] for rank in ranks]
        value, label = ASYNC_TARGETS["step"]
        _axes(axis, sizes, "step time (x idle step)", max([value, *(s for s in steps if s is not None)]))
        _bars(axis, [("step during the background write", steps)])
        axis.axhline(1.0, label="idle step (1.0x)", zorder=1.5, **_REFERENCE_STYLE)
        _target(axis, value, label)
        axis.set_title("training during the write")
        _legend(axis)
        figure.suptitle(f"Asynchronous save vs native synchronous save_state\n({_setup(rows)}, gloo, CPU)")
    return figure


def figures(path: Path) -> dict[str, Figure]:
    """The figures of one result file, keyed by the file name each is written to."""
    rows = load_rows(path)
    if kind(rows) == "async":
        return {f"{path.stem}.png": async_figure(rows)}
    return {f"{path.stem}_{name}.png": figure for name, figure in checkpoint_figures(rows).items()}


def plot(results: list[Path], out: Path) -> list[Path]:
    """Write the PNGs of every result file into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    with plt.rc_context(FONT):  # ticks are laid out again when saving: the same sizes there
        for path in results:
            for name, figure in figures(path).items():
                written.append(out / name)
                figure.savefig(written[-1], dpi=DPI)
                plt.close(figure)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="bench_checkpoint.py or bench_async.py --json files")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    for path in plot(args.results, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
