"""``accelerate-txn doctor``: one command answers "is this job protected?".

The job (:mod:`._job`): the settings ``accelerate launch`` and the Trainer would use, read from the Accelerate config
file, the environment and a Trainer ``fsdp_config``; for each front end, the path it takes, each setting with where
it came from, and protected or every reason it is not with the one change that protects it, by the front ends' rules
(``accelerate.patch.protection``, ``trainer.patch.protection``) and the evidence below.

The releases: for each path of each front end (Accelerate FSDP1, FSDP2 and one process or DDP; the Trainer on the
same three) whether the installed releases are protected, from the evidence about the private pieces each path relies
on (``runtime.versions.PATHS``, ``trainer.internals.trainer_pieces``, ``compat.evidence``), the same check the front
ends run before a save; and why not, one line per differing piece. Also the switches (override, automatic dispatch,
protect, strict mode), and which stores and signing schemes are available here (``importlib.util.find_spec`` and the
installed versions against ``store.base.CLIENT_FLOORS``: no client library is imported).

Exit status: 0 when the job is protected on every front end required (by default every installed one), or, where no
setting of a job is found, when every path required is protected (by default every path of an installed front end);
the override counts; 1 when not (or when no front end is installed); 2 a usage error (a config file missing or not
Accelerate's, an ``--fsdp-config`` that is no JSON object).

It imports torch, Accelerate and transformers, which the checks read, only when it runs, and only those installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import click

from . import _output as out


@dataclass(frozen=True)
class Target:
    """One path of one front end: its ``--require`` name, the front end, its key in ``runtime.versions.PATHS``,
    and how the output names it."""

    name: str
    front_end: str
    path: str
    label: str


TARGETS: tuple[Target, ...] = (
    Target("fsdp1", "accelerate", "fsdp1", "Accelerate FSDP1"),
    Target("fsdp2", "accelerate", "fsdp2", "Accelerate FSDP2"),
    Target("ddp", "accelerate", "common", 'Accelerate one-process and DDP (protect="all")'),
    Target("trainer-fsdp1", "trainer", "fsdp1", "Trainer FSDP1"),
    Target("trainer-fsdp2", "trainer", "fsdp2", "Trainer FSDP2"),
    Target("trainer-ddp", "trainer", "common", "Trainer one-process and DDP"),
)
#: ``--require`` names that stand for several paths.
GROUPS: dict[str, tuple[str, ...]] = {
    "accelerate": tuple(target.name for target in TARGETS if target.front_end == "accelerate"),
    "trainer": tuple(target.name for target in TARGETS if target.front_end == "trainer"),
    "all": tuple(target.name for target in TARGETS),
}
#: The packages (import names) a front end needs.
NEEDS: dict[str, tuple[str, ...]] = {"accelerate": ("torch", "accelerate"),
                                     "trainer": ("torch", "accelerate", "transformers")}
PACKAGES = ("torch", "accelerate", "transformers")

# Statuses of a path.
PROTECTED = "protected"
OVERRIDE = "override"
UNPROTECTED = "not protected"
OFF = "off"
ABSENT = "not installed"
TEXT = {
    PROTECTED: "protected",
    OVERRIDE: "protected at your own risk (override)",
    UNPROTECTED: "NOT protected",
    OFF: "off: exactly native",
    ABSENT: "not installed",
}


@dataclass(frozen=True)
class Feature:
    """A store or a signing scheme, and the packages (import name, distribution) it needs."""

    name: str
    what: str
    needs: tuple[tuple[str, str], ...] = ()
    install: str | None = None


STORES: tuple[Feature, ...] = (
    Feature("local", "local and shared file systems"),
    Feature("s3", "S3 and S3-compatible object storage (s3://)", (("s3fs", "s3fs"), ("botocore", "botocore")),
            "pip install 'accelerate-txn[s3]'"),
    Feature("az", "Azure Blob Storage (az://)",
            (("azure.storage.blob", "azure-storage-blob"), ("azure.core", "azure-core")),
            "pip install 'accelerate-txn[azure]'"),
    Feature("gs", "Google Cloud Storage (gs://)",
            (("google.cloud.storage", "google-cloud-storage"), ("google.api_core", "google-api-core"),
             ("google.auth", "google-auth")), "pip install 'accelerate-txn[gcs]'"),
)
SIGNING: tuple[Feature, ...] = (
    Feature("hmac", "HMAC-SHA256 authenticated manifests (a shared secret)"),
    Feature("ed25519", "Ed25519 authenticated manifests (verifiers hold only the public key)",
            (("cryptography", "cryptography"),), "pip install 'accelerate-txn[signing]'"),
    Feature("exported-weights", "exported weights signed for OpenSSF model_signing (export --sign-key)",
            (("model_signing", "model-signing"), ("OpenSSL", "pyOpenSSL")), "pip install 'accelerate-txn[model-signing]'"),
)


def findable(module: str) -> bool:
    """Whether ``module`` can be imported here, without importing it (its parent packages excepted)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package; a module blocked with sys.modules[name] = None
        return False


