"""``import accelerate_txn`` stays cheap (issue 21, item 10): what it imports, pinned structurally, not timed.

The import loads six modules of the package (the two import hooks with their packages) and, of the standard
library, ``__future__`` only; torch, Accelerate, wrapt, transformers, ``typing``, ``importlib.abc`` (which pulls in
``importlib.resources``, ``pathlib`` and ``tempfile``) and the library's own heavy modules load on first use. The
patches are still installed, exactly once, when Accelerate (or transformers) is imported afterwards.
``benchmarks/bench_import.py`` measures the time. Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import accelerate_txn

SOURCE_ROOT = str(Path(accelerate_txn.__file__).resolve().parents[1])

# What `import accelerate_txn` adds to a bare interpreter (-S: nothing that site's .pth files import first).
EXPECTED = {"__future__", "accelerate_txn", "accelerate_txn.errors", "accelerate_txn.accelerate",
            "accelerate_txn.accelerate.autopatch", "accelerate_txn.trainer", "accelerate_txn.trainer.autopatch",
            "accelerate_txn.compat", "accelerate_txn.compat.hooks"}
# Deferred to first use: never imported by `import accelerate_txn` alone.
HEAVY = ("torch", "accelerate", "accelerate.accelerator", "wrapt", "numpy", "typing", "importlib.abc",
         "importlib.resources", "pathlib", "tempfile", "accelerate_txn.accelerate.patch",
         "accelerate_txn.accelerate.save", "accelerate_txn.accelerate.load", "accelerate_txn.core.manifest",
         "accelerate_txn.core.ranks", "accelerate_txn.weights")

_PROBE = """\
import json, sys
sys.path.insert(0, {root!r})
{preamble}
before = set(sys.modules)
import accelerate_txn
print(json.dumps({{"added": sorted(set(sys.modules) - before),
                   "heavy": [name for name in {heavy!r} if name in sys.modules]}}))
"""


def _probe(*flags: str, preamble: str = "") -> dict[str, Any]:
    code = _PROBE.format(root=SOURCE_ROOT, preamble=preamble, heavy=HEAVY)
    result = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_import_in_a_bare_interpreter_loads_only_the_light_modules() -> None:
    probe = _probe("-E", "-s", "-S")
    assert set(probe["added"]) == EXPECTED
    assert probe["heavy"] == []


def test_import_in_a_normal_interpreter_imports_no_torch_accelerate_or_deferred_module() -> None:
    probe = _probe()  # with site, as users run it (site may have loaded typing or pathlib before)
    assert not {"torch", "accelerate", "accelerate.accelerator", "wrapt", "numpy"} & set(probe["heavy"])
    assert not set(HEAVY) & set(probe["added"])
    assert {name for name in probe["added"] if name.startswith("accelerate_txn")} == EXPECTED - {"__future__"}


def test_the_probe_sees_heavy_modules_when_they_are_imported() -> None:
    # The check above can fail: after `import accelerate` the same probe reports torch and Accelerate.
    probe = _probe(preamble="import accelerate.accelerator")
    assert {"torch", "accelerate", "accelerate.accelerator"} <= set(probe["heavy"])
    assert "accelerate_txn.accelerate.patch" in probe["added"]  # installed at once: accelerate came first


_LATER_ACCELERATE = """\
import sys
import accelerate_txn
assert "torch" not in sys.modules and "accelerate_txn.accelerate.patch" not in sys.modules
from accelerate_txn.compat.hooks import _Loader
class Real:
    def get_source(self, name):
        return f"source of {name}"
assert _Loader(Real(), "m").get_source("m") == "source of m"  # the wrapper is the real loader for everything else
import accelerate.accelerator as module
import wrapt
from accelerate_txn.compat.hooks import _Finder
wrapper = module.Accelerator.__dict__["save_state"]
assert isinstance(wrapper, wrapt.FunctionWrapper), "not wrapped after a later import of accelerate"
assert not isinstance(wrapper.__wrapped__, wrapt.FunctionWrapper), "wrapped twice"
assert isinstance(module.Accelerator.__dict__["load_state"], wrapt.FunctionWrapper)
assert not any(isinstance(finder, _Finder) and finder.target == "accelerate.accelerator"
           for finder in sys.meta_path), "the finder stayed on sys.meta_path"
assert not isinstance(module.__loader__, _Loader) and not isinstance(module.__spec__.loader, _Loader)
import inspect
assert "def save_state" in inspect.getsource(module.Accelerator)
accelerate_txn.install()  # idempotent
assert not isinstance(module.Accelerator.__dict__["save_state"].__wrapped__, wrapt.FunctionWrapper)
"""


def test_cheap_import_still_patches_accelerate_once_when_it_is_imported_later() -> None:
    result = subprocess.run([sys.executable, "-c", _LATER_ACCELERATE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
