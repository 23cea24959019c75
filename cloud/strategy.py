"""What the round engine hands to strategies, and how strategies are registered.

A federated method is one :class:`cloud.strategies.Strategy` object (in the spirit of
Flower's ``Strategy``), chosen by name in the aggregator's config: it configures each
round (experts, objective terms, extra tensors, training overrides per device), answers
a device's refusal, aggregates, and evaluates. Most methods are composed from parts: an
assignment strategy maps devices (their stats, budgets) to per-layer expert sets; an
aggregation strategy maps the global adapter state and the accepted updates to the next
global state. Failures and dropouts are inputs, never exceptions. A new paper is a new
module in ``cloud/strategies/``, ``cloud/assignment/`` or ``cloud/aggregation/`` (or a
third-party package's entry point; :mod:`protocol.plugins`, docs/extending.md), never a
branch inside the engine.

An assignment is an :class:`~protocol.experts.Experts` (MoE layer index -> sorted global
expert ids, re-exported here); strategies may return plain ``dict[int, list[int]]`` of
that shape, the engine validates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from protocol import plugins
from protocol.experts import Experts
from protocol.messages import PROTOCOL_MINOR, Objective, Stats, TrainConfig


@dataclass
class DeviceView:
    """A device as an assignment strategy sees it.

    Attributes:
        capacity: experts per MoE layer its memory budget holds (from
            ``moe_model.budget``), 0..E.
        memory: bytes this device needs to train a given assignment (the same memory
            model the device checks its assignment with); compare with ``budget_bytes``.
        last_stats: its most recent accepted statistics, if any.
        previous: its assignment in the last round it took part in, if any.
        protocol_minor: the minor protocol version its hello announced (objectives and
            extra tensors need :data:`protocol.messages.MIN_MINOR_FOR_EXTENSIONS`).
    """

    device_id: str
    task: str
    num_samples: int
    budget_bytes: int
    capacity: int
    memory: Callable[[Experts], int] | None = None
    last_stats: Stats | None = None
    previous: Experts | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    protocol_minor: int = PROTOCOL_MINOR


@dataclass
class ClientResult:
    """An accepted update: the device's trained adapter state and its statistics.

    ``state`` holds exactly the keys of ``experts``, the backbone and the task's head.
    """

    device_id: str
    task: str
    num_samples: int
    experts: Experts
    state: dict[str, torch.Tensor]
    stats: Stats
    lora_rank: int | None = None
    """The LoRA rank the device trained where below the model's (``min_lora_rank``); its
    ``state`` arrives padded to the model's rank (``moe_model.ranks.pad_rank``)."""


@dataclass
class Failure:
    """A selected device whose update was not accepted this round, and why."""

    device_id: str
    reason: str


@dataclass
class Plan:
    """An assignment strategy's answer for one round.

    Attributes:
        assignments: device -> experts; devices left out do not train this round.
        info: anything worth recording in the round record; ``info["status"]`` becomes
            the record's ``assignment_status`` (e.g. solver status, fallbacks).
        train: device -> overrides of the round's ``TrainConfig`` fields for that device
            (e.g. a short probe: ``{"max_steps": 5}``).
        excluded: device -> why the strategy left it out (sent to the device and kept
            in the round record; the engine words a default for devices left out
            without one).
        objectives: device -> terms added to its local objective (protocol minor 2).
        tensors: device -> named extra tensors sent with its adapter state (names
            ``namespace.name``, :data:`protocol.messages.ExtraName`; float32 or int64;
            protocol minor 2), e.g. a global routing distribution its objective uses.
    """

    assignments: dict[str, Experts]
    info: dict[str, Any] = field(default_factory=dict)
    train: dict[str, dict[str, Any]] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    objectives: dict[str, list[Objective]] = field(default_factory=dict)
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


@dataclass
class Aggregated:
    """A strategy's aggregation result for one round.

    Attributes:
        state: the next global adapter state (the keys and shapes of the current one).
        owned: the strategy's own tensors in the global model after this round
            (:attr:`cloud.global_model.GlobalModel.owned`; None: unchanged), e.g. a gate
            or a global routing distribution; persisted with the global state.
        metrics: JSON-serialisable figures for the round record (``strategy_metrics``).
    """

    state: dict[str, torch.Tensor]
    owned: dict[str, torch.Tensor] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class Setup:
    """What a strategy is built with (from the aggregator config).

    Attributes:
        layers: MoE layer indices.
        num_experts: E per MoE layer.
        seed: for any randomness (restarts reproduce the same choices).
        train: the federation's training configuration.
        tasks: task -> class labels.
        assignment, aggregation: the configured parts, ``(name, params)``; composed
            strategies build them (:class:`cloud.strategies.Composed`).
        reserved: task -> labelled items ``(input, label id)`` that only the cloud holds
            (Fed-MoE's server-reserved set D^r, :mod:`cloud.strategies.fusion`); disjoint
            from every device's data and never sent to a device.
    """

    layers: list[int]
    num_experts: int
    seed: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    tasks: dict[str, list[str]] = field(default_factory=dict)
    assignment: tuple[str, dict[str, Any]] = ("random_kept", {})
    aggregation: tuple[str, dict[str, Any]] = ("modular", {})
    reserved: dict[str, list] = field(default_factory=dict)


class Registered(plugins.Registered):
    """Base of the cloud's kinds of strategy (:class:`protocol.plugins.Registered`: a
    subclass with a ``name`` registers itself), with state kept between rounds."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state to persist between rounds (default: none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
