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
from moe_model.shards import BACKBONE, block_paths  # noqa: E402
from moe_model.training_program import (  # noqa: E402
    export_training_program, exportable, frozen_tensors, from_slots, pad_batch, slot_of, slot_shape, to_slots)
from protocol.topics import shard_id  # noqa: E402
from tests.conftest import tiny_spec  # noqa: E402

B, T = 4, 24


def _load(program):
    """ExecuTorch's Python runtime (its pybindings) on the program's bytes."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
    from executorch.extension.training import TrainingModule

    if program.shape.get("ops") == "fedmoe":
        from fedmoe.native import load_kernels

        load_kernels()  # the fedmoe::grouped_mm kernels, as the native core registers them
    return TrainingModule(_load_for_executorch_from_buffer(program.pte))


def _device(gm, held, task="bbc"):
    """(a device's sub-MoE holding ``held``, built from its stored shards with a trained-looking
    adapter state; those stored shards by shard id)."""
    model, stored = ProgramCache(gm, tempfile.mkdtemp()).model_for(task, held)
    model.load_adapter_state({k: torch.randn_like(v) * 0.1 for k, v in model.adapter_state().items()})
    return model, stored


def slot_named(model, held):
    """``frozen_tensors(model)`` of a device holding ``held``, each expert's module path by
    slot (as the program names its frozen inputs)."""
    slots, paths, out = slot_of(held), block_paths(model.model), {}
    for name, t in frozen_tensors(model).items():
        for path, layer in paths.items():
            prefix = f"model.{path}.experts."
            if name.startswith(prefix):
                e, rest = name[len(prefix):].split(".", 1)
                name = f"{prefix}{slots[layer][int(e)]}.{rest}"
        out[name] = t.detach()
    return out


def _eager(model, batch, labels, capacity_factor=None):
    """torch's loss and gradients (by adapter key) of the same step (the program's mode), and
    the step's other outputs by name (per-sample loss and correctness, each layer's routing)."""
    with exportable(model, capacity_factor):
        model.zero_grad()
        logits = model(batch)
        per_sample = objectives.sample_loss(model.objective, logits, labels)
        per_sample.mean().backward()
        outputs = {"sample_loss": per_sample.detach(),
                   "sample_correct": objectives.sample_correct(model.objective, logits, labels)}
        for layer, block in model.model.moe_blocks().items():
            rec = block.last
            outputs.update({f"router.{layer}.probs": rec.probs.detach(), f"router.{layer}.topk_idx": rec.topk_idx,
                            f"router.{layer}.topk_weight": rec.topk_weight.detach()})
    assert model.training and not any(b.dense_dispatch or b.capacity_factor for b in model.model.moe_blocks().values())
    return per_sample.mean().item(), {k: p.grad.clone() for k, p in model.trainable().items()}, outputs


def _check_step(program, model, held, items, frozen):
    """Run ``program`` in ExecuTorch for ``model`` (holding ``held``) on the first batch of
    ``items`` with ``frozen`` inputs, and assert loss and gradients equal torch's; returns the logits."""
    inputs = list(pad_batch(*model.collate(items[:B]), T).values())
    tm = _load(program)
    tm.forward_backward("forward", (*inputs, *frozen))  # the first call gives the parameters
    params = tm.named_parameters()
    state = to_slots(model.adapter_state(), held)
    for name, key in program.trainable.items():
        params[name].copy_(state[key])
    outs = tm.forward_backward("forward", (*inputs, *frozen))
    names = [o["name"] for o in program.outputs]
    first = names.index("sample_loss")  # a causal LM's program with the fused loss returns no logits
    loss, logits, rest = outs[0], outs[1] if first == 2 else None, outs[first:]
    grads = from_slots({program.trainable[n]: g for n, g in tm.named_gradients().items()}, held)
    ref_loss, ref_grads, ref_out = _eager(model, {"input_ids": inputs[0], "attention_mask": inputs[1]}, inputs[2],
                                          program.shape["capacity_factor"])
    assert abs(loss.item() - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
    assert names[first:] == list(ref_out) and len(rest) == len(ref_out)
    for spec, got in zip(program.outputs[first:], rest):  # what a device's statistics are made of
        want = ref_out[spec["name"]]
        assert list(got.shape) == spec["shape"] == list(want.shape), spec
        assert torch.equal(got, want) if want.dtype == torch.int64 else torch.allclose(got, want.float(), atol=1e-5)
    assert program.planned_bytes > 0
    assert set(grads) == set(ref_grads)
    for k, g in ref_grads.items():
        err = ((grads[k] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert err < 1e-4, (k, err)
    return logits


def _source(src, held):
    """The shard id a frozen input's source names for a device holding ``held`` (None: LoRA A)."""
    if "lora_a" in src:
        return None
    return src["shard"] if "shard" in src else shard_id(src["layer"], held[src["layer"]][src["slot"]])


@pytest.fixture(scope="module")
def setup():
    items, labels = bbc_news()
    gm = GlobalModel(tiny_spec(upcycle_noise=0.05, max_seq_len=T), {"bbc": labels}, "int8")
    return gm, labels, [(x, labels.index(c)) for x, c in items]


@pytest.fixture(scope="module")
def slot_program(setup):
    """The int8 program of two experts in layer 1 (slots ``{1: [0, 1]}``), with the sources of
    its frozen inputs (one export serves the tests below)."""
    slot_model, slot_stored = _device(setup[0], {1: [0, 1]})
    return export_training_program(slot_model, B, T, "int8", stored=slot_stored)


@pytest.mark.slow
def test_one_program_serves_every_expert_set_of_its_shape(setup, slot_program):
    gm, labels, items = setup
    held_a, held_b = {1: [1, 3]}, {1: [0, 2]}
    assert slot_shape(held_a) == {1: [0, 1]}
    program = slot_program
    assert program.shape["experts_per_layer"] == {"1": 2} and len(program.key) == 64
    assert len(program.pte) < 2**20  # weights are inputs, not baked in
    batch_inputs = [d["name"] for d in program.batch]
    assert batch_inputs == ["input_ids", "attention_mask", "labels"]
    for held in (held_a, held_b):
        model = _device(gm, held)[0]
        frozen = slot_named(model, held)
        assert [f["name"] for f in program.frozen] == list(frozen)
        logits = _check_step(program, model, held, items, list(frozen.values()))
        assert logits.shape == (B, len(labels))


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
    gm, _, _ = setup
    with pytest.raises(ValueError, match="by slot"):
        export_training_program(_device(gm, {1: [1, 3]})[0], B, T)


@pytest.mark.slow
def test_the_manifest_says_where_each_frozen_input_is_in_a_devices_shards(setup, slot_program):
    gm, _, _ = setup
    program = slot_program
    held = {1: [1, 3]}
    device, stored = _device(gm, held)
    frozen = slot_named(device, held)
    kinds = set()
    for spec in program.frozen:
        src = spec["source"]
        sid = _source(src, held)
        if sid is None:
            kinds.add("lora_a")
            assert ".lora_A" in src["lora_a"] and ".lora_A." in spec["name"]
            continue
        assert sid == BACKBONE or sid in {shard_id(1, 1), shard_id(1, 3)}
        t = stored[sid][src["tensor"]]
        kinds.add(str(t.dtype))
        assert torch.equal(t, frozen[spec["name"]]), spec["name"]
    assert kinds >= {"lora_a", "torch.int8", "torch.float32"}  # int8 weights are passed as stored


@pytest.mark.slow
def test_the_cloud_builds_each_shape_once_and_gives_a_device_its_lora_a(setup, tmp_path):
    gm, _, _ = setup
    cache = ProgramCache(gm, tmp_path)
    m1 = cache.get("bbc", {1: [1, 3]}, B, T)
    m2 = cache.get("bbc", {1: [0, 2]}, B, T)  # same shape: the same program
    assert m1 == m2 and cache.built == 1 and cache.path(m1["key"]).stat().st_size == m1["bytes"]
    assert ProgramCache(gm, tmp_path).get("bbc", {1: [2, 3]}, B, T) == m1  # found again after a restart
    assert cache.get("bbc", {1: [1]}, B, T)["key"] != m1["key"] and cache.built == 2  # another shape
    held = {1: [1, 3]}
    frozen = slot_named(cache.model_for("bbc", held)[0], held)
    lora_a = cache.lora_a(m1, held)
    assert lora_a
    for f in m1["frozen"]:
        if "lora_a" in f["source"]:
            assert torch.equal(lora_a[f["source"]["lora_a"]], frozen[f["name"]])
    with pytest.raises(ValueError):
        cache.get("bbc", {1: [0, 1, 2, 3, 4]}, B, T)
    with pytest.raises(KeyError):
        cache.get("tweets", held, B, T)


def _check_device_step(gm, task, held, items, fmt, capacity_factor=None, ops="core"):
    """Export the program of ``held``'s shape (experts by slot, with sources), run it in
    ExecuTorch for a device holding ``held`` whose frozen inputs come from its own stored
    shards and the cloud's LoRA A, and compare loss and gradients with torch's."""
    cache = ProgramCache(gm, tempfile.mkdtemp())
    slot_model, slot_stored = cache.model_for(task, slot_shape(held))
    program = export_training_program(slot_model, B, T, fmt, stored=slot_stored, capacity_factor=capacity_factor,
                                      ops=ops)
    model, stored = _device(gm, held, task)
    lora_a = cache.lora_a(program.manifest(), held)  # what the cloud sends
    frozen = [lora_a[f["source"]["lora_a"]] if (sid := _source(f["source"], held)) is None
              else stored[sid][f["source"]["tensor"]] for f in program.frozen]
    _check_step(program, model, held, items, frozen)
    return program


@pytest.mark.slow
def test_nf4_weights_stay_packed_and_the_step_equals_torchs(setup):
    """nf4 base shards: the program takes the packed uint8 data and absmax as stored and
    dequantizes inside; loss and gradients equal torch's on the same quantized weights."""
    _, labels, items = setup
    gm = GlobalModel(tiny_spec(upcycle_noise=0.05, max_seq_len=T), {"bbc": labels}, "nf4")
    program = _check_device_step(gm, "bbc", {1: [1, 3]}, items, "nf4")
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
    _check_device_step(gm, "lm", {0: [1, 3], 1: [0, 2]}, TEXTS * 2, "int8")


@pytest.mark.slow
def test_a_capacity_bounded_step_equals_torchs_and_keeps_dequantized_weights_out_of_the_plan(tmp_path):
    """A program whose experts each take ``ceil(c·B·T·k/n)`` tokens (capacity factor 0.75 on a
    Qwen3-MoE holding all 4 experts, top-2: 36 of the 96 tokens each, so routed tokens are
    dropped) equals torch's step under the same factor, and plans less memory than the dense
    dispatch."""
    from transformers import AutoModelForCausalLM

    from tests.test_hf_moe import FAMILIES, TEXTS, _spec, _tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"]()).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    gm = GlobalModel(_spec(tmp_path, max_seq_len=T), {"lm": ["a", "b"]}, "int8")
    held = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    capped = _check_device_step(gm, "lm", held, TEXTS * 2, "int8", capacity_factor=0.75)
    assert capped.shape["capacity_factor"] == 0.75
    dense = _check_device_step(gm, "lm", held, TEXTS * 2, "int8")
    assert dense.shape["capacity_factor"] is None and capped.key != dense.key
    assert capped.planned_bytes < dense.planned_bytes
    with pytest.raises(ValueError, match="capacity_factor"):
        export_training_program(ProgramCache(gm, tmp_path / "c").model_for("lm", held)[0], B, T, "int8",
                                capacity_factor=0.0)


def _operators(pte: bytes) -> set[str]:
    """The names of the operators a program calls."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(pte)
    return {o.name for o in getattr(program, "program", program).execution_plan[0].operators}


@pytest.mark.slow
def test_a_step_with_the_projects_operators_equals_torchs_and_plans_less_than_the_core_one(tmp_path):
    """The project's operators (``ops="fedmoe"``, run by the native core's kernels loaded into
    ExecuTorch's Python runtime): on a Qwen3-MoE holding all 4 experts, top-2, each expert runs
    on exactly its routed tokens (``fedmoe::grouped_mm``) and the int8 output layer and loss are
    one operator (``fedmoe::lm_head_loss``); the step equals torch's, and plans less memory than
    the program in ExecuTorch's own operators (dense dispatch, whole logits)."""
    from transformers import AutoModelForCausalLM

    from tests.test_hf_moe import FAMILIES, TEXTS, _spec, _tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"]()).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    gm = GlobalModel(_spec(tmp_path, max_seq_len=T), {"lm": ["a", "b"]}, "int8")
    held = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    grouped = _check_device_step(gm, "lm", held, TEXTS * 2, "int8", ops="fedmoe")
    dense = _check_device_step(gm, "lm", held, TEXTS * 2, "int8")
    assert grouped.shape["ops"] == "fedmoe" and grouped.key != dense.key
    assert grouped.manifest()["runtime"] == "executorch-1.5+fedmoe2" and dense.manifest()["runtime"] == "executorch-1.5"
    # the output layer and loss are one operator: no (B, T, V) logits among the outputs
    assert [o["name"] for o in grouped.outputs[:3]] == ["loss", "sample_loss", "sample_correct"]
    assert dense.outputs[1]["name"] == "logits"
    assert grouped.planned_bytes < dense.planned_bytes
    # int8 experts take their weights as held (no fp32 stack), every 2-D product is fedmoe::gemm
    ops = _operators(grouped.pte)
    assert {"fedmoe::grouped_mm_int8", "fedmoe::gemm", "fedmoe::lm_head_loss"} <= ops and "aten::mm" not in ops
    assert "aten::mm" in _operators(dense.pte) and not any(o.startswith("fedmoe::") for o in _operators(dense.pte))
    with pytest.raises(ValueError, match="ops must be one of"):
        export_training_program(ProgramCache(gm, tmp_path / "c").model_for("lm", held)[0], B, T, "int8",
                                ops="grouped")


@pytest.mark.slow
def test_a_grouped_dispatch_step_with_biased_experts_equals_torchs(setup):
    """The upcycled BERT family's experts (``fc2(gelu(fc1(x)))`` with biases) under grouped
    dispatch, a device holding experts other than the slots'."""
    _, labels, items = setup
    _check_device_step(setup[0], "bbc", {1: [0, 2, 3]}, items, "int8", ops="fedmoe")


def test_new_empty_strided_is_rewritten_into_the_core_operator_set():
    """``aten.new_empty_strided`` (in a tied-embedding Qwen3-MoE's backward; ExecuTorch's
    runtime has no kernel for it or for ``empty_strided``) becomes ``aten.empty`` in the
    source's dtype when its strides are contiguous, and is refused otherwise."""
    from moe_model.training_program import _core_operator_rewrites

    class M(torch.nn.Module):
        def __init__(self, stride):
            super().__init__()
            self.stride = stride

        def forward(self, x):
            y = torch.ops.aten.new_empty_strided.default(x, [2, 3], self.stride)
            return torch.ops.aten.fill.Scalar(y, 1.0) + x

    x = torch.randn(2, 3, dtype=torch.float64)
    ep = torch.export.export(M([3, 1]), (x,))
    ops = lambda: {n.target for n in ep.graph_module.graph.nodes if n.op == "call_function"}  # noqa: E731
    assert torch.ops.aten.new_empty_strided.default in ops()
    _core_operator_rewrites(ep)
    assert torch.ops.aten.new_empty_strided.default not in ops() and torch.ops.aten.empty.memory_format in ops()
    out = ep.module()(x)
    assert out.dtype == torch.float64 and torch.equal(out, x + 1.0)
    bad = torch.export.export(M([1, 2]), (x,))
    with pytest.raises(ValueError, match="non-contiguous"):
        _core_operator_rewrites(bad)


def test_dequantized_weights_are_recomputed_for_the_backward_pass():
    """A weight dequantized inside the program (int8 data x row scales) is used by the
    forward product and again by the backward product (the input's gradient): the export
    recomputes it right before each use, so no fp32 copy lives from the forward pass to the
    backward pass; the step's loss and gradients are unchanged."""
    from torch.export.experimental import _export_forward_backward

    from moe_model.training_program import _recompute_frozen_casts, computed_from

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 32)

        def forward(self, x, data, scale):
            y = torch.nn.functional.linear(self.a(x).relu(), data.float() * scale[:, None])
            return (y ** 2).mean(), y.detach()

    torch.manual_seed(0)
    module = Step()
    args = (torch.randn(4, 8), torch.randint(-127, 128, (32, 32), dtype=torch.int8), torch.rand(32) / 100)

    def joint(recompute):
        ep = _export_forward_backward(torch.export.export(module, args, strict=False))
        frozen = set(list(ep.graph_signature.user_inputs)[1:])
        if recompute:
            assert _recompute_frozen_casts(ep, frozen) > 0
        nodes = list(ep.graph.nodes)
        derived = computed_from(ep.graph, frozen)
        assert any(n.op == "call_function" for n in derived)  # the dequantization
        gap = max(nodes.index(u) - nodes.index(n) for n in derived if n.op != "placeholder" for u in n.users)
        return ep, gap

    kept, gap_kept = joint(False)
    recomputed, gap = joint(True)
    assert gap_kept > 5 and gap <= 3  # kept from the forward pass / made right before each use


    def run(ep):  # the joint graph on its parameters and the inputs: loss, output, then the gradients
        user = iter(args)
        flat = [ep.state_dict[s.target] if s.kind.name == "PARAMETER" else next(user)
                for s in ep.graph_signature.input_specs]
        return ep.graph_module(*flat)

    want, got = run(kept), run(recomputed)
    assert len(want) == len(got) == 4 and all(torch.equal(a, b) for a, b in zip(want, got))


def test_the_inputs_are_used_in_place_not_copied_into_the_memory_plan(slot_program):
    """A planned input is copied into the program's arena by ExecuTorch: every frozen weight
    would be held twice. The batch and frozen inputs have no place in the plan."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    plan = deserialize_pte_binary(slot_program.pte).program.execution_plan[0]
    assert len(plan.inputs) == len(slot_program.batch) + len(slot_program.frozen)
    assert all(plan.values[i].val.allocation_info is None for i in plan.inputs)
    assert any(v.val.allocation_info is not None for v in plan.values if hasattr(v.val, "allocation_info"))


def test_the_numpy_memory_plan_is_executorchs_greedy_plan(setup, monkeypatch):
    """The export plans memory with moe_model.program_memory.greedy: the program's bytes (every
    tensor's arena offset included) equal those of ExecuTorch's own greedy planner."""
    from executorch.exir.memory_planning import greedy

    from moe_model import training_program

    model, stored = _device(setup[0], {1: [0, 1]})
    ours = export_training_program(model, B, T, "int8", stored=stored)
    config = training_program._backend_config
    monkeypatch.setattr(training_program, "_backend_config", lambda: config(greedy))
    theirs = export_training_program(model, B, T, "int8", stored=stored)
    assert ours.planned_bytes == theirs.planned_bytes > 0
    assert ours.pte == theirs.pte
