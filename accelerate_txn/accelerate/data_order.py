"""Exact data order after a resume: what decides the batches of each prepared data loader, saved per rank.

Native Accelerate seeds the shuffling generator of a prepared loader at ``prepare`` (from the global torch RNG) and
saves neither it nor the loader's epoch counter (``iteration``, which ``set_epoch`` hands to seedable samplers and
datasets): a resumed script replays epoch 0's order. A protected save records, per prepared loader and per rank,
*where the next batches come from*:

* ``epoch``: the ``iteration`` the epoch to resume runs with;
* ``generators``: the states of the generators that decide the order (``synchronized``: the one
  ``DataLoaderShard.__iter__`` broadcasts from rank 0 at every epoch start; ``sampler``, ``loader``, ``dataset``:
  a sampler's, the torch ``DataLoader``'s and an iterable dataset's own ``generator``, each recorded once);
* ``seed``: a ``SeedableRandomSampler``'s ``initial_seed`` (its order is that seed plus the epoch);
* ``mid_epoch`` and ``global_rng``: whether the save fell inside an epoch, and then this rank's global torch (CPU)
  RNG state when that epoch's iteration started.

Inside an epoch the record is the state *at the start of that epoch* (captured when its iteration started), so the
resumed script, which iterates the same epoch again and skips what it consumed (``skip_first_batches`` or
``continue``), gets that epoch's order. At the last batch of an epoch (Accelerate's ``end_of_dataloader``: yielded,
``StopIteration`` not yet raised) and between epochs it is the generators' current state and the next epoch.

**Where epochs start.** ``install()`` wraps ``DataLoaderShard.__iter__`` and ``DataLoaderDispatcher.__iter__``
(wrapt, once, with the other patches). The wrapper yields exactly what the native generator yields; at the first
``next()`` (when the native body starts) it notes the generators' and the global RNG's state. A loader made by
``skip_first_batches`` shares the prepared loader's batch sampler (or iterable dataset) and generator: it belongs to
the same *family*, so an epoch it runs counts for the prepared loader. When the epoch a resume re-entered runs to its
end through such a loader, the prepared loader's ``iteration`` is moved to the next epoch, as the uninterrupted run's
would be (native Accelerate leaves it behind: seedable samplers would repeat the epoch). Nothing else changes what
native Accelerate yields.

**The global RNG.** Creating a torch ``DataLoader`` iterator draws its ``_base_seed`` from the global torch RNG when
the loader has no ``generator``, and a ``RandomSampler`` without a generator draws its seed there too (one process,
or ``DataLoaderDispatcher``). A mid-epoch resume creates an iterator the uninterrupted run did not: it would draw
once more, and dropout, noise, everything after it would differ. So the first iteration of the resumed loader's family
runs its start (up to its first batch) with the global torch RNG set to the state it had when the interrupted epoch
started (the same base seed, the same sampler seed, so the same order), and afterwards the global RNG is put back to
what it was just before (the restored checkpoint state): nothing is drawn that the uninterrupted run did not draw.
Without persistent workers an iterator at an epoch boundary draws exactly what the uninterrupted run's did, so nothing
is done there. With ``persistent_workers`` the uninterrupted run re-used its iterator (no draw) after its first
epoch, so the first iteration of every loader of the family after the restore (the ``skip_first_batches`` loader, then
the prepared one: each creates its iterator anew) has its draws undone, mid-epoch and at a boundary alike.
Why this rather than giving the loader a generator of its own, or re-seeding it: it keeps native Accelerate's objects,
seeds and draws as they are, and is exact for every loader whose start draws only from these generators.

**Stateful loaders** (``use_stateful_dataloader=True``): the iterator state itself is restored by Accelerate and the
per-rank file (``accelerate.loader_state``); its sampler order still comes from the generators (restored here). Right
after the restore the iterator is created from the restored state with every global generator saved and put back
(``StatefulDataLoader.state_dict()`` creates it), so the resumed iteration re-uses it and draws nothing the
uninterrupted run did not.

**Not exact**, said once per loader at save time (a ``RuntimeWarning`` on rank 0): a sampler or batch sampler this
module does not know (it may hold randomness of its own); and, in a stateful loader or with persistent workers (which
do not create their iterators where the uninterrupted run did), a sampler that draws its seed from the global RNG or a
``DataLoader(generator=...)`` (each new iterator draws its base seed from it). Randomness inside the dataset
(augmentation) is the dataset's: exact only if it draws from nothing the resume changes (with worker processes:
per-worker generators seeded per iterator). After a world-size change (elastic resume) the order continues at the
saved epoch, but the batches are sharded differently; a new rank's global RNG is derived, so it replays no saved epoch
start.

**What the records assume** (:func:`order_settings`, recorded in the descriptor): the same dataset length, batch size,
``drop_last``, sampler, batch sampler and Accelerate sharding settings. The records hold no batches, only what decides
them, so a resume with another of these settings would replay the saved generators and epoch over other batches; the
resume comparison (``resume_changes``) refuses such a change before anything is restored unless it is accepted by name.

Restore runs after every check passed (``accelerate.load``); a checkpoint without these records (native, or an earlier
accelerate-txn) restores nothing here, as before. Only the CPU torch generator is replayed: a default device other than
the CPU (``torch.set_default_device``) makes the iterator draw from that device's generator, which is not.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointIntegrityError
from ..runtime.accelerate_internals import prepared_dataloaders, stateful_shard_position_exact
from .resume_changes import ORDER_SETTINGS
from .rng import apply_rng, capture_rng

logger = logging.getLogger(__name__)
_TARGETS = ("DataLoaderShard.__iter__", "DataLoaderDispatcher.__iter__")
_ORIGINALS: dict[str, Any] = {}
_STATEFUL_SAMPLERS = "torchdata.stateful_dataloader.sampler"  # the module of torchdata's stateful samplers
_RECORD_KEYS = ("epoch", "mid_epoch", "generators", "global_rng", "seed")


@dataclass
class _Start:
    """What decided an epoch's order, noted when its iteration started."""

    epoch: int
    generators: dict[str, torch.Tensor]
    global_rng: torch.Tensor
    seed: int | None


