"""The memory plan of a device's training round, used by both sides.

:func:`plan` predicts the peak resident memory of a round; the cloud sizes
assignments with it (how many experts per layer fit a budget: FLEX k_c, FedMoE α·M,
randomMoE) and the device checks every assignment against it and refuses one that
does not fit. The plan is the sum of (:class:`MemoryPlan`):

- ``runtime``: the process before any model is built (Python, torch, transformers,
  MQTT); measured on the device at start-up (its footprint, below), and sent in its
  ``hello``; :data:`DEFAULT_RUNTIME_BYTES` when unknown;
- ``tokenizer``: the family's tokenizer once loaded (``ModelAdapter.tokenizer_bytes_for``);
- ``weights``: base weights as held: each expert linear in the shard format
  (:func:`moe_model.quant.held_bytes`: fp32, bf16, int8 + row scales, nf4 + block
  absmax), the backbone's linears and embedding tables likewise where the family keeps
  them quantized (``ModelAdapter.quantized_backbone``), the rest of the backbone in fp32;
- ``lora``: LoRA A and B, router rows and head (fp32);
- ``grads`` and ``optimizer``: gradients and two AdamW moments of the trainable part
  (LoRA B [and A], router rows, head);
- ``activations``: the family adapter's estimate for one training step;
- ``workspace``: the largest transient dequantized weight (one matmul's fp32 weight);
- ``fetch``: the shard fetch window (:data:`FETCH_WINDOW_BYTES`, twice: chunks and the
  joined blob), held only while shards download, before training: the total counts the
  larger of it and the training step's gradients, optimizer state, activations and
  workspace, not both;
- ``copies``: the adapter state received this round, which the device keeps through
  training as its update's reference (fp32, the trainable part), and with LoRA A trained
  A's seeded initial draw (``SubMoE`` resets to it); with full fine-tuning, ``SubMoE``'s
  own copy of every weight beside the held shards and their initial values;
- ``overhead``: per held expert, its module objects and the allocator's fragmentation
  around its small tensors (``ModelAdapter.expert_overhead_bytes``, measured).

The error-feedback residual (``edge_sdk.filters.UpdateEncoding``) is not in the plan: the
device keeps it on disk between rounds and reads it back after training, when the
training peak's gradients, optimizer state and activations are gone.

What the plan predicts, and the budget is held against, is the **footprint**
(:func:`footprint_of`): anonymous + shared-memory resident pages + swap, what a cgroup
limit, Android's low-memory killer and iOS (``phys_footprint``) act on. RSS also counts
clean file-backed pages (shared libraries' code), which the kernel drops under pressure
instead of killing: a device budgeted on RSS leaves about a quarter of its budget unused.
Every weight a device holds is its own anonymous copy (``ShardCache.load`` copies off the
mapped file), so the footprint counts it. The device measures the round's peak footprint
with :class:`PeakMeter` (RSS high-water mark minus file-backed pages, per training step)
and reports it as ``Stats.peak_footprint_bytes`` beside the RSS peak
(``Stats.peak_rss_bytes``); both include the pre-model baseline
(``Stats.baseline_rss_bytes``, the measured ``runtime``). ``benchmarks/memory.py``
compares predicted and measured peaks over a grid of budgets and formats and decomposes
each cell's footprint.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Mapping, Sequence

import psutil
from torch import nn

from protocol.codec import NF4_BLOCK
from protocol.config import parse_bytes as _parse_bytes
from protocol.messages import ModelSpec

from .models.base import get_adapter, trains_all_weights

DEFAULT_RUNTIME_BYTES = 290 * 1024**2
"""The runtime baseline assumed for a device that reports none: a device process's
footprint after ``fedmoe device``'s imports, measured here at 274 MiB (375 MiB RSS;
Linux x86-64, torch 2.13, transformers 5.24, peft 0.18), rounded up."""
DEFAULT_WEIGHT_FORMAT = "int8"
"""Format assumed when none is given (the aggregator's default ``weight_format``)."""
DEFAULT_HEADROOM_BYTES = 32 * 1024**2
"""Reserve a device adds to its measured runtime baseline for what the plan cannot model
(the plan's own error, page-cache effects on RSS, a first round's one-off growth): a
safety margin, not a ratchet (``EdgeClient._recalibrate`` raises the baseline only when a
peak exceeds the whole plan). The per-round growth it once had to absorb (up to 13 MiB in
one round) was oneDNN's primitive cache, now bounded (:func:`bound_native_caches`)."""
FETCH_WINDOW_BYTES = 8 * 1024**2
"""Shard bytes a device has in flight at once while fetching (then written to its cache)."""


def parse_bytes(text: str | int | float) -> int:
    """``"1.5GiB"``, ``"800MB"``, ``"512mib"``, ``1024`` -> bytes: pydantic's ``ByteSize``
    with a whole-text syntax check (:func:`protocol.config.parse_bytes`; ``MB`` = 10^6
    bytes, ``MiB`` = 2^20).

    Raises:
        ValueError: not a byte size, an unknown unit, or not positive.
    """
    return _parse_bytes(text)


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
    expert_linears: tuple[tuple[int, int, bool], ...] = ()
    """``(out_features, in_features, has_bias)`` of each linear of one expert."""
    expert_other: int = 0
    """Elements of one expert that are not in its linears."""
    expert_lora_a: int = 0
    """LoRA A elements per expert when A is trained (kept once more as its seeded initial
    draw); 0 with A frozen."""
    backbone_lora_a: int = 0
    """Likewise for the backbone's LoRA A."""
    backbone_linears: tuple[tuple[int, int, bool], ...] = ()
    """``(out_features, in_features, has_bias)`` of each backbone linear a family with
    ``ModelAdapter.quantized_backbone`` holds in the shard format (else empty: fp32)."""
    backbone_embeddings: tuple[tuple[int, int], ...] = ()
    """``(num_embeddings, dim)`` of each embedding table such a family holds in the shard
    format (rows dequantized as they are looked up)."""
    tied_outputs: tuple[tuple[int, int], ...] = ()
    """``(out_features, in_features)`` of each output layer that shares such a table (a
    tied LM head: held once, but dequantized block by block as a linear)."""


def param_counts(spec: ModelSpec) -> ParamCounts:
    """Count parameters from a ``meta`` skeleton holding one expert per layer (cached)."""
    return _param_counts(spec.model_dump_json())


@lru_cache(maxsize=32)
def _param_counts(spec_json: str) -> ParamCounts:
    spec = ModelSpec.model_validate_json(spec_json)
    adapter = get_adapter(spec.family)
    layers = adapter.moe_layers(spec)
    model = adapter.build(spec, {x: [0] for x in layers}, 2, device="meta")
    blocks = model.moe_blocks()
    expert_ids = {id(p) for b in blocks.values() for p in b.experts.parameters()}
    router_ids = {id(p) for b in blocks.values() for p in b.router.parameters()}
    head_ids = {id(p) for p in model.head.parameters()} if model.head is not None else set()
    backbone = sum(p.numel() for p in model.parameters() if id(p) not in expert_ids | router_ids | head_ids)
    first = next(iter(blocks.values()))
    expert = sum(p.numel() for p in first.experts.parameters())
    r = spec.lora.rank
    lin = [m for m in first.experts.modules() if isinstance(m, nn.Linear)]
    expert_lora = sum(r * (m.in_features + m.out_features) for m in lin)
    expert_lora_tr = sum(r * m.out_features for m in lin) if not spec.lora.train_a else expert_lora
    targets = adapter.attention_targets if spec.lora.attention else ()
    att = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets]
    bb_lora = sum(r * (m.in_features + m.out_features) for m in att)
    bb_lora_tr = sum(r * m.out_features for m in att) if not spec.lora.train_a else bb_lora
    hidden = model.head.in_features if model.head is not None else 0  # causal-lm: no task head
    a_expert = sum(r * m.in_features for m in lin) if spec.lora.train_a else 0
    a_bb = sum(r * m.in_features for m in att) if spec.lora.train_a else 0
    bb_lin: tuple[tuple[int, int, bool], ...] = ()
    bb_emb: tuple[tuple[int, int], ...] = ()
    tied: list[tuple[int, int]] = []
    if adapter.quantized_backbone and not trains_all_weights(spec):
        skip = expert_ids | router_ids | head_ids
        held, seen = [], set(skip)  # a tied output layer shares the embedding's table: count it once
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) and id(m.weight) not in seen:
                seen.add(id(m.weight))
                held.append(m)
            elif isinstance(m, nn.Linear) and id(m.weight) not in skip:
                tied.append((m.out_features, m.in_features))
        bb_lin = tuple((m.out_features, m.in_features, m.bias is not None) for m in held if isinstance(m, nn.Linear))
        bb_emb = tuple((m.num_embeddings, m.embedding_dim) for m in held if isinstance(m, nn.Embedding))
    if trains_all_weights(spec):  # no LoRA: every weight trains
        expert_lora, expert_lora_tr, bb_lora, bb_lora_tr, a_expert, a_bb = 0, expert, 0, backbone, 0, 0
    linears = tuple((m.out_features, m.in_features, m.bias is not None) for m in lin)
    other = expert - sum(o * i + (o if b else 0) for o, i, b in linears)
    head_per_label = hidden + 1 if hidden else 0
    return ParamCounts(backbone, expert, expert_lora, expert_lora_tr, bb_lora, bb_lora_tr, hidden, head_per_label,
                       len(layers), linears, other, a_expert, a_bb, bb_lin, bb_emb, tuple(tied))


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted peak bytes of one training round, by component (see the module docstring)."""

    runtime: int
    weights: int
    lora: int
    grads: int
    optimizer: int
    activations: int
    tokenizer: int = 0
    workspace: int = 0
    weight_format: str = DEFAULT_WEIGHT_FORMAT
    experts: int = 0
    """Experts held in all layers together."""
    copies: int = 0
    """Adapter values kept beside the model while it trains: the state received this round
    (the update's reference, one fp32 copy of the trainable part) and, with LoRA A
    trained, A's seeded initial draw (fp32); with full fine-tuning, two more fp32 copies of
    the weights (SubMoE's own beside the held shards, and the initial values)."""
    overhead: int = 0
    """Per held expert, what no tensor count shows: its module objects and the allocator's
    fragmentation around its small tensors, gradients and optimizer state
    (``ModelAdapter.expert_overhead_bytes``, measured per family)."""
    fetch: int = 0
    """The shard download window (bytes), held before training, never with it."""

    @property
    def adapters(self) -> int:
        """LoRA, router rows and head with their gradients and optimizer state."""
        return self.lora + self.grads + self.optimizer

    @property
    def training(self) -> int:
        """What exists only while a step trains: gradients, optimizer state, activations,
        workspace (bytes)."""
        return self.grads + self.optimizer + self.activations + self.workspace

    @property
    def total(self) -> int:
        """Predicted peak bytes: what is held all round (runtime, tokenizer, weights, LoRA,
        copies, overhead) plus the larger of :attr:`training` and :attr:`fetch`."""
        return (self.runtime + self.tokenizer + self.weights + self.lora + self.copies + self.overhead
                + max(self.training, self.fetch))

    def as_dict(self) -> dict[str, int | str]:
        """Every field plus ``adapters``, ``training`` and ``total`` (bytes; ``weight_format`` a
        string, ``experts`` a count)."""
        return {**asdict(self), "adapters": self.adapters, "training": self.training, "total": self.total}


MemoryEstimate = MemoryPlan
"""Former name of :class:`MemoryPlan`."""


def _count(c: ParamCounts, experts: int | Mapping[int, Sequence[int] | int]) -> int:
    if isinstance(experts, int):
        return experts * c.moe_layers
    return sum(v if isinstance(v, int) else len(v) for v in experts.values())


def plan(
    model_spec: ModelSpec,
    assignment: int | Mapping[int, Sequence[int] | int],
    weight_format: str = DEFAULT_WEIGHT_FORMAT,
    lora_rank: int | None = None,
    batch: int = 8,
    seq_len: int | None = None,
    *,
    num_labels: int = 2,
    runtime_bytes: int = DEFAULT_RUNTIME_BYTES,
) -> MemoryPlan:
    """Predict the peak memory of a round training ``assignment`` (module docstring).

    Args:
        model_spec: the model.
        assignment: experts held per MoE layer (the same count in every layer), or per
            layer the expert ids or their count (layers may differ).
        weight_format: the format the expert shards are held in (fp32, bf16, int8, nf4).
        lora_rank, seq_len: override the spec's LoRA rank / maximum sequence length.
        batch: training batch size.
        num_labels: classes of the task head.
        runtime_bytes: the process's measured baseline (``runtime``).

    Returns:
        The breakdown; ``.total`` is the predicted peak footprint in bytes.

    Raises:
        ValueError: unknown weight format.
    """
    from .quant import held_bytes, workspace_bytes

    spec = model_spec
    upd: dict = {}
    if lora_rank is not None and lora_rank != spec.lora.rank:
        upd["lora"] = spec.lora.model_copy(update={"rank": int(lora_rank)})
    if seq_len is not None and seq_len != spec.max_seq_len:
        upd["max_seq_len"] = int(seq_len)
    if upd:
        spec = spec.model_copy(update=upd)
    c = param_counts(spec)
    n = _count(c, assignment)
    expert = sum(held_bytes(o, i, weight_format, b) for o, i, b in c.expert_linears) + 4 * c.expert_other \
        if c.expert_linears else 4 * c.expert
    mats = c.backbone_linears + tuple((v, h, False) for v, h in c.backbone_embeddings)
    weights = 4 * (c.backbone - sum(o * i + (o if b else 0) for o, i, b in mats)) \
        + sum(held_bytes(o, i, weight_format, b) for o, i, b in mats) + n * expert
    # transient fp32 weights: per matmul (experts, backbone linears); an nf4 table whose rows
    # are not whole 64-value blocks is dequantized whole (moe_model.quant.QuantEmbedding)
    whole = [(v, h) for v, h in c.backbone_embeddings if weight_format == "nf4" and h % NF4_BLOCK]
    trainable = n * (c.expert_lora_trainable + c.router_row) + c.backbone_lora_trainable + c.head_per_label * num_labels
    lora = 4 * (n * (c.expert_lora + c.router_row) + c.backbone_lora + c.head_per_label * num_labels)
    adapter = get_adapter(spec.family)
    held = [assignment] * c.moe_layers if isinstance(assignment, int) else \
        [v if isinstance(v, int) else len(v) for v in assignment.values()]
    acts = adapter.activation_bytes(spec, batch, held)
    work = max([workspace_bytes(o, i, weight_format) for o, i, _ in c.expert_linears + c.backbone_linears]
               + [workspace_bytes(o, i, weight_format) for o, i in c.tied_outputs]
               + [workspace_bytes(v, h, weight_format) for v, h in whole], default=0)
    copies = 4 * (trainable + n * c.expert_lora_a + c.backbone_lora_a)
    if trains_all_weights(spec):  # SubMoE's own copy of the weights (the shards stay held) and their initial values
        copies += 2 * 4 * (n * c.expert + c.backbone)
    return MemoryPlan(runtime_bytes, weights, lora, 4 * trainable, 8 * trainable, acts,
                      adapter.tokenizer_bytes_for(spec), work, weight_format, n,
                      copies, n * adapter.expert_overhead_bytes(spec), 2 * FETCH_WINDOW_BYTES)


def estimate(
    spec: ModelSpec,
    experts: int | Mapping[int, Sequence[int] | int],
    batch_size: int,
    num_labels: int,
    runtime_bytes: int = DEFAULT_RUNTIME_BYTES,
    weight_format: str = DEFAULT_WEIGHT_FORMAT,
) -> MemoryPlan:
    """:func:`plan` with the spec's LoRA rank and sequence length (the cloud's and the
    device's call).

    Args:
        experts: experts held per MoE layer (the same count in every layer), or per layer
            either the expert ids or their count (layers may differ).
    """
    return plan(spec, experts, weight_format, batch=batch_size, num_labels=num_labels, runtime_bytes=runtime_bytes)


def max_experts_per_layer(
    spec: ModelSpec, budget_bytes: int, batch_size: int, num_labels: int, runtime_bytes: int = DEFAULT_RUNTIME_BYTES,
    weight_format: str = DEFAULT_WEIGHT_FORMAT,
) -> int:
    """Largest experts-per-layer count (0..E) whose :func:`plan` fits ``budget_bytes``."""
    best = 0
    for k in range(1, spec.num_experts + 1):
        if estimate(spec, k, batch_size, num_labels, runtime_bytes, weight_format).total <= budget_bytes:
            best = k
        else:
            break
    return best


_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmSwap")


def memory_status() -> dict[str, int]:
    """This process's memory counters from ``/proc/self/status``, in bytes: ``VmRSS``,
    ``VmHWM`` (RSS high-water mark), ``RssAnon``, ``RssFile`` (clean or dirty file-backed
    pages: shared libraries, mapped files), ``RssShmem``, ``VmSwap``. Empty where
    ``/proc`` is unavailable (not Linux)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in _FIELDS:
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def footprint_of(status: Mapping[str, int]) -> int:
    """The footprint in a :func:`memory_status` reading: anonymous + shared-memory
    resident pages + swapped-out pages (bytes): what a cgroup limit, Android's
    low-memory killer and iOS's ``phys_footprint`` hold against a process. File-backed
    pages are left out: the kernel drops clean ones under pressure instead of killing."""
    return status.get("RssAnon", 0) + status.get("RssShmem", 0) + status.get("VmSwap", 0)


def current_footprint_bytes() -> int:
    """This process's footprint now (:func:`footprint_of`), in bytes; falls back to the
    RSS (:func:`current_rss_bytes`, an over-estimate) where ``/proc`` is unavailable."""
    st = memory_status()
    return footprint_of(st) if "RssAnon" in st else current_rss_bytes()


class PeakMeter:
    """Peak RSS and peak footprint of this process over a span (one device round).

    The kernel keeps a high-water mark of RSS (``VmHWM``) but not of the footprint
    (anonymous + shared + swap, :func:`footprint_of`). The meter bounds it from above,
    segment by segment: each :meth:`mark` closes a segment and opens the next by reading
    ``VmHWM`` and the file-backed resident size ``RssFile``, then resetting ``VmHWM``
    (:func:`reset_peak_rss`). Within a segment ``footprint(t) = rss(t) - file(t) <=
    VmHWM - file(segment start)`` as long as file-backed pages (library code touched for
    the first time, nothing else is mapped: shards are copied off their files) do not
    shrink, which they do only when the kernel reclaims them under memory pressure. The
    bound is loose by the file pages a segment maps (a shard read while loading: one
    shard at a time, before training, far below the training peak); marks
    after every training step (``EdgeClient`` passes :meth:`mark` as ``train_local``'s
    progress callback) keep each segment's new code pages, the bound's slack, small
    (measured in ``benchmarks/memory.py`` against a 1 ms sampler). The meter never reports
    less than a footprint read at a mark. Where ``/proc`` is unavailable both peaks are
    the RSS peak.

    Use::

        meter = PeakMeter().start(); ...; meter.mark(); ...; rss, footprint = meter.peaks()
    """

    def __init__(self) -> None:
        self._file: int | None = None
        self._rss = 0
        self._footprint = 0

    def start(self) -> "PeakMeter":
        """Reset the peaks and open the first segment."""
        self._file, self._rss, self._footprint = None, 0, 0
        reset_peak_rss()
        self.mark()
        return self

    def mark(self, *_: object) -> None:
        """Close the current segment and open the next (any arguments are ignored, so
        the meter can be a progress callback)."""
        st = memory_status()
        if "RssFile" not in st or "VmHWM" not in st:
            return
        self._rss = max(self._rss, st["VmHWM"])
        fp = footprint_of(st)
        seg = st["VmHWM"] - (self._file if self._file is not None else st["RssFile"])
        self._footprint = max(self._footprint, fp, seg)
        self._file = st["RssFile"]
        reset_peak_rss()

    def peaks(self) -> tuple[int, int]:
        """``(peak RSS, peak footprint)`` in bytes since :meth:`start` (closes a segment)."""
        self.mark()
        if self._rss == 0:  # no /proc: the lifetime RSS peak for both
            rss = peak_rss_bytes()
            return rss, rss
        return self._rss, self._footprint


def current_rss_bytes() -> int:
    """Resident set size of this process now, in bytes (``psutil``; 0 where unknown)."""
    try:
        return int(psutil.Process().memory_info().rss)
    except (psutil.Error, OSError):
        return 0


# The peak stays on /proc (and getrusage): psutil has no portable peak RSS. On Linux its
# memory_info() reads /proc/PID/statm (current pages only, no VmHWM), and it has nothing
# that resets the high-water mark (/proc/self/clear_refs), which each round needs.
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
    hwm = memory_status().get("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def bound_native_caches(capacity: int = 0) -> bool:
    """Cap oneDNN's primitive cache at ``capacity`` entries (default 0: no cache), unless
    the environment already sets :data:`ONEDNN_CACHE_ENV`.

    Why: an MoE layer hands each expert a different number of tokens every batch, so
    its matmuls have a new shape almost every step, and torch's CPU kernels (oneDNN)
    cache one compiled primitive per shape, up to 1,024 by default. That cache was the
    device's per-round memory growth: measured on all-MiniLM-L6-v2 upcycled to 8 experts
    (3 MoE layers, int8, T=64, batch 8, 12 steps a round, 1 thread), malloc'd bytes in
    use grew 173 -> 191 MiB over 10 rounds and the round's peak RSS 727 -> 756 MiB over
    8 rounds (+10, +6, +4, ... MiB: the cache filling up); with the cache off both stay
    flat from round 2 (peak 718 -> 722 MiB) at the same step time (0.505 vs 0.514 s).
    Variable shapes rarely hit the cache, so it buys nothing here.

    oneDNN reads the variable when it creates its first primitive: call this before
    the process trains or evaluates anything (``EdgeClient`` and the aggregator do it on
    construction; an application that ran torch models before embedding the SDK should
    set the variable itself at start-up). Returns True if this call set it.
    """
    if ONEDNN_CACHE_ENV in os.environ:
        return False
    os.environ[ONEDNN_CACHE_ENV] = str(int(capacity))
    return True


def tune_allocator(mmap_threshold: int = 64 * 1024) -> bool:
    """Make glibc serve allocations above ``mmap_threshold`` bytes with mmap, so freed
    activations go straight back to the OS instead of fragmenting the heap, and bound
    the native kernel caches (:func:`bound_native_caches`).

    Measured on all-MiniLM-L6-v2 MoE training (T=64, batch 8, 1 thread): peak RSS over
    the pre-model baseline 819 MiB -> 360 MiB, step time 0.41 s -> 0.56 s. Memory-
    budgeted devices want the former trade. Returns False where not glibc/Linux.
    """
    bound_native_caches()
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
