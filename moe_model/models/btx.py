"""Branch-Train-MiX, the architecture-independent part (Sukhbaatar et al. 2024, "Branch-Train-MiX:
Mixing Expert LLMs into a Mixture-of-Experts LLM", arXiv:2403.07816).

BTX in three stages (paper section 2):

1. *Branch & Train*: copies of one dense seed model are trained, each on one domain
   (:func:`train_steps`, checkpointed per domain by :class:`BranchStore`, so a rerun skips the
   finished branches).
2. *MiX*: the feed-forward blocks of the branches become the experts of one MoE layer
   (expert ``e`` = branch ``e``'s FFN, paper eq. 2); every other weight is the mean of the
   branches' weights (:func:`average_states`).
3. *MoE fine-tuning*: the router learns to pick experts. Here the router of each MoE layer is
   first set from the domains (:func:`domain_router_rows`: row ``e`` starts as the centred mean
   hidden state of domain ``e`` at the layer's input and is fitted as a token-level domain
   classifier, the paper's "expert e for domain e" assignment as an initial guess), then trained
   on the domain mixture with the language-model loss plus the Switch load-balancing loss
   (Fedus et al. 2022, eq. 4; the paper's ``L = L_LM + alpha * L_balance``; :func:`train_router`).

An MoE layer is seen through an :class:`ExpertsView` (one per architecture): transformers'
fused-experts MoE blocks (:class:`HFBlockView`) and our :class:`~.moe.SparseMoeBlock`
(:class:`SparseBlockView`). Nothing here knows where the domains' text comes from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .moe import SparseMoeBlock

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
"""``(model, batch) -> scalar loss`` (mean over the batch's predicted tokens)."""


# ---------------------------------------------------------------------------------------------
# progress


def progress(total: int, desc: str):
    """A tqdm progress bar over ``total`` steps when tqdm is installed, else a stand-in that
    logs every tenth of the way (``update(n)``, ``set_postfix_str(s)``, ``close()``)."""
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, mininterval=2.0, dynamic_ncols=True)
    except ImportError:  # pragma: no cover - tqdm ships with transformers
        return _LogBar(total, desc)


