"""Heterogeneous LoRA ranks against uniform ranks (docs/ranks.md): the harness's grid table
(:mod:`benchmarks.harness`) with each method's mean LoRA rank per device-round beside the
experts it held (``table: ranks_table`` in ``benchmarks/configs/ranks.yaml``).

    python -m benchmarks.harness benchmarks/configs/ranks.yaml [--quick] [--lock FILE]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks import cells, harness
from benchmarks.common import fmt

EXTRA = harness.EXTRA + ("lora_rank_mean", "lora_effective_rank", "lora_top_share")


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """:func:`cells.summarise` plus ``lora_rank_mean``: the LoRA rank each reporting device
    trained, mean over device-rounds (the model's rank where a round record has none); with
    trained ``A`` (``flexlora``, ``hlora``, ``rankwise``), the last round's aggregated
    products' ``lora_effective_rank`` and ``lora_top_share`` (``strategy_metrics.lora_spectrum``,
    ``moe_model.ranks.spectrum_summary``: rank collapse shows as 1 and near 1)."""
    out = cells.summarise(report)
    rank = report["config"]["aggregator"]["model"]["lora"]["rank"]
    ranks = [d.get("lora_rank", rank) for r in report["rounds"] for d in r["devices"].values()]
    out["lora_rank_mean"] = sum(ranks) / len(ranks) if ranks else None
    spectrum = ((report["rounds"][-1].get("strategy_metrics") or {}).get("lora_spectrum") or {}) \
        if report["rounds"] else {}
    out["lora_effective_rank"] = spectrum.get("effective_rank")  # trained A: the last round's aggregate
    out["lora_top_share"] = spectrum.get("top_share")
    return out


_at = next(i for i, (name, _) in enumerate(harness.LAYOUT.columns) if name == "experts held") + 1
LAYOUT = dataclasses.replace(harness.LAYOUT, columns=[
    *harness.LAYOUT.columns[:_at], ("LoRA rank", lambda m, s, st: fmt(s.get("lora_rank_mean"), ".1f")),
    ("eff. rank of ΔW", lambda m, s, st: fmt(s.get("lora_effective_rank"), ".1f")),
    ("top σ share", lambda m, s, st: fmt(s.get("lora_top_share"), ".2f")),
    *harness.LAYOUT.columns[_at:]])
