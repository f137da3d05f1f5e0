"""``accelerate-txn``: list, verify, inspect, compare, prune and export checkpoints from the command line, and say
whether checkpoints are protected here (``doctor``).

Offline, one CPU process. ``list``, ``verify``, ``latest`` and ``prune`` are file work and do not import torch
themselves. Every path naming a checkpoint or a run directory may be an ``s3://`` URL (``_remote``). Entry points:
the console script ``accelerate-txn`` and ``python -m accelerate_txn``.
"""

from ._app import main

__all__ = ["main"]
