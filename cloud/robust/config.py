"""The aggregator's ``defences`` section: which defences run and with what bounds.

Defaults are on (bounds, screening, the pre-commit guard); a robust rule and
differential privacy are opt-in. ``benchmarks/poisoning.py`` measures what each costs
and protects.

    defences:
      screening: {clip_factor: 2.0, reject_factor: 20.0, sample_cap_factor: 3.0}
      robust: {name: multi_krum}         # none, or a robust rule: median | trimmed_mean | multi_krum | ...
      min_holders: 1                      # expert updates with fewer holders are damped
      guard: {max_step_factor: 10.0, max_relative_step: 10.0}
      dp: null                            # {noise_multiplier: 1.0, clip_norm: 0.5, delta: 1.0e-5}

``screening: null`` and ``guard: null`` turn those off (the finiteness check of the
guard always runs).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ScreeningConfig(BaseModel):
    """Update screening (:mod:`cloud.robust.screening`)."""

    model_config = ConfigDict(extra="forbid")
    clip_factor: float = Field(2.0, gt=0, allow_inf_nan=False)
    """A group's change is clipped to ``clip_factor`` x the round's reference norm of its
    kind (the median over every device's groups of that kind)."""
    reject_factor: float = Field(20.0, gt=0, allow_inf_nan=False)
    """A change beyond ``reject_factor`` x the reference rejects the whole update (with a reply)."""
    min_reference: int = Field(3, ge=1)
    """Norms of a kind needed in a round to set its reference; with fewer, the last
    round's reference is used (none yet: that kind is not screened this round)."""
    sample_cap_factor: float = Field(3.0, ge=1, allow_inf_nan=False)
    """A device's aggregation weight (``num_samples``, usage counts) is capped at this
    multiple of the round's median claimed ``num_samples``."""

    @model_validator(mode="after")
    def _order(self) -> "ScreeningConfig":
        if self.reject_factor < self.clip_factor:
            raise ValueError(f"reject_factor ({self.reject_factor}) must be >= clip_factor ({self.clip_factor})")
        return self


class RobustConfig(BaseModel):
    """A robust aggregation rule wrapped around the configured aggregation
    (:mod:`cloud.robust.rules`). Default: Multi-Krum with f = 1, the only rule under
    which no attack of ``benchmarks/poisoning.py`` cost significant accuracy (screening
    alone lost 27 points to one sign-flipping device of 10; README "Poisoned updates")."""

    model_config = ConfigDict(extra="forbid")
    name: str = "multi_krum"
    """``none``, or a registered :class:`cloud.robust.rules.RobustRule` name (built in:
    ``median``, ``trimmed_mean``, ``multi_krum``; third-party rules under the
    entry-point group ``fedmoe.robust_rules``)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The rule's parameters, checked by the rule: ``trimmed_mean``: ``trim`` (share cut
    at each end, default 0.1); ``multi_krum``: ``f`` (assumed malicious holders, default
    1), ``m`` (selected, default n - f)."""

    @model_validator(mode="after")
    def _known_rule(self) -> "RobustConfig":
        if self.name == "none":
            return self
        from .rules import get_robust_rule  # imports torch: only when a rule is configured

        get_robust_rule(self.name)(**self.params)  # ValueError: unknown name, unknown or invalid params
        return self


class GuardConfig(BaseModel):
    """The pre-commit step bound (:mod:`cloud.robust.guard`)."""

    model_config = ConfigDict(extra="forbid")
    max_step_factor: float = Field(10.0, gt=1, allow_inf_nan=False)
    """A round's global step (L2 norm of new - previous state) may be at most this
    multiple of the median of the last ``window`` committed steps."""
    max_relative_step: float = Field(10.0, gt=0, allow_inf_nan=False)
    """... and at most this multiple of the previous global state's L2 norm."""
    window: int = Field(10, ge=1)
    warmup_rounds: int = Field(2, ge=1)
    """Committed steps needed before the history bound applies."""


class DPConfig(BaseModel):
    """Client-level differential privacy, DP-FedAvg (:mod:`cloud.robust.dp`)."""

    model_config = ConfigDict(extra="forbid")
    noise_multiplier: float = Field(gt=0, allow_inf_nan=False)
    clip_norm: float = Field(gt=0, allow_inf_nan=False)
    """L2 bound of one device's whole update (every tensor it sends, minus what it was sent)."""
    delta: float = Field(1e-5, gt=0, lt=1)
    sampling_rate: float = Field(1.0, gt=0, le=1)
    """Claimed only if devices are Poisson-sampled; 1 claims no amplification."""
    seed: int | None = None
    """Noise seed for reproducible benchmarks; leave unset in production."""

    @model_validator(mode="after")
    def _accountant_installed(self) -> "DPConfig":
        if importlib.util.find_spec("dp_accounting") is None:
            raise ValueError("defences.dp needs the privacy accountant: pip install 'fedmoe[dp]'")
        return self


class DefenceConfig(BaseModel):
    """Everything :class:`cloud.robust.Defences` is built from."""

    model_config = ConfigDict(extra="forbid")
    screening: ScreeningConfig | None = Field(default_factory=ScreeningConfig)
    robust: RobustConfig = Field(default_factory=RobustConfig)
    min_holders: int = Field(1, ge=1)
    """An expert whose update this round comes from fewer devices moves by
    ``holders / min_holders`` of its aggregated step (1: no damping)."""
    guard: GuardConfig | None = Field(default_factory=GuardConfig)
    dp: DPConfig | None = None

    @model_validator(mode="after")
    def _compatible(self) -> "DefenceConfig":
        if self.dp is not None and "robust" not in self.model_fields_set:
            self.robust = RobustConfig(name="none")  # DP-FedAvg replaces the default rule
        if self.min_holders > 1 and self.screening is None:
            raise ValueError("defences.min_holders > 1 damps experts during screening; it needs screening on")
        if self.dp is not None and self.robust.name != "none":
            raise ValueError("defences.dp cannot be combined with a robust rule (DP-FedAvg's noise is calibrated "
                             f"to its own uniform mean, not to {self.robust.name!r}); set robust: {{name: none}}")
        return self
