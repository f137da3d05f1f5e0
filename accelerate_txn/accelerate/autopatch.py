"""Install the Accelerate patch when ``accelerate.accelerator`` is imported (standard library only at import).

``import accelerate_txn`` must wrap ``Accelerator.save_state``/``load_state`` without importing Accelerate (or torch)
itself: the shared import hook (:mod:`accelerate_txn.compat.hooks`) installs :func:`.patch.install` right after
``accelerate.accelerator`` is imported, or at once if it already is. An installation failure never breaks the user's
``import accelerate``: it is reported as a warning saying that checkpoints are not protected.
"""

from __future__ import annotations

from ..compat.hooks import guarded, when_imported

TARGET = "accelerate.accelerator"


def _install_patch() -> None:
    from .patch import install

    install()


_install = guarded(_install_patch, "Accelerator.save_state/load_state", "checkpoints are")


def install_on_import() -> None:
    """Install now if ``accelerate.accelerator`` is imported, else as soon as it is (once)."""
    when_imported(TARGET, _install)
