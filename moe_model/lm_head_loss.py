"""A causal LM's output layer and next-token loss in one operator that never holds the
``(tokens, vocabulary)`` logits, for training programs (:mod:`moe_model.training_program`).

A training step of a causal LM keeps its logits, their log-softmax and their gradient, each
``tokens × vocabulary`` fp32: 48 MiB apiece for 256 tokens of a 49,152-token vocabulary, most
of a phone-sized device's memory plan. ``fedmoe::lm_head_loss`` computes, for each token, the
loss, whether the arg-max is the target, and already the loss's gradient with respect to the
token's hidden state, a block of the vocabulary at a time (the chunked linear cross-entropy of
Wijmans et al., 2025, "Cut Your Losses in Large-Vocabulary Language Models",
arXiv:2411.09009, §4, there on GPUs): ``∂ℓ/∂h = Σ_v p_v w_v − w_y`` with ``p = softmax(h Wᵀ)``
(Wᵀ the int8 output embedding, dequantized a block of rows at a time). The backward pass only
scales that gradient by the incoming one. The weight gets no gradient (it is a frozen base
weight).

torch computes it here (whole logits; the eager reference), the native training core in
``native/src/lm_head_loss.cpp`` (two passes over the vocabulary in blocks: the log-sum-exp,
then the probabilities' product with the weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .objectives import IGNORE

_lib = torch.library.Library("fedmoe", "FRAGMENT")
_lib.define("lm_head_loss(Tensor h, Tensor weight, Tensor scale, Tensor targets) -> (Tensor, Tensor, Tensor)")
_lib.define("lm_head_loss.out(Tensor h, Tensor weight, Tensor scale, Tensor targets, *, Tensor(a!) loss, "
            "Tensor(b!) correct, Tensor(c!) grad_h) -> (Tensor(a!), Tensor(b!), Tensor(c!))")


def _check(h: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, targets: torch.Tensor) -> None:
    if (h.dim() != 2 or weight.dim() != 2 or scale.shape != (weight.shape[0],) or weight.shape[1] != h.shape[1]
            or targets.shape != (h.shape[0],) or weight.dtype != torch.int8):
        raise ValueError(f"lm_head_loss takes h (N, H), int8 weight (V, H), scale (V,), targets (N,); got "
                         f"{tuple(h.shape)}, {weight.dtype} {tuple(weight.shape)}, {tuple(scale.shape)}, "
                         f"{tuple(targets.shape)}")


def _lm_head_loss(h, weight, scale, targets):
    _check(h, weight, scale, targets)
    valid = targets != IGNORE
    safe = targets.clamp_min(0)
    w = weight.float() * scale.unsqueeze(1)
    logits = h @ w.t()
    logp = F.log_softmax(logits, dim=-1)
    loss = -logp.gather(1, safe.unsqueeze(1)).squeeze(1) * valid
    correct = ((logits.argmax(-1) == targets) & valid).float()
    grad = (logp.exp() @ w - w.index_select(0, safe)) * valid.unsqueeze(1)
    return loss, correct, grad


def _lm_head_loss_fake(h, weight, scale, targets):
    _check(h, weight, scale, targets)
    return h.new_empty(h.shape[0]), h.new_empty(h.shape[0]), h.new_empty(h.shape)


def _lm_head_loss_out(h, weight, scale, targets, *, loss, correct, grad_h):
    for dst, src in zip((loss, correct, grad_h), _lm_head_loss(h, weight, scale, targets)):
        dst.copy_(src)
    return loss, correct, grad_h


_lib.impl("lm_head_loss", _lm_head_loss, "CompositeExplicitAutograd")
_lib.impl("lm_head_loss.out", _lm_head_loss_out, "CompositeExplicitAutograd")
torch.library.register_fake("fedmoe::lm_head_loss", _lm_head_loss_fake)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[2])


def _backward(ctx, grad_loss, grad_correct, grad_grad):
    (grad_h,) = ctx.saved_tensors
    return grad_h * grad_loss.unsqueeze(1), None, None, None


torch.library.register_autograd("fedmoe::lm_head_loss", _backward, setup_context=_setup)


def lm_head_loss(h: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss and correctness of each token through an int8 output layer.

    Args:
        h: ``(N, H)`` fp32 hidden states (the positions that predict, flattened).
        weight: ``(V, H)`` int8, the output embedding as stored; ``scale``: ``(V,)`` fp32 row
            scales (``protocol.codec.quantize_int8``: ``W = weight · scale``).
        targets: ``(N,)`` int64 next-token ids, ``moe_model.objectives.IGNORE`` where none.

    Returns:
        ``loss`` ``(N,)`` fp32 (nats, ``-log softmax(h Wᵀ)[target]``, 0 where ignored;
        differentiable in ``h``) and ``correct`` ``(N,)`` fp32 (1 where the arg-max is the
        target, else 0).

    Raises:
        ValueError: shapes or dtypes other than these.
    """
    loss, correct, _ = torch.ops.fedmoe.lm_head_loss(h, weight, scale, targets)
    return loss, correct
