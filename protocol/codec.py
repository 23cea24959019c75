"""Tensor codec: state dicts <-> safetensors bytes, with weight formats and checks.

Formats (``WeightFormat``): ``fp32``, ``fp16``, ``bf16`` cast floating tensors;
``int8`` stores every floating tensor of rank >= 2 as symmetric per-row int8 with an
fp32 scale per row (``{name}::scale``, shape ``(rows,)``), 1-D tensors in fp32.
The format is recorded in the safetensors metadata, so :func:`decode_tensors`
needs no side channel.

Nothing from the network is unpickled: safetensors is a flat header + raw buffer.
:func:`inspect_header` parses and bounds-checks the header *before* any tensor is
allocated, so a payload that declares more bytes than it holds is rejected without
allocation.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

SCALE_SUFFIX = "::scale"
MAX_HEADER_BYTES = 16 * 1024 * 1024
_DTYPES = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "F64": (torch.float64, 8),
}
_CAST = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class CodecError(ValueError):
    """A tensor payload is malformed, oversized, non-finite or of the wrong shape."""


@dataclass(frozen=True)
class TensorInfo:
    """Declared dtype (safetensors name, e.g. ``F32``) and shape of one tensor."""

    dtype: str
    shape: tuple[int, ...]


def sha256_hex(data: bytes | memoryview) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization.

    Args:
        w: float tensor of shape ``(rows, ...)``.

    Returns:
        ``(q, scale)``: ``q`` int8 of ``w``'s shape, ``scale`` fp32 of shape ``(rows,)``
        with ``w ≈ q * scale[:, None, ...]``; the error per entry is at most ``scale/2``.
    """
    flat = w.detach().to(torch.float32).reshape(w.shape[0], -1)
    scale = flat.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(flat / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(w.shape), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: fp32 tensor of ``q``'s shape."""
    shape = [q.shape[0]] + [1] * (q.dim() - 1)
    return q.to(torch.float32) * scale.reshape(shape)


def encode_tensors(
    tensors: dict[str, torch.Tensor], fmt: str = "fp32", metadata: dict[str, str] | None = None
) -> bytes:
    """Serialise a state dict to safetensors bytes in weight format ``fmt``.

    Raises:
        CodecError: unknown format, or a name that uses the reserved ``::scale`` suffix.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            raise CodecError(f"tensor name {name!r} uses the reserved suffix {SCALE_SUFFIX}")
        t = t.detach().cpu()
        if not t.is_floating_point():
            out[name] = t.contiguous()
        elif fmt == "int8" and t.dim() >= 2:
            q, scale = quantize_int8(t)
            out[name] = q.contiguous()
            out[name + SCALE_SUFFIX] = scale.contiguous()
        elif fmt == "int8":
            out[name] = t.to(torch.float32).contiguous()
        elif fmt in _CAST:
            out[name] = t.to(_CAST[fmt]).contiguous()
        else:
            raise CodecError(f"unsupported weight format {fmt!r}")
    meta = {"format": fmt, **(metadata or {})}
    return st_save(out, metadata=meta)


def inspect_header(data: bytes | memoryview, max_bytes: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and bounds-check a safetensors header without allocating tensors.

    Args:
        data: the payload.
        max_bytes: largest acceptable payload size in bytes.

    Returns:
        ``(infos, metadata)``: declared dtype/shape per tensor, and the metadata dict.

    Raises:
        CodecError: oversized, truncated, unknown dtype, offsets that overlap, leave
            gaps or point past the end, or sizes inconsistent with the shapes.
    """
    n = len(data)
    if n > max_bytes:
        raise CodecError(f"payload of {n} bytes exceeds limit {max_bytes}")
    if n < 8:
        raise CodecError("truncated safetensors payload (no header length)")
    (hlen,) = struct.unpack("<Q", bytes(data[:8]))
    if hlen > min(MAX_HEADER_BYTES, n - 8):
        raise CodecError(f"declared header length {hlen} exceeds the payload")
    try:
        header = json.loads(bytes(data[8 : 8 + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CodecError(f"malformed safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CodecError("safetensors header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CodecError("safetensors metadata must map strings to strings")
    body = n - 8 - hlen
    infos: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CodecError(f"tensor {name!r}: malformed header entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _DTYPES:
            raise CodecError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 2**40 for d in shape)):
            raise CodecError(f"tensor {name!r}: malformed shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CodecError(f"tensor {name!r}: malformed offsets")
        start, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= start <= end <= body or end - start != numel * _DTYPES[dtype][1]:
            raise CodecError(f"tensor {name!r}: offsets {offsets} do not match shape {shape} within {body} bytes")
        spans.append((start, end))
        infos[name] = TensorInfo(dtype, tuple(shape))
    spans.sort()
    pos = 0
    for start, end in spans:
        if start != pos:
            raise CodecError("tensor buffers overlap or leave gaps")
        pos = end
    if pos != body:
        raise CodecError("payload has trailing bytes after the last tensor")
    return infos, metadata


def decode_tensors(
    data: bytes | memoryview,
    max_bytes: int,
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    dequantize: bool = True,
) -> dict[str, torch.Tensor]:
    """Validate and decode safetensors bytes produced by :func:`encode_tensors`.

    Args:
        data: the payload.
        max_bytes: largest acceptable payload in bytes (checked before parsing).
        expected: if given, the exact set of names with their logical shape and dtype
            (after dequantization); anything missing, extra or different is rejected.
        dequantize: turn ``int8`` tensors back into fp32 (else return ``q`` and
            ``{name}::scale`` as stored).

    Returns:
        name -> tensor (CPU). Floating tensors are checked finite.

    Raises:
        CodecError: see :func:`inspect_header`; plus non-finite values, or a mismatch
            with ``expected``.
    """
    infos, metadata = inspect_header(data, max_bytes)
    fmt = metadata.get("format", "fp32")
    if fmt not in ("fp32", "fp16", "bf16", "int8"):
        raise CodecError(f"unsupported weight format {fmt!r}")
    for name, info in infos.items():
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            bi = infos.get(base)
            if bi is None or bi.dtype != "I8" or info.dtype != "F32" or info.shape != bi.shape[:1]:
                raise CodecError(f"scale {name!r} does not match a per-row int8 tensor")
        elif info.dtype == "I8" and fmt == "int8" and name + SCALE_SUFFIX not in infos:
            raise CodecError(f"int8 tensor {name!r} has no scale")
    try:
        raw = st_load(bytes(data))
    except Exception as e:  # safetensors raises its own error types
        raise CodecError(f"undecodable safetensors payload: {e}") from None
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(SCALE_SUFFIX):
            if not dequantize:
                out[name] = t
            continue
        scale = raw.get(name + SCALE_SUFFIX)
        if scale is not None and dequantize:
            t = dequantize_int8(t, scale)
        out[name] = t
    for name, t in out.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CodecError(f"tensor {name!r} holds NaN or Inf")
    if expected is not None:
        check_expected(out if dequantize else {k: v for k, v in out.items() if not k.endswith(SCALE_SUFFIX)}, expected)
    return out


def check_expected(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> None:
    """Raise :class:`CodecError` unless ``tensors`` has exactly the expected names, shapes, dtypes."""
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CodecError(f"tensor names differ from the assignment: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise CodecError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.dtype != dtype:
            raise CodecError(f"tensor {name!r} has dtype {t.dtype}, expected {dtype}")
