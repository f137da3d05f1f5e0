"""The environment variables accelerate-txn reads, each declared once as a :class:`Variable` with its accepted values.

A value outside them raises :class:`CheckpointConfigurationError` naming the variable, the value and the accepted
values, instead of silently meaning something else (``ACCELERATE_TXN_DIRECT_IO=off`` once meant "on"). Every value is
read with surrounding spaces ignored; unset and empty mean the default. A variable that had an older name
(:data:`OLDER_NAMES`, ``VIDEOX_*``) is read under either. A switch (:func:`flag`) takes ``1``,
``true``, ``yes``, ``on`` and ``0``, ``false``, ``no``, ``off``; a choice (:func:`choice`) its names; both in any case.

Who raises depends on where a variable is read, which its declaring module decides: the front ends read every
variable a save or load uses before their first collective or inside a rank phase
(``accelerate.config.read_configs``), so an invalid value raises on every rank alike, never on one rank while the
others wait in a collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import CheckpointConfigurationError

T = TypeVar("T")

#: The older spelling of each variable, still honoured: the names of VideoX, the training codebase accelerate-txn was
#: extracted from (``VIDEOX_ACCELERATE_PATCHES=0`` keeps working). Set under both names to different values, a
#: setting is refused, not guessed (:meth:`Variable.raw`).
OLDER_NAMES: dict[str, tuple[str, ...]] = {
    "ACCELERATE_TXN_PATCHES": ("VIDEOX_ACCELERATE_PATCHES",),
    "ACCELERATE_TXN_PROTECT": ("VIDEOX_ACCELERATE_PROTECT",),
    "ACCELERATE_TXN_ALLOW_UNVALIDATED": ("VIDEOX_ACCELERATE_ALLOW_UNVALIDATED",),
    "ACCELERATE_TXN_CHECK_FINITE": ("VIDEOX_CHECKPOINT_FINITE",),
    "ACCELERATE_TXN_LOCK_TIMEOUT": ("VIDEOX_CHECKPOINT_LOCK_TIMEOUT",),
    "ACCELERATE_TXN_ARRIVAL_TIMEOUT": ("VIDEOX_CHECKPOINT_ARRIVAL_TIMEOUT",),
}

#: The spellings of a switch, in any case.
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable: ``parse`` turns a set value (spaces stripped, never empty) into its meaning and
    raises ``ValueError`` for a value outside the accepted set, which ``accepted`` describes for the error."""

    name: str
    parse: Callable[[str], T]
    default: T
    accepted: str

    @property
    def aliases(self) -> tuple[str, ...]:
        """The older spellings still honoured (:data:`OLDER_NAMES`)."""
        return OLDER_NAMES.get(self.name, ())

    def raw(self) -> str:
        """The value as set, spaces stripped (``""``: unset or empty), under :attr:`name` or any of its
        :attr:`aliases`. Set under two spellings to different values, it is a configuration error naming both:
        which one was meant is not for the library to guess."""
        found = {name: value for name in (self.name, *self.aliases) if (value := os.environ.get(name, "").strip())}
        if len(set(found.values())) > 1:
            spelled = ", ".join(f"{name}={os.environ.get(name)!r}" for name in found)
            raise CheckpointConfigurationError(
                f"The environment variables {spelled} are spellings of one setting with different values: unset "
                f"all but {self.name}.")
        return next(iter(found.values()), "")

    def source(self) -> str:
        """The spelling the current value was read from (:attr:`name` when unset)."""
        return next((name for name in (self.name, *self.aliases) if os.environ.get(name, "").strip()), self.name)

    def read(self) -> T:
        """The meaning of the current value; the default when unset or empty; else a configuration error naming
        the variable, the value and the accepted values."""
        raw = self.raw()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError:
            raise CheckpointConfigurationError(
                f"The environment variable {self.source()} is {os.environ.get(self.source())!r}: {self.accepted}. Set an "
                "accepted value, or unset it for the default.") from None


def _switch(raw: str) -> bool:
    value = raw.lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(raw)


def flag(name: str, default: bool) -> Variable[bool]:
    """A switch: ``1``, ``true``, ``yes``, ``on`` turn it on, ``0``, ``false``, ``no``, ``off`` off (any case)."""
    accepted = (f"use {', '.join(ON[:-1])} or {ON[-1]} (on), or {', '.join(OFF[:-1])} or {OFF[-1]} (off), in any "
                f"case; unset or empty: {'on' if default else 'off'}")
    return Variable(name, _switch, default, accepted)


def choice(name: str, choices: Sequence[str], default: str, meanings: str = "") -> Variable[str]:
    """One of ``choices`` (lower case; any case accepted); ``meanings`` says what each one does, for the error."""

    def parse(raw: str) -> str:
        if raw.lower() not in choices:
            raise ValueError(raw)
        return raw.lower()

    names = [repr(name) for name in choices]
    accepted = f"use {', '.join(names[:-1])} or {names[-1]}" + (f" ({meanings})" if meanings else "")
    return Variable(name, parse, default, f"{accepted}, in any case; unset or empty: {default!r}")
