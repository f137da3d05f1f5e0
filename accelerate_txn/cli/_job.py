"""The job ``accelerate-txn doctor`` judges: the settings ``accelerate launch`` and the Trainer would use, where each
came from, and whether the front ends would protect this job's checkpoints.

What is read, as Accelerate and transformers read it:

* the Accelerate config file: ``--config-file``, else Accelerate's default location where a file is there
  (``accelerate.commands.config.config_args``: ``$HF_HOME/accelerate/default_config.yaml``, ``HF_HOME`` defaulting to
  ``$XDG_CACHE_HOME/huggingface`` and that to ``~/.cache/huggingface``), read as JSON when its name ends in ``.json``,
  else as YAML;
* what ``accelerate launch`` exports from it over the environment the job starts with (``accelerate.utils.launch``:
  ``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION`` the file's ``fsdp_version`` or the launcher's default ``1``,
  ``FSDP_STATE_DICT_TYPE`` the file's ``fsdp_state_dict_type`` where it has one; ``ACCELERATE_USE_DEEPSPEED=true``);
* the environment ``Accelerator()`` reads (``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_USE_FSDP``) and its FSDP plugin
  reads for the fields a script leaves out (``FullyShardedDataParallelPlugin.__post_init__``: ``FSDP_VERSION``, default
  1; ``set_state_dict_type``: ``FSDP_STATE_DICT_TYPE``, default ``FULL_STATE_DICT`` for FSDP1 and
  ``SHARDED_STATE_DICT`` for FSDP2; FSDP2 refuses ``LOCAL_STATE_DICT``);
* a Trainer's ``fsdp_config`` (``--fsdp-config``: a JSON file or a JSON string, with ``fsdp=True``): the installed
  ``TrainingArguments`` is built with it in the job's environment, so the release's own defaults and mapping decide
  (5.x passes ``version`` and ``state_dict_type`` to the plugin, defaulting to 2 and ``FULL_STATE_DICT``; 4.57 passes
  neither: the plugin reads the environment);
* accelerate-txn's switches: automatic dispatch, ``ACCELERATE_TXN_PROTECT`` and strict mode.

The rules are the front ends' (``accelerate.patch.protection``, ``trainer.patch.protection``); what only the script
decides (a plugin built with explicit fields, ``configure_checkpointing(protect=...)``, ``ProjectConfiguration(
save_on_each_node=True)``, the optimizer, ``push_to_hub``) is beyond what the doctor reads, and said so.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from ..runtime.protection import STATE_DICT_FIX

# torch.distributed.fsdp.StateDictType: the names, and the numbers Accelerate also accepts ("3").
STATE_DICT_TYPES = {1: "FULL_STATE_DICT", 2: "LOCAL_STATE_DICT", 3: "SHARDED_STATE_DICT"}
PROTECTED_STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
ONE_PROCESS_OR_DDP = "NO"
#: The environment variables of the job this module reads (``Accelerator`` and its FSDP plugin).
JOB_VARIABLES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_VERSION", "FSDP_STATE_DICT_TYPE")


@dataclass(frozen=True)
class Setting:
    """One setting of the job and where its value came from."""

    value: Any
    source: str

    def as_json(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source}


@dataclass
class Inputs:
    """What the job is read from: the Accelerate config file (``None``: none), the environment its processes start
    with once ``accelerate launch`` exported the file's settings, where each variable came from, and the Trainer's
    ``fsdp_config`` (``None``: not given)."""

    config_file: Path | None
    config_default: bool  # the file is Accelerate's default one (not --config-file)
    default_location: Path
    config: dict[str, Any] | None
    environment: dict[str, str]
    sources: dict[str, str]
    notes: list[str]
    fsdp_config: dict[str, Any] | None
    fsdp_config_source: str | None

    @property
    def found(self) -> bool:
        """Whether any setting of a job was found: a config file, an Accelerate FSDP/DeepSpeed variable, or a Trainer
        ``fsdp_config``. Without one, the doctor judges the installed releases only."""
        return (self.config is not None or self.fsdp_config is not None
                or any(self.environment.get(name, "").strip() for name in JOB_VARIABLES))


@dataclass
class FrontEndJob:
    """The job on one front end: its settings, what would refuse them at start, and (once judged) the verdict."""

    front_end: str  # "accelerate" or "trainer"
    label: str
    distributed_type: Setting
    fsdp_version: Setting | None = None
    state_dict_type: Setting | None = None
    notes: list[str] = field(default_factory=list)
    refusal: tuple[str, str] | None = None  # why Accelerate or transformers refuses these settings at start; the fix
    # The verdict (``judge``): the doctor's status, and every reason it is not protected with its fix.
    status: str = ""
    reasons: list[tuple[str, str | None]] = field(default_factory=list)
    required: bool = False
    target: str = ""  # the doctor's path name (``fsdp1``, ``trainer-ddp``, ...)

    @property
    def path(self) -> str:
        """The protected path's key (``runtime.versions.PATHS``) the front end would take."""
        if self.distributed_type.value == "FSDP":
            return "fsdp2" if self.fsdp_version is not None and self.fsdp_version.value == 2 else "fsdp1"
        return "common"

    def describe(self) -> str:
        kind = self.distributed_type.value
        if kind == "FSDP":
            version = "" if self.fsdp_version is None else f"{self.fsdp_version.value}"
            return f"FSDP{version}" + (f" with {self.state_dict_type.value}" if self.state_dict_type else "")
        if kind == ONE_PROCESS_OR_DDP:
            return "one process or DDP"
        return str(kind)

    def settings(self) -> dict[str, Setting]:
        found = {"distributed_type": self.distributed_type}
        if self.fsdp_version is not None:
            found["fsdp_version"] = self.fsdp_version
        if self.state_dict_type is not None:
            found["state_dict_type"] = self.state_dict_type
        return found


