"""A griffe extension for the API reference (mkdocs.yml): Sphinx roles in docstrings render as inline code.

The library's docstrings name other objects the Sphinx way, ``:func:`launch```; Markdown would show the role
literally. This turns ``:role:`target``` into ``target`` in code font, leaving everything else as written.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|data|meth|attr|mod|exc|obj|const):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
