"""Hugging Face MoE language models from a local checkpoint directory (``family = "hf-moe"``).

Any causal-LM checkpoint whose MoE blocks use transformers' fused-experts layout loads
through transformers' own classes (``AutoConfig``, ``AutoModelForCausalLM``): Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GraniteMoE, PhiMoE (transformers 5.x;
docs/hf-moe-layouts.md has the per-family findings). MoE blocks are found by structure,
never by family name: a module with a child holding 3-D ``gate_up_proj (E, 2I, H)`` and
``down_proj (E, H, I)`` and ``num_experts == E`` (the experts), and a sibling owning a
``(E, H)`` weight (the router).

What changes in each block, and only there: the fused experts module is replaced by
:class:`HFExperts`, a :class:`~.moe.MoELayer` holding one :class:`GatedExpert` per *held*
expert (so a device holds only its experts, shards and LoRA are per expert, and int8/nf4
expert linears work as in every family) and called exactly as the fused module was
(``experts(hidden, top_k_index, top_k_weights)``). The block's own router keeps its
family-specific routing code (softmax or sigmoid, group-limited top-k, renormalisation,
scaling); its weight is the stack of the held experts' router rows and its expert count
is the held count, i.e. the non-held experts are masked out before routing. With every
expert held the model computes what transformers computes (tested per family). With a
subset: routers that renormalise the top-k (Mixtral, GraniteMoE, ``norm_topk_prob``)
reproduce the full model on tokens whose top-k are held; softmax routers without
renormalisation (Qwen2-MoE, OLMoE with ``norm_topk_prob=False``, DeepSeek-V2) give the
held experts the mass of the missing ones; DeepSeek group-limited routing keeps its
groups only when the held experts are whole groups (else plain top-k over the held).

Base weights stream from the checkpoint's safetensors files (``safe_open``, one tensor
at a time) into per-expert shards, with transformers' own key conversions
(``conversion_mapping``) mapping on-disk names (per-expert ``experts.{e}.w1`` or fused
``experts.gate_up_proj``) to the model's. The pretrained router rows travel in the expert
shards (``router_init``) and are the initial global router state.
"""

from __future__ import annotations

import json
import logging
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from protocol.messages import ModelSpec
from protocol.topics import parse_shard_id, shard_id

from .. import objectives
from .base import ModelAdapter, MoEModel
from .moe import MoELayer

log = logging.getLogger(__name__)
ROUTER_INIT = "router_init"
"""Expert-local name of the pretrained router row ``(H,)`` in an expert's base shard."""
ROUTER_BUFFER_PREFIX = "router_"
"""Expert-local prefix of a router's per-expert buffer (DeepSeek-V3 ``e_score_correction_bias``)."""
_EXPERT_ID = re.compile(r"\.(\d+)\.[A-Za-z0-9_]+\.weight$")
_LAYER_ID = re.compile(r"\.(\d+)\.")


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory ``path`` after checking it holds ``config.json`` and safetensors.

    Raises:
        FileNotFoundError: the directory, its ``config.json`` or any ``*.safetensors`` is missing
            (the message names the path; nothing is downloaded).
    """
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"model checkpoint directory {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model checkpoint {str(p)!r} has no config.json")
    if not any(p.glob("*.safetensors")):
        raise FileNotFoundError(f"model checkpoint {str(p)!r} has no *.safetensors weight files")
    return p


@lru_cache(maxsize=8)
def _config(path: str, overrides_json: str):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(checkpoint_dir(path)), local_files_only=True)
    for k, v in json.loads(overrides_json).items():
        setattr(cfg, k, v)
    cfg.output_router_logits = False
    return cfg


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers fused-experts module of the supported layout:
    exactly ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``, ``num_experts == E``,
    not transposed, no biases."""
    e = getattr(module, "num_experts", None)
    params = dict(module.named_parameters(recurse=False))
    if not isinstance(e, int) or set(params) != {"gate_up_proj", "down_proj"}:
        return False
    gu, dn = params["gate_up_proj"], params["down_proj"]
    return (gu.dim() == 3 and dn.dim() == 3 and gu.shape[0] == dn.shape[0] == e and gu.shape[2] == dn.shape[1]
            and gu.shape[1] == 2 * dn.shape[2] and not getattr(module, "is_transposed", False)
            and not getattr(module, "has_bias", False))


