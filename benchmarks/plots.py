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

The x axis is the model size in million parameters (``parameters`` of rank 0, global). Every figure carries a
caption under its panels (:func:`checkpoint_time_caption`, :func:`checkpoint_memory_caption`,
:func:`async_caption`): why its headline ratio is what it is, for the FSDP version measured, and every target a
bar misses, named with its values and the phase that holds it back; a bar over its target is drawn hatched with a
red edge and its label says "missed". Bar labels are moved clear of the reference and target lines
(:func:`clear_of_lines`), and a value that rounds onto its target but is over it gets a third decimal.

    .venv/bin/python benchmarks/plots.py benchmarks/results/checkpoint.json --out docs/img
"""

from __future__ import annotations

import argparse
import json
import textwrap
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
_MISSED_STYLE = {"edgecolor": _TARGET_STYLE["color"], "linewidth": 2.0, "hatch": "//"}
MISSED_LABEL = "over its target (missed)"
_BAR_LABEL = "bar-label"  # the gid of a bar's value label (clear_of_lines moves these)
_CAPTION = "caption"  # the gid of a figure's caption
_MISSED = "missed"  # the gid of a bar over its target
#: The smallest a caption's text is shown on the docs page, in pixels (its font grows with a figure the page shrinks).
CAPTION_PX = 12


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


def value_text(value: float, target: float | None = None) -> str:
    """A ratio as its label writes it: two decimals, three where two would round an over-target value onto its
    target (0.0512 against 0.05 reads "0.051x", not "0.05x")."""
    text = f"{value:.2f}x"
    if target is not None and value > target >= round(value, 2):
        text = f"{value:.3f}x"
    return text


def _bars(axis: Axes, series: list[tuple[str, list[float | None]]], labels: list[list[str]] | None = None,
          targets: list[float | None] | None = None) -> None:
    """Grouped bars (one group per model size), each labelled above with its value (``n/a`` where missing), on a
    white ground. ``targets``: each series' target (None: the target is not this series'); a bar over its target is
    hatched with a red edge and its label says "missed", in red."""
    count = len(series)
    width = 0.8 / count
    for index, (name, values) in enumerate(series):
        target = None if targets is None else targets[index]
        positions = [p + (index - (count - 1) / 2) * width for p in range(len(values))]
        heights = [0.0 if value is None else value for value in values]
        bars = axis.bar(positions, heights, width * 0.92, label=name, color=_COLOURS[index % len(_COLOURS)], zorder=2)
        for bar_index, (position, value) in enumerate(zip(positions, values)):
            missed = value is not None and target is not None and value > target
            if missed:
                bars[bar_index].set(gid=_MISSED, **_MISSED_STYLE)
            text = "n/a" if value is None else value_text(value, target)
            if labels is not None and value is not None:
                text += labels[index][bar_index]
            if missed:
                text += "\nmissed"
            axis.annotate(text, (position, 0.0 if value is None else value), xytext=(0, 3),
                          textcoords="offset points", ha="center", va="bottom", fontsize=10, zorder=5,
                          color=_TARGET_STYLE["color"] if missed else "black", gid=_BAR_LABEL,
                          bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                                "alpha": 0.85})


def _horizontal_lines(axis: Axes) -> list[float]:
    """The y of every horizontal line of an axis (the reference and target lines)."""
    ys = []
    for line in axis.get_lines():
        values = {float(y) for y in line.get_ydata()}
        if len(values) == 1:
            ys.append(values.pop())
    return sorted(ys)


def clear_of_lines(figure: Figure) -> None:
    """Move every bar label that a reference or target line would strike through to just above that line, and
    raise an axis' top where a moved label would leave it. The figure is drawn to measure the labels."""
    for _ in range(8):  # each pass moves a label above one more line; a few lines per axis
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
        moved = False
        for axis in figure.axes:
            lines = _horizontal_lines(axis)
            top = axis.get_window_extent(renderer).y1
            for label in (text for text in axis.texts if text.get_gid() == _BAR_LABEL):
                box = label.get_bbox_patch().get_window_extent(renderer) if label.get_bbox_patch() else \
                    label.get_window_extent(renderer)
                for y in lines:
                    pixel = axis.transData.transform((0, y))[1]
                    if box.y0 - 1 <= pixel <= box.y1 + 1 and y > label.xy[1]:
                        label.xy = (label.xy[0], y)  # its bottom now 3 points above the line
                        moved = True
                        break
                if box.y1 > top:
                    low, high = axis.get_ylim()
                    axis.set_ylim(low, high + (box.y1 - top + 4) * (high - low) / axis.bbox.height)
                    moved = True
        if not moved:
            return