@dataclass
class Finding:
    """What the checks found for one :class:`Target`."""

    target: Target
    absent: tuple[str, ...] = ()  # the packages it needs that are not installed
    differences: list[str] = field(default_factory=list)  # Difference.describe() of each differing piece
    blocking: list[str] = field(default_factory=list)  # what even the override does not cover
    required: bool = False

    def status(self, *, override: bool, dispatch: bool) -> str:
        if self.absent:
            return ABSENT
        if not dispatch:
            return OFF
        if self.blocking or (self.differences and not override):
            return UNPROTECTED
        return OVERRIDE if self.differences else PROTECTED

    @property
    def evidence(self) -> str | None:
        """``"matches"``: every piece has a value recorded for a release that passed; ``"differs"``; ``None``: not
        installed."""
        if self.absent:
            return None
        return "differs" if self.differences or self.blocking else "matches"


def _check_accelerate(finding: Finding) -> None:
    from ..runtime.versions import differing

    try:
        found = differing(finding.target.path)
    except Exception as exc:  # a broken installation: the check itself failed
        finding.blocking.append(f"the pieces cannot be checked ({type(exc).__name__}: {exc})")
        return
    finding.differences = [difference.describe() for difference in found]


def _check_trainer(finding: Finding) -> None:
    try:
        import transformers.trainer

        from ..trainer.internals import missing_points
        from ..trainer.versions import differing, transformers_series

        found = differing(transformers.trainer.Trainer, finding.target.path)
        missing = missing_points(transformers.trainer.Trainer, transformers_series())
    except Exception as exc:  # transformers that does not import, or a Trainer without a piece's parent
        finding.blocking.append(f"the pieces cannot be checked ({type(exc).__name__}: {exc})")
        return
    finding.differences = [difference.describe() for difference in found]
    if missing:  # the Trainer patch runs native for these whatever the override says (trainer.patch.native_reason)
        from ..compat.evidence import installed_release

        finding.blocking.append(f"transformers {installed_release('transformers')}: this Trainer lacks "
                                f"{', '.join(missing)} (or has another signature)")


def findings(required: Iterable[str]) -> list[Finding]:
    """Every target's :class:`Finding`, the ones named in ``required`` marked; checks only installed front ends."""
    installed = {package: findable(package) for package in PACKAGES}
    wanted = set(required)
    result = []
    for target in TARGETS:
        finding = Finding(target, tuple(p for p in NEEDS[target.front_end] if not installed[p]),
                          required=target.name in wanted)
        if not finding.absent:
            (_check_accelerate if target.front_end == "accelerate" else _check_trainer)(finding)
        result.append(finding)
    return result


