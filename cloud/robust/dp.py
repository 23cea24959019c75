"""Client-level differential privacy: DP-FedAvg with an RDP accountant.

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018 (DP-FedAvg, the fixed-weight estimator with uniform weights),
applied per aggregation unit of the MoE adapter state.

**Algorithm** (one round, :meth:`DPFedAvg.aggregate`). ``C`` = ``clip_norm``,
``sigma`` = ``noise_multiplier``.

1. For each accepted result ``c``: its update ``D_c = state_c - global_state`` over
   *every* key it holds (in float64; keys not in the global state are ignored, nothing
   about them is released), and the L2 norm ``||D_c||`` over all those keys together.
2. ``D_c`` is scaled by ``min(1, C / ||D_c||)``, so ``||D_c|| <= C`` across all units
   (an update with a non-finite norm is replaced by zeros).
3. For each aggregation unit ``u`` (:attr:`protocol.keys.Key.module`: ``("expert", l,
   e)`` is the expert's tensors *and* its router row, ``("head", task)``,
   ``("backbone",)``) held by ``m_u >= 1`` results (a result holds ``u`` when it has
   any key of ``u``), every key ``k`` of ``u`` becomes
   ``global[k] + (sum_c D_c[k] + N(0, (sigma*C)^2 I)) / m_u``,
   the sum over the holders of ``k``. A unit nobody holds stays unchanged and gets no
   noise: nothing data-dependent about it is released.

**Why this is a Gaussian mechanism with noise multiplier ``sigma`` per round.** The
vector of all per-unit sums ``(sum_c D_c[k])_k`` changes by one device's clipped update
when that device's contribution is added or removed, and that update has L2 norm ``<= C``
across *all* units together, so the L2 sensitivity of the concatenated sums is ``C``;
every coordinate gets independent noise of standard deviation ``sigma*C``. Dividing by
the holder counts ``m_u`` is post-processing: the counts are the cloud's own assignment
decision (which device trains which expert), public and not a function of the devices'
data. Precisely, the protected neighbourhood is therefore "one device's update is
replaced by nothing (zero) while who took part is public" -- the *zero-out* relation of
Kairouz et al. 2021 (``NeighboringRelation.REPLACE_SPECIAL`` of ``dp_accounting``,
whose RDP for the Gaussian and Poisson-subsampled Gaussian events is the same as for
add/remove-one). The guarantee is for a device's *whole* contribution over all rounds
(client-level DP), not for single examples.

**What is and is not covered.**

- Weights are uniform: ``|D_c|`` and FLEX-MoE's usage weights are *not* used; a
  data-dependent weight would change the sensitivity.
- A Byzantine-robust rule (median, trimmed mean, Krum) cannot be combined with it: the
  noise is calibrated to this sum, not to those statistics
  (:class:`cloud.robust.config.DefenceConfig` refuses the combination).
- Activation statistics (routing counts, losses, ``num_samples``) that devices report
  are **outside** the privacy budget, as are which devices failed or dropped out; only
  the adapter state released by this aggregation is accounted.
- ``sampling_rate`` defaults to 1: no amplification by subsampling is claimed, because
  the cloud's client selection is not Poisson sampling (and the assignment is public).
  Set it below 1 only if devices are Poisson-sampled with that probability and the
  sample stays secret; the accountant then uses ``PoissonSampledDpEvent``.
- The accountant (:class:`PrivacyAccountant`, ``dp_accounting``'s RDP accountant)
  steps once per round that released an aggregate; a round with no results releases
  nothing and is not counted.

**Noise source.** With ``seed`` set, round ``r`` draws its noise from a
``torch.Generator`` seeded with ``seed + r``: reproducible, for benchmarks only -- anyone
who knows the seed can subtract the noise and the guarantee is void. Without ``seed``
(production) each round's generator is seeded from 64 bits of ``os.urandom``; the
noise must not be predictable. (torch's generator is not a cryptographic one and
floating-point Gaussian sampling has known side channels, Mironov 2012; this is the usual
practice of DP training libraries, not a hardened implementation.)

Requires the ``dp`` extra: ``pip install 'fedmoe[dp]'`` (Google's ``dp-accounting``).
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from typing import Any, ClassVar

import torch

from protocol import keys

from ..aggregation.base import AggregationStrategy
from ..strategy import ClientResult, Failure

log = logging.getLogger(__name__)

_MISSING = "client-level DP needs the accountant: pip install 'fedmoe[dp]'"


def _dp_accounting():
    try:
        import dp_accounting
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(_MISSING) from e
    return dp_accounting


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return delta


def _check_step(noise_multiplier: float, sampling_rate: float) -> tuple[float, float]:
    sigma, q = float(noise_multiplier), float(sampling_rate)
    if not sigma >= 0.0 or math.isinf(sigma):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    return sigma, q


class PrivacyAccountant:
    """RDP accountant (``dp_accounting.rdp.RdpAccountant``) over rounds of the Gaussian
    mechanism.

    Each :meth:`step` composes one ``GaussianDpEvent(noise_multiplier)`` (or, for
    ``sampling_rate < 1``, ``PoissonSampledDpEvent(sampling_rate, GaussianDpEvent)``)
    over ``dp_accounting``'s default RDP orders; :meth:`epsilon` converts the composed
    RDP curve to ``(epsilon, delta)`` with ``dp_accounting.rdp.compute_epsilon``.

    Args:
        delta: the target delta, ``0 < delta < 1``.

    Raises:
        ValueError: delta outside (0, 1).
        ImportError: ``dp_accounting`` is not installed.
    """

    def __init__(self, delta: float):
        self.delta = _check_delta(delta)
        self._dpa = _dp_accounting()
        self._steps: list[tuple[float, float]] = []
        self._acc = self._new()

    def _new(self):
        return self._dpa.rdp.RdpAccountant(
            neighboring_relation=self._dpa.NeighboringRelation.REPLACE_SPECIAL
        )

    def _event(self, sigma: float, q: float):
        gauss = self._dpa.GaussianDpEvent(sigma)
        return gauss if q == 1.0 else self._dpa.PoissonSampledDpEvent(q, gauss)

    @property
    def rounds(self) -> int:
        """Steps composed so far."""
        return len(self._steps)

    def step(self, noise_multiplier: float, sampling_rate: float = 1.0) -> None:
        """Compose one round of the Gaussian mechanism with this noise multiplier
        (noise std / L2 sensitivity); ``noise_multiplier == 0`` makes epsilon infinite.

        Raises:
            ValueError: noise_multiplier < 0 or sampling_rate outside (0, 1].
        """
        sigma, q = _check_step(noise_multiplier, sampling_rate)
        self._acc.compose(self._event(sigma, q))
        self._steps.append((sigma, q))

    def epsilon(self) -> float:
        """Cumulative epsilon at :attr:`delta` after all steps (0.0 before any step;
        ``inf`` once a step had no noise)."""
        if not self._steps:
            return 0.0
        return float(self._acc.get_epsilon(self.delta))

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: ``{"steps": [[noise_multiplier, sampling_rate], ...]}``."""
        return {"steps": [[s, q] for s, q in self._steps]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rebuild the accountant from :meth:`state_dict`'s steps (replacing any steps
        taken so far)."""
        steps = [_check_step(s, q) for s, q in state.get("steps", [])]
        acc = self._new()
        for (s, q), count in Counter(steps).items():  # composition is commutative
            acc.compose(self._event(s, q), count)
        self._acc, self._steps = acc, steps


class DPFedAvg(AggregationStrategy):
    """DP-FedAvg over aggregation units (see the module docstring for the algorithm and
    what the guarantee covers).

    Not registered by name (``name = ""``): the aggregator builds it from its
    ``defences.dp`` section in place of the configured aggregation; :attr:`label` names
    it in records.

    Args:
        noise_multiplier: ``sigma``, noise std per coordinate / ``clip_norm``; ``>= 0``
            (0 adds no noise and gives epsilon = inf).
        clip_norm: ``C``, the L2 bound of one device's whole update; ``> 0``.
        delta: the delta epsilon is reported at, in (0, 1).
        sampling_rate: Poisson sampling probability claimed for amplification, in (0, 1];
            1 (the default) claims none.
        seed: noise seed for reproducible benchmarks (round ``r`` uses ``seed + r``);
            ``None`` (production) seeds from ``os.urandom``.

    Attributes:
        report: after :meth:`aggregate`: ``epsilon``, ``delta``, ``noise_multiplier``,
            ``clip_norm``, ``clipped`` (devices whose update was scaled down),
            ``update_norms`` (device -> update norm before clipping), ``rounds``
            (rounds accounted).

    Raises:
        ValueError: a parameter out of range.
        ImportError: ``dp_accounting`` is not installed.
    """

    name = ""
    label: ClassVar[str] = "dp_fedavg"

    def __init__(
        self,
        noise_multiplier: float,
        clip_norm: float,
        delta: float = 1e-5,
        sampling_rate: float = 1.0,
        seed: int | None = None,
    ):
        super().__init__()
        self.noise_multiplier, self.sampling_rate = _check_step(noise_multiplier, sampling_rate)
        clip_norm = float(clip_norm)
        if not (clip_norm > 0.0 and math.isfinite(clip_norm)):
            raise ValueError(f"clip_norm must be a finite number > 0, got {clip_norm}")
        self.clip_norm = clip_norm
        self.delta = _check_delta(delta)
        self.seed = None if seed is None else int(seed)
        self.accountant = PrivacyAccountant(self.delta)
        self.report: dict[str, Any] = {}

    def _generator(self, round: int) -> torch.Generator:
        g = torch.Generator()
        if self.seed is not None:
            g.manual_seed(self.seed + int(round))
        else:
            g.manual_seed(int.from_bytes(os.urandom(8), "little"))
        return g

    def aggregate(
        self, round: int, global_state: dict[str, torch.Tensor], results: list[ClientResult], failures: list[Failure]
    ) -> dict[str, torch.Tensor]:
        out = dict(global_state)
        C, sigma = self.clip_norm, self.noise_multiplier
        clipped: list[str] = []
        norms: dict[str, float] = {}
        updates: list[dict[str, torch.Tensor]] = []
        for r in results:
            delta_c: dict[str, torch.Tensor] = {}
            sq = 0.0
            for name, t in r.state.items():
                if name not in global_state:
                    continue
                g = global_state[name]
                if tuple(t.shape) != tuple(g.shape):
                    raise ValueError(f"{r.device_id}: {name} has shape {tuple(t.shape)}, expected {tuple(g.shape)}")
                d = t.detach().to("cpu", torch.float64) - g.detach().to("cpu", torch.float64)
                delta_c[name] = d
                sq += float(torch.sum(d * d))
            norm = math.sqrt(sq)
            norms[r.device_id] = norm
            if not math.isfinite(norm):
                log.warning("dp: %s sent a non-finite update; it counts as a zero update", r.device_id)
                delta_c = {k: torch.zeros_like(v) for k, v in delta_c.items()}
                clipped.append(r.device_id)
            elif norm > C:
                scale = C / norm
                delta_c = {k: v * scale for k, v in delta_c.items()}
                clipped.append(r.device_id)
            updates.append(delta_c)

        if results:
            units = keys.units(global_state)
            gen = self._generator(round)
            std = sigma * C
            for unit_keys in units.values():
                m = sum(1 for d in updates if any(k in d for k in unit_keys))
                if m == 0:
                    continue
                for name in unit_keys:
                    g = global_state[name]
                    acc = torch.zeros(g.shape, dtype=torch.float64)
                    for d in updates:
                        if name in d:
                            acc += d[name]
                    if std > 0:
                        acc += std * torch.randn(g.shape, generator=gen, dtype=torch.float64)
                    new = g.detach().to("cpu", torch.float64) + acc / m
                    out[name] = new.to(device=g.device, dtype=g.dtype)
            self.accountant.step(sigma, self.sampling_rate)

        self.report = {
            "epsilon": self.accountant.epsilon(),
            "delta": self.delta,
            "noise_multiplier": sigma,
            "clip_norm": C,
            "clipped": clipped,
            "update_norms": norms,
            "rounds": self.accountant.rounds,
        }
        return out

    def state_dict(self) -> dict[str, Any]:
        """The accountant's steps (JSON)."""
        return self.accountant.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state)
