"""ONNX export of a (sub-)MoE: fp32 parity and int8 argmax agreement with torch."""

import pytest
import torch
import yaml

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from cloud.global_model import GlobalModel  # noqa: E402
from edge_sdk.export import export_onnx, onnx_logits, onnx_session  # noqa: E402
from moe_model.shards import decode_shard  # noqa: E402
from moe_model.submoe import SubMoE  # noqa: E402
from moe_model.train import train_local  # noqa: E402
from protocol.messages import TrainConfig  # noqa: E402
from fedmoe.cli import main  # noqa: E402
from fedmoe.datasets import bbc_news  # noqa: E402
from protocol import keys  # noqa: E402
from tests.conftest import tiny_spec  # noqa: E402


@pytest.fixture(scope="module")
def trained():
    items, labels = bbc_news()
    spec = tiny_spec(upcycle_noise=0.01, max_seq_len=48)
    gm = GlobalModel(spec, {"bbc": labels}, "int8")
    model = gm.models["bbc"]  # a briefly trained model, as a device would export
    train = [(x, labels.index(y)) for x, y in items[1::5]]
    train_local(model, train, TrainConfig(max_steps=25, batch_size=16, lr=5e-3), seed=0)
    gm.set_state({**gm.state, **model.adapter_state()})
    test = [x for x, _ in items[::10]][:150] + ["short text", "two words"]  # test split, varied lengths
    return gm, labels, test


def _torch_logits(model, texts):
    with torch.no_grad():
        return torch.cat([model(model.collate([(t, 0) for t in texts[i:i + 32]])[0]) for i in range(0, len(texts), 32)])


@pytest.mark.slow
@pytest.mark.parametrize("experts", [None, {1: [1, 3]}])
def test_export_parity_fp32_and_int8(trained, tmp_path, experts):
    gm, labels, texts = trained
    experts = experts or gm.all_experts
    shards = {sid: decode_shard(gm.shard_bytes[sid]) for sid in ["backbone"] + [f"L1.E{e}" for e in experts[1]]}
    model = SubMoE(gm.spec, experts, "bbc", len(labels), shards)
    model.load_adapter_state(keys.select(gm.state, experts, "bbc"))
    model.eval()
    ref = _torch_logits(model, texts)
    fp32 = onnx_logits(onnx_session(export_onnx(model, tmp_path / "m.onnx")), model, texts)
    assert (fp32 - ref).abs().max().item() < 1e-3
    q = export_onnx(model, tmp_path / "m8.onnx", int8=True)
    assert q.stat().st_size < 0.5 * (tmp_path / "m.onnx").stat().st_size
    int8 = onnx_logits(onnx_session(q), model, texts)
    assert (int8.argmax(1) == ref.argmax(1)).float().mean().item() >= 0.99
    assert not any(b.dense_dispatch for b in model.model.moe_blocks().values())  # restored


def test_fedmoe_export_cli(tmp_path, capsys):
    _, labels = bbc_news()
    cfg = {"model": tiny_spec().model_dump(mode="json"), "tasks": {"bbc": {"labels": labels}},
           "store": f"sqlite:///{tmp_path}/agg.db"}
    (tmp_path / "agg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["export", "--config", str(tmp_path / "agg.yaml"), "--out", str(tmp_path / "g.onnx"), "--int8"]) == 0
    assert (tmp_path / "g.onnx").stat().st_size > 0
    assert main(["export", "--config", str(tmp_path / "agg.yaml"), "--out", str(tmp_path / "d.onnx"),
                 "--device", "nobody"]) == 1  # no assignment recorded: a clean error