# --- Reading -------------------------------------------------------------------------------------------------------


def default_config_file(environ: Mapping[str, str]) -> Path:
    """Accelerate's default config file for ``environ`` (``accelerate.commands.config.config_args``), ``~`` read as
    ``os.path.expanduser`` does in a process with that environment."""
    cache = environ.get("XDG_CACHE_HOME", "~/.cache")
    home = environ.get("HF_HOME", os.path.join(cache, "huggingface"))
    if home == "~" or home.startswith("~/"):
        user = environ["HOME"].rstrip("/") if "HOME" in environ else os.path.expanduser("~")
        home = (user + home[1:]) or "/"
    else:
        home = os.path.expanduser(home)  # ~user
    return Path(home) / "accelerate" / "default_config.yaml"


def read_config(path: Path, option: str) -> dict[str, Any]:
    """An Accelerate config file's settings; a file that is missing, unreadable or no Accelerate config is a usage
    error (``accelerate launch`` refuses it too) naming ``option`` and the file."""
    if not path.is_file():
        raise click.BadParameter(f"{path}: no such file. Give an Accelerate config file (accelerate config writes "
                                 "one), as accelerate launch --config_file takes.", param_hint=option)
    try:
        text = path.read_text(encoding="utf-8")
        if path.name.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml  # Accelerate's dependency (its config files are YAML)

            data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, ImportError) as exc:
        raise click.BadParameter(f"{path}: cannot be read as an Accelerate config file ({type(exc).__name__}: "
                                 f"{exc}).", param_hint=option) from None
    except Exception as exc:  # yaml.YAMLError
        raise click.BadParameter(f"{path}: not YAML ({exc}).", param_hint=option) from None
    if not isinstance(data, dict) or "distributed_type" not in data:
        raise click.BadParameter(f"{path}: not an Accelerate config file: it has no distributed_type (accelerate "
                                 "launch refuses it too).", param_hint=option)
    return data


def read_fsdp_config(value: str) -> tuple[dict[str, Any], str]:
    """A Trainer ``fsdp_config`` given as a JSON file or a JSON string, and how to name it."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise click.BadParameter(f"{path}: not JSON ({exc}); TrainingArguments reads fsdp_config files as "
                                     "JSON.", param_hint="'--fsdp-config'") from None
        where = str(path)
    else:
        try:
            data = json.loads(value)
        except ValueError:
            raise click.BadParameter(f"{value!r} is neither a file nor a JSON object: give the fsdp_config "
                                     "TrainingArguments takes, as a JSON file or a JSON string.",
                                     param_hint="'--fsdp-config'") from None
        where = "--fsdp-config"
    if not isinstance(data, dict):
        raise click.BadParameter(f"{where}: the fsdp_config is a JSON object, not {type(data).__name__}.",
                                 param_hint="'--fsdp-config'")
    return data, where


def fsdp_keys(settings: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``settings`` with every key in one spelling: Accelerate's config file prefixes its FSDP keys with ``fsdp_``
    (``accelerate launch`` adds it where missing), ``TrainingArguments`` strips it."""
    if prefix:
        return {(key if key.startswith(prefix) else prefix + key): value for key, value in settings.items()}
    return {(key[5:] if key.startswith("fsdp_") else key): value for key, value in settings.items()}


