"""Griffe extension: our docstrings' reST-style markup read as Markdown in the API reference.

The docstrings are written for ``help()`` and the source: ````code```` in double
backticks, Sphinx roles (``:class:`cloud.rounds.Round```), and indices such as
``p[l][e]``, which Markdown would take for a reference link. This turns roles and double
backticks into code spans and escapes ``][`` so that an index is not a link. Loaded by
mkdocstrings (``extensions`` in mkdocs.yml); the source is not changed.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:class|mod|data|attr|func|meth|exc|obj):`~?\.?([^`]+)`")
_CODE = re.compile(r"(`+[^`]*`+)")


def to_markdown(text: str) -> str:
    """``x`` and :role:`x` as `x`; ``a[i][j]`` outside code spans not a reference link."""
    text = _ROLE.sub(r"`\1`", text).replace("``", "`")
    parts = _CODE.split(text)
    return "".join(p if i % 2 else p.replace("][", "]\\[") for i, p in enumerate(parts))


class ReSTToMarkdown(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
