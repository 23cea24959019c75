"""``hlora``: the heterogeneous-rank LoRA aggregation of NVIDIA FLARE's HLoRA example
(NVIDIA/NVFlare ``examples/advanced/medgemma/custom_aggregators.py``): the same result as
:mod:`flexlora` (the truncated SVD of the weighted mean of the devices' ``B_i A_i``, per LoRA
module) computed without the ``(out, in)`` matrix: the scaled ``B_i`` and the ``A_i`` are
stacked, a QR of each stack leaves a ``(Σr_i, Σr_i)`` core, and its SVD gives the global
factors (``moe_model.ranks.stacked_factors``). It needs every update at once (it keeps the
factors, ``Σ r_i (out + in)`` values per module, instead of FlexLoRA's ``out · in`` sums), so it
does not decompose into running sums and runs on the coordinator. Other tensors as
:mod:`modular`.
"""

from __future__ import annotations

import torch

from moe_model.ranks import lora_pairs, spectrum_summary, stacked_factors
from protocol import keys

from ..strategy import ClientResult, Failure
from .base import RoundSums
from .flexlora import FlexLoRA
from .modular import Modular


class HLoRA(FlexLoRA):
    """HLoRA (module docstring): per LoRA module, the QR + SVD of the stacked, weighted factors."""

    name = "hlora"
    decomposes = False

    def fold(self, sums: RoundSums, result: ClientResult) -> None:
        raise NotImplementedError("aggregation 'hlora' needs every update at once (it does not decompose)")

    def aggregate(self, round: int, global_state: dict[str, torch.Tensor], results: list[ClientResult],
                  failures: list[Failure]) -> dict[str, torch.Tensor]:
        """:class:`Modular`'s mean for tensors outside LoRA pairs; per LoRA module held by some
        result, :func:`moe_model.ranks.stacked_factors` of the holders' ``(B_i, A_i)`` with
        their weights, at the rank of the global ``A``."""
        sums = RoundSums()
        stacks: dict[str, tuple[list[float], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        for r in results:
            for prefix, (a, b) in self.fold_unpaired(sums, r).items():
                w = self.weight(r, keys.parse(b))
                if w > 0:
                    ws, fs = stacks.setdefault(prefix, ([], []))
                    ws.append(w)
                    fs.append((r.state[b].to(torch.float64), r.state[a].to(torch.float64)))
        out = Modular.finish(self, global_state, sums)
        spectra, rank = [], 0
        for prefix, (a, b) in lora_pairs(global_state).items():
            if prefix in stacks:
                rank = global_state[a].shape[0]
                new_b, new_a, s = stacked_factors(*stacks[prefix], rank)
                out[b], out[a] = new_b.to(global_state[b].dtype), new_a.to(global_state[a].dtype)
                spectra.append(s)
        self._spectrum = spectrum_summary(spectra, rank)
        return out