def read_inputs(config_file: str | None, fsdp_config: str | None, environ: Mapping[str, str]) -> Inputs:
    """The job's inputs: the config file (given, else the default one where it exists), and the environment the
    job's processes would start with after ``accelerate launch`` exported the file's settings."""
    default = default_config_file(environ)
    path = Path(config_file).expanduser() if config_file is not None else default if default.is_file() else None
    config = read_config(path, "'--config-file'" if config_file is not None else "the default config file") \
        if path is not None else None
    environment = dict(environ)
    sources = {name: f"environment: {name}" for name in environment}
    notes: list[str] = []
    if config is not None:
        kind = str(config.get("distributed_type", "")).upper()
        if kind == "FSDP":
            fsdp = fsdp_keys(config.get("fsdp_config") or {}, "fsdp_")
            exported = {"ACCELERATE_USE_FSDP": ("true", f"{path}: distributed_type: FSDP")}
            if "fsdp_version" in fsdp:
                exported["FSDP_VERSION"] = (str(fsdp["fsdp_version"]), f"{path}: fsdp_config.fsdp_version")
            else:
                exported["FSDP_VERSION"] = ("1", f"accelerate launch's default (--fsdp_version 1): {path} has no "
                                                 "fsdp_version")
            if fsdp.get("fsdp_state_dict_type") is not None:
                exported["FSDP_STATE_DICT_TYPE"] = (str(fsdp["fsdp_state_dict_type"]),
                                                    f"{path}: fsdp_config.fsdp_state_dict_type")
        elif kind == "DEEPSPEED":
            exported = {"ACCELERATE_USE_DEEPSPEED": ("true", f"{path}: distributed_type: DEEPSPEED")}
        else:
            exported = {}
        for name, (value, source) in exported.items():
            before = environ.get(name)
            if before is not None and before.strip() and before != value and name.startswith("FSDP_"):
                notes.append(f"the environment's {name}={before} is replaced: accelerate launch exports "
                             f"{name}={value} ({source})")
            environment[name], sources[name] = value, source
    given, where = read_fsdp_config(fsdp_config) if fsdp_config is not None else (None, None)
    return Inputs(path, config_file is None and path is not None, default, config, environment, sources, notes,
                  given, where)


# --- What Accelerate and the Trainer would build -------------------------------------------------------------------


def distributed_type(inputs: Inputs, environment: Mapping[str, str], sources: Mapping[str, str]) -> Setting:
    """The distributed type ``Accelerator()`` would take (``accelerate.state``): DeepSpeed or FSDP where their
    variable is ``true``, else the config file's, else one process or DDP."""
    for kind, name in (("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED"), ("FSDP", "ACCELERATE_USE_FSDP")):
        if environment.get(name, "false").lower() == "true":
            return Setting(kind, sources.get(name, f"environment: {name}"))
    if inputs.config is not None:
        return Setting(str(inputs.config["distributed_type"]).upper(), f"{inputs.config_file}: distributed_type")
    for name in ("FSDP_STATE_DICT_TYPE", "FSDP_VERSION"):
        if environment.get(name, "").strip():
            return Setting("FSDP", f"assumed from {sources.get(name, name)} (ACCELERATE_USE_FSDP is not set: it "
                                   "applies to an FSDP plugin the script builds)")
    return Setting(ONE_PROCESS_OR_DDP, "no FSDP or DeepSpeed setting: one process or DDP")


def fsdp_plugin(job: FrontEndJob, environment: Mapping[str, str], sources: Mapping[str, str],
                explicit: Mapping[str, Setting]) -> None:
    """The FSDP version and state dict type of the ``FullyShardedDataParallelPlugin`` built with the fields in
    ``explicit`` in ``environment`` (Accelerate's rules), and what it would refuse."""
    version = explicit.get("fsdp_version")
    if version is None:
        version = Setting(environment.get("FSDP_VERSION", "1"),
                          sources.get("FSDP_VERSION", "Accelerate's default (FSDP_VERSION unset): 1"))
    try:
        number = int(version.value)
    except (TypeError, ValueError):
        job.fsdp_version = version
        job.refusal = (f"Accelerate refuses FSDP version {version.value!r} ({version.source}): the job does not start",
                       "set the FSDP version to 1 or 2 (accelerate config: fsdp_version; environment: FSDP_VERSION)")
        return
    job.fsdp_version = Setting(number, version.source)
    kind = explicit.get("state_dict_type")
    if kind is None:
        if environment.get("FSDP_STATE_DICT_TYPE") is not None:
            kind = Setting(environment["FSDP_STATE_DICT_TYPE"],
                           sources.get("FSDP_STATE_DICT_TYPE", "environment: FSDP_STATE_DICT_TYPE"))
        else:
            kind = Setting("FULL_STATE_DICT" if number == 1 else "SHARDED_STATE_DICT",
                           f"Accelerate's default for FSDP{number} (FSDP_STATE_DICT_TYPE unset)")
    raw = str(kind.value).strip()
    name = STATE_DICT_TYPES.get(int(raw)) if raw.isdigit() else raw.upper()
    job.state_dict_type = Setting(name if name in STATE_DICT_TYPES.values() else kind.value, kind.source)
    if name not in STATE_DICT_TYPES.values():
        job.refusal = (f"Accelerate refuses the state dict type {kind.value!r} ({kind.source}; it takes "
                       f"{', '.join(STATE_DICT_TYPES.values())}): the job does not start", STATE_DICT_FIX)
    elif number == 2 and name == "LOCAL_STATE_DICT":
        job.refusal = ("Accelerate refuses LOCAL_STATE_DICT with FSDP2 (FSDP2 does not support it): the job does not "
                       "start", STATE_DICT_FIX)


