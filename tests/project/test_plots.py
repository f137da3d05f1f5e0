"""benchmarks/plots.py (issue 21, item 8; issue 46): PNGs from small result files, with the targets the documentation
names drawn as labelled horizontal lines, labelled axes, readable text, for checkpoint (FSDP1, FSDP2) and async
results; each bar over its target marked, each figure captioned with why its headline is what it is and every
missed target named with the phase that holds it back; no bar label struck through by a line.

The figures are checked as matplotlib objects (lines, labels, texts), not as pixels. The async fixture has the
schema ``bench_async.py --json`` writes, and a test reads that schema from bench_async.py's source, so the two
cannot drift apart unnoticed."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.text import Text

from benchmarks import plots

REPO = Path(__file__).resolve().parents[2]
SHARD = 200_000_000


def _checkpoint_rank(parameters: int, fsdp_version: int, save: float = 1.07, load: float = 0.53) -> dict[str, Any]:
    return {"parameters": parameters, "shard_bytes": SHARD, "optimizer": "adamw", "fsdp_version": fsdp_version,
            "ratios": {"save": save, "load": load},
            "times": {"save_native": 2.38, "save_protected": 2.44, "load_native": 4.66, "load_protected": 2.30},
            "growth": {"load_native": int(2.17 * SHARD), "load_protected": int(0.75 * SHARD),
                       "load_fresh_protected": int(1.08 * SHARD)},
            "checkpoint_bytes": {"protected": 600_000_000},
            "bandwidth": {"save_native": 1.5e9, "save_protected": 1.4e9, "dd_write": 0.8e9},
            "fractions": {"save_dd": 1.75}}


def _checkpoint_rows(fsdp_version: int = 1, save: float = 1.07, load: float = 0.53) -> list[dict[str, Any]]:
    # Unsorted on purpose: the plot orders by model size.
    return [{"million": million, "ranks": [_checkpoint_rank(parameters, fsdp_version, save, load)] * 2}
            for million, parameters in ((200, 201_424_896), (50, 50_356_224))]


def _async_rank(parameters: int, step: float | None, blocking: float = 0.08, reuse: float = 0.09) -> dict[str, Any]:
    return {"parameters": parameters, "steps_during": [3, 4, 3],
            "times": {"native": 1.81, "blocking": 0.12, "total": 0.92, "blocking_reuse": 0.12, "total_reuse": 1.09,
                      "step_idle": 0.05, "step_during": None if step is None else 0.05 * step,
                      "background_cpu": 0.8},
            "ratios": {"blocking": blocking, "total": 0.62, "blocking_reuse": reuse, "total_reuse": 0.60,
                       "step": step}}


def _async_rows(steps: tuple[float | None, float | None] = (1.26, None), blocking: float = 0.08,
                reuse: float = 0.09) -> list[dict[str, Any]]:
    return [{"million": million, "fsdp_version": 2, "world_size": 2,
             "ranks": [_async_rank(parameters, step, blocking, reuse)] * 2}
            for million, parameters, step in ((50, 50_356_224, steps[0]), (200, 201_424_896, steps[1]))]


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(rows))
    return path


def _targets(axis: Any) -> dict[str, float]:
    """The axis' horizontal target lines: label -> y."""
    found = {}
    for line in axis.get_lines():
        label = line.get_label()
        ys = list(line.get_ydata())
        if label.startswith("target") and len(set(ys)) == 1:
            found[label] = float(ys[0])
    return found


def _texts(figure: Any) -> list[Text]:
    figure.canvas.draw()  # lays out the tick labels
    return [text for text in figure.findobj(Text) if text.get_text().strip() and text.get_visible()]


