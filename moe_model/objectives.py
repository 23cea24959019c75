"""Task objectives a sub-MoE trains for: per-sample loss, correctness and weight.

- ``classification``: model output = logits ``(B, C)``, targets = class ids ``(B,)`` int64;
  loss = cross-entropy, correct = argmax hit, weight 1 per sample.
- ``causal-lm``: model output = next-token logits ``(B, T, V)``, targets = token ids
  ``(B, T)`` int64 with :data:`IGNORE` at padding; the logits at position t predict the
  target at t + 1. Loss = mean next-token cross-entropy of the sample's real tokens,
  correct = the fraction of them predicted exactly (top-1), weight = their count, so a
  weighted mean over samples is the token-level mean and ``exp`` of it the perplexity.

Both return float32 ``(B,)`` tensors; the loss keeps its graph.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

IGNORE = -100
"""Target id of positions that carry no loss (padding)."""
Objective = Literal["classification", "causal-lm"]
OBJECTIVES: tuple[str, ...] = ("classification", "causal-lm")


def _next_token(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"causal-lm needs logits (B, T, V) and targets (B, T), got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    shifted = targets[:, 1:]
    valid = shifted != IGNORE
    tok_loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), shifted.clamp_min(0), reduction="none")
    return tok_loss * valid, valid, shifted


def sample_loss(objective: str, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample loss ``(B,)`` (nats; mean over the sample's target tokens for ``causal-lm``).

    Raises:
        ValueError: unknown objective or shapes that do not fit it.
    """
    if objective == "classification":
        return F.cross_entropy(out.float(), targets, reduction="none")
    if objective == "causal-lm":
        tok_loss, valid, _ = _next_token(out, targets)
        return tok_loss.sum(1) / valid.sum(1).clamp_min(1)
    raise ValueError(f"unknown objective {objective!r}; known: {OBJECTIVES}")


@torch.no_grad()
def sample_correct(objective: str, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample accuracy ``(B,)`` float32 in [0, 1] (fraction of next tokens for ``causal-lm``)."""
    if objective == "causal-lm":
        _, valid, shifted = _next_token(out, targets)
        hit = (out[:, :-1].argmax(-1) == shifted) & valid
        return hit.sum(1).float() / valid.sum(1).clamp_min(1).float()
    return (out.argmax(-1) == targets).float()


def sample_weight(objective: str, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample weight ``(B,)`` float32: 1, or the number of target tokens for ``causal-lm``."""
    if objective == "causal-lm":
        return (targets[:, 1:] != IGNORE).sum(1).float()
    return torch.ones(targets.shape[0])


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean next-token loss in nats, the loss capped at 700 so the result
    stays a finite float (JSON stores reject infinity)."""
    return math.exp(min(loss, 700.0))
