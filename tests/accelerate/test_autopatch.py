"""``import accelerate_txn`` wraps Accelerate whichever is imported first, and costs no torch import by itself.

Each check runs in a fresh interpreter (the import order is the point)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECKS = {
    "library first": (
        "import sys\n"
        "import accelerate_txn\n"
        "assert 'torch' not in sys.modules and 'accelerate.accelerator' not in sys.modules\n"
        "from accelerate import Accelerator\n"
        "from accelerate_txn.accelerate.patch import installed\n"
        "assert installed(), 'not wrapped after a later import of accelerate'\n"
        "assert type(Accelerator.__dict__['save_state']).__name__ == 'FunctionWrapper'\n"
    ),
    "accelerate first": (
        "from accelerate import Accelerator\n"
        "import accelerate_txn\n"
        "from accelerate_txn.accelerate.patch import installed\n"
        "assert installed()\n"
    ),
    "public names load on use": (
        "import sys\n"
        "import accelerate_txn\n"
        "assert 'accelerate_txn.accelerate.save' not in sys.modules\n"
        "assert callable(accelerate_txn.save_training_checkpoint) and 'accelerate_txn.accelerate.save' in sys.modules\n"
        "assert set(accelerate_txn.__all__) <= set(dir(accelerate_txn))\n"
        "try:\n"
        "    accelerate_txn.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('unknown attribute resolved')\n"
    ),
    "uninstall then reinstall": (
        "import accelerate_txn, accelerate.accelerator as m\n"
        "original = accelerate_txn.accelerate.patch.ORIGINALS['Accelerator.save_state']\n"
        "accelerate_txn.uninstall()\n"
        "assert m.Accelerator.__dict__['save_state'] is original\n"
        "accelerate_txn.install()\n"
        "assert accelerate_txn.accelerate.patch.installed()\n"
    ),
}


@pytest.mark.parametrize("name", sorted(_CHECKS))
def test_import_order_and_lazy_api(name: str) -> None:
    result = subprocess.run([sys.executable, "-c", _CHECKS[name]], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