def releases() -> dict[str, str | None]:
    """The installed torch, Accelerate and transformers releases (``None``: not installed): the imported module's
    ``__version__`` where it is imported (the sources the checks read), else the distribution's."""
    from ..compat.evidence import installed_release

    return {package: installed_release(package) if findable(package) else None for package in PACKAGES}


def feature(item: Feature) -> dict[str, Any]:
    """A store's or signing scheme's packages: installed (and their versions), too old for the floors the library
    checks at first use (``store.base.CLIENT_FLOORS``), or ok."""
    from ..store.base import CLIENT_FLOORS, installed_version, older_than

    floors = {name: floor for extra in CLIENT_FLOORS.values() for name, floor in extra.items()}
    found = {distribution: installed_version(distribution) if findable(module) else None
             for module, distribution in item.needs}
    required = {distribution: floors[distribution] for distribution in found if distribution in floors}
    too_old = [distribution for distribution, version in found.items()
               if version is not None and distribution in required and older_than(version, required[distribution])]
    status = ABSENT if None in found.values() else "too old" if too_old else "ok"
    return {"what": item.what, "available": status == "ok", "status": status, "packages": found,
            "required": required, "too_old": too_old, "install": None if status == "ok" else item.install}


def _feature_text(report: dict[str, Any]) -> str:
    packages = ", ".join(f"{distribution} {version}" for distribution, version in report["packages"].items()
                         if version is not None)
    if report["available"]:
        return f"available: {report['what']}" + (f" ({packages})" if packages else "")
    if report["status"] == "too old":
        old = [f"{name}>={report['required'][name]} ({report['packages'][name]} installed)"
               for name in report["too_old"]]
        return f"too old: {report['what']} needs {', '.join(old)}: {report['install']}"
    lacking = [distribution for distribution, version in report["packages"].items() if version is None]
    return f"not installed: {report['what']} needs {', '.join(lacking)}: {report['install']}"


def _required(values: tuple[str, ...]) -> list[str] | None:
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    if not names:
        return None
    known = {target.name for target in TARGETS}
    unknown = [name for name in names if name not in known and name not in GROUPS]
    if unknown:
        raise click.BadParameter(f"unknown path {', '.join(map(repr, unknown))}: use {', '.join(sorted(known))}, or "
                                 f"{', '.join(GROUPS)}", param_hint="'--require'")
    expanded = [member for name in names for member in GROUPS.get(name, (name,))]
    return [target.name for target in TARGETS if target.name in expanded]


REQUIRE_HELP = ("The paths that must be protected for exit 0, comma-separated or repeated: fsdp1, fsdp2, ddp (the "
                "Accelerate front end; ddp: one process and DDP, protect=\"all\"), trainer-fsdp1, trainer-fsdp2, "
                "trainer-ddp; accelerate, trainer and all name a front end's three. A path named whose packages are "
                "not installed counts as not protected. Default: every path of every installed front end. Where a "
                "job's settings are found, a front end is required when it or one of its paths is named, and a path "
                "named must be the one this job takes.")


CONFIG_HELP = ("The Accelerate config file the job is launched with, as accelerate launch --config_file takes. Default: "
               "Accelerate's default one where it exists ($HF_HOME/accelerate/default_config.yaml, HF_HOME defaulting "
               "to $XDG_CACHE_HOME/huggingface, that to ~/.cache/huggingface).")
FSDP_CONFIG_HELP = ("The Trainer's fsdp_config (a JSON file or a JSON string, as TrainingArguments takes it, with "
                    "fsdp=True): the installed transformers builds it in the job's environment.")