@dataclass
class _Resume:
    """A restored position, taken by the next iteration of the loader's family."""

    record: dict[str, Any]  # as restored: what a save before that iteration records again
    start: _Start | None  # the interrupted epoch's start (mid-epoch), else None
    replay: torch.Tensor | None  # global RNG state to start the resumed iteration with (None: the current one)
    keep_rng: bool  # put the global RNG back after the resumed iteration's start


@dataclass(eq=False)
class _Family:
    """A prepared loader and the loaders ``skip_first_batches`` made from it (one order source)."""

    parents: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # prepared loaders seen by a save or restore
    start: _Start | None = None  # the running epoch's start
    running: Any = None  # weak reference to the loader iterating now
    token: object | None = None  # the running iteration (an abandoned older one must not clear it)
    pending: _Resume | None = None
    # Persistent workers, restored after the saved run had created its iterator: the loaders of the family that have
    # created theirs since (each one's creation is a draw the uninterrupted run did not make). None otherwise.
    renewed: weakref.WeakSet | None = None


_FAMILIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # order source -> family
_WARNED: weakref.WeakSet = weakref.WeakSet()  # loaders already warned about at a save


# --- what a loader's order depends on ------------------------------------------------------------------------

def _inner_batch_sampler(loader: Any) -> Any:
    """The user's batch sampler under Accelerate's ``BatchSamplerShard`` and ``SkipBatchSampler`` wrappers."""
    from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
    from torch.utils.data import BatchSampler

    sampler = getattr(loader, "sampler", None)
    batch = sampler if isinstance(sampler, BatchSampler) else getattr(loader, "batch_sampler", None)
    while isinstance(batch, (SkipBatchSampler, BatchSamplerShard)):
        batch = batch.batch_sampler
    return batch


def _sampler(loader: Any) -> Any:
    return getattr(_inner_batch_sampler(loader), "sampler", None)


def _iterable(loader: Any) -> bool:
    return isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)


