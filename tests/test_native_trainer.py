"""The native device's training core (C++, ``native/``) built against ExecuTorch's wheel:
run on a training program, it gives the Python device's update (same batches, AdamW, no
dropout) within a relative L2 error of 1e-3, and refuses bad input with a reason."""

import json
import subprocess

import pytest
import torch

pytest.importorskip("executorch")

from safetensors.torch import load_file, save_file  # noqa: E402

from cloud.global_model import GlobalModel  # noqa: E402
from cloud.programs import ProgramCache  # noqa: E402
from fedmoe.datasets import bbc_news  # noqa: E402
from moe_model import objectives  # noqa: E402
from moe_model.shards import shards_for  # noqa: E402
from moe_model.training_program import (  # noqa: E402
    export_training_program, exportable, frozen_tensors, pad_batch, to_slots)
from tests.conftest import native_binary, tiny_spec  # noqa: E402

B, T, STEPS, LR, WD = 4, 24, 3, 5e-3, 0.01
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def binary():
    return native_binary("fedmoe-train")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 2-of-4-expert int8 device holding slots {1: [0, 1]}: the program, its manifest, the
    frozen inputs, the initial adapter state and 3 batches, as a native device gets them."""
    d = tmp_path_factory.mktemp("native")
    items, labels = bbc_news()
    gm = GlobalModel(tiny_spec(upcycle_noise=0.05, max_seq_len=T), {"bbc": labels}, "int8")
    held = {1: [0, 1]}
    model = ProgramCache(gm, d / "programs").model_for("bbc", held)[0]
    model.load_adapter_state({k: torch.randn_like(v) * 0.1 for k, v in model.adapter_state().items()})
    program = export_training_program(model, B, T, "int8")
    (d / "p.pte").write_bytes(program.pte)
    (d / "m.json").write_text(json.dumps(program.manifest()))
    save_file({k: t.contiguous() for k, t in frozen_tensors(model).items()}, str(d / "frozen.safetensors"))
    start = to_slots(model.adapter_state(), held)
    save_file(start, str(d / "state.safetensors"))
    batches = [pad_batch(*model.collate([(x, labels.index(c)) for x, c in items[i * B:(i + 1) * B]]), T)
               for i in range(STEPS)]
    stacked = {k: torch.stack([b[k] for b in batches]) for k in batches[0]}
    save_file(stacked, str(d / "batches.safetensors"))
    return d, start, *_python_update(model, held, stacked["input_ids"], stacked["attention_mask"], stacked["labels"])


def _python_update(model, held, ids, mask, ys):
    """The Python device's update on the same batches (AdamW, the program's mode: no
    dropout): (trained adapter state with experts by slot, losses)."""
    opt = torch.optim.AdamW(list(model.trainable().values()), lr=LR, weight_decay=WD)
    losses = []
    with exportable(model):
        for i in range(STEPS):
            loss = objectives.sample_loss(model.objective, model({"input_ids": ids[i], "attention_mask": mask[i]}),
                                          ys[i]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return to_slots(model.adapter_state(), held), losses


def _relative_error(out, start, ref):
    delta = torch.cat([(out[k] - start[k]).flatten() for k in sorted(ref)])
    ref_delta = torch.cat([(ref[k] - start[k]).flatten() for k in sorted(ref)])
    assert ref_delta.norm() > 0
    return ((delta - ref_delta).norm() / ref_delta.norm()).item()


def _run(binary, d, **over):
    args = {"--program": d / "p.pte", "--manifest": d / "m.json", "--frozen": d / "frozen.safetensors",
            "--state": d / "state.safetensors", "--batches": d / "batches.safetensors", "--steps": STEPS,
            "--lr": LR, "--weight-decay": WD, "--out": d / "out.safetensors", **over}
    return subprocess.run([str(binary), *[str(x) for kv in args.items() if kv[1] is not None for x in kv]],
                          capture_output=True, text=True, timeout=300)


def test_native_update_equals_the_python_devices(binary, files):
    d, start, ref, ref_losses = files
    r = _run(binary, d)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["losses"] == pytest.approx(ref_losses, rel=1e-4)
    out = load_file(str(d / "out.safetensors"))
    assert out.keys() == ref.keys()
    assert _relative_error(out, start, ref) < 1e-3
    assert 0 < report["peak_rss_bytes"] < 2**30


def test_a_device_binds_its_frozen_inputs_from_its_own_shards(binary, files):
    """A device holding experts {1: [1, 3]} (slots 0, 1) of the same shape trains with the
    same program from the base shards it downloaded, as stored (int8), plus its LoRA A factors."""
    d = files[0]
    _, labels = bbc_news()
    gm = GlobalModel(tiny_spec(upcycle_noise=0.05, max_seq_len=T), {"bbc": labels}, "int8")
    cache = ProgramCache(gm, d / "programs2")
    slot_model, slot_stored = cache.model_for("bbc", {1: [0, 1]})
    program = export_training_program(slot_model, B, T, "int8", stored=slot_stored)
    (d / "p2.pte").write_bytes(program.pte)
    (d / "m2.json").write_text(json.dumps(program.manifest()))
    held = {1: [1, 3]}
    device = cache.model_for("bbc", held)[0]
    (d / "shards").mkdir(exist_ok=True)
    for sid in shards_for(held):
        (d / "shards" / f"{sid}.safetensors").write_bytes(gm.shard_bytes[sid])
    save_file(cache.lora_a(program.manifest(), held), str(d / "lora_a.safetensors"))  # what the cloud sends
    device.load_adapter_state({k: torch.randn_like(v) * 0.1 for k, v in device.adapter_state().items()})
    start = to_slots(device.adapter_state(), held)
    save_file(start, str(d / "state2.safetensors"))
    b = load_file(str(d / "batches.safetensors"))
    ref, ref_losses = _python_update(device, held, b["input_ids"], b["attention_mask"], b["labels"])
    from_shards = {"--program": d / "p2.pte", "--manifest": d / "m2.json", "--frozen": None, "--shards": d / "shards",
                   "--held": json.dumps(held), "--lora-a": d / "lora_a.safetensors", "--state": d / "state2.safetensors",
                   "--out": d / "out2.safetensors"}
    r = _run(binary, d, **from_shards)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["losses"] == pytest.approx(ref_losses, rel=1e-4)
    assert _relative_error(load_file(str(d / "out2.safetensors")), start, ref) < 1e-3
    r = _run(binary, d, **{**from_shards, "--held": '{"1": [1, 2]}', "--steps": 1, "--lr": 0.1,
                           "--out": d / "out3.safetensors"})
    assert r.returncode == 2 and "L1.E2.safetensors: cannot open" in r.stderr


def test_a_grouped_dispatch_program_gives_the_python_devices_update(binary, files):
    """Grouped dispatch (``moe_model.grouped``: each held expert on exactly its routed tokens,
    the native core's ``fedmoe::grouped_mm`` kernels) for a device holding 3 experts with top-2
    routing, so that each expert sees only some tokens: the update equals the Python device's."""
    d = files[0]
    _, labels = bbc_news()
    gm = GlobalModel(tiny_spec(upcycle_noise=0.05, max_seq_len=T), {"bbc": labels}, "int8")
    held = {1: [0, 1, 2]}
    model = ProgramCache(gm, d / "programs3").model_for("bbc", held)[0]
    model.load_adapter_state({k: torch.randn_like(v) * 0.1 for k, v in model.adapter_state().items()})
    program = export_training_program(model, B, T, "int8", ops="fedmoe")
    assert program.shape["ops"] == "fedmoe"
    (d / "p4.pte").write_bytes(program.pte)
    (d / "m4.json").write_text(json.dumps(program.manifest()))
    save_file({k: t.contiguous() for k, t in frozen_tensors(model).items()}, str(d / "frozen4.safetensors"))
    start = to_slots(model.adapter_state(), held)
    save_file(start, str(d / "state4.safetensors"))
    b = load_file(str(d / "batches.safetensors"))
    ref, ref_losses = _python_update(model, held, b["input_ids"], b["attention_mask"], b["labels"])
    assert model.model.moe_blocks()[1].top_k == 2  # of 3 held
    r = _run(binary, d, **{"--program": d / "p4.pte", "--manifest": d / "m4.json",
                           "--frozen": d / "frozen4.safetensors", "--state": d / "state4.safetensors",
                           "--out": d / "out4.safetensors"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["losses"] == pytest.approx(ref_losses, rel=1e-4)
    assert _relative_error(load_file(str(d / "out4.safetensors")), start, ref) < 1e-3


def test_native_trainer_refuses_bad_input_with_a_reason(binary, files, tmp_path):
    d = files[0]
    truncated = tmp_path / "frozen.safetensors"
    truncated.write_bytes((d / "frozen.safetensors").read_bytes()[:1000])
    r = _run(binary, d, **{"--frozen": truncated})
    assert r.returncode == 2 and "fedmoe-train:" in r.stderr and "beyond the file" in r.stderr
    wrong = tmp_path / "state.safetensors"
    save_file({"x": torch.zeros(2)}, str(wrong))
    r = _run(binary, d, **{"--state": wrong})
    assert r.returncode == 2 and "adapter state lacks" in r.stderr
    r = _run(binary, d, **{"--steps": 99})
    assert r.returncode == 2 and "fewer batches" in r.stderr
