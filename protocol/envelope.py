"""MQTT 3.1.1's stand-in for MQTT 5 user properties (protocol 1.7, PROTOCOL.md §8.1).

MQTT 3.1.1 has no user properties, yet signatures travel in them (``protocol.signing``).
A sender on 3.1.1 that has properties to send wraps the payload in an envelope:

    b"FMP1" | uint16 big-endian n | n bytes: UTF-8 JSON object {name: value, ...} | payload

Names and values are strings; ``n`` is at most :data:`MAX_HEADER_BYTES`. Every receiver,
on either protocol version, unwraps a payload that starts with the magic and treats the
object as the message's user properties (MQTT 5 properties, where both exist, win). The
magic cannot begin a control message (JSON: ``{``) or a chunk (``FMC1``). A payload that
starts with the magic but is not a well-formed envelope is passed on unchanged and without
properties, so the receiver refuses it as it would any malformed message.
"""

from __future__ import annotations

import json
import struct

MAGIC = b"FMP1"
MAX_HEADER_BYTES = 4096
"""Largest property object (bytes of JSON) an envelope may carry."""


def wrap(payload: bytes, properties: dict[str, str]) -> bytes:
    """``payload`` in an envelope carrying ``properties``.

    Raises:
        ValueError: a name or value that is not a string, or the object over
            :data:`MAX_HEADER_BYTES`.
    """
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in properties.items()):
        raise ValueError("envelope properties must map strings to strings")
    head = json.dumps(properties, separators=(",", ":"), ensure_ascii=False).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"envelope properties take {len(head)} bytes, more than {MAX_HEADER_BYTES}")
    return MAGIC + struct.pack(">H", len(head)) + head + payload


def unwrap(data: bytes) -> tuple[bytes, dict[str, str]] | None:
    """``(payload, properties)`` of an envelope; None when ``data`` is not a well-formed one."""
    if len(data) < 6 or not data.startswith(MAGIC):
        return None
    (n,) = struct.unpack(">H", data[4:6])
    if n > MAX_HEADER_BYTES or len(data) < 6 + n:
        return None
    try:
        props = json.loads(data[6:6 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(props, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in props.items()):
        return None
    return data[6 + n:], props