def _router_of(block: nn.Module, experts_name: str, num_experts: int) -> tuple[str, nn.Module] | None:
    """The sibling of the experts that owns an ``(E, H)`` ``weight`` (preferring one whose
    ``num_experts == E``: skips shared-expert MLPs and gates)."""
    siblings = [(n, c) for n, c in block.named_children() if n != experts_name]
    siblings.sort(key=lambda nc: getattr(nc[1], "num_experts", None) != num_experts)
    for name, child in siblings:
        w = child._parameters.get("weight")
        if w is not None and w.dim() == 2 and w.shape[0] == num_experts:
            return name, child
    return None


def find_moe_blocks(model: nn.Module) -> dict[int, tuple[str, nn.Module, str, nn.Module, nn.Module]]:
    """MoE blocks of a transformers model, by decoder-layer index.

    Returns:
        layer -> (block path, block, experts child name, experts module, router module).

    Raises:
        NotImplementedError: a block whose experts are not the supported fused layout
            (e.g. experts with biases or transposed weights) or has no router.
    """
    out = {}
    for path, block in model.named_modules():
        for name, child in block.named_children():
            if isinstance(child, HFExperts):
                out[child.layer] = (path, block, name, child, child.hf_router)
                continue
            if not (isinstance(getattr(child, "num_experts", None), int)
                    and any(p.dim() == 3 for p in child.parameters(recurse=False))):
                continue
            if not is_fused_experts(child):
                raise NotImplementedError(
                    f"{path}.{name} ({type(child).__name__}) is not the fused gate_up_proj/down_proj layout "
                    "this adapter supports")
            router = _router_of(block, name, child.num_experts)
            if router is None:
                raise NotImplementedError(f"MoE block {path} ({type(block).__name__}) has no router with an "
                                          f"({child.num_experts}, hidden) weight")
            layers = _LAYER_ID.findall(f".{path}.")
            if not layers:
                raise NotImplementedError(f"MoE block {path}: no layer index in its path")
            out[int(layers[-1])] = (path, block, name, child, router[1])
    return dict(sorted(out.items()))


