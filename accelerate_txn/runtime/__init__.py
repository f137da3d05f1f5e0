"""What both front ends run on, below them: Accelerate's internals, the version gate, the asynchronous engine.

The Trainer runs on Accelerate, so the private Accelerate pieces the library relies on (:mod:`.accelerate_internals`)
are shared by the Accelerate front end (``accelerate``) and the Trainer front end (``trainer``), as are the evidence
gate that decides protection from them (:mod:`.versions`: the switches, the table of validated releases, the pieces of
each protected path, which path an Accelerator takes) and the engine that runs a save's tail in the background
(:mod:`.async_save`). Neither front end imports the other; both import this room. So does setting a checkpoint aside
(:mod:`.quarantine`: ``quarantine_checkpoint``/``release_checkpoint``, which pick the store of a path or a URL), read by
both front ends' selection. Internal: the public API is the package root.
"""
