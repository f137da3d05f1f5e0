#!/usr/bin/env python3
"""Run the version matrix: the pytest arguments after ``--`` on (Python, torch, Accelerate) jobs of the validated
table, accelerate_txn/validated.json (``make test-matrix``; .ci/run calls it after ``make test``).

Which jobs: every job of the table, or with ``--cover`` (what CI runs) a covering set: every torch minor, every
Accelerate minor and every Python of the table at least once -- the diagonal of the rectangle (each torch minor
with the oldest Accelerate minor of its rows not yet covered), its edges (the newest torch with its newest
Accelerate; the default torch with its oldest and newest Accelerate) -- see :func:`cover`. ``--rectangle``
runs every torch release of the table with every Accelerate release of the table (make test-matrix-full).
``--fsdp2-tests`` names a second set of tests (MATRIX_FSDP2_TESTS), run as well on the rows the table marks
``"fsdp2": true``, where the protected FSDP2 path is on.

Standard library only, so any Python 3.10+ can drive it. Installs use uv (pinned in constraints.txt, installed
into the matrix folder first; ``--installer pip`` uses pip instead): it unpacks a CUDA build of torch in seconds
where pip takes minutes, and links the files from its cache (kept inside the matrix folder, deleted with it).
One virtual environment per (Python, torch): torch is installed once and Accelerate is swapped inside it job
after job; the environment is deleted when its jobs are done (several GB each) unless ``--keep``. The next
group's environment is installed in the background while the current group's tests run (its log is printed when
the group starts). The job equal to the default pins (this interpreter's Python, torch and Accelerate from
constraints.txt) is skipped: ``make test`` already runs the whole suite there. Every job checks that the
installed versions are the ones asked for and that accelerate_txn's evidence protects them (every release of the
table has its evidence recorded in accelerate_txn/evidence.json), then runs pytest with the override variables
removed, so the protected path runs because the evidence says so. pytest's exit
code 5 (no tests collected) is a failure.

Pins: the versions in constraints.txt apply, except torch and Accelerate, which come from the table. Some pins
name releases that do not support an older Python (numpy 2.4 and filelock 4.3 need Python 3.11+): for a Python
other than this interpreter's, when the pinned set does not resolve the matrix says so and retries with the
table's torch and Accelerate pinned only. The machine-wide pip constraint (a torch cap on some machines) does
not apply to the matrix's own installs (uv does not read pip's configuration; pip gets these pins instead); its
find-links folder is still searched (the CPU build of torch on the machine's disk). Nothing outside the matrix
folder is changed.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "accelerate_txn" / "validated.json"
CONSTRAINTS = ROOT / "constraints.txt"
OVERRIDE = "ACCELERATE_TXN_ALLOW_UNVALIDATED"
UNSET = (OVERRIDE, "ACCELERATE_TXN_PATCHES")
NOISE = re.compile(r"^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$")
PIP = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check")
_REMOVALS: list[subprocess.Popen[bytes]] = []


@dataclass(frozen=True)
class Job:
    python: str
    torch: str
    accelerate: str
    in_table: bool = True  # False: a cell of the rectangle that no table row names (protected by the evidence too)
    fsdp2: bool = field(default=False, compare=False)  # its table row says "fsdp2": true (never outside the table)

    def __str__(self) -> str:
        return f"Python {self.python}, torch {self.torch}, accelerate {self.accelerate}"


@dataclass
class Outcome:
    job: Job
    install_s: float = 0.0
    test_s: float = 0.0
    result: str = "not run"
    finished: str = ""  # when the job ended, UTC ("2026-12-02 16:40")


def jobs() -> list[Job]:
    table = json.loads(TABLE.read_text(encoding="utf-8"))
    return [Job(python, row["torch"], row["accelerate"], fsdp2=bool(row.get("fsdp2", False)))
            for row in table["pairs"] for python in row["python"]]


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def rectangle(python: str) -> list[Job]:
    """Every torch release of the table with every Accelerate release of the table (the whole rectangle of
    validated minor series), on one Python: the table's own pairs and every other combination of the two."""
    fsdp2 = {(job.torch, job.accelerate): job.fsdp2 for job in jobs()}  # the table's pairs
    torches = sorted({torch for torch, _ in fsdp2}, key=_release_key)
    accelerates = sorted({accelerate for _, accelerate in fsdp2}, key=_release_key)
    return [Job(python, torch, accelerate, (torch, accelerate) in fsdp2, fsdp2.get((torch, accelerate), False))
            for torch in torches for accelerate in accelerates]


