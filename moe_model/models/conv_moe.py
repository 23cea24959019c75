"""``conv-moe``: the vision MoE of FLEX-MoE's experiments (Zhang et al. 2025, "FLEX-MoE: Federated Mixture-of-Experts with Load-balanced Expert Assignment", arXiv:2512.23070,
"Step 2: Local training"), small enough to train fully on a CPU.

- Shared feature extractor ψ (the backbone): two 3x3 conv + ReLU + 2x2 max-pool stages
  and a linear projection to ``hidden`` features, ``(B, C_in, H, W) -> (B, hidden)``.
- One MoE layer (layer index 0) of E small MLP experts ``hidden -> ffn -> hidden``
  (:class:`~.moe.SparseMoeBlock`, top-k); its router is the gating network G_c (keep
  it client-private with ``train.router: private``).
- Classifier: a linear head on the MoE output (no residual around the MoE layer, so the
  prediction goes through the experts as in the paper's pipeline).

Every parameter is trained (``full_finetune``): the adapter state is the whole model,
keyed ``backbone.*``, ``expert.0.{e}.*``, ``router.0.{e}``, ``head.{task}.*``. One image
is one token for the MoE statistics.

``ModelSpec.config`` keys (defaults): ``in_channels`` 1, ``image_size`` 28,
``channels`` [16, 32], ``hidden`` 64, ``ffn`` 128, ``mean`` 0.286, ``std`` 0.353
(Fashion-MNIST pixel statistics).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from protocol.messages import ModelSpec

from .base import ModelAdapter, MoEModel
from .moe import SparseMoeBlock

DEFAULTS = {"in_channels": 1, "image_size": 28, "channels": [16, 32], "hidden": 64, "ffn": 128, "mean": 0.286,
            "std": 0.353}


def _cfg(spec: ModelSpec) -> dict[str, Any]:
    cfg = {**DEFAULTS, **spec.config}
    if cfg["image_size"] % 4 or len(cfg["channels"]) != 2:
        raise ValueError("conv-moe needs an image size divisible by 4 and two conv channel counts")
    return cfg


class ConvMoEClassifier(MoEModel):
    """Conv extractor -> MoE layer -> linear head; ``forward({"pixels": (B,C,H,W)})`` -> ``(B, labels)``."""

    def __init__(self, cfg: dict[str, Any], experts: list[int], top_k: int, num_labels: int, device: Any = None):
        super().__init__()
        c1, c2 = cfg["channels"]
        side = cfg["image_size"] // 4
        with torch.device(device or "cpu"):
            self.features = nn.Sequential(
                nn.Conv2d(cfg["in_channels"], c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                nn.Linear(c2 * side * side, cfg["hidden"]), nn.ReLU(),
            )
            self.moe = SparseMoeBlock(0, cfg["hidden"], cfg["ffn"], experts, top_k, "relu")
            self.head = nn.Linear(cfg["hidden"], num_labels)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``pixels`` ``(B, C_in, H, W)`` float -> logits ``(B, num_labels)``."""
        return self.head(self.moe(self.features(batch["pixels"])))

    def token_mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """All-true ``(B, 1)`` bool: one image is one token."""
        return torch.ones(batch["pixels"].shape[0], 1, dtype=torch.bool)


class ConvMoEAdapter(ModelAdapter):
    """``name = "conv-moe"`` (images as ``(H, W)`` or ``(C, H, W)`` uint8/float arrays)."""

    name = "conv-moe"
    full_finetune = True

    def moe_layers(self, spec: ModelSpec) -> list[int]:
        """Always ``[0]`` (one MoE layer)."""
        return [0]

    def build(self, spec: ModelSpec, experts: dict[int, list[int]], num_labels: int, device: Any = None) -> MoEModel:
        """A :class:`ConvMoEClassifier` holding ``experts[0]``.

        Raises:
            ValueError: no experts for layer 0, or an invalid ``spec.config`` (image size not
                divisible by 4, not two channel counts).
        """
        if 0 not in experts:
            raise ValueError("no experts given for MoE layer 0")
        return ConvMoEClassifier(_cfg(spec), experts[0], spec.top_k, num_labels, device)

    def base_state(self, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """Seeded initial weights (``spec.seed``), every expert drawn independently."""
        torch.manual_seed(spec.seed)
        model = self.build(spec, {0: list(range(spec.num_experts))}, 2)
        return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
                if ".router." not in k and not k.startswith("head.")}

    def collate(self, spec: ModelSpec, items: list[tuple[Any, int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Images ``(H, W)`` or ``(C, H, W)`` -> ``{"pixels": (B, C, H, W) float32}`` (scaled to [0, 1]
        when the batch max exceeds 1.5, then normalised by ``mean``/``std``), labels ``(B,)`` int64."""
        cfg = _cfg(spec)
        x = np.stack([np.asarray(a) for a, _ in items]).astype(np.float32)
        if x.max(initial=0) > 1.5:
            x = x / 255.0
        if x.ndim == 3:
            x = x[:, None]
        pixels = (torch.from_numpy(x) - cfg["mean"]) / cfg["std"]
        return {"pixels": pixels}, torch.tensor([int(y) for _, y in items], dtype=torch.long)

    def activation_bytes(self, spec: ModelSpec, batch_size: int, held: Sequence[int] | None = None) -> int:
        """fp32 values kept for backward: conv maps (pre/post ReLU, pooled), features,
        and per token ``top_k`` expert hidden layers (``held`` is not used: an upper bound)."""
        cfg = _cfg(spec)
        s = cfg["image_size"]
        c1, c2 = cfg["channels"]
        per = 2.25 * c1 * s * s + 2.25 * c2 * (s // 2) ** 2 + 4 * cfg["hidden"] + 2 * spec.top_k * cfg["ffn"]
        return int(4 * batch_size * per)
