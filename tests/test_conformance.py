"""The conformance runner (fedmoe.conformance) passes the reference device and names what a
broken one does wrong, over a real (embedded) broker."""

import threading

import pytest

from edge_sdk import EdgeClient
from edge_sdk.filters import Filter
from fedmoe.conformance import check_device, default_config
from fedmoe.datasets import bbc_news
from tests.conftest import tiny_spec

pytestmark = pytest.mark.slow  # each test runs devices against the runner over a broker


def _config(federation: str, round_timeout_s: float = 20.0):
    cfg = default_config(federation)
    labels = cfg.tasks["bbc"].labels
    return cfg.model_copy(update={"model": tiny_spec(num_experts=4), "round_timeout_s": round_timeout_s,
                                  "start_timeout_s": 60.0}), labels


def _run(url, tmp_path, federation, filters=(), round_timeout_s: float = 20.0):
    cfg, labels = _config(federation, round_timeout_s)
    items, _ = bbc_news()
    device = EdgeClient(url, "dut-1", items[:40], federation=federation, budget_bytes="8GiB", task="bbc",
                        cache_dir=str(tmp_path / "cache"), protocol="3.1.1", filters=list(filters))
    t = threading.Thread(target=lambda: device.run(idle_timeout=120), daemon=True)
    t.start()
    try:
        return check_device(url, "dut-1", cfg.model_copy(update={"protocol": "3.1.1"}), timeout_s=300)
    finally:
        device.stop()
        t.join(30)


def test_the_reference_device_passes(embedded_url, tmp_path):
    report = _run(embedded_url, tmp_path, "conf-ok")
    assert report.passed, "\n".join(report.lines())
    assert [c.number for c in report.checks] == list(range(1, 10))


class _WrongReference(Filter):
    """A device whose stats name another update than the one it sent."""

    def on_stats(self, stats):
        return stats.model_copy(update={"update": stats.update.model_copy(update={"transfer_id": "not-sent"})})


class _MoreSamples(Filter):
    """A device whose stats claim more samples than its hello declared."""

    def on_stats(self, stats):
        return stats.model_copy(update={"num_samples": stats.num_samples * 10})


def test_broken_devices_fail_the_rules_they_break(embedded_url, tmp_path):
    # the cloud itself matches stats to the update by sha256, so only the runner notices
    report = _run(embedded_url, tmp_path / "a", "conf-ref", filters=[_WrongReference()])
    failed = {c.number: c.detail for c in report.checks if not c.passed}
    assert set(failed) == {6}, "\n".join(report.lines())
    assert "not-sent" in failed[6]
    # its stats are refused, so its round waits out the deadline: a short one (the device's messages
    # of the round take about a second; the runner checks them, not the wait)
    report = _run(embedded_url, tmp_path / "b", "conf-samples", filters=[_MoreSamples()], round_timeout_s=8.0)
    failed = {c.number: c.detail for c in report.checks if not c.passed}
    assert set(failed) == {8, 9}, "\n".join(report.lines())
    assert "stats round 1" in failed[8] and "samples" in failed[8]


def test_the_native_device_passes(embedded_url, tmp_path):
    """The native device (``fedmoe-device``, C++ on ExecuTorch's runtime), on MQTT 3.1.1, with
    the shards and its training program served over HTTP."""
    import subprocess

    pytest.importorskip("executorch")
    from fedmoe.native_data import write_token_file
    from tests.conftest import native_binary

    device = native_binary()
    cfg, _ = _config("conf-native", round_timeout_s=60.0)
    items, _ = bbc_news()
    data = write_token_file(items[:40], cfg.model, tmp_path / "dut.tokens.safetensors")
    with open(tmp_path / "dut.log", "w") as log:
        proc = subprocess.Popen([str(device), "--broker", embedded_url, "--device-id", "dut-n", "--federation",
                                 "conf-native", "--task", "bbc", "--budget", "8GiB", "--data", str(data), "--cache",
                                 str(tmp_path / "cache"), "--protocol", "3.1.1", "--idle-timeout", "120"], stderr=log)
        try:
            report = check_device(embedded_url, "dut-n", cfg.model_copy(update={"protocol": "3.1.1"}), timeout_s=300,
                                  serve_files=True)
        finally:
            proc.terminate()
            proc.wait(30)
    assert report.passed, "\n".join(report.lines()) + "\n" + (tmp_path / "dut.log").read_text()[-3000:]
