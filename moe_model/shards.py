"""Base shards: splitting base weights into backbone + per-expert shards, encoding
them in a weight format, and the device-side cache keyed by sha256.

A shard id is ``backbone`` or ``L{layer}.E{expert}`` (``protocol.topics.shard_id``).
Expert shards use expert-local tensor names (``fc1.weight``); the backbone shard uses
model parameter/buffer names. Routers and heads are not base weights: they are part
of the adapter state (docs/methods/index.md).
"""

from __future__ import annotations

import hashlib
import json
import struct
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from protocol.codec import (
    _DTYPES, ABSMAX_SUFFIX, SCALE_SUFFIX, CodecError, decode_tensors, dequantize_int8, dequantize_nf4,
    encode_tensors, inspect_header, nf4_shapes, sha256_hex,
)
from protocol.topics import parse_shard_id, shard_id

from .models.moe import MoELayer

log = logging.getLogger(__name__)
BACKBONE = "backbone"
MAX_SHARD_BYTES = 2 * 1024**3


def block_paths(model: nn.Module) -> dict[str, int]:
    """Module path of every MoE block -> its MoE layer index."""
    return {name: m.layer for name, m in model.named_modules() if isinstance(m, MoELayer)}


def _expert_of(name: str, paths: dict[str, int]) -> tuple[int, int, str] | None:
    for path, layer in paths.items():
        prefix = f"{path}.experts."
        if name.startswith(prefix):
            e, local = name[len(prefix):].split(".", 1)
            return layer, int(e), local
    return None


