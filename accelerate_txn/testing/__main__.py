"""``python -m accelerate_txn.testing run [OPTIONS] script.py [ARGS...]``: run a training script on N CPU processes
with FSDP forced on (see ``_cli``)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
