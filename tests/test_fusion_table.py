"""The Fed-MoE fusion table (benchmarks/configs/fusion_table.yaml on the harness, its cells in
benchmarks/fusion_table.py) on synthetic cells, and its budgets (no federation runs here)."""

from __future__ import annotations

import pytest

from benchmarks import fusion_table as T
from benchmarks import harness as H

CFG = H.load_config(T.CONFIG)


def _cell(seed, method, curve, setting="tweets 10", fused=None):
    return {"seed": seed, "setting": setting, "method": method, "accuracy": curve[-1], "local_accuracy": 0.6,
            "accuracy_per_round": curve, "initial_accuracy": 0.3, "experts_held_mean": 3.0, "fused_accuracy": fused,
            "devices_trained": 10, "reserved": 40, "wall_seconds": 1.0,
            "sanity": {"rounds": [{"alpha": 0.6, "gate_entropy": 0.4, "compact_clients": 10}], "problems": []}}


def test_tables_mark_only_significant_differences():
    cells = []
    for s in range(3):
        cells.append(_cell(s, "FedAvg", [0.4, 0.50 + 0.01 * s]))
        cells.append(_cell(s, "Fed-MoE", [0.5, 0.56 + 0.01 * s]))               # +0.06 in every seed
        cells.append(_cell(s, "Avg-MoE", [0.4, [0.45, 0.70, 0.55][s]]))           # noisy
        cells.append(_cell(s, "Fed-MoE hybrid", [0.5, 0.55], fused=0.5))
    cfg = {**CFG, "seeds": [0, 1, 2], "rounds": 2}
    stats = H.aggregate(cfg, cells)
    st = stats["tweets 10"]
    tests = {(t["a"], t["b"]): t for t in st["tests"]}
    assert tests[("Fed-MoE", "FedAvg")]["global"]["significant"]
    assert not tests[("Fed-MoE", "Avg-MoE")]["global"]["significant"]
    assert ("Fed-MoE", "Cent-MoE") not in tests                                # not run: not tested
    assert st["methods"]["Fed-MoE hybrid"]["fused_accuracy"] == pytest.approx(0.5)
    result = {"profile": "quick", "profile_config": {"seeds": [0, 1, 2], "rounds": 2}, "stats": stats, "cells": cells,
              "date": "d", "machine": "m", "note": "", "cells_missing": ["s0 tweets 50 / FedAvg"],
              "cells_wall_seconds": 12.0}
    md = H.markdown(result, cfg)
    assert "▲FedAvg" in md.split("| Fed-MoE |")[1].split("\n")[0]
    assert "missing: s0 tweets 50 / FedAvg" in md and "**better**" in md


def test_budgets_put_every_other_client_below_three_experts():
    from moe_model.budget import estimate
    from protocol.messages import ModelSpec

    spec = ModelSpec(family="conv-moe", base=None, tokenizer=None, num_experts=8, top_k=2)
    b = T.budgets_for(spec, 32, 10, 4, 0, "fp32")
    plan = {k: estimate(spec, k, 32, 10, runtime_bytes=0, weight_format="fp32").total for k in (2, 3, 8)}
    assert plan[2] <= b[0] < plan[3] and plan[2] <= b[2] < plan[3]
    assert b[1] >= plan[8] and b[3] >= plan[8]


def test_ablations_run_in_one_setting_only():
    assert set(H.methods_for(CFG, "fmnist 10")) == set(CFG["methods"]) | set(CFG["ablations"])
    assert set(H.methods_for(CFG, "tweets 50")) == set(CFG["methods"])
    assert not H.load_config(T.CONFIG, "quick")["ablations"]                    # the quick profile runs none
    assert list(T.settings_of(CFG)) == ["fmnist 10", "tweets 10", "fmnist 50", "tweets 50"]
