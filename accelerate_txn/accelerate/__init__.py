"""The Accelerate front end: ``Accelerator.save_state``/``load_state`` as transactions.

The wrapt patch and autopatch, dispatch (protected or native), the descriptor of an Accelerator,
``configure_checkpointing``, save and load orchestration over the shared transaction (:mod:`..core`), the shared
services (:mod:`..runtime`: Accelerate's internals, the version gate, the asynchronous engine) and FSDP
(:mod:`..fsdp`), RNG and data-loader state, object-store saves. Internal: the public API is the package root.
"""
