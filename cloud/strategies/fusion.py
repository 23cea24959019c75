"""``fusion``: Fed-MoE server fusion (Jiang et al. 2025, "Heterogeneous Federated Learning with Scalable Server Mixture-of-Experts", IJCAI 2025, doi:10.24963/ijcai.2025/610,
Jiang et al., "Heterogeneous Federated Learning with Scalable Server Mixture-of-Experts";
docs/methods/fed-moe-fusion.md): devices train one *compact* model, the cloud fuses the uploaded
models into a server MoE (a main expert E_0, K routed experts E_1..E_K and a gate G) with
a small labelled set D^r that only the cloud holds, and sends each device its own
synchronised model back.

**The compact model.** In our families a sub-MoE holding exactly one expert per MoE layer
*is* a dense model of the expert's architecture (for ``bert-upcycled``: the dense MiniLM
whose FFN was copied into the experts; for ``conv-moe``: the dense CNN). Every fusion
device holds expert slot :data:`SLOT` (0) in every MoE layer: its adapter state is
``model.state_for({l: [0]}, task)`` (backbone LoRA, the slot-0 expert LoRA and router row,
the task head; full weights with ``full_finetune``), which is the paper's "identical
compact client model" (Sec. 3). There is **no smaller model** in our families: the only
smaller architecture would drop the MoE layers' FFN, and the memory plan
(:mod:`moe_model.budget`) shows that would not help. For all-MiniLM-L6-v2 (8 experts,
int8, batch 8, 445 MiB runtime) one expert per layer needs 875 MiB and all eight 905 MiB;
one expert is ~1.4 MiB, while activations are 324 MiB at batch 8 and 41 MiB at batch 1.
So a device below one expert per layer at the federation's batch size gets the same
compact model at the largest batch size (halving down to ``min_batch``, default 1) whose
plan fits its budget (a ``batch_size`` training override; the device checks the plan with
it too). A device whose budget holds not even that (for MiniLM the batch takes the plan
from 875 MiB down to 591 MiB, no further) stays excluded, with the figures
(:meth:`Fusion.configure_round`).

**State mapping.** The global adapter state keeps its shape; the server MoE lives in the
strategy's owned tensors (:attr:`cloud.global_model.GlobalModel.owned`), each a flat
vector over the compact keys in sorted order (:meth:`Fusion.layout`):

- :data:`EXPERTS` ``(K+1, P)`` float32: row 0 is E_0, rows 1..K the routed experts;
- :data:`GATE_W` ``(K, H)``, :data:`GATE_B` ``(K,)``: the gate, a linear layer + softmax over
  the compact base model's pooled feature (the task head's input, ``H`` = hidden size)
  of a sample; seeded random init (a uniform gate with equal experts is a stationary
  point of eq. 6-9 that never breaks its symmetry);
- :data:`ALPHA` ``(1,)``: the logit of α (α = sigmoid, so it stays in (0, 1); 0.5 at init);
- ``fusion.sync.{device_id}`` ``(P,)``: the model Stage C synchronised for that device
  (eq. 13), which :meth:`Fusion.state_for` sends it next time (E_0 before it has one).

The global adapter state's compact keys are set to E_0 each round (the main expert holds
the common knowledge: what a device joining later starts from); the other experts' keys
are untouched. The cloud's evaluation is the
server MoE's top-L inference (eq. 10, :func:`top_l_mixture`), not the global MoE.

**Per round** (after m compact models M_1..M_m arrive; :meth:`Fusion.aggregate`):

- Step 0: P = each M_j's class probabilities on D^r, P_y the true class's (:func:`true_label_probs`);
- Steps 1-4, T times: Q = G(X) (eq. 3); W = Q·P_yᵀ averaged over D^r (eq. 4,
  :func:`relevance`); W^r = row-softmax(W) (eq. 5); E_0 and E_i by the moving average with
  λ (eq. 6, :func:`update_experts`); gate and α by ``gate_steps`` Adam steps (lr
  ``gate_lr``) on CE(ŷ) + β·H(Q) (eq. 7-9, :func:`gate_loss`), where ŷ = (1−α)·P̂_0 + α·Σ_i
  Q_i·P̂_i (eq. 1) with the experts' probabilities P̂ on D^r held fixed (α's gradient is
  L_ce's alone, as Algorithm 1 writes: the entropy term does not depend on α);
- Stage C: W^c = column-softmax(cat(1−α, α·W)) (eq. 11-12, :func:`sync_weights`) with the
  refined gate; M_j ← λ·M_j + (1−λ)·Σ_i W^c[i,j]·E_i (eq. 13, :func:`synchronise_clients`).

**The entropy term's sign.** Eq. 8 defines L_ent = −mean Σ_k Q[k]·log Q[k], the gate's
entropy (>= 0), and the paper minimises L_gate = L_ce + β·L_ent (eq. 9) to make the gate
*sharply peaked* (expert specialisation, Sec. 4.2, Fig. 3). So the term is added with
β > 0 and a gradient step on it *lowers* the entropy (tested); a negative sign would
spread the gate instead.

**D^r** (``Setup.reserved``, task -> items) is cloud-only: it comes from the aggregator's
``tasks.{task}.reserved_data`` file or ``Aggregator(reserved_data=...)``; ``fedmoe
simulate`` reserves ``reserve_fraction`` (default 2%) of each task's training split,
seeded and disjoint from every device's data (:func:`fedmoe.partition.reserve`). No
message carries it: devices get adapter states only (tested on the wire).

Choices where the paper is silent: K default 3 (the paper's language
setting); all routed experts start as copies of the initial compact state and diverge
through W^r; the experts' P̂ in Step 4 are recomputed after each Step 3; M̄ is the plain
mean (the paper's Sec. 4.2), not |D_c|-weighted; Step 3 runs inside the T loop, as in
Algorithm 1; eq. 10's σ is a softmax over the selected gate values (weight 1 for L = 1).
One task per federation (the gate, D^r and the backbone would otherwise be shared by
tasks with different heads): more raise ValueError. Classification only (P_y is a class
probability). Sub-MoE devices and compact devices in one federation: :mod:`.fusion_hybrid`.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Sequence

import torch

from moe_model.budget import estimate
from moe_model.submoe import SubMoE
from protocol.experts import Experts

from ..strategy import Aggregated, ClientResult, DeviceView, Failure, Plan, Setup
from .base import Strategy

if TYPE_CHECKING:
    from ..global_model import GlobalModel

log = logging.getLogger(__name__)

SLOT = 0
"""The expert slot every compact model holds in each MoE layer."""
EXPERTS, GATE_W, GATE_B, ALPHA = "fusion.experts", "fusion.gate.weight", "fusion.gate.bias", "fusion.alpha_logit"
SYNC_PREFIX = "fusion.sync."
DEFAULT_RESERVE_FRACTION = 0.02
_EPS = 1e-12


# ---------------------------------------------------------------------------- pure math
def true_label_probs(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Step 0 (Sec. 4.2): P_y, each client model's probability of the true label.

    Args:
        probs: ``(m, N, C)`` class probabilities of m client models on N samples of D^r.
        labels: ``(N,)`` int64 true class ids.

    Returns:
        ``(N, m)``: ``probs[j, n, labels[n]]``.

    Raises:
        ValueError: shapes disagree.
    """
    if probs.dim() != 3 or labels.shape != (probs.shape[1],):
        raise ValueError(f"probs (m, N, C) and labels (N,) expected, got {tuple(probs.shape)}, {tuple(labels.shape)}")
    return probs.gather(2, labels.view(1, -1, 1).expand(probs.shape[0], -1, 1)).squeeze(2).t()


