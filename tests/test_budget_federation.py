"""Format negotiation and over-budget refusal + reassignment in a real federation."""

import pytest

from moe_model.budget import estimate
from tests.federation import Federation


@pytest.mark.slow
def test_formats_negotiated_and_over_budget_assignment_reassigned(mosquitto_url, tmp_path):
    """dev0 prefers nf4 and gets nf4 shards; dev1 loads only fp16, which the cloud does
    not serve, so it is never selected; dev2 lowers its budget after joining: it refuses
    its 4-expert assignment, the cloud reassigns it within the new budget in the same
    round, and it trains the smaller assignment."""
    fed = Federation(mosquitto_url, str(tmp_path), rounds=1, experts=(4, 4, 4), min_devices=3,
                     config_kw={"weight_formats": ["nf4", "fp32"]})
    spec = fed.aggregator.cfg.model
    small = estimate(spec, 2, 8, len(fed.labels), runtime_bytes=0).total + 1

    def hook(c):
        if c.device_id == "dev0":
            c.weight_formats = ["nf4", "int8"]
            # this tiny model's nf4 plan is the larger (its 32-wide embedding rows are not whole
            # nf4 blocks, so the table is dequantized whole while training): budget for it
            c.budget_bytes = max(c.budget_bytes, estimate(spec, 4, 8, len(fed.labels), 0, "nf4").total + 1)
        elif c.device_id == "dev1":
            c.weight_formats = ["fp16"]
        elif c.device_id == "dev2":
            original = c._train_round

            def shrink_then_train(a):
                c.budget_bytes = small  # the device application took memory after hello
                return original(a)

            c._train_round = shrink_then_train

    fed.client_hook = hook

    records = fed.run(timeout=240)
    (rec,) = records
    assert rec["status"] == "ok"
    assert set(rec["selected"]) == {"dev0", "dev2"}  # dev1 cannot load any served format
    assert rec["devices"]["dev0"]["weight_format"] == "nf4"
    assert rec["devices"]["dev2"]["weight_format"] == "int8"
    r = rec["reassigned"]["dev2"]
    assert r["attempt"] == 1 and r["from"] == {"1": [0, 1, 2, 3]} and len(r["to"]["1"]) == 2
    assert "over budget" in r["reason"]
    dev2 = rec["devices"]["dev2"]
    assert dev2["experts"] == r["to"]
    assert dev2["predicted_peak_bytes"] <= small
    assert not rec["failures"]
    # dev2 fetched only the shards of its smaller assignment
    assert sorted(dev2["shards_fetched"]) == sorted(["backbone"] + [f"L1.E{e}" for e in r["to"]["1"]])


def test_peak_above_plan_is_folded_into_the_runtime_baseline():
    """A measured peak above the plan raises the device's runtime baseline by the excess
    plus the headroom (later plans keep the whole headroom free above what was
    measured); below the plan, or for a client that plans for the model alone
    (runtime_bytes=0), nothing changes."""
    from edge_sdk import EdgeClient

    mib = 2**20
    c = EdgeClient("mqtt://127.0.0.1:1", "d0", [("x", "a")], budget_bytes=900 * mib, runtime_bytes=400 * mib,
                   headroom_bytes=32 * mib)
    c._recalibrate(1, peak=705 * mib, planned=700 * mib)
    assert c.runtime_bytes == (432 + 5 + 32) * mib
    c._recalibrate(2, peak=690 * mib, planned=705 * mib)
    assert c.runtime_bytes == 469 * mib
    z = EdgeClient("mqtt://127.0.0.1:1", "d1", [("x", "a")], budget_bytes=900 * mib, runtime_bytes=0)
    z._recalibrate(1, peak=705 * mib, planned=300 * mib)
    assert z.runtime_bytes == 0


def test_headroom_is_a_margin_not_a_ratchet():
    """A measured baseline gets the default headroom on top; a peak that eats into the
    headroom but stays within the plan changes nothing (the assignment must not shrink
    while budget and plan are unchanged), round after round."""
    from edge_sdk import EdgeClient
    from moe_model.budget import DEFAULT_HEADROOM_BYTES, current_rss_bytes

    mib = 2**20
    c = EdgeClient("mqtt://127.0.0.1:1", "d0", [("x", "a")], budget_bytes=900 * mib, runtime_bytes=400 * mib,
                   headroom_bytes=32 * mib)
    assert c.runtime_bytes == 432 * mib
    for rnd, peak in enumerate((690, 695, 699, 700), 1):  # up to all 32 MiB of the headroom used
        c._recalibrate(rnd, peak=peak * mib, planned=700 * mib)
        assert c.runtime_bytes == 432 * mib
    m = EdgeClient("mqtt://127.0.0.1:1", "d1", [("x", "a")], budget_bytes=900 * mib)
    assert m.headroom_bytes == DEFAULT_HEADROOM_BYTES
    assert DEFAULT_HEADROOM_BYTES < m.runtime_bytes - DEFAULT_HEADROOM_BYTES <= current_rss_bytes()
    with pytest.raises(ValueError, match="headroom"):
        EdgeClient("mqtt://127.0.0.1:1", "d2", [("x", "a")], budget_bytes=900 * mib, headroom_bytes=-1)


@pytest.mark.slow
def test_device_on_the_bitsandbytes_backend_trains_in_a_federation(embedded_url, tmp_path):
    """One device runs its int8 experts on bitsandbytes' Linear8bitLt, the other on the
    plain-torch backend; both rounds close with both updates accepted."""
    pytest.importorskip("bitsandbytes")
    from tests.conftest import TINY_CONFIG

    def hook(c):
        if c.device_id == "dev0":
            c.quant_backend = "bitsandbytes"

    fed = Federation(embedded_url, str(tmp_path), protocol="3.1.1", rounds=2, experts=(2, 2), client_hook=hook,
                     spec_kw={"upcycle_noise": 0.01, "config": {**TINY_CONFIG, "hidden_size": 64,
                                                                "intermediate_size": 128}})
    records = fed.run()
    assert [r["status"] for r in records] == ["ok", "ok"]
    assert all(set(r["devices"]) == {"dev0", "dev1"} for r in records)
    fc1 = fed.clients[0]._held.model.model.bert.encoder.layer[1].intermediate.experts
    assert {type(e.fc1.base_layer).__name__ for e in fc1.values()} == {"Linear8bitLt"}
