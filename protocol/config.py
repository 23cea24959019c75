"""Building blocks of the configuration schemas both sides use: byte sizes and the MQTT
connection settings.

The aggregator's config (:class:`cloud.config.AggregatorConfig`), a device's
(:class:`edge_sdk.config.DeviceConfig`) and ``fedmoe simulate``'s
(:class:`fedmoe.simulate.SimulationConfig`) are pydantic models built from these; this
module imports nothing heavier than pydantic, so a config is checked within a second.

Byte sizes (:data:`Bytes`, :data:`PositiveBytes`, :func:`parse_bytes`) are pydantic's
:class:`~pydantic.ByteSize`: ``"1.5GiB"``, ``"800MB"``, ``"512mib"``, ``"256 KiB"`` or a
plain number of bytes; ``KB``/``MB``/``GB``/... are powers of 1000 and ``KiB``/``MiB``/
``GiB``/... powers of 1024, case-insensitive. One thing is stricter than ``ByteSize``:
the whole text must be a size, where ``ByteSize`` reads the leading part of
``"1,5GiB"`` or ``"5MiB extra"`` and ignores the rest (``"1,5GiB"`` would be 1 byte).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ByteSize, ConfigDict, TypeAdapter, ValidationError,
)
from pydantic_core import PydanticCustomError

_SIZE = re.compile(r"\s*([+-]?)(\d*\.?\d+)\s*([a-z]*)\s*", re.IGNORECASE)  # ByteSize's number syntax
_HINT = "use e.g. 1.5GiB, 800MB or a number of bytes"


def _cannot_parse(value: Any) -> PydanticCustomError:
    return PydanticCustomError("byte_size", "cannot parse a byte size from {value} ({hint})",
                               {"value": repr(value), "hint": _HINT})


def _negative(value: Any) -> PydanticCustomError:
    return PydanticCustomError("byte_size_positive", "a byte size cannot be negative, got {value}",
                               {"value": repr(value)})


def _size_syntax(value: Any) -> Any:
    """Refuse what ``ByteSize`` would misread (module docstring), booleans and non-finite
    numbers; a finite float is truncated to whole bytes. Everything else is ``ByteSize``'s."""
    if isinstance(value, bool):
        raise _cannot_parse(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _cannot_parse(value)
        value = int(value)
    if isinstance(value, int) and value < 0:
        raise _negative(value)
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m is None or (m.group(3) and m.group(3).lower() not in ByteSize.byte_sizes):
            raise _cannot_parse(value)
        if m.group(1) == "-":
            raise _negative(value)
        return value.replace("+", "", 1)
    return value


def _positive(value: ByteSize) -> ByteSize:
    if value <= 0:
        raise PydanticCustomError("byte_size_positive", "byte size must be positive, got {value}",
                                  {"value": int(value)})
    return value


Bytes = Annotated[ByteSize, BeforeValidator(_size_syntax)]
"""A number of bytes (0 or more) written as an int or a size such as ``"256MiB"`` (module
docstring); the value is an ``int`` (a :class:`~pydantic.ByteSize`) and is dumped as one."""
PositiveBytes = Annotated[Bytes, AfterValidator(_positive)]
""":data:`Bytes` greater than 0 (memory budgets, size limits)."""

_POSITIVE = TypeAdapter(PositiveBytes)


def parse_bytes(text: str | int | float) -> int:
    """``"1.5GiB"``, ``"800MB"``, ``"512mib"``, ``1024`` -> bytes (:data:`PositiveBytes`).

    Raises:
        ValueError: not a byte size, an unknown unit, or not positive (one line).
    """
    try:
        return int(_POSITIVE.validate_python(text))
    except ValidationError as e:
        raise ValueError("; ".join(x["msg"] for x in e.errors())) from None


class BrokerSettings(BaseModel):
    """How to reach the MQTT broker (:class:`protocol.transport.Transport`): shared by the
    aggregator's and a device's config, and by their ``--protocol``/``--username``/...
    command-line options. The broker URL itself is given separately."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    """MQTT protocol version"""
    username: str | None = None
    """MQTT account name"""
    password: str | None = None
    """MQTT account password"""
    tls_ca: str | None = None
    """CA certificate (PEM) for TLS"""
    tls_cert: str | None = None
    """client certificate (PEM) for TLS"""
    tls_key: str | None = None
    """client certificate key (PEM) for TLS"""
    credentials: str | None = None
    """credentials JSON from `fedmoe provision` (account, signing key, CA)"""

    def missing_files(self) -> list[str]:
        """``"key: no such file 'path'"`` for each of ``credentials``, ``tls_ca``,
        ``tls_cert``, ``tls_key`` that names a file that does not exist (relative paths:
        relative to the working directory)."""
        from pathlib import Path

        return [f"{key}: no such file {path!r}" for key in ("credentials", "tls_ca", "tls_cert", "tls_key")
                if (path := getattr(self, key)) and not Path(path).is_file()]
