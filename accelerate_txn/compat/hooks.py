"""Install a patch when a module is imported (standard library only, no torch at import): the import hook both
front ends share (``accelerate.autopatch`` for ``accelerate.accelerator``, ``trainer.autopatch`` for
``transformers.trainer``).

``import accelerate_txn`` must wrap what it protects without importing it. If the module is already imported,
:func:`when_imported` installs at once; otherwise a meta-path finder waits for the module to be imported and installs
right after its module code ran, so ``import accelerate_txn`` before ``import accelerate`` works the same, and a
process that never imports Accelerate (the offline CLI) never pays for torch. An installation failure never breaks
the user's import (:func:`guarded`): it is reported as a warning saying what is not protected.

Import cost: this module runs on every ``import accelerate_txn``, so it imports only ``sys`` at import time. The
finder and the loader follow the import protocol by their methods (``find_spec``; ``create_module`` and
``exec_module``) instead of subclassing ``importlib.abc``, whose import pulls in ``importlib.resources``,
``pathlib``, ``tempfile`` and ``shutil`` (about 10 ms, three times that where bytecode is not cached); ``typing``
and ``types`` are needed by type checkers only.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; type checkers treat the name as True
if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any


def guarded(install: Any, what: str, unprotected: str) -> Any:
    """``install`` made safe for an import hook: a failure never breaks the user's import, it is a warning that
    says what could not be wrapped (``what``) and what is therefore unprotected."""

    def run() -> None:
        try:
            install()
        except Exception as exc:  # never turn the user's import into an error
            import warnings

            warnings.warn(f"accelerate-txn could not wrap {what} ({type(exc).__name__}: {exc}): {unprotected} NOT "
                          "protected in this process.", RuntimeWarning, stacklevel=2)

    return run


def _nothing() -> None:
    pass


class _Loader:
    """Runs the real loader, then installs; every other loader attribute is the real loader's."""

    def __init__(self, loader: Any, target: str) -> None:
        self._loader = loader
        self._target = target

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, get_resource_reader, ...
        if name in ("_loader", "_target"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module carries the real loader, as if this wrapper had never been there.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None and module.__spec__.loader is self:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _remove_finder(self._target)
        _HOOKS.pop(self._target, _nothing)()


class _Finder:
    """A meta-path finder (``importlib.abc.MetaPathFinder`` by protocol) for one module, ``target``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != self.target:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _Finder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader, fullname)
                return spec
            if spec is not None:
                return spec
        return None


_HOOKS: dict[str, Any] = {}  # target module -> what to call once it was imported


def _remove_finder(target: str) -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path
                        if not (isinstance(finder, _Finder) and finder.target == target)]


def when_imported(target: str, install: Any) -> None:
    """Call ``install()`` now if the module ``target`` is imported, else right after it is (once). ``install`` must
    never raise (it runs inside the user's import: wrap it with :func:`guarded`)."""
    if target in sys.modules:
        install()
    elif not any(isinstance(finder, _Finder) and finder.target == target for finder in sys.meta_path):
        _HOOKS[target] = install
        sys.meta_path.insert(0, _Finder(target))
