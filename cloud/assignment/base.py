"""The assignment-strategy interface."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

from protocol.plugins import Registry

from ..strategy import ClientResult, DeviceView, Failure, Plan, Registered


class AssignmentStrategy(Registered):
    """Maps the round's devices to per-layer expert sets.

    Args:
        layers: MoE layer indices.
        num_experts: E per layer.
        seed: for any randomness (restarts reproduce the same choices).
        **params: strategy-specific settings from the config.
    """

    registry: ClassVar[Registry] = Registry("assignment strategy", "fedmoe.assignment", "cloud.assignment")

    def __init__(self, layers: list[int], num_experts: int, seed: int = 0, **params: Any):
        if params:
            raise TypeError(f"{type(self).__name__} got unknown parameters {sorted(params)}")
        self.layers = list(layers)
        self.num_experts = num_experts
        self.seed = seed

    @abstractmethod
    def configure(self, round: int, devices: list[DeviceView]) -> Plan:
        """Choose each device's experts for ``round``; at most ``capacity`` per layer."""

    def served_experts(self) -> dict[int, list[int]] | None:
        """Layer -> expert ids when every device holds the same sub-MoE (the cloud then
        evaluates that model, not the whole MoE); None (default): devices differ."""
        return None

    def observe(self, round: int, results: list[ClientResult], failures: list[Failure]) -> None:
        """Feedback after the round closed (default: ignored)."""


def get_assignment(name: str) -> type[AssignmentStrategy]:
    """The assignment strategy class registered as ``name``.

    Raises:
        protocol.plugins.UnknownNameError: unknown name (a KeyError and a ValueError;
            suggests near misses, lists the known ones).
    """
    return AssignmentStrategy.lookup(name)
