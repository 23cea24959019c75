"""``flexlora``: FlexLoRA aggregation (Bai et al. 2024, "Federated Fine-tuning of Large
Language Models under Heterogeneous Tasks and Client Resources", arXiv:2402.11505, Sec. 3,
eqs. 3-5): for LoRA with trained ``A`` and ``B`` (``lora.train_a``), possibly of different
ranks per device (``min_lora_rank``, docs/ranks.md).

Per LoRA module, the server forms each device's full-size product ``ΔW_i = B_i A_i``,
averages them with the aggregation weights (|D_c|, over the devices that hold the module,
as :mod:`modular` does for every tensor), and factors the mean back to the global rank by
its truncated SVD (``moe_model.ranks.truncated_factors``): ``B = U_R sqrt(S_R)``, ``A =
sqrt(S_R) V_Rᵀ``. A device of rank ``r`` is then sent the first ``r`` columns of ``B`` and
rows of ``A``: the best rank-``r`` approximation of the global product, FlexLoRA's
redistribution. A lower-rank device's update arrives padded with the global factors' tail it
did not hold (``moe_model.ranks.pad_rank``), so its product counts the global part it left
unchanged. Everything else (router rows, heads) is :mod:`modular`'s weighted mean.

The running sums keep one ``(out, in)`` float64 matrix per LoRA module (``{prefix}.lora_BA``):
the memory FlexLoRA costs, which :mod:`hlora` avoids.
"""

from __future__ import annotations

import torch

from moe_model.ranks import lora_pairs, spectrum_summary, truncated_factors
from protocol import keys

from ..strategy import ClientResult
from .base import ReportsLoraSpectrum, RoundSums
from .modular import Modular

PRODUCT = ".lora_BA"
"""Suffix of a module's running sum of products ``w_i B_i A_i`` in :class:`RoundSums`."""


class FlexLoRA(ReportsLoraSpectrum, Modular):
    """FlexLoRA (module docstring): weighted mean of the devices' ``B_i A_i`` per LoRA module,
    factored back to the global rank by truncated SVD; other tensors as :class:`Modular`."""

    name = "flexlora"
    decomposes = True

    def fold_unpaired(self, sums: RoundSums, result: ClientResult) -> dict[str, tuple[str, str]]:
        """Add ``w · theta`` for each tensor of ``result`` outside a LoRA pair (``w`` =
        :meth:`weight`, |D_c|); returns its LoRA pairs (:func:`moe_model.ranks.lora_pairs`)."""
        pairs = lora_pairs(result.state)
        paired = {k for ab in pairs.values() for k in ab}
        for name, t in result.state.items():
            if name not in paired:
                sums.add(name, t, self.weight(result, keys.parse(name)))
        return pairs

    def fold(self, sums: RoundSums, result: ClientResult) -> None:
        """Add ``w · B_i A_i`` (``(out, in)``, float64) per LoRA module ``result`` holds, and
        ``w · theta`` for its other tensors (``w`` = :meth:`weight`, |D_c|)."""
        for prefix, (a, b) in self.fold_unpaired(sums, result).items():
            product = result.state[b].to(torch.float64) @ result.state[a].to(torch.float64)
            sums.add(prefix + PRODUCT, product, self.weight(result, keys.parse(b)))
        sums.devices += 1

    def finish(self, global_state: dict[str, torch.Tensor], sums: RoundSums) -> dict[str, torch.Tensor]:
        """:meth:`Modular.finish`, then each LoRA module whose products were summed: the
        truncated SVD of their weighted mean at the rank of the global ``A``."""
        out = super().finish(global_state, sums)
        spectra, rank = [], 0
        for prefix, (a, b) in lora_pairs(global_state).items():
            total = sums.weight.get(prefix + PRODUCT, 0.0)
            if total > 0:
                rank = global_state[a].shape[0]
                new_b, new_a, s = truncated_factors(sums.weighted[prefix + PRODUCT] / total, rank)
                out[b], out[a] = new_b.to(global_state[b].dtype), new_a.to(global_state[a].dtype)
                spectra.append(s)
        self._spectrum = spectrum_summary(spectra, rank)
        return out