class _LogBar:
    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.post, self.t0 = total, desc, 0, "", time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n == self.total or self.n % max(1, self.total // 10) == 0:
            log.info("%s: %d/%d %s (%.0f s)", self.desc, self.n, self.total, self.post, time.perf_counter() - self.t0)

    def set_postfix_str(self, s: str) -> None:
        self.post = s

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# data: fixed-length token blocks


class BlockSampler:
    """Random batches of fixed-length token blocks of one domain, reproducible per seed.

    ``blocks`` is an int64 tensor ``(n_blocks, T)``; :meth:`batch` draws ``batch_size`` rows
    (with replacement) from a generator seeded by ``seed``.
    """

    def __init__(self, blocks: torch.Tensor, seed: int):
        if blocks.dim() != 2 or blocks.shape[0] == 0:
            raise ValueError(f"need a non-empty (n_blocks, T) tensor of token blocks, got shape {tuple(blocks.shape)}")
        self.blocks = blocks
        self.gen = torch.Generator().manual_seed(int(seed))

    def batch(self, batch_size: int) -> torch.Tensor:
        """``(batch_size, T)`` int64 rows."""
        idx = torch.randint(0, self.blocks.shape[0], (batch_size,), generator=self.gen)
        return self.blocks[idx]


DOC_BLOCKS = 4
"""Default cap of :func:`pack_texts`: blocks' worth of tokens taken from one document."""


def pack_blocks(token_lists: Sequence[Sequence[int]], length: int, sep: int | None, max_blocks: int) -> torch.Tensor:
    """Concatenate documents' token ids (``sep`` between them when given) and cut the stream into
    ``(n, length)`` blocks, at most ``max_blocks`` (the incomplete tail is dropped).

    Raises:
        ValueError: ``length < 2`` or the documents hold fewer than ``length`` tokens.
    """
    if length < 2:
        raise ValueError(f"block length must be >= 2, got {length}")
    stream: list[int] = []
    need = length * max_blocks
    for ids in token_lists:
        stream.extend(int(t) for t in ids)
        if sep is not None:
            stream.append(int(sep))
        if len(stream) >= need:
            break
    n = min(len(stream) // length, max_blocks)
    if n == 0:
        raise ValueError(f"the documents hold {len(stream)} tokens, fewer than one block of {length}")
    return torch.tensor(stream[: n * length], dtype=torch.long).view(n, length)


def pack_texts(tok, texts: Sequence[str], length: int, sep: int | None, max_blocks: int,
               doc_blocks: int | None = DOC_BLOCKS) -> torch.Tensor:
    """:func:`pack_blocks` of ``texts`` tokenised by the transformers tokenizer ``tok`` (no special
    tokens), 64 texts at a time until there are enough tokens for ``max_blocks`` blocks.

    Each document contributes at most ``doc_blocks * length`` tokens (None: all of it), so that
    the blocks span many documents: without the cap a domain of long documents (the standard
    library's modules) is a handful of files, which a branch memorises instead of learning the
    domain. Characters beyond ``8 * doc_blocks * length`` are not even tokenised."""
    cap = None if doc_blocks is None else int(doc_blocks) * length
    if cap is not None and cap < 1:
        raise ValueError(f"doc_blocks must be >= 1 (or None), got {doc_blocks}")
    out: list[list[int]] = []
    total = 0
    for i in range(0, len(texts), 64):
        chunk = [t if cap is None else t[: 8 * cap] for t in texts[i:i + 64]]
        ids = [x if cap is None else x[:cap] for x in tok(chunk, add_special_tokens=False)["input_ids"]]
        out.extend(ids)
        total += sum(len(x) + 1 for x in ids)
        if total >= length * max_blocks:
            break
    return pack_blocks(out, length, sep, max_blocks)


# ---------------------------------------------------------------------------------------------
# stage 1: branch & train


PRECISIONS = ("fp32", "bf16")
"""Arithmetic of a build's branch and router training steps: fp32, or bf16 autocast (mixed precision:
matmuls in bfloat16, weights, gradients and optimiser state in fp32; 1.3-1.7x faster branch steps
on a CPU with AVX-512 BF16, measured on SmolLM2-135M)."""


def autocast_loss(loss_fn: LossFn, precision: str, device: str) -> LossFn:
    """``loss_fn`` run under ``torch.autocast(bfloat16)`` on ``device``'s type when ``precision`` is
    ``"bf16"`` (the returned loss is float32), ``loss_fn`` itself for ``"fp32"``.

    Raises:
        ValueError: ``precision`` not in :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return loss_fn
    kind = torch.device(device).type

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        with torch.autocast(kind, dtype=torch.bfloat16):
            return loss_fn(model, batch).float()

    return loss


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's global generators (dropout, initialisers)."""
    random.seed(seed)
    torch.manual_seed(seed)


def train_steps(model: nn.Module, params: Sequence[nn.Parameter], next_batch: Callable[[], Batch], loss_fn: LossFn,
                steps: int, lr: float, desc: str, weight_decay: float = 0.0) -> list[float]:
    """AdamW on ``params`` for ``steps`` steps: linear warm-up over the first 10% of the steps, then
    cosine decay to 10% of ``lr``; gradients clipped to norm 1.

    Args:
        next_batch: returns the next training batch (already on the model's device).
        loss_fn: see :data:`LossFn`.

    Returns:
        The loss of each step (floats).

    Raises:
        ValueError: ``steps < 1``, no parameters, or a non-finite loss (the step is named).
    """
    params = [p for p in params if p.requires_grad]
    if steps < 1 or not params:
        raise ValueError(f"need steps >= 1 and parameters to train, got steps={steps}, {len(params)} parameters")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    warm = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    losses: list[float] = []
    bar = progress(steps, desc)
    try:
        for step in range(steps):
            loss = loss_fn(model, next_batch())
            if not torch.isfinite(loss):
                raise ValueError(f"{desc}: loss is {float(loss)} at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix_str(f"loss {losses[-1]:.3f}")
    finally:
        bar.close()
    model.eval()
    return losses


def train_branches(model: nn.Module, seed_state: dict[str, torch.Tensor], names: Sequence[str], store: "BranchStore",
                   trainable: Callable[[str], bool], batches: Callable[[int, str], Callable[[], Batch]],
                   loss_fn: LossFn, steps: int, lr: float, seed: int) -> tuple[dict[str, list[float]], float]:
    """Stage 1 of Branch-Train-MiX (Sukhbaatar et al. 2024, arXiv:2403.07816, Sec. 2.1): one
    branch per domain, each trained from ``seed_state`` alone, its trained tensors kept in
    ``store`` (a finished branch of the same settings is reused, not trained again).

    Args:
        model: the dense model, loaded with ``seed_state`` before each branch.
        trainable: parameter name -> whether the branch trains it (and ``store`` keeps it).
        batches: ``(domain index, domain name)`` -> that branch's batch source (called after
            the branch's seed is set: ``seed + 1000 * index``).
        loss_fn, steps, lr: as :func:`train_steps`.

    Returns:
        ``({domain: loss per step}, seconds)``.

    Raises:
        ValueError: as :func:`train_steps`.
    """
    t0 = time.perf_counter()
    losses: dict[str, list[float]] = {}
    for d, name in enumerate(names):
        saved = store.load(name)
        if saved is not None:
            log.info("branch %s: reusing %s", name, store.root)
            losses[name] = saved["losses"]
            continue
        model.load_state_dict(seed_state)
        for k, p in model.named_parameters():
            p.requires_grad_(trainable(k))
        seed_everything(seed + 1000 * d)
        next_batch = batches(d, name)
        losses[name] = train_steps(model, [p for p in model.parameters() if p.requires_grad], next_batch, loss_fn,
                                   steps, lr, f"branch {d + 1}/{len(names)} {name}")
        store.save(name, {k: p for k, p in model.named_parameters() if p.requires_grad}, losses[name])
    return losses, time.perf_counter() - t0


class BranchStore:
    """Per-domain branch checkpoints in a work directory, so a rerun skips finished branches.

    ``branch-<domain>.pt`` holds ``{"settings": dict, "state": {name: tensor}, "losses": [...]}``;
    a checkpoint whose settings differ from the current build's (another seed, step count,
    source...) is not reused (a warning names it) and is overwritten.
    """

    def __init__(self, root: str | Path, settings: dict):
        self.root = Path(root)
        self.settings = json.loads(json.dumps(settings, sort_keys=True))
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, domain: str) -> Path:
        return self.root / f"branch-{domain}.pt"

    def load(self, domain: str) -> dict | None:
        """The finished branch of ``domain`` (``{"state", "losses"}``) or None."""
        path = self._path(domain)
        if not path.is_file():
            return None
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("settings") != self.settings:
            log.warning("branch checkpoint %s was built with other settings; training it again", path)
            return None
        return saved

    def save(self, domain: str, state: dict[str, torch.Tensor], losses: list[float]) -> None:
        """Write ``domain``'s branch atomically (temporary file, then rename)."""
        path = self._path(domain)
        tmp = path.with_suffix(".tmp")
        torch.save({"settings": self.settings, "state": {k: v.detach().cpu().clone() for k, v in state.items()},
                    "losses": losses}, tmp)
        os.replace(tmp, path)

    def digest(self) -> str:
        """Short hash of the settings (recorded with the merged checkpoint)."""
        return hashlib.sha256(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# stage 2: mix


def average_states(states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of state dicts with the same keys and shapes (float32).

    Raises:
        ValueError: no states, or keys that differ.
    """
    if not states:
        raise ValueError("nothing to average")
    keys = set(states[0])
    for s in states[1:]:
        if set(s) != keys:
            raise ValueError(f"state dicts differ in keys: {sorted(keys ^ set(s))[:5]}")
    return {k: torch.stack([s[k].float() for s in states]).mean(0) for k in states[0]}


# ---------------------------------------------------------------------------------------------
# MoE layers, whatever their architecture


class ExpertsView:
    """One MoE layer of a model, as BTX needs it.

    Attributes:
        layer: decoder/encoder layer index.
        block: the module whose input (``(..., H)``) is what the router sees.
        num_experts: E.
    """

    layer: int
    block: nn.Module
    num_experts: int

    def router_weight(self) -> torch.Tensor:
        """The router, ``(E, H)`` (live tensor or a stack)."""
        raise NotImplementedError

    def set_router(self, weight: torch.Tensor) -> None:
        """Copy ``(E, H)`` into the router."""
        raise NotImplementedError

    def router_params(self) -> list[nn.Parameter]:
        """The router's trainable parameters."""
        raise NotImplementedError

    def last_logits(self) -> torch.Tensor:
        """Router logits ``(N, E)`` of the last forward (with the graph; log-probabilities for
        routers that only record probabilities)."""
        raise NotImplementedError

    def expert_vector(self, e: int) -> torch.Tensor:
        """Expert ``e``'s weights flattened, float32 ``(P,)``."""
        raise NotImplementedError

    def forced(self, e: int) -> contextlib.AbstractContextManager:
        """Context in which every token of this layer goes through expert ``e`` only."""
        raise NotImplementedError

    def held_only(self, held: Sequence[int]) -> contextlib.AbstractContextManager:
        """Context in which the router picks its top-k among ``held`` only (the others' logits are
        ``-inf``): the sub-MoE holding ``held``."""
        raise NotImplementedError


class HFBlockView(ExpertsView):
    """A transformers MoE block with fused experts (``experts.gate_up_proj (E, 2I, H)``,
    ``experts.down_proj (E, H, I)``) and a top-k router child ``gate`` with ``weight (E, H)``
    (Mixtral, Qwen2-MoE in transformers 5)."""

    def __init__(self, layer: int, block: nn.Module):
        self.layer, self.block = layer, block
        self.experts, self.gate = block.experts, block.gate
        self.num_experts = int(self.experts.gate_up_proj.shape[0])
        self._logits: torch.Tensor | None = None
        self.gate.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self._logits = output[0]

    def router_weight(self) -> torch.Tensor:
        return self.gate.weight

    def set_router(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.gate.weight.copy_(weight.to(self.gate.weight))

    def router_params(self) -> list[nn.Parameter]:
        return [self.gate.weight]

    def last_logits(self) -> torch.Tensor:
        if self._logits is None:
            raise RuntimeError(f"MoE layer {self.layer} has not run yet")
        return self._logits

    def expert_vector(self, e: int) -> torch.Tensor:
        return torch.cat([self.experts.gate_up_proj[e].detach().float().reshape(-1),
                          self.experts.down_proj[e].detach().float().reshape(-1)])

    @contextlib.contextmanager
    def forced(self, e: int) -> Iterator[None]:
        gu, dn = self.experts.gate_up_proj, self.experts.down_proj
        saved = gu.data, dn.data
        try:  # every expert slot holds expert e; top-k weights sum to 1, so the output is expert e's
            # (contiguous copies: grouped-matmul expert kernels may not take stride-0 weights)
            gu.data = saved[0][e:e + 1].expand_as(saved[0]).contiguous()
            dn.data = saved[1][e:e + 1].expand_as(saved[1]).contiguous()
            yield
        finally:
            gu.data, dn.data = saved

    @contextlib.contextmanager
    def held_only(self, held: Sequence[int]) -> Iterator[None]:
        gate = self.gate
        mask = torch.full((self.num_experts,), float("-inf"), device=gate.weight.device)
        mask[list(held)] = 0.0
        k = min(int(gate.top_k), len(held))

        def forward(hidden_states):
            x = hidden_states.reshape(-1, gate.weight.shape[1])
            logits = F.linear(x, gate.weight) + mask.to(x.dtype)
            probs = torch.softmax(logits.float(), dim=-1)
            top, idx = torch.topk(probs, k, dim=-1)
            top = top / top.sum(-1, keepdim=True)  # both families renormalise (see upcycle_hf)
            return logits, top.to(logits.dtype), idx

        gate.forward = forward
        try:
            yield
        finally:
            del gate.forward


class SparseBlockView(ExpertsView):
    """Our :class:`~.moe.SparseMoeBlock` (router rows keyed by global expert id, ``ExpertFFN``
    experts ``fc1``/``fc2``), holding experts ``0..E-1``."""

    def __init__(self, block: SparseMoeBlock):
        self.layer, self.block = block.layer, block
        self.num_experts = len(block.expert_ids)
        if block.expert_ids != list(range(self.num_experts)):
            raise ValueError(f"MoE layer {block.layer} holds experts {block.expert_ids}, not 0..E-1")

    def router_weight(self) -> torch.Tensor:
        return self.block.router.weight()

    def set_router(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            for e in range(self.num_experts):
                self.block.router.rows[str(e)].copy_(weight[e])

    def router_params(self) -> list[nn.Parameter]:
        return [self.block.router.rows[str(e)] for e in range(self.num_experts)]

    def last_logits(self) -> torch.Tensor:
        if self.block.last is None:
            raise RuntimeError(f"MoE layer {self.layer} has not run yet")
        return self.block.last.probs.clamp_min(1e-30).log()

    def expert_vector(self, e: int) -> torch.Tensor:
        expert = self.block.experts[str(e)]  # its base weights (LoRA adapters, when wrapped, are not the expert)
        return torch.cat([p.detach().float().reshape(-1) for n, p in expert.named_parameters() if "lora_" not in n])

    @contextlib.contextmanager
    def forced(self, e: int) -> Iterator[None]:
        experts = self.block.experts
        saved = dict(experts.items())
        try:
            for j in range(self.num_experts):
                experts[str(j)] = saved[str(e)]
            yield
        finally:
            for j in range(self.num_experts):
                experts[str(j)] = saved[str(j)]

    @contextlib.contextmanager
    def held_only(self, held: Sequence[int]) -> Iterator[None]:
        router = self.block.router
        mask = torch.full((self.num_experts,), float("-inf"))
        mask[list(held)] = 0.0
        original = router.forward
        router.forward = lambda x: original(x) + mask.to(x)
        try:
            yield
        finally:
            del router.forward


@contextlib.contextmanager
def forced_expert(views: Sequence[ExpertsView], e: int) -> Iterator[None]:
    """Every MoE layer in ``views`` sends every token to expert ``e`` only."""
    with contextlib.ExitStack() as stack:
        for v in views:
            stack.enter_context(v.forced(e))
        yield


@contextlib.contextmanager
def held_only(views: Sequence[ExpertsView], held: dict[int, Sequence[int]]) -> Iterator[None]:
    """Each MoE layer routes among ``held[layer]`` only (a sub-MoE)."""
    with contextlib.ExitStack() as stack:
        for v in views:
            stack.enter_context(v.held_only(held[v.layer]))
        yield


# ---------------------------------------------------------------------------------------------
# stage 3: router


@torch.no_grad()
def layer_inputs(model: nn.Module, views: Sequence[ExpertsView], batches: Sequence[Batch],
                 forward: Callable[[nn.Module, Batch], object], max_tokens: int = 2048) -> dict[int, torch.Tensor]:
    """The inputs of each MoE layer over ``batches``: ``{layer: (N, H)}`` float32 on the CPU, at most
    ``max_tokens`` tokens (evenly spaced) per layer; ``forward(model, batch)`` runs the model."""
    got: dict[int, list[torch.Tensor]] = {v.layer: [] for v in views}

    def keep(layer: int):
        return lambda module, args: got[layer].append(args[0].reshape(-1, args[0].shape[-1]).float().cpu())

    hooks = [v.block.register_forward_pre_hook(keep(v.layer)) for v in views]
    try:
        model.eval()
        for b in batches:
            forward(model, b)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for layer, xs in got.items():
        x = torch.cat(xs)
        if x.shape[0] > max_tokens:
            x = x[torch.linspace(0, x.shape[0] - 1, max_tokens).long()]
        out[layer] = x
    return out


def domain_router_rows(inputs: Sequence[torch.Tensor], logit_std: float = 2.0, fit_steps: int = 200) -> torch.Tensor:
    """Router rows from the domains (BTX's initial guess that expert ``e`` serves domain ``e``).

    Row ``e`` starts as the direction of domain ``e``'s mean layer input away from the mean of the
    domain means, ``u_e = (mu_e - mean_d mu_d) / ||...||``, scaled so that the logits ``x · u_e`` over
    all the domains' tokens have standard deviation ``logit_std``. Mean directions alone tell the
    domains' *tokens* apart poorly (most tokens of a news article are not about its category), so
    the rows are then fitted for ``fit_steps`` full-batch Adam steps (lr 0.01) as a softmax
    regression of each token's domain on its layer input (cross-entropy, the router's own
    ``softmax(x W^T)``; 0 steps: the scaled means).

    Args:
        inputs: per domain ``e`` (= expert ``e``), its tokens' layer inputs ``(N_e, H)``.

    Returns:
        ``(E, H)`` float32.

    Raises:
        ValueError: fewer than two domains or a domain without tokens.
    """
    if len(inputs) < 2 or any(x.shape[0] == 0 for x in inputs):
        raise ValueError("need at least two domains, each with tokens")
    mus = torch.stack([x.float().mean(0) for x in inputs])
    u = mus - mus.mean(0, keepdim=True)
    u = u / u.norm(dim=1, keepdim=True).clamp_min(1e-12)
    x = torch.cat([t.float() for t in inputs])
    w = u * (logit_std / (x @ u.t()).std().clamp_min(1e-12))
    if fit_steps > 0:
        y = torch.cat([torch.full((t.shape[0],), e, dtype=torch.long) for e, t in enumerate(inputs)])
        w = w.clone().requires_grad_(True)
        opt = torch.optim.Adam([w], lr=0.01)
        with torch.enable_grad():
            for _ in range(fit_steps):
                loss = F.cross_entropy(x @ w.t(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        w = w.detach()
    return w


def top1_affinity(views: Sequence[ExpertsView], run: Callable[[], object]) -> dict[int, torch.Tensor]:
    """Share of the tokens whose top-1 expert is each expert, per MoE layer, over one call of
    ``run()`` (a forward pass): ``{layer: (E,)}`` summing to 1."""
    run()
    out = {}
    for v in views:
        top1 = v.last_logits().detach().argmax(-1)
        out[v.layer] = torch.bincount(top1.reshape(-1).cpu(), minlength=v.num_experts).double() / top1.numel()
    return out


def balance_loss(views: Sequence[ExpertsView], top_k: int) -> torch.Tensor:
    """Switch load-balancing loss (Fedus et al. 2022, eq. 4, top-k form, transformers'
    ``load_balancing_loss_func``) over the last forward of every MoE layer: ``E · Σ_e f_e · P_e``
    averaged over layers (1 when balanced)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = tuple(v.last_logits().float() for v in views)
    return load_balancing_loss_func(logits, views[0].num_experts, top_k) / len(views)


def train_router(model: nn.Module, views: Sequence[ExpertsView], next_batch: Callable[[], Batch], loss_fn: LossFn,
                 steps: int, lr: float, top_k: int, alpha: float = 0.01) -> list[float]:
    """BTX stage 3, router only: train the routers on the domain mixture with
    ``L = L_task + alpha · L_balance`` (:func:`balance_loss`); every other weight is frozen.

    Returns:
        The total loss of each step.
    """
    frozen = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for v in views for p in v.router_params()]
    for p in params:
        p.requires_grad_(True)

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        return loss_fn(m, b) + alpha * balance_loss(views, top_k)

    try:
        return train_steps(model, params, next_batch, loss, steps, lr, "router")
    finally:
        for p, flag in frozen.items():
            p.requires_grad_(flag)


def expert_distances(views: Sequence[ExpertsView]) -> dict[int, float]:
    """Mean relative pairwise distance of each layer's experts, ``{layer: mean over pairs i<j of
    ||w_i - w_j|| / ((||w_i|| + ||w_j||) / 2)}`` over all of an expert's weights. Copies with
    upcycling noise ``s`` (relative to each weight's std) are about ``sqrt(2)·s`` apart."""
    out = {}
    for v in views:
        ws = [v.expert_vector(e) for e in range(v.num_experts)]
        d = [float((ws[i] - ws[j]).norm() / ((ws[i].norm() + ws[j].norm()) / 2))
             for i in range(len(ws)) for j in range(i + 1, len(ws))]
        out[v.layer] = sum(d) / len(d) if d else 0.0
    return out
