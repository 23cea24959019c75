"""The objective-term interface and registry (device side)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from protocol.messages import Objective, TrainConfig
from protocol.plugins import Registered, Registry


@dataclass
class TermContext:
    """What a term may use besides the model and the batch.

    Attributes:
        start_state: the adapter state the round started from (name -> tensor, the
            cloud's global state for what this device holds). Read-only: it is the
            device's own reference copy (the update's delta is taken against it), shared
            with the terms rather than copied, so a term adds no adapter-sized copy to the
            round's memory (``moe_model.budget.MemoryPlan.copies`` counts one).
        tensors: the round's named extra tensors (``Assignment.tensors``), e.g. a global
            routing distribution; name -> tensor of the announced shape.
        train: the round's training configuration.
        memory: the device's per-term memory across rounds (term name -> dict; in RAM,
            lost when the device restarts), e.g. a client-private router.
        val_items: the local validation samples ``(input, label id)`` (stay on the device).
    """

    start_state: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: dict[str, dict] = field(default_factory=dict)
    val_items: list = field(default_factory=list)


class ObjectiveTerm(Registered):
    """One term of the local objective, or a step of local training the cloud switches on.

    A subclass with a ``name`` registers itself (:class:`protocol.plugins.Registered`;
    third-party terms under the entry-point group ``fedmoe.objectives``). It is built once per round with the
    cloud's parameters and the :class:`TermContext`; :meth:`before_training` runs once the
    round's state is loaded, the term is called once per training step (when
    ``adds_loss``), :meth:`after_training` runs after local validation, before the update
    is taken; it may report statistics (sent up in ``Stats.extras`` as ``{name}.{key}``).

    Args:
        params: the ``Objective.params`` the cloud sent.
        ctx: the round's context.

    Raises:
        ValueError: unknown or invalid parameters, or a tensor the term needs is missing
            from ``ctx.tensors`` (the device then refuses the round with the reason).
    """

    registry: ClassVar[Registry] = Registry("objective term", "fedmoe.objectives", "edge_sdk.objectives")
    adds_loss: ClassVar[bool] = True
    """False for terms that only act before/after training (no per-step value)."""

    def __init__(self, params: dict[str, Any], ctx: TermContext):
        self.params, self.ctx = dict(params), ctx

    @property
    def memory(self) -> dict:
        """This term's memory across rounds on this device (:attr:`TermContext.memory`)."""
        return self.ctx.memory.setdefault(self.name, {})

    def before_training(self, model: Any) -> None:
        """Called with the :class:`moe_model.submoe.SubMoE` once the cloud's state is loaded."""

    def after_training(self, model: Any) -> None:
        """Called with the trained model after local validation, before the update is taken."""

    def param(self, key: str, default: float | None = None, lo: float = -math.inf, hi: float = math.inf) -> float:
        """A numeric parameter within ``[lo, hi]`` (``default`` when absent and given).

        Raises:
            ValueError: missing without default, not a number, or out of range.
        """
        value = self.params.get(key, default)
        if value is None or isinstance(value, (bool, str)) or not lo <= float(value) <= hi:
            raise ValueError(f"objective {self.name!r}: parameter {key!r} must be a number in [{lo}, {hi}], "
                             f"got {value!r}")
        return float(value)

    def __call__(self, model: Any, batch: dict, logits: torch.Tensor) -> torch.Tensor:
        """The term's value for one training step (a scalar tensor with a graph).

        Args:
            model: the :class:`moe_model.submoe.SubMoE` being trained.
            batch: the collated batch.
            logits: the model's output for it, (batch, labels).
        """
        raise NotImplementedError

    def statistics(self) -> dict[str, list[float]]:
        """Finite values to report after training, key -> values (default: none)."""
        return {}


def check_objectives(objectives: Sequence[Objective]) -> None:
    """Fail fast, before a round is accepted, on objectives this device cannot run.

    Raises:
        ValueError: an unknown term name (:class:`protocol.plugins.UnknownNameError`: it
            suggests near misses and lists the known ones) or a term named twice.
    """
    names = [o.name for o in objectives]
    for n in names:
        ObjectiveTerm.lookup(n)
    if len(set(names)) != len(names):
        raise ValueError(f"objective terms named twice: {names}")


def terms_for(train: TrainConfig, objectives: Sequence[Objective], start_state: dict[str, torch.Tensor],
              tensors: dict[str, torch.Tensor] | None = None, memory: dict[str, dict] | None = None,
              val_items: list | None = None) -> list[ObjectiveTerm]:
    """The round's terms: ``fedprox`` when ``train.prox_mu > 0`` and ``private_router``
    when ``train.router == "private"`` (the pre-minor-2 ways to ask for them), then each
    of ``objectives`` in order.

    Args:
        start_state: the round's starting adapter state, shared read-only with the terms
            (not copied: the plan counts the device's one reference copy).
        memory: the device's per-term memory (:attr:`TermContext.memory`), kept by the
            caller across rounds.
        val_items: the local validation samples (:attr:`TermContext.val_items`).

    Raises:
        ValueError: see :func:`check_objectives` and :class:`ObjectiveTerm`.
    """
    check_objectives(objectives)
    ctx = TermContext(start_state, dict(tensors or {}), train,
                      memory if memory is not None else {}, list(val_items or []))
    wanted = list(objectives)
    names = {o.name for o in wanted}
    if train.router == "private" and "private_router" not in names:
        wanted.insert(0, Objective(name="private_router"))
    if train.prox_mu > 0 and "fedprox" not in names:
        wanted.insert(0, Objective(name="fedprox", params={"mu": train.prox_mu}))
    return [ObjectiveTerm.lookup(o.name)(dict(o.params), ctx) for o in wanted]