@click.command("doctor", short_help="Say whether this job's checkpoints are protected, and why not (exit 0 yes, 1 no).")
@click.option("--config-file", "--config_file", "config_file", metavar="PATH", help=CONFIG_HELP)
@click.option("--fsdp-config", "fsdp_config", metavar="JSON", help=FSDP_CONFIG_HELP)
@click.option("--require", "require", multiple=True, metavar="PATHS", help=REQUIRE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print only JSON on stdout (messages and log lines go to stderr).")
def doctor_command(config_file: str | None, fsdp_config: str | None, require: tuple[str, ...], as_json: bool) -> int:
    """Say whether this job's checkpoints are protected: the settings accelerate launch and the Trainer would use,
    and the installed torch, Accelerate and transformers releases.

    The job is read from the Accelerate config file (--config-file, else Accelerate's default one where it exists),
    the environment Accelerate reads (ACCELERATE_USE_FSDP, FSDP_VERSION, FSDP_STATE_DICT_TYPE, ...) and a Trainer's
    --fsdp-config: for each front end (Accelerate save_state(), the Trainer) it names each setting with where it came
    from, and says protected, or NOT protected with each reason and the one change that protects it (LOCAL_STATE_DICT,
    automatic dispatch off, one process or DDP without ACCELERATE_TXN_PROTECT=all, DeepSpeed, ...). Without any such
    setting, only the releases are judged.

    Each path (Accelerate FSDP1, FSDP2, one process and DDP; the Trainer on the same three) relies on private pieces
    of those packages; it is protected when every piece has a value recorded for a release that passed
    accelerate-txn's tests. Otherwise each differing piece is named, with the release and what changed. Also says
    whether the override (ACCELERATE_TXN_ALLOW_UNVALIDATED) is set and automatic dispatch
    (ACCELERATE_TXN_PATCHES) is on, and which stores and signing schemes are available.

    Exit 0 when the job is protected on every front end required (default: every installed one; the Trainer alone
    with --fsdp-config; without job settings: every path required; the override counts), 1 when it is not, or when
    automatic dispatch is off, or no front end is installed; 2 a usage error (a config file that is missing or no
    Accelerate config, an --fsdp-config that is no JSON object). Imports torch, Accelerate and transformers.
    """
    import platform

    from .. import __version__
    from ..accelerate.config import PROTECT, PROTECT_ENV
    from ..core.environment import OLDER_NAMES
    from ..runtime.protection import REQUIRE, REQUIRE_ENV
    from ..runtime.versions import DISPATCH as DISPATCH_SWITCH
    from ..runtime.versions import OVERRIDE as OVERRIDE_SWITCH
    from ..runtime.versions import (
        OVERRIDE_ENV,
        PATCH_ENV,
        automatic_dispatch_requested,
        override_requested,
    )
    from . import _job as job_module

    named = _required(require)
    inputs = job_module.read_inputs(config_file, fsdp_config, os.environ)  # a bad file: exit 2 before any import
    override, dispatch = override_requested(), automatic_dispatch_requested()  # an invalid value raises, naming it
    protect, strict = PROTECT.read(), REQUIRE.read()
    found = findings(named or ())
    jobs = _judge_jobs(inputs, found, require, override=override,
                       dispatch=(dispatch, f"{DISPATCH_SWITCH.source()}={os.environ.get(DISPATCH_SWITCH.source())}"),
                       protect=(protect, PROTECT.source()))
    if jobs:
        wanted = {job.target for job in jobs if job.required}
        for finding in found:
            finding.required = finding.target.name in wanted
    elif named is None:
        for finding in found:
            finding.required = not finding.absent
    statuses = {finding.target.name: finding.status(override=override, dispatch=dispatch) for finding in found}
    if jobs:
        required_jobs = [job for job in jobs if job.required]
        failing_jobs = [job for job in required_jobs if job.status not in (PROTECTED, OVERRIDE)]
        ok = bool(required_jobs) and not failing_jobs
        failing: list[Finding] = []
    else:
        required = [finding for finding in found if finding.required]
        failing = [finding for finding in required if statuses[finding.target.name] not in (PROTECTED, OVERRIDE)]
        ok = bool(required) and not failing
        failing_jobs = []
    report: dict[str, Any] = {
        "accelerate_txn": __version__,
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "releases": releases(),
        "automatic_dispatch": dispatch,
        "override": override,
        "protect": protect,
        "strict": strict,
        # Each switch under its name, and under an older name where that one is set (``core.environment``).
        "environment": {name: os.environ.get(name) for switch in (OVERRIDE_ENV, PATCH_ENV, PROTECT_ENV, REQUIRE_ENV)
                        for name in (switch, *(old for old in OLDER_NAMES.get(switch, ()) if old in os.environ))},
        "job": _job_report(inputs, jobs),
        "paths": {finding.target.name: {
            "label": finding.target.label, "front_end": finding.target.front_end,
            "installed": not finding.absent, "missing_packages": list(finding.absent),
            "status": statuses[finding.target.name],
            "protected": None if finding.absent else statuses[finding.target.name] in (PROTECTED, OVERRIDE),
            "evidence": finding.evidence, "differences": finding.blocking + finding.differences,
            "required": finding.required} for finding in found},
        "required": [finding.target.name for finding in found if finding.required],
        "protected": ok,
        "stores": {item.name: feature(item) for item in STORES},
        "signing": {item.name: feature(item) for item in SIGNING},
    }
    if as_json:
        out.emit_json(report)
    else:
        # Each switch named as it was set (an older VIDEOX_ name too: ``core.environment``).
        names = (OVERRIDE_SWITCH.source(), DISPATCH_SWITCH.source(), PROTECT.source(), REQUIRE.source())
        _print(report, found, statuses, failing, named is not None, names, inputs, jobs, failing_jobs)
    return 0 if ok else 1


def _target_name(front_end: str, path: str) -> str:
    """The ``--require`` name of a front end's path (``("trainer", "common")`` -> ``"trainer-ddp"``)."""
    return next(target.name for target in TARGETS if target.front_end == front_end and target.path == path)


def _judge_jobs(inputs: Any, found: list[Finding], require: tuple[str, ...], *, override: bool,
                dispatch: tuple[bool, str], protect: tuple[str, str]) -> list[Any]:
    """Each installed front end's job (``_job.FrontEndJob``), judged; empty when no setting of a job was found.

    Required: every installed front end (the Trainer alone with a Trainer ``fsdp_config``), or those ``--require``
    names (a group: its front end; a path: its front end, whose job must take that path)."""
    from . import _job as job_module

    if not inputs.found:
        return []
    names = [name.strip() for value in require for name in value.split(",") if name.strip()]
    by_name = {target.name: target for target in TARGETS}
    fronts: set[str] = set()
    paths: dict[str, set[str]] = {"accelerate": set(), "trainer": set()}
    for name in names:
        if name in GROUPS:
            fronts |= {"accelerate", "trainer"} if name == "all" else {name}
        else:
            fronts.add(by_name[name].front_end)
            paths[by_name[name].front_end].add(name)
    findings_by_name = {finding.target.name: finding for finding in found}
    jobs = []
    for front_end, build in (("accelerate", job_module.accelerate_job), ("trainer", job_module.trainer_job)):
        absent = [package for package in NEEDS[front_end] if not findable(package)]
        job = build(inputs) if not absent else job_module.FrontEndJob(
            front_end, "Accelerate save_state()" if front_end == "accelerate" else "Trainer",
            job_module.Setting(None, f"not installed ({', '.join(absent)})"))
        job.target = _target_name(front_end, job.path)
        finding = findings_by_name[job.target]
        # Default: every installed front end; a Trainer fsdp_config says the job is a Trainer's.
        job.required = front_end in fronts if names else not absent and (
            inputs.fsdp_config is None or front_end == "trainer")
        evidence = finding.status(override=override, dispatch=True)
        job_module.judge(job, evidence, finding.differences, finding.blocking, dispatch=dispatch, protect=protect)
        if paths[front_end] and job.target not in paths[front_end] and job.status != ABSENT:
            asked = ", ".join(sorted(paths[front_end]))
            job.reasons.append((f"this job takes the {job.target} path, not {asked} (--require)",
                                f"ask for it (--require {job.target}), or change the job's settings to take {asked}"))
            job.status = UNPROTECTED
        jobs.append(job)
    return jobs


def _job_report(inputs: Any, jobs: list[Any]) -> dict[str, Any]:
    from . import _job as job_module

    return {
        "found": inputs.found,
        "config_file": None if inputs.config_file is None else str(inputs.config_file),
        "config_default": inputs.config_default,
        "default_location": str(inputs.default_location),
        "fsdp_config": inputs.fsdp_config_source,
        "notes": inputs.notes,
        "front_ends": {job.front_end: job_module.as_json(job) for job in jobs},
    }


def _print_job(inputs: Any, jobs: list[Any]) -> None:
    if not jobs:
        out.say(f"this job: no settings found (no Accelerate config file given or at {inputs.default_location}; none "
                "of ACCELERATE_USE_FSDP, ACCELERATE_USE_DEEPSPEED, FSDP_VERSION, FSDP_STATE_DICT_TYPE set; no "
                "--fsdp-config): the installed releases only are judged; give --config-file (as to accelerate "
                "launch) or --fsdp-config to judge a job")
        return
    read = []
    if inputs.config_file is not None:
        read.append(f"Accelerate config {inputs.config_file}" + (" (Accelerate's default location)"
                                                                  if inputs.config_default else ""))
    else:
        read.append(f"no Accelerate config file (none given, none at {inputs.default_location})")
    read.append("the environment")
    if inputs.fsdp_config_source is not None:
        read.append(f"Trainer fsdp_config {inputs.fsdp_config_source}")
    out.say(f"this job (read from {', '.join(read)}):")
    for note in inputs.notes:
        out.say(f"  note: {note}")
    for job in jobs:
        if job.status == ABSENT:
            out.say(f"  {job.label}: not installed")
            continue
        out.say(f"  {job.label}: {job.describe()} ({job.target} path)" + ("" if job.required else "  (not required)"))
        for name, setting in job.settings().items():
            out.say(f"      {name.replace('_', ' ')}: {setting.value} ({setting.source})")
        for note in job.notes:
            out.say(f"      note: {note}")
        if job.reasons:
            for reason, fix in job.reasons:
                out.say(f"    NOT protected: {reason}" + (f"; to protect it: {fix}" if fix else ""))
        else:
            out.say(f"    {TEXT[job.status]}")
    out.say("  the script decides the rest, which is not read here: an FSDP plugin it builds with explicit fields, "
            "configure_checkpointing(protect=..., require_protection=...), ProjectConfiguration(save_on_each_node="
            "True) (not protected), its optimizer (accelerate_txn.protection() answers in the script); the Trainer's "
            "push_to_hub=True (not protected)")


def _print(report: dict[str, Any], found: list[Finding], statuses: dict[str, str], failing: list[Finding],
           restricted: bool, names: tuple[str, str, str, str], inputs: Any, jobs: list[Any],
           failing_jobs: list[Any]) -> None:
    python = report["python"]
    out.say(f"accelerate-txn {report['accelerate_txn']} on Python {python['version']} ({python['executable']})")
    out.say("installed: " + ", ".join(f"{package} {version or 'not installed'}"
                                      for package, version in report["releases"].items()))
    override_env, patch_env, protect_env, require_env = names
    override_value, patch_value = report["environment"][override_env], report["environment"][patch_env]
    out.say(f"override ({override_env}): " + (f"set ({override_value}): paths whose pieces differ take the protected "
                                              "path at your own risk" if report["override"] else "not set"))
    if report["automatic_dispatch"]:
        out.say(f"automatic dispatch ({patch_env}): on")
    else:
        out.say(f"automatic dispatch ({patch_env}={patch_value}): off: exactly native: save_state(), "
                "load_state() and Trainer checkpoints run native Accelerate and Trainer; only an Accelerator opted in "
                "with patch_accelerate_fsdp(accelerator) and the explicit API (save_training_checkpoint) take the "
                "protected path, where the evidence below matches")
    out.say(f"protect ({protect_env}): {report['protect']}" + (": one process and DDP too" if report["protect"] == "all"
                                                               else ": FSDP (one process and DDP with 'all')"))
    out.say(f"strict mode ({require_env}): " + ("on: a save or load that would run native raises "
                                                 "CheckpointUnprotectedError" if report["strict"] else "off"))
    out.say()
    width = max(len(target.label) for target in TARGETS) + 2
    job_paths = {job.target for job in jobs if job.status != ABSENT}
    for finding in found:
        status = statuses[finding.target.name]
        text = TEXT[status]
        if status == ABSENT:
            text += f" ({', '.join(finding.absent)})"
        elif status == OFF:
            text += f" (the evidence {'matches' if finding.evidence == 'matches' else 'differs'})"
        if jobs and finding.target.name in job_paths:
            text += "  (this job's path)"
        elif not jobs and restricted and not finding.required and status != ABSENT:
            text += "  (not required)"
        out.say(f"{finding.target.label.ljust(width)}{text}")
        for line in finding.blocking + finding.differences:
            out.say(f"    {line}")
    out.say()
    _print_job(inputs, jobs)
    out.say()
    for section in ("stores", "signing"):
        out.say(f"{section}:")
        items: dict[str, dict[str, Any]] = report[section]
        column = max(map(len, items)) + 2
        for name, item in items.items():
            out.say(f"  {name.ljust(column)}{_feature_text(item)}")
    out.say()
    if jobs:
        _verdict_job(report, jobs, failing_jobs, require_env)
        return
    required = [name for name, path in report["paths"].items() if path["required"]]
    scope = f"the paths required ({', '.join(required)})" if restricted else "every path of every installed front end"
    if not required:
        out.say("NOT protected: no front end is installed (the Accelerate front end needs torch and Accelerate) (exit 1)")
    elif failing:
        out.say(f"NOT protected: {', '.join(finding.target.label for finding in failing)} (exit 1)")
        if any(statuses[finding.target.name] == UNPROTECTED and not finding.blocking for finding in failing):
            out.say(f"  these run native Accelerate or Trainer after one warning; set {override_env}=1 to take the "
                    "protected path at your own risk (docs/versions.md)")
        if any(statuses[finding.target.name] == OFF for finding in failing):
            out.say(f"  automatic dispatch is off ({patch_env}={patch_value}): unset {patch_env} to protect them")
    elif any(statuses[name] == OVERRIDE for name in required):
        out.say(f"protected at your own risk (override): {scope} (exit 0)")
    else:
        out.say(f"protected: {scope} (exit 0)")


def _verdict_job(report: dict[str, Any], jobs: list[Any], failing: list[Any], require_env: str) -> None:
    required = [job for job in jobs if job.required]
    scope = " and ".join(f"{job.label} ({job.target})" for job in required)
    if not required:
        out.say("NOT protected: no front end is installed (the Accelerate front end needs torch and Accelerate) (exit 1)")
    elif failing:
        out.say(f"NOT protected: this job's checkpoints on {', '.join(job.label for job in failing)} (exit 1)")
        for job in failing:
            if job.status == ABSENT:
                out.say(f"  {job.label}: not installed")
            for reason, fix in job.reasons:
                out.say(f"  {job.label}: {reason}" + (f"; to protect it: {fix}" if fix else ""))
        if report["strict"]:
            out.say(f"  strict mode ({require_env}): the first save or load raises CheckpointUnprotectedError "
                    "instead of running native")
    elif any(job.status == OVERRIDE for job in required):
        out.say(f"protected at your own risk (override): this job's checkpoints on {scope} (exit 0)")
    else:
        out.say(f"protected: this job's checkpoints on {scope} (exit 0)")
