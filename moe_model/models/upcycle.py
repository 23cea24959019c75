"""Sparse upcycling of a dense FFN into E experts (Komatsuzaki et al., 2022).

Each expert starts as a copy of the dense FFN plus a small Gaussian perturbation
(std = ``noise`` x the weight's own std) that breaks the symmetry between copies.
With ``noise = 0`` and top-k weights renormalised to sum to 1, the MoE layer's output
equals the dense FFN's output exactly, whatever the router says.
"""

from __future__ import annotations

import torch


def upcycle_ffn(
    dense: dict[str, torch.Tensor], num_experts: int, noise: float, generator: torch.Generator
) -> list[dict[str, torch.Tensor]]:
    """Copy one dense FFN into ``num_experts`` experts.

    Args:
        dense: the FFN's tensors by expert-local name (``fc1.weight`` ``(ffn, hidden)``,
            ``fc1.bias`` ``(ffn,)``, ``fc2.weight`` ``(hidden, ffn)``, ``fc2.bias`` ``(hidden,)``).
        num_experts: E, the number of copies.
        noise: perturbation std relative to each tensor's std (0 = exact copies).
        generator: seeded RNG, so cloud restarts upcycle identically.

    Returns:
        One state dict per expert, same names and shapes as ``dense``.
    """
    experts = []
    for _ in range(num_experts):
        sd = {}
        for name, t in dense.items():
            t = t.detach().to(torch.float32)
            if noise > 0:
                std = float(t.std()) if t.numel() > 1 else 0.0
                t = t + noise * std * torch.randn(t.shape, generator=generator)
            sd[name] = t.clone()
        experts.append(sd)
    return experts
