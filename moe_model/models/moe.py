"""Architecture-independent MoE building blocks: expert FFN, router, sparse MoE layer.

Every model family builds its MoE layers on :class:`MoELayer`, so everything
downstream (shards, sub-MoE, LoRA, statistics, aggregation) finds experts and routers
the same way. Experts and router rows are keyed by their *global* expert id, so a
sub-MoE holding experts {1, 5} names them exactly as the full MoE does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


class ExpertFFN(nn.Module):
    """One expert: ``fc2(act(fc1(x)))``; ``(N, hidden) -> (N, hidden)``."""

    def __init__(self, hidden: int, ffn: int, act: str = "gelu", device=None):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, device=device)
        self.fc2 = nn.Linear(ffn, hidden, device=device)
        self.act = ACT2FN[act] if isinstance(act, str) else act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., hidden)`` -> ``(..., hidden)``: ``fc2(act(fc1(x)))``."""
        return self.fc2(self.act(self.fc1(x)))


class Router(nn.Module):
    """Router of one MoE layer: one row of shape ``(hidden,)`` per held expert.

    ``forward(x)`` maps ``(N, hidden)`` to logits ``(N, n_held)`` in the order of
    ``expert_ids`` (ascending global ids). Rows are separate parameters so that each
    expert's row is trained, shipped and aggregated with its expert (docs/methods/fedmoe.md).
    """

    def __init__(self, hidden: int, expert_ids: list[int], device=None):
        super().__init__()
        self.expert_ids = sorted(int(e) for e in expert_ids)
        self.rows = nn.ParameterDict(
            {str(e): nn.Parameter(torch.zeros(hidden, device=device)) for e in self.expert_ids}
        )

    def weight(self) -> torch.Tensor:
        """Stacked rows, ``(n_held, hidden)``."""
        return torch.stack([self.rows[str(e)] for e in self.expert_ids])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits: ``(N, hidden)`` -> ``(N, n_held)``, column ``j`` for ``expert_ids[j]``
        (``x @ weight().T``, no bias; the softmax is the caller's)."""
        return x @ self.weight().t()


@dataclass
class RoutingRecord:
    """What one forward pass of a :class:`SparseMoeBlock` decided (flattened tokens).

    Attributes:
        probs: ``(N, n_held)`` softmax over held experts (keeps its graph, for
            routing regularisers).
        topk_idx: ``(N, k)`` local expert indices chosen per token.
        topk_weight: ``(N, k)`` renormalised routing weights of the chosen experts.
        hidden: ``(N, hidden)`` layer input (detached), only when the block records it.
    """

    probs: torch.Tensor
    topk_idx: torch.Tensor
    topk_weight: torch.Tensor
    hidden: torch.Tensor | None = None


class MoELayer(nn.Module):
    """What every MoE layer holds, whatever computes its routing: a :class:`Router` with one
    row per held expert (``self.router``), the held experts keyed by global id
    (``self.experts``, an ``nn.ModuleDict``), and the last routing decision (``self.last``).

    Everything downstream (shards, sub-MoE, LoRA, statistics, aggregation, ONNX export)
    finds MoE layers as instances of this class (:func:`moe_blocks`) and names their
    tensors ``{path}.experts.{e}.*`` and ``{path}.router.rows.{e}``. Subclasses decide the
    routing: :class:`SparseMoeBlock` (softmax top-k, our upcycled families) or
    ``moe_model.models.hf_moe.HFExperts`` (a Hugging Face block's own router).
    """

    def __init__(self, layer: int, hidden: int, experts: dict[int, nn.Module], device=None):
        super().__init__()
        if not experts:
            raise ValueError(f"MoE layer {layer} needs at least one expert")
        self.layer = int(layer)
        self.router = Router(hidden, list(experts), device=device)
        self.experts = nn.ModuleDict({str(e): experts[e] for e in self.router.expert_ids})
        self.record_hidden = False
        self.dense_dispatch = False
        """Run every held expert on every token and combine by the (zero-padded) top-k
        gates: the same result without data-dependent control flow (ONNX export)."""
        self.grouped_dispatch = False
        """Run each held expert on exactly its routed tokens with static shapes: the routed
        (token, expert) pairs sorted by expert, one grouped matrix product per linear layer
        (:func:`moe_model.grouped.grouped_dispatch`; a training program's exact dispatch)."""
        self.capacity_factor: float | None = None
        """When set, each held expert takes at most :meth:`capacity` of the tokens routed to
        it, those with the largest gates, with static shapes (a training program's sparse
        dispatch); None: every routed token."""
        self.last: RoutingRecord | None = None

    @property
    def expert_ids(self) -> list[int]:
        """Global ids of the held experts, ascending (the router's column order)."""
        return self.router.expert_ids

    def initial_router_row(self, expert: int) -> torch.Tensor | None:
        """A pretrained router row ``(hidden,)`` for a held global expert id, or None (then
        the row starts random, ``moe_model.submoe.ROUTER_INIT_STD``)."""
        return None

    def capacity(self, tokens: int, k: int) -> int | None:
        """Tokens each held expert takes per forward pass under :attr:`capacity_factor` ``c``:
        ``ceil(c · tokens · k / n_held)``, the expert capacity of GShard (Lepikhin et al., 2020,
        "GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding",
        arXiv:2006.16668, §2.2) and Switch Transformers (Fedus, Zoph and Shazeer, 2021,
        arXiv:2101.03961, eq. 3, with ``k`` experts per token). A token routed to an expert
        that is full (not among its ``capacity`` largest gates) skips that expert; its other
        experts and the residual stream still carry it. None when no factor is set or the
        capacity reaches ``tokens`` (then nothing can be dropped and the dispatch is exact)."""
        if self.capacity_factor is None:
            return None
        cap = math.ceil(self.capacity_factor * tokens * k / len(self.expert_ids))
        return cap if cap < tokens else None

    def dispatch(self, flat: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
                 probs: torch.Tensor) -> torch.Tensor:
        """Send each token to its chosen experts and sum their weighted outputs.

        Args:
            flat: ``(N, hidden)`` tokens.
            idx: ``(N, k)`` int64, local expert indices (columns of ``probs``).
            weight: ``(N, k)`` routing weights of the chosen experts (as the router made them).
            probs: ``(N, n_held)`` routing probabilities (recorded in :attr:`last`).

        Returns:
            ``(N, hidden)``. Stores a :class:`RoutingRecord` in :attr:`last` (``hidden`` only
            when ``record_hidden`` and not ``dense_dispatch``). Under a :attr:`capacity_factor`
            whose :meth:`capacity` is below ``N``, each expert runs on that many tokens
            (static shapes, also in dense-dispatch mode) and the routed tokens beyond it skip it;
            the record still holds every routing decision. Under :attr:`grouped_dispatch` (and
            no capacity), each expert runs on exactly its routed tokens with static shapes,
            unless every token goes to every held expert (``k`` = held experts: then the dense
            form computes the same without the pair sort).
        """
        cap = self.capacity(flat.shape[0], idx.shape[1])
        if self.grouped_dispatch and cap is None and idx.shape[1] < len(self.expert_ids):
            from ..grouped import grouped_dispatch

            self.last = RoutingRecord(probs, idx, weight, None)
            return grouped_dispatch([self.experts[str(e)] for e in self.expert_ids], flat, idx, weight)
        out = torch.zeros_like(flat)
        if self.dense_dispatch or cap is not None:
            gates = torch.zeros_like(probs).scatter(1, idx, weight.to(probs.dtype)).to(flat.dtype)
            for j, e in enumerate(self.expert_ids):
                if cap is None:
                    out = out + self.experts[str(e)](flat) * gates[:, j:j + 1]
                else:  # the cap tokens of largest gate (unrouted tokens have gate 0 and add nothing)
                    g, tok = gates[:, j].topk(cap)
                    out = out.index_add(0, tok, self.experts[str(e)](flat.index_select(0, tok)) * g[:, None])
            self.last = RoutingRecord(probs, idx, weight, None if self.dense_dispatch or not self.record_hidden
                                      else flat.detach())
            return out
        for j, e in enumerate(self.expert_ids):
            tok, slot = (idx == j).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            y = self.experts[str(e)](flat[tok]) * weight[tok, slot, None].to(flat.dtype)
            out.index_add_(0, tok, y)
        self.last = RoutingRecord(probs, idx, weight, flat.detach() if self.record_hidden else None)
        return out


class SparseMoeBlock(MoELayer):
    """Top-k sparse MoE layer over the experts this model holds.

    The softmax runs over the held experts only, the top-``k`` (``k = min(top_k,
    n_held)``) are renormalised to sum to 1 (Mixtral style), so an upcycled block of
    identical experts reproduces the dense FFN exactly.

    Shapes: ``forward(x)`` takes ``(..., hidden)`` and returns the same shape.
    """

    def __init__(self, layer: int, hidden: int, ffn: int, expert_ids: list[int], top_k: int, act: str = "gelu",
                 device=None):
        super().__init__(layer, hidden, {int(e): ExpertFFN(hidden, ffn, act, device=device) for e in expert_ids},
                         device=device)
        self.top_k = int(top_k)
        self.initial_rows: dict[int, torch.Tensor] = {}
        """Pretrained router rows ``(hidden,)`` by global expert id (a Branch-Train-MiX checkpoint's,
        ``moe_model.models.bert_upcycled.btx_weights``); experts without one start random."""

    def initial_router_row(self, expert: int) -> torch.Tensor | None:
        """The checkpoint's router row ``(hidden,)`` of held expert ``expert``, or None."""
        return self.initial_rows.get(int(expert))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., hidden)`` -> ``(..., hidden)``: each of the ``N`` flattened tokens goes to its
        top-``k`` held experts, outputs summed with the renormalised fp32 gates.

        Stores the decision in :attr:`last` (a :class:`RoutingRecord` with ``probs`` ``(N, n_held)``,
        ``topk_idx``/``topk_weight`` ``(N, k)``; ``hidden`` ``(N, hidden)`` only when
        ``record_hidden`` and not ``dense_dispatch``).
        """
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)
        k = min(self.top_k, probs.shape[-1])
        weight, idx = probs.topk(k, dim=-1)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        return self.dispatch(flat, idx, weight, probs).reshape(shape)


def moe_blocks(model: nn.Module) -> dict[int, MoELayer]:
    """All :class:`MoELayer` modules of ``model`` by MoE layer index."""
    return {m.layer: m for m in model.modules() if isinstance(m, MoELayer)}
