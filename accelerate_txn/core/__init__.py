"""The transaction core: files, hashes, manifests, selection, retention and rank agreement.

It knows nothing of Accelerate, FSDP or the transformers Trainer, and of storage only the interface
:class:`accelerate_txn.store.base.Store`. Front ends (``accelerate_txn.accelerate``) orchestrate it; it never
imports them. Internal: the public API is the package root.
"""
