"""Fail fast, never hang: bad settings are refused before any set-up, with a one-line
reason and exit code 2 (issue "steady device")."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedmoe.simulate import SimulationConfig, SimulationConfigError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "aggregator.yaml"


def _fedmoe(*args: str, timeout: float = 90, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fedmoe", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)
    return proc, time.monotonic() - t0


# --------------------------------------------------------------------------- simulate


@pytest.mark.slow
def test_simulate_budget_below_one_expert_fails_fast_with_the_smallest_budget(tmp_path):
    proc, seconds = _fedmoe("simulate", "--tiny", "--budget-range", "10MiB:20MiB", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert seconds < 60
    assert "smallest budget" in proc.stderr and "--budget-range" in proc.stderr
    assert "dev-00" in proc.stderr  # the devices below are named
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no process was started


@pytest.mark.parametrize("args, message", [
    (["--devices", "0"], "--devices must be at least 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--tasks", "bbc,nope"], "unknown task 'nope'"),
    (["--top-k", "9"], "--top-k 9 exceeds --num-experts 8"),
])
def test_simulate_rejects_bad_arguments_before_any_set_up(tmp_path, args, message):
    proc, _ = _fedmoe("simulate", "--tiny", *args, "--out", str(tmp_path / "run"), timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # refused before any set-up (before: 44 s of it for --rounds 0): no log line, no run directory.
    # Not timed: the imports alone took 10.8 s with the suite's other workers busy, over a 10 s bound
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedmoe: error: ") and message in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_validate_lists_every_problem_in_one_line():
    with pytest.raises(SimulationConfigError) as e:  # the config validates on construction (pydantic)
        SimulationConfig(devices=0, rounds=0, tasks=["bbc", "nope"], partition="zipf:3", quorum=0.0,
                         batch_size=0, num_experts=2, top_k=3, weight_format="int4").validate()
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, ValueError)
    for part in ("--devices", "--rounds", "unknown task 'nope'", "partition", "quorum", "--batch-size",
                 "--top-k 3 exceeds --num-experts 2", "--weight-format 'int4'"):
        assert part in msg, part


@pytest.mark.parametrize("change, message", [
    (dict(budget_range=("2GiB", "1GiB")), "LO exceeds HI"),
    (dict(budget_range=("10XB", "1GiB")), "--budget-range: cannot parse"),
    (dict(budgets=["1GiB", "lots"]), "--budgets: cannot parse"),
    (dict(max_seq_len=4), "max_seq_len"),
    (dict(full_finetune=True), "--full-finetune needs --weight-format fp32"),
    (dict(devices=1, tasks=["bbc", "tweets"]), "at least one device per task"),
    (dict(weight_format="nf4", device={"formats": ["int8", "fp32"]}), r"the devices load only \['int8', 'fp32'\]"),
])
def test_validate_rejects(change, message):
    with pytest.raises(SimulationConfigError, match=message):
        SimulationConfig(**change).validate()


def test_validate_accepts_the_defaults_and_the_tiny_run():
    assert SimulationConfig().validate() is not None
    SimulationConfig(budget_range=("700MiB", "700MiB"), base=None, tasks=["bbc", "tweets"]).validate()


def test_check_budgets_names_devices_below_one_expert_per_layer(tmp_path):
    from fedmoe.simulate import check_budgets
    from tests.conftest import TINY_CONFIG

    cfg = SimulationConfig(devices=3, budgets=["100MiB", "2GiB"], base=None, model_config=TINY_CONFIG,
                           num_experts=4)
    devices = [{"device_id": f"dev-{i:02d}", "task": "bbc", "data": "-", "budget_bytes": b}
               for i, b in enumerate([100 * 2**20, 2 * 2**30, 100 * 2**20])]
    with pytest.raises(SimulationConfigError) as e:
        check_budgets(cfg, devices, baseline=400 * 2**20)
    msg = str(e.value)
    assert "2 of 3 devices (dev-00 100 MiB, dev-02 100 MiB)" in msg and "smallest budget that works here is" in msg
    need = int(msg.split("smallest budget that works here is ")[1].split(" MiB")[0])
    assert 400 < need < 2048 and f"--budgets {need}MiB" in msg
    for d in devices:
        d["budget_bytes"] = need * 2**20
    check_budgets(cfg, devices, baseline=400 * 2**20)  # the suggested budget passes
    check_budgets(SimulationConfig(), devices, baseline=10**12)  # auto budgets are not checked
    from moe_model.budget import estimate
    from fedmoe.simulate import _model_dict
    from protocol.messages import ModelSpec

    one, every = (estimate(ModelSpec(**_model_dict(cfg)), k, 8, 5, 400 * 2**20).total for k in (1, 4))
    assert one < every
    for d in devices:
        d["budget_bytes"] = one
    cfg.assignment = "full"  # every device would sit out: no device holds all experts
    with pytest.raises(SimulationConfigError, match="no device budget holds all 4 experts"):
        check_budgets(cfg, devices, baseline=400 * 2**20)
    devices[1]["budget_bytes"] = every
    check_budgets(cfg, devices, baseline=400 * 2**20)


def test_builtin_test_set_is_the_simulators_test_split(tmp_path):
    from edge_sdk.data import load_text_file
    from fedmoe.simulate import _prepare_data, builtin_test_set

    cfg = SimulationConfig(devices=2, budgets=["1GiB"])
    _prepare_data(cfg, tmp_path)
    items, labels = builtin_test_set("bbc")
    assert load_text_file(tmp_path / "test-bbc.jsonl").items == items
    assert len(items) == 445 and labels == ["business", "entertainment", "politics", "sports", "tech"]


# --------------------------------------------------------------------------- aggregator


def test_example_aggregator_config_loads_and_passes_the_check():
    from cloud.service import AggregatorConfig
    from fedmoe.cli import _builtin_eval_data

    cfg = AggregatorConfig.load(EXAMPLE)
    assert cfg.tasks["bbc"].eval_data == "builtin:bbc"
    eval_data = _builtin_eval_data(cfg)
    assert len(eval_data["bbc"]) == 445
    assert cfg.check_paths(eval_given=eval_data) is cfg
    with pytest.raises(ValueError, match="builtin:bbc.*only the fedmoe command"):
        cfg.check_paths()  # the cloud layer alone cannot resolve builtin: names


@pytest.mark.parametrize("key", ["round_timeout_s", "start_timeout_s", "clients_per_round", "resume_drain_s"])
def test_infinite_or_nan_durations_refused(key):
    """`.inf` in YAML is a float: a round that never times out would hang the federation."""
    from pydantic import ValidationError

    from cloud.service import AggregatorConfig

    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="finite number"):
            AggregatorConfig(tasks={"t": {"labels": ["a", "b"]}}, **{key: bad})


def _no_model(*args, **kwargs):
    raise AssertionError("the model was set up before the config was checked")


def test_aggregator_refuses_missing_files_before_building_anything(tmp_path, monkeypatch):
    import cloud.service as S

    monkeypatch.setattr(S, "GlobalModel", _no_model)
    monkeypatch.setattr(S, "Store", _no_model)
    cfg = S.AggregatorConfig.load(EXAMPLE, store="mongodb://db/x", credentials=str(tmp_path / "agg.json"))
    cfg.tasks["bbc"].eval_data = str(tmp_path / "test-bbc.jsonl")
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        S.Aggregator(cfg, "mqtt://127.0.0.1:1")
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "tasks.bbc.eval_data: no such file" in msg and "test-bbc.jsonl" in msg
    assert "credentials: no such file" in msg and "store: unsupported store URL 'mongodb://db/x'" in msg
    cfg.tasks["bbc"].eval_data = "builtin:bbc"
    with pytest.raises(ValueError, match="builtin:bbc"):
        S.Aggregator(cfg.model_copy(update={"store": "sqlite://", "credentials": None}), "mqtt://127.0.0.1:1")


@pytest.mark.slow
def test_cli_aggregator_reports_a_bad_config_in_one_line(tmp_path):
    bad = tmp_path / "agg.yaml"
    bad.write_text(EXAMPLE.read_text().replace("builtin:bbc ", "test-bbc.jsonl "))
    proc, seconds = _fedmoe("aggregator", "--config", str(bad), "--store", f"sqlite:///{tmp_path}/a.db",
                            timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "fedmoe: error:" in proc.stderr and "no such file 'test-bbc.jsonl'" in proc.stderr
    assert "Traceback" not in proc.stderr and "global model" not in proc.stderr
    assert not (tmp_path / "a.db").exists()
    proc, _ = _fedmoe("aggregator", "--config", str(bad).replace("agg.yaml", "builtin:bbcx.yaml"), timeout=60)
    assert proc.returncode == 2 and "No such file" in proc.stderr


# --------------------------------------------------------------------------- noise


@pytest.mark.slow
def test_no_bitsandbytes_kernels_notice_on_import():
    proc = subprocess.run([sys.executable, "-c", "import edge_sdk.client, cloud.service"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gemm_4bit" not in proc.stderr


def test_other_bitsandbytes_warnings_still_pass():
    import edge_sdk  # noqa: F401  (installs the filter)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")

    def record(msg: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, ("x",), None)

    assert not logger.filter(record("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ..."))
    assert logger.filter(record("some other bitsandbytes warning: %s"))


def test_an_exception_text_of_any_length_still_makes_a_valid_ack():
    """A round that fails with a 5,000-character error is refused with a valid ack (the
    reason cut to the schema's 1,000 characters) instead of the device stopping."""
    from edge_sdk.client import EdgeClient
    from protocol.messages import Ack, parse_message
    from protocol.topics import Topics

    sent = []
    client = EdgeClient.__new__(EdgeClient)
    client.device_id, client.topics = "dev-1", Topics("ff")
    client.transport = type("T", (), {"publish": lambda self, topic, payload, **kw: sent.append(payload)})()
    client._ack(3, False, "round failed on device: " + "x" * 5000)
    ack = parse_message(sent[0], Ack)
    assert not ack.accepted and len(ack.reason) == 1000 and ack.reason.startswith("round failed on device: x")
