"""The Accelerate front end: ``Accelerator.save_state``/``load_state`` as transactions.

The wrapt patch and autopatch, the version gate (``validated.json``), dispatch (protected or native), every
private Accelerate access (:mod:`.internals`), the descriptor of an Accelerator, ``configure_checkpointing``,
save and load orchestration over the core (:mod:`..core`) and FSDP (:mod:`..fsdp`), RNG and data-loader state,
asynchronous saves. Internal: the public API is the package root.
"""
