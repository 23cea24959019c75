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


def test_export_stores_tokenizer_and_labels_and_predict_uses_them(trained, tmp_path):
    """``fedmoe export`` of round 4's global state (as a store holds it), quietly, then
    ``fedmoe predict`` on two texts: labels from the model's metadata, probabilities as
    torch computes them (fp32 in-process; the int8 file through the command line)."""
    import json
    import subprocess
    import sys

    import onnx

    from cloud.store import Store
    from edge_sdk.export import OnnxClassifier
    from protocol.codec import encode_tensors

    gm, labels, texts = trained
    url = f"sqlite:///{tmp_path}/agg.db"
    store = Store(url)
    store.put_blob("global_state", encode_tensors(gm.state, "fp32"))
    store.put_json("last_round", 4)
    store.close()
    cfg = {"model": gm.spec.model_dump(mode="json"), "tasks": {"bbc": {"labels": labels}}, "store": url}
    (tmp_path / "agg.yaml").write_text(yaml.safe_dump(cfg))
    two = ["Shares fell sharply after the central bank raised interest rates again",
           "The striker scored twice as the home side won the cup final"]

    model = gm.models["bbc"].eval()
    ref = torch.softmax(_torch_logits(model, two), 1).numpy()
    fp32 = OnnxClassifier(export_onnx(model, tmp_path / "f.onnx", labels=labels))
    assert fp32.labels == labels and fp32.max_seq_len == 48
    assert abs(fp32.predict_proba(two) - ref).max() < 1e-4

    proc = subprocess.run([sys.executable, "-m", "fedmoe", "export", "--config", str(tmp_path / "agg.yaml"),
                           "--out", str(tmp_path / "m.onnx"), "--int8"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    for noise in ("Quantization parameters", "Ignore MatMul", "pre-processing", "TracerWarning", "Warning",
                  "global model v0"):
        assert noise not in said, (noise, said)
    assert "round 4" in said and "global model after round 4" in said
    props = {p.key: p.value for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props}
    assert json.loads(props["fedmoe.labels"]) == labels and props["fedmoe.round"] == "4"
    assert props["fedmoe.task"] == "bbc" and props["fedmoe.max_seq_len"] == "48"
    assert (tmp_path / props["fedmoe.tokenizer"] / "tokenizer.json").is_file()

    proc = subprocess.run([sys.executable, "-m", "fedmoe", "predict", str(tmp_path / "m.onnx"), "--text", two[0],
                           "--text", two[1], "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["text"] for r in rows] == two
    for r, p in zip(rows, ref):
        assert list(r["probabilities"]) == labels  # names from the metadata, in logit order
        assert abs(sum(r["probabilities"].values()) - 1) < 1e-4
        assert r["label"] == max(r["probabilities"], key=r["probabilities"].get)
        assert max(abs(r["probabilities"][y] - q) for y, q in zip(labels, p)) < 0.05  # int8 near fp32
    (tmp_path / props["fedmoe.tokenizer"] / "tokenizer.json").unlink()
    (tmp_path / props["fedmoe.tokenizer"] / "tokenizer_config.json").unlink()
    (tmp_path / props["fedmoe.tokenizer"]).rmdir()
    proc = subprocess.run([sys.executable, "-m", "fedmoe", "predict", str(tmp_path / "m.onnx"), "--text", "x"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "tokenizer directory" in proc.stderr  # copied without it: says so
