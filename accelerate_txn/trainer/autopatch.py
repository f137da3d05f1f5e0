"""Install the Trainer patch when ``transformers.trainer`` is imported (standard library only at import).

``import accelerate_txn`` must protect Trainer checkpoints without importing transformers (or torch) itself: the
shared import hook of :mod:`accelerate_txn.compat.hooks` installs :func:`.patch.install` right after
``transformers.trainer`` is imported, or at once if it already is. A failure never breaks the user's import: it is
reported as a warning saying that Trainer checkpoints are not protected.
"""

from __future__ import annotations

from ..compat.hooks import guarded, when_imported

TARGET = "transformers.trainer"


def _install_patch() -> None:
    from .patch import install

    install()


_install = guarded(_install_patch, "transformers.Trainer", "Trainer checkpoints are")


def install_on_import() -> None:
    """Install now if ``transformers.trainer`` is imported, else as soon as it is (once)."""
    when_imported(TARGET, _install)
