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

With ``A`` trained as well (``lora.train_a``) the factors do not average exactly; the
aggregation rules ``flexlora`` and ``hlora`` (``cloud.aggregation``) then average the
devices' products ``B_i A_i`` and factor the mean back to rank ``R`` by its truncated SVD
(:func:`truncated_factors`, :func:`stacked_factors`), and a rank-``r`` device is sent the
first ``r`` columns of ``B`` and rows of ``A`` (singular values descending: the best rank-``r``
approximation).
"""

from __future__ import annotations

from typing import Any

import torch

from protocol.messages import ModelSpec

LORA_B = ".lora_B"
"""The adapter-state key part of a LoRA ``B`` factor (``(out_features, rank)``)."""
LORA_A = ".lora_A"
"""The adapter-state key part of a LoRA ``A`` factor (``(rank, in_features)``; on the wire
only with ``lora.train_a``)."""


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
        ValueError: ``rank`` not in ``[1, spec.lora.rank]``.
    """
    full = spec.lora.rank
    if rank == full:
        return spec
    if not 1 <= rank <= full:
        raise ValueError(f"LoRA rank {rank} is outside [1, {full}] (the model's rank)")
    lora = spec.lora.model_copy(update={"rank": int(rank), "alpha": spec.lora.alpha * rank / full})
    return spec.model_copy(update={"lora": lora})


