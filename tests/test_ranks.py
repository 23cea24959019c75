"""Heterogeneous LoRA ranks over a frozen, shared A (moe_model.ranks): the FedAvg of the
padded B factors is exactly the average of the devices' weight updates, a rank-r device
builds the global model's LoRA scaling, and a federation gives a small device a lower rank
and more experts."""

from __future__ import annotations

import pytest
import torch

from moe_model.ranks import at_rank, expected_at_rank, pad_rank, rank_ladder, spec_at_rank
from moe_model.submoe import lora_a_init
from protocol.messages import Assignment, BlobRef, LoraSpec, ModelSpec, TrainConfig
from tests.conftest import tiny_spec


def test_rank_ladder_halves_down_to_the_minimum():
    assert rank_ladder(8, 2) == [8, 4, 2]
    assert rank_ladder(8, 3) == [8, 4, 3]
    assert rank_ladder(8, 8) == [8]
    assert rank_ladder(16, 1) == [16, 8, 4, 2, 1]
    for bad in (0, 9):
        with pytest.raises(ValueError, match="minimum LoRA rank"):
            rank_ladder(8, bad)


def test_a_lower_rank_keeps_the_global_scaling_and_the_first_rows_of_a():
    spec = ModelSpec(lora=LoraSpec(rank=8, alpha=16.0))
    low = spec_at_rank(spec, 2)
    assert low.lora.rank == 2 and low.lora.alpha / low.lora.rank == spec.lora.alpha / spec.lora.rank
    assert spec_at_rank(spec, 8) is spec
    assert torch.equal(lora_a_init(7, "expert.1.0.fc1.lora_A", (8, 32))[:2],
                       lora_a_init(7, "expert.1.0.fc1.lora_A", (2, 32)))  # what makes the rule exact
    with pytest.raises(ValueError, match="outside"):
        spec_at_rank(spec, 9)
    with pytest.raises(ValueError, match="frozen, shared A"):
        spec_at_rank(spec.model_copy(update={"lora": LoraSpec(rank=8, train_a=True)}), 2)


def test_fedavg_of_padded_b_is_the_average_of_the_devices_weight_updates():
    """Devices of ranks 8, 4 and 2 start from the global B (cut to their rank), train their
    columns; the FedAvg of their updates padded with the columns they were sent changes W
    by exactly the sample-weighted mean of what each changed it by."""
    gen = torch.Generator().manual_seed(0)
    out, inp, full, scale = 12, 10, 8, 16.0 / 8
    a = lora_a_init(3, "k.lora_A", (full, inp))
    b = torch.randn(out, full, generator=gen)
    ranks, weights = [8, 4, 2], torch.tensor([0.5, 0.3, 0.2])
    updates, deltas = [], []
    for r in ranks:
        sent = at_rank({"k.lora_B": b}, r)["k.lora_B"]
        trained = sent + 0.1 * torch.randn(out, r, generator=gen)
        deltas.append(scale * (trained - sent) @ lora_a_init(3, "k.lora_A", (r, inp)))  # the device's own ΔW
        updates.append(pad_rank({"k.lora_B": trained}, {"k.lora_B": b}, r)["k.lora_B"])
    new_b = sum(w * u for w, u in zip(weights, updates))
    assert torch.allclose(scale * (new_b - b) @ a, sum(w * d for w, d in zip(weights, deltas)), atol=1e-5)
    with pytest.raises(ValueError, match="not rank 2"):
        pad_rank({"k.lora_B": torch.zeros(out, 3)}, {"k.lora_B": b}, 2)
    assert expected_at_rank({"k.lora_B": ((out, full), torch.float32), "router.1.0": ((5,), torch.float32)}, 2) == \
        {"k.lora_B": ((out, 2), torch.float32), "router.1.0": ((5,), torch.float32)}


def test_a_rank_device_model_applies_the_global_scaling():
    from moe_model.submoe import SubMoE

    spec = tiny_spec()
    low = SubMoE(spec_at_rank(spec, 2), {1: [0, 1]}, "bbc", 5, None)
    scalings = {m.scaling["default"] for m in low.model.modules() if hasattr(m, "scaling")
                and isinstance(m.scaling, dict) and "default" in m.scaling}
    assert scalings == {spec.lora.alpha / spec.lora.rank}
    assert {tuple(t.shape)[1] for k, t in low.adapter_state().items() if ".lora_B" in k} == {2}


def test_an_assignment_refuses_a_rank_above_the_models():
    ref = BlobRef(transfer_id="s", bytes=1, sha256="0" * 64, chunks=1)
    kw = dict(round=1, model_version=0, model=ModelSpec(num_experts=4), task="bbc", labels=["a", "b"],
              experts={1: [0]}, shards=[], weight_format="int8", state=ref, train=TrainConfig(), deadline=1.0)
    assert Assignment(**kw, lora_rank=2).lora_rank == 2
    with pytest.raises(ValueError, match="lora_rank 9"):
        Assignment(**kw, lora_rank=9)


def test_min_lora_rank_is_refused_with_trained_a_or_above_the_rank(tmp_path):
    from cloud.config import FederationSettings

    assert FederationSettings(min_lora_rank=2).min_lora_rank == 2
    with pytest.raises(ValueError, match="above the model's LoRA rank"):
        FederationSettings(min_lora_rank=16)
    with pytest.raises(ValueError, match="frozen, shared A"):
        FederationSettings(model=ModelSpec(lora=LoraSpec(train_a=True)), min_lora_rank=2)


@pytest.mark.slow
def test_a_small_device_trains_a_lower_rank_and_more_experts(mosquitto_url, tmp_path):
    """min_lora_rank 2: dev0's budget holds 2 experts per layer at rank 8 but 3 at rank 2,
    so it is given 3 at the highest rank that fits them; its update comes back padded to
    rank 8 and the round aggregates both devices."""
    from moe_model.budget import estimate
    from tests.federation import Federation

    spec = tiny_spec()
    plan = lambda r, k: estimate(spec_at_rank(spec, r), k, 8, 5, runtime_bytes=0, weight_format="int8").total  # noqa: E731
    assert plan(2, 3) < plan(8, 3)
    budget = plan(2, 3)  # 2 experts at rank 8, 3 at rank 2
    assert plan(8, 2) <= budget < plan(8, 3)
    hook = lambda c: setattr(c, "budget_bytes", budget) if c.device_id == "dev0" else None  # noqa: E731
    fed = Federation(mosquitto_url, str(tmp_path), rounds=2, experts=(1, 4), round_timeout_s=60,
                     config_kw={"min_lora_rank": 2}, client_hook=hook)
    records = fed.run(timeout=180)
    assert plan(4, 3) > budget  # so rank 2 is the highest that holds 3 experts
    for rec in records:
        assert rec["status"] == "ok" and set(rec["devices"]) == {"dev0", "dev1"}, rec
        small, big = rec["devices"]["dev0"], rec["devices"]["dev1"]
        assert big["lora_rank"] == 8 and small["lora_rank"] == 2
        assert {len(v) for v in small["experts"].values()} == {3}
    assert all(t.shape[1] == 8 for k, t in fed.aggregator.model.state.items() if ".lora_B" in k)
