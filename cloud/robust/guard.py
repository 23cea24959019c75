"""The pre-commit guard: a new global state is committed only if it is finite and
within a bound of the previous one.

Screening bounds each device's change and a robust rule bounds a minority's pull, but a
strategy bug, a colluding majority on a rarely held expert or a misconfiguration can
still produce a wild aggregate. Before a round's state is committed the guard checks:

1. every tensor is finite (always);
2. the global step ``||new - previous||_2`` is at most ``max_relative_step`` x
   ``||previous||_2``;
3. once ``warmup_rounds`` steps were committed, the step is at most ``max_step_factor``
   x the median of the last ``window`` committed steps.

A failed check fails the round (reason in the record, previous state kept, devices
told); the step is then not added to the history.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from .config import GuardConfig


def l2_norm(tensors) -> float:
    """L2 norm over every element of an iterable of tensors (float64 accumulation)."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


class StepGuard:
    """Checks a candidate global state against the previous one (module docstring).

    Args:
        config: the bounds; ``None`` checks finiteness only.
    """

    def __init__(self, config: GuardConfig | None):
        self.config = config
        self.steps: list[float] = []
        """L2 norms of the last committed global steps, oldest first (at most ``window``)."""

    def problem(self, previous: dict[str, torch.Tensor], new: dict[str, torch.Tensor],
                step: float | None = None) -> str | None:
        """Why ``new`` must not be committed after ``previous``, or None.

        Args:
            previous, new: global adapter states with the same keys (name -> tensor).
            step: ``||new - previous||_2`` if the caller already has it (computed here otherwise).
        """
        bad = [k for k, v in new.items() if not torch.isfinite(v).all()]
        if bad:
            return f"the aggregated global state is not finite ({len(bad)} tensors, e.g. {bad[0]})"
        cfg = self.config
        if cfg is None:
            return None
        if step is None:
            step = l2_norm(new[k] - previous[k] for k in previous)
        size = l2_norm(previous.values())
        if size > 0 and step > cfg.max_relative_step * size:
            return (f"the global step has L2 norm {step:.4g}, more than {cfg.max_relative_step:g} x the previous "
                    f"state's {size:.4g}")
        if len(self.steps) >= cfg.warmup_rounds:
            typical = statistics.median(self.steps)
            if typical > 0 and step > cfg.max_step_factor * typical:
                return (f"the global step has L2 norm {step:.4g}, more than {cfg.max_step_factor:g} x the median "
                        f"{typical:.4g} of the last {len(self.steps)} committed steps")
        return None

    def committed(self, step_norm: float) -> None:
        """Record the step of a committed round (a no-quorum round's zero step is not a step)."""
        if self.config is None or not math.isfinite(step_norm) or step_norm <= 0:
            return
        self.steps = (self.steps + [float(step_norm)])[-self.config.window:]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable ``{"steps": [L2 norms, oldest first]}``."""
        return {"steps": list(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the committed steps :meth:`state_dict` returned (replacing the current ones)."""
        self.steps = [float(s) for s in state.get("steps", [])]
