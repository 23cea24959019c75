"""benchmarks/harness.py: config loading and checks, the settings grid, budgets, the
markdown of synthetic cells, and one tiny grid run end to end (two cells over the
embedded broker)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks import harness as H

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "benchmarks" / "configs"


def _write(tmp_path, **changes):
    cfg = yaml.safe_load((CONFIGS / "fedmoe_experts.yaml").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_config_loads_in_both_profiles(path):
    for profile in ("full", "quick"):
        cfg = H.load_config(path, profile)
        assert H.settings(cfg) and cfg["methods"]
        assert all(H.methods_for(cfg, s) for s in H.settings(cfg))


COMMITTED = sorted([*ROOT.glob("results/*_table*.json"), *ROOT.glob("results/evidence/*.json")])
COMMITTED = [p for p in COMMITTED if p.stem != "expert_choice"]  # a measurement, not a table


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_rendering_a_committed_table_again_gives_its_committed_markdown_and_json(tmp_path, path, caplog):
    """--render from the committed JSON alone: the statistics recomputed from its cells equal
    the recorded ones, and the markdown and JSON written are the committed ones."""
    import shutil

    shutil.copy(path, tmp_path / path.name)
    assert H.main(["--render", str(tmp_path / path.name)]) == 0
    assert not [r for r in caplog.records if "differ" in r.getMessage()]
    assert (tmp_path / path.name).read_text() == path.read_text()
    assert (tmp_path / f"{path.stem}.md").read_text() == path.with_suffix(".md").read_text()


def test_a_config_names_an_unknown_table_or_ablation_reference(tmp_path):
    with pytest.raises(H.ConfigError, match="no module benchmarks.nope"):
        H.load_config(_write(tmp_path, table="nope"))
    with pytest.raises(H.ConfigError, match="ablations_against: 'nobody'"):
        H.load_config(_write(tmp_path, ablations={"X": {"strategy": "composed"}}, ablations_against="nobody"))


def test_profiles_override_by_dotted_key_and_the_grid_is_a_product(tmp_path):
    cfg = H.load_config(_write(tmp_path, grid={"data": ["bbc", "tweets"], "partition": {"IID": "iid",
                                                                                       "Dir(0.1)": "dirichlet:0.1"},
                                               "devices": [4, 8]}), "quick")
    assert cfg["seeds"] == [0] and cfg["rounds"] == 2 and cfg["grid"]["data"] == ["bbc"]     # quick's overrides
    assert list(H.settings(cfg)) == ["bbc IID 4", "bbc IID 8", "bbc Dir(0.1) 4", "bbc Dir(0.1) 8"]
    assert H.settings_of(cfg)["bbc Dir(0.1) 8"] == {"data": "bbc", "partition": "dirichlet:0.1", "devices": 8}


@pytest.mark.parametrize("changes, match", [
    ({"rounds": None}, "missing rounds"),
    ({"compare": [["FedMoE", "nobody"]]}, "'nobody' is not a method"),
    ({"grid": {"data": ["mnist"]}}, "unknown source 'mnist'"),
    ({"grid": {"clients": [3]}}, "unknown axis 'clients'"),
    ({"budgets": {"experts": [2]}}, "budgets"),
    ({"methods": {"X": {"assignment": "full"}}, "compare": []}, "method 'X' has no strategy"),
    ({"methods": {"X": {"strategy": "composed", "update": {"precision": "int4"}}}, "compare": []},
     "update precision must be one of"),
    ({"methods": {"X": {"strategy": "composed", "state_precision": "int4"}}, "compare": []},
     "state_precision 'int4' is not one of"),
    ({"methods": {"X": {"strategy": "composed", "weight_format": "int4"}}, "compare": []},
     "weight_format 'int4' is not one of"),
    ({"methods": {"X": {"strategy": "composed", "update": {"precision": "int8", "error_feedback": True}}},
      "compare": []}, "error_feedback needs delta"),
    ({"methods": {"X": {"strategy": "composed", "update": {"bits": 4}}}, "compare": []}, "unexpected keyword"),
])
def test_bad_configs_fail_with_the_reason(tmp_path, changes, match):
    with pytest.raises(H.ConfigError, match=match):
        H.load_config(_write(tmp_path, **changes))
    with pytest.raises(H.ConfigError, match="no profile 'fast'"):
        H.load_config(_write(tmp_path), "fast")


def test_cycle_budgets_hold_exactly_their_expert_counts(tmp_path):
    from moe_model.budget import estimate

    cfg = H.load_config(_write(tmp_path, budgets={"cycle": [2, 16]}))
    spec = H.spec_for(cfg, "bbc", 0)
    b = H.budgets_for(cfg, spec, 5, 3, 0, "int8")
    plan = {k: estimate(spec, k, 8, 5, runtime_bytes=0, weight_format="int8").total for k in (2, 3, 16)}
    assert b == [plan[2] + 1, plan[16] + 1, plan[2] + 1] and b[0] < plan[3]
    assert len(spec.moe_layers) == 6 and spec.num_experts == 16


def test_markdown_says_better_only_where_significant(tmp_path):
    cfg = H.load_config(_write(tmp_path))
    rows = []
    for s in range(3):
        for m, acc in (("FedMoE", 0.70 + 0.01 * s), ("randomMoE (same sizes)", 0.65 + 0.01 * s),
                       ("FLEX", [0.6, 0.8, 0.7][s])):
            rows.append({"seed": s, "setting": "bbc Dir(0.5) 6", "method": m, "accuracy": acc, "local_accuracy": 0.6,
                         "accuracy_per_round": [0.4, acc], "initial_accuracy": 0.2, "experts_held_mean": 40.0,
                         "mib_per_device_round": 1.0, "devices_trained": 6, "planned_peak_mib": 30.0,
                         "cv_usage": {"FedMoE": 0.9}.get(m, 0.5) + 0.01 * s, "cv_assigned": 0.1,
                         "sanity": {"problems": []}})
    result = {"config": cfg, "stats": H.aggregate(cfg, rows), "cells": rows, "profile": "full", "date": "d",
              "machine": "m", "note": "", "config_path": "c.yaml", "cells_missing": []}
    md = H.markdown(result)
    line = next(x for x in md.splitlines() if x.startswith("| FedMoE − randomMoE"))
    cols = [c.strip() for c in line.split("|")]
    assert cols[3].startswith("**better**") and cols[7].startswith("**worse**") and cols[8] == "1.78"  # 0.91 / 0.51
    line = next(x for x in md.splitlines() if x.startswith("| FedMoE − FLEX"))
    assert "no sig. difference" in line


def test_reused_rows_stand_in_for_cells_this_checkout_lacks(tmp_path):
    """--reuse: a committed table's rows fill the cells with no report; --collect lists only the rest."""
    import argparse
    import json

    from benchmarks import cells

    table = tmp_path / "t.json"
    row = {"seed": 0, "setting": "a 10", "method": "M", "measured": "2026-01-01 00:00 UTC", "accuracy": 0.5,
           "wall_seconds": 1.0, "sanity": {"problems": []}}
    table.write_text(json.dumps({"cells": [row]}))
    args = argparse.Namespace(force=False, collect=True, lock=None, threads=1, reuse=str(table))
    todo = [(0, "a 10", "M", {}), (1, "a 10", "M", {})]
    rows, missing = cells.run_cells(todo, tmp_path / "runs", args, run=None, summarise=None)
    assert [r["accuracy"] for r in rows] == [0.5] and rows[0]["reused_from"] == str(table)
    assert missing == ["s1 a 10 / M"]
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="not a table result"):
        cells.reusable_rows(str(tmp_path / "bad.json"))


