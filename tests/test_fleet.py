"""The fleet load generator (benchmarks/fleet.py) against a real Mosquitto and the real aggregator process:
protocol-level devices with signed, chunked 1 MiB updates; every update accepted exactly once."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

from fedmoe.broker import MosquittoBroker

pytest.importorskip("aiomqtt")
pytestmark = [pytest.mark.slow,  # a fleet of devices over mosquitto
              pytest.mark.skipif(not MosquittoBroker.available(), reason="no mosquitto binary")]


def test_fleet_updates_are_accepted_exactly_once(tmp_path):
    from benchmarks import fleet

    args = Namespace(rounds=2, round_timeout=120.0, procs=1, train_s=0.5, connect_rate=200.0, timeout=240.0,
                     robust="none", fedmoe=str(Path(sys.executable).parent / "fedmoe"))
    s = fleet.run_setting(args, "mosquitto", 12, 8, tmp_path)
    assert s["connected"] == 12 and s["broker_connected"] >= 13  # the devices and the aggregator
    assert s["rounds_closed"] == 2 and not s["timed_out"]
    assert [p["accepted"] for p in s["rounds"]] == [8, 8] and [p["uploaded"] for p in s["rounds"]] == [8, 8]
    assert s["not_accepted"] == 0 and s["reported_twice"] == 0 and s["rejects"] == 0, s
    assert s["update_bytes"] > 2**20  # the realistic size the benchmark claims
    assert s["latency_p99_s"] is not None and s["latency_p99_s"] > 0
