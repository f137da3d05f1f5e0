"""Per-Accelerator checkpoint configuration (``configure_checkpointing``) and the failed-restore guard.

Configuration lives beside the Accelerator in a ``WeakKeyDictionary``: nothing is stored on the Accelerator
itself and nothing keeps it alive.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary, ref

import torch

from ..core import faults
from ..core.environment import Variable, choice, flag
from ..core.remote import SCHEMES, is_url
from ..core.signing import Keyring, environment_paths, keyring
from ..errors import CheckpointConfigurationError, RestoreFailedError
from ..fsdp.dcp_writer import DIRECT_IO
from ..fsdp.optimizer_state import raw_optimizer
from ..runtime.accelerate_internals import prepared_optimizers
from .resume_changes import check_accept_names

FINITE_ENV = "ACCELERATE_TXN_CHECK_FINITE"
LOCK_TIMEOUT_ENV = "ACCELERATE_TXN_LOCK_TIMEOUT"
#: Seconds rank 0 waits for the directory lock: a writer that died on another node of NFS or Lustre keeps its
#: lock until the server notices (tens of seconds); a live writer's save usually takes longer than this.
DEFAULT_LOCK_TIMEOUT = 60.0
ARRIVAL_TIMEOUT_ENV = "ACCELERATE_TXN_ARRIVAL_TIMEOUT"
#: Seconds the ranks that reached an FSDP save_state/load_state wait for the others before raising
#: CheckpointArrivalError: shorter than NCCL's 10-minute watchdog, which would otherwise kill the job first, unexplained.
DEFAULT_ARRIVAL_TIMEOUT = 300.0
CHECKSUM_MODES = ("metadata", "full")
PROTECT_ENV = "ACCELERATE_TXN_PROTECT"
#: Which ``save_state``/``load_state`` calls automatic dispatch protects: FSDP sharded ones (default), or every one of
#: a supported distributed type (one process, DDP on CPU or GPU, FSDP sharded).
PROTECT_MODES = ("fsdp", "all")
#: What a save does when its destination exists: replace it atomically, as native Accelerate overwrites (default),
#: or refuse (``CheckpointExistsError``).
OVERWRITE_MODES = ("replace", "refuse")
FINITE = flag(FINITE_ENV, False)
PROTECT = choice(PROTECT_ENV, PROTECT_MODES, "fsdp",
                 "'fsdp': protect FSDP sharded checkpoints; 'all': also one process and DDP")


def plain(value: Any, where: str = "value") -> Any:
    """A JSON-able, key-sorted copy of ``value`` (one-element tensors become numbers); raises on anything else."""
    if isinstance(value, float) and not math.isfinite(value):
        raise CheckpointConfigurationError(
            f"Checkpoint metadata {where} is {value!r}: a non-finite number never compares equal, so no resume could "
            "ever match it. Record it as a string or leave it out."
        )
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (tuple, list)):
        return [plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(key): plain(item, f"{where}.{key}") for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    raise CheckpointConfigurationError(
        f"Checkpoint metadata {where} has type {type(value).__module__}.{type(value).__qualname__}, which cannot be "
        "recorded in a manifest: use str, int, float, bool, None, lists and dicts of those."
    )


Validator = Callable[[Path, int], Any]


@dataclass
class CheckpointConfig:
    model_ids: WeakKeyDictionary = field(default_factory=WeakKeyDictionary)
    allow_legacy: bool = True
    check_finite: bool = False
    checksum: str = "full"
    trust_custom_objects: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    legacy_metadata_keys: tuple[str, ...] = ()
    legacy_metadata_groups: tuple[tuple[str, ...], ...] = ()
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    overwrite: str = "replace"
    protect: str | None = None  # None: ACCELERATE_TXN_PROTECT decides at each call (see ``protect_mode``)
    # None: ACCELERATE_TXN_REQUIRE_PROTECTION decides at each call (``accelerate.patch.require_protection``)
    require_protection: bool | None = None
    arrival_timeout: float = DEFAULT_ARRIVAL_TIMEOUT
    # File-name template -> schema recorded in the descriptor; and -> validator(directory, rank).
    private_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    validators: dict[str, Validator] = field(default_factory=dict)
    run_id: str | None = None
    async_save: bool = False
    reuse_staging_memory: bool = False
    staging_pool: Any = None  # ``fsdp.host_memory.StagingPool`` while reuse_staging_memory is on
    allow_reshard: bool = False
    reshard_rank_map: dict[int, int] | None = None
    accept_changes: tuple[str, ...] = ()  # named resume changes accepted on purpose (``resume_changes``)
    # During a restore: where this run's per-rank state comes from (``accelerate.elastic.RankPlan``); after an elastic
    # resume, what the next save records as ``resharded_from`` (then cleared).
    rank_plan: Any = None
    resharded_from: dict[str, Any] | None = None
    mirror: str | None = None  # an object-store prefix every published checkpoint is uploaded to (``accelerate.remote``)
    cache_dir: Path | None = None  # local copies of object-store checkpoints (None: ``core.remote.default_cache_root``)
    # Key files (``core.signing``): the paths, and the keys read from them (never logged, stored or compared in clear).
    signing_key: str | None = None
    verification_keys: tuple[str, ...] = ()
    keys: Keyring = field(default_factory=Keyring)
    failed: bool = False
    step_guards: list[Any] = field(default_factory=list)


_CONFIGS: WeakKeyDictionary = WeakKeyDictionary()


def checkpoint_config(accelerator: Any) -> CheckpointConfig:
    """The configuration of ``accelerator`` (created with defaults on first use)."""
    config = _CONFIGS.get(accelerator)
    if config is None:
        signing, verify = environment_paths()  # key files named by the environment (ACCELERATE_TXN_*)
        config = CheckpointConfig(
            check_finite=FINITE.read(), lock_timeout=LOCK_TIMEOUT.read(),
            arrival_timeout=ARRIVAL_TIMEOUT.read(), signing_key=signing, verification_keys=tuple(verify),
            keys=keyring(signing, verify),
        )
        _CONFIGS[accelerator] = config
    return config


def existing_config(accelerator: Any) -> CheckpointConfig | None:
    """The configuration of ``accelerator`` if one was created (none is created here: nothing is read)."""
    return _CONFIGS.get(accelerator)


def read_configs(group: dict[str, Any]) -> dict[str, Any]:
    """Create the configuration of every Accelerator of ``group`` now, reading the environment, and return
    ``group``. Call it inside the first rank phase of a save or load: a setting that is invalid on one rank only
    (``ACCELERATE_TXN_LOCK_TIMEOUT``) then raises the same error on every rank instead of raising on that rank
    alone before the first agreement, where the others would wait for it. The variables the call reads deep inside
    (:data:`fsdp.dcp_writer.DIRECT_IO` in DCP's write, the test switches of ``core.faults``) are read here too, for
    the same reason."""
    for owner in group.values():
        checkpoint_config(owner)
    for variable in (DIRECT_IO, *faults.SWITCHES):
        variable.read()
    return group


#: What each wait is, for messages: (its description, what its default and special values are).
_LOCK_WAIT = ("the directory-lock wait", f"0 = fail at once if another writer holds the lock; default {DEFAULT_LOCK_TIMEOUT:g}")
_ARRIVAL_WAIT = ("the wait for every rank to reach save_state()/load_state()", f"default {DEFAULT_ARRIVAL_TIMEOUT:g}")


def _valid_seconds(value: Any, where: str, wait: tuple[str, str]) -> float:
    """``value`` as a wait in seconds (a finite number >= 0), else a configuration error naming the ``wait``."""
    from ..store.base import wait_seconds

    seconds = wait_seconds(value)
    if seconds is None:
        raise CheckpointConfigurationError(
            f"{where} is {value!r}: {wait[0]} must be a finite number of seconds >= 0 ({wait[1]}).")
    return seconds


def _valid_lock_timeout(value: Any, where: str) -> float:
    return _valid_seconds(value, where, _LOCK_WAIT)


def _valid_arrival_timeout(value: Any, where: str) -> float:
    return _valid_seconds(value, where, _ARRIVAL_WAIT)


def _seconds(raw: str) -> float:
    from ..store.base import wait_seconds

    seconds = wait_seconds(raw)
    if seconds is None:
        raise ValueError(raw)
    return seconds


LOCK_TIMEOUT = Variable(LOCK_TIMEOUT_ENV, _seconds, DEFAULT_LOCK_TIMEOUT,
                        f"{_LOCK_WAIT[0]} must be a finite number of seconds >= 0 ({_LOCK_WAIT[1]})")
ARRIVAL_TIMEOUT = Variable(ARRIVAL_TIMEOUT_ENV, _seconds, DEFAULT_ARRIVAL_TIMEOUT,
                           f"{_ARRIVAL_WAIT[0]} must be a finite number of seconds >= 0 ({_ARRIVAL_WAIT[1]})")


def arrival_timeout(accelerator: Any) -> float:
    """The arrival wait of ``accelerator``, read before any agreement and therefore never raising: its configured
    value once it has a configuration, else ``ACCELERATE_TXN_ARRIVAL_TIMEOUT``, or the default where that is
    unset or invalid. An invalid value is not lost: the first rank phase reads the configuration
    (:func:`read_configs`) and raises the same error on every rank. Raising here instead would raise on that rank
    alone, and the others would wait the whole arrival timeout for it."""
    try:
        config = _CONFIGS.get(accelerator)
    except TypeError:  # not an Accelerator (the explicit API refuses it inside its first phase)
        config = None
    if config is not None:
        return config.arrival_timeout
    from ..store.base import wait_seconds

    seconds = wait_seconds(ARRIVAL_TIMEOUT.raw() or DEFAULT_ARRIVAL_TIMEOUT)
    return DEFAULT_ARRIVAL_TIMEOUT if seconds is None else seconds


def configure_checkpointing(
    accelerator: Any,
    *,
    model_ids: Mapping[str, torch.nn.Module] | None = None,
    allow_legacy: bool | None = None,
    check_finite: bool | None = None,
    checksum: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    legacy_metadata_keys: Iterable[str] | None = None,
    legacy_metadata_groups: Iterable[Iterable[str]] | None = None,
    lock_timeout: float | None = None,
    arrival_timeout: float | None = None,
    trust_custom_objects: bool | None = None,
    async_save: bool | None = None,
    reuse_staging_memory: bool | None = None,
    allow_reshard: bool | None = None,
    reshard_rank_map: Mapping[int, int] | None = None,
    overwrite: str | None = None,
    protect: str | None = None,
    require_protection: bool | None = None,
    accept_changes: Iterable[str] | None = None,
    mirror: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    signing_key: str | os.PathLike[str] | None = None,
    verification_keys: Iterable[str | os.PathLike[str]] | None = None,
) -> Any:
    """Configure protected checkpoints of one Accelerator; returns it.

    Each call changes only what it names: an argument left out (``None``) keeps its current value. Every
    argument is validated, against the configuration that would result, before anything changes.

    * ``model_ids``: stable role names for the prepared models (``{"transformer": model}``); required when
      several models share a class, since native order alone cannot prove which weights belong where.
    * ``allow_legacy``: load checkpoints without a completion manifest (with a warning). Default True.
    * ``check_finite``: refuse to save (and to finish a restore of) NaN/Inf parameters and optimizer state.
      Default from ``ACCELERATE_TXN_CHECK_FINITE=1``.
    * ``checksum``: ``"full"`` (default) hashes every file, verified by every restore; ``"metadata"`` hashes
      control files and small payloads and records only the size of payloads over 16 MiB.
    * ``metadata``: JSON-able user training configuration recorded in the manifest and compared on load.
    * ``legacy_metadata_keys`` / ``legacy_metadata_groups``: metadata fields added after older checkpoints
      were written. A checkpoint lacking a whole group loads with a warning (current values are assumed);
      lacking part of a group is an error; present values must still match.
    * ``lock_timeout``: seconds rank 0 waits for the output directory's lock held by another writer (a writer
      that died on another node of NFS or Lustre holds it until the server notices). Finite, >= 0; default
      60, or ``ACCELERATE_TXN_LOCK_TIMEOUT``.
    * ``arrival_timeout``: seconds the ranks that reached an FSDP ``save_state``/``load_state`` (or the explicit
      API) wait for the others before raising ``CheckpointArrivalError`` (a call made on some ranks only, e.g.
      inside ``if accelerator.is_main_process:``). Finite, >= 0; default 300, or
      ``ACCELERATE_TXN_ARRIVAL_TIMEOUT``. Raise it if a rank may legitimately reach a save that much later.
    * ``trust_custom_objects``: let Accelerate unpickle registered custom objects (``custom_checkpoint_N.pkl``)
      with ``weights_only=False``, for objects whose state holds arbitrary Python types. Default False: they are
      read with ``weights_only=True`` in the restore preflight and restored from that state, so nothing in a
      checkpoint runs code. Only for checkpoints you trust: a crafted file then runs its code.
    * ``async_save``: ``save_state`` returns once this rank's state is copied to host memory; writing, hashing,
      flushing, the manifest, the atomic publish and retention run in a background thread (one save in flight;
      the next save, ``wait_for_checkpoint`` and ``end_training`` wait for it and raise its error). Costs one
      host copy of this rank's model and optimizer shards while the write runs (released after the write).
      FSDP2: ``save_state`` does not even wait for that copy of the parameter shards and optimizer moments; the
      background makes it while the next forward and backward run, and the next ``optimizer.step()`` waits for
      it. Modify parameters or optimizer state in place outside ``optimizer.step`` only after
      ``wait_for_checkpoint`` (such a write before the copy fails the save on every rank; nothing is published).
      Default False.
    * ``reuse_staging_memory``: with ``async_save``, keep that host copy allocated between saves and copy into it
      again: the blocking copy skips the kernel's page allocation (several times faster), at the cost of holding
      one copy of this rank's model and optimizer shards for as long as the Accelerator lives. Applies to
      FSDP2 and to FSDP1's collective-free staging (FSDP1 setups staged natively still take fresh memory).
      Default False.
    * ``allow_reshard``: elastic resume. A checkpoint saved on N ranks may load on M ranks: model and optimizer
      are resharded, every other check still applies, and per-rank state (RNG, data-loader position, private
      state) follows the policy of ``accelerate_txn.accelerate.elastic`` (ranks in both runs keep theirs; new ranks take
      saved rank ``r % N``'s progress with derived random generators; the state of ranks that are gone is
      dropped, with a warning). Default False: a world-size change is refused before anything is restored, except
      for a checkpoint saved and resumed with ``FULL_STATE_DICT`` (whole tensors: it resumes on another world size
      without the opt-in, its per-rank state following the same policy).
    * ``reshard_rank_map``: ``{this run's rank: saved rank}`` for an elastic resume: the named ranks take that
      saved rank's per-rank state exactly (random generators included) instead of the default policy.
    * ``overwrite``: what a save does when its destination exists. ``"replace"`` (default, where native
      ``save_state`` would write into it): a checkpoint directory (published, native, or empty) is replaced as a
      whole: the new checkpoint is published atomically in its place, the old one deleted only after that, with
      one warning; a destination that is not a checkpoint (a file, a link, a directory of other files, a run
      directory, the working or project directory) is never replaced: the save runs native Accelerate with one
      warning. Saving beside another run's checkpoints is allowed with one warning (retention prunes only this
      run's). ``"refuse"``: both raise ``CheckpointExistsError`` before anything is written.
    * ``require_protection``: strict mode. ``True``: a ``save_state``/``load_state`` of this Accelerator that would
      run native Accelerate (unprotected: an FSDP setting the protected path does not take, automatic dispatch off,
      releases the evidence does not protect, ...) raises ``CheckpointUnprotectedError`` on every rank, naming the
      reason and the fix, before anything is written or read. ``False``: it runs native after one WARNING per
      process and reason. Default: ``ACCELERATE_TXN_REQUIRE_PROTECTION`` (unset: off).
      ``accelerate_txn.protection(accelerator)`` answers the same question without saving.
    * ``accept_changes``: changes a resume refuses unless named, accepted on purpose, each exactly as the refusal
      prints it: ``"schedulers[N].<value>"`` (a learning-rate schedule's warmup, cycles, ...; a built-in
      scheduler's setting, which the restore keeps at its saved value) or ``"training.<key>"`` (a metadata
      value). A schedule's total length and run-length or cadence metadata need no name: docs/configuration.md,
      "What may change on resume". Pass ``()`` to clear.
    * ``mirror``: an object-store prefix (``"s3://bucket/run"``; ``pip install 'accelerate-txn[s3]'``). Each
      checkpoint published on the local path is then uploaded in the background to ``mirror/<its name>`` with the
      same manifest, committed there last (create-only), and the mirror's own retention follows ``total_limit``;
      an upload failure is raised on every rank at the next save, ``wait_for_checkpoint`` or load. Automatic
      ``load_state()`` resumes from the newest complete checkpoint of either tier, the local copy first when it
      verifies. ``""`` turns mirroring off. Default: off.
    * ``cache_dir``: where checkpoints saved to or loaded from an object store (``save_state("s3://...")``, the
      mirror) are kept locally: the save is published there first, then uploaded; a restore downloads into it and
      verifies before anything is loaded. It must be visible to every rank of a node; it holds the newest
      checkpoint of each prefix only. Default ``$XDG_CACHE_HOME/accelerate-txn`` (``~/.cache/accelerate-txn``).
    * ``signing_key``: the path of a key file (an HMAC secret, or an Ed25519 PEM private key with
      ``pip install 'accelerate-txn[signing]'``; format: docs/configuration.md, "Authenticated checkpoints"). Every
      manifest this Accelerator's saves write then carries an authenticator, and the key also verifies. ``""`` turns
      signing off. Default: the file ``ACCELERATE_TXN_SIGNING_KEY_FILE`` names, else none.
    * ``verification_keys``: paths of key files (HMAC secrets, Ed25519 public or private keys; several at once for
      key rotation). Once any verification key (or a signing key) is configured, every restore and automatic
      selection refuses a checkpoint whose manifest carries no authenticator, a wrong one, or one made with a key
      not configured (``CheckpointAuthenticationError``, naming the checkpoint and the key id), and a manifest-less
      checkpoint. ``()`` clears them. Default: the files ``ACCELERATE_TXN_VERIFY_KEYS`` lists (``os.pathsep``-separated).
    """
    config = checkpoint_config(accelerator)
    changes: dict[str, Any] = {}
    if model_ids is not None:
        if not all(isinstance(name, str) and name for name in model_ids):
            raise CheckpointConfigurationError("configure_checkpointing(model_ids=...): every role must be a non-empty str")
        if len({id(model) for model in model_ids.values()}) != len(model_ids):
            raise CheckpointConfigurationError("configure_checkpointing(model_ids=...): each model needs exactly one role")
        changes["model_ids"] = WeakKeyDictionary((model, name) for name, model in model_ids.items())
    if metadata is not None:
        changes["metadata"] = plain(dict(metadata), "metadata")
    if legacy_metadata_keys is not None:
        changes["legacy_metadata_keys"] = _names(legacy_metadata_keys, "legacy_metadata_keys")
    if legacy_metadata_groups is not None:
        changes["legacy_metadata_groups"] = tuple(
            _names(group, "legacy_metadata_groups[...]") for group in _iterable(legacy_metadata_groups, "legacy_metadata_groups")
        )
    _check_legacy_keys(
        changes.get("metadata", config.metadata),
        changes.get("legacy_metadata_keys", config.legacy_metadata_keys),
        changes.get("legacy_metadata_groups", config.legacy_metadata_groups),
    )
    if allow_legacy is not None:
        changes["allow_legacy"] = bool(allow_legacy)
    if check_finite is not None:
        changes["check_finite"] = bool(check_finite)
    if checksum is not None:
        if checksum not in CHECKSUM_MODES:
            raise CheckpointConfigurationError(f"configure_checkpointing(checksum={checksum!r}): use 'metadata' or 'full'")
        changes["checksum"] = checksum
    if trust_custom_objects is not None:
        changes["trust_custom_objects"] = bool(trust_custom_objects)
    if async_save is not None:
        if not isinstance(async_save, bool):
            raise CheckpointConfigurationError(
                f"configure_checkpointing(async_save={async_save!r}): use True (save in the background) or False")
        changes["async_save"] = async_save
    if reuse_staging_memory is not None:
        if not isinstance(reuse_staging_memory, bool):
            raise CheckpointConfigurationError(
                f"configure_checkpointing(reuse_staging_memory={reuse_staging_memory!r}): use True (keep the "
                "staged host copy between asynchronous saves) or False (release it after each write)")
        changes["reuse_staging_memory"] = reuse_staging_memory
        if not reuse_staging_memory:
            changes["staging_pool"] = None  # released once the save in flight (if any) drops its copy
    if allow_reshard is not None:
        if not isinstance(allow_reshard, bool):
            raise CheckpointConfigurationError(
                f"configure_checkpointing(allow_reshard={allow_reshard!r}): use True (elastic resume) or False")
        changes["allow_reshard"] = allow_reshard
    if reshard_rank_map is not None:
        changes["reshard_rank_map"] = check_rank_map(reshard_rank_map)
    if protect is not None:
        changes["protect"] = _valid_protect(protect, f"configure_checkpointing(protect={protect!r})")
    if require_protection is not None:
        if not isinstance(require_protection, bool):
            raise CheckpointConfigurationError(
                f"configure_checkpointing(require_protection={require_protection!r}): use True (a save or load that "
                "would run native raises CheckpointUnprotectedError instead) or False (it runs native, with a WARNING)")
        changes["require_protection"] = require_protection
    if overwrite is not None:
        if overwrite not in OVERWRITE_MODES:
            raise CheckpointConfigurationError(
                f"configure_checkpointing(overwrite={overwrite!r}): use 'replace' (an existing checkpoint at the "
                "destination is replaced atomically, as native save_state overwrites) or 'refuse'")
        changes["overwrite"] = overwrite
    if accept_changes is not None:
        changes["accept_changes"] = check_accept_names(accept_changes)
    if mirror is not None:
        changes["mirror"] = _valid_mirror(mirror)
    if cache_dir is not None:
        changes["cache_dir"] = Path(os.fspath(cache_dir)).expanduser().absolute()
    if signing_key is not None or verification_keys is not None:
        changes.update(_keys(config, signing_key, verification_keys))
    if lock_timeout is not None:
        changes["lock_timeout"] = _valid_lock_timeout(lock_timeout, "configure_checkpointing(lock_timeout=...)")
    if arrival_timeout is not None:
        changes["arrival_timeout"] = _valid_arrival_timeout(arrival_timeout,
                                                            "configure_checkpointing(arrival_timeout=...)")
    for name, value in changes.items():  # everything validated: now change it
        setattr(config, name, value)
    return accelerator


def group_keys(group: Mapping[str, Any]) -> Keyring:
    """The keys of a group of Accelerators (one checkpoint, one manifest, one authenticator): every member must be
    configured with the same key ids, else a configuration error naming them."""
    keys = {name: checkpoint_config(owner).keys for name, owner in group.items()}
    ids = {name: value.key_ids() for name, value in keys.items()}
    if len({repr(value) for value in ids.values()}) > 1:
        raise CheckpointConfigurationError(
            f"The Accelerators of one checkpoint are configured with different keys ({ids}): one manifest carries one "
            "authenticator. Configure the same signing_key and verification_keys on each.")
    return next(iter(keys.values()), Keyring())


def _keys(config: CheckpointConfig, signing_key: Any, verification_keys: Any) -> dict[str, Any]:
    """The key settings after ``configure_checkpointing(signing_key=..., verification_keys=...)``: every key file read
    now (an unreadable or malformed one raises, naming the file, never its content)."""
    signing = config.signing_key
    if signing_key is not None:
        if not isinstance(signing_key, (str, os.PathLike)):
            raise CheckpointConfigurationError(
                f"configure_checkpointing(signing_key=...) takes the path of a key file (or '' for none), not a "
                f"{type(signing_key).__name__}: the key itself is never passed in an argument")
        signing = os.fspath(signing_key) or None
    verify = config.verification_keys
    if verification_keys is not None:
        if isinstance(verification_keys, (str, bytes, os.PathLike)) or not isinstance(verification_keys, Iterable):
            raise CheckpointConfigurationError(
                "configure_checkpointing(verification_keys=...) takes a list of key file paths (() for none)")
        verify = tuple(path if isinstance(path, str) else os.fspath(path) if isinstance(path, os.PathLike) else None
                       for path in verification_keys)
        if not all(isinstance(path, str) and path for path in verify):
            raise CheckpointConfigurationError(
                "configure_checkpointing(verification_keys=...): every entry must be the path of a key file")
    return {"signing_key": signing, "verification_keys": verify, "keys": keyring(signing, verify)}


def _valid_mirror(value: Any) -> str | None:
    if value == "":
        return None
    if not is_url(value) or not value.partition("://")[2].strip("/"):
        raise CheckpointConfigurationError(
            f"configure_checkpointing(mirror={value!r}): use an object-store prefix such as 's3://bucket/run' "
            f"(schemes: {', '.join(SCHEMES)}), or '' to turn mirroring off")
    return value.rstrip("/")


def _valid_protect(value: Any, where: str) -> str:
    mode = value.strip().lower() if isinstance(value, str) else value
    if mode not in PROTECT_MODES:
        raise CheckpointConfigurationError(
            f"{where}: use 'fsdp' (protect FSDP sharded checkpoints, the default) or 'all' (also one process and DDP)")
    return mode


def protect_mode(accelerator: Any) -> str:
    """``"fsdp"`` or ``"all"``: ``configure_checkpointing(protect=...)`` if it was set for ``accelerator``, else
    ``ACCELERATE_TXN_PROTECT`` (read now; unset: ``"fsdp"``). Creates no configuration (nothing else of the
    environment is read); an invalid value raises ``CheckpointConfigurationError`` naming the variable."""
    config = _CONFIGS.get(accelerator)
    if config is not None and config.protect is not None:
        return config.protect
    return PROTECT.read()


def _iterable(value: Any, where: str) -> tuple[Any, ...]:
    # A bare string is iterable too, but "seed" meaning ("s", "e", "e", "d") is never what the caller meant.
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise CheckpointConfigurationError(
            f"configure_checkpointing({where}=...) must be a list of metadata key names, got {value!r}"
        )
    return tuple(value)


def _names(value: Any, where: str) -> tuple[str, ...]:
    names = _iterable(value, where)
    if not all(isinstance(name, str) and name for name in names):
        raise CheckpointConfigurationError(f"configure_checkpointing({where}): every key must be a non-empty str, got {names!r}")
    return names


def _check_legacy_keys(
    metadata: Mapping[str, Any], keys: tuple[str, ...], groups: tuple[tuple[str, ...], ...]
) -> None:
    unknown = sorted({key for group in (keys, *groups) for key in group} - set(metadata))
    if unknown:
        raise CheckpointConfigurationError(
            f"configure_checkpointing: legacy metadata keys {unknown} are not in metadata=...; a migrated field "
            "must have a current value to fall back on. Add them to metadata, or drop them from "
            "legacy_metadata_keys/legacy_metadata_groups (pass () to clear them)."
        )


def mark_failed(accelerator: Any, failed: bool) -> None:
    """Mark a restore as failed (``optimizer.step()`` and saving raise) or clear the mark."""
    config = checkpoint_config(accelerator)
    config.failed = failed
    if failed and not config.step_guards:
        owner = ref(accelerator)

        def guard(optimizer: Any, args: Any, kwargs: Any) -> None:
            target = owner()
            if target is not None and checkpoint_config(target).failed:
                raise RestoreFailedError(
                    "The last load_state() failed part-way, so parameters and optimizer state may be inconsistent: "
                    "load a checkpoint successfully before calling optimizer.step()."
                )

        for optimizer in prepared_optimizers(accelerator):
            config.step_guards.append(raw_optimizer(optimizer).register_step_pre_hook(guard))
    elif not failed:
        for handle in config.step_guards:
            handle.remove()
        config.step_guards.clear()


def ensure_not_failed(accelerator: Any) -> None:
    if checkpoint_config(accelerator).failed:
        raise RestoreFailedError(
            "Refusing to save: the last load_state() failed part-way and the training state may be inconsistent. "
            "Load a checkpoint successfully first."
        )


def check_rank_map(rank_map: Any) -> dict[int, int] | None:
    """Validate the shape of ``reshard_rank_map`` (ranges are checked against a checkpoint on load)."""
    if rank_map is None:
        return None
    if not isinstance(rank_map, Mapping) or not all(
            type(k) is int and type(v) is int and k >= 0 and v >= 0 for k, v in rank_map.items()):
        raise CheckpointConfigurationError(
            f"configure_checkpointing(reshard_rank_map={rank_map!r}): use a dict {{this run's rank: saved rank}} "
            "of non-negative ints"
        )
    return dict(rank_map)

