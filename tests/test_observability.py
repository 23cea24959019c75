"""The aggregator's operator endpoints (issue 17): Prometheus /metrics, /healthz, /readyz."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud.config import AggregatorConfig
from cloud.observability import MAX_REASONS, AggregatorMetrics, parse_address
from protocol.logsafe import reason_class


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_reason_classes_are_bounded_and_free_of_ids():
    assert reason_class("over budget: the memory plan needs 900 MiB") == "over budget"
    assert reason_class("device 'dev-17' sent 3 chunks") == "device '...' sent N chunks"
    assert len(reason_class("x" * 500)) == 80

    m = AggregatorMetrics(_service())
    for i in range(MAX_REASONS + 20):
        m.on_reject(f"reason {chr(65 + i % 26)}{chr(65 + i // 26)}: detail")
    values = {dict(k[1]).get("reason") for k in samples(_latest(m)) if k[0] == "fedmoe_messages_rejected_total"}
    assert len(values) == MAX_REASONS + 1 and "other" in values


def _latest(m: AggregatorMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(m.registry).decode()


def test_metrics_address_is_checked():
    assert parse_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_address("[::1]:9464") == ("::1", 9464)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("localhost")
    from cloud.config import TaskConfig

    TASKS = {"bbc": TaskConfig(labels=["a", "b"])}
    assert AggregatorConfig(tasks=TASKS, metrics="[::1]:9464").metrics == "[::1]:9464"
    with pytest.raises(ValueError, match="metrics"):
        AggregatorConfig(tasks=TASKS, metrics="127.0.0.1")
    with pytest.raises(ValueError, match="metrics"):
        AggregatorConfig(tasks=TASKS, metrics="127.0.0.1:99999x")


@pytest.mark.slow
def test_metrics_during_a_federation_match_the_round_records(embedded_url, tmp_path):
    from tests.federation import Federation

    fed = Federation(embedded_url, str(tmp_path), rounds=3, experts=(2, 4, 4),
                     config_kw={"metrics": "127.0.0.1:0"})
    seen: dict = {}

    def during(f):
        deadline = time.time() + 150
        while f.aggregator.engine.completed < 1 and time.time() < deadline:
            time.sleep(0.2)
        port = f.aggregator.metrics_port
        assert port, "metrics not served"
        seen["healthz"] = scrape(port, "/healthz")
        seen["readyz"] = scrape(port, "/readyz")
        seen["404"] = scrape(port, "/nope")[0]
        status, text = scrape(port)
        closed = f.aggregator.store.rounds()
        seen.update(status=status, metrics=samples(text), closed=closed,
                    current=f.aggregator.engine.current.selected if f.aggregator.engine.current else set())

    records = fed.run(during, timeout=400)
    assert seen["healthz"] == (200, "ok\n") and seen["readyz"] == (200, "ok\n") and seen["404"] == 404
    m, closed = seen["metrics"], seen["closed"]
    in_closed = sum(len(r["devices"]) for r in closed)
    accepted = m[("fedmoe_updates_accepted_total", ())]
    assert in_closed <= accepted <= in_closed + len(seen["current"])  # reports of the open round count too
    assert m[("fedmoe_rounds_closed_total", (("status", "ok"),))] == len(closed)
    assert m[("fedmoe_devices_online", ())] == 3 and m[("fedmoe_devices_registered", ())] == 3
    assert m[("fedmoe_received_bytes_total", ())] > 0 and m[("process_resident_memory_bytes", ())] > 0
    last = closed[-1]
    assert m[("fedmoe_global_accuracy", (("task", "bbc"),))] == pytest.approx(last["per_task"]["bbc"]["accuracy"])
    for layer, cv in last["cv_per_layer"].items():
        assert m[("fedmoe_expert_load_cv", (("layer", str(layer)),))] == pytest.approx(cv)
    # after the run, the counters equal the store's records exactly
    final = samples(_latest(fed.aggregator.metrics))
    assert final[("fedmoe_updates_accepted_total", ())] == sum(len(r["devices"]) for r in records)
    assert final[("fedmoe_rounds_opened_total", ())] == len(records) == 3
    assert final[("fedmoe_round_duration_seconds_count", ())] == 3
    assert final[("fedmoe_store_write_seconds_count", ())] == 3
    assert fed.aggregator.metrics_port is None  # the listener closed with the service


def test_status_prints_the_store_s_device_and_round_tables(tmp_path, capsys):
    """``fedmoe status`` on a stopped service's store: the values the store holds."""
    from cloud.store import Store
    from fedmoe.cli import main

    url = f"sqlite:///{tmp_path}/agg.db"
    store = Store(url)
    store.save_device("dev-a", {"device_id": "dev-a", "task": "bbc", "budget_bytes": 512 * 2**20, "num_samples": 9,
                                "weight_formats": ["int8"], "runtime_bytes": 300 * 2**20, "online": True})
    store.save_device("dev-b", {"device_id": "dev-b", "task": "bbc", "budget_bytes": 256 * 2**20, "num_samples": 9,
                                "weight_formats": ["int8"], "online": False})
    store.save_round({"round": 1, "status": "ok", "accuracy": 0.5, "loss": 1.25, "selected": ["dev-a", "dev-b"],
                      "devices": {"dev-a": {"experts": {"1": [0, 3], "3": [2]}, "peak_bytes": 384 * 2**20,
                                            "budget_bytes": 512 * 2**20}},
                      "excluded": {"dev-b": "over budget: the plan needs 300 MiB"}, "bytes_up": 2**20,
                      "bytes_down": 3 * 2**20, "seconds": 12.0, "cv": 0.25})
    store.put_json("last_round", 1)
    store.close()
    assert main(["status", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "2 devices registered, 1 online; 1 rounds completed" in out
    dev_a = next(line for line in out.splitlines() if line.startswith("dev-a"))
    assert dev_a.split()[:9] == ["dev-a", "bbc", "yes", "-", "512", "300", "3", "384", "(75%)"]  # never seen
    dev_b = next(line for line in out.splitlines() if line.startswith("dev-b"))
    assert "over budget: the plan needs 300 MiB" in dev_b and " no " in dev_b
    round_1 = next(line for line in out.splitlines() if line.startswith("1 "))
    assert round_1.split() == ["1", "-", "ok", "1/2", "0.500", "1.250", "-", "1.00", "3.00", "12.0", "1", "0.250"]
    assert "Open round: none" in out
    assert main(["status", "--store", f"sqlite:///{tmp_path}/none.db"]) == 2  # nothing created
    assert not (tmp_path / "none.db").exists()


def _service(url: str = "mqtt://127.0.0.1:1", store: str = "sqlite://"):
    """What the metrics read of an aggregator: a real transport, store and registry."""
    from cloud.registry import Registry
    from cloud.store import Store
    from protocol.transport import Transport

    class Service:
        pass

    s = Service()
    s.transport, s.store = Transport(url, "metrics-probe"), Store(store)
    s.registry = Registry(s.store)
    return s


def test_readyz_needs_the_broker_and_the_store(mosquitto_url, tmp_path):
    Service = _service(mosquitto_url, f"sqlite:///{tmp_path}/s.db")
    m = AggregatorMetrics(Service)
    port = m.serve("127.0.0.1", 0)
    try:
        assert scrape(port, "/readyz") == (503, "broker not connected\n")
        Service.transport.connect()
        assert scrape(port, "/readyz") == (200, "ok\n")
        Service.store._engine.dispose()
        Service.store._engine = __import__("sqlalchemy").create_engine(f"sqlite:///{tmp_path}/missing/dir/x.db")
        status, body = scrape(port, "/readyz")
        assert status == 503 and body.startswith("store not reachable")
        assert scrape(port, "/healthz") == (200, "ok\n")
    finally:
        m.stop()
        Service.transport.close()


def test_open_round_gauges_and_the_grafana_dashboard_s_series(tmp_path):
    """The open round's gauges follow the engine's round; every series the Grafana dashboard
    (examples/deploy/grafana-dashboard.json) queries is one this exporter serves."""
    import json
    import re
    from pathlib import Path
    from types import SimpleNamespace

    service = _service(store=f"sqlite:///{tmp_path}/s.db")
    service.engine = SimpleNamespace(current=None)
    m = AggregatorMetrics(service)
    try:
        values = samples(_latest(m))
        assert values[("fedmoe_round_open_seconds", ())] == 0 and values[("fedmoe_round_timeout_seconds", ())] == 0
        service.engine.current = SimpleNamespace(started=time.time() - 90, deadline=time.time() + 150)
        text = _latest(m)
        values = samples(text)
        assert 90 <= values[("fedmoe_round_open_seconds", ())] < 120
        assert values[("fedmoe_round_timeout_seconds", ())] == pytest.approx(240, abs=1)
        served = {f.name for f in text_string_to_metric_families(text)}
        dashboard = json.loads((Path(__file__).parents[1] / "examples/deploy/grafana-dashboard.json").read_text())
        queried = {re.sub(r"_(total|bucket|count|sum)$", "", name) for p in dashboard["panels"] for t in p["targets"]
                   for name in re.findall(r"\b(?:fedmoe|process)_[a-z_]+", t["expr"])}
        assert queried and queried <= served, queried - served
        assert {"fedmoe_round_open_seconds", "fedmoe_global_accuracy", "fedmoe_devices_online",
                "fedmoe_messages_rejected", "fedmoe_received_bytes"} <= queried
    finally:
        service.transport.close()
        service.store.close()
