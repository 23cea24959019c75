"""The sub-MoE a device trains (docs/methods/index.md): backbone + assigned experts, LoRA.

:class:`SubMoE` builds the model skeleton on the ``meta`` device (no memory for
experts it does not hold), assigns the decoded base-shard tensors into it, injects
LoRA with peft, draws the frozen LoRA ``A`` factors from the shared seed (FFA-LoRA,
Sun et al., ICLR 2024: A frozen, only B trained, so averaging B is exact), and maps
its trainable tensors to architecture-independent adapter-state keys
(:mod:`protocol.keys`). The cloud uses the same class with every expert for
evaluation and to create the initial global adapter state, so both sides agree on
names, shapes and seeds by construction.
"""

from __future__ import annotations

import math
import zlib

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from protocol import keys
from protocol.experts import Experts
from protocol.messages import ModelSpec

from .models.base import MoEModel, get_adapter, trains_all_weights
from .notices import quiet_kernels_notice
from .quant import QuantEmbedding, QuantLinear, swap_in_quantized
from .quant_bnb import convert
from .shards import block_paths, join_shards

quiet_kernels_notice()
try:  # peft (>= 0.22) imports bitsandbytes, where installed, at its first LoRA injection: import it now,
    # so that the footprint a device measures before any model (its runtime_bytes) holds it (42 MiB with
    # bitsandbytes 0.50), not the first round's peak
    import bitsandbytes  # noqa: F401
except ImportError:
    pass

ROUTER_INIT_STD = 0.02


def key_seed(seed: int, name: str) -> int:
    """Deterministic per-name seed shared by cloud and devices."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def lora_a_init(seed: int, key: str, shape: tuple[int, int]) -> torch.Tensor:
    """The frozen LoRA ``A`` factor of adapter-state key ``key`` (FFA-LoRA, Sun et al. 2024,
    "Improving LoRA in Privacy-preserving Federated Learning", arXiv:2403.12313): fp32
    ``(rank, in_features)`` uniform in ±1/sqrt(in_features), drawn from a generator seeded by
    ``(seed, key)``, identical on every machine that runs torch."""
    gen = torch.Generator().manual_seed(key_seed(seed, key))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.rand(shape, generator=gen) * 2 * bound - bound


def _lora_name(local: str) -> str:
    """``fc1.lora_B.default.weight`` -> ``fc1.lora_B``."""
    return local.replace(".default.weight", "").replace(".default", "")


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` at parameter/buffer ``name`` without copying (frozen)."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    elif attr in mod._buffers:
        mod._buffers[attr] = tensor
    else:
        raise KeyError(f"model has no parameter or buffer {name!r}")


def _swap_module(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` in place of the module at ``path``."""
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _placeholder(model: nn.Module, path: str, q: QuantLinear) -> None:
    """Give the meta ``nn.Linear`` at ``path`` storage-free fp32 stand-ins (so peft
    injects LoRA on the CPU in fp32); :func:`swap_in_quantized` replaces it afterwards."""
    lin = model.get_submodule(path)
    if not isinstance(lin, nn.Linear) or (lin.out_features, lin.in_features) != (q.out_features, q.in_features):
        raise KeyError(f"quantized weight at {path!r} does not match the model's linear")
    lin._parameters["weight"] = nn.Parameter(torch.zeros(()).expand(q.out_features, q.in_features),
                                             requires_grad=False)
    if lin.bias is not None:
        lin._parameters["bias"] = nn.Parameter(torch.zeros(()).expand(q.out_features), requires_grad=False)


