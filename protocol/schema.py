"""JSON Schemas of the wire formats, generated from the pydantic models (PROTOCOL.md).

Every control message (:data:`protocol.messages._TYPES`: ``hello``, ``ack``, ``stats``,
``status``, ``assignment``, ``command``, ``progress``) and the chunk header of binary
transfers (:class:`protocol.chunking.ChunkHeader`) get one JSON Schema (draft 2020-12)
each, committed under ``protocol/schemas/<ClassName>.json``; ``tests/test_schema.py``
fails when a model changes and the committed files do not. Implementations in other
languages validate against these files.

Wire rules the schemas express: JSON types (``"1"`` is not an integer, ``1`` not a
boolean: the peers validate strictly; JSON Schema, unlike the peers, counts ``1.0`` as an
integer); ``v`` and ``type`` are required (the parser
refuses a message without them, although the Python models default them); every bound of the models (lengths, ranges,
patterns) is there. What they relax on purpose: a control message's objects admit
unknown keys (``additionalProperties`` is not false), because a peer drops the fields of a
newer minor version of the same major (``v``) instead of rejecting the message. The chunk
header is closed (unknown keys rejected). What no schema can say (finite floats only,
NaN/Inf being invalid JSON anyway; the control message size limit
:data:`protocol.messages.MAX_CONTROL_BYTES`; cross-field rules) is in PROTOCOL.md.

Usage::

    python -m protocol.schema            # rewrite protocol/schemas/*.json
    python -m protocol.schema --check    # exit 1 listing the files that differ
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

SCHEMA_DIR = Path(__file__).with_name("schemas")
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _open(node: Any) -> Any:
    """Drop ``additionalProperties: false`` everywhere (a peer ignores unknown fields)."""
    if isinstance(node, dict):
        return {k: _open(v) for k, v in node.items() if not (k == "additionalProperties" and v is False)}
    if isinstance(node, list):
        return [_open(v) for v in node]
    return node


def _schema(model: type[BaseModel], title: str, description: str, closed: bool) -> dict[str, Any]:
    body = model.model_json_schema(mode="validation")
    body = body if closed else _open(body)
    return {"$schema": DIALECT, "$id": f"fedmoe/protocol/v1/{title}.json", **body, "title": title,
            "description": description}


def schemas() -> dict[str, dict[str, Any]]:
    """File name (``<ClassName>.json``) -> JSON Schema, for every control message and the chunk header."""
    from .chunking import ChunkHeader
    from .messages import _TYPES, PROTOCOL_MINOR, PROTOCOL_VERSION

    out = {}
    for kind, cls in sorted(_TYPES.items()):
        doc = " ".join((cls.__doc__ or "").split())
        s = _schema(cls, cls.__name__, f"Control message type {kind!r}, protocol {PROTOCOL_VERSION}.{PROTOCOL_MINOR}. "
                    f"{doc}", closed=False)
        s["required"] = sorted({*s.get("required", ()), "type", "v"})  # defaults in Python, required on the wire
        out[f"{cls.__name__}.json"] = s
    out["ChunkHeader.json"] = _schema(
        ChunkHeader, "ChunkHeader", "The JSON header of one chunk of a binary transfer (PROTOCOL.md, Chunks).",
        closed=True)
    return out


def rendered() -> dict[str, str]:
    """File name -> file text (sorted keys, 2-space indent, final newline)."""
    return {name: json.dumps(s, indent=2, sort_keys=True) + "\n" for name, s in schemas().items()}


def sync_files(argv: list[str] | None, files: dict[str, str], default_dir: Path, what: str, module: str,
               same: Callable[[str, str, str], bool] = lambda name, a, b: a == b) -> int:
    """The command line of a generated-files module: write ``files`` (name -> text) into
    ``--dir`` (default ``default_dir``), deleting other ``*.json`` there, or with
    ``--check`` exit 1 listing the files that differ (``same(name, committed, generated)``)
    or should not be there. Returns the exit status."""
    ap = argparse.ArgumentParser(description=f"Generate the protocol's {what}.")
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 if any file differs")
    ap.add_argument("--dir", type=Path, default=default_dir)
    args = ap.parse_args(argv)
    if args.check:
        stale = [n for n, text in files.items()
                 if not (args.dir / n).is_file() or not same(n, (args.dir / n).read_text(), text)]
        stale += [p.name for p in sorted(args.dir.glob("*.json")) if p.name not in files]
        if stale:
            print(f"out of date in {args.dir}: {', '.join(stale)} (run python -m {module})", file=sys.stderr)
            return 1
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    for p in args.dir.glob("*.json"):
        if p.name not in files:
            p.unlink()
    for n, text in files.items():
        (args.dir / n).write_text(text)
    print(f"wrote {len(files)} {what} to {args.dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) ``protocol/schemas/*.json``; returns the exit status."""
    return sync_files(argv, rendered(), SCHEMA_DIR, "JSON Schemas", "protocol.schema")


if __name__ == "__main__":
    raise SystemExit(main())
