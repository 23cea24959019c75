"""The one small interface behind which model-specific code lives.

A :class:`ModelAdapter` knows, for one model family, how to build the (sub-)MoE
skeleton for a set of held experts, where its base weights come from, and how to
turn raw samples into a batch. Everything else in the SDK and the cloud works on
the :class:`MoEModel` it returns and finds routers and experts through
:func:`moe_model.models.moe.moe_blocks`; nothing else branches on the architecture.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterator, Sequence

import torch
from torch import nn

from protocol.messages import ModelSpec
from protocol.plugins import Registered, Registry

from .moe import MoELayer, moe_blocks


class MoEModel(nn.Module):
    """A model with sparse MoE layers, trained for one objective (``moe_model.objectives``).

    ``objective`` is ``classification`` (``forward`` returns logits ``(B, num_labels)``;
    ``head`` is the task head, an ``nn.Linear(hidden, num_labels)``, part of the adapter
    state) or ``causal-lm`` (``forward`` returns next-token logits ``(B, T, V)``; ``head``
    is None: the language-model head is a base weight). Subclasses implement
    :meth:`forward` and :meth:`token_mask`.
    """

    objective: str = "classification"

    def __init__(self) -> None:
        super().__init__()
        self.head: nn.Linear | None = None

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # pragma: no cover - interface
        """``batch`` -> logits (shape per :attr:`objective`)."""
        raise NotImplementedError

    def token_mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # pragma: no cover - interface
        """``(B, T)`` bool: which of the ``B*T`` tokens the MoE layers routed are real
        (not padding), in the row-major order the blocks flatten them."""
        raise NotImplementedError

    def finish_loading(self) -> None:
        """Called once the base weights are in place (e.g. to re-tie shared weights)."""

    def enable_gradient_checkpointing(self) -> None:
        """Turn on transformers' (non-reentrant) gradient checkpointing in every transformers
        model this model wraps (``ModelSpec.gradient_checkpointing``).

        Raises:
            ValueError: the model wraps no transformers model that supports it.
        """
        from transformers import PreTrainedModel

        found = [m for m in self.modules() if isinstance(m, PreTrainedModel) and m.supports_gradient_checkpointing]
        if not found:
            raise ValueError(f"{type(self).__name__} does not support gradient checkpointing")
        for m in found:
            if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.2
                m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def moe_blocks(self) -> dict[int, MoELayer]:
        """This model's :class:`MoELayer` modules by MoE layer index."""
        return moe_blocks(self)


