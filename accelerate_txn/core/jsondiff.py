"""Explain how two JSON-like values differ, as readable paths (used for descriptors and rank agreement)."""

from __future__ import annotations

import json
from typing import Any

#: Characters of one value shown in a difference; a longer value is cut around the first character that differs.
WIDTH = 160


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _cut(text: str, at: int) -> str:
    """``text`` in at most :data:`WIDTH` characters, keeping the part around index ``at`` (elided with "...")."""
    if len(text) <= WIDTH:
        return text
    start = max(0, at - WIDTH // 3)
    if start == 0:
        return text[: WIDTH - 3] + "..."
    if start + WIDTH - 3 >= len(text):
        return "..." + text[-(WIDTH - 3):]
    return "..." + text[start:start + WIDTH - 6] + "..."


def _show(value: Any) -> str:
    return _cut(_text(value), 0)


def _pair(a: Any, b: Any) -> tuple[str, str]:
    """Both values as text, each cut around the first character where they differ (not before it)."""
    left, right = _text(a), _text(b)
    at = next((index for index, (x, y) in enumerate(zip(left, right)) if x != y), min(len(left), len(right)))
    return _cut(left, at), _cut(right, at)


def differences(
    left: Any, right: Any, *, names: tuple[str, str] = ("saved", "live"), limit: int | None = 8, path: str = ""
) -> list[str]:
    """Up to ``limit`` lines (every one with ``limit=None``) ``path: <left> (saved) vs <right> (live)`` describing
    where the values differ; a long value is cut around the first character where the two differ."""
    found: list[str] = []

    def full() -> bool:
        return limit is not None and len(found) >= limit

    def walk(a: Any, b: Any, where: str) -> None:
        if full():
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b), key=str):
                sub = f"{where}.{key}" if where else str(key)
                if key not in b:
                    found.append(f"{sub}: only in {names[0]} ({_show(a[key])})")
                elif key not in a:
                    found.append(f"{sub}: only in {names[1]} ({_show(b[key])})")
                else:
                    walk(a[key], b[key], sub)
                if full():
                    return
            return
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for index, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{index}]")
            return
        if a != b:
            shown = _pair(a, b)
            found.append(f"{where or 'value'}: {shown[0]} ({names[0]}) vs {shown[1]} ({names[1]})")

    walk(left, right, path)
    return found
