"""Exact top-k expert dispatch with static shapes: the grouped matrix product of a sorted
token-expert pair list, for training programs (:mod:`moe_model.training_program`).

A training program needs static shapes, so its MoE layers used to run every held expert on
every token (dense dispatch) or each on a fixed capacity of tokens (dropping the rest). Here
the ``N·k`` routed (token, expert) pairs of a layer are sorted by expert, so that expert
``e``'s pairs are the rows ``offsets[e]:offsets[e+1]`` of one ``(N·k, ·)`` matrix, and each
expert's linear layers run only on their own rows: one *grouped* matrix product per linear
layer (the block-sparse formulation of MoE computation of Gale, Narayanan, Young and
Zaharia, 2022, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts",
arXiv:2211.15841, §5; here with segments of any length instead of blocks). Every shape is
static (``N·k`` rows whatever the routing), nothing is dropped, and the function is the
Python device's sparse dispatch (:meth:`moe_model.models.moe.MoELayer.dispatch`).

Three operators, ``fedmoe::grouped_mm``, ``fedmoe::grouped_mm_int8`` (the experts' weights
as the int8 tensors and row scales a device holds, each dequantized only while its rows are
computed) and ``fedmoe::grouped_mm_wgrad``, with their ``.out`` forms for ExecuTorch; torch
computes them here (a loop over experts), the native training core in
``native/src/grouped.cpp`` (one BLAS ``sgemm`` per expert, the experts shared among
ExecuTorch's thread pool). Their gradients are defined by the same operators, so an exported
joint forward-backward graph holds only these (``torch.library.register_autograd``).
"""

from __future__ import annotations

import torch
from torch import nn

from protocol.codec import dequantize_int8

from .quant import QuantLinear

_lib = torch.library.Library("fedmoe", "DEF")
_lib.define("grouped_mm(Tensor x, Tensor w, Tensor offsets, bool trans=False) -> Tensor")
_lib.define("grouped_mm.out(Tensor x, Tensor w, Tensor offsets, bool trans=False, *, Tensor(a!) out) -> Tensor(a!)")
_lib.define("grouped_mm_int8(Tensor x, Tensor[] weight, Tensor[] scale, Tensor offsets, bool trans=False) -> Tensor")
_lib.define("grouped_mm_int8.out(Tensor x, Tensor[] weight, Tensor[] scale, Tensor offsets, bool trans=False, *, "
            "Tensor(a!) out) -> Tensor(a!)")
_lib.define("grouped_mm_wgrad(Tensor g, Tensor x, Tensor offsets) -> Tensor")
_lib.define("grouped_mm_wgrad.out(Tensor g, Tensor x, Tensor offsets, *, Tensor(a!) out) -> Tensor(a!)")


