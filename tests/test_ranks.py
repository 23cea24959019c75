"""Heterogeneous LoRA ranks (moe_model.ranks): over a frozen, shared A the FedAvg of the
padded B factors is exactly the average of the devices' weight updates; with trained A,
FlexLoRA and HLoRA give the truncated SVD of the mean product (Eckart-Young) and each
other's result; a rank-r device builds the global model's LoRA scaling, and a federation
gives a small device a lower rank and more experts."""

from __future__ import annotations

import pytest
import torch

from moe_model.ranks import at_rank, expected_at_rank, pad_rank, rank_ladder, spec_at_rank, stacked_factors, \
    truncated_factors
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
    with pytest.raises(ValueError, match="flexlora, hlora, rankwise"):
        FederationSettings(model=ModelSpec(lora=LoraSpec(train_a=True)), min_lora_rank=2)
    assert FederationSettings(model=ModelSpec(lora=LoraSpec(train_a=True)), min_lora_rank=2,
                              aggregation={"name": "hlora"}).min_lora_rank == 2
    with pytest.raises(ValueError, match="no full fine-tuning"):
        FederationSettings(model=ModelSpec(full_finetune=True), min_lora_rank=2)


def test_truncated_factors_are_the_best_low_rank_approximation_and_the_stack_gives_the_same():
    """Eckart-Young: the error of the rank-R product is the norm of the dropped singular
    values; a matrix of rank <= R comes back exactly; HLoRA's QR of the stacked factors gives
    FlexLoRA's factors of the weighted mean product without forming it."""
    gen = torch.Generator().manual_seed(1)
    m = torch.randn(9, 7, generator=gen, dtype=torch.float64)
    b, a, sv = truncated_factors(m, 3)
    assert torch.allclose(sv, torch.linalg.svdvals(m))
    s = torch.linalg.svdvals(m)
    assert b.shape == (9, 3) and a.shape == (3, 7)
    assert torch.linalg.norm(m - b @ a) == pytest.approx(s[3:].norm().item(), rel=1e-9)
    low = torch.randn(9, 2, generator=gen, dtype=torch.float64) @ torch.randn(2, 7, generator=gen, dtype=torch.float64)
    b, a, _ = truncated_factors(low, 4)
    assert torch.allclose(b @ a, low, atol=1e-10) and a[2:].abs().max() < 1e-6  # sqrt of rounding-level values
    factors = [(torch.randn(9, r, generator=gen, dtype=torch.float64), torch.randn(r, 7, generator=gen,
                                                                                     dtype=torch.float64))
               for r in (4, 2, 3)]
    weights = [3.0, 1.0, 2.0]
    mean = sum(w * b @ a for w, (b, a) in zip(weights, factors)) / sum(weights)
    fb, fa, fs = truncated_factors(mean, 4)
    hb, ha, hs = stacked_factors(weights, factors, 4)
    assert torch.allclose(hs[:4], fs[:4], atol=1e-9)
    assert torch.allclose(hb @ ha, fb @ fa, atol=1e-9)
    with pytest.raises(ValueError, match="at least one pair"):
        stacked_factors([], [], 4)


@pytest.mark.parametrize("rule", ["flexlora", "hlora"])
def test_the_svd_rules_aggregate_products_of_heterogeneous_ranks(rule):
    from cloud.aggregation import get_aggregation
    from cloud.strategy import ClientResult

    gen = torch.Generator().manual_seed(2)
    full = {"expert.1.0.fc1.lora_A": torch.randn(4, 6, generator=gen), "expert.1.0.fc1.lora_B": torch.zeros(5, 4),
            "router.1.0": torch.zeros(6)}
    results, products = [], []
    for i, (r, n) in enumerate(((4, 30), (2, 10))):
        trained = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in at_rank(full, r).items()}
        padded = pad_rank(trained, full, r)
        products.append((n, padded["expert.1.0.fc1.lora_B"].double() @ padded["expert.1.0.fc1.lora_A"].double()))
        results.append(ClientResult(f"d{i}", "bbc", n, {1: [0]}, padded, None))
    aggregation = get_aggregation(rule)()
    out = aggregation.aggregate(1, full, results, [])
    spectrum = aggregation.metrics()["lora_spectrum"]
    assert spectrum["modules"] == 1 and 1 <= spectrum["effective_rank"] <= 6 and 0 < spectrum["energy_kept"] <= 1
    mean = sum(n * p for n, p in products) / 40
    b, a, _ = truncated_factors(mean, 4)
    assert torch.allclose(out["expert.1.0.fc1.lora_B"] @ out["expert.1.0.fc1.lora_A"], (b @ a).float(), atol=1e-5)
    assert torch.allclose(out["router.1.0"], (30 * results[0].state["router.1.0"]
                                              + 10 * results[1].state["router.1.0"]) / 40, atol=1e-6)


