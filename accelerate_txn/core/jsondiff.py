"""Explain how two JSON-like values differ, as readable paths (used for descriptors and rank agreement)."""

from __future__ import annotations

import json
from typing import Any


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 160 else text[:157] + "..."


def differences(
    left: Any, right: Any, *, names: tuple[str, str] = ("saved", "live"), limit: int = 8, path: str = ""
) -> list[str]:
    """Up to ``limit`` lines ``path: <left> (saved) vs <right> (live)`` describing where the values differ."""
    found: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if len(found) >= limit:
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
                if len(found) >= limit:
                    return
            return
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for index, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{index}]")
            return
        if a != b:
            found.append(f"{where or 'value'}: {_show(a)} ({names[0]}) vs {_show(b)} ({names[1]})")

    walk(left, right, path)
    return found