def test_plot_writes_the_pngs_of_checkpoint_fsdp1_fsdp2_and_async_results(tmp_path: Path) -> None:
    results = [_write(tmp_path / "checkpoint.json", _checkpoint_rows(1)),
               _write(tmp_path / "checkpoint_fsdp2.json", _checkpoint_rows(2)),
               _write(tmp_path / "async_fsdp2.json", _async_rows())]
    written = plots.plot(results, tmp_path / "img")
    assert [path.name for path in written] == ["checkpoint_time.png", "checkpoint_memory.png",
                                               "checkpoint_fsdp2_time.png", "checkpoint_fsdp2_memory.png",
                                               "async_fsdp2.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    assert plt.get_fignums() == []  # every figure closed after writing


def test_checkpoint_time_draws_the_save_and_load_targets_with_labelled_axes() -> None:
    figure = plots.checkpoint_figures(plots.load_rows_from(_checkpoint_rows(2)))["time"]
    save, load = figure.axes
    assert _targets(save) == {"target: save at most 0.6x native": 0.6}
    assert _targets(load) == {"target: load at most 0.5x native": 0.5}
    for axis in (save, load):
        assert axis.get_xlabel() == "model size (million parameters)"
        assert axis.get_ylabel() == "time (x native)"
        assert [tick.get_text() for tick in axis.get_xticklabels()] == ["50", "201"]
        assert "native Accelerate (1.0x)" in [line.get_label() for line in axis.get_lines()]
    texts = [text.get_text() for text in _texts(figure)]
    assert any(text.startswith("1.07x") for text in texts) and any(text.startswith("0.53x") for text in texts)
    assert "0.60x" in texts  # the target's value written at the end of its line
    assert "FSDP2" in figure.get_suptitle()
    plt.close(figure)


def test_restore_memory_draws_the_125_target_against_the_shard() -> None:
    figure = plots.checkpoint_figures(plots.load_rows_from(_checkpoint_rows(1)))["memory"]
    (axis,) = figure.axes
    assert _targets(axis) == {"target: protected restore at most 1.25x the shard": 1.25}
    assert axis.get_xlabel() == "model size (million parameters)"
    assert "shard" in axis.get_ylabel()
    heights = sorted(round(patch.get_height(), 2) for patch in axis.patches)
    assert heights == [0.75, 0.75, 1.08, 1.08, 2.17, 2.17]  # growth / shard_bytes, worst rank, 3 series x 2 sizes
    plt.close(figure)


def test_async_figure_draws_blocking_publication_and_step_targets() -> None:
    figure = plots.async_figure(plots.load_rows_from(_async_rows()))
    blocking, total, step = figure.axes
    assert _targets(blocking) == {"target: blocking at most 0.05x native": 0.05}
    assert _targets(total) == {"target: publication at most 1.15x native": 1.15}
    assert _targets(step) == {"target: step at most 1.10x idle": 1.10}
    for axis in (blocking, total):
        assert axis.get_xlabel() == "model size (million parameters)"
        assert axis.get_ylabel() == "time (x native)"
    assert sorted(round(patch.get_height(), 2) for patch in blocking.patches) == [0.08, 0.08, 0.09, 0.09]
    texts = [text.get_text() for text in _texts(figure)]
    assert "n/a" in texts  # the 200M row had no step during the write
    assert "FSDP2, 2 ranks" in figure.get_suptitle()
    plt.close(figure)


def test_the_async_figure_text_is_legible_at_the_docs_page_width() -> None:
    # Regression: three panels side by side, 1400 px wide, shown at the page's ~720 px: text about 6 px tall.
    figure = plots.async_figure(plots.load_rows_from(_async_rows()))
    width_px = figure.get_figwidth() * plots.DPI
    shown = min(1.0, plots.PAGE_WIDTH_PX / width_px)  # how much the page shrinks the PNG
    smallest = min(text.get_fontsize() for text in _texts(figure) if text.get_text())
    assert smallest * plots.DPI / 72 * shown >= 12, (smallest, width_px)  # pixels tall on the page
    assert [axis.get_subplotspec().colspan.start for axis in figure.axes] == [0, 0, 0]  # stacked in one column
    plt.close(figure)


@pytest.mark.parametrize("which", ["time", "memory", "async"])
def test_no_text_in_a_figure_is_smaller_than_10_points(which: str) -> None:
    if which == "async":
        figure = plots.async_figure(plots.load_rows_from(_async_rows()))
    else:
        figure = plots.checkpoint_figures(plots.load_rows_from(_checkpoint_rows(1)))[which]
    sizes = {text.get_text(): text.get_fontsize() for text in _texts(figure)}
    assert len(sizes) > 10
    assert {text: size for text, size in sizes.items() if size < 10} == {}
    plt.close(figure)


def _bar_labels(axis: Any) -> list[Text]:
    return [text for text in axis.texts if text.get_gid() == "bar-label"]


def _missed_bars(axis: Any) -> list[float]:
    return sorted(round(patch.get_height(), 3) for patch in axis.patches if patch.get_gid() == "missed")


def test_a_bar_over_its_target_is_marked_and_the_caption_names_it_with_its_phase() -> None:
    figure = plots.async_figure(plots.load_rows_from(_async_rows()))
    blocking, total, step = figure.axes
    assert _missed_bars(blocking) == [0.08, 0.08, 0.09, 0.09]  # every blocking bar is over 0.05x
    assert _missed_bars(total) == []  # publication 0.60-0.62x: met
    assert _missed_bars(step) == [1.26]  # 1.26x at 50M; 200M has no value
    labels = [text.get_text() for text in _bar_labels(blocking)]
    assert labels == ["0.08x\nmissed", "0.08x\nmissed", "0.09x\nmissed", "0.09x\nmissed"], labels
    assert all(text.get_color() == "#c0392b" for text in _bar_labels(blocking))
    legend = [text.get_text() for text in blocking.get_legend().get_texts()]
    assert plots.MISSED_LABEL in legend
    assert plots.MISSED_LABEL not in [text.get_text() for text in total.get_legend().get_texts()]
    caption = plots.caption_of(figure)
    assert ("Missed: blocking at most 0.05x native: 0.08x (50M), 0.09x (50M, reused memory), 0.08x (201M), 0.09x "
            "(201M, reused memory). Held back by the host copy of this rank's state, which an exact asynchronous "
            "save makes before save_state returns.") in caption, caption
    assert "Missed: step at most 1.10x idle: 1.26x (50M). Held back by the background write's CPU" in caption
    assert "publication at most" not in caption
    assert caption.startswith("Blocking: an asynchronous save is exact")
    plt.close(figure)


def test_a_figure_whose_bars_meet_every_target_says_so() -> None:
    figure = plots.async_figure(plots.load_rows_from(_async_rows((1.02, 1.05), blocking=0.04, reuse=0.03)))
    assert all(_missed_bars(axis) == [] for axis in figure.axes)
    assert plots.caption_of(figure).endswith("Every target met.")
    assert "Missed" not in plots.caption_of(figure)
    plt.close(figure)


def test_a_value_that_rounds_onto_its_target_but_is_over_it_gets_a_third_decimal() -> None:
    assert plots.value_text(0.0512, 0.05) == "0.051x"
    assert plots.value_text(0.05, 0.05) == "0.05x"
    assert plots.value_text(0.0449, 0.05) == "0.04x"
    assert plots.value_text(1.27, 1.10) == "1.27x"
    figure = plots.async_figure(plots.load_rows_from(_async_rows(blocking=0.0512, reuse=0.049)))
    labels = [text.get_text() for text in _bar_labels(figure.axes[0])]
    assert labels == ["0.051x\nmissed", "0.051x\nmissed", "0.05x", "0.05x"], labels  # series by series
    plt.close(figure)


def test_no_bar_label_is_struck_through_by_a_reference_or_target_line() -> None:
    # A 1.03x step sits just under the 1.10x target line: its label, placed above the bar, would straddle the line.
    figure = plots.async_figure(plots.load_rows_from(_async_rows((1.03, 1.27))))
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    step = figure.axes[2]
    assert [label.xy[1] for label in _bar_labels(step)] == [1.10, 1.27]  # moved above the line; 1.27x was clear
    for axis in figure.axes:
        lines = [float(line.get_ydata()[0]) for line in axis.get_lines()]
        assert {1.0} <= set(lines)
        for label in _bar_labels(axis):
            box = label.get_bbox_patch().get_window_extent(renderer)
            assert box.y1 <= axis.get_window_extent(renderer).y1 + 0.5, label.get_text()  # inside the axis
            for y in lines:
                pixel = axis.transData.transform((0, y))[1]
                assert not box.y0 <= pixel <= box.y1, (label.get_text(), y)
    plt.close(figure)


def test_the_checkpoint_captions_explain_the_headline_for_each_fsdp_version() -> None:
    fsdp1 = plots.checkpoint_figures(plots.load_rows_from(_checkpoint_rows(1, save=0.21, load=0.08)))
    caption = plots.caption_of(fsdp1["time"])
    assert caption.startswith("Why the protected save is 0.21x, 0.21x native: native FSDP1 all-gathers every flat "
                              "parameter and all optimizer state"), caption
    assert "streams each rank's own shards from memory to the disk" in caption
    assert caption.endswith("Every target met.")
    assert "optim_state_dict_to_load" in plots.caption_of(fsdp1["memory"])  # why native grows by 2.17x
    fsdp2 = plots.checkpoint_figures(plots.load_rows_from(_checkpoint_rows(2)))
    caption = plots.caption_of(fsdp2["time"])
    assert "native FSDP2 already writes each rank's local shards without a gather" in caption
    assert "Missed: save at most 0.6x native: 1.07x (50M), 1.07x (201M). Held back by the disk" in caption
    # 600 MB in 0.6 x 2.38 s; dd with fdatasync wrote 0.80 GB/s
    assert "0.6x would need 0.42 GB/s at 50M against dd's 0.80 GB/s" in caption
    assert "Missed: load at most 0.5x native: 0.53x (50M), 0.53x (201M). Held back by fixed costs" in caption
    for figure in (*fsdp1.values(), *fsdp2.values()):
        plt.close(figure)


@pytest.mark.parametrize("which", ["time", "memory", "async"])
def test_the_caption_is_legible_at_the_docs_page_width(which: str) -> None:
    if which == "async":
        figure = plots.async_figure(plots.load_rows_from(_async_rows()))
    else:
        figure = plots.checkpoint_figures(plots.load_rows_from(_checkpoint_rows(1)))[which]
    (caption,) = figure.findobj(lambda artist: artist.get_gid() == "caption")
    shown = min(1.0, plots.PAGE_WIDTH_PX / (figure.get_figwidth() * plots.DPI))
    assert caption.get_fontsize() * plots.DPI / 72 * shown >= plots.CAPTION_PX - 0.1
    figure.canvas.draw()
    box = caption.get_window_extent(figure.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= figure.bbox.width and box.y0 >= 0  # wrapped inside the figure
    assert all(box.y1 <= axis.get_tightbbox().y0 + 1 for axis in figure.axes)  # under every panel and legend
    plt.close(figure)


def test_an_unknown_result_file_is_refused_with_its_keys(tmp_path: Path) -> None:
    path = _write(tmp_path / "other.json", [{"million": 50, "ranks": [{"parameters": 1, "seconds": 2}]}])
    with pytest.raises(ValueError, match=r"unknown benchmark result \(rank keys: \['parameters', 'seconds'\]\)"):
        plots.figures(path)
    with pytest.raises(ValueError, match=r"not a bench_checkpoint\.py or bench_async\.py --json result"):
        plots.figures(_write(tmp_path / "empty.json", []))


def _dict_keys(node: ast.AST) -> set[str]:
    assert isinstance(node, ast.Dict), ast.dump(node)
    return {key.value for key in node.keys if isinstance(key, ast.Constant)}


def test_the_async_fixture_has_the_schema_bench_async_writes() -> None:
    tree = ast.parse((REPO / "benchmarks" / "bench_async.py").read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    worker, main = functions["worker"], functions["main"]
    assigned = {node.target.id: node.value for node in ast.walk(worker)
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    (returned,) = [node.value for node in worker.body if isinstance(node, ast.Return)]
    (row,) = [node.args[0] for node in ast.walk(main) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "rows"]
    fixture_row = _async_rows()[0]
    rank = fixture_row["ranks"][0]
    assert set(fixture_row) == _dict_keys(row)
    assert set(rank) == _dict_keys(returned)
    assert set(rank["times"]) == _dict_keys(assigned["times"])
    assert set(rank["ratios"]) == _dict_keys(assigned["ratios"])
    assert plots.kind(plots.load_rows_from(_async_rows())) == "async"
    assert plots.kind(plots.load_rows_from(_checkpoint_rows())) == "checkpoint"
