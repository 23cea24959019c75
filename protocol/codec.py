"""Tensor codec: state dicts <-> safetensors bytes, with weight formats and checks.

Formats (``WeightFormat``): ``fp32``, ``fp16``, ``bf16`` cast floating tensors;
``int8`` stores every floating tensor of rank >= 2 as symmetric int8 with fp32 scales
(``{name}::scale``): one per row (shape ``(rows,)``; the tensor viewed as
``(shape[0], -1)``), or, for a 2-D tensor taller than it is wide, one per column (shape
``(1, cols)``): a rank-r LoRA B of shape ``(out, r)`` then costs ``r`` scales instead of
``out`` (1.0 instead of 1.5 bytes per value at r = 8). Base shards always use rows
(``scales="row"``: the int8 linear scales each output row). 1-D tensors stay fp32.
``nf4`` stores every floating tensor of rank >= 2 in bitsandbytes' 4-bit NormalFloat
layout (Dettmers et al., QLoRA 2023, §3 "4-bit NormalFloat"): the row-major flattened
tensor is cut into blocks of :data:`NF4_BLOCK` = 64 values, each block is scaled by its
absolute maximum (``{name}::absmax``, fp32, one per block) and every value becomes the
index of the nearest of the 16 :data:`NF4_CODE` levels, two indices per byte (first
value in the high nibble), stored as ``U8`` of shape ``(ceil(numel/2),)``; the logical
shape is recorded in the metadata (``nf4_shape:{name}``). 1-D tensors stay fp32, except
with ``vectors=True`` (updates: deltas with error feedback), where nf4 also packs 1-D
tensors of at least :data:`NF4_BLOCK` values (a sub-MoE's router rows, ``(H,)`` each).
The format is recorded in the safetensors metadata, so :func:`decode_tensors`
needs no side channel. An update may also be a *delta* (the trained state minus the
state the cloud sent; metadata ``{ENCODING_KEY: "delta"}``, written by the device's
``UpdateEncoding`` filter and undone by the cloud's ``UpdateDecoding``); the codec only
carries the marker.

A payload may be *compressed* (protocol minor 8): :data:`COMPRESSED_MAGIC` (8 bytes)
followed by the zlib stream (RFC 1950) of the safetensors bytes. The magic read as a
safetensors header length is far above :data:`MAX_HEADER_BYTES`, so no valid plain
payload starts with it; :func:`decode_tensors` takes either and inflates at most
``max_bytes`` (a zlib bomb is refused without inflating the rest), while
:func:`inspect_header` describes the bytes it is given and refuses a compressed payload
(its offsets would not be that payload's; base shards, read in place, are never
compressed). zlib
saves what quantization leaves: on an nf4 LoRA update of 512 experts (3,616 tensors) the
header JSON is 0.82 of 6.2 MiB and deflates to 0.07 MiB.

Nothing from the network is unpickled: safetensors is a flat header + raw buffer.
:func:`inspect_header` parses and bounds-checks the header *before* any tensor is
allocated, so a payload that declares more bytes than it holds is rejected without
allocation.
"""

from __future__ import annotations

import functools
import json
import struct
import zlib
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import save as st_save

from .chunking import sha256_hex  # noqa: F401  (re-exported: the codec's callers hash payloads too)

SCALE_SUFFIX = "::scale"
ABSMAX_SUFFIX = "::absmax"
NF4_SHAPE_KEY = "nf4_shape:"
NF4_BLOCK = 64
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
"""The 16 NF4 levels (quantiles of N(0, 1) normalised to [-1, 1]), as in bitsandbytes."""
NF4_MAX_ERROR = max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:])) / 2
"""Largest |x - deq(q(x))| / absmax of a block (half the widest gap between levels)."""
WEIGHT_FORMATS = ("fp32", "fp16", "bf16", "int8", "nf4")
ENCODING_KEY = "fedmoe.encoding"
"""Metadata key of an update's encoding: absent (the state itself) or ``"delta"``."""
UPDATE_ENCODINGS = ("state", "delta")
COMPRESSED_MAGIC = b"FMZ1zlib"
"""First 8 bytes of a compressed payload (then a zlib stream of the safetensors bytes)."""
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
    """Declared dtype (safetensors name, e.g. ``F32``) and shape of one tensor, and where its
    bytes are: ``start`` and ``end`` byte offsets in the whole payload (header included)."""

    dtype: str
    shape: tuple[int, ...]
    start: int = 0
    end: int = 0


