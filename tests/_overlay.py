"""A changed release of an installed package, for tests of the evidence gate: a directory that shadows the package
(put it first on ``PYTHONPATH``) where every file is the installed one (a symbolic link) except the ones changed.

This is what a new release that changed one private piece looks like to the library: it reads the sources of the
package Python imports. Nothing installed is modified.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path


def installed_package(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not an installed package"
    return Path(next(iter(spec.submodule_search_locations)))


def overlay(name: str, into: Path, changes: dict[str, Callable[[str], str]]) -> Path:
    """A shadow of package ``name`` under ``into`` (returned: the directory to put on ``PYTHONPATH``): each file of
    ``changes`` (a path relative to the package, e.g. ``"utils/fsdp_utils.py"``) is a copy transformed by its
    function, which must change it; everything else links to the installed files."""
    source = installed_package(name)
    target = into / name

    def mirror(directory: Path, copy: Path, changed: dict[str, Callable[[str], str]]) -> None:
        copy.mkdir(parents=True)
        for entry in directory.iterdir():
            if entry.name == "__pycache__":
                continue
            below = {path.split("/", 1)[1]: change for path, change in changed.items()
                     if "/" in path and path.split("/", 1)[0] == entry.name}
            if entry.name in changed:
                text = entry.read_text(encoding="utf-8")
                new = changed[entry.name](text)
                assert new != text, f"the change to {entry} changed nothing"
                (copy / entry.name).write_text(new, encoding="utf-8")
            elif below:
                mirror(entry, copy / entry.name, below)
            else:
                (copy / entry.name).symlink_to(entry)

    mirror(source, target, changes)
    return into


# A release of Accelerate that renamed one parameter of ``load_fsdp_optimizer`` (a function the protected path
# replaces): every protected path of the Accelerate front end relies on its signature.
_RENAMED = "def load_fsdp_optimizer(\n    fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0"


def _renamed_parameter(text: str) -> str:
    assert text.count(_RENAMED) == 1, "load_fsdp_optimizer's definition moved: update tests/_overlay.py"
    return text.replace(_RENAMED, _RENAMED.replace("optimizer_index=0", "index=0"))


def accelerate_with_a_renamed_parameter(into: Path) -> Path:
    """An Accelerate whose ``load_fsdp_optimizer`` calls ``optimizer_index`` ``index`` (``PYTHONPATH`` entry)."""
    return overlay("accelerate", into, {"utils/fsdp_utils.py": _renamed_parameter})


# A release of Accelerate that changed the body of ``save_fsdp_optimizer`` and kept its parameters: the FSDP1 path
# relies on its code (its save writes the optimizer's DCP files), FSDP2 only on its signature (the library replaces
# it), one process and DDP not at all.
_SAVE_OPTIMIZER = re.compile(r"^def save_fsdp_optimizer\([^)]*\):\n", re.MULTILINE)


def _changed_body(text: str) -> str:
    assert len(_SAVE_OPTIMIZER.findall(text)) == 1, "save_fsdp_optimizer's definition moved: update tests/_overlay.py"
    return _SAVE_OPTIMIZER.sub(lambda match: match.group(0) + "    changed_in_this_release = True\n", text)


def accelerate_with_a_changed_fsdp1_save(into: Path) -> Path:
    """An Accelerate whose ``save_fsdp_optimizer`` has one more statement, the same parameters (``PYTHONPATH``
    entry)."""
    return overlay("accelerate", into, {"utils/fsdp_utils.py": _changed_body})


# A release of Accelerate whose ``save_state`` lets the user choose Accelerate's per-rank ``use_dcp=False`` format
# (``save_fsdp_model``/``save_fsdp_optimizer`` take it; no release up to 1.16 passes it from ``save_state``).
_SAVE_STATE = ("    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, "
               "**save_model_func_kwargs):\n")
_SAVES = ("save_fsdp_model(self.state.fsdp_plugin, self, model, output_dir, i)",
          "save_fsdp_optimizer(self.state.fsdp_plugin, self, opt, self._models[i], output_dir, i)")


def _use_dcp_choice(text: str) -> str:
    assert text.count(_SAVE_STATE) == 1 and all(text.count(call) == 1 for call in _SAVES), \
        "Accelerator.save_state moved: update tests/_overlay.py"
    text = text.replace(_SAVE_STATE, _SAVE_STATE.replace("safe_serialization: bool = True,",
                                                         "safe_serialization: bool = True, use_dcp: bool = True,"))
    for call in _SAVES:
        text = text.replace(call, call[:-1] + ", use_dcp=use_dcp)")
    return text


def accelerate_with_a_use_dcp_choice(into: Path) -> Path:
    """An Accelerate whose ``save_state(use_dcp=False)`` writes the per-rank format (``PYTHONPATH`` entry)."""
    return overlay("accelerate", into, {"accelerator.py": _use_dcp_choice})