class ModelAdapter(Registered, ABC):
    """Family-specific knowledge; one subclass per family, registered by ``name`` (the
    ``ModelSpec.family`` value that selects it; :class:`protocol.plugins.Registered`,
    third-party families under the entry-point group ``fedmoe.model_families``).

    Raises:
        TypeError: (at class definition) a subclass sets ``family`` instead of ``name``.
    """

    registry: ClassVar[Registry] = Registry("model family", "fedmoe.model_families", "moe_model.models")
    full_finetune: ClassVar[bool] = False
    """True: every parameter trains and is the adapter state (tiny models); False: LoRA."""
    attention_targets: ClassVar[tuple[str, ...]] = ()
    """Names of the non-expert linear modules LoRA adapts (when ``lora.attention``)."""
    tokenizer_bytes: ClassVar[int] = 0
    """Resident bytes its tokenizer adds once loaded (the memory plan counts them; see
    :meth:`tokenizer_bytes_for`)."""

    quantized_backbone: ClassVar[bool] = False
    """True: the device holds the backbone's linears and embedding tables in the shard's
    format too (``QuantLinear`` / ``QuantEmbedding``, dequantized per matmul or per looked-up
    row; an output layer tied to the table dequantizes it a block of rows at a time), not in
    fp32; False: the backbone is dequantized to fp32 on load."""
    expert_overhead: ClassVar[int] = 32 * 1024
    """Bytes per held expert that no tensor count shows (module objects, allocator
    fragmentation around its small LoRA tensors, gradients and optimizer state), for
    :meth:`expert_overhead_bytes`. Measured on the upcycled MiniLM (``bert-upcycled``,
    FFA-LoRA rank 8, int8 shards): peaks exceeded the tensor count by about 25 KiB per
    held expert at 768 experts (``results/memory``)."""

    def __init_subclass__(cls, **kw: Any) -> None:
        if "family" in cls.__dict__:
            raise TypeError(f"{cls.__qualname__}: a model family registers by `name = {cls.family!r}`, not `family`")
        super().__init_subclass__(**kw)

    @abstractmethod
    def moe_layers(self, spec: ModelSpec) -> list[int]:
        """Indices of the MoE layers."""

    @abstractmethod
    def build(self, spec: ModelSpec, experts: dict[int, list[int]], num_labels: int, device: Any = None) -> MoEModel:
        """Skeleton holding only ``experts`` (layer -> global ids); weights uninitialised
        when ``device='meta'``."""

    @abstractmethod
    def base_state(self, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """Base (pretrained or seeded) weights of the full MoE: every parameter of
        ``build(spec, all experts)`` except routers and the head, by parameter name."""

    def base_shards(self, spec: ModelSpec, skeleton: nn.Module) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """``(shard id, tensors)`` of the full MoE's base weights, backbone first
        (``moe_model.shards``: expert shards with expert-local names). Default: split
        :meth:`base_state`; families reading large checkpoints stream instead."""
        from ..shards import split_base

        yield from split_base(self.base_state(spec), skeleton).items()

    @abstractmethod
    def collate(self, spec: ModelSpec, items: list[tuple[Any, int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Samples ``(input, label)`` -> (batch dict, targets): labels ``(B,)`` int64 for
        ``classification``, token ids ``(B, T)`` int64 (``moe_model.objectives.IGNORE`` at
        padding) for ``causal-lm``."""

    def tokenizer_bytes_for(self, spec: ModelSpec) -> int:
        """Resident bytes ``spec``'s tokenizer adds once loaded (default :attr:`tokenizer_bytes`;
        0 without a tokenizer or base)."""
        return self.tokenizer_bytes if spec.tokenizer or spec.base else 0

    def expert_overhead_bytes(self, spec: ModelSpec) -> int:
        """Resident bytes per held expert beyond its tensors (default :attr:`expert_overhead`;
        the memory plan's ``overhead``)."""
        return self.expert_overhead

    @abstractmethod
    def activation_bytes(self, spec: ModelSpec, batch_size: int, held: Sequence[int] | None = None) -> int:
        """Estimated bytes a training step holds above the model: activations kept for
        backward and the step's scratch (with ``spec.gradient_checkpointing`` where the
        family supports it). ``held``: experts held in each MoE layer (a layer holding
        fewer than ``top_k`` routes each token through fewer); ``top_k`` each when None."""


def get_adapter(family: str) -> ModelAdapter:
    """An adapter of the model family registered as ``family`` (``ModelSpec.family``).

    Raises:
        protocol.plugins.UnknownNameError: unknown family (a KeyError and a ValueError;
            suggests near misses, lists the known ones).
    """
    return ModelAdapter.lookup(family)()


def trains_all_weights(spec: ModelSpec) -> bool:
    """Whether every weight trains (no LoRA) for ``spec``: its ``full_finetune`` switch,
    else the family's default (``ModelAdapter.full_finetune``)."""
    if spec.full_finetune is not None:
        return spec.full_finetune
    return get_adapter(spec.family).full_finetune


def all_experts(adapter: ModelAdapter, spec: ModelSpec) -> dict[int, list[int]]:
    """The full-MoE assignment: every layer holds every expert."""
    return {layer: list(range(spec.num_experts)) for layer in adapter.moe_layers(spec)}
