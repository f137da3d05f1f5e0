"""Run every benchmark once with the settings recorded in docs/benchmarks.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    for script, args in (("bench_checkpoint.py", ["--sizes", "50", "--repeats", "5"]), ("bench_weights.py", [])):
        print(f"== {script} {' '.join(args)}", flush=True)
        subprocess.run([sys.executable, str(HERE / script), *args], check=True, cwd=HERE.parent)
