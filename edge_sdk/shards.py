"""Base shards: splitting base weights into backbone + per-expert shards, encoding
them in a weight format, and the device-side cache keyed by sha256.

A shard id is ``backbone`` or ``L{layer}.E{expert}`` (``protocol.topics.shard_id``).
Expert shards use expert-local tensor names (``fc1.weight``); the backbone shard uses
model parameter/buffer names. Routers and heads are not base weights: they are part
of the adapter state (ALGORITHMS.md §0).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from protocol.codec import decode_tensors, encode_tensors, sha256_hex
from protocol.topics import parse_shard_id, shard_id

from .models.moe import SparseMoeBlock

log = logging.getLogger(__name__)
BACKBONE = "backbone"
MAX_SHARD_BYTES = 2 * 1024**3


def block_paths(model: nn.Module) -> dict[str, int]:
    """Module path of every MoE block -> its MoE layer index."""
    return {name: m.layer for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)}


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
    """safetensors bytes of one shard in weight format ``fmt``."""
    return encode_tensors(tensors, fmt)


def decode_shard(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors (fp32 after dequantization) of one shard's bytes.

    Raises:
        protocol.codec.CodecError: malformed or non-finite.
    """
    return decode_tensors(data, MAX_SHARD_BYTES)


@dataclass
class ShardCache:
    """Device-side cache of shard bytes by sha256 (``{dir}/{sha256}.safetensors``).

    A shard is only ever fetched when its sha256 is not here; reads verify the hash.
    """

    directory: Path

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, sha: str) -> Path:
        if len(sha) != 64 or not all(c in "0123456789abcdef" for c in sha):
            raise ValueError(f"invalid sha256 {sha!r}")
        return self.directory / f"{sha}.safetensors"

    def has(self, sha: str) -> bool:
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


__all__ = [
    "BACKBONE", "ShardCache", "block_paths", "decode_shard", "encode_shard", "join_shards", "parse_shard_id",
    "shards_for", "split_base",
]