def _axes(axis: Axes, sizes: list[str], ylabel: str, highest: float) -> None:
    """Labels both axes; the y axis reaches above the highest bar or line."""
    axis.set_xticks(list(range(len(sizes))), sizes)
    axis.set_xlabel(SIZE_LABEL)
    axis.set_ylabel(ylabel)
    axis.set_ylim(0, highest * 1.3)  # room for the labels above the highest bar
    axis.grid(axis="y", alpha=0.3, zorder=0)


def _legend(axis: Axes, ncols: int = 1) -> None:
    """The legend under an axis; where a bar missed its target, an entry explains the hatching."""
    from matplotlib.patches import Patch

    handles, labels = axis.get_legend_handles_labels()
    if any(patch.get_gid() == _MISSED for patch in axis.patches):
        handles.append(Patch(facecolor="white", label=MISSED_LABEL, **_MISSED_STYLE))
        labels.append(MISSED_LABEL)
    axis.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=ncols, frameon=False)


def _setup(rows: list[dict[str, Any]]) -> str:
    rank = rows[0]["ranks"][0]
    fsdp = _fsdp(rows)
    ranks = rows[0].get("world_size", len(rows[0]["ranks"]))
    optimizer = rank.get("optimizer")
    return f"FSDP{fsdp}, {ranks} rank{'s' if ranks != 1 else ''}" + (f", {optimizer}" if optimizer else "")


def _fsdp(rows: list[dict[str, Any]]) -> int:
    return int(rows[0]["ranks"][0].get("fsdp_version", rows[0].get("fsdp_version", 1)))


def _caption(figure: Figure, paragraphs: list[str]) -> None:
    """The caption under a figure's panels: its paragraphs wrapped to the figure's width, at a size the docs page
    shows at least ``CAPTION_PX`` pixels tall however much it shrinks the figure."""
    width_px = figure.get_figwidth() * DPI
    shown = min(1.0, PAGE_WIDTH_PX / width_px)
    size = max(10.0, round(CAPTION_PX / (DPI / 72 * shown), 1))
    columns = int(width_px / (size * DPI / 72 * 0.56))  # DejaVu Sans: about 0.56 em a character
    text = "\n".join(textwrap.fill(paragraph, columns - 2) for paragraph in paragraphs)
    figure.supxlabel(text, x=0.01, ha="left", multialignment="left", fontsize=size, linespacing=1.35,
                     gid=_CAPTION)


def caption_of(figure: Figure) -> str:
    """The caption of a figure made here, its wrapped lines joined again ("" where it has none)."""
    found = figure.findobj(lambda artist: artist.get_gid() == _CAPTION)
    return " ".join(found[0].get_text().split()) if found else ""


