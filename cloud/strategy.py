"""What the round engine hands to strategies, and how strategies are registered.

Strategies are small objects chosen by name in the aggregator's config (in the
spirit of Flower's ``Strategy``): an assignment strategy maps devices (their stats,
budgets) to per-layer expert sets; an aggregation strategy maps the global adapter
state and the accepted updates to the next global state. Failures and dropouts are
inputs, never exceptions. A new paper is a new module in ``cloud/assignment/`` or
``cloud/aggregation/``, never a branch inside the engine.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from protocol.messages import Stats

Experts = dict[int, list[int]]
"""MoE layer index -> sorted global expert ids."""


@dataclass
class DeviceView:
    """A device as an assignment strategy sees it.

    Attributes:
        capacity: experts per MoE layer its memory budget holds (from
            ``edge_sdk.budget``), 0..E.
        memory: bytes this device needs to train a given assignment (the same memory
            model the device checks its assignment with); compare with ``budget_bytes``.
        last_stats: its most recent accepted statistics, if any.
        previous: its assignment in the last round it took part in, if any.
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
    """

    assignments: dict[str, Experts]
    info: dict[str, Any] = field(default_factory=dict)
    train: dict[str, dict[str, Any]] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)


class Registered:
    """Base of strategy families: subclasses with a ``name`` register themselves."""

    name: ClassVar[str] = ""
    _registry: ClassVar[dict[str, type]]
    _package: ClassVar[str]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "_registry" in cls.__dict__:
            return
        if cls.name:
            cls._registry[cls.name] = cls

    @classmethod
    def lookup(cls, name: str) -> type:
        """The strategy class registered as ``name``.

        Raises:
            KeyError: unknown name (the message lists the known ones).
        """
        pkg = importlib.import_module(cls._package)
        for mod in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{cls._package}.{mod.name}")
        if name not in cls._registry:
            raise KeyError(f"unknown {cls._package.rsplit('.', 1)[-1]} strategy {name!r}; known: {sorted(cls._registry)}")
        return cls._registry[name]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state to persist between rounds (default: none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
