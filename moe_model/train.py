"""Local training and evaluation of a sub-MoE.

The local objective is composed (docs/architecture.md "Seams"): the task loss of the model's
objective (``moe_model.objectives``: cross-entropy over classes or over next tokens)
plus the terms the assignment names, each a small callable
``term(model, batch, logits) -> scalar`` (:mod:`edge_sdk.objectives`, e.g. FedProx).
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from protocol.messages import TrainConfig

from . import objectives
from .stats import ActivationStats
from .submoe import SubMoE

log = logging.getLogger(__name__)
LOG_EVERY_S = 10.0
"""Seconds between two progress lines of :func:`train_local`."""
TermFn = Callable[[SubMoE, dict, torch.Tensor], torch.Tensor]


@dataclass
class TrainResult:
    """Outcome of local training: mean loss, steps, samples seen, wall seconds."""

    loss: float
    steps: int
    samples: int
    seconds: float


@dataclass
class EvalResult:
    """Mean cross-entropy (nats) and accuracy over ``samples`` samples; for ``causal-lm``
    both are token-weighted means over the next-token targets (``tokens`` of them) and
    accuracy is top-1 next-token accuracy."""

    loss: float
    accuracy: float
    samples: int
    tokens: int = 0

    @property
    def perplexity(self) -> float:
        """``exp(loss)`` (meaningful for ``causal-lm``; :func:`moe_model.objectives.perplexity`)."""
        return objectives.perplexity(self.loss)


def num_steps(cfg: TrainConfig, samples: int) -> int:
    """Optimizer steps of one round of local training on ``samples`` samples:
    ``ceil(local_epochs * samples / batch_size)``, capped by ``max_steps`` (the cloud
    bounds the statistics a device may report with the same count)."""
    steps = math.ceil(cfg.local_epochs * samples / cfg.batch_size)
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def _batches(items: Sequence, batch_size: int, order: list[int]):
    for i in range(0, len(order), batch_size):
        yield [items[j] for j in order[i : i + batch_size]]


def train_local(
    model: SubMoE,
    items: Sequence[tuple[Any, int]],
    cfg: TrainConfig,
    *,
    terms: Sequence[TermFn] = (),
    stats: ActivationStats | None = None,
    seed: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
    name: str = "training",
    log_every_s: float = LOG_EVERY_S,
) -> TrainResult:
    """Train the adapter state of ``model`` on ``items`` (AdamW, fresh each round).

    Steps = ``ceil(local_epochs * len(items) / batch_size)``, capped by ``max_steps``.
    While it trains it logs (INFO) one line at most every ``log_every_s`` seconds:
    ``{name}: step s/steps, loss (last step), seconds elapsed``, so a device is never
    silent through a long round; ``name`` says whose (e.g. ``dev-1 round 3``).

    Raises:
        ValueError: no training samples, or the loss became non-finite.
    """
    if not items:
        raise ValueError("no local training samples")
    params = [p for p in model.trainable().values()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = num_steps(cfg, len(items))
    rng = random.Random(seed)
    model.train()
    t0, done, seen, loss_sum = time.perf_counter(), 0, 0, 0.0
    logged = t0
    while done < steps:
        order = list(range(len(items)))
        rng.shuffle(order)
        for chunk in _batches(items, cfg.batch_size, order):
            batch, labels = model.collate(chunk)
            logits = model(batch)
            per_sample = objectives.sample_loss(model.objective, logits, labels)
            loss = per_sample.mean()
            for term in terms:
                loss = loss + term(model, batch, logits)
            if not torch.isfinite(loss):
                raise ValueError(f"non-finite training loss at step {done}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if stats is not None:
                stats.add_train(model.model.token_mask(batch), per_sample.detach(),
                                objectives.sample_correct(model.objective, logits, labels))
            done += 1
            seen += len(chunk)
            loss_sum += loss.item() * len(chunk)
            if progress is not None:
                progress(done, steps, loss.item())
            now = time.perf_counter()
            if now - logged >= log_every_s and done < steps:
                log.info("%s: step %d/%d, loss %.4f, %.0f s", name, done, steps, loss.item(), now - t0)
                logged = now
            if done >= steps:
                break
    return TrainResult(loss_sum / max(seen, 1), done, seen, time.perf_counter() - t0)


@torch.no_grad()
def evaluate(
    model: SubMoE, items: Sequence[tuple[Any, int]], batch_size: int = 32, stats: ActivationStats | None = None
) -> EvalResult:
    """Mean loss and accuracy of ``model`` on ``items`` (weighted by
    ``moe_model.objectives.sample_weight``: per sample, or per target token for
    ``causal-lm``); optionally feeds validation activation statistics. Returns zeros for an
    empty set."""
    model.eval()
    n, weight_sum, loss_sum, correct = 0, 0.0, 0.0, 0.0
    for chunk in _batches(items, batch_size, list(range(len(items)))):
        batch, labels = model.collate(chunk)
        logits = model(batch)
        w = objectives.sample_weight(model.objective, labels)
        loss_sum += float((objectives.sample_loss(model.objective, logits, labels) * w).sum())
        correct += float((objectives.sample_correct(model.objective, logits, labels) * w).sum())
        weight_sum += float(w.sum())
        n += len(chunk)
        if stats is not None:
            stats.add_validation(model.model.token_mask(batch))
    model.train()
    tokens = int(weight_sum) if model.objective == "causal-lm" else 0
    return EvalResult(loss_sum / max(weight_sum, 1.0), correct / max(weight_sum, 1.0), n, tokens)
