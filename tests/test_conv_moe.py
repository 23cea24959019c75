"""The conv-moe family (FLEX-MoE's vision setting), the Fashion-MNIST IDX reader, and a
small conv-moe federation over the embedded broker."""

import gzip
import os
import uuid

import numpy as np
import pytest
import torch

from moe_model.budget import estimate, max_experts_per_layer
from moe_model.submoe import SubMoE
from moe_model.train import train_local
from fedmoe.datasets import FASHION_MNIST_DIR, read_idx
from fedmoe.inprocess import run_inprocess
from protocol.messages import ModelSpec, TrainConfig

SPEC = ModelSpec(family="conv-moe", base=None, tokenizer=None, num_experts=4, top_k=2, seed=0,
                 config={"channels": [4, 8], "hidden": 16, "ffn": 32})


def fake_images(n, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = (rng.random((n, 28, 28)) * 60).astype(np.uint8)
    for i, c in enumerate(y):  # class-dependent bright band: learnable
        x[i, 8 * c: 8 * c + 6] = 250
    return [(x[i], int(y[i])) for i in range(n)]


def test_conv_moe_trains_every_parameter_and_sizes_budgets():
    m = SubMoE(SPEC, {0: [1, 3]}, "img", 3, None)
    groups = {k.split(".")[0] for k in m.trainable()}
    assert groups == {"backbone", "expert", "router", "head"}
    assert {k for k in m.trainable() if k.startswith("expert.")} == {
        f"expert.0.{e}.{p}" for e in (1, 3) for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
    assert sum(p.numel() for p in m.trainable().values()) == sum(p.numel() for p in m.model.parameters())
    before = {k: v.clone() for k, v in m.adapter_state().items()}
    r = train_local(m, fake_images(64), TrainConfig(local_epochs=3, batch_size=16, lr=5e-3))
    after = m.adapter_state()
    assert r.steps == 12 and all(not torch.equal(before[k], after[k]) for k in before if k.startswith("backbone"))
    # budgets map to capacities monotonically (k_c from the memory budget)
    for k in range(1, 5):
        budget = estimate(SPEC, k, 16, 3, runtime_bytes=0, weight_format="fp32").total + 1
        assert max_experts_per_layer(SPEC, budget, 16, 3, runtime_bytes=0, weight_format="fp32") == k


def test_read_idx_roundtrip_and_errors(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in arr.shape) + arr.tobytes()
    p = tmp_path / "x-idx3-ubyte.gz"
    p.write_bytes(gzip.compress(raw))
    assert np.array_equal(read_idx(p), arr)
    (tmp_path / "bad").write_bytes(b"\x00\x00\x0d\x01" + raw[4:])
    with pytest.raises(ValueError):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(raw[:-3])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "short")


@pytest.mark.slow
def test_conv_moe_flex_federation(embedded_url, tmp_path):
    from cloud.service import Aggregator, AggregatorConfig, StrategyConfig, TaskConfig
    from edge_sdk import EdgeClient

    if os.path.exists(FASHION_MNIST_DIR):
        from fedmoe.datasets import fashion_mnist

        train, test, labels = fashion_mnist()
        labels = labels[:3]
        train = [t for t in train[:3000] if t[1] < 3][:360]
        test = [t for t in test[:1000] if t[1] < 3][:150]
    else:
        train, test, labels = fake_images(360), fake_images(150, 1), ["a", "b", "c"]
    fed = f"conv-{uuid.uuid4().hex[:8]}"
    cfg = AggregatorConfig(
        federation=fed, model=SPEC, tasks={"img": TaskConfig(labels=labels)}, rounds=3, min_devices=3,
        start_timeout_s=60, round_timeout_s=60, weight_format="fp32", store=f"sqlite:///{tmp_path}/agg.db",
        clear_retained_on_exit=True, protocol="3.1.1", train=TrainConfig(local_epochs=2, batch_size=16, lr=5e-3,
                                                                         router="private"),
        assignment=StrategyConfig(name="flex", params={"solver": "fast"}),
        aggregation=StrategyConfig(name="usage_weighted"))
    agg = Aggregator(cfg, embedded_url, eval_data={"img": test})
    clients = [EdgeClient(embedded_url, f"c{i}", train[i * 120:(i + 1) * 120], federation=fed, task="img",
                          budget_bytes=estimate(SPEC, k, 16, 3, runtime_bytes=0, weight_format="fp32").total + 1, protocol="3.1.1",
                          cache_dir=str(tmp_path / f"cache{i}"), runtime_bytes=0, low_memory=False)
               for i, k in enumerate((1, 2, 3))]
    records, errors = run_inprocess(agg, clients, 240)
    assert not errors and len(records) == 3, errors
    assert all(r["status"] == "ok" for r in records)
    for r in records:
        assert [len(r["devices"][f"c{i}"]["experts"]["0"]) for i in range(3)] == [1, 2, 3]  # k_c from budgets
        assert r["assignment_status"] in ("optimal", "widened", "greedy_fallback")
    assert any(r["assignment_status"] != "greedy_fallback" for r in records)  # the LP fast path really ran
    assert records[-1]["mean_local_accuracy"] > 0.5  # learns (3 classes: chance 1/3)
