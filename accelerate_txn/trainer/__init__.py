"""The transformers ``Trainer`` front end: each ``checkpoint-N`` a Trainer saves is a transaction, and
``train(resume_from_checkpoint=...)`` resumes only from a complete, verified one.

The same core as the Accelerate front end (``core.transaction``, ``core.manifest``, ``core.select``, ``core.ranks``), over
Trainer's own file layout (:mod:`.layout`). Every private transformers access is in :mod:`.internals`; the version
gate in :mod:`.versions`; the wrapt patch and dispatch in :mod:`.patch`; the save transaction in :mod:`.save`; the
resume selection and verification in :mod:`.resume`, and the safe reading, on every rank, of every file a resume
reads in :mod:`.reads`. Internal: the public API is the package root.

Layer: this package imports ``errors``, ``store``, ``core``, ``fsdp``, ``compat`` (the import hook both front ends
install with, and the evidence gate's mechanism) and ``runtime`` (Accelerate's internals the Trainer runs on, the
version gate with the Accelerate path a Trainer's checkpoints take, the asynchronous engine), never the Accelerate
front end (``accelerate``). It never reaches Accelerate's or torch's internals itself.
"""
