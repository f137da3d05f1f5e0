"""The README as a new user follows it: it says how to install and activate, and its program runs as pasted, twice.

Each ```python block with a ``__main__`` guard is a complete program. The check program keeps its checkpoints in
a project directory under the current one, so a second run resumes from the first run's checkpoint instead of
refusing to overwrite it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
_TEXT = README.read_text()
_PROGRAMS = [block for block in re.findall(r"```python\n(.*?)```", _TEXT, re.DOTALL)
             if 'if __name__ == "__main__":' in block]
_BASH = "\n".join(re.findall(r"```bash\n(.*?)```", _TEXT, re.DOTALL))


def test_the_readme_has_a_complete_program() -> None:
    assert _PROGRAMS


def test_the_readme_shows_how_to_install_and_how_to_activate_the_environment() -> None:
    commands = {line.split("#")[0].strip() for line in _BASH.splitlines()}
    assert "pip install accelerate-txn" in commands, "no install from PyPI"
    assert "pip install -e ." in commands, "no install from a checkout"
    assert "source .venv/bin/activate" in commands, "make builds .venv, but the README never activates it"
    assert ".venv/bin/accelerate-txn --help" in commands, "no way to use .venv without activating it"


def _run(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=300)


_CHECK_PROGRAM = "# check_checkpointing.py"


def test_the_readme_has_the_check_program() -> None:
    assert [block for block in _PROGRAMS if block.startswith(_CHECK_PROGRAM)]


@pytest.mark.distributed
@pytest.mark.parametrize("program", _PROGRAMS, ids=lambda block: block.splitlines()[0][:40])
def test_readme_program_runs_twice_in_a_row_as_pasted(program: str, tmp_path: Path) -> None:
    script = tmp_path / "readme_program.py"
    script.write_text(program)
    outputs = []
    for attempt in ("first", "second"):
        done = _run(script, tmp_path)
        assert done.returncode == 0, f"the {attempt} run failed:\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, f"the {attempt} run printed a traceback:\n{done.stderr[-3000:]}"
        outputs.append((done.stdout.strip().splitlines() or [""])[-1])
    if program.startswith(_CHECK_PROGRAM):  # the second run resumed from the first run's checkpoint
        checkpoints = tmp_path / "check-run" / "checkpoints"
        assert outputs == [
            f"resumed from None; saved {checkpoints / 'checkpoint_0'}",
            f"resumed from check-run/checkpoints/checkpoint_0; saved {checkpoints / 'checkpoint_1'}",
        ]
        assert (checkpoints / "checkpoint_1" / "checkpoint_manifest.json").is_file()