def _source(loader: Any) -> Any:
    """The object a prepared loader and every ``skip_first_batches`` loader made from it share: an iterable dataset,
    else the batch sampler under ``SkipBatchSampler`` (Accelerate's ``BatchSamplerShard``, or the user's on one
    process)."""
    from accelerate.data_loader import SkipBatchSampler
    from torch.utils.data import BatchSampler

    if _iterable(loader):
        return loader.dataset
    sampler = getattr(loader, "sampler", None)
    batch = sampler if isinstance(sampler, BatchSampler) else getattr(loader, "batch_sampler", None)
    while isinstance(batch, SkipBatchSampler):
        batch = batch.batch_sampler
    return batch if batch is not None else loader


def _seedable(loader: Any) -> Any:
    from accelerate.data_loader import SeedableRandomSampler

    sampler = _sampler(loader)
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def _generators(loader: Any) -> dict[str, torch.Generator]:
    """The generators that decide ``loader``'s order, each once, by role (the same for a ``skip_first_batches``
    loader as for the loader it was made from). A seedable sampler's generator is re-seeded every epoch: its
    ``seed`` is recorded instead."""
    dataset = getattr(loader, "dataset", None)
    inner = getattr(dataset, "dataset", None)  # Accelerate's IterableDatasetShard wraps the user's dataset
    candidates = [
        ("synchronized", getattr(loader, "synchronized_generator", None)),
        ("sampler", None if _seedable(loader) is not None else getattr(_sampler(loader), "generator", None)),
        ("loader", getattr(loader, "generator", None)),
        ("dataset", getattr(dataset, "generator", None)),
        ("dataset", getattr(inner, "generator", None) if inner is not None else None),
    ]
    found: dict[str, torch.Generator] = {}
    for role, generator in candidates:
        if isinstance(generator, torch.Generator) and role not in found \
                and all(generator is not other for other in found.values()):
            found[role] = generator
    return found


def _states(loader: Any) -> dict[str, torch.Tensor]:
    return {role: generator.get_state() for role, generator in _generators(loader).items()}


def _seed(loader: Any) -> int | None:
    sampler = _seedable(loader)
    return int(sampler.initial_seed) if sampler is not None else None


