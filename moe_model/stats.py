"""Expert-activation statistics a device reports each round (docs/methods/index.md).

Per MoE layer and global expert e, accumulated over the round's training batches:

- ``usage[e]``: training tokens routed to e, top-k counted (FLEX-MoE u[c,e],
  Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070 eq. 4); ``tokens``: training tokens (padding excluded).
- ``routing_dist[e]``: mean over tokens of the top-k-renormalised routing weight of e
  (FedAlign-MoE r_c, Fang et al. 2026, "Aggregation Alignment for Federated Learning with Mixture-of-Experts under Data Heterogeneity" (FedAlign-MoE), arXiv:2603.21276 eq. 3 as reconstructed in docs/methods/fedalign-moe.md;
  :func:`routing_mass`, so it sums to 1 over the held experts whenever tokens were seen,
  also for routers that do not renormalise their top-k themselves).
- ``margin[e]``: mean of p(e|x) - max_{j≠e} p(j|x) over tokens whose top-1 is e
  (FedAlign eq. 5); 0 if e was never top-1.
- ``expert_loss/acc/samples[e]``: over training samples whose *majority* expert is
  e (the expert receiving most of the sample's top-k token assignments; ties go to
  the lower id). With hundreds of tokens per sample, "any token routed there" would
  count nearly every sample for every expert, so majority routing is used.
- ``hidden_mean[e]`` (optional): mean layer input over tokens routed to e (FedAlign eq. 12).

And over the validation pass: ``activation_prob[e]`` = fraction of validation tokens
routed to e, top-k counted (FedMoE p[c,l,e], Mei et al. 2024, "FedMoE: Personalized Federated Learning via Heterogeneous Mixture of Experts", arXiv:2408.11304).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from protocol.messages import LayerStats

if TYPE_CHECKING:  # transformers (its activations): not for the objective terms a config check imports
    from .models.moe import MoELayer


def routing_mass(idx: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
    """Each token's top-k routing weights, renormalised to sum to 1 (FedAlign eq. 3's "after
    top-k renormalisation"; a token whose weights sum to 0 keeps zeros), in expert columns.

    Args:
        idx: ``(N, k)`` int64 local expert indices (:attr:`RoutingRecord.topk_idx`).
        weight: ``(N, k)`` their routing weights (:attr:`RoutingRecord.topk_weight`).
        n: held experts (columns).

    Returns:
        ``(N, n)`` float64, detached.
    """
    w = weight.detach().double()
    total = w.sum(-1, keepdim=True)
    w = torch.where(total > 0, w / total.clamp_min(torch.finfo(torch.float64).tiny), w)
    return torch.zeros(idx.shape[0], n, dtype=torch.float64).scatter_add_(1, idx, w)


@dataclass
class _Layer:
    n: int
    tokens: int = 0
    usage: torch.Tensor = None  # type: ignore[assignment]
    route_sum: torch.Tensor = None  # type: ignore[assignment]
    margin_sum: torch.Tensor = None  # type: ignore[assignment]
    top1: torch.Tensor = None  # type: ignore[assignment]
    loss_sum: torch.Tensor = None  # type: ignore[assignment]
    correct: torch.Tensor = None  # type: ignore[assignment]
    samples: torch.Tensor = None  # type: ignore[assignment]
    hidden_sum: torch.Tensor | None = None
    val_tokens: int = 0
    val_usage: torch.Tensor = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        z = lambda dt=torch.float64: torch.zeros(self.n, dtype=dt)  # noqa: E731
        self.usage, self.top1, self.samples, self.val_usage = z(torch.long), z(torch.long), z(torch.long), z(torch.long)
        self.route_sum, self.margin_sum, self.loss_sum, self.correct = z(), z(), z(), z()


@dataclass
class ActivationStats:
    """Accumulator of routing statistics for the MoE blocks of one model.

    Args:
        blocks: MoE layer index -> block (its ``expert_ids`` map local to global ids).
        num_experts: E, the length of every reported list.
        hidden: also accumulate per-expert mean hidden states.
    """

    blocks: dict[int, MoELayer]
    num_experts: int
    hidden: bool = False
    _layers: dict[int, _Layer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for layer, block in self.blocks.items():
            block.record_hidden = self.hidden
            self._layers[layer] = _Layer(len(block.expert_ids))

    @torch.no_grad()
    def add_train(self, token_mask: torch.Tensor, sample_loss: torch.Tensor, sample_correct: torch.Tensor) -> None:
        """Account one training batch after its forward pass.

        Args:
            token_mask: ``(B, T)`` bool, real tokens.
            sample_loss: ``(B,)`` per-sample loss.
            sample_correct: ``(B,)`` bool, prediction correct.
        """
        b, t = token_mask.shape
        valid = token_mask.reshape(-1)
        sample_of = torch.arange(b).repeat_interleave(t)[valid]
        for layer, block in self.blocks.items():
            rec, acc = block.last, self._layers[layer]
            idx, w = rec.topk_idx[valid], rec.topk_weight[valid].double()
            probs = rec.probs.detach()[valid].double()
            n = acc.n
            acc.tokens += int(valid.sum())
            onehot = torch.zeros(idx.shape[0], n, dtype=torch.float64).scatter_add_(1, idx, torch.ones_like(w))
            acc.usage += onehot.sum(0).long()
            acc.route_sum += routing_mass(idx, w, n).sum(0)
            top1 = idx[:, 0]
            if n > 1:
                top2 = probs.topk(2, dim=-1).values
                margin = top2[:, 0] - top2[:, 1]
            else:
                margin = probs[:, 0]
            acc.top1 += torch.bincount(top1, minlength=n)
            acc.margin_sum += torch.zeros(n, dtype=torch.float64).scatter_add_(0, top1, margin)
            per_sample = torch.zeros(b, n, dtype=torch.float64).index_add_(0, sample_of, onehot)
            majority = per_sample.argmax(dim=1)
            has = per_sample.sum(1) > 0
            acc.samples += torch.bincount(majority[has], minlength=n)
            acc.loss_sum += torch.zeros(n, dtype=torch.float64).scatter_add_(0, majority[has], sample_loss[has].double())
            acc.correct += torch.zeros(n, dtype=torch.float64).scatter_add_(
                0, majority[has], sample_correct[has].double()
            )
            if self.hidden and rec.hidden is not None:
                h = rec.hidden[valid].double()
                hs = onehot.t() @ h
                acc.hidden_sum = hs if acc.hidden_sum is None else acc.hidden_sum + hs

    @torch.no_grad()
    def add_validation(self, token_mask: torch.Tensor) -> None:
        """Account one validation batch (activation probabilities) after its forward."""
        valid = token_mask.reshape(-1)
        for layer, block in self.blocks.items():
            acc = self._layers[layer]
            idx = block.last.topk_idx[valid]
            acc.val_tokens += int(valid.sum())
            acc.val_usage += torch.bincount(idx.reshape(-1), minlength=acc.n)

    def layer_stats(self) -> list[LayerStats]:
        """The per-layer statistics, lists indexed by global expert id (length E)."""
        out = []
        for layer, block in sorted(self.blocks.items()):
            a, E = self._layers[layer], self.num_experts

            def spread(local, default=0.0):
                full = [default] * E
                for j, e in enumerate(block.expert_ids):
                    full[e] = local[j]
                return full

            tok = max(a.tokens, 1)
            top1 = a.top1.clamp_min(1).double()
            smp = a.samples.clamp_min(1).double()
            loss = [float(x) if s > 0 else None for x, s in zip((a.loss_sum / smp).tolist(), a.samples.tolist())]
            accs = [float(x) if s > 0 else None for x, s in zip((a.correct / smp).tolist(), a.samples.tolist())]
            hidden = None
            if self.hidden:
                cnt = a.usage.clamp_min(1).double()[:, None]
                means = (a.hidden_sum / cnt).tolist() if a.hidden_sum is not None else [None] * a.n
                hidden = spread([m if u > 0 else None for m, u in zip(means, a.usage.tolist())], None)
            out.append(
                LayerStats(
                    layer=layer,
                    tokens=a.tokens,
                    usage=spread(a.usage.tolist(), 0),
                    activation_prob=spread((a.val_usage.double() / max(a.val_tokens, 1)).tolist()),
                    routing_dist=spread((a.route_sum / tok).tolist()),
                    margin=spread((a.margin_sum / top1).tolist()),
                    expert_loss=spread(loss, None),
                    expert_acc=spread(accs, None),
                    expert_samples=spread(a.samples.tolist(), 0),
                    hidden_mean=hidden,
                )
            )
        return out
