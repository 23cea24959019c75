"""``fedmoe simulate`` end to end in separate processes, as a user runs it."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.mark.slow
def test_simulate_tiny_writes_report_and_plots(tmp_path):
    """Also, where a memory cgroup can be created, every device runs under a hard limit equal
    to its budget (``--device-memory-limit``), as a phone or container would run it; and where
    the native device builds, the first device is one (``--native-devices 1``)."""
    from fedmoe.cgroups import unavailable
    from tests.conftest import native_binary

    limited = unavailable() is None
    native = native_binary(optional=True) is not None
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fedmoe", "simulate", "--tiny", "--out", str(out), "--devices", "3", "--rounds", "2",
         "--max-steps", "4", "--partition", "classes:2", "--eval-max-samples", "64", "--budgets", "700MiB,720MiB"]
        + (["--device-memory-limit"] if limited else []) + (["--native-devices", "1"] if native else []),
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
    if native:  # it took part in every round beside the Python devices, and the device table says what it is
        assert report["config"]["devices"][0]["runtime"] == "native"
        assert all("dev-00" in rnd["devices"] for rnd in report["rounds"]), report["rounds"]
        assert "its sub-MoE (native device)" in proc.stdout
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


def _children(pid: int) -> list[int]:
    """The ids of the processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_simulate_stops_every_process_it_started(tmp_path, sig):
    """A signal to the ``fedmoe simulate`` process alone (not its process group) ends the
    aggregator and device processes it started, at once (fedmoe.supervisor)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fedmoe", "simulate", "--tiny", "--out", str(out), "--devices", "2",
                             "--rounds", "100", "--budgets", "700MiB"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            # a suite run in the background (`cmd &`) starts with SIGINT ignored, which
                            # children inherit: give the command Ctrl-C's default, as a terminal would
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not (out / "logs" / "dev-01.log").exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no device process started within 300 s"
            time.sleep(0.2)
        while len(children := _children(proc.pid)) < 3 and time.monotonic() < deadline:  # the last Popen returns
            time.sleep(0.1)
        assert len(children) >= 3, children  # the aggregator and two devices
        proc.send_signal(sig)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    deadline = time.monotonic() + 30
    while [p for p in children if _running(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in children if _running(p)], "processes left running after the signal"