def _minor(release: str) -> str:
    return ".".join(release.split(".")[:2])


def cover(table: list[Job], default_torch: str) -> list[Job]:
    """A covering set of the table's jobs (``--cover``, what CI runs): every torch minor, every Accelerate minor
    and every Python of the table at least once, in this order of choice --

    1. the diagonal: each torch minor, oldest first, with the oldest Accelerate minor of its rows not yet chosen
       (its newest Accelerate when all of its rows' minors are chosen already);
    2. the edges: the newest torch with its newest Accelerate, the default torch with its oldest and newest;
    3. any Accelerate minor still missing, on the default torch (else the newest torch that has it);
    4. any Python still missing, with its first row.

    The table's own order is kept. Every row outside this set passed when it was added (make test-matrix-table
    runs them all again), and make test-matrix-full runs the whole rectangle."""
    chosen: set[Job] = set()
    torches = sorted({_minor(job.torch) for job in table}, key=_release_key)

    def rows(torch_minor: str) -> list[Job]:
        return sorted((job for job in table if _minor(job.torch) == torch_minor),
                      key=lambda job: (_release_key(job.accelerate), job.python))

    for torch_minor in torches:
        named = {_minor(job.accelerate) for job in chosen}
        options = rows(torch_minor)
        fresh = [job for job in options if _minor(job.accelerate) not in named]
        chosen.add(fresh[0] if fresh else options[-1])
    chosen.add(rows(torches[-1])[-1])
    default_rows = rows(_minor(default_torch))
    if default_rows:
        chosen.update((default_rows[0], default_rows[-1]))
    for accelerate in sorted({_minor(job.accelerate) for job in table}, key=_release_key):
        if accelerate not in {_minor(job.accelerate) for job in chosen}:
            having = [job for job in table if _minor(job.accelerate) == accelerate]
            on_default = [job for job in having if _minor(job.torch) == _minor(default_torch)]
            chosen.add((on_default or sorted(having, key=lambda job: _release_key(job.torch)))[-1])
    for python in sorted({job.python for job in table}):
        if python not in {job.python for job in chosen}:
            chosen.add(next(job for job in table if job.python == python))
    return [job for job in table if job in chosen]


def pins() -> dict[str, str]:
    found = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            found[name.strip().lower()] = version.strip()
    return found


def host_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _say(message: str) -> None:
    print(f"[matrix] {message}", flush=True)


KEEP_CACHE_FREE_BYTES = 40 * 2**30  # below this much free disk, uv's cache is emptied between groups
BACKGROUND = ("nice", "-n", "19")  # work that overlaps the tests takes only what they leave idle of the cores


def _run(command: list[str], env: dict[str, str], cwd: Path = ROOT, sink: list[str] | None = None) -> int:
    """Run ``command``, streaming its output without the machine's find-links noise (into ``sink`` instead of
    standard output when given: an environment prepared in the background prints its log when its turn comes, and
    runs at the lowest CPU priority meanwhile); its exit code."""
    command = command if sink is None else [*BACKGROUND, *command]
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if NOISE.match(line.rstrip("\n")):
            continue
        if sink is None:
            print(line, end="", flush=True)
        else:
            sink.append(line)
    return process.wait()


def find_interpreter(version: str) -> str:
    """An interpreter for Python ``version`` ("3.13"): this one, ``python3.13`` on PATH, or pyenv's newest 3.13.x."""
    if version == host_python():
        return sys.executable
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    installed = sorted(glob.glob(os.path.join(pyenv_root, "versions", f"{version}.*", "bin", "python")),
                       key=lambda path: [int(part) for part in re.findall(r"\d+", Path(path).parents[1].name)])
    candidates = [shutil.which(f"python{version}"), *reversed(installed)]
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, check=False)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    raise SystemExit(f"[matrix] No Python {version} interpreter found (looked for python{version} on PATH and in "
                     f"{pyenv_root}/versions). Install it (for example `pyenv install {version}`) and run again.")


