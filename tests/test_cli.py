"""``fedmoe simulate`` end to end in separate processes, as a user runs it."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_simulate_tiny_writes_report_and_plots(tmp_path):
    """Also, where a memory cgroup can be created, every device runs under a hard limit equal
    to its budget (``--device-memory-limit``), as a phone or container would run it."""
    from fedmoe.cgroups import unavailable

    limited = unavailable() is None
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fedmoe", "simulate", "--tiny", "--out", str(out), "--devices", "3", "--rounds", "2",
         "--max-steps", "4", "--partition", "classes:2", "--eval-max-samples", "64", "--budgets", "700MiB,720MiB"]
        + (["--device-memory-limit"] if limited else []),
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["initial_accuracy"] is not None and len(report["rounds"]) == 2
    assert report["config"]["simulation"]["partition"] == "classes:2"
    assert [d["budget_bytes"] for d in report["config"]["devices"]] == [700 * 2**20, 720 * 2**20, 700 * 2**20]
    r = report["rounds"][-1]
    for key in ("round", "accuracy", "mean_local_accuracy", "loss", "seconds", "bytes_up", "bytes_down",
                "expert_load", "cv", "max_min_gap", "devices"):
        assert key in r
    dev = next(iter(r["devices"].values()))
    for key in ("bytes_up", "bytes_down", "peak_rss_bytes", "budget_bytes", "experts", "shards_fetched", "samples"):
        assert key in dev
    for png in ("accuracy.png", "bytes.png", "expert_load.png"):
        assert (out / png).stat().st_size > 1000
    assert "round" in proc.stdout and "MiB down" in proc.stdout  # the per-round table
    if limited:
        cg = report["device_cgroups"]
        assert sorted(cg) == sorted(r["devices"]) and all(c["oom_kills"] == 0 for c in cg.values()), cg
        assert all(0 < c["peak_bytes"] <= c["limit_bytes"] for c in cg.values()), cg


@pytest.mark.slow
def test_cli_rejects_bad_arguments(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedmoe", "simulate", "--partition", "zipf:3", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "partition" in proc.stderr
    bad = tmp_path / "d.csv"
    bad.write_text("words,y\nhello,1\n")
    proc = subprocess.run([sys.executable, "-m", "fedmoe", "device", "--broker", "mqtt://127.0.0.1:1", "--device-id",
                           "d1", "--budget", "1GiB", "--data", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "text and label" in proc.stderr
