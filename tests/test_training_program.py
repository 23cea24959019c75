"""The sub-MoE training step as an ExecuTorch program: one program per shape, run by
ExecuTorch's runtime, gives torch's loss and gradients for any held experts of that shape."""

import tempfile

import pytest
import torch

pytest.importorskip("executorch")

from cloud.global_model import GlobalModel  # noqa: E402
from cloud.programs import ProgramCache  # noqa: E402
from fedmoe.datasets import bbc_news  # noqa: E402
from moe_model import objectives  # noqa: E402
from moe_model.shards import decode_shard  # noqa: E402
from moe_model.submoe import SubMoE  # noqa: E402
from moe_model.training_program import (  # noqa: E402
    export_training_program, exportable, frozen_tensors, from_slots, slot_of, slot_shape, to_slots)
from tests.conftest import tiny_spec  # noqa: E402

B, T = 4, 24


def _load(program):
    """ExecuTorch's Python runtime (its pybindings) on the program's bytes."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
    from executorch.extension.training import TrainingModule

    return TrainingModule(_load_for_executorch_from_buffer(program.pte))


def _device_model(gm, held, labels):
    shards = {sid: decode_shard(gm.shard_bytes[sid], keep_quantized=True)
              for sid in ["backbone"] + [f"L{layer}.E{e}" for layer, ids in held.items() for e in ids]}
    model = SubMoE(gm.spec, held, "bbc", len(labels), shards)
    state = {k: torch.randn_like(v) * 0.1 for k, v in model.adapter_state().items()}  # a trained-looking state
    model.load_adapter_state(state)
    return model


def _eager(model, batch, labels):
    """torch's loss and gradients (by adapter key) of the same step (the program's mode)."""
    with exportable(model):
        model.zero_grad()
        loss = objectives.sample_loss(model.objective, model(batch), labels).mean()
        loss.backward()
    assert model.training and not any(b.dense_dispatch for b in model.model.moe_blocks().values())  # restored
    return loss.item(), {k: p.grad.clone() for k, p in model.trainable().items()}


@pytest.fixture(scope="module")
def setup():
    items, labels = bbc_news()
    gm = GlobalModel(tiny_spec(upcycle_noise=0.05, max_seq_len=T), {"bbc": labels}, "int8")
    return gm, labels, items


@pytest.mark.slow
def test_one_program_serves_every_expert_set_of_its_shape(setup):
    gm, labels, items = setup
    held_a, held_b = {1: [1, 3]}, {1: [0, 2]}
    program = export_training_program(_device_model(gm, slot_shape(held_a), labels), B, T, "int8")
    assert program.shape["experts_per_layer"] == {"1": 2} and len(program.key) == 64
    assert len(program.pte) < 2**20  # weights are inputs, not baked in
    batch_inputs = [d["name"] for d in program.batch]
    assert batch_inputs == ["input_ids", "attention_mask", "labels"]
    for held in (held_a, held_b):
        model = _device_model(gm, held, labels)
        batch, y = model.collate([(x, labels.index(c)) for x, c in items[:B]])
        ids = torch.zeros(B, T, dtype=torch.int64)
        mask = torch.zeros(B, T, dtype=torch.int64)
        n = batch["input_ids"].shape[1]
        ids[:, :n], mask[:, :n] = batch["input_ids"], batch["attention_mask"]
        slot_names = {f"experts.{e}.": f"experts.{j}." for e, j in slot_of(held)[1].items()}
        frozen = {}
        for name, t in frozen_tensors(model).items():
            for a, b in slot_names.items():
                name = name.replace(a, b)
            frozen[name] = t.detach()
        assert [f["name"] for f in program.frozen] == list(frozen)
        tm = _load(program)
        tm.forward_backward("forward", (ids, mask, y, *frozen.values()))  # first call: the parameters
        params = tm.named_parameters()
        state = to_slots(model.adapter_state(), held)
        for name, key in program.trainable.items():
            params[name].copy_(state[key])
        loss, logits = tm.forward_backward("forward", (ids, mask, y, *frozen.values()))
        grads = from_slots({program.trainable[n]: g for n, g in tm.named_gradients().items()}, held)
        ref_loss, ref_grads = _eager(model, {"input_ids": ids, "attention_mask": mask}, y)
        assert logits.shape == (B, len(labels))
        assert abs(loss.item() - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
        assert set(grads) == set(ref_grads)
        for k, g in ref_grads.items():
            err = ((grads[k] - g).norm() / g.norm().clamp_min(1e-12)).item()
            assert err < 1e-4, (k, err)


def test_slot_keys_round_trip_and_refuse_an_expert_not_held():
    from protocol import keys

    held = {1: [2, 5], 3: [0]}
    state = {keys.expert_key(1, 5, "fc1.lora_B"): torch.zeros(1), keys.router_key(1, 2): torch.zeros(1),
             keys.router_key(3, 0): torch.zeros(1), keys.head_key("bbc", "weight"): torch.zeros(1)}
    slots = to_slots(state, held)
    assert keys.expert_key(1, 1, "fc1.lora_B") in slots and keys.router_key(1, 0) in slots
    assert from_slots(slots, held).keys() == state.keys()
    with pytest.raises(KeyError):
        to_slots({keys.router_key(1, 4): torch.zeros(1)}, held)
    assert slot_shape(held) == {1: [0, 1], 3: [0]}


@pytest.mark.slow
def test_export_refuses_global_expert_ids(setup):
    gm, labels, _ = setup
    with pytest.raises(ValueError, match="by slot"):
        export_training_program(_device_model(gm, {1: [1, 3]}, labels), B, T)


def _stored(gm, sids):
    from moe_model.shards import MAX_SHARD_BYTES
    from protocol.codec import decode_tensors

    return {sid: decode_tensors(gm.shard_bytes[sid], MAX_SHARD_BYTES, dequantize=False) for sid in sids}


def _from_stored(gm, held, labels, stored, task="bbc"):
    from moe_model.shards import MAX_SHARD_BYTES, held_tensors
    from protocol.codec import inspect_header

    shards = {sid: held_tensors(t, inspect_header(gm.shard_bytes[sid], MAX_SHARD_BYTES)[1], True)
              for sid, t in stored.items()}
    return SubMoE(gm.spec, held, task, labels if isinstance(labels, int) else len(labels), shards)


@pytest.mark.slow
def test_the_manifest_says_where_each_frozen_input_is_in_a_devices_shards(setup):
    gm, labels, _ = setup
    slot_model_stored = _stored(gm, ["backbone", "L1.E0", "L1.E1"])
    program = export_training_program(_from_stored(gm, {1: [0, 1]}, labels, slot_model_stored), B, T, "int8",
                                      stored=slot_model_stored)
    held = {1: [1, 3]}
    stored = _stored(gm, ["backbone", "L1.E1", "L1.E3"])
    device = _from_stored(gm, held, labels, stored)
    frozen = {n.replace("experts.1.", "experts.0.").replace("experts.3.", "experts.1."): t
              for n, t in frozen_tensors(device).items()}
    kinds = set()
    for spec in program.frozen:
        src = spec["source"]
        if "lora_a" in src:
            kinds.add("lora_a")
            assert ".lora_A" in src["lora_a"] and ".lora_A." in spec["name"]
            continue
        sid = src.get("shard") or f"L{src['layer']}.E{held[src['layer']][src['slot']]}"
        t = stored[sid][src["tensor"]]
        kinds.add(str(t.dtype))
        assert torch.equal(t, frozen[spec["name"]]), spec["name"]
    assert kinds >= {"lora_a", "torch.int8", "torch.float32"}  # int8 weights are passed as stored


@pytest.mark.slow
def test_the_cloud_builds_each_shape_once_and_gives_a_device_its_lora_a(setup, tmp_path):
    gm, labels, _ = setup
    cache = ProgramCache(gm, tmp_path)
    m1 = cache.get("bbc", {1: [1, 3]}, B, T)
    m2 = cache.get("bbc", {1: [0, 2]}, B, T)  # same shape: the same program
    assert m1 == m2 and cache.built == 1 and cache.path(m1["key"]).stat().st_size == m1["bytes"]
    assert ProgramCache(gm, tmp_path).get("bbc", {1: [2, 3]}, B, T) == m1  # found again after a restart
    assert cache.get("bbc", {1: [1]}, B, T)["key"] != m1["key"] and cache.built == 2  # another shape
    held = {1: [1, 3]}
    device = _from_stored(gm, held, labels, _stored(gm, ["backbone", "L1.E1", "L1.E3"]))
    frozen = {n.replace("experts.1.", "experts.0.").replace("experts.3.", "experts.1."): t
              for n, t in frozen_tensors(device).items()}
    lora_a = cache.lora_a(m1, held)
    assert lora_a
    for f in m1["frozen"]:
        if "lora_a" in f["source"]:
            assert torch.equal(lora_a[f["source"]["lora_a"]], frozen[f["name"]])
    with pytest.raises(ValueError):
        cache.get("bbc", {1: [0, 1, 2, 3, 4]}, B, T)
    with pytest.raises(KeyError):
        cache.get("tweets", held, B, T)


def _check_device_step(gm, task, num_labels, held, texts, fmt):
    """Export the program of ``held``'s shape (experts by slot, with sources), run it in
    ExecuTorch for a device holding ``held`` whose frozen inputs come from its own stored
    shards (its LoRA A from its model), and compare loss and gradients with torch's."""
    from moe_model.shards import shards_for

    slots = slot_shape(held)
    slot_stored = _stored(gm, shards_for(slots))
    program = export_training_program(_from_stored(gm, slots, num_labels, slot_stored, task), B, T, fmt,
                                      stored=slot_stored)
    stored = _stored(gm, shards_for(held))
    model = _from_stored(gm, held, num_labels, stored, task)
    model.load_adapter_state({k: torch.randn_like(v) * 0.1 for k, v in model.adapter_state().items()})
    batch, y = model.collate(texts[:B])
    ids, mask = torch.zeros(B, T, dtype=torch.int64), torch.zeros(B, T, dtype=torch.int64)
    n = batch["input_ids"].shape[1]
    ids[:, :n], mask[:, :n] = batch["input_ids"], batch["attention_mask"]
    if y.dim() == 2:  # causal LM: next-token targets, padding ignored
        y2 = torch.full((B, T), -100, dtype=torch.int64)
        y2[:, :n] = y
        y = y2
    lora_a = ProgramCache(gm, tempfile.mkdtemp()).lora_a(program.manifest(), held)  # what the cloud sends
    frozen = []
    for f in program.frozen:
        src = f["source"]
        sid = src.get("shard") or (f"L{src['layer']}.E{held[src['layer']][src['slot']]}" if "layer" in src else None)
        frozen.append(lora_a[src["lora_a"]] if sid is None else stored[sid][src["tensor"]])
    tm = _load(program)
    tm.forward_backward("forward", (ids, mask, y, *frozen))
    params = tm.named_parameters()
    state = to_slots(model.adapter_state(), held)
    for name, key in program.trainable.items():
        params[name].copy_(state[key])
    loss, _ = tm.forward_backward("forward", (ids, mask, y, *frozen))
    grads = from_slots({program.trainable[n]: g for n, g in tm.named_gradients().items()}, held)
    ref_loss, ref_grads = _eager(model, {"input_ids": ids, "attention_mask": mask}, y)
    assert abs(loss.item() - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
    for k, g in ref_grads.items():
        assert ((grads[k] - g).norm() / g.norm().clamp_min(1e-12)).item() < 1e-4, k
    return program


@pytest.mark.slow
def test_nf4_weights_stay_packed_and_the_step_equals_torchs(setup):
    """nf4 base shards: the program takes the packed uint8 data and absmax as stored and
    dequantizes inside; loss and gradients equal torch's on the same quantized weights."""
    _, labels, items = setup
    gm = GlobalModel(tiny_spec(upcycle_noise=0.05, max_seq_len=T), {"bbc": labels}, "nf4")
    program = _check_device_step(gm, "bbc", len(labels), {1: [1, 3]}, [(x, labels.index(c)) for x, c in items],
                                 "nf4")
    assert "uint8" in {f["dtype"] for f in program.frozen}


@pytest.mark.slow
def test_a_hugging_face_moe_step_equals_torchs(tmp_path):
    """A Qwen3-MoE (``hf-moe``, causal LM, int8): exported (its backward's ``empty_permuted``
    rewritten for ExecuTorch) and run for a device holding other experts than the slots'."""
    from transformers import AutoModelForCausalLM

    from tests.test_hf_moe import FAMILIES, TEXTS, _spec, _tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"]()).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    gm = GlobalModel(_spec(tmp_path, max_seq_len=T), {"lm": ["a", "b"]}, "int8")
    _check_device_step(gm, "lm", 2, {0: [1, 3], 1: [0, 2]}, TEXTS * 2, "int8")