def accelerate_job(inputs: Inputs) -> FrontEndJob:
    """The job as ``Accelerator()`` in a script launched with these settings builds it (no plugin of its own)."""
    kind = distributed_type(inputs, inputs.environment, inputs.sources)
    job = FrontEndJob("accelerate", "Accelerate save_state()", kind)
    if kind.value == "FSDP":
        fsdp_plugin(job, inputs.environment, inputs.sources, {})
    return job


@contextlib.contextmanager
def environment_of(values: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """``os.environ`` is ``values`` inside (yields it, as code inside leaves it); the process's own afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(values)
    try:
        yield os.environ  # type: ignore[misc]
    finally:
        os.environ.clear()
        os.environ.update(saved)


def trainer_job(inputs: Inputs) -> FrontEndJob:
    """The job as the Trainer builds it: its ``fsdp_config`` through the installed ``TrainingArguments`` (in the job's
    environment), then the Accelerator with that plugin, or from the environment without one."""
    if inputs.fsdp_config is None:
        job = FrontEndJob("trainer", "Trainer", distributed_type(inputs, inputs.environment, inputs.sources))
        if job.distributed_type.value == "FSDP":
            fsdp_plugin(job, inputs.environment, inputs.sources, {})
        return job
    import transformers

    given = fsdp_keys(inputs.fsdp_config, "")
    where = f"Trainer fsdp_config ({inputs.fsdp_config_source})"
    release = f"transformers {transformers.__version__}"
    with environment_of(inputs.environment) as live, tempfile.TemporaryDirectory() as scratch:
        try:
            from transformers import TrainingArguments

            arguments = TrainingArguments(output_dir=scratch, fsdp=True, fsdp_config=dict(inputs.fsdp_config),
                                          report_to=[])
        except Exception as exc:  # the release's own refusal of this fsdp_config
            job = FrontEndJob("trainer", "Trainer", Setting("FSDP", where))
            job.refusal = (f"{release}'s TrainingArguments refuses this fsdp_config ({type(exc).__name__}: {exc}): the "
                           "job does not start", "correct the fsdp_config as the error says")
            return job
        environment = dict(live)
    sources = dict(inputs.sources)
    sources.update({name: f"{release}'s TrainingArguments ({where})" for name, value in environment.items()
                    if inputs.environment.get(name) != value})
    if given.get("xla"):
        return FrontEndJob("trainer", "Trainer", Setting("XLA", f"{where}: xla"))
    plugin = getattr(arguments, "fsdp_plugin_args", None)
    explicit: dict[str, Setting] = {}
    notes = []
    for key, field_name in (("version", "fsdp_version"), ("state_dict_type", "state_dict_type")):
        if plugin and field_name in plugin:
            source = f"{where}: {key}" if key in given else f"{release}'s default ({where} has no {key})"
            explicit[field_name] = Setting(plugin[field_name], source)
        elif key in given:
            notes.append(f"{release} does not pass {where}'s {key} to Accelerate: the plugin reads the environment")
    kind = distributed_type(inputs, environment, sources)
    if kind.value != "DEEPSPEED" and (plugin or kind.value != "FSDP"):
        kind = Setting("FSDP", f"{where}: TrainingArguments(fsdp=True, fsdp_config=...)")
    job = FrontEndJob("trainer", "Trainer", kind, notes=notes)
    if kind.value == "FSDP":
        fsdp_plugin(job, environment, sources, explicit)
    return job


# --- Judging ------------------------------------------------------------------------------------------------------


def judge(job: FrontEndJob, evidence: str, differences: list[str], blocking: list[str], *, dispatch: tuple[bool, str],
          protect: tuple[str, str]) -> None:
    """Set ``job``'s status and reasons: every condition of its front end's rule that fails (in the order the front
    end checks them: ``accelerate.patch.protection``, ``trainer.patch.protection``), each with the one change that
    lifts it. ``evidence``: the doctor's status of the job's path from the installed releases (``protected``,
    ``override``, ``not protected``, ``not installed``), ``differences`` and ``blocking`` its lines; ``dispatch``:
    (on, how it was set: ``NAME=value``), ``protect``: (``fsdp`` or ``all``, the variable's spelling)."""
    from ..accelerate.patch import BROADER_BACKENDS
    from ..runtime.versions import OVERRIDE_ENV

    if evidence == "not installed":
        job.status = evidence
        return
    reasons: list[tuple[str, str | None]] = []
    kind = job.distributed_type.value
    if job.refusal is not None:
        reasons.append(job.refusal)
    on, switch = dispatch
    variable = switch.partition("=")[0]
    if job.front_end == "accelerate":
        mode, protect_variable = protect
        if kind != "FSDP" and kind not in BROADER_BACKENDS:
            reasons.append((f"the distributed type {kind} is not protected",
                            "none that keeps it: FSDP (distributed_type: FSDP) is protected, and one process and DDP "
                            f"with {protect_variable}=all"))
        elif kind != "FSDP" and mode != "all":
            reasons.append((f"{job.describe()} checkpoints are protected only with protect='all'",
                            f"configure_checkpointing(accelerator, protect='all') or {protect_variable}=all"))
        if not on:
            reasons.append((f"automatic dispatch is off ({switch})",
                            f"unset {variable} (or set it to 1), or opt this Accelerator in with "
                            "patch_accelerate_fsdp()"))
    elif not on:
        reasons.append((f"automatic dispatch is off ({switch})", f"unset {variable} (or set it to 1)"))
    if evidence == "not protected":
        lines = blocking + differences
        what = f"{'the Trainer' if job.front_end == 'trainer' else 'Accelerate'} on the {job.path} path"
        reasons.append((f"the installed releases are not protected for {what}: {lines[0]}"
                        + (f" (and {len(lines) - 1} more, listed above)" if len(lines) > 1 else ""),
                        "install releases the evidence protects (docs/versions.md)" if blocking else
                        f"install releases the evidence protects (docs/versions.md) or set {OVERRIDE_ENV}=1 at your "
                        "own risk"))
    if kind == "FSDP" and job.refusal is None:  # both front ends: LOCAL_STATE_DICT runs native
        version = job.fsdp_version.value if job.fsdp_version is not None else 1
        if version not in (1, 2):
            reasons.append((f"FSDP{version} is not protected (FSDP1 and FSDP2 only)",
                            "use FSDP1 or FSDP2 (fsdp_version: 1 or 2)"))
        elif job.state_dict_type is not None and job.state_dict_type.value not in PROTECTED_STATE_DICT_TYPES:
            reasons.append((f"state_dict_type is {job.state_dict_type.value} (protected: SHARDED_STATE_DICT and "
                            "FULL_STATE_DICT)", STATE_DICT_FIX))
    if job.front_end == "trainer" and kind not in ("FSDP", "DEEPSPEED", *BROADER_BACKENDS):
        job.notes.append(f"the Trainer's save transaction wraps what Trainer writes on {kind} as on one process or "
                         "DDP; accelerate-txn's tests run one process, DDP and FSDP")
    if job.front_end == "trainer" and kind == "DEEPSPEED":
        reasons.append(("DeepSpeed writes its own checkpoint layout (native Trainer)",
                        "none that keeps DeepSpeed: the Trainer's FSDP, one-process and DDP checkpoints are protected"))
    job.reasons = reasons
    job.status = "not protected" if reasons else evidence


def as_json(job: FrontEndJob) -> dict[str, Any]:
    return {
        "label": job.label, "path": job.target, "describes": job.describe(),
        "settings": {name: setting.as_json() for name, setting in job.settings().items()},
        "notes": job.notes, "status": job.status,
        "protected": None if job.status == "not installed" else job.status in ("protected", "override"),
        "reasons": [{"reason": reason, "fix": fix} for reason, fix in job.reasons],
        "reason": job.reasons[0][0] if job.reasons else None, "fix": job.reasons[0][1] if job.reasons else None,
        "required": job.required,
    }