_EXPONENT = {"F32": (np.uint32, 0x7F800000), "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80),
             "F64": (np.uint64, 0x7FF0000000000000)}
"""Float dtype -> (same-width unsigned integer, its exponent bits): a value is NaN or Inf
exactly when every exponent bit is set (IEEE 754)."""


def _non_finite(data: bytes | memoryview, infos: dict[str, TensorInfo]) -> str | None:
    """The first float tensor of ``data`` (checked by :func:`inspect_header`) holding NaN or
    Inf, or None. Adjacent tensors of one dtype are checked as one run of bytes, by their
    exponent bits (one vectorised pass over a 1 MiB fp32 update instead of ~100 per-tensor
    ``isfinite`` calls, 1.2 ms of 12 per update in the aggregator)."""
    runs: list[tuple[str, int, int, list[str]]] = []
    for name, info in sorted(infos.items(), key=lambda kv: kv[1].start):
        if info.dtype not in _EXPONENT or info.end == info.start:
            continue
        if runs and runs[-1][0] == info.dtype and runs[-1][2] == info.start:
            runs[-1] = (info.dtype, runs[-1][1], info.end, runs[-1][3] + [name])
        else:
            runs.append((info.dtype, info.start, info.end, [name]))
    for dtype, start, end, names in runs:
        uint, bits = _EXPONENT[dtype]
        width = np.dtype(uint).itemsize
        x = np.frombuffer(data, dtype=uint, count=(end - start) // width, offset=start)
        if np.any((x & uint(bits)) == uint(bits)):
            return next(n for n in names if np.any(
                (np.frombuffer(data, dtype=uint, count=(infos[n].end - infos[n].start) // width,
                               offset=infos[n].start) & uint(bits)) == uint(bits)))
    return None


def _tensor_views(data: bytes | memoryview, infos: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """Each tensor of ``data`` (its header checked by :func:`inspect_header`: offsets in
    bounds, contiguous, sizes matching shapes) as a view into one writable copy of the
    payload, in the header's order: one copy of the bytes in all, where safetensors' ``load``
    makes two per tensor (1.2 ms of the aggregator's CPU per 1.1 MiB update of 128 tensors,
    ``results/fleet/profile.md``). A tensor whose offset is not a multiple of its element
    size (no safetensors writer makes one) gets its own aligned copy."""
    buf = bytearray(data)
    out: dict[str, torch.Tensor] = {}
    for name, info in infos.items():
        dtype, width = _DTYPES[info.dtype]
        count = (info.end - info.start) // width
        if count == 0:
            out[name] = torch.empty(info.shape, dtype=dtype)
        elif info.start % width:
            out[name] = torch.frombuffer(buf[info.start:info.end], dtype=dtype).reshape(info.shape)
        else:
            out[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=info.start).reshape(info.shape)
    return out


EXTRA_DTYPES = {"float32": torch.float32, "int64": torch.int64}
"""``TensorSpec.dtype`` -> torch dtype: what a method's own tensors may be (extra tensors
sent down with the adapter state, tensors a strategy keeps in the global model)."""


def extra_tensor_problem(t: object) -> str | None:
    """Why ``t`` cannot be a method's extra or owned tensor (not a float32/int64 tensor,
    or non-finite values), or None."""
    if not isinstance(t, torch.Tensor) or t.dtype not in EXTRA_DTYPES.values():
        return "must be a float32 or int64 tensor"
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        return "has non-finite values"
    return None


INT8_SCALES = ("row", "short")
"""Where :func:`encode_tensors` puts int8 scales: ``row`` always per row; ``short`` per
column for a 2-D tensor with more rows than columns (else per row)."""


def int8_axis(shape: tuple[int, ...] | torch.Size, scales: str = "short") -> str:
    """``"col"`` where ``scales="short"`` and ``shape`` is 2-D with more rows than
    columns, else ``"row"`` (the layout :func:`encode_tensors` writes).

    Raises:
        CodecError: ``scales`` not in :data:`INT8_SCALES`.
    """
    if scales not in INT8_SCALES:
        raise CodecError(f"int8 scales must be one of {INT8_SCALES}, got {scales!r}")
    return "col" if scales == "short" and len(shape) == 2 and shape[0] > shape[1] else "row"


def quantize_int8(w: torch.Tensor, axis: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one fp32 scale per row (``axis="row"``) or, for a
    2-D ``w``, per column (``axis="col"``).

    Args:
        w: float tensor of shape ``(rows, ...)`` (``(rows, cols)`` for ``axis="col"``).
        axis: ``row`` or ``col``.

    Returns:
        ``(q, scale)``: ``q`` int8 of ``w``'s shape; ``scale`` fp32 of shape ``(rows,)``
        with ``w ≈ q * scale[:, None, ...]``, or of shape ``(1, cols)`` with
        ``w ≈ q * scale``; the error per entry is at most half its scale.

    Raises:
        CodecError: ``axis="col"`` for a tensor that is not 2-D, or an unknown axis.
    """
    if axis == "col":
        if w.dim() != 2:
            raise CodecError(f"per-column int8 needs a 2-D tensor, got shape {tuple(w.shape)}")
        q, scale = quantize_int8(w.t())
        return q.t().contiguous(), scale.reshape(1, -1)
    if axis != "row":
        raise CodecError(f"int8 axis must be 'row' or 'col', got {axis!r}")
    flat = w.detach().to(torch.float32).reshape(w.shape[0], -1)
    scale = flat.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(flat / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(w.shape), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: fp32 tensor of ``q``'s shape (a ``(rows,)``
    scale per row, a ``(1, cols)`` one per column)."""
    if scale.dim() == 2:
        return q.to(torch.float32) * scale
    shape = [q.shape[0]] + [1] * (q.dim() - 1)
    return q.to(torch.float32) * scale.reshape(shape)


def _scale_fits(scale: TensorInfo, q: TensorInfo) -> bool:
    """Whether ``scale`` is a per-row or (2-D ``q``) per-column int8 scale of ``q``."""
    if scale.dtype != "F32" or q.dtype != "I8" or not q.shape:
        return False
    return scale.shape == q.shape[:1] or (len(q.shape) == 2 and scale.shape == (1, q.shape[1]))


def quantize_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise NF4 quantization (bitsandbytes layout, see the module docstring).

    Args:
        w: float tensor of any shape, ``numel`` values.

    Returns:
        ``(packed, absmax)``: ``packed`` uint8 ``(ceil(numel/2),)``, two 4-bit code indices
        per byte, first in the high nibble; ``absmax`` fp32 ``(ceil(numel/64),)``. Then
        ``|w - dequantize_nf4(...)| <= NF4_MAX_ERROR * absmax`` of the value's block.
    """
    flat = w.detach().to(torch.float32).reshape(-1)
    n = flat.numel()
    nblocks = -(-n // NF4_BLOCK)
    padded = torch.zeros(nblocks * NF4_BLOCK, dtype=torch.float32)
    padded[:n] = flat
    blocks = padded.view(nblocks, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks / absmax.clamp_min(1e-12)[:, None]
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    idx = torch.bucketize(scaled.reshape(-1), (code[1:] + code[:-1]) / 2).to(torch.uint8)[: n + (n % 2)]
    if idx.numel() % 2:
        idx = torch.cat([idx, idx.new_zeros(1)])
    packed = (idx[0::2] << 4) | idx[1::2]
    return packed.contiguous(), absmax.contiguous()


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...] | torch.Size,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_nf4`: tensor of ``shape`` in ``dtype``."""
    n = 1
    for d in shape:
        n *= int(d)
    idx = torch.stack([packed >> 4, packed & 0x0F], dim=1).reshape(-1)[:n].long()
    code = torch.tensor(NF4_CODE, dtype=dtype)
    scale = absmax.to(dtype).repeat_interleave(NF4_BLOCK)[:n]
    return (code[idx] * scale).reshape(tuple(shape))


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(",")) if text else ()
    except ValueError:
        raise CodecError(f"malformed nf4 shape {text!r}") from None
    if not shape or any(d < 0 or d >= 2**40 for d in shape):
        raise CodecError(f"malformed nf4 shape {text!r}")
    return shape


def _packs_nf4(t: torch.Tensor, vectors: bool) -> bool:
    """Whether nf4 packs floating tensor ``t`` (rank >= 2; with ``vectors`` also 1-D of at
    least one block)."""
    return t.dim() >= 2 or (vectors and t.dim() == 1 and t.numel() >= NF4_BLOCK)


def round_trip(t: torch.Tensor, fmt: str, vectors: bool = False) -> torch.Tensor:
    """What :func:`decode_tensors` (dequantizing) returns for floating tensor ``t`` after
    :func:`encode_tensors` in ``fmt`` (``fp32``/``fp16``/``bf16``/``int8``/``nf4``, int8
    with its default ``scales="short"``) with the same ``vectors``, as fp32 of ``t``'s
    shape, without serialising: the same rules (quantized formats for rank >= 2, 1-D
    tensors stay fp32 unless nf4 packs them).

    Raises:
        CodecError: an unknown format.
    """
    t = t.detach().float()
    if (fmt == "int8" and t.dim() < 2) or (fmt == "nf4" and not _packs_nf4(t, vectors)):
        return t
    if fmt == "int8":
        return dequantize_int8(*quantize_int8(t, int8_axis(t.shape)))
    if fmt == "nf4":
        return dequantize_nf4(*quantize_nf4(t), tuple(t.shape))
    if fmt in _CAST:
        return t.to(_CAST[fmt]).float()
    raise CodecError(f"round_trip: unsupported weight format {fmt!r}")


def encode_tensors(
    tensors: dict[str, torch.Tensor], fmt: str = "fp32", metadata: dict[str, str] | None = None,
    exact: Collection[str] = (), scales: str = "short", vectors: bool = False, compress: bool = False,
) -> bytes:
    """Serialise a state dict to safetensors bytes in weight format ``fmt``; the floating
    tensors named in ``exact`` are stored in fp32 whatever ``fmt`` (:func:`decode_tensors`
    returns them unchanged). ``scales`` places int8 scales (:func:`int8_axis`; base
    shards use ``row``). ``vectors``: nf4 also packs 1-D tensors of at least
    :data:`NF4_BLOCK` values. ``compress``: return the compressed payload
    (:data:`COMPRESSED_MAGIC` + zlib, level 6; decoders of protocol minor 8 or later).

    Raises:
        CodecError: unknown format or ``scales``, or a name that uses a reserved suffix.
    """
    if scales not in INT8_SCALES:
        raise CodecError(f"int8 scales must be one of {INT8_SCALES}, got {scales!r}")
    out: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {"format": fmt}
    for name, t in tensors.items():
        if name.endswith((SCALE_SUFFIX, ABSMAX_SUFFIX)):
            raise CodecError(f"tensor name {name!r} uses a reserved suffix ({SCALE_SUFFIX}, {ABSMAX_SUFFIX})")
        t = t.detach().cpu()
        if not t.is_floating_point():
            out[name] = t.contiguous()
        elif name in exact:
            out[name] = t.to(torch.float32).contiguous()
        elif fmt == "int8" and t.dim() >= 2 and t.numel():  # an empty tensor (e.g. a 0-wide shared expert) stays fp32
            q, scale = quantize_int8(t, int8_axis(t.shape, scales))
            out[name] = q.contiguous()
            out[name + SCALE_SUFFIX] = scale.contiguous()
        elif fmt == "nf4" and t.numel() and _packs_nf4(t, vectors):
            packed, absmax = quantize_nf4(t)
            out[name] = packed
            out[name + ABSMAX_SUFFIX] = absmax
            meta[NF4_SHAPE_KEY + name] = ",".join(str(d) for d in t.shape)
        elif fmt in ("int8", "nf4"):
            out[name] = t.to(torch.float32).contiguous()
        elif fmt in _CAST:
            out[name] = t.to(_CAST[fmt]).contiguous()
        else:
            raise CodecError(f"unsupported weight format {fmt!r}")
    data = st_save(out, metadata={**meta, **(metadata or {})})
    return COMPRESSED_MAGIC + zlib.compress(data, 6) if compress else data


def is_compressed(data: bytes | memoryview) -> bool:
    """Whether ``data`` is a compressed payload (starts with :data:`COMPRESSED_MAGIC`)."""
    return bytes(data[: len(COMPRESSED_MAGIC)]) == COMPRESSED_MAGIC


def inflate(data: bytes | memoryview, max_bytes: int) -> bytes | memoryview:
    """The safetensors bytes of a payload: ``data`` itself if plain, else its zlib
    stream inflated to at most ``max_bytes`` bytes.

    Raises:
        CodecError: a compressed payload that is malformed, truncated, followed by stray
            bytes, or that inflates to more than ``max_bytes`` (stopped there).
    """
    if not is_compressed(data):
        return data
    d = zlib.decompressobj()
    try:
        out = d.decompress(bytes(data[len(COMPRESSED_MAGIC):]), max_bytes + 1)
    except zlib.error as e:
        raise CodecError(f"malformed compressed payload: {e}") from None
    if len(out) > max_bytes:
        raise CodecError(f"compressed payload inflates to more than the limit of {max_bytes} bytes")
    if not d.eof or d.unused_data:
        raise CodecError("compressed payload is truncated or has stray bytes after its zlib stream")
    return out


def inspect_header(data: bytes | memoryview, max_bytes: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and bounds-check a safetensors header without allocating tensors.

    The parse of a header is kept (:func:`_parse_header`, the last
    :data:`HEADER_CACHE_SIZE` headers by their bytes and the payload's length): devices
    holding the same experts send byte-identical headers, and parsing and checking one of
    the fleet's 128 tensors costs about 0.3 ms, a few percent of the aggregator's CPU per
    update.

    Args:
        data: the payload.
        max_bytes: largest acceptable payload size in bytes.

    Returns:
        ``(infos, metadata)``: declared dtype/shape per tensor, and the metadata dict (both
        the caller's own: changing them changes no cached parse).

    Raises:
        CodecError: oversized, truncated, unknown dtype, offsets that overlap, leave
            gaps or point past the end, or sizes inconsistent with the shapes; a
            compressed payload (:func:`inflate` it first).
    """
    if is_compressed(data):
        raise CodecError("a compressed payload: its header describes the inflated bytes (base shards are "
                         "never compressed)")
    n = len(data)
    if n > max_bytes:
        raise CodecError(f"payload of {n} bytes exceeds limit {max_bytes}")
    if n < 8:
        raise CodecError("truncated safetensors payload (no header length)")
    (hlen,) = struct.unpack("<Q", bytes(data[:8]))
    if hlen > min(MAX_HEADER_BYTES, n - 8):
        raise CodecError(f"declared header length {hlen} exceeds the payload")
    raw = bytes(data[8 : 8 + hlen])
    infos, metadata = (_parse_header_cached if hlen <= CACHED_HEADER_BYTES else _parse_header)(raw, n)
    return dict(infos), dict(metadata)


HEADER_CACHE_SIZE = 256
CACHED_HEADER_BYTES = 32 * 1024
""":func:`inspect_header` keeps the parses of the last :data:`HEADER_CACHE_SIZE` headers of at
most :data:`CACHED_HEADER_BYTES` bytes (the fleet's 128 tensors: about 12 KiB of header), so
devices sending distinct headers make it hold at most 256 parses of 32 KiB headers (about
40 MiB: a 32 KiB header of one-element tensors parses into about 150 KiB of objects)."""


def _parse_header(raw: bytes, n: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The checked header ``raw`` of a payload of ``n`` bytes (:func:`inspect_header`; the
    dicts returned may be shared: copy before changing them). Raises CodecError."""
    hlen = len(raw)
    try:
        header = json.loads(raw.decode("utf-8"))
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
        infos[name] = TensorInfo(dtype, tuple(shape), 8 + hlen + start, 8 + hlen + end)
    spans.sort()
    pos = 0
    for start, end in spans:
        if start != pos:
            raise CodecError("tensor buffers overlap or leave gaps")
        pos = end
    if pos != body:
        raise CodecError("payload has trailing bytes after the last tensor")
    return infos, metadata


_parse_header_cached = functools.lru_cache(maxsize=HEADER_CACHE_SIZE)(_parse_header)


def decode_tensors(
    data: bytes | memoryview,
    max_bytes: int,
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    dequantize: bool = True,
    as_float: torch.dtype | None = None,
    metadata_out: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Validate and decode safetensors bytes produced by :func:`encode_tensors`.

    Args:
        data: the payload.
        max_bytes: largest acceptable payload in bytes (checked before parsing).
        expected: if given, the exact set of names with their logical shape and dtype
            (after dequantization); anything missing, extra or different is rejected.
        dequantize: turn ``int8`` / ``nf4`` tensors back into fp32 (else return them as
            stored: ``q`` and ``{name}::scale``, or packed ``U8`` and ``{name}::absmax``;
            :func:`nf4_shapes` gives the logical shapes).
        as_float: in an ``fp16``/``bf16`` payload, cast the tensors stored in that dtype
            to this one before the ``expected`` check (an fp16 update checked against an
            fp32 model); a tensor whose dtype is not its payload's format stays as it is
            (and fails the check).
        metadata_out: if given, filled with the payload's safetensors metadata.

    Returns:
        name -> tensor (CPU). Floating tensors are checked finite.

    Raises:
        CodecError: see :func:`inspect_header`; plus non-finite values, or a mismatch
            with ``expected``.
    """
    data = inflate(data, max_bytes)
    infos, metadata = inspect_header(data, max_bytes)
    if metadata_out is not None:
        metadata_out.update(metadata)
    fmt = metadata.get("format", "fp32")
    if fmt not in WEIGHT_FORMATS:
        raise CodecError(f"unsupported weight format {fmt!r}")
    shapes = _check_nf4(infos, metadata) if fmt == "nf4" else {}
    for name, info in infos.items():
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            bi = infos.get(base)
            if bi is None or not _scale_fits(info, bi):
                raise CodecError(f"scale {name!r} does not match an int8 tensor's rows or columns")
        elif info.dtype == "I8" and fmt == "int8" and name + SCALE_SUFFIX not in infos:
            raise CodecError(f"int8 tensor {name!r} has no scale")
    raw = _tensor_views(data, infos)
    out: dict[str, torch.Tensor] = {}
    computed: list[str] = []  # dequantized here
    for name, t in raw.items():
        if name.endswith(SCALE_SUFFIX):
            if not dequantize:
                out[name] = t
            continue
        if name.endswith(ABSMAX_SUFFIX):
            if not dequantize:
                out[name] = t
            continue
        scale = raw.get(name + SCALE_SUFFIX)
        if scale is not None and dequantize:
            t = dequantize_int8(t, scale)
            computed.append(name)
        elif name in shapes and dequantize:
            t = dequantize_nf4(t, raw[name + ABSMAX_SUFFIX], shapes[name])
            computed.append(name)
        if as_float is not None and fmt in ("fp16", "bf16") and t.dtype == _CAST[fmt]:
            t = t.to(as_float)
        out[name] = t
    bad = _non_finite(data, infos)  # the stored floats, in one pass (a cast of a finite fp16/bf16 stays finite)
    if bad is None:  # a finite int8 scale or nf4 absmax can still overflow when dequantized
        bad = next((n for n in computed if not bool(torch.isfinite(out[n]).all())), None)
    if bad is not None:
        raise CodecError(f"tensor {bad!r} holds NaN or Inf")
    if expected is not None:
        check_expected(out if dequantize else
                       {k: v for k, v in out.items() if not k.endswith((SCALE_SUFFIX, ABSMAX_SUFFIX))}, expected)
    return out


def nf4_shapes(metadata: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Logical shapes of the nf4 tensors recorded in a payload's metadata.

    Raises:
        CodecError: a malformed shape entry.
    """
    return {k[len(NF4_SHAPE_KEY):]: _parse_shape(v) for k, v in metadata.items() if k.startswith(NF4_SHAPE_KEY)}


def _check_nf4(infos: dict[str, TensorInfo], metadata: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Every nf4 tensor has a consistent packed size, absmax and recorded shape."""
    shapes = nf4_shapes(metadata)
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        info, amax = infos.get(name), infos.get(name + ABSMAX_SUFFIX)
        if info is None or info.dtype != "U8" or info.shape != (-(-n // 2),):
            raise CodecError(f"nf4 tensor {name!r} does not match its shape {shape}")
        if amax is None or amax.dtype != "F32" or amax.shape != (-(-n // NF4_BLOCK),):
            raise CodecError(f"nf4 tensor {name!r} has no matching absmax")
    for name in infos:
        if name.endswith(ABSMAX_SUFFIX) and name[: -len(ABSMAX_SUFFIX)] not in shapes:
            raise CodecError(f"absmax {name!r} belongs to no nf4 tensor")
    return shapes


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