def _segments(offsets: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` per expert from ``offsets`` ``(n+1,)``.

    Raises:
        ValueError: offsets that do not ascend from 0 within ``rows``."""
    o = [int(v) for v in offsets.tolist()]
    if not o or o[0] != 0 or any(b < a for a, b in zip(o, o[1:])) or o[-1] > rows:
        raise ValueError(f"offsets must ascend from 0 to at most {rows} rows, got {o}")
    return list(zip(o, o[1:]))


def _check(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, trans: bool) -> tuple[int, int]:
    if x.dim() != 2 or w.dim() != 3 or offsets.dim() != 1 or offsets.shape[0] != w.shape[0] + 1:
        raise ValueError(f"grouped_mm takes x (P, K), w (n, out, in), offsets (n+1,); got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(offsets.shape)}")
    k, m = (w.shape[1], w.shape[2]) if trans else (w.shape[2], w.shape[1])
    if x.shape[1] != k:
        raise ValueError(f"grouped_mm: x has {x.shape[1]} columns, w's {'rows' if trans else 'columns'} are {k}")
    return x.shape[0], m


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, trans: bool = False) -> torch.Tensor:
    rows, cols = _check(x, w, offsets, trans)
    out = x.new_zeros(rows, cols)
    for e, (a, b) in enumerate(_segments(offsets, rows)):
        if b > a:
            out[a:b] = x[a:b] @ (w[e] if trans else w[e].t())
    return out


def _grouped_mm_fake(x, w, offsets, trans=False):
    rows, cols = _check(x, w, offsets, trans)
    return x.new_empty(rows, cols)


def _check_int8(x: torch.Tensor, weight: list[torch.Tensor], scale: list[torch.Tensor], offsets: torch.Tensor,
                trans: bool) -> tuple[int, int]:
    if not weight or len(weight) != len(scale) or weight[0].dim() != 2 or any(
            q.dtype != torch.int8 or q.shape != weight[0].shape or s.dtype != torch.float32 or s.shape != (q.shape[0],)
            for q, s in zip(weight, scale)):
        raise ValueError("grouped_mm_int8 takes n int8 weights (out, in) of one shape and n fp32 scales (out,)")
    return _check(x, weight[0].unsqueeze(0).expand(len(weight), -1, -1), offsets, trans)


def _grouped_mm_int8(x: torch.Tensor, weight: list[torch.Tensor], scale: list[torch.Tensor], offsets: torch.Tensor,
                     trans: bool = False) -> torch.Tensor:
    _check_int8(x, weight, scale, offsets, trans)  # the reference: grouped_mm on the dequantized stack
    return _grouped_mm(x, torch.stack([dequantize_int8(q, s) for q, s in zip(weight, scale)]), offsets, trans)


def _grouped_mm_int8_fake(x, weight, scale, offsets, trans=False):
    rows, cols = _check_int8(x, weight, scale, offsets, trans)
    return x.new_empty(rows, cols)


def _grouped_mm_wgrad(g: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if g.dim() != 2 or x.dim() != 2 or g.shape[0] != x.shape[0] or offsets.dim() != 1:
        raise ValueError(f"grouped_mm_wgrad takes g (P, out), x (P, in), offsets (n+1,); got {tuple(g.shape)}, "
                         f"{tuple(x.shape)}, {tuple(offsets.shape)}")
    out = g.new_zeros(offsets.shape[0] - 1, g.shape[1], x.shape[1])
    for e, (a, b) in enumerate(_segments(offsets, g.shape[0])):
        if b > a:
            out[e] = g[a:b].t() @ x[a:b]
    return out


def _grouped_mm_wgrad_fake(g, x, offsets):
    return g.new_empty(offsets.shape[0] - 1, g.shape[1], x.shape[1])


def out_variant(fn):
    """The ``.out`` form of the function ``fn`` of an operator: ``fn(*args)`` copied into ``out``
    (the form ExecuTorch's lowering calls)."""
    def impl(*args, out):
        out.copy_(fn(*args))
        return out
    return impl


_lib.impl("grouped_mm", _grouped_mm, "CompositeExplicitAutograd")
_lib.impl("grouped_mm.out", out_variant(_grouped_mm), "CompositeExplicitAutograd")
_lib.impl("grouped_mm_int8", _grouped_mm_int8, "CompositeExplicitAutograd")
_lib.impl("grouped_mm_int8.out", out_variant(_grouped_mm_int8), "CompositeExplicitAutograd")
_lib.impl("grouped_mm_wgrad", _grouped_mm_wgrad, "CompositeExplicitAutograd")
_lib.impl("grouped_mm_wgrad.out", out_variant(_grouped_mm_wgrad), "CompositeExplicitAutograd")
torch.library.register_fake("fedmoe::grouped_mm", _grouped_mm_fake)
torch.library.register_fake("fedmoe::grouped_mm_wgrad", _grouped_mm_wgrad_fake)
torch.library.register_fake("fedmoe::grouped_mm_int8", _grouped_mm_int8_fake)


def _setup(ctx, inputs, output):
    x, w, offsets, *rest = inputs
    ctx.trans = bool(rest[0]) if rest else False
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad):
    x, w, offsets = ctx.saved_tensors
    gx = gw = None
    if ctx.needs_input_grad[0]:
        gx = torch.ops.fedmoe.grouped_mm(grad, w, offsets, not ctx.trans)
    if ctx.needs_input_grad[1]:
        gw = (torch.ops.fedmoe.grouped_mm_wgrad(x, grad, offsets) if ctx.trans
              else torch.ops.fedmoe.grouped_mm_wgrad(grad, x, offsets))
    return gx, gw, None, None


torch.library.register_autograd("fedmoe::grouped_mm", _backward, setup_context=_setup)


def _setup_int8(ctx, inputs, output):
    x, weight, scale, offsets, *rest = inputs
    ctx.trans = bool(rest[0]) if rest else False
    ctx.weight, ctx.scale, ctx.offsets = weight, scale, offsets


def _backward_int8(ctx, grad):
    # the weights are frozen (int8): only the input's gradient, by the transposed product; one gradient per input as
    # the call passed them (x, each weight, each scale, offsets, and trans unless it was left to its default)
    n = len(ctx.weight)
    gx = torch.ops.fedmoe.grouped_mm_int8(grad, ctx.weight, ctx.scale, ctx.offsets, not ctx.trans)
    return (gx, [None] * n, [None] * n, None, None)[:len(ctx.needs_input_grad)]


torch.library.register_autograd("fedmoe::grouped_mm_int8", _backward_int8, setup_context=_setup_int8)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, trans: bool = False) -> torch.Tensor:
    """Each expert's linear map on its own rows.

    Args:
        x: ``(P, K)`` fp32, rows sorted by expert.
        w: ``(n, out, in)`` fp32, one weight per expert in ``nn.Linear``'s layout.
        offsets: ``(n+1,)`` int64, ascending from 0: expert ``e``'s rows are
            ``offsets[e]:offsets[e+1]``; rows from ``offsets[n]`` on are zero in the result.
        trans: False: ``y = x @ w[e].T`` (``K = in``, result ``(P, out)``); True:
            ``y = x @ w[e]`` (``K = out``, result ``(P, in)``), the input gradient.

    Returns:
        ``(P, out)`` or ``(P, in)``; differentiable in ``x`` and ``w``.

    Raises:
        ValueError: shapes that do not match, offsets that do not ascend from 0 within ``P``.
    """
    return torch.ops.fedmoe.grouped_mm(x, w, offsets, trans)


def grouped_mm_int8(x: torch.Tensor, weight: list[torch.Tensor], scale: list[torch.Tensor], offsets: torch.Tensor,
                    trans: bool = False) -> torch.Tensor:
    """:func:`grouped_mm` with each expert's frozen weight held in int8 with one fp32 scale per
    output row (:class:`moe_model.quant.QuantLinear`'s ``int8``): each is dequantized only
    while its own rows are computed, so no ``(n, out, in)`` fp32 stack is ever held (31 MiB
    per linear layer for 64 Qwen3-MoE experts of 384 x 320).

    Args:
        x: ``(P, K)`` fp32, rows sorted by expert.
        weight: ``n`` int8 ``(out, in)`` tensors, expert ``e``'s at position ``e``.
        scale: ``n`` fp32 ``(out,)`` tensors: ``W_e = weight[e] * scale[e][:, None]``.
        offsets, trans: as :func:`grouped_mm`.

    Returns:
        ``(P, out)`` or ``(P, in)``; differentiable in ``x`` only (the weights are frozen).

    Raises:
        ValueError: weights that are not int8 of one shape, scales of another length, and
        :func:`grouped_mm`'s errors.
    """
    return torch.ops.fedmoe.grouped_mm_int8(x, weight, scale, offsets, trans)


def sort_pairs(idx: torch.Tensor, weight: torch.Tensor,
               n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``N·k`` routed (token, expert) pairs of a layer in expert order (stable: by
    token within an expert), with static shapes.

    Args:
        idx: ``(N, k)`` int64 local expert indices in ``[0, n)``.
        weight: ``(N, k)`` their gate weights.
        n: held experts.

    Returns:
        ``token`` ``(N·k,)`` int64 (the token of each sorted pair), ``expert`` ``(N·k,)``
        int64 (its expert), ``gate`` ``(N·k,)`` (its weight, differentiable), ``offsets``
        ``(n+1,)`` int64 (expert ``e``'s pairs are ``offsets[e]:offsets[e+1]``).
    """
    tokens, k = idx.shape
    pairs = tokens * k
    flat = idx.reshape(-1)
    order = torch.topk(flat * pairs + torch.arange(pairs), pairs, largest=False).indices
    counts = (flat.unsqueeze(1) == torch.arange(n).unsqueeze(0)).sum(0)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return (torch.div(order, k, rounding_mode="floor"), flat.index_select(0, order),
            weight.reshape(-1).index_select(0, order), offsets)


def _lora(mod: nn.Module) -> bool:
    return hasattr(mod, "base_layer") and hasattr(mod, "lora_A")


def _base_weight(mod: nn.Module) -> torch.Tensor:
    if not isinstance(mod, (nn.Linear, QuantLinear)):
        raise TypeError(f"grouped dispatch takes nn.Linear or QuantLinear expert layers, not {type(mod).__name__}")
    return mod.weight  # a QuantLinear's: dequantized


def grouped_linear(layers: list[nn.Module], x: torch.Tensor, offsets: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """The same linear layer of ``n`` experts (``nn.Linear`` or :class:`QuantLinear`, each
    optionally wrapped by a peft LoRA layer: ``y = base(x) + s · B(A(x))``, no dropout) on the
    rows of each.

    Args:
        layers: ``n`` modules, expert ``e``'s at position ``e``.
        x: ``(P, in)`` rows sorted by expert; ``offsets`` ``(n+1,)`` as :func:`grouped_mm`.
        expert: ``(P,)`` int64, the expert of each row (for the bias).

    Returns:
        ``(P, out)``.
    """
    lora = _lora(layers[0])
    base = [m.base_layer if lora else m for m in layers]
    if all(isinstance(b, QuantLinear) and b.fmt == "int8" for b in base):
        y = grouped_mm_int8(x, [b.qweight_data for b in base], [b.qweight_scale for b in base], offsets)
    else:
        y = grouped_mm(x, torch.stack([_base_weight(b) for b in base]), offsets)
    if base[0].bias is not None:
        y = y + torch.stack([b.bias for b in base]).index_select(0, expert)
    if lora:
        name = layers[0].active_adapters[0]
        a = torch.stack([m.lora_A[name].weight for m in layers])
        b = torch.stack([m.lora_B[name].weight for m in layers])
        y = y + grouped_mm(grouped_mm(x, a, offsets), b, offsets) * layers[0].scaling[name]
    return y


def grouped_experts(experts: list[nn.Module], x: torch.Tensor, offsets: torch.Tensor,
                    expert: torch.Tensor) -> torch.Tensor:
    """``n`` experts of one MoE layer on their own rows: ``(P, hidden)`` -> ``(P, hidden)``.

    Experts are ``moe_model.models.moe.ExpertFFN`` (``fc2(act(fc1(x)))``) or
    ``moe_model.models.hf_moe.GatedExpert`` (``down_proj(act(gate_proj(x)) * up_proj(x))``).

    Raises:
        TypeError: another expert module.
    """
    first = experts[0]
    if hasattr(first, "fc1"):
        h = first.act(grouped_linear([e.fc1 for e in experts], x, offsets, expert))
        return grouped_linear([e.fc2 for e in experts], h, offsets, expert)
    if hasattr(first, "gate_proj"):
        gate = grouped_linear([e.gate_proj for e in experts], x, offsets, expert)
        up = grouped_linear([e.up_proj for e in experts], x, offsets, expert)
        return grouped_linear([e.down_proj for e in experts], first.act_fn(gate) * up, offsets, expert)
    raise TypeError(f"grouped dispatch has no form for {type(first).__name__} experts")


def grouped_dispatch(experts: list[nn.Module], flat: torch.Tensor, idx: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts, summed with the gate weights, with static
    shapes: ``flat`` ``(N, hidden)``, ``idx``/``weight`` ``(N, k)`` -> ``(N, hidden)``
    (:meth:`moe_model.models.moe.MoELayer.dispatch`'s function, exactly)."""
    token, expert, gate, offsets = sort_pairs(idx, weight, len(experts))
    y = grouped_experts(experts, flat.index_select(0, token), offsets, expert)
    return torch.zeros_like(flat).index_add(0, token, y * gate.unsqueeze(1).to(flat.dtype))

