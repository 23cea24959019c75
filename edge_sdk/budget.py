"""Memory estimate of a device's training round, used by both sides.

The cloud sizes assignments with it (how many experts per layer fit a budget) and
the device checks its assignment against it. The estimate is the sum of:

- ``runtime``: the process before any model is built (Python, torch, transformers,
  tokenizer); measured on the device at start-up, :data:`DEFAULT_RUNTIME_BYTES` when
  unknown (measured here: 445 MiB RSS on Linux x86-64, torch 2.13, transformers 5.23);
- ``weights``: base weights as held in memory (fp32 after dequantization);
- ``adapters``: LoRA A and B, router rows and head (fp32), their gradients and
  two AdamW moments for the trainable part;
- ``activations``: the family adapter's estimate for one training step.

This is a deliberately simple first-order model; ``benchmarks/memory.py`` compares it
with measured peaks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Mapping, Sequence

from torch import nn

from protocol.messages import ModelSpec

from .models.base import get_adapter

DEFAULT_RUNTIME_BYTES = 445 * 1024**2
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_bytes(text: str | int | float) -> int:
    """``"1.5GiB"``, ``"800MB"``, ``"512mib"``, ``1024`` -> bytes.

    Raises:
        ValueError: unknown unit or a non-positive amount.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = text.strip().lower().replace(" ", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):]
        if unit not in _UNITS or not num:
            raise ValueError(f"cannot parse a byte size from {text!r} (use e.g. 1.5GiB, 800MB)")
        value = float(num) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"byte size must be positive, got {text!r}")
    return int(value)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model family instance (elements, not bytes)."""

    backbone: int
    expert: int
    """Per expert (all MoE layers have the same expert size)."""
    expert_lora: int
    """LoRA A+B elements per expert."""
    expert_lora_trainable: int
    backbone_lora: int
    backbone_lora_trainable: int
    router_row: int
    head_per_label: int
    moe_layers: int


def param_counts(spec: ModelSpec) -> ParamCounts:
    """Count parameters from a ``meta`` skeleton holding one expert per layer (cached)."""
    return _param_counts(spec.model_dump_json())


@lru_cache(maxsize=32)
def _param_counts(spec_json: str) -> ParamCounts:
    from .submoe import ATTENTION_TARGETS

    spec = ModelSpec.model_validate_json(spec_json)
    adapter = get_adapter(spec.family)
    layers = adapter.moe_layers(spec)
    model = adapter.build(spec, {x: [0] for x in layers}, 2, device="meta")
    blocks = model.moe_blocks()
    expert_ids = {id(p) for b in blocks.values() for p in b.experts.parameters()}
    router_ids = {id(p) for b in blocks.values() for p in b.router.parameters()}
    head_ids = {id(p) for p in model.head.parameters()}
    backbone = sum(p.numel() for p in model.parameters() if id(p) not in expert_ids | router_ids | head_ids)
    first = next(iter(blocks.values()))
    expert = sum(p.numel() for p in first.experts.parameters())
    r = spec.lora.rank
    lin = [m for m in first.experts.modules() if isinstance(m, nn.Linear)]
    expert_lora = sum(r * (m.in_features + m.out_features) for m in lin)
    expert_lora_tr = sum(r * m.out_features for m in lin) if not spec.lora.train_a else expert_lora
    targets = ATTENTION_TARGETS.get(spec.family, ()) if spec.lora.attention else ()
    att = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets]
    bb_lora = sum(r * (m.in_features + m.out_features) for m in att)
    bb_lora_tr = sum(r * m.out_features for m in att) if not spec.lora.train_a else bb_lora
    hidden = model.head.in_features
    return ParamCounts(backbone, expert, expert_lora, expert_lora_tr, bb_lora, bb_lora_tr, hidden, hidden + 1,
                       len(layers))


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak bytes of one training round, by component."""

    runtime: int
    weights: int
    adapters: int
    activations: int

    @property
    def total(self) -> int:
        return self.runtime + self.weights + self.adapters + self.activations

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def estimate(
    spec: ModelSpec,
    experts: int | Mapping[int, Sequence[int] | int],
    batch_size: int,
    num_labels: int,
    runtime_bytes: int = DEFAULT_RUNTIME_BYTES,
) -> MemoryEstimate:
    """Estimate peak bytes for a device training with ``batch_size``.

    Args:
        experts: experts held per MoE layer (the same count in every layer), or per layer
            either the expert ids or their count (layers may differ).
    """
    c = param_counts(spec)
    if isinstance(experts, int):
        n = experts * c.moe_layers
    else:
        n = sum(v if isinstance(v, int) else len(v) for v in experts.values())
    weights = 4 * (c.backbone + n * c.expert)
    lora = n * c.expert_lora + c.backbone_lora
    trainable = n * (c.expert_lora_trainable + c.router_row) + c.backbone_lora_trainable + c.head_per_label * num_labels
    adapters = 4 * (lora + 3 * trainable)
    acts = get_adapter(spec.family).activation_bytes(spec, batch_size)
    return MemoryEstimate(runtime_bytes, weights, adapters, acts)


def max_experts_per_layer(
    spec: ModelSpec, budget_bytes: int, batch_size: int, num_labels: int, runtime_bytes: int = DEFAULT_RUNTIME_BYTES
) -> int:
    """Largest experts-per-layer count (0..E) whose :func:`estimate` fits ``budget_bytes``."""
    best = 0
    for k in range(1, spec.num_experts + 1):
        if estimate(spec, k, batch_size, num_labels, runtime_bytes).total <= budget_bytes:
            best = k
    return best


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_bytes() -> int:
    """Resident set size of this process now, in bytes (0 where unknown)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux ``/proc/self/clear_refs`` = 5).
    Returns False where unsupported (then the peak is the process lifetime's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """RSS high-water mark since the last :func:`reset_peak_rss` (``VmHWM``), in bytes;
    falls back to ``getrusage`` (lifetime peak)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def tune_allocator(mmap_threshold: int = 64 * 1024) -> bool:
    """Make glibc serve allocations above ``mmap_threshold`` bytes with mmap, so freed
    activations go straight back to the OS instead of fragmenting the heap.

    Measured on all-MiniLM-L6-v2 MoE training (T=64, batch 8, 1 thread): peak RSS over
    the pre-model baseline 819 MiB -> 360 MiB, step time 0.41 s -> 0.56 s. Memory-
    budgeted devices want the former trade. Returns False where not glibc/Linux.
    """
    try:
        libc = _libc()
        return bool(libc and libc.mallopt(-3, int(mmap_threshold)))  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        return False


def release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``); no-op elsewhere."""
    try:
        libc = _libc()
        if libc is not None:
            libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