def find_links() -> list[str]:
    """The folders of wheels pip is configured to search (``find-links``: the CPU build of torch lies there on
    some machines), for uv, which does not read pip's configuration."""
    configured = os.environ.get("PIP_FIND_LINKS")
    if configured is None:
        probe = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                               capture_output=True, text=True, check=False)
        configured = probe.stdout if probe.returncode == 0 else ""
    return [location for location in configured.split() if os.path.isdir(location)]


@dataclass(frozen=True)
class Installer:
    """How packages get into an environment: uv (``uv`` is its binary; its cache lives in ``cache``) or pip."""
    uv: str | None = None
    cache: Path | None = None
    links: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return "uv" if self.uv else "pip"

    def env(self) -> dict[str, str]:
        # Bytecode compiled at install (in the background, for a prepared group), not at the first import by a test.
        return {"UV_CACHE_DIR": str(self.cache), "UV_NO_PROGRESS": "1", "UV_COMPILE_BYTECODE": "1"} if self.uv else {}

    def venv(self, interpreter: str, directory: Path) -> list[str]:
        if self.uv:
            return [self.uv, "venv", "--quiet", "--python", interpreter, str(directory)]
        return [interpreter, "-m", "venv", str(directory)]

    def install(self, python: Path, constraints: Path, requirements: tuple[str, ...]) -> list[str]:
        if self.uv:
            links = [argument for location in self.links for argument in ("--find-links", location)]
            return [self.uv, "pip", "install", "--quiet", "--python", str(python), "--constraint", str(constraints),
                    *links, *requirements]
        return [str(python), *PIP, *requirements]  # the constraints come through PIP_CONSTRAINT (Environment.env)

    def clean(self) -> None:
        """Free uv's cache between groups, when no install runs. The environments hold hard links to its files, so
        what a removed group used stays on disk while the cache keeps it: torch's own files (a release per group)
        are dropped every time; the rest (the CUDA libraries, which groups of one CUDA version share, and the small
        packages every group installs) is kept while the disk has room, then dropped as well."""
        if not self.uv:
            return
        env = {**os.environ, **self.env()}
        assert self.cache is not None
        self.cache.mkdir(parents=True, exist_ok=True)
        only = [] if shutil.disk_usage(self.cache).free < KEEP_CACHE_FREE_BYTES else ["torch"]
        _run([self.uv, "cache", "clean", "--quiet", *only], env)


def uv_installer(root: Path) -> Installer:
    """uv at the version constraints.txt pins, installed into ``root``/uv-tool (once), with its cache beside it;
    pip where uv cannot be installed (said once: the matrix still runs, only slower)."""
    tool = root / "uv-tool"
    binary = tool / "bin" / "uv"
    version = pins().get("uv")
    if not binary.exists():
        root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        code = _run([sys.executable, "-m", "venv", str(tool)], env)
        code = code or _run([str(tool / "bin" / "python"), *PIP, f"uv=={version}" if version else "uv"], env)
        if code or not binary.exists():
            _say(f"installing uv into {tool} failed (exit {code}); installing with pip instead (slower)")
            return Installer()
    return Installer(str(binary), root / "uv-cache", tuple(find_links()))


