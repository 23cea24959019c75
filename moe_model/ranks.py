"""Heterogeneous LoRA ranks over a frozen, shared ``A`` (FFA-LoRA): a device whose memory
holds less trains rank ``r`` below the federation's rank ``R``, exactly aggregable.

With ``A`` frozen and drawn from the seed shared with the cloud (FFA-LoRA: Sun et al.
2024, "Improving LoRA in Privacy-preserving Federated Learning", arXiv:2403.12313), the
rank-``r`` draw of a module's ``A`` is the first ``r`` rows of its rank-``R`` draw
(``moe_model.submoe.lora_a_init`` fills rows in order). A rank-``r`` device therefore
trains the first ``r`` columns of the global ``B`` (``(out, R)``) and leaves the others as
they are; with the scaling ``alpha / R`` on every device (:func:`spec_at_rank`), its
weight update is

    ΔW_i = (alpha / R) · B_i' · A,   B_i' = [B_i | B[:, r_i:]]   (B_i: (out, r_i))

so the FedAvg of the padded ``B_i'`` gives exactly the sample-weighted average of the
devices' ΔW_i (:func:`pad_rank`): no SVD, no projection (contrast FlexLoRA, Bai et al.
2024, arXiv:2402.11505, and HetLoRA, Cho et al. 2024, which average approximately).
With ``A`` trained as well (``lora.train_a``) this does not hold; those rules are not
built.
"""

from __future__ import annotations

from typing import Any

import torch

from protocol.messages import ModelSpec

LORA_B = ".lora_B"
"""The adapter-state key part of a LoRA ``B`` factor (``(out_features, rank)``)."""


def rank_ladder(rank: int, min_rank: int) -> list[int]:
    """The ranks a device may train, highest first: ``rank``, halved while above
    ``min_rank``, then ``min_rank`` (e.g. 8, 2 -> [8, 4, 2]; 8, 3 -> [8, 4, 3]).

    Raises:
        ValueError: ``min_rank`` is not in ``[1, rank]``.
    """
    if not 1 <= min_rank <= rank:
        raise ValueError(f"the minimum LoRA rank must be in [1, {rank}], got {min_rank}")
    out = [rank]
    while out[-1] // 2 > min_rank:
        out.append(out[-1] // 2)
    if out[-1] != min_rank:
        out.append(min_rank)
    return out


def spec_at_rank(spec: ModelSpec, rank: int) -> ModelSpec:
    """``spec`` as a device of LoRA rank ``rank`` builds it: the rank, and ``alpha`` scaled by
    ``rank / spec.lora.rank`` so that the LoRA scaling ``alpha / rank`` stays the global
    model's (a device's ``B·A`` then adds to the base weight as the global one does).

    Raises:
        ValueError: ``rank`` not in ``[1, spec.lora.rank]``, or ``spec`` trains ``A``
            (``lora.train_a``: a rank-r ``A`` is then not the first rows of the global one).
    """
    full = spec.lora.rank
    if rank == full:
        return spec
    if not 1 <= rank <= full:
        raise ValueError(f"LoRA rank {rank} is outside [1, {full}] (the model's rank)")
    if spec.lora.train_a:
        raise ValueError("a LoRA rank below the model's needs a frozen, shared A (lora.train_a false)")
    lora = spec.lora.model_copy(update={"rank": int(rank), "alpha": spec.lora.alpha * rank / full})
    return spec.model_copy(update={"lora": lora})


def at_rank(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """``state`` as a rank-``rank`` device holds it: each LoRA ``B`` cut to its first
    ``rank`` columns (views, no copy); other tensors unchanged.

    Raises:
        ValueError: a ``B`` with fewer than ``rank`` columns.
    """
    out = {}
    for k, t in state.items():
        if LORA_B in k:
            if t.dim() != 2 or t.shape[1] < rank:
                raise ValueError(f"{k}: shape {tuple(t.shape)} has no {rank} rank columns")
            t = t[:, :rank]
        out[k] = t
    return out


def expected_at_rank(expected: dict[str, tuple[tuple[int, ...], Any]], rank: int
                     ) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Exact names, shapes and dtypes (``GlobalModel.expected_for``) for a rank-``rank``
    device: each LoRA ``B``'s ``(out, R)`` becomes ``(out, rank)``."""
    return {k: ((s[0], rank), d) if LORA_B in k else (s, d) for k, (s, d) in expected.items()}


def pad_rank(update: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """A rank-``rank`` device's update as a full-rank one: each LoRA ``B`` ``(out, rank)``
    followed by the columns ``rank:`` of the full-rank state it was sent (``sent``), which it
    did not train (module docstring: the FedAvg of the results is the average of ΔW).

    Raises:
        KeyError: a ``B`` of ``update`` missing from ``sent``. ValueError: shapes that do
            not fit (``update``'s ``B`` not ``(out, rank)`` of ``sent``'s ``(out, R)``).
    """
    out = {}
    for k, t in update.items():
        if LORA_B in k:
            full = sent[k]
            if t.dim() != 2 or full.dim() != 2 or t.shape != (full.shape[0], rank):
                raise ValueError(f"{k}: update {tuple(t.shape)} is not rank {rank} of {tuple(full.shape)}")
            t = torch.cat([t, full[:, rank:].to(t.dtype)], dim=1)
        out[k] = t
    return out
