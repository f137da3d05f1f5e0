"""Evidence, not version numbers, decides protection.

:mod:`.pieces` describes a private piece of Accelerate, torch or transformers that a front end relies on and reads
its value (a fingerprint of its code, its signature, ...) from the running interpreter or from a release's files;
:mod:`.evidence` compares the installed values with those recorded for the releases that passed the library's tests
(``accelerate_txn/evidence.json``). Each front end declares its pieces in its internals layer and decides with them.
Standard library only: nothing here imports torch, Accelerate or transformers until a piece is read.
"""