class GatedExpert(nn.Module):
    """One expert of a gated-MLP MoE: ``down_proj(act(gate_proj(x)) * up_proj(x))``,
    ``(N, H) -> (N, H)``; ``gate_proj``/``up_proj`` ``(I, H)`` and ``down_proj`` ``(H, I)`` are
    rows ``[:I]``, ``[I:]`` of transformers' ``gate_up_proj[e]`` and ``down_proj[e]``.

    Buffers (base weights, not trained): ``router_init`` ``(H,)``, the checkpoint's router
    row of this expert; ``router_<name>`` ``(1,)`` per-expert router buffers.
    """

    def __init__(self, hidden: int, inter: int, act_fn: nn.Module, router_buffers: tuple[str, ...] = (),
                 device=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, device=device)
        self.up_proj = nn.Linear(hidden, inter, bias=False, device=device)
        self.down_proj = nn.Linear(inter, hidden, bias=False, device=device)
        self.act_fn = act_fn
        self.register_buffer(ROUTER_INIT, torch.zeros(hidden, device=device))
        for name in router_buffers:
            self.register_buffer(ROUTER_BUFFER_PREFIX + name, torch.zeros(1, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, H)`` -> ``(N, H)``."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class HFExperts(MoELayer):
    """The held experts of one transformers MoE block, in place of its fused experts.

    Called as the fused module is: ``(hidden (N, H), top_k_index (N, k) int64 positions
    among the held experts, top_k_weights (N, k))`` -> ``(N, H)``. Before the block's
    router runs, a hook gives it the stacked held router rows ``(n_held, H)`` (and the
    held experts' per-expert buffers); after, another keeps its logits, whose softmax is
    the recorded ``probs`` (``(N, n_held)``) of :class:`~.moe.RoutingRecord`.
    """

    def __init__(self, layer: int, hidden: int, inter: int, act_fn: nn.Module, expert_ids: list[int],
                 router: nn.Module, router_buffers: tuple[str, ...], device=None):
        super().__init__(layer, hidden, {int(e): GatedExpert(hidden, inter, act_fn, router_buffers, device)
                                         for e in expert_ids}, device=device)
        object.__setattr__(self, "hf_router", router)  # the block's child; not registered twice
        self._router_buffers = router_buffers
        self._router_dtype = router._parameters["weight"].dtype
        del router._parameters["weight"]
        for name in router_buffers:
            del router._buffers[name]
        router.register_forward_pre_hook(self._feed_router)
        router.register_forward_hook(self._keep_logits)
        self._logits: torch.Tensor | None = None

    def _feed_router(self, router: nn.Module, args: Any) -> None:
        router.weight = self.router.weight().to(self._router_dtype)
        for name in self._router_buffers:
            setattr(router, name, torch.cat([getattr(self.experts[str(e)], ROUTER_BUFFER_PREFIX + name)
                                             for e in self.expert_ids]))

    def _keep_logits(self, router: nn.Module, args: Any, output: Any) -> None:
        self._logits = output[0] if isinstance(output, tuple) else None

    def initial_router_row(self, expert: int) -> torch.Tensor | None:
        """The checkpoint's router row ``(H,)`` of a held global expert id (None while the
        base weights are not loaded: all zeros)."""
        row = getattr(self.experts[str(expert)], ROUTER_INIT)
        return None if row.is_meta or not bool(row.any()) else row

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``(N, H)``, ``(N, k)``, ``(N, k)`` -> ``(N, H)``."""
        logits, self._logits = self._logits, None
        if logits is None or logits.shape != (hidden.shape[0], len(self.expert_ids)):
            logits = torch.zeros(hidden.shape[0], len(self.expert_ids))
        return self.dispatch(hidden, top_k_index.long(), top_k_weights, F.softmax(logits.float(), dim=-1))


def _restrict(block: nn.Module, router: nn.Module, full: int, expert_ids: list[int], top_k: int) -> None:
    """Set the expert counts, top-k and routing groups of ``block`` and ``router`` for the
    held experts (``expert_ids`` sorted global ids of ``full`` experts)."""
    k = len(expert_ids)
    groups = getattr(router, "num_group", None)
    for m in (block, router):
        if getattr(m, "num_experts", None) == full:
            m.num_experts = k
        if isinstance(getattr(m, "top_k", None), int):
            m.top_k = min(top_k, k)
        if isinstance(m, nn.Linear):
            m.out_features = k
    if isinstance(groups, int) and groups > 1:
        size = full // groups
        held = sorted({e // size for e in expert_ids})
        whole = k == len(held) * size
        router.num_group = len(held) if whole else 1
        router.topk_group = min(router.topk_group, router.num_group) if whole else 1


class HFMoEModel(MoEModel):
    """A transformers MoE causal LM (``self.lm``) holding only its assigned experts.

    ``causal-lm``: ``forward(batch)`` -> next-token logits ``(B, T, V)``. ``classification``:
    mean of the last hidden states over real tokens -> ``head`` -> ``(B, num_labels)``.
    ``batch``: ``input_ids``, ``attention_mask`` int64 ``(B, T)``.
    """

    def __init__(self, lm: nn.Module, objective: str, num_labels: int, device: Any = None):
        super().__init__()
        self.lm = lm
        self.objective = objective
        if objective == "classification":
            self.head = nn.Linear(lm.config.hidden_size, num_labels, device=device)
        self.hidden_only = False
        """``causal-lm``: return the last hidden states ``(B, T, H)`` instead of the logits (a
        training program's output layer and loss are one operator: ``moe_model.lm_head_loss``)."""

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """See the class docstring."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.objective == "causal-lm" and self.hidden_only:
            return self.lm.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        if self.objective == "causal-lm":
            return self.lm(input_ids=ids, attention_mask=mask, use_cache=False).logits
        hidden = self.lm.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * m).sum(1) / m.sum(1).clamp_min(1.0))

    def token_mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``attention_mask`` as ``(B, T)`` bool."""
        return batch["attention_mask"].bool()

    def finish_loading(self) -> None:
        """Compute the buffers no checkpoint holds (rotary ``inv_freq``) with transformers' own
        initialisation, and re-tie the output embedding (``tie_word_embeddings``): to the
        input embedding's parameter, or, where the table is held quantized
        (``moe_model.quant.QuantEmbedding``), to the same stored table as a
        ``QuantLinear`` (logits dequantize it a block of rows at a time)."""
        from ..quant import QuantEmbedding

        table = self.lm.get_input_embeddings()
        tied_to_quantized = bool(getattr(self.lm.config, "tie_word_embeddings", False)) and \
            isinstance(table, QuantEmbedding)
        if tied_to_quantized:
            out = self.lm.get_output_embeddings()
            path = next(n for n, m in self.lm.named_modules() if m is out)
            parent, _, attr = path.rpartition(".")
            setattr(self.lm.get_submodule(parent) if parent else self.lm, attr, table.q)
        owners = set()
        for name, buf in list(self.lm.named_non_persistent_buffers()):
            if not buf.is_meta:  # loaded already (a quantized table's storage), not computed
                continue
            owner, _, attr = name.rpartition(".")
            module = self.lm.get_submodule(owner)
            module._buffers[attr] = torch.empty_like(buf, device="cpu")
            owners.add(owner)
        for owner in owners:
            self.lm._init_weights(self.lm.get_submodule(owner))
        if not tied_to_quantized:
            self.lm.tie_weights()


class HFMoEAdapter(ModelAdapter):
    """``family = "hf-moe"``: ``spec.base`` is a local checkpoint directory of a transformers
    MoE causal LM (config.json + safetensors, sharded or not; a tokenizer for text).

    ``spec.num_experts`` must equal the checkpoint's experts per layer; ``spec.top_k``
    replaces its ``num_experts_per_tok``; ``spec.config`` overrides config keys (tests);
    ``spec.moe_layers``, when given, must list exactly the checkpoint's MoE layers.
    """

    name = "hf-moe"
    attention_targets = ("q_proj", "v_proj")
    quantized_backbone = True
    """Attention linears, embedding table and (tied or not) output layer held in the shard
    format; norms and rotary buffers fp32."""
    tokenizer_bytes = 10 * 1024**2
    """The fixed part of :meth:`tokenizer_bytes_for`."""
    expert_overhead = 216 * 1024
    """Measured on the random-init Qwen3-MoE of ``benchmarks/peer.py`` (refitted to the
    footprint: 210-216 KiB per expert between 64, 256 and 512 held; gated experts of three
    linears, LoRA rank 8 on A and B, gradient checkpointing, int8 shards): one device-round
    holding 320 experts peaked 62 MiB further above the tensor count than one holding 64,
    about 0.24 MiB per expert, of which 34 KiB is LoRA A's kept initial draw (counted in the
    plan's ``copies``). Three linears' LoRA wrappers make 34 modules per expert (12 in
    ``bert-upcycled``)."""

    def tokenizer_bytes_for(self, spec: ModelSpec) -> int:
        """``10 MiB + 1.5 x`` the checkpoint's ``tokenizer.json`` bytes (measured footprint
        growth of a fast tokenizer: 14-16 MiB for SmolLM2's 3.5 MB file, 11-12 MiB for
        MiniLM's 0.45 MB); the fixed part alone when the file is absent (a device without
        the checkpoint's files plans before it has them)."""
        path = Path(str(spec.tokenizer or spec.base or "")) / "tokenizer.json"
        return self.tokenizer_bytes + int(1.5 * path.stat().st_size) if path.is_file() else self.tokenizer_bytes

    # ------------------------------------------------------------------ config and layout
    def config(self, spec: ModelSpec):
        """The checkpoint's transformers config with ``spec.config`` applied (cached).

        Raises:
            ValueError: no ``spec.base``. FileNotFoundError: see :func:`checkpoint_dir`.
        """
        if spec.base is None:
            raise ValueError("model family 'hf-moe' needs model.base: a local checkpoint directory")
        return _config(str(spec.base), json.dumps(spec.config, sort_keys=True))

    def _layout(self, spec: ModelSpec) -> dict[int, tuple[int, int]]:
        """MoE layer -> (experts in the checkpoint, expert intermediate size)."""
        return _layout(str(spec.base), json.dumps(spec.config, sort_keys=True))

    def moe_layers(self, spec: ModelSpec) -> list[int]:
        """Decoder layers with an MoE block in the checkpoint.

        Raises:
            ValueError: ``spec.num_experts`` differs from the checkpoint's, ``spec.moe_layers``
                lists other layers, or the checkpoint has no MoE block.
        """
        layout = self._layout(spec)
        if not layout:
            raise ValueError(f"checkpoint {spec.base!r} has no MoE block with fused experts")
        counts = {e for e, _ in layout.values()}
        if counts != {spec.num_experts}:
            raise ValueError(f"checkpoint {spec.base!r} has {sorted(counts)} experts per MoE layer; "
                             f"model.num_experts is {spec.num_experts}")
        if spec.moe_layers is not None and sorted(spec.moe_layers) != sorted(layout):
            raise ValueError(f"checkpoint {spec.base!r} has MoE layers {sorted(layout)}, not {sorted(spec.moe_layers)}")
        return sorted(layout)

    def build(self, spec: ModelSpec, experts: dict[int, list[int]], num_labels: int, device: Any = None) -> MoEModel:
        """The model holding ``experts`` (layer -> global ids) on ``device`` (``meta``: no storage).

        Raises:
            ValueError: an MoE layer without experts, unknown ids, or see :meth:`moe_layers`.
        """
        layers = self.moe_layers(spec)
        missing = [x for x in layers if not experts.get(x)]
        if missing:
            raise ValueError(f"no experts given for MoE layers {missing}")
        bad = {x: [e for e in experts[x] if not 0 <= e < spec.num_experts] for x in layers}
        if any(bad.values()):
            raise ValueError(f"expert ids out of range [0, {spec.num_experts}): {bad}")
        return HFMoEModel(_skeleton(self.config(spec), experts, spec.top_k, device), spec.objective, num_labels,
                          device)

    # ------------------------------------------------------------------ base weights
    def base_state(self, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """Every base tensor by model name (reads the whole checkpoint; the cloud uses the
        streaming :meth:`base_shards` instead)."""
        skeleton = self.build(spec, {x: list(range(spec.num_experts)) for x in self.moe_layers(spec)}, 2, "meta")
        from ..shards import join_shards

        return join_shards(skeleton, dict(self.base_shards(spec, skeleton)))

    def base_shards(self, spec: ModelSpec, skeleton: nn.Module) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """Stream ``(shard id, tensors)`` from the checkpoint: the backbone first, then each
        ``L{layer}.E{expert}`` (``gate_proj``/``up_proj`` ``(I, H)``, ``down_proj`` ``(H, I)``,
        ``router_init`` ``(H,)``, ``router_<buffer>`` ``(1,)``), fp32, read tensor by tensor with
        ``safe_open`` (never the whole checkpoint at once).

        Raises:
            FileNotFoundError: a weight file the index names is missing.
            KeyError: the checkpoint lacks a tensor the model needs.
        """
        plan = _shard_plan(spec, skeleton)
        for sid, names in plan.items():
            yield sid, _read_shard(names)

    # ------------------------------------------------------------------ data
    def collate(self, spec: ModelSpec, items: list[tuple[Any, int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Texts -> ``input_ids``/``attention_mask`` int64 ``(B, T)`` (right-padded, truncated to
        ``spec.max_seq_len``) and targets: labels ``(B,)`` (classification) or the token ids
        with ``objectives.IGNORE`` at padding ``(B, T)`` (causal-lm)."""
        tok = tokenizer(str(spec.tokenizer or spec.base))
        enc = tok([str(x) for x, _ in items], truncation=True, max_length=spec.max_seq_len, padding=True,
                  return_tensors="pt")
        batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        if spec.objective == "causal-lm":
            return batch, enc["input_ids"].masked_fill(enc["attention_mask"] == 0, objectives.IGNORE)
        return batch, torch.tensor([int(y) for _, y in items], dtype=torch.long)

    ACTIVATION_FIT = (62.0, 18.7, 12.4, 13.2)
    """Bytes per ``B·T·H`` per layer, per ``B·T·I`` per expert pass, per ``B·heads·T²`` per
    layer, per ``B·T·V`` (causal-lm logits): the RSS-era estimate's shape (10·H, 3·I·k,
    2·heads·T per token and layer in fp32, 5 logits copies) refitted to the measured
    training-step footprint of the random-init Qwen3-MoE of ``benchmarks/peer.py`` (H 384,
    I 320, V 49152, 8 layers, top-4, T 64, batch 8, int8; ``benchmarks/memory.py --model
    --experts-grid 1,8,32,64``): the layers' terms x1.56 and 3.3 logits copies, from the
    step at 1 expert per layer (1 pass) against 8-64 (4 passes). Only one (B, T) was
    measured; the footprint of those cells is within 2% of the plan."""

    def activation_bytes(self, spec: ModelSpec, batch_size: int, held: Sequence[int] | None = None) -> int:
        """Bytes a training step holds above the model (:data:`ACTIVATION_FIT`): per decoder
        layer ``62·B·T·H + 18.7·B·T·I·passes + 12.4·B·heads·T²`` (``passes`` =
        ``min(top_k, experts held)`` in the layer, ``top_k`` without ``held``), plus for
        ``causal-lm`` ``13.2·B·T·V`` at the loss's backward (logits, log-softmax, their
        gradients). With ``spec.gradient_checkpointing``: one layer's share (recomputed in
        backward) plus every layer's input ``4·L·B·T·H`` (not calibrated)."""
        cfg = self.config(spec)
        t, h = spec.max_seq_len, cfg.hidden_size
        inter = max((i for _, i in self._layout(spec).values()), default=cfg.intermediate_size)
        layers = cfg.num_hidden_layers
        per_token, per_pass, per_attention, per_logit = self.ACTIVATION_FIT
        passes = [min(spec.top_k, n) for n in held] if held else [spec.top_k] * layers
        bt = batch_size * t
        attention = per_attention * batch_size * cfg.num_attention_heads * t * t
        if spec.gradient_checkpointing:
            kept = per_token * bt * h + per_pass * bt * inter * max(passes) + attention + 4 * layers * bt * h
        else:  # a dense layer (no MoE block) counts as top_k passes, as before ``held`` was known
            passes += [spec.top_k] * max(layers - len(passes), 0)
            kept = per_token * bt * h * layers + per_pass * bt * inter * sum(passes) + attention * layers
        logits = per_logit * bt * cfg.vocab_size if spec.objective == "causal-lm" else 0
        return int(kept + logits)


# ---------------------------------------------------------------------- helpers (module level, cached)


def _skeleton(cfg, experts: dict[int, list[int]], top_k: int, device: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config(cfg)`` with each MoE block's fused experts
    replaced by :class:`HFExperts` over ``experts[layer]``."""
    from transformers import AutoModelForCausalLM

    with torch.device(device or "cpu"):
        # fp32 whatever the checkpoint's ``dtype`` (transformers 5 builds in the config's dtype,
        # bf16 for most published MoE checkpoints; shards are read as fp32 and quantized from it)
        lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for layer, (path, block, name, fused, router) in find_moe_blocks(lm).items():
        held = sorted(int(e) for e in experts.get(layer, ()))
        if not held:
            continue
        inter, hidden = fused.down_proj.shape[2], fused.down_proj.shape[1]
        buffers = tuple(n for n, b in router.named_buffers(recurse=False)
                        if b.dim() == 1 and b.shape[0] == fused.num_experts)
        new = HFExperts(layer, hidden, inter, fused.act_fn, held, router, buffers, device=device)
        setattr(block, name, new)
        _restrict(block, router, fused.num_experts, held, top_k)
    return lm


@lru_cache(maxsize=8)
def _layout(path: str, overrides_json: str) -> dict[int, tuple[int, int]]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(_config(path, overrides_json), dtype=torch.float32)
    return {layer: (fused.num_experts, fused.down_proj.shape[2])
            for layer, (_, _, _, fused, _) in find_moe_blocks(lm).items()}


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"weight file {str(f)!r} named in {index.name} is missing")
        return files
    return sorted(path.glob("*.safetensors"))


_Source = tuple[Path, str, tuple | None]
"""(file, tensor name, index into it: ``None`` whole, ``(e,)`` row e (a fused expert's
``down_proj[e]`` or a router row), ``(e, half)`` half ``0|1`` of a fused ``gate_up_proj[e]``,
``(e, "one")`` element e of an ``(E,)`` buffer as shape ``(1,)``)."""


def _read_shard(names: dict[str, _Source]) -> dict[str, torch.Tensor]:
    """One shard's tensors (fp32 where floating), in ``names``' order, each weight file
    opened once."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str, tuple | None]]] = {}
    for local, (file, name, where) in names.items():
        by_file.setdefault(file, []).append((local, name, where))
    out = {}
    for file, entries in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for local, name, where in entries:
                if where is None:
                    t = f.get_tensor(name)
                else:
                    t = f.get_slice(name)[where[0]]
                    if len(where) > 1 and where[1] in (0, 1):
                        t = t.chunk(2, dim=0)[where[1]]
                    elif len(where) > 1 and where[1] == "one":
                        t = t.reshape(1)
                out[local] = t.to(torch.float32).contiguous() if t.is_floating_point() else t.contiguous()
    return {local: out[local] for local in names}


def _shard_plan(spec: ModelSpec, skeleton: nn.Module) -> dict[str, dict[str, _Source]]:
    """Shard id -> expert-local (or backbone model) name -> where it is read from."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from safetensors import safe_open
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from ..shards import BACKBONE

    path = checkpoint_dir(str(spec.base))
    lm = skeleton.lm
    conversions = get_model_conversion_mapping(lm)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    experts_at, routers_at = {}, {}
    for layer, (p, block, name, _, router) in find_moe_blocks(lm).items():
        experts_at[f"{p}.{name}"] = layer
        routers_at.update({f"{p}.{n}": layer for n, c in block.named_children() if c is router})
    known = set(lm.state_dict(keep_vars=True))
    plan: dict[str, dict[str, _Source]] = {BACKBONE: {}}
    unused: list[str] = []
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
        for disk in names:
            model_name, pattern = rename_source_key(disk, renamings, converters)
            if model_name not in known and f"{lm.base_model_prefix}.{model_name}" in known:
                model_name = f"{lm.base_model_prefix}.{model_name}"
            owner, _, leaf = model_name.rpartition(".")
            if owner in experts_at:
                _plan_expert(plan, spec, experts_at[owner], leaf, file, disk, pattern, converters)
            elif owner in routers_at:
                _plan_router(plan, spec, routers_at[owner], leaf, file, disk)
            elif model_name in known:
                plan[BACKBONE][f"lm.{model_name}"] = (file, disk, None)
            else:
                unused.append(disk)
    if unused:
        log.info("checkpoint %s: %d tensors the model does not use (e.g. %s)", path, len(unused), unused[:3])
    lacking = sorted(n for n in (f"lm.{k}" for k in known) if ".experts." not in n and ".router.rows." not in n
                     and n not in plan[BACKBONE] and not _tied(lm, n[3:]))
    if lacking:
        raise KeyError(f"checkpoint {str(path)!r} lacks tensors {lacking[:5]} ({len(lacking)} in all)")
    return {BACKBONE: plan[BACKBONE], **{k: plan[k] for k in sorted(set(plan) - {BACKBONE}, key=parse_shard_id)}}


def _tied(lm: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` is tied to another (the output embedding of a model with
    ``tie_word_embeddings``), so the checkpoint need not hold it."""
    out = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    return bool(getattr(lm.config, "tie_word_embeddings", False)) and out is not None and name == \
        f"{next(n for n, m in lm.named_modules() if m is out)}.weight"


def _plan_expert(plan, spec, layer, leaf, file, disk, pattern, converters) -> None:
    """One on-disk expert tensor (per-expert through a converter, or fused) into the plan."""
    if pattern is not None:  # per-expert on disk: experts.{e}.w1 -> gate_up_proj half
        m = _EXPERT_ID.search(disk)
        if m is None:
            raise KeyError(f"checkpoint tensor {disk!r}: no expert index")
        e = int(m.group(1))
        conv = next(c for c in converters if pattern in c.source_patterns)
        if leaf == "gate_up_proj":
            local = ("gate_proj", "up_proj")[conv.source_patterns.index(pattern)]
        else:
            local = "down_proj"
        plan.setdefault(shard_id(layer, e), {})[f"{local}.weight"] = (file, disk, None)
        return
    for e in range(spec.num_experts):  # fused on disk
        sid = shard_id(layer, e)
        if leaf == "gate_up_proj":
            plan.setdefault(sid, {})["gate_proj.weight"] = (file, disk, (e, 0))
            plan[sid]["up_proj.weight"] = (file, disk, (e, 1))
        elif leaf == "down_proj":
            plan.setdefault(sid, {})["down_proj.weight"] = (file, disk, (e,))
        else:
            raise KeyError(f"checkpoint tensor {disk!r}: unknown fused expert tensor {leaf!r}")


def _plan_router(plan, spec, layer, leaf, file, disk) -> None:
    """The router weight ``(E, H)`` -> each expert's ``router_init``; an ``(E,)`` buffer ->
    ``router_<name>``."""
    for e in range(spec.num_experts):
        sid = shard_id(layer, e)
        if leaf == "weight":
            plan.setdefault(sid, {})[ROUTER_INIT] = (file, disk, (e,))
        else:
            plan.setdefault(sid, {})[ROUTER_BUFFER_PREFIX + leaf] = (file, disk, (e, "one"))


@lru_cache(maxsize=4)
def tokenizer(name: str):
    """The (cached) tokenizer of a checkpoint directory, with ``pad = eos`` when it has no
    pad token. Raises FileNotFoundError when the directory holds no tokenizer."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"no tokenizer in {name!r}: {e}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def checkpoint_model(path: str | Path) -> dict[str, Any]:
    """The ``ModelSpec`` fields that point a federation at a checkpoint directory (what
    ``--model PATH`` sets): ``family="hf-moe"``, ``base`` (absolute path), ``tokenizer=None``
    (the checkpoint's own), ``num_experts`` and ``top_k`` (``num_experts_per_tok``) of the
    checkpoint.

    Raises:
        FileNotFoundError: see :func:`checkpoint_dir`. ValueError: no MoE block, or MoE
            layers with different expert counts.
    """
    base = str(checkpoint_dir(path).resolve())
    layout = _layout(base, "{}")
    counts = {e for e, _ in layout.values()}
    if not counts:
        raise ValueError(f"checkpoint {base!r} has no MoE block with fused experts")
    if len(counts) > 1:
        raise ValueError(f"checkpoint {base!r}: MoE layers with different expert counts {sorted(counts)}")
    num_experts = counts.pop()
    top_k = int(getattr(_config(base, "{}"), "num_experts_per_tok", 2) or 2)
    return {"family": HFMoEAdapter.name, "base": base, "tokenizer": None, "num_experts": num_experts,
            "top_k": min(top_k, num_experts)}
