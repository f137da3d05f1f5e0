"""FSDP: what torch's FSDP1 and FSDP2 checkpoints look like and how their sharded state is restored.

Layouts (FSDP1 flat parameters, FSDP2 DTensors), the bounded sharded optimizer restores built from a
checkpoint's own DCP metadata, the asynchronous capture of local shards, host staging memory, and every private
torch (and NumPy, CPython) access in :mod:`.internals`. Works on models and optimizers, never on a front end's
objects (an Accelerator, a Trainer). Internal: the public API is the package root.
"""
