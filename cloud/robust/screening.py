"""Update screening: bound each device's influence before aggregation.

A provisioned device that signs correctly may still send a poisoned update (scaled
noise, a sign flip, a huge claimed sample count). Screening looks at each update's
*change* from the state that device was sent this round (the round's global state),
split into tensor groups, and compares it with the round's other changes:

- **Groups and kinds.** A group is the backbone's LoRA tensors, one expert's tensors
  (``expert.{l}.{e}``), the router rows a device holds in layer ``l`` (``router.{l}``) or
  a task's head (``head.{task}``). Groups of the same kind (the backbone; the experts of
  layer ``l``; the router rows of layer ``l``; a task's head) are comparable, so an
  expert that only one device holds is still measured against the other experts of its
  layer.
- **Reference.** Per kind, the median L2 norm over every device's groups of that kind
  this round (a minority of attackers cannot move a median), kept for the next round;
  an expert group counts only if its device routed training tokens to it (``Stats``
  usage > 0): an expert no token reached does not train, so its change is 0 or an
  encoding residual, and when routing concentrates (measured on a random-init
  Qwen3-MoE with LoRA A and B under Adam: the trained experts of a layer changed by about
  1.5, the median of all held ones by 0.07) counting those would put every honest
  trained expert 20x over the reference. Every group is still clipped and rejected
  against that reference;
  with fewer than ``min_reference`` norms of a kind the last reference is used (none
  yet: that kind is not screened this round; the pre-commit guard still bounds it).
  This is the "adaptive clipping to a quantile of the round's norms" of Andrew, Thakkar,
  McMahan, Ramaswamy 2019 ("Differentially Private Learning with Adaptive Clipping"),
  here without noise on the quantile and computed per kind.
- **Clip.** A group whose change exceeds ``clip_factor`` x its reference is scaled down
  to that bound (the norm-bounded mean of Sun et al. 2019, "Can You Really Backdoor
  Federated Learning?", with an adaptive bound).
- **Reject.** A change beyond ``reject_factor`` x the reference rejects the device's
  whole update this round (the device is told why).
- **Sample cap.** Aggregation weights are what devices claim; a claim above
  ``sample_cap_factor`` x the round's median claimed ``num_samples`` is cut to that cap,
  and its usage counts (FLEX-MoE's expert weights) scaled alike.
- **Few holders.** With ``min_holders`` > 1, an expert (and its router row) held by
  fewer devices this round has every holder's change scaled by holders / min_holders,
  so its aggregated step is damped: a lone holder, honest or not, moves the expert by at
  most ``clip_factor / min_holders`` x a typical expert change.

What was clipped, rejected, capped and damped goes into the round record
(``screening``); each device's state (clean / clipped / rejected) is logged when it
changes, not every round.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from protocol import keys

from ..strategy import ClientResult
from .config import ScreeningConfig

log = logging.getLogger(__name__)


def _squared_changes(state: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor]) -> dict[str, float]:
    """name -> ``sum((t - g)**2)`` for each tensor ``t`` of ``state`` against ``global_state``'s:
    one ``torch._foreach_sub`` and one ``torch._foreach_norm`` over all of them, in their own
    dtype (relative error about 3e-7 in fp32 against a float64 sum; per-tensor calls cost 1.4
    ms for the fleet's 128 tensors of one update, these 0.6 ms)."""
    names = list(state)
    if not names:
        return {}
    norms = torch._foreach_norm(torch._foreach_sub([state[n] for n in names], [global_state[n] for n in names]))
    return {n: v * v for n, v in zip(names, torch.stack(norms).tolist())}


def group_of(name: str) -> tuple[str, str]:
    """``(kind, group)`` of an adapter-state key (see the module docstring).

    >>> group_of("expert.1.3.fc1.lora_B")
    ('expert.1', 'expert.1.3')
    >>> group_of("router.1.3")
    ('router.1', 'router.1')

    Raises:
        ValueError: not an adapter-state key.
    """
    k = keys.parse(name)
    if k.group == "expert":
        return f"expert.{k.layer}", f"expert.{k.layer}.{k.expert}"
    if k.group == "router":
        return f"router.{k.layer}", f"router.{k.layer}"
    if k.group == "head":
        return f"head.{k.task}", f"head.{k.task}"
    return "backbone", "backbone"


def routed_experts(result: ClientResult) -> set[str] | None:
    """The expert groups (``expert.{l}.{e}``) ``result``'s device routed training tokens to
    (its ``Stats`` usage), or None when it sent no per-layer statistics (all count)."""
    if result.stats is None or not result.stats.layers:
        return None
    return {f"expert.{ls.layer}.{e}" for ls in result.stats.layers for e, u in enumerate(ls.usage) if u > 0}


@dataclass
class Screened:
    """What screening let through.

    Attributes:
        results: the accepted results, with clipped/damped states and capped weights.
        rejected: device -> why its update was rejected (reply text).
        report: JSON-serialisable summary for the round record.
        norms: device -> group -> L2 norm of its change (before clipping).
        kinds: group -> kind (what reference a group is held against).
    """

    results: list[ClientResult]
    rejected: dict[str, str] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    norms: dict[str, dict[str, float]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)


class UpdateScreen:
    """Clips and rejects updates against per-kind reference norms (module docstring).

    Args:
        config: bounds (:class:`cloud.robust.config.ScreeningConfig`).
        min_holders: experts held by fewer devices in a round are damped (1: never).
    """

    def __init__(self, config: ScreeningConfig, min_holders: int = 1):
        self.config = config
        self.min_holders = int(min_holders)
        self.references: dict[str, float] = {}
        """kind -> reference norm (L2, in parameter units) of the last round that had one."""
        self._logged: dict[str, str] = {}

    def screen(self, round: int, global_state: dict[str, torch.Tensor], results: list[ClientResult],
               references: dict[str, float] | None = None, sample_cap: int | None = None) -> Screened:
        """Screen one round's accepted results.

        Args:
            round: the round number (log lines).
            global_state: the state every device was sent this round (name -> tensor).
            results: updates that passed the protocol's checks; ``state`` holds the
                device's trained tensors (same shapes as ``global_state``).
            references: kind -> reference norm to hold the results against instead of
                this round's (:meth:`update_references`): an aggregator worker screens
                each update as it arrives against the references of the rounds before.
            sample_cap: the cap on claimed ``num_samples`` instead of :meth:`sample_cap` of
                these results' claims (a worker screening one update uses the round's cap
                from the declared samples of the selected devices).

        Returns:
            :class:`Screened`; the inputs are not modified.
        """
        cfg = self.config
        group = {name: group_of(name) for name in global_state}    # name -> (kind, group), parsed once
        unit = {name: keys.parse(name).module for name in global_state}
        norms: dict[str, dict[str, float]] = {}   # device -> group -> norm
        kinds: dict[str, str] = {}                 # group -> kind
        for r in results:  # no change is kept: at 1,000 updates a round their float64 copies were 2 GiB
            sq = {}
            for name, v in _squared_changes(r.state, global_state).items():
                kind, g = group[name]
                kinds[g] = kind
                sq[g] = sq.get(g, 0.0) + v
            norms[r.device_id] = {g: math.sqrt(v) for g, v in sq.items()}

        if references is None:
            reference = self.update_references(norms, kinds, {r.device_id: routed_experts(r) for r in results})
        else:
            reference = references

        rejected: dict[str, str] = {}
        scales: dict[str, dict[str, float]] = {}
        clipped: dict[str, dict[str, Any]] = {}
        for r in results:
            s: dict[str, float] = {}
            worst = 0.0
            for g, n in norms[r.device_id].items():
                ref = reference.get(kinds[g])
                if ref is None:
                    continue
                ratio = n / ref
                if not math.isfinite(n) or ratio > cfg.reject_factor:
                    rejected[r.device_id] = (
                        f"the change of {g} has L2 norm {n:.3g}, {ratio:.3g} x this round's typical {ref:.3g} "
                        f"(limit {cfg.reject_factor:g} x)")
                    break
                if ratio > cfg.clip_factor:
                    s[g] = cfg.clip_factor / ratio
                    worst = max(worst, ratio)
            if r.device_id not in rejected and s:
                scales[r.device_id] = s
                clipped[r.device_id] = {"groups": len(s), "max_ratio": float(f"{worst:.4g}")}

        kept = [r for r in results if r.device_id not in rejected]
        damped, damp = self._few_holders(kept)
        claimed = {r.device_id: r.num_samples for r in kept}
        capped = self._sample_cap(kept, sample_cap)
        out = []
        for r in kept:
            s, u = scales.get(r.device_id, {}), damp.get(r.device_id, {})
            state = r.state
            if s or u:
                state = {}
                for name, t in r.state.items():
                    f = s.get(group[name][1], 1.0) * u.get(unit[name], 1.0)
                    if f != 1.0:
                        g64 = global_state[name].to(torch.float64)
                        t = (g64 + f * (t.to(torch.float64) - g64)).to(t.dtype)
                    state[name] = t
            out.append(replace(capped.get(r.device_id, r), state=state))

        for r in results:
            now = "rejected" if r.device_id in rejected else "clipped" if r.device_id in clipped else "clean"
            if self._logged.get(r.device_id, "clean") != now:
                level = logging.WARNING if now != "clean" else logging.INFO
                log.log(level, "round %d: update of %s %s%s", round, r.device_id, now,
                        f": {rejected[r.device_id]}" if now == "rejected" else
                        f" ({clipped[r.device_id]['groups']} groups, up to {clipped[r.device_id]['max_ratio']:.3g} x "
                        "the typical change)" if now == "clipped" else " again")
                self._logged[r.device_id] = now
        report = {"reference": {k: float(f"{v:.6g}") for k, v in reference.items()}, "clipped": clipped,
                  "rejected": rejected,
                  "capped_samples": {d: [claimed[d], r.num_samples] for d, r in capped.items()},
                  "damped": damped}
        return Screened(out, rejected, report, norms, kinds)

    def update_references(self, norms: dict[str, dict[str, float]], kinds: dict[str, str],
                          routed: dict[str, set[str] | None]) -> dict[str, float]:
        """This round's reference norm per kind, kept for later rounds: the median of the
        devices' group norms of that kind (expert groups only where the device routed
        tokens to the expert), given at least ``min_reference`` of them; else the last
        round's.

        Args:
            norms: device -> group -> L2 norm of its change.
            kinds: group -> kind.
            routed: device -> expert groups it routed tokens to (None: unknown, all count).

        Returns:
            kind -> reference norm (kinds with none are absent).
        """
        by_kind: dict[str, list[float]] = {}
        for d, groups in norms.items():
            for g, n in groups.items():
                if routed.get(d) is None or not g.startswith("expert.") or g in routed[d]:
                    by_kind.setdefault(kinds[g], []).append(n)
        reference: dict[str, float] = {}
        for kind in sorted(set(kinds.values())):
            values = [n for n in by_kind.get(kind, []) if math.isfinite(n)]
            if len(values) >= self.config.min_reference and statistics.median(values) > 0:
                reference[kind] = self.references[kind] = statistics.median(values)
            elif kind in self.references:
                reference[kind] = self.references[kind]
        return reference

    def _few_holders(self, kept: list[ClientResult]) -> tuple[dict[str, int], dict[str, dict[tuple, float]]]:
        """Damping of experts with fewer than ``min_holders`` holders this round.

        Returns:
            ``(damped, factors)``: expert group -> its holders, for the damped experts;
            device -> aggregation unit (:attr:`protocol.keys.Key.module`, the expert's
            tensors and its router row) -> factor.
        """
        if self.min_holders <= 1:
            return {}, {}
        holders: dict[tuple, list[str]] = {}
        for r in kept:
            for unit in keys.units(r.state):
                if unit[0] == "expert":
                    holders.setdefault(unit, []).append(r.device_id)
        damped: dict[str, int] = {}
        factors: dict[str, dict[tuple, float]] = {}
        for unit, devs in holders.items():
            if len(devs) < self.min_holders:
                damped[f"expert.{unit[1]}.{unit[2]}"] = len(devs)
                for d in devs:
                    factors.setdefault(d, {})[unit] = len(devs) / self.min_holders
        return damped, factors

    def sample_cap(self, samples: list[int]) -> int:
        """The sample cap over these ``num_samples`` (``sample_cap_factor`` x their median,
        at least 1). Raises statistics.StatisticsError when ``samples`` is empty."""
        return max(1, int(self.config.sample_cap_factor * statistics.median(samples)))

    def _sample_cap(self, kept: list[ClientResult], cap: int | None = None) -> dict[str, ClientResult]:
        """Results whose claimed ``num_samples`` exceeds the cap (``cap``, or
        :meth:`sample_cap` of the claims), with capped weights."""
        if not kept:
            return {}
        cap = self.sample_cap([r.num_samples for r in kept]) if cap is None else cap
        out = {}
        for r in kept:
            if r.num_samples > cap:
                ratio = cap / r.num_samples
                stats = r.stats
                if stats is not None:
                    stats = stats.model_copy(update={
                        "num_samples": cap,
                        "layers": [ls.model_copy(update={"usage": [int(u * ratio) for u in ls.usage]})
                                   for ls in stats.layers]})
                out[r.device_id] = replace(r, num_samples=cap, stats=stats)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The per-kind references (JSON)."""
        return {"references": dict(self.references)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.references = {str(k): float(v) for k, v in state.get("references", {}).items()}
