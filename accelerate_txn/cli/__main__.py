"""``python -m accelerate_txn.cli`` (the same as ``python -m accelerate_txn``)."""

import sys

from . import main

sys.exit(main())
