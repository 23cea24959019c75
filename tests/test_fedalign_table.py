"""The FedAlign-MoE table (benchmarks/configs/fedalign_table.yaml on the harness, its cells in
benchmarks/fedalign_table.py) and the statistics in benchmarks/common.py, on synthetic
cells (no federation runs here)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import fedalign_table as T
from benchmarks import harness as H
from benchmarks.common import holm, mean_ci, paired_test, rounds_to

CFG = H.load_config(T.CONFIG)


def test_mean_ci_uses_student_t():
    s = mean_ci([1.0, 2.0, 3.0, None])
    assert s["n"] == 3 and s["mean"] == 2.0 and s["std"] == 1.0
    assert s["ci_hi"] - 2.0 == pytest.approx(4.3027 / 3**0.5, rel=1e-4)     # t(0.975, 2) * sd / sqrt(n)
    assert mean_ci([0.5])["std"] is None and mean_ci([])["mean"] is None


def test_paired_test_significance_and_zero_spread():
    t = paired_test([0.80, 0.82, 0.85], [0.78, 0.80, 0.84])   # diffs .02 .02 .01
    assert t["diff"] == pytest.approx(1 / 60) and t["significant"] and t["p"] < 0.05
    t = paired_test([0.8, 0.7, 0.9], [0.75, 0.78, 0.85])      # diffs +.05 -.08 +.05
    assert not t["significant"] and t["p"] > 0.05 and t["ci_lo"] < 0 < t["ci_hi"]
    # the same round-count difference in every seed: t-test undefined; significant with >= 3 pairs
    t3, t2 = paired_test([3, 4, 5], [4, 5, 6]), paired_test([3, 4], [4, 5])
    assert t3["zero_spread"] and t3["p"] is None and t3["significant"] and t3["diff"] == -1
    assert t2["zero_spread"] and not t2["significant"]
    assert not paired_test([1, 1, 1], [1, 1, 1])["significant"]
    assert paired_test([0.5, None, 0.7], [0.4, 0.6, None])["n"] == 1


def test_rounds_to_target():
    assert rounds_to([0.2, 0.5, 0.8, 0.9], 0.75) == 3
    assert rounds_to([0.2, None, 0.5], 0.75) is None


def _cell(seed, method, curve, local=0.8, setting="bbc Dir(0.1)"):
    return {"seed": seed, "setting": setting, "method": method, "accuracy": curve[-1], "local_accuracy": local,
            "accuracy_per_round": curve, "initial_accuracy": 0.2, "experts_held_mean": 24.0,
            "sanity": {"rounds": [], "problems": [], "gate": {}}}


def test_aggregate_target_tests_and_markdown():
    cells = []
    for s in range(3):
        cells.append(_cell(s, "FedAvg", [0.3, 0.5, 0.69 + 0.01 * s]))
        cells.append(_cell(s, "FedAlign-MoE", [0.4, 0.7, 0.75 + 0.01 * s]))   # +0.06 in every seed
        cells.append(_cell(s, "FedProx", [0.3, 0.5, [0.6, 0.85, 0.7][s]]))
    cfg = {**CFG, "seeds": [0, 1, 2], "rounds": 3}
    stats = H.aggregate(cfg, cells)
    st = stats["bbc Dir(0.1)"]
    assert st["target"] == pytest.approx(0.9 * 0.76)
    fa = st["methods"]["FedAlign-MoE"]
    assert fa["rounds_to_target_values"] == [2, 2, 2] and fa["reached"] == 3
    assert st["methods"]["FedAvg"]["rounds_to_target_values"] == [3, 3, 3]
    tests = {(t["a"], t["b"]): t for t in st["tests"]}
    assert tests[("FedAlign-MoE", "FedAvg")]["global"]["significant"]
    assert tests[("FedAlign-MoE", "FedAvg")]["rounds"]["diff"] == -1
    assert not tests[("FedAlign-MoE", "FedProx")]["global"]["significant"]
    assert ("FedAlign-MoE", "FedMoE") not in tests                  # FedMoE not run: no test
    result = {"profile": "full", "profile_config": {"seeds": [0, 1, 2], "rounds": 3}, "stats": stats, "cells": cells,
              "date": "d", "machine": "m", "note": "", "cells_missing": [], "cells_wall_seconds": 60.0,
              "wall_seconds_this_invocation": 60.0}
    md = H.markdown(result, cfg)
    assert "▲FedAvg" in md and "**better**" in md and "no sig. difference" in md


def test_the_gate_probe_observes_without_changing_the_weights():
    import cloud.strategies.fedalign as F

    orig = F.client_weights
    deltas, hidden = torch.randn(4, 10, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    with T.GateProbe() as probe:
        assert F.client_weights is not orig
        got = F.client_weights(deltas, hidden)
    assert F.client_weights is orig
    assert torch.equal(got, orig(deltas, hidden))
    row = probe.summary()["0"]
    assert row["experts"] == 1 and row["participants"] == 4 and -1 <= row["s"] <= 1


def test_methods_and_ablations_per_setting():
    assert "w/o router alignment" in H.methods_for(CFG, CFG["ablation_setting"])
    assert "w/o router alignment" not in H.methods_for(CFG, "tweets IID")
    assert "w/o router alignment" not in H.methods_for(CFG, CFG["ablation_setting"], ablations=False)
    assert "FedAlign-MoE on FedMoE" in H.methods_for(CFG, "tweets Dir(0.1)")
    assert "FedAlign-MoE on FedMoE" not in H.methods_for(CFG, "bbc IID")
    assert H.methods_for(CFG, "bbc IID")["FedAlign-MoE"]["assignment"] == CFG["methods"]["FedAvg"]["assignment"] == "full"


def test_differences_equal_up_to_rounding_count_as_zero_spread():
    t = paired_test([0.5 + 1 / 48, 0.25 + 1 / 48], [0.5, 0.25])   # the same +1/48 in both seeds, up to rounding
    assert t["zero_spread"] and t["p"] is None and not t["significant"]   # two pairs: not enough


def test_holm_adjusts_in_order_and_keeps_the_family_monotone():
    assert holm([0.01, 0.04, None, 0.03, 0.5]) == pytest.approx([0.04, 0.09, None, 0.09, 0.5])  # 4x, 3x, max(2x, prev)
    assert holm([0.6, 0.6]) == [1.0, 1.0] and holm([]) == [] and holm([None]) == [None]


def test_the_markdown_says_which_differences_survive_holm():
    cells = []
    for s in range(3):
        cells.append(_cell(s, "FedAvg", [0.3, 0.5, 0.69 + 0.01 * s]))
        cells.append(_cell(s, "FedAlign-MoE", [0.4, 0.7, 0.75 + 0.012 * s]))   # about +0.06 in every seed
        cells.append(_cell(s, "FedProx", [0.3, 0.5, 0.7 + 0.011 * s]))         # about +0.01
    cfg = {**CFG, "seeds": [0, 1, 2], "rounds": 3}
    st = H.aggregate(cfg, cells)["bbc Dir(0.1)"]
    ps = {(t["a"], t["b"]): t["global"] for t in st["tests"]}
    tested = [t for t in ps.values() if t["p"] is not None]
    assert len(tested) == 3 and all(t["p_holm"] >= t["p"] for t in tested)
    smallest = min(tested, key=lambda t: t["p"])
    assert smallest["p_holm"] == pytest.approx(min(1.0, 3 * smallest["p"]))      # the first of three: 3 p
    fa = ps[("FedAlign-MoE", "FedAvg")]
    result = {"profile": "full", "profile_config": cfg, "stats": {"bbc Dir(0.1)": st}, "cells": cells, "date": "d",
              "machine": "m", "note": "", "cells_missing": [], "cells_wall_seconds": 60.0}
    line = next(x for x in H.markdown(result, cfg).splitlines() if x.startswith("Holm-Bonferroni"))
    assert "3 tests" in line and ("FedAlign-MoE − FedAvg" in line) == (fa["p_holm"] < 0.05)
