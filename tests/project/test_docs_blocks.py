"""Every code block of the docs that claims to run is run, and every other one is checked against the code.

A block claims to run when it is a script (a ```python block titled ``*.py``, or one with a ``__main__`` guard) or a
command line of this package (``accelerate-txn ...``, ``python -m accelerate_txn.testing run ...``). Here:

* the quick start's ``train.py`` runs under the quick start's own commands, unchanged: ``python -m
  accelerate_txn.testing run --fsdp-version 2 train.py`` twice (saves ``checkpoint_0``, then resumes from it and saves
  ``checkpoint_1``), then ``accelerate-txn verify``; the same under ``--fsdp-version 1`` in another directory, as
  the page says; and an FSDP1 run refuses the FSDP2 run's checkpoint, naming the configuration, as the page says;
* the training loop's ``train.py`` runs under FSDP2 (with ``SAVE_EVERY``/``MAX_STEPS`` made small, the only change),
  is killed with ``kill -9`` once its second checkpoint is published, and resumes from it; and runs under FSDP1;
* the README's scripts run in tests/project/test_readme.py;
* every script block of the pages is one of those (a new one fails here until a test runs it);
* every ```python block is valid Python and every ``accelerate_txn`` name it uses exists;
* every command line of the package in a ```bash block names a real command and only options that command has.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import accelerate_txn
from accelerate_txn.testing import ScriptResult, run_script

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
_TITLE = re.compile(r'title="([^"]+)"')
TIMEOUT = 300.0  # a hang guard per job


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int
    language: str
    title: str | None
    code: str

    @property
    def is_script(self) -> bool:
        return self.language == "python" and ((self.title or "").endswith(".py")
                                              or 'if __name__ == "__main__":' in self.code)


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in _BLOCK.finditer(text):
            language, attributes, code = match.groups()
            title = _TITLE.search(attributes)
            found.append(Block(str(page.relative_to(ROOT)), text[:match.start()].count("\n") + 1, language,
                               title.group(1) if title else None, code))
    return found


def script(page: str, title: str) -> str:
    (block,) = [b for b in blocks() if b.page == page and b.title == title]
    return block.code


def commands_after(page: str, anchor: str) -> list[list[str]]:
    """The command lines of the first ```bash block after ``anchor`` on ``page`` (comments dropped)."""
    text = (ROOT / page).read_text()
    match = _BLOCK.search(text, text.index(anchor))
    assert match is not None and match.group(1) == "bash", f"{page}: no bash block after {anchor!r}"
    return [shlex.split(line, comments=True) for line in match.group(3).splitlines() if line.split("#")[0].strip()]


#: Every script block of the pages, and the test that runs it.
RUN_BY = {
    ("docs/quickstart.md", "train.py"): "test_the_quickstart_script_runs_under_its_commands_on_fsdp2_and_fsdp1",
    ("docs/training-loop.md", "train.py"): "test_the_training_loop_script_resumes_after_a_kill",
    ("README.md", None): "tests/project/test_readme.py::test_readme_program_runs_twice_in_a_row_as_pasted",
}


def test_every_script_block_of_the_docs_is_run_by_a_test() -> None:
    scripts = {(block.page, block.title) for block in blocks() if block.is_script}
    assert scripts == set(RUN_BY), (f"script blocks no test runs: {sorted(scripts - set(RUN_BY), key=str)}; "
                                    f"listed but gone: {sorted(set(RUN_BY) - scripts, key=str)}")


@pytest.mark.parametrize("block", [b for b in blocks() if b.language == "python"],
                         ids=lambda b: f"{b.page}:{b.line}")
def test_every_python_block_is_valid_python_and_uses_existing_accelerate_txn_names(block: Block) -> None:
    tree = ast.parse(block.code, filename=f"{block.page}:{block.line}")
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "accelerate_txn":
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{alias.name}" for alias in node.names if not hasattr(module, alias.name)]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "accelerate_txn"):
            missing += [] if hasattr(importlib.import_module("accelerate_txn"), node.attr) else [
                f"accelerate_txn.{node.attr}"]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == "accelerate_txn" and hasattr(accelerate_txn, node.func.attr):
            parameters = inspect.signature(getattr(accelerate_txn, node.func.attr)).parameters
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
                missing += [f"accelerate_txn.{node.func.attr}({keyword.arg}=)" for keyword in node.keywords
                            if keyword.arg is not None and keyword.arg not in parameters]
    assert not missing, f"{block.page}:{block.line} uses names accelerate_txn does not have: {missing}"


def _package_command_lines() -> list[tuple[str, list[str]]]:
    lines = []
    for block in blocks():
        if block.language != "bash":
            continue
        for number, line in enumerate(block.code.replace("\\\n", " ").splitlines(), start=block.line + 1):
            try:
                words = shlex.split(re.sub(r"\[(--?[\w-]+)[^\]]*\]", r"\1", line), comments=True)  # "[--full]"
            except ValueError:  # a line of a multi-line argument (python -c "...)
                assert not line.lstrip().startswith(("accelerate-txn", "python -m accelerate_txn")), (block.page, line)
                continue
            if words[:1] in (["accelerate-txn"], [".venv/bin/accelerate-txn"]) or words[:3] == [
                    "python", "-m", "accelerate_txn.testing"]:
                lines.append((f"{block.page}:{number}", words))
    return lines


def _options(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", help_text))


def _help(*command: str) -> str:
    done = subprocess.run([sys.executable, "-m", *command, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command} --help failed:\n{done.stderr}"
    return done.stdout


def test_every_command_line_of_the_package_in_the_docs_names_a_real_command_and_its_options() -> None:
    lines = _package_command_lines()
    assert len(lines) >= 10, lines  # the README's and cli.md's command lines are found
    helps: dict[tuple[str, ...], set[str]] = {}
    problems = []
    for where, words in lines:
        if words[0].endswith("accelerate-txn"):
            command, rest = ("accelerate_txn", *words[1:2]), words[2:]
        else:  # python -m accelerate_txn.testing run [options] SCRIPT ARGS: the options before the script
            command, rest = ("accelerate_txn.testing", *words[3:4]), []
            for word in words[4:]:
                if not word.startswith("-") and not (rest and rest[-1] in ("-n", "--num-processes", "--fsdp-version",
                                                                           "--state-dict-type", "--auto-wrap",
                                                                           "--timeout", "--grace", "--log-dir",
                                                                           "--kill-on-output", "--kill-on-path")):
                    break
                rest.append(word)
        if len(command) < 2 and not rest:
            continue  # "accelerate-txn" alone
        if command not in helps:
            try:
                helps[command] = _options(_help(*command))
            except AssertionError as exc:
                problems.append(f"{where}: {' '.join(words)}: {exc}")
                continue
        unknown = [word.split("=")[0] for word in rest if word.startswith("-") and word.split("=")[0] not in
                   helps[command]]
        if unknown:
            problems.append(f"{where}: {' '.join(words)}: options {command[-1]} does not have: {unknown}")
    assert not problems, "\n".join(problems)


def _launch(directory: Path, text: str, words: list[str]) -> tuple[ScriptResult, str]:
    """Run one ``python -m accelerate_txn.testing run --fsdp-version V train.py`` line of the docs in
    ``directory`` (holding ``train.py`` = ``text``) and return the job's output, rank by rank."""
    assert words[:4] == ["python", "-m", "accelerate_txn.testing", "run"] and words[4] == "--fsdp-version", words
    (directory / words[6]).write_text(text)
    result = run_script(words[6], words[7:], fsdp_version=int(words[5]), num_processes=2, timeout=TIMEOUT,
                        cwd=directory, env={"PYTHONPATH": str(ROOT)})
    return result, "\n".join(result.output)


def _cli(directory: Path, words: list[str]) -> subprocess.CompletedProcess[str]:
    assert words[0] == "accelerate-txn", words
    return subprocess.run([sys.executable, "-m", "accelerate_txn", *words[1:]], cwd=directory, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_the_quickstart_script_runs_under_its_commands_on_fsdp2_and_fsdp1(tmp_path: Path) -> None:
    text = script("docs/quickstart.md", "train.py")
    commands = commands_after("docs/quickstart.md", "Try it on a laptop first")
    assert [words[:6] for words in commands[:2]] == [
        ["python", "-m", "accelerate_txn.testing", "run", "--fsdp-version", "2"]] * 2
    for version, directory in (("2", tmp_path / "fsdp2"), ("1", tmp_path / "fsdp1")):
        directory.mkdir()
        first, second, verify = ([*words[:5], version, *words[6:]] if words[0] == "python" else words
                                 for words in commands)
        result, output = _launch(directory, text, first)
        assert result.returncode == 0, output
        assert f"saved {directory / 'runs/exp1/checkpoints/checkpoint_0'}" in output, output
        result, output = _launch(directory, text, second)
        assert result.returncode == 0, output
        assert "resumed from runs/exp1/checkpoints/checkpoint_0" in output, output
        assert f"saved {directory / 'runs/exp1/checkpoints/checkpoint_1'}" in output, output
        checked = _cli(directory, verify)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    # "an FSDP2 run refuses an FSDP1 checkpoint, naming what differs" (and the other way round)
    result, output = _launch(tmp_path / "fsdp1", text, [*commands[0][:5], "2", *commands[0][6:]])
    assert result.returncode != 0, output
    assert "was saved for a different training configuration" in output, output


@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_the_training_loop_script_resumes_after_a_kill(tmp_path: Path) -> None:
    text = script("docs/training-loop.md", "train.py")
    small = text.replace("SAVE_EVERY = 1000\n", "SAVE_EVERY = 3\n").replace("MAX_STEPS = 100_000\n", "MAX_STEPS = 10\n")
    assert small.count("= 3\n") == 1 and "MAX_STEPS = 10\n" in small, "the constants the test shrinks moved"
    (tmp_path / "train.py").write_text(small)
    checkpoints = tmp_path / "runs" / "exp1" / "checkpoints"
    killed = run_script("train.py", fsdp_version=2, timeout=TIMEOUT, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)},
                        kill_on_path=checkpoints / "checkpoint_1")
    assert killed.returncode == 137, "\n".join(killed.output)  # killed once checkpoint_1 was published
    resumed = run_script("train.py", fsdp_version=2, timeout=TIMEOUT, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
    output = "\n".join(resumed.output)
    assert resumed.returncode == 0, output
    assert re.search(r"resumed from runs/exp1/checkpoints/checkpoint_[12] at step [69]\b", output), output
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_0", "checkpoint_1", "checkpoint_2"]
    fsdp1 = tmp_path / "fsdp1"
    fsdp1.mkdir()
    (fsdp1 / "train.py").write_text(small)
    ran = run_script("train.py", fsdp_version=1, timeout=TIMEOUT, cwd=fsdp1, env={"PYTHONPATH": str(ROOT)})
    assert ran.returncode == 0, "\n".join(ran.output)
    assert (fsdp1 / "runs/exp1/checkpoints/checkpoint_2/checkpoint_manifest.json").is_file()


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_quickstart_script_on_fsdp1_without_original_parameters_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """FSDP1 with ``use_orig_params=False`` replaces the parameters the optimizer holds when model and optimizer are
    prepared together: the optimizer then updates nothing, and a save cannot map its state (native Accelerate fails
    with a bare ``KeyError``). The save is refused on every rank with the library's error, naming the fix."""
    (tmp_path / "train.py").write_text(script("docs/quickstart.md", "train.py"))
    result = run_script("train.py", fsdp_version=1, timeout=TIMEOUT, cwd=tmp_path,
                        env={"PYTHONPATH": str(ROOT), "FSDP_USE_ORIG_PARAMS": "false"})
    assert result.returncode != 0
    for output in result.output:
        assert "CheckpointConfigurationError: Checkpoint preflight failed on rank(s) [0, 1]" in output, output
        assert "are not parameters of the FSDP1 model" in output and "use_orig_params=True" in output, output
        assert "KeyError" not in output, output
    assert not (tmp_path / "runs/exp1/checkpoints/checkpoint_0").exists()