class Environment:
    """One virtual environment for one (Python, torch); Accelerate is swapped inside it."""

    def __init__(self, directory: Path, python: str, torch: str, constraints: Path, installer: Installer,
                 sink: list[str] | None = None) -> None:
        self.directory, self.python, self.torch = directory, python, torch
        self.bin = directory / "bin" / "python"
        self.constraints = constraints
        self.installer = installer
        self.editable_installed = False
        self.accelerate: str | None = None  # the Accelerate release installed last
        self.sink = sink

    def env(self, override: bool = False) -> dict[str, str]:
        """The environment for the installer and pytest: no override variable set, unless ``override``."""
        env = {key: value for key, value in os.environ.items() if key not in UNSET}
        if override:
            env[OVERRIDE] = "1"
        # Replaces the machine-wide constraint file (pip config), which may cap torch below the table's release.
        env["PIP_CONSTRAINT"] = str(self.constraints)
        env.update(self.installer.env())
        return env

    def pip(self, *requirements: str) -> int:
        return _run(self.installer.install(self.bin, self.constraints, requirements), self.env(), sink=self.sink)

    def create(self, *requirements: str) -> int:
        """A fresh environment with torch installed (and ``requirements``, in the same resolution)."""
        shutil.rmtree(self.directory, ignore_errors=True)
        code = _run(self.installer.venv(find_interpreter(self.python), self.directory), self.env(), sink=self.sink)
        return code or self.pip(f"torch=={self.torch}", *requirements)

    def use_accelerate(self, version: str) -> int:
        if self.accelerate == version:
            return 0
        if self.editable_installed:
            code = self.pip(f"accelerate=={version}")
        else:
            code = self.pip(f"accelerate=={version}", "-e", ".[test]")
            self.editable_installed = code == 0
        self.accelerate = version if code == 0 else None
        return code

    def check(self, job: Job) -> str | None:
        """Why this environment is not the job's pair, protected by accelerate_txn's evidence, or None."""
        code = ("import json, sys, torch, accelerate\n"
                "from accelerate_txn.runtime.versions import unprotected\n"
                "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], 'torch': torch.__version__,"
                " 'accelerate': accelerate.__version__, 'unprotected': unprotected()}))")
        probe = subprocess.run([str(self.bin), "-c", code], cwd=ROOT, env=self.env(), capture_output=True, text=True,
                               check=False)
        if probe.returncode != 0:
            return f"importing torch, accelerate and accelerate_txn failed:\n{probe.stderr[-3000:]}"
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
        _say(f"installed: Python {seen['python']}, torch {seen['torch']}, accelerate {seen['accelerate']}")
        if (seen["python"], seen["torch"].split("+")[0], seen["accelerate"]) != (job.python, job.torch, job.accelerate):
            return f"expected {job}, found {seen}"
        if seen["unprotected"]:  # every release of the table and the rectangle has its evidence recorded
            return f"accelerate_txn's evidence does not protect this pair: {seen['unprotected']}"
        return None

    def remove(self) -> None:
        """Delete the environment in the background (several GB take a while) so the next one starts at once;
        :func:`main` waits for every removal before it exits."""
        self.constraints.unlink(missing_ok=True)
        if self.directory.exists():
            trash = self.directory.with_name(f"{self.directory.name}.removing-{os.getpid()}")
            self.directory.rename(trash)
            _REMOVALS.append(subprocess.Popen([*BACKGROUND, "rm", "-rf", str(trash)]))


def constraints_file(directory: Path, keep_pins: bool, drop: tuple[str, ...] = ("torch", "accelerate")) -> Path:
    """constraints.txt without its lines for ``drop`` (the releases the job installs itself), or without any pin
    (``keep_pins`` false), beside ``directory``."""
    path = directory.parent / f"{directory.name}.constraints.txt"
    lines = [f"{name}=={version}" for name, version in pins().items() if keep_pins and name not in drop]
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


@dataclass
class Prepared:
    """An environment with torch installed (or the installer's exit code that says why not), and what it took."""
    env: Environment
    code: int
    create_s: float
    log: list[str] | None  # what the installer printed, for an environment created in the background; else None


def prepare(python: str, torch: str, accelerate: str, root: Path, installer: Installer, quiet: bool) -> Prepared:
    """The virtual environment of one (Python, torch) with torch, the group's first Accelerate release and this
    package (its test extra) installed. ``quiet``: collect the installer's output instead of printing it (the next
    group's environment is prepared while the current group's tests run: the download and unpacking of several GB
    overlap the tests instead of adding to them). An Accelerate install that fails here is left to the job, which
    tries again and reports it."""
    directory = root / f"py{python}-torch{torch}"
    root.mkdir(parents=True, exist_ok=True)
    log: list[str] | None = [] if quiet else None
    if not quiet:
        _say(f"== Python {python}, torch {torch}: creating {directory.relative_to(ROOT)} ==")
    started = time.monotonic()
    env = Environment(directory, python, torch, constraints_file(directory, keep_pins=True), installer, sink=log)
    code = env.create()
    if code and python != host_python():
        message = (f"[matrix] constraints.txt's pins do not all install on Python {python}; retrying with only "
                   "torch and accelerate pinned (from the table)\n")
        if log is None:
            print(message, end="", flush=True)
        else:
            log.append(message)
        env.remove()
        env = Environment(directory, python, torch, constraints_file(directory, keep_pins=False), installer,
                          sink=log)
        code = env.create()
    if code == 0:
        env.use_accelerate(accelerate)
    env.sink = None
    return Prepared(env, code, time.monotonic() - started, log)