class SubMoE(nn.Module):
    """A (sub-)MoE with LoRA, whose trainable state has canonical adapter-state keys.

    Args:
        spec: the model spec from the assignment.
        experts: layer -> global expert ids held (kept as an :class:`protocol.experts.Experts`:
            int keys, sorted ids).
        task: task name (keys the head).
        num_labels: classes of the task.
        base_shards: shard id -> decoded fp32 tensors (``moe_model.shards``), where an
            expert linear may instead be a :class:`moe_model.quant.QuantLinear` under its
            module path (``fc1``): it stays quantized, LoRA wraps it; ``None`` builds a
            randomly initialised base (tests only).
        quant_backend: ``torch`` (:class:`QuantLinear`, everywhere) or ``bitsandbytes``
            (its int8/nf4 layers on the same stored weights, ``moe_model.quant_bnb``).

    Raises:
        KeyError: a needed shard or tensor is missing from ``base_shards``.
        ValueError: ``experts`` is not a valid :class:`protocol.experts.Experts`; unknown
            ``quant_backend``; ``spec.gradient_checkpointing`` for a family without it.
            ImportError: bitsandbytes missing for it.
    """

    def __init__(self, spec: ModelSpec, experts: dict[int, list[int]], task: str, num_labels: int,
                 base_shards: dict[str, dict[str, torch.Tensor]] | None, quant_backend: str = "torch"):
        super().__init__()
        self.spec = spec
        self.task = task
        self.num_labels = num_labels
        self.adapter = get_adapter(spec.family)
        self.experts = Experts(experts)
        quantized: dict[str, QuantLinear] = {}
        if base_shards is None:
            model = self.adapter.build(spec, self.experts, num_labels)
        else:
            model = self.adapter.build(spec, self.experts, num_labels, device="meta")
            for name, t in join_shards(model, base_shards).items():
                if isinstance(t, QuantLinear) and isinstance(model.get_submodule(name), nn.Embedding):
                    _swap_module(model, name, QuantEmbedding(t, model.get_submodule(name).padding_idx))
                elif isinstance(t, QuantLinear):
                    quantized[name] = t
                    _placeholder(model, name, t)
                else:
                    _assign(model, name, t)
            model.finish_loading()
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_meta and not self._is_adapter_slot(name):
                raise KeyError(f"base shards lack tensor {name!r}")
        for block in model.moe_blocks().values():
            block.router.to_empty(device="cpu")
        if model.head is not None:
            model.head.to_empty(device="cpu")
        self.model: MoEModel = model
        self.full = trains_all_weights(spec)
        if self.full and quantized:
            raise ValueError(f"full fine-tuning trains every weight and needs fp32 base shards, got "
                             f"{type(next(iter(quantized.values()))).__name__} expert linears")
        if not self.full:
            self._inject_lora()
        swap_in_quantized(self.model, convert(quantized, quant_backend))
        for p in self.model.parameters():
            p.requires_grad_(False)
        if spec.gradient_checkpointing:
            self.model.enable_gradient_checkpointing()
        self._keys = self._map_keys()
        self._initial: dict[str, torch.Tensor] = {}
        if self.full:  # own copies (shards may be shared), and the base values are the initial state
            for k, p in self._keys.items():
                p.data = p.data.clone()
                if keys.parse(k).group in ("expert", "backbone"):
                    self._initial[k] = p.detach().clone()
        elif spec.lora.train_a:  # trained A starts from its seeded draw (_inject_lora), not 0: A = B = 0 never moves
            self._initial.update({k: p.detach().clone() for k, p in self._keys.items() if ".lora_A" in k})
        for k, p in self.trainable().items():
            p.requires_grad_(True)
        self.reset_adapter_state()

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _is_adapter_slot(name: str) -> bool:
        return name.startswith("head.") or ".router.rows." in name

    def _inject_lora(self) -> None:
        lora = self.spec.lora
        linears = sorted({name.rsplit(".", 1)[-1] for block in self.model.moe_blocks().values()
                          for name, m in block.experts.named_modules() if isinstance(m, (nn.Linear, QuantLinear))})
        targets = [rf"experts\.\d+\.({'|'.join(linears)})"]
        if lora.attention:
            targets += [rf"{t}" for t in get_adapter(self.spec.family).attention_targets]
        regex = rf".*\.({'|'.join(targets)})$"
        cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=regex, bias="none")
        inject_adapter_in_model(cfg, self.model)
        paths = block_paths(self.model)  # once: a walk over every module (was one per LoRA A, quadratic in experts)
        for name, p in self.model.named_parameters():
            if ".lora_A." in name:
                with torch.no_grad():
                    p.copy_(lora_a_init(lora.seed, self._canonical(name, paths), tuple(p.shape)))

    def _canonical(self, name: str, paths: dict[str, int]) -> str | None:
        if name.startswith("head."):
            return keys.head_key(self.task, name[len("head."):])
        for path, layer in paths.items():
            if name.startswith(f"{path}.router.rows."):
                return keys.router_key(layer, int(name.rsplit(".", 1)[1]))
            if name.startswith(f"{path}.experts."):
                e, local = name[len(f"{path}.experts."):].split(".", 1)
                if self.full:
                    return keys.expert_key(layer, int(e), local)
                return keys.expert_key(layer, int(e), _lora_name(local)) if ".lora_" in local else None
        if self.full:
            return keys.backbone_key(name)
        return keys.backbone_key(_lora_name(name)) if ".lora_" in name else None

    def _map_keys(self) -> dict[str, nn.Parameter]:
        paths = block_paths(self.model)
        out: dict[str, nn.Parameter] = {}
        for name, p in self.model.named_parameters():
            key = self._canonical(name, paths)
            if key is None:
                continue
            if ".lora_A" in key and not self.spec.lora.train_a:
                continue
            out[key] = p
        return out

    # ------------------------------------------------------------------ adapter state
    def trainable(self) -> dict[str, nn.Parameter]:
        """Adapter-state key -> live parameter (LoRA B [and A], router rows, head; every
        parameter for a ``full_finetune`` family)."""
        return self._keys

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """Detached copies of the adapter state, by canonical key."""
        return {k: p.detach().clone() for k, p in self._keys.items()}

    def expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Key -> (shape, dtype) of this model's adapter state (what an update must hold)."""
        return {k: (tuple(p.shape), p.dtype) for k, p in self._keys.items()}

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy adapter-state tensors in.

        Raises:
            KeyError: ``state`` lacks a key this model holds or has one it does not.
            ValueError: a shape differs.
        """
        missing = sorted(set(self._keys) - set(state))
        extra = sorted(set(state) - set(self._keys))
        if missing or extra:
            raise KeyError(f"adapter state mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for k, p in self._keys.items():
                t = state[k]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{k}: shape {tuple(t.shape)} != {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))

    def reset_adapter_state(self) -> None:
        """Initial values, identical on every machine: LoRA B = 0, router rows from the
        checkpoint where its MoE layer has them (``MoELayer.initial_router_row``), else
        N(0, 0.02²), head like ``nn.Linear`` (uniform ±1/sqrt(hidden), bias 0), each
        drawn from a generator seeded by ``(spec.seed, key)``."""
        blocks = self.model.moe_blocks()
        with torch.no_grad():
            for k, p in self._keys.items():
                gen = torch.Generator().manual_seed(key_seed(self.spec.seed, k))
                kind = keys.parse(k)
                if k in self._initial:
                    p.copy_(self._initial[k])
                elif kind.group == "router":
                    row = blocks[kind.layer].initial_router_row(kind.expert)
                    p.copy_(row if row is not None else torch.randn(p.shape, generator=gen) * ROUTER_INIT_STD)
                elif kind.group == "head" and kind.path == "weight":
                    bound = 1.0 / math.sqrt(p.shape[1])
                    p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
                else:
                    p.zero_()

    # ------------------------------------------------------------------ forward
    @property
    def objective(self) -> str:
        """The model's objective (``moe_model.objectives``): ``classification`` or ``causal-lm``."""
        return self.model.objective

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``batch`` -> logits: ``(B, num_labels)`` (classification) or ``(B, T, V)`` (causal-lm)."""
        return self.model(batch)

    def collate(self, items):
        """Samples ``[(input, label), ...]`` -> ``(batch, labels)`` by the family's adapter; labels
        ``(B,)`` int64. ``batch``: ``bert-upcycled`` ``input_ids``/``attention_mask`` int64 ``(B, T)``
        (``T <= max_seq_len``); ``conv-moe`` ``pixels`` float32 ``(B, C, H, W)``."""
        return self.adapter.collate(self.spec, items)

    def num_base_bytes(self) -> int:
        """Bytes of the base weights held in memory (fp32, or quantized expert linears
        as stored; stride-0 stand-ins count nothing)."""
        seen, total = set(), 0
        for t in [p for p in self.model.parameters() if not p.requires_grad] + list(self.model.buffers()):
            if t is None or id(t) in seen or (t.dim() and 0 in t.stride()):
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size()
        return total