def _sizes_named(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{size}M" for size in _sizes(rows)]


def _missed(target: tuple[float, str], values: list[tuple[str, float | None]], why: str) -> str | None:
    """One sentence naming a missed target: its label, each value over it and where, and the phase that holds it
    back; None where every value meets it."""
    over = [f"{value_text(value, target[0])} ({where})" for where, value in values
            if value is not None and value > target[0]]
    if not over:
        return None
    name = target[1].removeprefix("target: ")
    return f"Missed: {name}: {', '.join(over)}. Held back by {why}."


def _gb(value: float | None) -> str:
    return "?" if value is None else f"{value / 1e9:.2f} GB/s"


def checkpoint_time_caption(rows: list[dict[str, Any]]) -> list[str]:
    """Why the protected save and load take what they take against native, and each missed target with its phase."""
    ranks = [row["ranks"][0] for row in rows]
    where = _sizes_named(rows)
    save = [rank.get("ratios", {}).get("save") for rank in ranks]
    load = [rank.get("ratios", {}).get("load") for rank in ranks]
    first = ranks[0]
    bandwidth = first.get("bandwidth", {})
    shown = ", ".join(value_text(value) for value in save if value is not None)
    loaded = ", ".join(value_text(value) for value in load if value is not None)
    if _fsdp(rows) == 1:
        why = [f"Why the protected save is {shown} native: native FSDP1 all-gathers every flat parameter and all "
               "optimizer state to build its sharded state dicts, then pickles them with torch.save; the protected "
               "writer streams each rank's own shards from memory to the disk (O_DIRECT), without a collective or a "
               f"copy ({_gb(bandwidth.get('save_protected'))} against native's {_gb(bandwidth.get('save_native'))} "
               f"at {where[0]}, every byte hashed and made durable). The load, {loaded}: native unshards every flat "
               "parameter to copy the loaded chunks in; the protected restore hash-checks every file, then reads "
               "each rank's elements straight into its flat parameter and optimizer state."]
        save_why = load_why = ("a phase this result does not break down (profile one save_state/load_state as "
                               "docs/benchmarks.md does)")
    else:
        per_size = [row["ranks"][0] for row in rows]
        durable = ", ".join(f"{_gb(rank.get('bandwidth', {}).get('save_protected'))} at {size}"
                            for rank, size in zip(per_size, where))
        of_dd = ", ".join(f"{rank['fractions']['save_dd']:.0%}" for rank in per_size if "fractions" in rank)
        why = [f"Why the protected save is {shown} native: native FSDP2 already writes each rank's local shards "
               "without a gather, and stops in the page cache without an fsync "
               f"({_gb(bandwidth.get('save_native'))} at {where[0]}); the protected save makes every byte durable "
               f"and hashed, at the pace of this disk: {durable}"
               + (f" ({of_dd} of what dd with fdatasync writes)" if of_dd else "") + ". The load, "
               f"{loaded}: native FSDP2 already reads in place; the protected restore also hash-checks every byte "
               "first."]
        needed = [f"{_gb(rank['checkpoint_bytes']['protected'] / (CHECKPOINT_TARGETS['save'][0] * rank['times']['save_native']))}"
                  f" at {size} against dd's {_gb(rank.get('bandwidth', {}).get('dd_write'))}"
                  for rank, size in zip(per_size, where) if "checkpoint_bytes" in rank]
        save_why = ("the disk: a durable save cannot take 0.6x of a write that stops in the page cache unless the "
                    "disk is that much faster" + (f" (0.6x would need {'; '.join(needed)})" if needed else ""))
        load_why = ("fixed costs native FSDP2 does not pay: the hash check of every byte before anything is "
                    "restored, the ranks' agreements, the descriptor and RNG checks")
    missed = [line for line in (_missed(CHECKPOINT_TARGETS["save"], list(zip(where, save)), save_why),
                                _missed(CHECKPOINT_TARGETS["load"], list(zip(where, load)), load_why)) if line]
    return why + (missed or ["Every target met."])


#: The restore-memory figure's series: label, and the key of ``growth`` in a bench_checkpoint.py result.
MEMORY_SERIES = (("native, stepped optimizer", "load_native"), ("protected, stepped optimizer", "load_protected"),
                 ("protected, fresh optimizer", "load_fresh_protected"))


def checkpoint_memory_caption(rows: list[dict[str, Any]], series: list[tuple[str, list[float | None]]]) -> list[str]:
    """Why each restore grows as it does, and the missed target (a protected restore over 1.25x) with its phase."""
    values = dict(series)
    native, stepped, fresh = (values[label] for label, _ in MEMORY_SERIES)
    where = _sizes_named(rows)

    def listed(ratios: list[float | None]) -> str:
        return ", ".join(value_text(value) for value in ratios if value is not None)

    native_why = ("its read template plus optim_state_dict_to_load's output, built by all-gathering each "
                  "parameter's state" if _fsdp(rows) == 1 else "native FSDP2 reads each rank's shards in place too")
    why = [f"Native restore into a stepped optimizer: {listed(native)} the rank's optimizer shard ({native_why}). "
           "The protected restore reads each rank's own elements straight into the tensors the optimizer keeps: "
           f"{listed(fresh)} into a fresh optimizer (the new state itself), {listed(stepped)} into a stepped one "
           "(its existing tensors are filled)."]
    missed = _missed(MEMORY_TARGET, [(f"{size}, {label}", value) for label, _ in MEMORY_SERIES[1:]
                                     for size, value in zip(where, values[label])],
                     "the restore's own buffers on top of the optimizer state")
    return [*why, missed or "Every target met."]


def async_caption(rows: list[dict[str, Any]]) -> list[str]:
    """Why blocking and publication are what they are, and each missed target with the phase that holds it back."""
    ranks = [row["ranks"][0] for row in rows]
    where = _sizes_named(rows)
    times = [rank["times"] for rank in ranks]
    blocking = ", ".join(f"{t['blocking']:.2f} s ({size})" for t, size in zip(times, where))
    reused = ", ".join(f"{t['blocking_reuse']:.2f} s" for t in times)
    totals = [value for rank in ranks for value in (rank["ratios"]["total"], rank["ratios"]["total_reuse"])
              if value is not None]
    gathers = ", and without native FSDP1's gathers" if _fsdp(rows) == 1 else ""
    why = [f"Blocking: an asynchronous save is exact, so save_state returns once this rank's state is copied to "
           f"host memory: {blocking} into fresh memory, {reused} into reused staging memory; the write, hashes, "
           f"fsync and publish run in the background. Publication, {min(totals):.2f}-{max(totals):.2f}x a native "
           f"synchronous save: the files go to the disk with O_DIRECT{gathers}."]
    cpu = ", ".join(f"{t['background_cpu']:.2f} s" for t in times)
    faster = [size for t, size in zip(times, where) if t["blocking_reuse"] < 0.8 * t["blocking"]]
    missed = [
        _missed(ASYNC_TARGETS["blocking"],
                [(f"{size}{suffix}", rank["ratios"][key]) for size, rank in zip(where, ranks)
                 for key, suffix in (("blocking", ""), ("blocking_reuse", ", reused memory"))],
                "the host copy of this rank's state, which an exact asynchronous save makes before save_state "
                "returns" + (" (into fresh memory the kernel first has to provide the pages: reused staging memory "
                             f"blocks for less at {', '.join(faster)})" if faster else "")),
        _missed(ASYNC_TARGETS["total"],
                [(f"{size}{suffix}", rank["ratios"][key]) for size, rank in zip(where, ranks)
                 for key, suffix in (("total", ""), ("total_reuse", ", reused memory"))],
                "the background write: the hash-and-fsync pass a native save does not make"),
        _missed(ASYNC_TARGETS["step"], [(size, rank["ratios"]["step"]) for size, rank in zip(where, ranks)],
                f"the background write's CPU ({cpu} per save, rank 0), taken from the training ranks on the "
                "machine's cores"),
    ]
    return why + ([line for line in missed if line] or ["Every target met."])


def checkpoint_figures(rows: list[dict[str, Any]]) -> dict[str, Figure]:
    """``{"time": ..., "memory": ...}`` figures of one ``bench_checkpoint.py --json`` result."""
    import matplotlib.pyplot as plt

    sizes = _sizes(rows)
    setup = _setup(rows)
    figures = {}
    with plt.rc_context(FONT):
        figure, axes = plt.subplots(1, 2, figsize=(10, 7.4), layout="constrained")
        for axis, phase in zip(axes, ("save", "load")):
            times = [row["ranks"][0]["times"] for row in rows]
            ratios = [row["ranks"][0].get("ratios", {}).get(phase) for row in rows]
            seconds = [f"\n{t[f'{phase}_protected']:.2f} s vs {t[f'{phase}_native']:.2f} s" for t in times]
            value, label = CHECKPOINT_TARGETS[phase]
            _axes(axis, sizes, TIME_LABEL, max([1.0, value, *(r for r in ratios if r is not None)]))
            _bars(axis, [("accelerate-txn (protected)", ratios)], [seconds], targets=[value])
            axis.axhline(1.0, label="native Accelerate (1.0x)", zorder=1.5, **_REFERENCE_STYLE)
            _target(axis, value, label)
            axis.set_title(phase + (" (into a stepped optimizer)" if phase == "load" else ""))
            _legend(axis)
        figure.suptitle(f"Checkpoint time, protected vs native Accelerate ({setup}, gloo, CPU)")
        _caption(figure, checkpoint_time_caption(rows))
        clear_of_lines(figure)
        figures["time"] = figure

        figure, axis = plt.subplots(figsize=(8, 6.8), layout="constrained")
        series: list[tuple[str, list[float | None]]] = [
            (label, [max(rank["growth"][key] / rank["shard_bytes"] for rank in row["ranks"]) for row in rows])
            for label, key in MEMORY_SERIES]
        _axes(axis, sizes, "peak RSS growth (x own optimizer shard)",
              max([MEMORY_TARGET[0], *(value for _, values in series for value in values if value is not None)]))
        _bars(axis, series, targets=[None, MEMORY_TARGET[0], MEMORY_TARGET[0]])  # the target is the protected ones'
        axis.axhline(1.0, label="one optimizer shard (1.0x)", zorder=1.5, **_REFERENCE_STYLE)
        _target(axis, *MEMORY_TARGET)
        axis.set_title(f"Restore memory, worst rank ({setup})")
        _legend(axis, ncols=2)
        _caption(figure, checkpoint_memory_caption(rows, series))
        clear_of_lines(figure)
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
        figure, axes = plt.subplots(3, 1, figsize=(PAGE_WIDTH_PX / DPI, 17.5), layout="constrained")
        for axis, quantity, title in zip(axes[:2], ("blocking", "total"),
                                         ("blocking (until save_state returns)", "until published")):
            series = [("async save", [rank["ratios"][quantity] for rank in ranks]),
                      ("async, reused staging memory", [rank["ratios"][f"{quantity}_reuse"] for rank in ranks])]
            value, label = ASYNC_TARGETS[quantity]
            _axes(axis, sizes, TIME_LABEL,
                  max([1.0, value, *(v for _, values in series for v in values if v is not None)]))
            _bars(axis, series, targets=[value, value])
            axis.axhline(1.0, label="native synchronous save (1.0x)", zorder=1.5, **_REFERENCE_STYLE)
            _target(axis, value, label)
            axis.set_title(title)
            _legend(axis)
        axis = axes[2]
        steps = [rank["ratios"]["step"] for rank in ranks]
        value, label = ASYNC_TARGETS["step"]
        _axes(axis, sizes, "step time (x idle step)", max([value, *(s for s in steps if s is not None)]))
        _bars(axis, [("step during the background write", steps)], targets=[value])
        axis.axhline(1.0, label="idle step (1.0x)", zorder=1.5, **_REFERENCE_STYLE)
        _target(axis, value, label)
        axis.set_title("training during the write")
        _legend(axis)
        figure.suptitle(f"Asynchronous save vs native synchronous save_state\n({_setup(rows)}, gloo, CPU)")
        _caption(figure, async_caption(rows))
        clear_of_lines(figure)
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
