"""MkDocs hook: configuration reference tables generated from the pydantic schemas.

A page writes a marker on a line of its own::

    <!-- schema: cloud.config.AggregatorConfig -->      every field, inherited ones too
    <!-- schema: cloud.config.AggregatorConfig own -->  only the fields the class itself adds
    <!-- options: fedmoe.simulate -->                   the module's OPTIONS (command line -> field)

and the build replaces it by a table per model (field, type, unit, default, description),
followed by a section for each model a field nests (``model``, ``train``, ``defences``,
...). Descriptions are the attribute docstrings under each field (or the field's
``description``), so the reference cannot drift from the code. Defaults are those of an
instance built without arguments where the model allows it (``fedmoe simulate``'s
defaults differ from the aggregator's), else the fields' own.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from pathlib import Path

from pydantic import BaseModel, ByteSize

_MARKER = re.compile(r"^<!-- (schema|options): ([\w.]+)( own)? -->$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|mod|data|attr|func|meth):`~?([^`]+)`")


def on_config(config):
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)  # the checkout's packages, not an installed copy
    return config


def _object(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _attr_docs(cls: type[BaseModel]) -> dict[str, str]:
    """Attribute docstrings (a string right under a field) of ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):
            continue
        for field, doc in zip(body, body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                docs[field.target.id] = inspect.cleandoc(doc.value.value)
    return docs


def _text(doc: str | None) -> str:
    """A docstring as one table cell: reST roles and double backticks as code, one line."""
    if not doc:
        return ""
    doc = _ROLE.sub(r"`\1`", doc).replace("``", "`")
    return " ".join(doc.split()).replace("|", "\\|")


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation mentions (``X``, ``X | None``, ``list[X]``, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _type(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else _type(a) for a in args)}]"
    if isinstance(annotation, type):
        if issubclass(annotation, ByteSize):
            return "bytes"
        if issubclass(annotation, BaseModel):
            return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _constraints(field) -> str:
    """``≥ 1``, ``< 1``, ``length ≥ 2`` ... from the field's annotated-types metadata."""
    out = []
    for m in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"),
                           ("min_length", "length ≥"), ("max_length", "length ≤")):
            value = getattr(m, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
    return ", ".join(out)


def _unit(name: str, annotation) -> str:
    if name.endswith("_s") or name.endswith("timeout"):
        return "s"
    if "bytes" in _type(annotation) or name.endswith("_bytes"):
        return "bytes"
    return ""


def _value(value) -> str:
    if isinstance(value, BaseModel):
        changed = value.model_dump(mode="json", exclude_defaults=True)
        return f"`{json.dumps(changed)}`" if changed else "(its defaults)"
    if isinstance(value, ByteSize) and value >= 1024:
        return f"`{int(value)}` ({value.human_readable(decimal=False)})"
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return f"`{text}`".replace("|", "\\|")


def _defaults(cls: type[BaseModel]) -> dict[str, str]:
    try:
        instance = cls()
    except Exception:  # required fields: fall back to each field's own default
        instance = None
    out = {}
    for name, field in cls.model_fields.items():
        if instance is not None:
            out[name] = _value(getattr(instance, name))
        elif field.is_required():
            out[name] = "required"
        elif field.default_factory is not None:
            try:
                out[name] = _value(field.default_factory())
            except Exception as e:  # a factory that needs something absent: say which
                out[name] = f"computed ({type(e).__name__})"
        else:
            out[name] = _value(field.default)
    return out


def _table(cls: type[BaseModel], own: bool, level: int, done: set) -> list[str]:
    docs, defaults = _attr_docs(cls), _defaults(cls)
    names = list(cls.model_fields)
    inherited = []
    if own:
        mine = set(vars(cls).get("__annotations__", {}))
        names = [n for n in names if n in mine]
        inherited = [b.__name__ for b in cls.__bases__ if issubclass(b, BaseModel) and b is not BaseModel]
    done.add(cls)
    lines = [f"{'#' * level} {cls.__name__}", "",
             f"`{cls.__module__}.{cls.__qualname__}`: {_text((inspect.getdoc(cls) or '').split(chr(10) * 2)[0])}", ""]
    if inherited:
        lines += ["Besides the fields below, it has every field of "
                  + " and ".join(f"[{b}](#{b.lower()})" for b in inherited) + ".", ""]
    lines += ["| field | type | unit | default | description |", "|---|---|---|---|---|"]
    nested: list[type[BaseModel]] = []
    for name in names:
        field = cls.model_fields[name]
        kind = _type(field.annotation)
        limits = _constraints(field)
        if limits:
            kind += f" ({limits})"
        lines.append(f"| `{name}` | {kind} | {_unit(name, field.annotation)} | {defaults[name]} "
                     f"| {_text(field.description or docs.get(name))} |")
        nested += [m for m in _models(field.annotation) if m not in nested]
    lines.append("")
    for model in nested:
        if model not in done:
            lines += _table(model, False, min(level + 1, 6), done)
    return lines


def _options(module_name: str) -> list[str]:
    """The module's ``OPTIONS`` (option name -> object with a field ``path``), as a table
    of the command-line option, the field it sets and the default there."""
    module = importlib.import_module(module_name)
    config = module.SimulationConfig()
    lines = ["| option | sets | default |", "|---|---|---|"]
    for name, option in module.OPTIONS.items():
        value = config
        for part in option.path.split("."):
            value = getattr(value, part, None)
        lines.append(f"| `--{name.replace('_', '-')}` | `{option.path}` | {_value(value)} |")
    return lines + [""]


def on_page_markdown(markdown: str, page, config, files) -> str:
    done: set = set()

    def render(m: re.Match) -> str:
        if m.group(1) == "options":
            return "\n".join(_options(m.group(2)))
        return "\n".join(_table(_object(m.group(2)), bool(m.group(3)), 3, done))

    return _MARKER.sub(render, markdown)