def relevance(q: torch.Tensor, p_y: torch.Tensor) -> torch.Tensor:
    """Eq. 4: W = Q·P_yᵀ, the server-client relevance, averaged over D^r.

    Args:
        q: ``(N, K)`` gate probabilities of N samples over K routed experts (eq. 3).
        p_y: ``(N, m)`` the client models' true-label probabilities (Step 0).

    Returns:
        ``(K, m)``: W[i, j] = mean_n q[n, i]·p_y[n, j].
    """
    return q.t() @ p_y / q.shape[0]


def row_softmax(w: torch.Tensor) -> torch.Tensor:
    """Eq. 5: W^r = σ_row(W) ``(K, m)``, each row sums to 1."""
    return torch.softmax(w, dim=1)


def update_experts(experts: torch.Tensor, models: torch.Tensor, w_r: torch.Tensor, lam: float) -> torch.Tensor:
    """Eq. 6 (Step 3): the moving FedAvg of the server experts.

    Args:
        experts: ``(K+1, P)``: row 0 the main expert E_0, rows 1..K the routed E_i.
        models: ``(m, P)`` the client models M_j (flattened).
        w_r: ``(K, m)`` the row-softmax relevance W^r (eq. 5).
        lam: λ in (0, 1), the moving-average rate.

    Returns:
        ``(K+1, P)``: E_0 ← (1−λ)E_0 + λ·mean_j M_j; E_i ← (1−λ)E_i + λ·Σ_j W^r[i,j]·M_j.
    """
    target = torch.cat([models.mean(0, keepdim=True), w_r @ models])
    return (1 - lam) * experts + lam * target


