"""benchmarks/plots.py (issue 21, item 8): PNGs from small result files, with the targets the documentation names
drawn as labelled horizontal lines, labelled axes, readable text, for checkpoint (FSDP1, FSDP2) and async results.

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


def _checkpoint_rank(parameters: int, fsdp_version: int) -> dict[str, Any]:
    return {"parameters": parameters, "shard_bytes": SHARD, "optimizer": "adamw", "fsdp_version": fsdp_version,
            "ratios": {"save": 1.07, "load": 0.53},
            "times": {"save_native": 2.38, "save_protected": 2.44, "load_native": 4.66, "load_protected": 2.30},
            "growth": {"load_native": int(2.17 * SHARD), "load_protected": int(0.75 * SHARD),
                       "load_fresh_protected": int(1.08 * SHARD)}}


def _checkpoint_rows(fsdp_version: int = 1) -> list[dict[str, Any]]:
    # Unsorted on purpose: the plot orders by model size.
    return [{"million": million, "ranks": [_checkpoint_rank(parameters, fsdp_version)] * 2}
            for million, parameters in ((200, 201_424_896), (50, 50_356_224))]


def _async_rank(parameters: int, step: float | None) -> dict[str, Any]:
    return {"parameters": parameters, "steps_during": [3, 4, 3],
            "times": {"native": 1.81, "blocking": 0.12, "total": 0.92, "blocking_reuse": 0.12, "total_reuse": 1.09,
                      "step_idle": 0.05, "step_during": None if step is None else 0.05 * step,
                      "background_cpu": 0.8},
            "ratios": {"blocking": 0.08, "total": 0.62, "blocking_reuse": 0.09, "total_reuse": 0.60, "step": step}}


def _async_rows() -> list[dict[str, Any]]:
    return [{"million": million, "fsdp_version": 2, "world_size": 2,
             "ranks": [_async_rank(parameters, step)] * 2}
            for million, parameters, step in ((50, 50_356_224, 1.26), (200, 201_424_896, None))]


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
