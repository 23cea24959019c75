"""``rankwise``: rank-wise averaging of LoRA factors of heterogeneous ranks, the baseline the
SVD rules (:mod:`flexlora`, :mod:`hlora`) are measured against (docs/ranks.md).

With trained ``A`` and ``B`` and devices of different ranks (``min_lora_rank``), each rank
component ``j`` of a LoRA module (row ``j`` of ``A``, column ``j`` of ``B``) becomes the
weighted mean (weights |D_c|) over the devices whose rank covers it; a component no device
trained this round keeps its global value. ``A`` and ``B`` are averaged apart, not as
products: the zero-padding aggregation of HetLoRA (Cho et al., EMNLP 2024, "Heterogeneous LoRA
for Federated Fine-tuning of On-Device Foundation Models", Sec. 3) without its sparsity
weights, and the "rank-wise averaging" baseline of NVIDIA FLARE's HLoRA example
(``examples/advanced/medgemma``). With trained factors the mean of the factors is not the mean
of the products ``B_i A_i``, which is why it is the baseline and not the default. Tensors
outside LoRA pairs are :mod:`modular`'s weighted mean.

A lower-rank device's update arrives padded to the global rank with the tail it was sent
(``moe_model.ranks.pad_rank``); this rule reads its rank from
:attr:`cloud.strategy.ClientResult.lora_rank` and leaves that tail out. It decomposes: the
running sums hold, per factor, the masked weighted sum and a ``(R,)`` vector of the weight
each rank component received (``{factor}.rank_weight``).
"""

from __future__ import annotations

import torch

from moe_model.ranks import lora_pairs, spectrum_summary, stacked_factors
from protocol import keys

from ..strategy import ClientResult
from .base import ReportsLoraSpectrum, RoundSums
from .modular import Modular

RANK_WEIGHT = ".rank_weight"
"""Suffix of a factor's ``(R,)`` running sum of the weights its rank components received."""


class RankWise(ReportsLoraSpectrum, Modular):
    """Rank-wise averaging (module docstring): each rank component of each LoRA factor the
    weighted mean over the devices whose rank covers it; other tensors as :class:`Modular`."""

    name = "rankwise"
    decomposes = True

    def fold(self, sums: RoundSums, result: ClientResult) -> None:
        """Add ``w · theta`` per tensor of ``result`` (``w`` = :meth:`weight`, |D_c|), each
        LoRA factor with its rank components beyond ``result.lora_rank`` zeroed, and ``w`` to
        the ``(R,)`` weights of the components it trained."""
        pairs = lora_pairs(result.state)
        axis_of = {k: axis for a, b in pairs.values() for k, axis in ((a, 0), (b, 1))}
        for name, t in result.state.items():
            w = self.weight(result, keys.parse(name))
            axis = axis_of.get(name)
            if axis is None:
                sums.add(name, t, w)
                continue
            full = t.shape[axis]
            r = full if result.lora_rank is None else min(result.lora_rank, full)
            covered = torch.zeros(full, dtype=torch.float64)
            covered[:r] = 1.0
            sums.add(name, t * (covered.unsqueeze(1) if axis == 0 else covered).to(t.dtype), w)
            sums.add(name + RANK_WEIGHT, covered, w)
        sums.devices += 1

    def finish(self, global_state: dict[str, torch.Tensor], sums: RoundSums) -> dict[str, torch.Tensor]:
        """:meth:`Modular.finish` for the tensors outside LoRA pairs; each LoRA factor's rank
        component ``j`` its masked sum over the weight component ``j`` received, the global
        value where that weight is 0."""
        out = super().finish(global_state, sums)
        spectra, rank = [], 0
        for a, b in lora_pairs(global_state).values():
            if a + RANK_WEIGHT not in sums.weighted:
                continue
            for name, axis in ((a, 0), (b, 1)):
                got = sums.weighted[name + RANK_WEIGHT]
                mean = sums.weighted[name] / got.clamp(min=1e-300).unsqueeze(axis ^ 1)
                keep = (got > 0).unsqueeze(axis ^ 1)
                out[name] = torch.where(keep, mean, global_state[name].double()).to(global_state[name].dtype)
            rank = global_state[a].shape[0]
            # the aggregated product's singular values from the QR of its factors (no (out, in) matrix)
            spectra.append(stacked_factors([1.0], [(out[b].double(), out[a].double())], rank)[2])
        self._spectrum = spectrum_summary(spectra, rank)
        return out
