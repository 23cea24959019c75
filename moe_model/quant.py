"""Expert linears held quantized in memory and dequantized on the fly (QLoRA-style).

A device that receives ``int8``, ``nf4`` or ``bf16`` expert shards keeps each expert
linear's weight in that format (:class:`QuantLinear`): int8 with one fp32 scale per
output row (``protocol.codec.quantize_int8``), nf4 in bitsandbytes' blockwise layout
(``protocol.codec.quantize_nf4``; Dettmers et al., "QLoRA", 2023, §3), or bf16. The
forward pass dequantizes the weight to fp32 for the one matmul and drops it; the
backward pass dequantizes it again to compute the input gradient (the weight is frozen,
so no weight gradient), so no fp32 copy of any expert outlives its own matmul. LoRA
(peft) wraps the layer as usual: :func:`swap_in_quantized` replaces the frozen
``base_layer`` of peft's LoRA wrappers after injection.

This is the plain-torch backend, available everywhere torch runs. bitsandbytes'
kernels are not needed (its nf4 byte layout is identical, tested).

Memory held per linear (``held_bytes``): fp32 ``4·out·in``; bf16 ``2·out·in``; int8
``out·in + 4·out``; nf4 ``ceil(out·in/2) + 4·ceil(out·in/64)``; plus the bias in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from protocol.codec import NF4_BLOCK, NF4_CODE, dequantize_int8

QUANTIZED_FORMATS = ("bf16", "int8", "nf4")
"""Weight formats whose expert linears stay quantized on the device."""


def held_bytes(out_features: int, in_features: int, fmt: str, bias: bool = True) -> int:
    """Bytes one linear's frozen weight (+ fp32 bias) occupies when held in ``fmt``.

    Raises:
        ValueError: unknown format.
    """
    n = out_features * in_features
    if fmt in ("fp32",):
        w = 4 * n
    elif fmt in ("fp16", "bf16"):
        w = 2 * n
    elif fmt == "int8":
        w = n + 4 * out_features
    elif fmt == "nf4":
        w = -(-n // 2) + 4 * -(-n // NF4_BLOCK)
    else:
        raise ValueError(f"unknown weight format {fmt!r}")
    return w + (4 * out_features if bias else 0)


CHUNK_BYTES = 8 * 2**20
"""A :class:`QuantLinear` whose fp32 weight would exceed this many bytes is dequantized a
block of rows at a time (:func:`chunk_rows`): a tied output embedding (vocabulary x hidden,
75 MiB in fp32 for a 49k-token vocabulary at 384 wide) never exists whole in fp32."""


def chunk_rows(out_features: int, in_features: int, fmt: str) -> int:
    """Rows of a ``(out, in)`` weight in ``fmt`` dequantized at once: all of them when the
    fp32 weight fits :data:`CHUNK_BYTES`, or when rows cannot be cut out of the stored form
    (nf4 with ``in`` not a multiple of its 64-value block); else as many as fit it."""
    if 4 * out_features * in_features <= CHUNK_BYTES or (fmt == "nf4" and in_features % NF4_BLOCK):
        return out_features
    return max(1, CHUNK_BYTES // (4 * in_features))


def workspace_bytes(out_features: int, in_features: int, fmt: str) -> int:
    """Transient bytes to dequantize one weight, or its largest row block
    (:func:`chunk_rows`): the fp32 result and the index temporaries."""
    n = chunk_rows(out_features, in_features, fmt) * in_features
    return {"fp32": 0, "fp16": 4 * n, "bf16": 4 * n, "int8": 8 * n, "nf4": 16 * n}[fmt]


_PAIR_TABLE = torch.tensor(NF4_CODE, dtype=torch.float32)[
    torch.stack([torch.arange(256) >> 4, torch.arange(256) & 0x0F], dim=1)]
"""byte -> its two NF4 levels ``(256, 2)``."""


def _dequant_nf4_fast(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    n = shape[0] * shape[1]
    vals = _PAIR_TABLE.index_select(0, packed.to(torch.int32)).reshape(-1)
    nblocks = absmax.numel()
    if vals.numel() < nblocks * NF4_BLOCK:
        vals = F.pad(vals, (0, nblocks * NF4_BLOCK - vals.numel()))
    return (vals[: nblocks * NF4_BLOCK].view(nblocks, NF4_BLOCK) * absmax[:, None]).reshape(-1)[:n].view(shape)


class _DequantLinear(torch.autograd.Function):
    """``y = x @ deq(W).T + b`` that saves no fp32 weight for backward, dequantizing a
    block of rows at a time (``QuantLinear.row_blocks``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "QuantLinear") -> torch.Tensor:
        ctx.layer = layer
        return layer.apply_blocks(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layer = ctx.layer
        out = None
        for start, end in layer.row_blocks():
            part = grad[..., start:end] @ layer.dequantized(grad.dtype, start, end)
            out = part if out is None else out.add_(part)
        return out, None


class QuantLinear(nn.Module):
    """A frozen linear layer whose weight is held in ``int8``, ``nf4`` or ``bf16``.

    Args:
        fmt: the held format.
        shape: ``(out_features, in_features)``.
        data: the stored weight: int8 ``(out, in)``; nf4 packed uint8 ``(ceil(out·in/2),)``;
            bf16 ``(out, in)``.
        scale: int8 per-row scales ``(out,)`` or nf4 block absmax ``(ceil(out·in/64),)``
            (fp32); ``None`` for bf16.
        bias: fp32 ``(out,)`` or ``None``.

    ``forward``: ``(..., in)`` -> ``(..., out)`` in the input's dtype.

    Raises:
        ValueError: unknown format or inconsistent shapes.
    """

    def __init__(self, fmt: str, shape: tuple[int, int], data: torch.Tensor, scale: torch.Tensor | None,
                 bias: torch.Tensor | None):
        super().__init__()
        if fmt not in QUANTIZED_FORMATS:
            raise ValueError(f"QuantLinear holds {QUANTIZED_FORMATS}, not {fmt!r}")
        out_f, in_f = (int(d) for d in shape)
        n = out_f * in_f
        want = {"int8": (out_f, in_f), "bf16": (out_f, in_f), "nf4": (-(-n // 2),)}[fmt]
        if tuple(data.shape) != want:
            raise ValueError(f"{fmt} weight of shape {tuple(data.shape)}, expected {want}")
        self.fmt, self.out_features, self.in_features = fmt, out_f, in_f
        self.register_buffer("qweight_data", data, persistent=False)
        self.register_buffer("qweight_scale", scale, persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> "QuantLinear":
        """Quantize an fp32 ``nn.Linear`` (tests, export of a quantized model)."""
        from protocol.codec import quantize_int8, quantize_nf4

        w = linear.weight.detach().float()
        bias = linear.bias.detach().float().clone() if linear.bias is not None else None
        if fmt == "int8":
            q, s = quantize_int8(w)
            return cls(fmt, tuple(w.shape), q, s, bias)
        if fmt == "nf4":
            q, s = quantize_nf4(w)
            return cls(fmt, tuple(w.shape), q, s, bias)
        return cls(fmt, tuple(w.shape), w.to(torch.bfloat16), None, bias)

    def dequantized(self, dtype: torch.dtype = torch.float32, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start:end`` of the weight (default all: ``(out, in)``) in ``dtype`` (a fresh
        tensor). For nf4, row blocks other than the whole weight need ``in`` to be a multiple
        of the 64-value block (:func:`chunk_rows` only cuts such weights)."""
        end = self.out_features if end is None else end
        if self.fmt == "int8":
            w = dequantize_int8(self.qweight_data[start:end], self.qweight_scale[start:end])
        elif self.fmt == "nf4":
            i = self.in_features
            w = _dequant_nf4_fast(self.qweight_data[start * i // 2: -(-end * i // 2)],
                                  self.qweight_scale[start * i // NF4_BLOCK: -(-end * i // NF4_BLOCK)],
                                  (end - start, i))
        else:
            w = self.qweight_data[start:end].to(torch.float32)
        return w if dtype == torch.float32 else w.to(dtype)

    def row_blocks(self) -> list[tuple[int, int]]:
        """``(start, end)`` row ranges dequantized at once (:func:`chunk_rows`)."""
        step = chunk_rows(self.out_features, self.in_features, self.fmt)
        return [(s, min(s + step, self.out_features)) for s in range(0, self.out_features, step)]

    def apply_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ deq(W).T + b``, ``(..., in)`` -> ``(..., out)``, one row block of the weight
        dequantized at a time."""
        blocks = self.row_blocks()
        if len(blocks) == 1:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for start, end in blocks:
            bias = self.bias[start:end] if self.bias is not None else None
            out[..., start:end] = F.linear(x, self.dequantized(x.dtype, start, end), bias)
        return out

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (for inspection and export; allocates)."""
        return self.dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in)`` -> ``(..., out)`` in ``x``'s dtype; the weight is dequantized for this matmul
        only, a row block at a time (:meth:`row_blocks`), and again in backward when ``x``
        needs a gradient (the weight gets none)."""
        if torch.is_grad_enabled() and x.requires_grad:
            return _DequantLinear.apply(x, self)
        return self.apply_blocks(x)

    def held_bytes(self) -> int:
        """Bytes this layer holds (weight storage, scales, bias)."""
        ts = [self.qweight_data, self.qweight_scale, self.bias]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def extra_repr(self) -> str:
        """``in_features=..., out_features=..., fmt=...`` for ``repr``."""
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class QuantEmbedding(nn.Module):
    """A frozen embedding table held in a shard format (the weight of a :class:`QuantLinear`
    from the backbone shard): ``forward(ids (...,) int64)`` -> ``(..., H)`` fp32,
    dequantizing only the rows looked up (int8 row scales, bf16; nf4 when ``H`` is a
    multiple of the 64-value block, else the whole table per call). Takes the place of an
    ``nn.Embedding`` (same ``weight`` property for inspection, ``padding_idx`` kept).

    Raises:
        ValueError: ``q`` has a bias (an embedding has none).
    """

    def __init__(self, q: QuantLinear, padding_idx: int | None = None):
        super().__init__()
        if q.bias is not None:
            raise ValueError("an embedding table has no bias")
        self.q, self.padding_idx = q, padding_idx
        self.num_embeddings, self.embedding_dim = q.out_features, q.in_features

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table ``(V, H)`` (allocates)."""
        return self.q.dequantized()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(...,)`` token ids -> ``(..., H)`` fp32 rows."""
        q, h = self.q, self.embedding_dim
        flat = ids.reshape(-1)
        if q.fmt == "int8":
            rows = q.qweight_data.index_select(0, flat).float() * q.qweight_scale.reshape(-1, 1).index_select(0, flat)
        elif q.fmt == "bf16":
            rows = q.qweight_data.index_select(0, flat).float()
        elif h % NF4_BLOCK == 0:
            packed = q.qweight_data.view(self.num_embeddings, h // 2).index_select(0, flat)
            absmax = q.qweight_scale.view(self.num_embeddings, h // NF4_BLOCK).index_select(0, flat)
            rows = _dequant_nf4_fast(packed.reshape(-1), absmax.reshape(-1), (flat.numel(), h))
        else:
            rows = q.dequantized().index_select(0, flat)
        return rows.reshape(*ids.shape, h)

    def held_bytes(self) -> int:
        """Bytes the table holds (weight storage and scales)."""
        return self.q.held_bytes()


def quantized_from_tensors(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], fmt: str,
                           prefix: str) -> QuantLinear:
    """Build a :class:`QuantLinear` from a shard's stored tensors ``{prefix}weight`` (+
    ``::scale`` / ``::absmax``) and ``{prefix}bias``.

    Raises:
        KeyError: a tensor is missing.
    """
    from protocol.codec import ABSMAX_SUFFIX, SCALE_SUFFIX

    wname = f"{prefix}weight"
    data = tensors[wname]
    bias = tensors.get(f"{prefix}bias")
    bias = bias.float() if bias is not None else None
    if fmt == "int8":
        return QuantLinear(fmt, tuple(data.shape), data, tensors[wname + SCALE_SUFFIX], bias)
    if fmt == "nf4":
        return QuantLinear(fmt, shapes[wname], data, tensors[wname + ABSMAX_SUFFIX], bias)
    return QuantLinear(fmt, tuple(data.shape), data.to(torch.bfloat16), None, bias)


def swap_in_quantized(model: nn.Module, layers: dict[str, nn.Module]) -> None:
    """Replace frozen linears by quantized ones, after peft injected LoRA.

    Args:
        model: the model.
        layers: module path of an original ``nn.Linear`` (as before injection, e.g.
            ``...experts.3.fc1``) -> its :class:`QuantLinear` (or the bitsandbytes layer
            ``moe_model.quant_bnb`` made of it).

    Raises:
        KeyError: a path names no module.
    """
    for path, q in layers.items():
        mod = model.get_submodule(path)
        if hasattr(mod, "base_layer"):  # a peft LoRA wrapper
            mod.base_layer = q
        else:
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, q)
