"""Run every benchmark exactly as docs/benchmarks.md records it.

The commands are read from the documentation itself (each code block after a "**Command**" line), so the
settings run here and the settings the recorded figures came from cannot drift apart. A line such as
``MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/bench_checkpoint.py --sizes 50 200 --repeats 3``
runs with that environment variable, with this interpreter in place of ``.venv/bin/python``, from the
repository root. ``--dry-run`` prints the commands without running them.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
_BLOCK = re.compile(r"\*\*Command\*\*[^\n]*\n```[^\n]*\n(?P<body>.*?)\n```", re.DOTALL)
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def recorded_commands(doc: Path = DOC) -> list[tuple[dict[str, str], list[str]]]:
    """``(environment, argv)`` of every command line in the documentation's "**Command**" blocks, in order.

    Comments (``# ...``) are dropped; leading ``NAME=value`` words become the environment; ``.venv/bin/python``
    (or ``python``) becomes this interpreter.
    """
    commands = []
    for block in _BLOCK.finditer(doc.read_text()):
        for line in block.group("body").splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            env = {}
            while words and _ASSIGNMENT.match(words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if not words or Path(words[0]).name not in ("python", "python3"):
                raise ValueError(f"{doc}: cannot run recorded command {line!r}: expected a python command")
            commands.append((env, [sys.executable, *words[1:]]))
    if not commands:
        raise ValueError(f"{doc} records no '**Command**' code block: nothing to run")
    return commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the recorded commands, run nothing")
    args = parser.parse_args(argv)
    for env, command in recorded_commands():
        shown = " ".join([*(f"{k}={v}" for k, v in env.items()), *map(shlex.quote, command)])
        print(f"== {shown}", flush=True)
        if not args.dry_run:
            base = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_",)}
            subprocess.run(command, check=True, cwd=REPO, env={**base, **env})
    return 0


if __name__ == "__main__":
    sys.exit(main())
