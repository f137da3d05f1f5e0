"""The transformers ``Trainer`` front end: each ``checkpoint-N`` a Trainer saves is a transaction, and
``train(resume_from_checkpoint=...)`` resumes only from a complete, verified one.

The same core as the Accelerate front end (``core.manifest``, ``core.select``, ``core.ranks``, ``store.posix``), over
Trainer's own file layout (:mod:`.layout`). Every private transformers access is in :mod:`.internals`; the version
gate in :mod:`.versions`; the wrapt patch and dispatch in :mod:`.patch`; the save transaction in :mod:`.save`; the
resume selection and verification in :mod:`.resume`, and the safe reading, on every rank, of every file a resume
reads in :mod:`.reads`. Internal: the public API is the package root.

Layer: this package imports ``errors``, ``store``, ``core`` and, from the Accelerate front end, only
``accelerate.autopatch`` (the import hook that installs a patch when a module is imported, shared so that both front
ends install the same way) and ``accelerate.versions`` (the table file, the torch/Accelerate version reading and the
DCP compatibility policy: one policy for both front ends). It never reaches Accelerate's or torch's internals.
"""