def test_rankwise_averages_each_rank_component_over_the_devices_that_trained_it():
    """``rankwise``: row j of A and column j of B are the |D_c|-weighted mean over the
    devices whose rank covers j (the padded tail of a lower-rank device does not count);
    other tensors FedAvg; the spectrum is that of the aggregated product; it decomposes
    (sums folded in two halves and merged give the same)."""
    from cloud.aggregation import get_aggregation
    from cloud.aggregation.base import RoundSums
    from cloud.strategy import ClientResult

    gen = torch.Generator().manual_seed(3)
    a_key, b_key = "expert.1.0.fc1.lora_A", "expert.1.0.fc1.lora_B"
    full = {a_key: torch.randn(4, 6, generator=gen), b_key: torch.randn(5, 4, generator=gen), "router.1.0": torch.zeros(6)}
    results = []
    for i, (r, n) in enumerate(((4, 30), (2, 10), (4, 20))):
        trained = {k: v + torch.randn(v.shape, generator=gen) for k, v in at_rank(full, r).items()}
        results.append(ClientResult(f"d{i}", "bbc", n, {1: [0]}, pad_rank(trained, full, r), None, r))
    rule = get_aggregation("rankwise")()
    out = rule.aggregate(1, full, results, [])
    s = [r.state for r in results]
    assert torch.allclose(out[a_key][:2], (30 * s[0][a_key][:2] + 10 * s[1][a_key][:2] + 20 * s[2][a_key][:2]) / 60)
    assert torch.allclose(out[a_key][2:], (30 * s[0][a_key][2:] + 20 * s[2][a_key][2:]) / 50)  # d1's tail left out
    assert torch.allclose(out[b_key][:, 2:], (30 * s[0][b_key][:, 2:] + 20 * s[2][b_key][:, 2:]) / 50)
    assert torch.allclose(out["router.1.0"], sum(n * x["router.1.0"] for n, x in zip((30, 10, 20), s)) / 60)
    assert torch.allclose(stacked_factors([1.0], [(out[b_key].double(), out[a_key].double())], 4)[2],
                          torch.linalg.svdvals((out[b_key] @ out[a_key]).double())[:4], atol=1e-6)
    assert rule.metrics()["lora_spectrum"]["modules"] == 1
    first, second = RoundSums(), RoundSums()
    rule.fold(first, results[0])
    for r in results[1:]:
        rule.fold(second, r)
    first.merge(RoundSums.from_bytes(second.to_bytes()))
    assert all(torch.allclose(rule.finish(full, first)[k], out[k]) for k in full)
    only_small = rule.aggregate(1, full, results[1:2], [])  # nobody trained components 2-3: they stay
    assert torch.equal(only_small[a_key][2:], full[a_key][2:])


@pytest.mark.slow
@pytest.mark.parametrize("train_a,aggregation", [(False, "modular"), (True, "flexlora"), (True, "hlora"),
                                                 (True, "rankwise")])
def test_a_small_device_trains_a_lower_rank_and_more_experts(mosquitto_url, tmp_path, train_a, aggregation):
    """min_lora_rank 2: dev0's budget holds 2 experts per layer at rank 8 but 3 at rank 2,
    so it is given 3 at the highest rank that fits them; its update comes back padded to
    rank 8 and the round aggregates both devices (frozen A by modular FedAvg; trained A by
    FlexLoRA, HLoRA or rank-wise averaging)."""
    from cloud.config import StrategyConfig
    from moe_model.budget import estimate
    from tests.federation import Federation

    lora = LoraSpec(train_a=train_a)
    spec = tiny_spec(lora=lora)
    plan = lambda r, k: estimate(spec_at_rank(spec, r), k, 8, 5, runtime_bytes=0, weight_format="int8").total  # noqa: E731
    budget = plan(2, 3)  # 2 experts at rank 8, 3 at rank 2, and rank 2 the highest that holds 3
    assert plan(8, 2) <= budget < plan(8, 3) and plan(4, 3) > budget
    hook = lambda c: setattr(c, "budget_bytes", budget) if c.device_id == "dev0" else None  # noqa: E731
    fed = Federation(mosquitto_url, str(tmp_path), rounds=2, experts=(1, 4), round_timeout_s=60,
                     spec_kw={"upcycle_noise": 0.01, "lora": lora}, client_hook=hook,
                     config_kw={"min_lora_rank": 2, "aggregation": StrategyConfig(name=aggregation)})
    records = fed.run(timeout=180)
    for rec in records:
        assert rec["status"] == "ok" and set(rec["devices"]) == {"dev0", "dev1"}, rec
        small, big = rec["devices"]["dev0"], rec["devices"]["dev1"]
        assert big["lora_rank"] == 8 and small["lora_rank"] == 2
        assert {len(v) for v in small["experts"].values()} == {3}
        spectrum = (rec.get("strategy_metrics") or {}).get("lora_spectrum")
        assert (spectrum is not None and spectrum["modules"] > 0 and spectrum["effective_rank"] <= 8) == train_a
    state = fed.aggregator.model.state
    assert all(t.shape[1] == 8 for k, t in state.items() if ".lora_B" in k)
    assert all(t.shape[0] == 8 for k, t in state.items() if ".lora_A" in k) and \
        any(".lora_A" in k for k in state) == train_a


def test_an_open_round_keeps_its_ranks_across_a_restart():
    """The ranks are stored with the open round (a restarted aggregator, or a worker, decodes
    a rank-r update as rank r) and read back."""
    from cloud.rounds.recovery import Recovery

    rnd = Recovery.round_from_json({"number": 3, "started": 1.0, "deadline": 2.0, "selected": {"dev0": {"1": [0, 1]}},
                                    "ranks": {"dev0": 2}})
    assert rnd.ranks == {"dev0": 2}
    assert Recovery.round_from_json({"number": 3, "started": 1.0, "deadline": 2.0, "selected": {}}).ranks == {}
