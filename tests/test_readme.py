"""The README's complete programs run as pasted (each ```python block with a ``__main__`` guard)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_PROGRAMS = [block for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
             if 'if __name__ == "__main__":' in block]


def test_the_readme_has_a_complete_program() -> None:
    assert _PROGRAMS


@pytest.mark.distributed
@pytest.mark.parametrize("program", _PROGRAMS, ids=lambda block: block.splitlines()[0][:40])
def test_readme_program_runs_as_pasted(program: str, tmp_path: Path) -> None:
    script = tmp_path / "readme_program.py"
    script.write_text(program.replace("/tmp/accelerate-txn-check", str(tmp_path)))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checkpoint_manifest.json" in done.stdout