def split_base(base_state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Split a full-MoE base state into shards.

    Args:
        base_state: parameter/buffer name -> tensor for the full MoE (no router, no head).
        model: a skeleton of the same family (any device, e.g. ``meta``), used to find
            where the MoE blocks are.

    Returns:
        shard id -> tensors; expert shards with expert-local names.
    """
    paths = block_paths(model)
    shards: dict[str, dict[str, torch.Tensor]] = {BACKBONE: {}}
    for name, t in base_state.items():
        hit = _expert_of(name, paths)
        if hit is None:
            shards[BACKBONE][name] = t
        else:
            layer, e, local = hit
            shards.setdefault(shard_id(layer, e), {})[local] = t
    return shards


def join_shards(model: nn.Module, shards: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_base` for the experts ``model`` holds.

    Raises:
        KeyError: a shard of an expert the model holds is missing.
    """
    out = dict(shards[BACKBONE])
    for path, layer in block_paths(model).items():
        block = model.get_submodule(path)
        for e in block.expert_ids:
            sid = shard_id(layer, e)
            if sid not in shards:
                raise KeyError(f"missing base shard {sid}")
            for local, t in shards[sid].items():
                out[f"{path}.experts.{e}.{local}"] = t
    return out


def shards_for(experts: dict[int, list[int]]) -> list[str]:
    """Shard ids a device holding ``experts`` needs (backbone first)."""
    return [BACKBONE] + [shard_id(layer, e) for layer in sorted(experts) for e in sorted(experts[layer])]


def encode_shard(tensors: dict[str, torch.Tensor], fmt: str) -> bytes:
    """safetensors bytes of one shard in weight format ``fmt`` (int8 scales per output
    row, as :class:`moe_model.quant.QuantLinear` computes with them)."""
    return encode_tensors(tensors, fmt, scales="row")


def decode_shard(data: bytes, keep_quantized: bool = False) -> dict[str, Any]:
    """Tensors of one shard's bytes: fp32 after dequantization, or (``keep_quantized``)
    with every quantized linear weight as a :class:`moe_model.quant.QuantLinear` under its
    module-local path (``fc1``), its bias folded in (see :func:`held_tensors`).

    Raises:
        protocol.codec.CodecError: malformed or non-finite.
    """
    return held_tensors(*stored_tensors(data), keep_quantized)


def stored_tensors(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One shard's tensors as stored (quantized data and their scales or absmax as they are,
    ``protocol.codec.decode_tensors`` with ``dequantize=False``) and its header metadata.

    Raises:
        protocol.codec.CodecError: malformed, compressed (PROTOCOL.md 6.5a) or non-finite.
    """
    _, meta = inspect_header(data, MAX_SHARD_BYTES)  # refuses a compressed payload (PROTOCOL.md 6.5a)
    return decode_tensors(data, MAX_SHARD_BYTES, dequantize=False), meta


def held_tensors(stored: dict[str, torch.Tensor], metadata: dict[str, str], keep_quantized: bool) -> dict[str, Any]:
    """Stored shard tensors (as :func:`protocol.codec.decode_tensors` with
    ``dequantize=False`` returns them) -> what the device holds.

    With ``keep_quantized`` and a quantized format (bf16, int8, nf4), each rank-2
    ``{p}.weight`` becomes a ``QuantLinear`` at ``{p}`` (with ``{p}.bias``); every other
    tensor is fp32. Without, everything is dequantized to fp32.

    Raises:
        protocol.codec.CodecError: inconsistent quantization metadata.
    """
    from .quant import QUANTIZED_FORMATS, quantized_from_tensors

    fmt = metadata.get("format", "fp32")
    shapes = nf4_shapes(metadata) if fmt == "nf4" else {}
    out: dict[str, Any] = {}
    quant_prefixes = []
    for name, t in stored.items():
        if name.endswith((SCALE_SUFFIX, ABSMAX_SUFFIX)):
            continue
        logical = shapes.get(name, tuple(t.shape))
        if keep_quantized and fmt in QUANTIZED_FORMATS and name.endswith("weight") and len(logical) == 2 \
                and (fmt != "int8" or name + SCALE_SUFFIX in stored):
            quant_prefixes.append(name[: -len("weight")])
    for prefix in quant_prefixes:
        out[prefix[:-1]] = quantized_from_tensors(stored, shapes, fmt, prefix)
    done = {p + "weight" for p in quant_prefixes} | {p + "bias" for p in quant_prefixes}
    for name, t in stored.items():
        if name in done or name.endswith((SCALE_SUFFIX, ABSMAX_SUFFIX)):
            continue
        if name + SCALE_SUFFIX in stored:
            t = dequantize_int8(t, stored[name + SCALE_SUFFIX])
        elif name in shapes:
            t = dequantize_nf4(t, stored[name + ABSMAX_SUFFIX], shapes[name])
        elif t.is_floating_point() and t.dtype != torch.float32:
            t = t.to(torch.float32)
        out[name] = t
    return out


@dataclass
class ShardCache:
    """Device-side cache of shard files by sha256 (``{dir}/{sha256}.safetensors``).

    A shard is only ever fetched when its sha256 is not here; reads verify the hash.
    :meth:`load` maps a file, copies its tensors into the process's own memory and closes
    the mapping (the held weights are footprint the memory plan counts; no file pages stay
    mapped). ``max_bytes`` bounds the directory: after each :meth:`put` or :meth:`adopt`
    the least recently used files (by access time, refreshed on every use) are deleted
    until the total fits, never a file in ``pinned`` (the current round's shards).
    """

    directory: Path
    max_bytes: int | None = None
    pinned: set[str] = field(default_factory=set)
    evicted: int = 0
    """Files deleted by the size limit so far."""

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._verified: set[str] = set()

    def _path(self, sha: str) -> Path:
        if len(sha) != 64 or not all(c in "0123456789abcdef" for c in sha):
            raise ValueError(f"invalid sha256 {sha!r}")
        return self.directory / f"{sha}.safetensors"

    def has(self, sha: str) -> bool:
        """Whether a file for ``sha`` is cached (not verified). Raises ValueError for a malformed
        sha256 (not 64 lowercase hex digits)."""
        return self._path(sha).exists()

    def get(self, sha: str) -> bytes | None:
        """Cached bytes, or None when absent or corrupted (a corrupted file is removed)."""
        p = self._path(sha)
        if not p.exists():
            return None
        data = p.read_bytes()
        if sha256_hex(data) != sha:
            log.warning("cached shard %s is corrupted; removing it", sha[:12])
            p.unlink(missing_ok=True)
            return None
        return data

    def put(self, sha: str, data: bytes) -> None:
        """Store bytes under their sha256 (atomically). Raises ValueError on a hash mismatch."""
        if sha256_hex(data) != sha:
            raise ValueError("shard bytes do not match their sha256")
        p = self._path(sha)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, p)
        self._verified.add(sha)
        self.evict()

    def adopt(self, sha: str, path: Path) -> None:
        """Move a downloaded file whose content the caller verified against ``sha`` into the
        cache (atomically; ``path`` must be on the cache's file system, e.g. from
        :meth:`partial_path`). The hash is checked again on the first :meth:`load`.

        Raises:
            ValueError: malformed sha256.
            OSError: the move failed.
        """
        os.replace(path, self._path(sha))
        self.evict()

    def partial_path(self, sha: str) -> Path:
        """Where a download of ``sha`` is written before :meth:`adopt` (in the cache
        directory, so the move is atomic; never loaded). Raises ValueError for a malformed
        sha256."""
        return self._path(sha).with_suffix(".part")

    def size(self) -> int:
        """Bytes of all cached shard files."""
        return sum(p.stat().st_size for p in self.directory.glob("*.safetensors"))

    def evict(self) -> list[str]:
        """Delete least recently used unpinned files until the cache fits ``max_bytes``.

        Returns:
            The sha256 of each deleted file.
        """
        if self.max_bytes is None:
            return []
        files = []
        for p in self.directory.glob("*.safetensors"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, p.stem, p, st.st_size))
        total = sum(f[3] for f in files)
        gone = []
        for _, sha, p, size in sorted(files):
            if total <= self.max_bytes:
                break
            if sha in self.pinned:
                continue
            p.unlink(missing_ok=True)
            self._verified.discard(sha)
            total -= size
            gone.append(sha)
        if gone:
            self.evicted += len(gone)
            log.info("shard cache over %.1f MiB: evicted %d files", self.max_bytes / 2**20, len(gone))
        return gone

    def load(self, sha: str, keep_quantized: bool = True) -> dict[str, Any] | None:
        """Memory-map a cached shard and return what the device holds of it
        (:func:`held_tensors`: quantized with ``keep_quantized``, else dequantized to
        fp32), or None when absent or corrupted (then removed).

        The hash is verified once per process and file. Every returned tensor is the
        device's own copy and the mapping is closed before returning, so the held weights
        are anonymous memory, counted in the device's footprint
        (:func:`moe_model.budget.footprint_of`) like everything else the plan counts, and
        no file pages stay mapped (measured on the MiniLM backbone: 18-20 MiB of mapped
        pages let go).

        Raises:
            protocol.codec.CodecError: a file whose hash is right but whose content is
                not a valid shard (cannot happen for files written by :meth:`put`).
        """
        p = self._path(sha)
        try:
            f = open(p, "rb")
        except FileNotFoundError:
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                p.unlink(missing_ok=True)
                return None
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if sha not in self._verified:
            if hashlib.sha256(mm).hexdigest() != sha:
                log.warning("cached shard %s is corrupted; removing it", sha[:12])
                mm.close()
                p.unlink(missing_ok=True)
                return None
            self._verified.add(sha)
        os.utime(p, (time.time(), time.time()))
        try:
            infos, meta = inspect_header(mm, MAX_SHARD_BYTES)  # a compressed shard too (PROTOCOL.md 6.5a)
        except CodecError:
            mm.close()
            raise
        (hlen,) = struct.unpack("<Q", mm[:8])
        base = 8 + hlen
        header = json.loads(mm[8:base])
        header.pop("__metadata__", None)
        stored: dict[str, torch.Tensor] = {}
        for name, info in infos.items():
            dtype, width = _DTYPES[info.dtype]
            start, end = header[name]["data_offsets"]
            n = (end - start) // width
            # the device's own copy: nothing keeps viewing the mapping, which closes below
            t = torch.frombuffer(mm, dtype=dtype, count=n, offset=base + start).clone() if n \
                else torch.empty(0, dtype=dtype)
            stored[name] = t.reshape(info.shape)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise CodecError(f"cached shard {sha[:12]}: tensor {name!r} holds NaN or Inf")
        mm.close()
        return held_tensors(stored, meta, keep_quantized)


__all__ = [
    "BACKBONE", "ShardCache", "block_paths", "decode_shard", "encode_shard", "join_shards", "parse_shard_id",
    "shards_for", "split_base", "stored_tensors",
]