def gating_entropy(q: torch.Tensor) -> torch.Tensor:
    """Eq. 8: L_ent = −mean_n Σ_k q[n,k]·log q[n,k] (>= 0; 0 for one-hot gates).

    Args:
        q: ``(N, K)`` gate probabilities.

    Returns:
        A scalar (nats).
    """
    return -(q * q.clamp_min(_EPS).log()).sum(1).mean()


def mixture_probs(p0: torch.Tensor, routed: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
    """Eq. 1 / Step 4: ŷ = (1−α)·P̂_0 + α·Σ_i Q_i·P̂_i.

    Args:
        p0: ``(N, C)`` the main expert's class probabilities.
        routed: ``(K, N, C)`` the routed experts'.
        q: ``(N, K)`` gate probabilities.
        alpha: α in [0, 1] (scalar or 0-d tensor).

    Returns:
        ``(N, C)`` class probabilities.
    """
    return (1 - alpha) * p0 + alpha * torch.einsum("nk,knc->nc", q, routed)


def gate_loss(p0: torch.Tensor, routed: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor | float,
              labels: torch.Tensor, beta: float) -> torch.Tensor:
    """Eq. 9: L_gate = L_ce (eq. 7) + β·L_ent (eq. 8), to be *minimised* (β > 0 sharpens Q).

    Args:
        p0, routed, q, alpha: as :func:`mixture_probs`.
        labels: ``(N,)`` int64 true classes.
        beta: β >= 0 (paper: 1e-3).

    Returns:
        A scalar: −mean_n log ŷ[n, y_n] + β·H(Q).
    """
    y_hat = mixture_probs(p0, routed, q, alpha)
    ce = -y_hat.gather(1, labels.view(-1, 1)).clamp_min(_EPS).log().mean()
    return ce + beta * gating_entropy(q)


def sync_weights(w: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
    """Eq. 11-12: W^c = σ_col(cat(1−α, α·W)).

    Args:
        w: ``(K, m)`` relevance W (eq. 4) with the refined gate.
        alpha: α in [0, 1].

    Returns:
        ``(K+1, m)``: row 0 the main expert's weight; each column sums to 1.
    """
    top = torch.full((1, w.shape[1]), 1.0, dtype=w.dtype) * (1 - alpha)
    return torch.softmax(torch.cat([top, alpha * w]), dim=0)


def synchronise_clients(models: torch.Tensor, experts: torch.Tensor, w_c: torch.Tensor, lam: float) -> torch.Tensor:
    """Eq. 13 (Stage C): M ← λ·M + (1−λ)·(W^c)ᵀ·E.

    Args:
        models: ``(m, P)`` client models; experts: ``(K+1, P)``; w_c: ``(K+1, m)``; lam: λ.

    Returns:
        ``(m, P)``: M_j ← λ·M_j + (1−λ)·Σ_i W^c[i, j]·E_i.
    """
    return lam * models + (1 - lam) * (w_c.t() @ experts)


def top_l_mixture(p0: torch.Tensor, routed: torch.Tensor, q: torch.Tensor, alpha: float, top_l: int) -> torch.Tensor:
    """Eq. 10: inference with the main expert and the top-L routed experts.

    Args:
        p0: ``(N, C)``; routed: ``(K, N, C)``; q: ``(N, K)``; alpha: α; top_l: L in 1..K.

    Returns:
        ``(N, C)``: (1−α)·P_0 + α·Σ_{i∈I} σ(Q[I])_i·P_i with I = the L largest gate values
        (σ a softmax over the selected gate values, as eq. 10 writes; weight 1 for L = 1).

    Raises:
        ValueError: L outside 1..K.
    """
    if not 1 <= top_l <= q.shape[1]:
        raise ValueError(f"top_l must be in 1..{q.shape[1]}, got {top_l}")
    val, idx = q.topk(top_l, dim=1)
    weights = torch.zeros_like(q).scatter(1, idx, torch.softmax(val, dim=1))
    return mixture_probs(p0, routed, weights, alpha)


# ---------------------------------------------------------------------------- strategy
class Fusion(Strategy):
    """Fed-MoE server fusion (see the module docstring).

    Params (paper defaults where it gives them): ``routed_experts`` K (3), ``lam`` λ (0.5,
    eq. 6 and 13), ``beta`` β (1e-3, eq. 9), ``iterations`` T (5), ``top_l`` L (1, eq. 10),
    ``gate_lr`` (0.05) and ``gate_steps`` (20) per iteration (Adam; the paper gives plain
    gradient steps without a rate), ``min_batch`` (1: the smallest batch size a device below
    one expert per layer may train with), ``reserve_fraction`` (0.02: the share of the
    training split ``fedmoe simulate`` reserves as D^r), ``seed_offset`` (0: added to the
    federation seed for the gate's init).

    Raises:
        ValueError: a parameter out of range; more than one task; a task without D^r.
        TypeError: unknown parameters.
    """

    name = "fusion"

    def __init__(self, setup: Setup, routed_experts: int = 3, lam: float = 0.5, beta: float = 1e-3,
                 iterations: int = 5, top_l: int = 1, gate_lr: float = 0.05, gate_steps: int = 20,
                 min_batch: int = 1, reserve_fraction: float = DEFAULT_RESERVE_FRACTION, seed_offset: int = 0,
                 **params: Any):
        super().__init__(setup, **params)
        ints = dict(routed_experts=routed_experts, iterations=iterations, top_l=top_l, gate_steps=gate_steps,
                    min_batch=min_batch, seed_offset=seed_offset)
        bad = [k for k, v in ints.items() if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k in (
            "seed_offset", "gate_steps") else 1)]
        for k, v, ok in (("lam", lam, lambda x: 0 < x < 1), ("beta", beta, lambda x: x >= 0),
                         ("gate_lr", gate_lr, lambda x: x > 0), ("reserve_fraction", reserve_fraction,
                                                                 lambda x: 0 < x < 1)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                bad.append(k)
        if not bad and top_l > routed_experts:
            bad.append("top_l")
        if bad:
            raise ValueError(f"fusion: invalid parameters {sorted(bad)} (routed_experts >= 1, 1 <= top_l <= "
                             f"routed_experts, iterations >= 1, gate_steps >= 0, min_batch >= 1, 0 < lam < 1, "
                             f"beta >= 0, gate_lr > 0, 0 < reserve_fraction < 1)")
        if len(setup.tasks) != 1:
            raise ValueError(f"fusion: the server MoE serves one task; this federation has {sorted(setup.tasks)}")
        self.task = next(iter(setup.tasks))
        reserved = setup.reserved.get(self.task) or []
        if not reserved:
            raise ValueError(f"fusion needs a server-reserved labelled set D^r for task {self.task!r}: set "
                             f"tasks.{self.task}.reserved_data (a CSV/JSONL file on the cloud) or pass "
                             f"Aggregator(reserved_data=...); `fedmoe simulate` reserves reserve_fraction of the "
                             f"training split")
        self.reserved = list(reserved)
        self.k, self.lam, self.beta, self.iterations, self.top_l = routed_experts, lam, beta, iterations, top_l
        self.gate_lr, self.gate_steps, self.min_batch = gate_lr, gate_steps, min_batch
        self.seed = setup.seed + seed_offset
        self._net: SubMoE | None = None
        self._features: torch.Tensor | None = None

    @classmethod
    def reserve_fraction_of(cls, params: dict[str, Any]) -> float:
        """The share of each task's training split a simulator keeps on the cloud as D^r."""
        return float(params.get("reserve_fraction", DEFAULT_RESERVE_FRACTION))

    @classmethod
    def smallest_batch_of(cls, params: dict[str, Any], batch_size: int) -> int:
        """``min_batch`` (default 1): a device below the compact model at ``batch_size`` trains it with
        a halved batch down to this."""
        return min(batch_size, int(params.get("min_batch", 1)))

    # ------------------------------------------------------------------ layout
    def compact(self, model: "GlobalModel") -> dict[int, list[int]]:
        """The compact model's experts: slot :data:`SLOT` in every MoE layer."""
        return {layer: [SLOT] for layer in model.layers}

    def is_compact(self, experts, model: "GlobalModel") -> bool:
        """Whether ``experts`` (layer -> ids) is the compact model's assignment."""
        return Experts(experts) == self.compact(model)

    def layout(self, model: "GlobalModel") -> list[tuple[str, tuple[int, ...]]]:
        """(key, shape) of the compact adapter state, in the order of the flat vectors."""
        return [(k, tuple(v.shape)) for k, v in sorted(model.state_for(self.compact(model), self.task).items())]

    def flatten(self, state: dict[str, torch.Tensor], model: "GlobalModel") -> torch.Tensor:
        """A compact adapter state -> ``(P,)`` float64 in :meth:`layout` order."""
        return torch.cat([state[k].double().reshape(-1) for k, _ in self.layout(model)])

    def unflatten(self, flat: torch.Tensor, model: "GlobalModel") -> dict[str, torch.Tensor]:
        """``(P,)`` -> the compact adapter state (float32)."""
        out, at = {}, 0
        for k, shape in self.layout(model):
            n = math.prod(shape)
            out[k] = flat[at:at + n].reshape(shape).float().clone()
            at += n
        return out

    def experts_of(self, model: "GlobalModel") -> torch.Tensor:
        """``(K+1, P)`` float64 server experts (row 0 E_0): the owned tensor, or K+1 copies
        of the compact part of the global state before the first round."""
        if EXPERTS in model.owned:
            return model.owned[EXPERTS].double()
        return self.flatten(model.state, model).repeat(self.k + 1, 1)

    def gate_of(self, model: "GlobalModel") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate weight ``(K, H)``, gate bias ``(K,)``, α logit ``(1,)``) float64: the owned
        tensors, or a seeded N(0, 0.02²) weight, zero bias and α = 0.5 before the first round."""
        o = model.owned
        if GATE_W in o:
            return o[GATE_W].double(), o[GATE_B].double(), o[ALPHA].double()
        hidden = self._feature_net(model).model.head.in_features
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 17)
        return (torch.randn(self.k, hidden, generator=gen, dtype=torch.float64) * 0.02,
                torch.zeros(self.k, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))

    # ------------------------------------------------------------------ rounds
    def state_for(self, device_id: str, task: str, experts, model: "GlobalModel") -> dict:
        """The model Stage C synchronised for ``device_id`` (eq. 13), else the main expert
        E_0 (the compact part of the global state); the default for a non-compact assignment."""
        if not self.is_compact(experts, model) or task != self.task:
            return super().state_for(device_id, task, experts, model)
        synced = model.owned.get(SYNC_PREFIX + device_id)
        return self.unflatten(synced, model) if synced is not None else model.state_for(experts, task)

    def configure_round(self, round: int, devices: list[DeviceView], model: "GlobalModel") -> Plan:
        """Every device gets the compact model; one whose budget does not hold it at the
        federation's batch size gets the largest halved batch size >= ``min_batch`` that
        fits (``train.batch_size`` override); one that fits none is excluded with figures."""
        compact, batch = self.compact(model), self.setup.train.batch_size
        plan = Plan({}, info={"status": "compact", "slot": SLOT})
        for d in devices:
            labels = len(self.setup.tasks.get(d.task, [0, 1]))
            runtime, fmt = d.extra.get("runtime_bytes", 0), d.extra.get("weight_format", model.weight_format)
            b, need = batch, None
            while b >= self.min_batch:
                need = estimate(model.spec, compact, b, labels, runtime, fmt).total
                if need <= d.budget_bytes:
                    break
                b = b // 2 if b > self.min_batch else 0
            if b >= self.min_batch and need is not None and need <= d.budget_bytes:
                plan.assignments[d.device_id] = compact
                if b != batch:
                    plan.train[d.device_id] = {"batch_size": b}
                    plan.info.setdefault("smaller_batch", {})[d.device_id] = b
            else:
                plan.excluded[d.device_id] = (
                    f"budget {d.budget_bytes / 2**20:.0f} MiB is below the {need / 2**20:.0f} MiB memory plan of the "
                    f"compact model (one expert per layer, {fmt}, batch {self.min_batch}); there is no smaller model "
                    f"in this family")
        return plan

    def aggregate(self, round: int, model: "GlobalModel", results: list[ClientResult],
                  failures: list[Failure]) -> Aggregated:
        """Stage B (Steps 0-4, T times) and Stage C on the compact models (:meth:`fuse`); the
        global state's compact keys become E_0."""
        results = self.compact_results(model, results)
        if not results:
            log.warning("round %d: fusion got no compact model; the server MoE is unchanged", round)
            return Aggregated(dict(model.state), None, {"clients": 0})
        experts, synced, gate, metrics = self.fuse(model, self.experts_of(model), results, self.lam)
        owned = {**model.owned, EXPERTS: experts.float(), **gate}
        owned.update({SYNC_PREFIX + r.device_id: synced[j].float() for j, r in enumerate(results)})
        return Aggregated({**model.state, **self.unflatten(experts[0], model)}, owned, metrics)

    def compact_results(self, model: "GlobalModel", results: list[ClientResult]) -> list[ClientResult]:
        """The results that are compact models of the task (slot :data:`SLOT` in every layer)."""
        return [r for r in results if r.task == self.task and self.is_compact(r.experts, model)]

    def fuse(self, model: "GlobalModel", experts: torch.Tensor, results: list[ClientResult], lam: float,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict]:
        """Stage B and Stage C (eq. 3-13) for the compact models of ``results``.

        Args:
            experts: ``(K+1, P)`` the server experts before the round.
            lam: λ of Step 3 (eq. 6); Stage C (eq. 13) uses the configured ``lam``.
            mask: ``(P,)`` bool: Step 3 moves only these entries (the rest stay shared).

        Returns:
            (experts ``(K+1, P)`` float64, synchronised client models ``(m, P)`` float64 in
            ``results`` order, the gate's owned tensors (float32), metrics).
        """
        models = torch.stack([self.flatten(r.state, model) for r in results])
        feats, labels = self._reserved_features(model), self._reserved_labels()
        p_y = true_label_probs(torch.stack([self._probs(model, m) for m in models]), labels)  # Step 0
        gw, gb, a = (t.clone().requires_grad_(True) for t in self.gate_of(model))
        opt = torch.optim.Adam([gw, gb, a], lr=self.gate_lr)
        losses = []
        for _ in range(self.iterations):
            with torch.no_grad():
                q = torch.softmax(feats @ gw.t() + gb, dim=1)  # Step 1, eq. 3
                w_r = row_softmax(relevance(q, p_y))  # Step 2, eq. 4-5
                moved = update_experts(experts, models, w_r, lam)  # Step 3, eq. 6
                experts = moved if mask is None else torch.where(mask, moved, experts)
                p_hat = torch.stack([self._probs(model, e) for e in experts])
            for _ in range(self.gate_steps):  # Step 4, eq. 7-9
                opt.zero_grad()
                loss = gate_loss(p_hat[0], p_hat[1:], torch.softmax(feats @ gw.t() + gb, dim=1), torch.sigmoid(a),
                                 labels, self.beta)
                loss.backward()
                opt.step()
            losses.append(float(loss.detach()) if self.gate_steps else None)
        with torch.no_grad():  # Stage C, eq. 11-13
            q = torch.softmax(feats @ gw.t() + gb, dim=1)
            w = relevance(q, p_y)
            alpha = torch.sigmoid(a)
            w_c = sync_weights(w, alpha)
            synced = synchronise_clients(models, experts, w_c, self.lam)
        gate = {GATE_W: gw.detach().float(), GATE_B: gb.detach().float(), ALPHA: a.detach().float()}
        metrics = {"clients": len(results), "alpha": float(alpha), "gate_loss": losses,
                   "gate_entropy": float(gating_entropy(q)), "W": w.tolist(), "W_c": w_c.tolist(),
                   "clients_order": [r.device_id for r in results]}
        return experts, synced, gate, metrics

    def evaluate(self, round: int, model: "GlobalModel", eval_data: dict[str, Sequence[tuple[Any, int]]],
                 batch_size: int = 32) -> dict[str, Any]:
        """The server MoE's top-L inference (eq. 10) on the cloud's test items: accuracy and
        the mean negative log-likelihood (nats) of the mixture's true-class probability."""
        items = eval_data.get(self.task) or []
        if not items:
            return {"accuracy": None, "loss": None, "per_task": {}}
        experts, (gw, gb, a) = self.experts_of(model), self.gate_of(model)
        with torch.no_grad():
            feats, labels = self._features_of(model, items, batch_size), torch.tensor([y for _, y in items])
            p = torch.stack([self._probs(model, e, items, batch_size) for e in experts])
            q = torch.softmax(feats @ gw.t() + gb, dim=1)
            y_hat = top_l_mixture(p[0], p[1:], q, float(torch.sigmoid(a)), self.top_l)
        acc = float((y_hat.argmax(1) == labels).double().mean())
        loss = float(-y_hat.gather(1, labels.view(-1, 1)).clamp_min(_EPS).log().mean())
        return {"accuracy": acc, "loss": loss,
                "per_task": {self.task: {"accuracy": acc, "loss": loss, "samples": len(items)}}}

    # ------------------------------------------------------------------ model runs
    def _feature_net(self, model: "GlobalModel") -> SubMoE:
        """The compact model on the decoded base shards (built once)."""
        if self._net is None:
            if model.spec.objective != "classification":
                raise ValueError(f"fusion needs class probabilities (P_y, eq. 4); the model's objective is "
                                 f"{model.spec.objective!r}")
            self._net = model.sub_model(self.task, self.compact(model))
            self._net.eval()
        return self._net

    @torch.no_grad()
    def _run(self, model: "GlobalModel", flat: torch.Tensor | None, items, batch_size: int,
             features: bool = False) -> torch.Tensor:
        net = self._feature_net(model)
        if flat is None:
            net.reset_adapter_state()  # the base model: a gate input that does not move between rounds
        else:
            net.load_adapter_state(self.unflatten(flat, model))
        seen: list[torch.Tensor] = []
        hook = net.model.head.register_forward_pre_hook(lambda _m, inp: seen.append(inp[0].detach())) \
            if features else None
        try:
            out = []
            for at in range(0, len(items), batch_size):
                batch, _ = net.collate(items[at:at + batch_size])
                out.append(torch.softmax(net(batch).double(), dim=1))
        finally:
            if hook is not None:
                hook.remove()
        return torch.cat(seen).double() if features else torch.cat(out)

    def _probs(self, model: "GlobalModel", flat: torch.Tensor, items=None, batch_size: int = 32) -> torch.Tensor:
        """``(N, C)`` class probabilities of the compact model ``flat`` on ``items`` (default D^r)."""
        return self._run(model, flat, self.reserved if items is None else items, batch_size)

    def _features_of(self, model: "GlobalModel", items, batch_size: int = 32) -> torch.Tensor:
        """``(N, H)`` the gate's input: the head input of the initial compact model (the base)."""
        return self._run(model, None, items, batch_size, features=True)

    def _reserved_features(self, model: "GlobalModel") -> torch.Tensor:
        if self._features is None:
            self._features = self._features_of(model, self.reserved)
        return self._features

    def _reserved_labels(self) -> torch.Tensor:
        return torch.tensor([int(y) for _, y in self.reserved])
