"""Command-line options mapped onto the configuration schemas (pydantic models), and
pydantic's validation errors phrased in the options' terms.

An :class:`Option` names the field a flag sets (a dotted path such as ``train.lr``);
:func:`add_options` adds the flags to an ``argparse`` parser, with the value type
(``int``/``float``), choices (``Literal`` fields) and help taken from the schema where the
option does not give them; :func:`schema_options` makes one option per field of a model
(``fedmoe device``). :func:`explain` turns a ``ValidationError`` into one line such as
``--devices must be at least 1 (got 0); unknown --weight-format 'int4' (...)``.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Mapping, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError


@dataclass(frozen=True)
class Option:
    """A command-line option that sets one field of a config schema."""

    path: str
    """Dotted field path in the schema, e.g. ``train.lr``."""
    help: str | None = None
    """Help text (default: the field's description, i.e. its docstring)."""
    parse: Callable[[str], Any] | None = None
    """Turns the option's text into the field's value (default: ``int``/``float`` for such
    fields, else the text as given; pydantic converts the rest)."""
    switch: bool = False
    """A flag without a value that sets True (``bool`` fields)."""


def flag(name: str) -> str:
    """``device_id`` -> ``--device-id``."""
    return "--" + name.replace("_", "-")


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> ``X``; ``Annotated[X, ...]`` -> ``X``."""
    while True:
        origin = get_origin(annotation)
        if origin in (Union, types.UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        elif hasattr(annotation, "__metadata__"):  # Annotated
            annotation = annotation.__origin__
        else:
            return annotation


def field_info(schema: type[BaseModel], path: str):
    """The pydantic ``FieldInfo`` at dotted ``path`` of ``schema`` (through nested models).

    Raises:
        KeyError: no such field.
    """
    model: Any = schema
    info = None
    for part in path.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise KeyError(path)
        info = model.model_fields[part]
        model = _unwrap(info.annotation)
    return info


def _argparse_kw(info: Any, option: Option) -> dict[str, Any]:
    kind = _unwrap(info.annotation)
    kw: dict[str, Any] = {"help": " ".join((option.help or info.description or "").split()) or None}
    if option.switch or kind is bool:
        return {**kw, "action": "store_true", "default": None}
    if option.parse is not None:
        kw["type"] = option.parse
    elif kind in (int, float):
        kw["type"] = kind
    elif get_origin(kind) is Literal:
        kw["choices"] = [str(c) for c in get_args(kind)]
    elif get_origin(kind) is list:
        kw["type"] = comma_list
    return kw


def add_options(parser: argparse.ArgumentParser, options: Mapping[str, Option], schema: type[BaseModel]) -> None:
    """Add ``--NAME`` (:func:`flag`) for each ``NAME: option``; the parsed value is
    ``args.NAME``, None when the option is not given.

    Raises:
        KeyError: an option's path is not a field of ``schema``.
    """
    for name, option in options.items():
        parser.add_argument(flag(name), dest=name, **_argparse_kw(field_info(schema, option.path), option))


def schema_options(schema: type[BaseModel], skip: Iterable[str] = ()) -> dict[str, Option]:
    """One option per top-level field of ``schema`` (named as the field), the fields a
    class declares itself before those it inherits (in the order of ``schema.__mro__``)."""
    names: list[str] = []
    for klass in schema.__mro__:
        for name in getattr(klass, "__annotations__", {}):
            if name in schema.model_fields and name not in names and name not in skip:
                names.append(name)
    return {name: Option(name) for name in names}


def given(args: argparse.Namespace, options: Iterable[str]) -> dict[str, Any]:
    """The options set on the command line: ``{name: value}`` without the None ones."""
    return {name: v for name in options if (v := getattr(args, name, None)) is not None}


def comma_list(text: str) -> list[str]:
    """``"a,b,,c"`` -> ``["a", "b", "c"]``."""
    return [x.strip() for x in text.split(",") if x.strip()]


_SECRET = object()  # the value of a secret field (a token, a password): never echoed in an error


def _got(value: Any) -> str:
    return "" if value is _SECRET or isinstance(value, (dict, BaseModel)) else f" (got {value!r})"


def phrase(error: Mapping[str, Any], name: str) -> str:
    """One pydantic error (an item of ``ValidationError.errors()``) as a sentence about
    ``name`` (the option or field it concerns; empty for errors of the whole config, whose
    message is then taken as it is). The value given is quoted, except a secret's (a field
    named for a token, a password or a secret)."""
    kind, ctx, got = error["type"], error.get("ctx") or {}, error.get("input")
    if any(w in str((error.get("loc") or ("",))[-1]).lower() for w in ("token", "password", "secret")):
        got = _SECRET
    msg = str(error["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if not name:
        return msg
    if kind == "greater_than_equal":
        return f"{name} must {'not be negative' if ctx['ge'] == 0 else 'be at least ' + str(ctx['ge'])}{_got(got)}"
    if kind == "greater_than":
        return f"{name} must be {'positive' if ctx['gt'] == 0 else 'greater than ' + str(ctx['gt'])}{_got(got)}"
    if kind == "less_than_equal":
        return f"{name} must be at most {ctx['le']}{_got(got)}"
    if kind == "less_than":
        return f"{name} must be below {ctx['lt']}{_got(got)}"
    if kind == "literal_error":
        return f"unknown {name} {got!r} (use one of {ctx.get('expected', '...')})"
    if kind == "missing":
        return f"{name} is required"
    if kind == "extra_forbidden":
        return f"unknown setting {name}"
    if kind == "string_too_short" and not got:
        return f"{name} is empty"
    if kind == "too_short" and not got:
        return f"{name} names nothing"
    if kind == "value_error" and msg.startswith(("--", name.split(" ")[0])):  # names the options itself
        return msg
    return f"{name}: {msg}" + ("" if kind.startswith("byte_size") or kind == "value_error" else _got(got))


def explain(e: ValidationError, name: Callable[[tuple], str]) -> str:
    """Every error of ``e`` phrased (:func:`phrase`) and joined by ``; `` (one line);
    ``name(loc)`` names the option or field of each error's location."""
    return "; ".join(dict.fromkeys(" ".join(phrase(x, name(tuple(x["loc"]))).split()) for x in e.errors()))