def at_rank(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """``state`` as a rank-``rank`` device holds it: each LoRA ``B`` cut to its first
    ``rank`` columns and each ``A`` (trained ``A`` only) to its first ``rank`` rows (views, no
    copy); other tensors unchanged.

    Raises:
        ValueError: a factor with fewer than ``rank`` rank columns or rows.
    """
    out = {}
    for k, t in state.items():
        if LORA_B in k or LORA_A in k:
            axis = 1 if LORA_B in k else 0
            if t.dim() != 2 or t.shape[axis] < rank:
                raise ValueError(f"{k}: shape {tuple(t.shape)} has no {rank} rank {'columns' if axis else 'rows'}")
            t = t[:, :rank] if axis else t[:rank]
        out[k] = t
    return out


def expected_at_rank(expected: dict[str, tuple[tuple[int, ...], Any]], rank: int
                     ) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Exact names, shapes and dtypes (``GlobalModel.expected_for``) for a rank-``rank``
    device: each LoRA ``B``'s ``(out, R)`` becomes ``(out, rank)``, each ``A``'s ``(R, in)``
    ``(rank, in)``."""
    return {k: ((s[0], rank), d) if LORA_B in k else ((rank, s[1]), d) if LORA_A in k else (s, d)
            for k, (s, d) in expected.items()}


def pad_rank(update: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """A rank-``rank`` device's update as a full-rank one: each LoRA ``B`` ``(out, rank)``
    followed by the columns ``rank:`` of the full-rank state it was sent (``sent``), each ``A``
    ``(rank, in)`` (trained ``A``) by its rows ``rank:``, which it did not train (module
    docstring: the FedAvg of the results is the average of ΔW).

    Raises:
        KeyError: a factor of ``update`` missing from ``sent``. ValueError: shapes that do
            not fit (``update``'s ``B`` not ``(out, rank)`` of ``sent``'s ``(out, R)``, or its
            ``A`` not ``(rank, in)`` of ``(R, in)``).
    """
    out = {}
    for k, t in update.items():
        if LORA_B in k or LORA_A in k:
            full = sent[k]
            axis = 1 if LORA_B in k else 0
            want = (full.shape[0], rank) if axis else (rank, full.shape[-1])
            if t.dim() != 2 or full.dim() != 2 or tuple(t.shape) != want:
                raise ValueError(f"{k}: update {tuple(t.shape)} is not rank {rank} of {tuple(full.shape)}")
            t = torch.cat([t, (full[:, rank:] if axis else full[rank:]).to(t.dtype)], dim=axis)
        out[k] = t
    return out


def lora_pairs(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """Module key prefix -> (its ``A`` key, its ``B`` key), for every module of ``state``
    that has both (trained ``A``: ``lora.train_a``)."""
    return {k[:-len(LORA_A)]: (k, k[:-len(LORA_A)] + LORA_B) for k in state
            if k.endswith(LORA_A) and k[:-len(LORA_A)] + LORA_B in state}


def truncated_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, A)`` of rank ``rank`` whose product is the best rank-``rank`` approximation of
    ``delta`` (``(out, in)``) in Frobenius norm (Eckart-Young): ``B = U_r·sqrt(S_r)`` ``(out,
    rank)``, ``A = sqrt(S_r)·V_rᵀ`` ``(rank, in)`` from its SVD, singular values descending,
    so the first ``r`` columns of ``B`` and rows of ``A`` are its best rank-``r`` factors too
    (what a rank-``r`` device is sent, :func:`at_rank`). Columns beyond ``delta``'s own rank
    are zero. The third value is every singular value of ``delta`` (descending): the spectrum
    a rank collapse shows in (:func:`spectrum_summary`)."""
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    k = min(rank, s.shape[0])
    root = s[:k].sqrt()
    b = torch.zeros(delta.shape[0], rank, dtype=delta.dtype)
    a = torch.zeros(rank, delta.shape[1], dtype=delta.dtype)
    b[:, :k], a[:k] = u[:, :k] * root, root[:, None] * vh[:k]
    return b, a, s


def stacked_factors(weights: list[float], factors: list[tuple[torch.Tensor, torch.Tensor]], rank: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`truncated_factors` of ``sum_i w_i B_i A_i / sum_i w_i`` without forming the
    ``(out, in)`` matrix: the ``B_i`` (scaled) and ``A_i`` stacked side by side give the sum
    exactly (``[w_1 B_1 ... w_n B_n] · [A_1; ...; A_n]``), a QR of each stack leaves a small
    ``(Σr_i, Σr_i)`` core, and its SVD gives the factors (the weighted-sum-then-QR+SVD of
    NVIDIA FLARE's HLoRA example, ``examples/advanced/medgemma/custom_aggregators.py``).
    ``factors`` are ``(B_i, A_i)`` pairs of any ranks; the third value is the mean product's
    singular values (those of the core).

    Raises:
        ValueError: no factors, or weights that do not sum to > 0.
    """
    total = float(sum(weights))
    if not factors or total <= 0:
        raise ValueError("stacked factors need at least one pair and weights summing to > 0")
    b_cat = torch.cat([b * (w / total) for w, (b, _) in zip(weights, factors)], dim=1)
    a_cat = torch.cat([a for _, a in factors], dim=0)
    qb, rb = torch.linalg.qr(b_cat)
    qa, ra = torch.linalg.qr(a_cat.T)
    b, a, s = truncated_factors(rb @ ra.T, rank)
    return qb @ b, a @ qa.T, s


def spectrum_summary(spectra: list[torch.Tensor], rank: int) -> dict[str, float | int]:
    """What the singular values of the aggregated LoRA products say about rank collapse, over
    the modules aggregated in a round: ``modules``; ``effective_rank``: mean count of singular
    values above 1% of the largest (at most ``rank`` survive the truncation);
    ``energy_kept``: mean share of the squared singular values within the first ``rank``
    (1.0: the truncation lost nothing); ``top_share``: mean share of the largest alone (near
    1.0: collapsed to rank one). Empty when ``spectra`` is."""
    if not spectra:
        return {}
    eff, kept, top = [], [], []
    for s in spectra:
        s2 = s.double() ** 2
        total = float(s2.sum()) or 1.0
        eff.append(int((s > 0.01 * s[0]).sum()) if s.numel() and s[0] > 0 else 0)
        kept.append(float(s2[:rank].sum()) / total)
        top.append(float(s2[:1].sum()) / total)
    n = len(spectra)
    return {"modules": n, "effective_rank": sum(eff) / n, "energy_kept": sum(kept) / n, "top_share": sum(top) / n}
