"""``accelerate-txn doctor``: one command answers "am I protected?".

For each path of each front end (Accelerate FSDP1, FSDP2 and one process or DDP; the Trainer on the same three) it
says whether the installed releases are protected, from the evidence about the private pieces each path relies on
(``runtime.versions.PATHS``, ``trainer.internals.trainer_pieces``, ``compat.evidence``), the same check the
front ends run before a save; and why not, one line per differing piece. Also the override and automatic dispatch
settings, and which stores and signing schemes are available here (``importlib.util.find_spec`` and the installed
versions against ``store.base.CLIENT_FLOORS``: no client library is imported).

Exit status: 0 when every path required is protected (by default every path of an installed front end; the
override counts), 1 when one is not (or when no front end is installed), 2 a usage error.

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
                "not installed counts as not protected. Default: every path of every installed front end.")


@click.command("doctor", short_help="Say whether checkpoints are protected here, and why not (exit 0 yes, 1 no).")
@click.option("--require", "require", multiple=True, metavar="PATHS", help=REQUIRE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print only JSON on stdout (messages and log lines go to stderr).")
def doctor_command(require: tuple[str, ...], as_json: bool) -> int:
    """Say whether the installed torch, Accelerate and transformers releases are protected, path by path.

    Each path (Accelerate FSDP1, FSDP2, one process and DDP; the Trainer on the same three) relies on private pieces
    of those packages; it is protected when every piece has a value recorded for a release that passed
    accelerate-txn's tests. Otherwise each differing piece is named, with the release and what changed. Also says
    whether the override (ACCELERATE_TXN_ALLOW_UNVALIDATED) is set and automatic dispatch
    (ACCELERATE_TXN_PATCHES) is on, and which stores and signing schemes are available.

    Exit 0 when every path required is protected (the override counts), 1 when one is not, or when automatic
    dispatch is off, or no front end is installed; 2 a usage error. Imports torch, Accelerate and transformers.
    """
    import platform

    from .. import __version__
    from ..core.environment import OLDER_NAMES
    from ..runtime.versions import DISPATCH as DISPATCH_SWITCH
    from ..runtime.versions import OVERRIDE as OVERRIDE_SWITCH
    from ..runtime.versions import (
        OVERRIDE_ENV,
        PATCH_ENV,
        automatic_dispatch_requested,
        override_requested,
    )

    named = _required(require)
    override, dispatch = override_requested(), automatic_dispatch_requested()  # an invalid value raises, naming it
    found = findings(named or ())
    if named is None:
        for finding in found:
            finding.required = not finding.absent
    statuses = {finding.target.name: finding.status(override=override, dispatch=dispatch) for finding in found}
    required = [finding for finding in found if finding.required]
    failing = [finding for finding in required if statuses[finding.target.name] not in (PROTECTED, OVERRIDE)]
    ok = bool(required) and not failing
    report: dict[str, Any] = {
        "accelerate_txn": __version__,
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "releases": releases(),
        "automatic_dispatch": dispatch,
        "override": override,
        # Each switch under its name, and under an older name where that one is set (``core.environment``).
        "environment": {name: os.environ.get(name) for switch in (OVERRIDE_ENV, PATCH_ENV)
                        for name in (switch, *(old for old in OLDER_NAMES.get(switch, ()) if old in os.environ))},
        "paths": {finding.target.name: {
            "label": finding.target.label, "front_end": finding.target.front_end,
            "installed": not finding.absent, "missing_packages": list(finding.absent),
            "status": statuses[finding.target.name],
            "protected": None if finding.absent else statuses[finding.target.name] in (PROTECTED, OVERRIDE),
            "evidence": finding.evidence, "differences": finding.blocking + finding.differences,
            "required": finding.required} for finding in found},
        "required": [finding.target.name for finding in required],
        "protected": ok,
        "stores": {item.name: feature(item) for item in STORES},
        "signing": {item.name: feature(item) for item in SIGNING},
    }
    if as_json:
        out.emit_json(report)
    else:
        # Each switch named as it was set (an older VIDEOX_ name too: ``core.environment``).
        _print(report, found, statuses, failing, named is not None, (OVERRIDE_SWITCH.source(), DISPATCH_SWITCH.source()))
    return 0 if ok else 1


def _print(report: dict[str, Any], found: list[Finding], statuses: dict[str, str], failing: list[Finding],
           restricted: bool, names: tuple[str, str]) -> None:
    python = report["python"]
    out.say(f"accelerate-txn {report['accelerate_txn']} on Python {python['version']} ({python['executable']})")
    out.say("installed: " + ", ".join(f"{package} {version or 'not installed'}"
                                      for package, version in report["releases"].items()))
    override_env, patch_env = names
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
    out.say()
    width = max(len(target.label) for target in TARGETS) + 2
    for finding in found:
        status = statuses[finding.target.name]
        text = TEXT[status]
        if status == ABSENT:
            text += f" ({', '.join(finding.absent)})"
        elif status == OFF:
            text += f" (the evidence {'matches' if finding.evidence == 'matches' else 'differs'})"
        if restricted and not finding.required and status != ABSENT:
            text += "  (not required)"
        out.say(f"{finding.target.label.ljust(width)}{text}")
        for line in finding.blocking + finding.differences:
            out.say(f"    {line}")
    out.say()
    for section in ("stores", "signing"):
        out.say(f"{section}:")
        items: dict[str, dict[str, Any]] = report[section]
        column = max(map(len, items)) + 2
        for name, item in items.items():
            out.say(f"  {name.ljust(column)}{_feature_text(item)}")
    out.say()
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