def run_group(python: str, torch: str, group: list[Job], pytest_args: list[str], fsdp2_args: list[str],
              prepared: Prepared, keep: bool, report: Callable[[Outcome], None]) -> None:
    """Run the group's jobs in its environment; ``report`` gets each outcome as soon as its job ends."""
    outcomes = [Outcome(job) for job in group]
    env, code, create_s = prepared.env, prepared.code, prepared.create_s
    if prepared.log is not None:
        _say(f"== Python {python}, torch {torch}: {env.directory.relative_to(ROOT)}, created while the previous "
             "group's tests ran; its install log: ==")
        print("".join(prepared.log), end="", flush=True)
    _say(f"venv + torch {torch}, accelerate {env.accelerate or '(not yet)'} and this package on Python {python} "
         f"({env.installer.name}): {create_s:.0f} s (exit {code})")
    try:
        for index, outcome in enumerate(outcomes):
            run_job(env, code, create_s if index == 0 else 0.0, outcome, pytest_args, fsdp2_args)
            outcome.finished = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
            report(outcome)
    finally:
        if not keep:
            env.remove()
            _say(f"removing {env.directory.relative_to(ROOT)} (in the background)")


def run_job(env: Environment, code: int, create_s: float, outcome: Outcome, pytest_args: list[str],
            fsdp2_args: Sequence[str] = ()) -> None:
    """One job in its group's environment (``code``: the environment's exit code); the result into ``outcome``.
    ``fsdp2_args`` (``--fsdp2-tests``) run as a second pytest on a row marked ``"fsdp2": true``."""
    job = outcome.job
    if code:
        outcome.result = f"environment failed ({env.installer.name} exit {code})"
        return
    step = time.monotonic()
    install_exit = env.use_accelerate(job.accelerate)
    failure = (f"installing accelerate failed ({env.installer.name} exit {install_exit})" if install_exit
               else env.check(job))
    outcome.install_s = time.monotonic() - step + create_s
    _say(f"{job}: install {time.monotonic() - step:.0f} s")
    if failure:
        outcome.result = failure
        _say(f"FAILED {job}: {failure}")
        return
    step = time.monotonic()
    runs = [pytest_args] + ([list(fsdp2_args)] if fsdp2_args and job.fsdp2 else [])
    for args in runs:
        _say(f"{job}: pytest {shlex.join(args)}")
        rc = _run([str(env.bin), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                  env.env())
        outcome.result = {0: "passed", 5: "FAILED: pytest collected no tests (exit 5)"}.get(rc, f"FAILED: pytest exit {rc}")
        if rc:
            if args is not pytest_args:
                outcome.result += " (the FSDP2 tests)"
            break
    outcome.test_s = time.monotonic() - step
    _say(f"{job}: tests {outcome.test_s:.0f} s, {outcome.result}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="only these Pythons (repeatable), e.g. 3.13")
    parser.add_argument("--torch", action="append", help="only these torch releases (repeatable), e.g. 2.7.0")
    parser.add_argument("--accelerate", action="append", help="only these Accelerate releases (repeatable)")
    parser.add_argument("--cover", action="store_true",
                        help="only a covering set of the table: every torch minor, every Accelerate minor and every "
                             "Python at least once (the diagonal and the edges; what CI runs); ignored when --python, "
                             "--torch or --accelerate name the jobs")
    parser.add_argument("--include-default", action="store_true", help="also run the job that make test covers")
    parser.add_argument("--installer", choices=("uv", "pip"), default="uv",
                        help="what installs the environments (default uv, pinned in constraints.txt)")
    parser.add_argument("--keep", action="store_true", help="keep the environments (default: delete each when done)")
    parser.add_argument("--envs", type=Path, default=ROOT / ".venv-matrix", help="where environments are created")
    parser.add_argument("--rectangle", action="store_true",
                        help="every torch release of the table with every Accelerate release of the table, on one "
                             "Python (this interpreter's, or the first --python); every cell runs without the override: "
                             "the evidence protects it (make test-matrix-full)")
    parser.add_argument("--record", type=Path,
                        help="write the results, one cell per (torch, Accelerate), as Markdown to this file")
    parser.add_argument("--resume", action="store_true",
                        help="with --record: keep the cells that passed in the record's last run with the same pytest "
                             "arguments (its .json beside it) and run only the others (a long run continues where "
                             "it stopped)")
    parser.add_argument("--fsdp2-tests", default="", metavar="PYTEST_ARGS",
                        help="one string of pytest arguments run as well on each table row marked \"fsdp2\": true "
                             "(after the tests given after --), e.g. \"tests/fsdp/test_fsdp2.py -k 'resume or flipped'\"")
    parser.add_argument("--list", action="store_true", help="print the jobs and exit")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs in every job")
    options = parser.parse_args(argv)

    default = pins()
    candidates = rectangle((options.python or [host_python()])[0]) if options.rectangle else jobs()
    if options.cover and not (options.rectangle or options.python or options.torch or options.accelerate):
        candidates = cover(candidates, default["torch"])  # a filter names its jobs: they run, covering set or not
    selected = [job for job in candidates
                if (options.rectangle or not options.python or job.python in options.python)
                and (not options.torch or job.torch in options.torch)
                and (not options.accelerate or job.accelerate in options.accelerate)
                and (options.include_default
                     or (job.python, job.torch, job.accelerate) != (host_python(), default["torch"], default["accelerate"]))]
    if options.list:
        for job in selected:
            print(f"{job}{' (+ FSDP2 tests)' if job.fsdp2 and options.fsdp2_tests else ''}")
        return 0
    if not selected:
        _say("no job matches the filters")
        return 1
    if not options.pytest_args:
        parser.error("give the pytest arguments after --")

    # What a record's cells ran: the tests after --, and the FSDP2 tests when given (--resume compares both).
    recorded_args = options.pytest_args + (["--fsdp2-tests", options.fsdp2_tests] if options.fsdp2_tests else [])
    kept: list[Outcome] = []
    if options.resume and options.record is not None:
        kept = [outcome for outcome in load_record(options.record, recorded_args) if outcome.job in selected]
        selected = [job for job in selected if job not in {outcome.job for outcome in kept}]
        _say(f"--resume: {len(kept)} cells passed before with these pytest arguments; {len(selected)} to run")
    groups: dict[tuple[str, str], list[Job]] = {}
    for job in selected:
        groups.setdefault((job.python, job.torch), []).append(job)
    started = time.monotonic()
    for stale in options.envs.glob("*.removing-*"):  # left by an interrupted run
        shutil.rmtree(stale, ignore_errors=True)
    outcomes: list[Outcome] = list(kept)

    def report(outcome: Outcome) -> None:  # the record is rewritten after every job: an interrupted run keeps it
        outcomes.append(outcome)
        if options.record is not None:
            done = {o.job for o in outcomes}
            write_record(options.record, outcomes, [job for job in selected if job not in done], argv,
                         recorded_args)

    root = options.envs.resolve()
    installer = uv_installer(root) if options.installer == "uv" else Installer()
    keys = list(groups)
    first = {key: group[0].accelerate for key, group in groups.items()}
    # One environment ahead: the next (Python, torch) is installed in the background while this group's tests run.
    with ThreadPoolExecutor(max_workers=1) as ahead:
        upcoming: Future[Prepared] | None = None
        try:
            for index, (python, torch) in enumerate(keys):
                prepared = (upcoming.result() if upcoming is not None
                            else prepare(python, torch, first[(python, torch)], root, installer, quiet=False))
                installer.clean()  # nothing installs at this point: the previous group is done, this one is ready
                upcoming = (ahead.submit(prepare, *keys[index + 1], first[keys[index + 1]], root, installer, True)
                            if index + 1 < len(keys) else None)
                run_group(python, torch, groups[(python, torch)], options.pytest_args,
                          shlex.split(options.fsdp2_tests), prepared, options.keep, report)
        finally:
            if upcoming is not None:  # interrupted: the environment prepared ahead is not used
                with contextlib.suppress(Exception):
                    upcoming.result().env.remove()
            for removal in _REMOVALS:
                removal.wait()

    _say(f"== summary ({time.monotonic() - started:.0f} s in all) ==")
    for outcome in outcomes:
        _say(f"{outcome.job!s:<48} install {outcome.install_s:5.0f} s  tests {outcome.test_s:5.0f} s  {outcome.result}")
    failed = sum(outcome.result != "passed" for outcome in outcomes)
    print(f"matrix: {len(outcomes) - failed} passed, {failed} failed", flush=True)
    if options.record is not None:
        _say(f"results written to {options.record} (and {options.record.with_suffix('.json').name} beside it)")
    return 1 if failed else 0


def _cell(outcome: Outcome) -> str:
    if outcome.result == "passed":
        return "passed"
    if outcome.result.startswith("FAILED: pytest"):
        return "**tests failed**"
    return "not installable" if re.search(r"\((uv|pip) exit \d+\)", outcome.result) else "**failed**"


def write_record(path: Path, outcomes: list[Outcome], pending: list[Job], argv: list[str],
                 pytest_args: list[str]) -> None:
    """The record as Markdown (``path``) and as JSON beside it (what ``--resume`` reads)."""
    path.write_text(record(outcomes, argv, pending), encoding="utf-8")
    cells = [asdict(outcome) for outcome in outcomes]
    path.with_suffix(".json").write_text(json.dumps({"pytest_args": pytest_args, "cells": cells}, indent=1) + "\n",
                                         encoding="utf-8")


def load_record(path: Path, pytest_args: list[str]) -> list[Outcome]:
    """The cells of an earlier record that passed with the same pytest arguments (none if there is no record)."""
    try:
        saved = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    if saved.get("pytest_args") != pytest_args:
        _say(f"--resume: {path.with_suffix('.json')} was run with other pytest arguments; running every cell")
        return []
    return [Outcome(**{**cell, "job": Job(**cell["job"])}) for cell in saved["cells"] if cell["result"] == "passed"]


def record(outcomes: list[Outcome], argv: list[str], pending: Sequence[Job] = ()) -> str:
    """The results as Markdown: when, the command, and one cell per (torch, Accelerate); a table pair's cell is
    marked "(table)"; ``pending`` cells (not run yet) are shown as such."""
    jobs_shown = [o.job for o in outcomes] + list(pending)
    torches = sorted({job.torch for job in jobs_shown}, key=_release_key)
    accelerates = sorted({job.accelerate for job in jobs_shown}, key=_release_key)
    cells = {(o.job.torch, o.job.accelerate): o for o in outcomes}
    pythons = sorted({job.python for job in jobs_shown})
    passed = sum(o.result == "passed" for o in outcomes)
    dates = sorted(o.finished for o in outcomes if o.finished)
    when = f"from {dates[0]} to {dates[-1]} UTC" if dates else time.strftime("on %Y-%m-%d %H:%M UTC", time.gmtime())
    minutes = sum(o.install_s + o.test_s for o in outcomes) / 60
    state = (f", {len(pending)} not run yet (the run was interrupted or is going on; `--resume` continues it)"
             if pending else "")
    lines = [
        "<!-- Written by .ci/matrix.py --record (make test-matrix-full); do not edit by hand. -->",
        "",
        f"Cells run {when}: `python3 .ci/matrix.py {shlex.join(argv)}` on Python {', '.join(pythons)}, "
        f"{os.cpu_count()} CPU cores, {minutes:.0f} minutes of installs and tests; "
        f"{len(outcomes) + len(pending)} cells, {passed} passed, {len(outcomes) - passed} not{state}. "
        "\"(table)\" marks a pair of the validated table; every cell ran without "
        "`ACCELERATE_TXN_ALLOW_UNVALIDATED`, protected by the evidence (accelerate_txn/evidence.json).",
        "",
        "| torch \\ Accelerate | " + " | ".join(accelerates) + " |",
        "| --- |" + " --- |" * len(accelerates),
    ]
    waiting = {(job.torch, job.accelerate) for job in pending}
    for torch in torches:
        row = []
        for accelerate in accelerates:
            outcome = cells.get((torch, accelerate))
            if outcome is not None:
                row.append(_cell(outcome) + (" (table)" if outcome.job.in_table else ""))
            else:
                row.append("not run yet" if (torch, accelerate) in waiting else "not run")
        lines.append(f"| {torch} | " + " | ".join(row) + " |")
    failures = [o for o in outcomes if o.result != "passed"]
    if failures:
        lines += ["", "Why each cell that did not pass failed:", ""]
        lines += [f"- torch {o.job.torch}, Accelerate {o.job.accelerate}: {o.result.splitlines()[0]}" for o in failures]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