def _draws_globally(loader: Any) -> bool:
    """Whether the sampler draws its seed from the global torch RNG at every epoch (a random sampler without a
    generator of its own)."""
    from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

    sampler = _sampler(loader)
    return (type(sampler) in (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
            and getattr(sampler, "generator", None) is None)


def _persistent(loader: Any) -> bool:
    return bool(getattr(loader, "persistent_workers", False)) and getattr(loader, "num_workers", 0) > 0


def _stateful(loader: Any) -> bool:
    return bool(getattr(loader, "use_stateful_dataloader", False))


def inexact_reason(loader: Any) -> str | None:
    """Why ``loader`` cannot resume in exactly the uninterrupted order, or None."""
    from accelerate import PartialState
    from accelerate.data_loader import DataLoaderDispatcher, SeedableRandomSampler
    from torch.utils.data import (
        BatchSampler,
        DistributedSampler,
        RandomSampler,
        SequentialSampler,
        SubsetRandomSampler,
        WeightedRandomSampler,
    )

    known_samplers: tuple[type, ...] = (SequentialSampler, RandomSampler, SeedableRandomSampler, SubsetRandomSampler,
                                        WeightedRandomSampler, DistributedSampler)
    known_batches: tuple[type, ...] = (BatchSampler,)

    def known(value: Any, classes: tuple[type, ...], stateful_name: str) -> bool:
        # torchdata's stateful RandomSampler/BatchSampler (a stateful loader's own) are known too; recognised by
        # name, since torchdata is no dependency of ours.
        kind = type(value)
        return kind in classes or (kind.__module__ == _STATEFUL_SAMPLERS and kind.__qualname__ == stateful_name)

    if type(getattr(loader, "iteration", None)) is not int:
        return f"it is a {type(loader).__name__}, not a data loader Accelerate prepared (no epoch counter to restore)"
    if _iterable(loader):
        return None  # the dataset decides the order (documented: not checkable here)
    batch = _inner_batch_sampler(loader)
    if batch is not None and not known(batch, known_batches, "BatchSampler"):
        return (f"its batch sampler {type(batch).__module__}.{type(batch).__qualname__} is not one accelerate-txn "
                "can restore (any randomness of its own is not in the checkpoint)")
    sampler = _sampler(loader)
    if sampler is not None and not known(sampler, known_samplers, "RandomSampler"):
        return (f"its sampler {type(sampler).__module__}.{type(sampler).__qualname__} is not one accelerate-txn can "
                "restore (any randomness of its own is not in the checkpoint)")
    if (_stateful(loader) and not isinstance(loader, DataLoaderDispatcher) and PartialState().num_processes > 1
            and not stateful_shard_position_exact()):
        return ("this Accelerate records a stateful loader's position num_processes - 1 batches early in a "
                "multi-process run (accelerate #3938, fixed in Accelerate 1.13): a resume trains on them again; "
                "upgrade Accelerate to 1.13 or later")
    kind = "a stateful loader" if _stateful(loader) else "a loader with persistent workers"
    if (_stateful(loader) or _persistent(loader)) and _draws_globally(loader):
        return (f"its sampler draws each epoch's seed from the global torch RNG, and {kind} does not create its "
                "iterators where the uninterrupted run did; give the sampler a generator of its own")
    if (_stateful(loader) or _persistent(loader)) and isinstance(getattr(loader, "generator", None), torch.Generator):
        return (f"the DataLoader's own generator= also seeds each new iterator, and {kind} does not create its "
                "iterators where the uninterrupted run did; give the generator to the sampler instead "
                "(sampler=RandomSampler(dataset, generator=...))")
    return None


# --- what a loader's order and position mean (the descriptor's record) -----------------------------------------

def _shard(loader: Any) -> Any:
    """Accelerate's sharding wrapper of ``loader``: its ``IterableDatasetShard`` or ``BatchSamplerShard`` (under any
    ``SkipBatchSampler``), or None (one process, batches dispatched, or a dataset sharded by ``datasets``)."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard, SkipBatchSampler
    from torch.utils.data import BatchSampler

    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDatasetShard):
        return dataset
    sampler = getattr(loader, "sampler", None)
    batch = sampler if isinstance(sampler, BatchSampler) else getattr(loader, "batch_sampler", None)
    while isinstance(batch, SkipBatchSampler):
        batch = batch.batch_sampler
    return batch if isinstance(batch, BatchSamplerShard) else None


def _class(value: Any) -> str | None:
    return None if value is None else f"{type(value).__module__}.{type(value).__qualname__}"


def _length(dataset: Any) -> int | None:
    try:
        length = len(dataset)
    except Exception:  # an iterable dataset without a length, or a __len__ that fails: unknown (never a failed save)
        return None
    return int(length) if isinstance(length, int) and not isinstance(length, bool) else None


def order_settings(loader: Any, num_processes: int) -> dict[str, Any]:
    """What decides ``loader``'s order and the meaning of a position in it (``resume_changes.ORDER_SETTINGS``), as
    the user set it up: the dataset's length (where it has one), the batch size and ``drop_last`` the user gave (not
    Accelerate's per-process split), the sampler (and whether it shuffles) and batch sampler classes, Accelerate's
    ``split_batches`` / ``even_batches`` where a sharding wrapper applies them, whether batches are dispatched, and
    the number of processes the loader shards over (``num_processes``: the Accelerator's, unless a wrapper says
    otherwise). ``None``: does not apply, or unknown (the dataset's length where several processes each read a
    dataset Accelerate does not shard: theirs may differ). The same on every rank for a loader every rank prepared
    alike (the descriptor is compared across ranks). Reads only; draws nothing."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
    from torch.utils.data import RandomSampler

    dataset = getattr(loader, "dataset", None)
    shard = _shard(loader)
    dispatched = isinstance(loader, DataLoaderDispatcher)
    if _iterable(loader):
        source = shard if isinstance(shard, IterableDatasetShard) else loader
        user_dataset = dataset.dataset if isinstance(dataset, IterableDatasetShard) else dataset
        batch_size, drop_last = getattr(source, "batch_size", None), getattr(source, "drop_last", None)
        sampler = batch = None
        shuffle = None
    else:
        user_dataset = dataset
        batch, sampler = _inner_batch_sampler(loader), _sampler(loader)
        batch_size, drop_last = getattr(batch, "batch_size", None), getattr(batch, "drop_last", None)
        shuffle = isinstance(sampler, RandomSampler) if sampler is not None else None
    split = getattr(loader if dispatched else shard, "split_batches", None)
    # Several processes and no sharding by Accelerate (a dataset each rank sharded itself, e.g. with datasets'
    # split_dataset_by_node): each rank's dataset is its own, possibly of another length. The descriptor is compared
    # across ranks, so its length is not recorded (unknown), never a save refused for ranks that differ.
    own_shards = num_processes > 1 and shard is None and not dispatched
    settings = {
        "dataset_length": None if own_shards else _length(user_dataset),
        "batch_size": batch_size if type(batch_size) is int else None,
        "drop_last": drop_last if type(drop_last) is bool else None,
        "shuffle": shuffle,
        "sampler": _class(sampler),
        "batch_sampler": _class(batch),
        "split_batches": split if type(split) is bool else None,
        "even_batches": shard.even_batches if isinstance(shard, BatchSamplerShard) else None,
        "dispatch_batches": dispatched,
        "processes": int(getattr(shard, "num_processes", num_processes)),
    }
    assert tuple(settings) == ORDER_SETTINGS
    return settings


# --- the epoch hook --------------------------------------------------------------------------------------------

def _family(loader: Any, create: bool) -> _Family | None:
    source = _source(loader)
    try:
        family = _FAMILIES.get(source)
        if family is None and create:
            family = _FAMILIES[source] = _Family()
    except TypeError:  # an order source that cannot be weakly referenced or hashed: the loader is its own family
        family = _FAMILIES.get(loader)
        if family is None and create:
            family = _FAMILIES[loader] = _Family()
    return family


def _capture(loader: Any) -> _Start:
    return _Start(epoch=int(loader.iteration), generators=_states(loader), global_rng=torch.get_rng_state(),
                  seed=_seed(loader))


def _first(inner: Iterator[Any], replay: torch.Tensor | None) -> tuple[Any, bool]:
    """The resumed iteration's first batch (or exhaustion), its start run from ``replay`` (if given) and the global
    torch RNG put back afterwards (see the module docstring)."""
    before = torch.get_rng_state()
    if replay is not None:
        torch.set_rng_state(replay)
    try:
        return next(inner), False
    except StopIteration:
        return None, True
    finally:
        torch.set_rng_state(before)


def _epoch(inner: Iterator[Any], loader: Any) -> Iterator[Any]:
    """Yields what ``inner`` (the native epoch generator of ``loader``) yields; notes where the epoch started."""
    family: _Family | None = None
    try:
        family = _family(loader, create=True)
        assert family is not None
        if family.pending is not None and loader.iteration != family.pending.record["epoch"]:
            # The first iteration after a restore runs the restored epoch: a skip_first_batches loader Accelerate
            # 1.7-1.14 made starts at epoch 0 (1.15 hands it the prepared loader's), which a seedable sampler or
            # dataset would replay.
            loader.iteration = int(family.pending.record["epoch"])
        start = family.pending.start if family.pending is not None and family.pending.start is not None \
            else _capture(loader)
    except Exception as exc:  # bookkeeping must never break a native iteration: this epoch is not tracked
        logger.warning("accelerate-txn: cannot note where an epoch of %s starts (%s: %s); its data order after a "
                       "resume is not exact", type(loader).__name__, type(exc).__name__, exc)
        family = None
    if family is None:
        yield from inner
        return
    plan, family.pending = family.pending, None
    token = object()
    family.start, family.running, family.token = start, weakref.ref(loader), token
    epoch = start.epoch
    keep = plan is not None and (plan.keep_rng or plan.replay is not None)
    if family.renewed is not None and loader not in family.renewed:
        family.renewed.add(loader)
        keep = True
    completed = False
    try:
        if keep:
            first, completed = _first(inner, plan.replay if plan is not None else None)
            if completed:
                return
            yield first
        yield from inner
        completed = True
    finally:
        if family.token is token:
            family.running = family.token = None
        if completed and plan is not None:
            # The resumed epoch ran to its end through a skip_first_batches loader: the prepared loader moves on
            # to the next epoch, as the uninterrupted run's did.
            for parent in list(family.parents):
                if parent is not loader and parent.iteration <= epoch:
                    parent.iteration = epoch + 1


def _iterate(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if instance is None:
        return wrapped(*args, **kwargs)
    return _epoch(wrapped(*args, **kwargs), instance)


def installed() -> bool:
    import wrapt
    from accelerate import data_loader

    return isinstance(data_loader.DataLoaderShard.__dict__.get("__iter__"), wrapt.FunctionWrapper)


def install() -> None:
    """Wrap the prepared loaders' ``__iter__`` once (idempotent; ``accelerate.patch.install`` calls it)."""
    import wrapt
    from accelerate import data_loader

    if installed():
        return
    for target in _TARGETS:
        _parent, _attribute, original = wrapt.resolve_path(data_loader, target)
        _ORIGINALS[target] = original
        wrapt.wrap_function_wrapper(data_loader, target, _iterate)


def uninstall() -> None:
    """Put the native ``__iter__`` back."""
    import wrapt
    from accelerate import data_loader

    if not installed():
        return
    for target in _TARGETS:
        parent, attribute, _current = wrapt.resolve_path(data_loader, target)
        setattr(parent, attribute, _ORIGINALS.pop(target))


# --- save ------------------------------------------------------------------------------------------------------

def order_record(loader: Any) -> dict[str, Any]:
    """Where ``loader``'s next batches come from, on this rank (see the module docstring)."""
    family = _family(loader, create=True)
    assert family is not None
    family.parents.add(loader)
    if family.pending is not None:  # restored and not iterated since: the restored position, unchanged
        return dict(family.pending.record)
    running = family.running() if family.running is not None else None
    epoch = int(loader.iteration)
    if running is not None and family.start is not None:
        start = family.start
        if not getattr(running, "end_of_dataloader", False):
            return {"epoch": start.epoch, "mid_epoch": True, "generators": dict(start.generators),
                    "global_rng": start.global_rng, "seed": start.seed}
        epoch = start.epoch + 1  # the last batch was yielded: the next epoch starts from the current state
    return {"epoch": epoch, "mid_epoch": False, "generators": _states(loader), "global_rng": None,
            "seed": _seed(loader)}


def order_records(accelerator: Any, *, warn: bool) -> dict[int, dict[str, Any]]:
    """This rank's record of every prepared loader, by its index; with ``warn``, a loader that cannot resume exactly
    is named once (a ``RuntimeWarning``)."""
    records = {}
    for index, loader in enumerate(prepared_dataloaders(accelerator)):
        if type(getattr(loader, "iteration", None)) is int:
            records[index] = order_record(loader)
        if warn and loader not in _WARNED:
            reason = inexact_reason(loader)
            if reason is not None:
                _WARNED.add(loader)
                warnings.warn(
                    f"accelerate-txn: data loader {index} ({type(loader).__name__} over "
                    f"{type(getattr(loader, 'dataset', None)).__name__}) cannot resume in exactly the uninterrupted "
                    f"data order: {reason}. Checkpoints are still complete; a resume from them continues with the "
                    "generators and epoch they record.", RuntimeWarning, stacklevel=2)
    return records


# --- load ------------------------------------------------------------------------------------------------------

def check_order_records(accelerator: Any, records: Any, where: str) -> dict[int, dict[str, Any]]:
    """``records`` as read from a per-rank file, checked: the schema, and every state one the live loader's generator
    (and the CPU generator, for ``global_rng``) accepts. Changes nothing."""
    def bad(detail: str) -> CheckpointIntegrityError:
        return CheckpointIntegrityError(f"{where} holds a malformed data-order record ({detail}): the file was "
                                        "altered. Restore an intact copy of the checkpoint.")

    if not isinstance(records, dict):
        raise bad("not a mapping")
    loaders = prepared_dataloaders(accelerator)
    for index, record in records.items():
        if not isinstance(index, int) or not isinstance(record, dict) or set(record) != set(_RECORD_KEYS):
            raise bad(f"entry {index!r}")
        if type(record["epoch"]) is not int or record["epoch"] < 0 or type(record["mid_epoch"]) is not bool:
            raise bad(f"loader {index}: epoch {record['epoch']!r}, mid_epoch {record['mid_epoch']!r}")
        if record["seed"] is not None and type(record["seed"]) is not int:
            raise bad(f"loader {index}: seed {record['seed']!r}")
        states = record["generators"]
        if not isinstance(states, dict) or not all(isinstance(r, str) and _byte_state(s) for r, s in states.items()):
            raise bad(f"loader {index}: generators")
        if record["mid_epoch"] != (record["global_rng"] is not None) or \
                (record["global_rng"] is not None and not _byte_state(record["global_rng"])):
            raise bad(f"loader {index}: global_rng")
        live = _generators(loaders[index]) if 0 <= index < len(loaders) else {}
        checks = [(role, torch.Generator(device=live[role].device), state)
                  for role, state in states.items() if role in live]
        if record["global_rng"] is not None:
            checks.append(("global_rng", torch.Generator(), record["global_rng"]))
        for role, scratch, state in checks:
            try:
                scratch.set_state(state)
            except Exception as exc:
                raise bad(f"loader {index}: {role} state cannot be applied: {exc}") from exc
    return records


def _byte_state(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def restore_order(accelerator: Any, records: Mapping[int, dict[str, Any]] | None, *, replay: bool) -> list[int]:
    """Give each prepared loader its recorded generators, seed and epoch, and its family the resumed position (taken
    by the next iteration). ``replay``: this rank's global RNG is the saved one (not derived for a new rank), so a
    mid-epoch start is replayed from the recorded state. Returns the indices of loaders whose generators no longer
    match the record (their order is not restored: the data-loader setup changed)."""
    skipped: list[int] = []
    for index, loader in enumerate(prepared_dataloaders(accelerator)):
        record = (records or {}).get(index)
        if record is None:
            continue
        live = _generators(loader)
        sampler = _seedable(loader)
        if set(live) != set(record["generators"]) or (sampler is None) != (record["seed"] is None):
            skipped.append(index)
            continue
        for role, state in record["generators"].items():
            live[role].set_state(state)
        if sampler is not None:
            sampler.initial_seed = record["seed"]
        loader.iteration = record["epoch"]
        family = _family(loader, create=True)
        assert family is not None
        family.parents.add(loader)
        family.running = family.token = family.start = None
        stateful, persistent, mid = _stateful(loader), _persistent(loader), record["mid_epoch"]
        if stateful:
            _create_stateful_iterator(loader)
        start = _Start(record["epoch"], dict(record["generators"]), record["global_rng"], record["seed"]) \
            if mid else None
        keep_rng = mid and not stateful and not persistent
        family.pending = _Resume(record=dict(record), start=start,
                                 replay=record["global_rng"] if keep_rng and replay else None, keep_rng=keep_rng)
        # Persistent workers: the saved run re-used its iterator (no draw) once it had one; every loader of the
        # family creates one again here.
        family.renewed = weakref.WeakSet() if persistent and not stateful and (mid or record["epoch"] > 0) else None
    return skipped


def _create_stateful_iterator(loader: Any) -> None:
    """Create the stateful loader's iterator from the state just restored, drawing nothing from the global
    generators (``StatefulDataLoader.state_dict()`` creates it when there is none; the next ``__iter__`` re-uses it)."""
    base = getattr(loader, "base_dataloader", None)
    if base is None or not hasattr(base, "state_dict"):
        return
    saved = capture_rng()
    try:
        base.state_dict()
    finally:
        apply_rng(saved)