@pytest.mark.slow
def test_a_tiny_grid_runs_end_to_end_and_every_cell_starts_with_empty_shard_caches(tmp_path):
    """Two cells of the same method in one run: the second pays for its base shards in round 1
    as the first did (no cache shared between cells, so bytes compare across methods), its
    int8 update encoding shrinks the upload, and the table, JSON and plot are written."""
    import json
    import logging

    cfg = yaml.safe_load((CONFIGS / "fedmoe_experts.yaml").read_text())
    cfg.update(name="tiny", model={"num_experts": 4, "top_k": 2, "max_seq_len": 16, "moe_layers": [5]},
               grid={"data": ["bbc"], "partition": {"IID": "iid"}, "devices": [2]}, samples=24, eval_samples=16,
               budgets={"cycle": [2, 4]}, train={"max_steps": 1, "batch_size": 4, "lr": 0.003}, rounds=1, seeds=[0],
               methods={"first": {"strategy": "composed", "assignment": "greedy"},
                        "second": {"strategy": "composed", "assignment": "greedy",
                                   "update": {"precision": "int8", "delta": True, "error_feedback": True}}},
               compare=[["first", "second"]], profiles={})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    quieted = ("amqtt", "transitions", "cloud", "edge_sdk", "moe_model", "protocol", "fedmoe")
    levels = {n: logging.getLogger(n).level for n in quieted}
    try:
        assert H.main(["--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "res"), str(path)]) == 0
    finally:  # the harness quiets these loggers for its run; later tests expect them as they were
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)
    fetched, up = {}, {}
    for m in ("first", "second"):
        (report,) = (tmp_path / "runs" / "tiny" / "full" / "s0").glob(f"*--{m}/report.json")
        devices = json.loads(report.read_text())["rounds"][0]["devices"]
        fetched[m] = {d: len(v["shards_fetched"]) for d, v in devices.items()}
        up[m] = sum(v["payload_up"] for v in devices.values())
        assert not (report.parent / "shards").exists()
    assert fetched["first"] == fetched["second"] and all(n > 0 for n in fetched["first"].values())
    assert up["second"] < 0.5 * up["first"], up  # int8 values (~1 byte) instead of fp32
    result = json.loads((tmp_path / "res" / "tiny.json").read_text())
    assert len(result["cells"]) == 2 and (tmp_path / "res" / "tiny.png").exists()
    assert "first − second" in (tmp_path / "res" / "tiny.md").read_text()


def test_the_fedmoe_table_rows_are_per_task_and_render_in_its_own_markdown():
    """fedmoe_table's cells are `fedmoe simulate` runs with two tasks: a row per cell holds
    each task's accuracy, and the table (no statistics over seeds) renders them."""
    from benchmarks import fedmoe_table as F

    cfg = H.load_config(F.CONFIG, "quick")
    dev = lambda up, acc: {"bytes_up": up, "bytes_down": 2 * up, "peak_rss_bytes": 2**29, "val_accuracy": acc}  # noqa
    report = {"config": {"devices": [{"device_id": "d0", "task": "bbc"}, {"device_id": "d1", "task": "tweets"}]},
              "initial_per_task": {"bbc": {"accuracy": 0.2}, "tweets": {"accuracy": 0.3}}, "wall_seconds": 5.0,
              "rounds": [{"round": 1, "status": "ok", "per_task": {"bbc": {"accuracy": 0.5}, "tweets": {"accuracy": 0.4}},
                          "devices": {"d0": dev(10**6, 0.6), "d1": dev(10**6, 0.7)}},
                         {"round": 2, "status": "timeout", "per_task": {"bbc": {"accuracy": 0.6}},
                          "devices": {"d0": dev(10**6, 0.8)}}]}
    row = F.summarise(report)
    assert row["accuracy"] == {"bbc": 0.6, "tweets": None} and row["local_accuracy"] == {"bbc": 0.8, "tweets": 0.7}
    assert row["comm_gb"] == pytest.approx(9e-3) and row["devices_trained"] == 2
    assert row["sanity"]["problems"] == ["round 2: status timeout"]
    result = {"profile": "quick", "profile_config": H.profile_config(cfg), "budgets_bytes": [2**29] * 2, "date": "d",
              "machine": "m", "note": "", "cells": [{"seed": 0, "setting": "Standard-Hetero-T", "method": "FedMoE",
                                                      "measured": "d", **row}], "cells_missing": []}
    md = H.markdown(result, cfg)
    assert "| FedMoE | 0.600 | – | 0.800 | 0.700 |" in md and "## Ablation (Standard-Hetero-T)" in md
