"""Hugging Face MoE checkpoints (``family = "hf-moe"``): tiny random-init models of four
families written with ``save_pretrained`` load through ``model.base = DIR``, cut into
per-expert shards bit-exactly, reproduce transformers' logits with every expert held, and
train LoRA on a sub-MoE."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from moe_model.models import all_experts, get_adapter
from moe_model.objectives import sample_loss
from moe_model.shards import BACKBONE, decode_shard, encode_shard, shards_for
from moe_model.submoe import SubMoE
from moe_model.train import evaluate, train_local
from protocol import keys
from protocol.messages import LoraSpec, ModelSpec, TrainConfig
from protocol.topics import shard_id

E = 4
BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "mixtral": lambda: MixtralConfig(**BASE, num_local_experts=E),
    "qwen3_moe": lambda: Qwen3MoeConfig(**BASE, num_experts=E, moe_intermediate_size=16, norm_topk_prob=True,
                                        head_dim=8),
    "olmoe": lambda: OlmoeConfig(**BASE, num_experts=E),
    "deepseek_v3": lambda: DeepseekV3Config(**{**BASE, "num_key_value_heads": 4}, n_routed_experts=E,
                                            moe_intermediate_size=16,
                                            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
                                            qk_nope_head_dim=4, v_head_dim=8),
    "qwen2_moe": lambda: Qwen2MoeConfig(**BASE, num_experts=E, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=32),
}
WORDS = "the a bank rate market team match goal film music vote minister growth shares player award".split()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(family, checkpoint dir, the transformers model loaded back from it)."""
    family = request.param
    d = tmp_path_factory.mktemp(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]())
    with torch.no_grad():  # give routers (and DeepSeek's correction bias) non-trivial values
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and p.shape[0] == E:
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.save_pretrained(d)
    _tokenizer().save_pretrained(d)
    loaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return family, d, loaded


def _spec(d, **kw) -> ModelSpec:
    return ModelSpec(family="hf-moe", base=str(d), tokenizer=None, num_experts=E, top_k=2,
                     max_seq_len=kw.pop("max_seq_len", 16), objective=kw.pop("objective", "causal-lm"),
                     upcycle_noise=0.0,
                     lora=LoraSpec(rank=2, alpha=4, attention=True), **kw)


def _shards(spec, fmt="fp32"):
    ad = get_adapter("hf-moe")
    skel = ad.build(spec, all_experts(ad, spec), 2, device="meta")
    raw = dict(ad.base_shards(spec, skel))
    return raw, {sid: decode_shard(encode_shard(t, fmt)) for sid, t in raw.items()}


TEXTS = [("the bank rate market growth", 0), ("a team match goal player award the", 1), ("film music", 0)]


def test_layers_and_shards_are_cut_bit_exactly(checkpoint):
    family, d, hf = checkpoint
    spec = _spec(d)
    ad = get_adapter("hf-moe")
    layers = ad.moe_layers(spec)
    assert layers == ([1] if family == "deepseek_v3" else [0, 1])
    raw, decoded = _shards(spec)
    assert list(raw)[0] == BACKBONE and set(raw) == set(shards_for(all_experts(ad, spec)))
    for layer in layers:
        block = hf.model.layers[layer].mlp
        experts = block.experts
        router = getattr(block, "gate", None) or block.router
        for e in range(E):
            sh = decoded[shard_id(layer, e)]
            assert torch.equal(torch.cat([sh["gate_proj.weight"], sh["up_proj.weight"]]), experts.gate_up_proj[e])
            assert torch.equal(sh["down_proj.weight"], experts.down_proj[e])
            assert torch.equal(sh["router_init"], router.weight[e].float())
            if family == "deepseek_v3":
                assert torch.equal(sh["router_e_score_correction_bias"], router.e_score_correction_bias[e:e + 1])


def test_all_experts_reproduce_transformers_logits(checkpoint):
    family, d, hf = checkpoint
    spec = _spec(d)
    _, decoded = _shards(spec)
    ad = get_adapter("hf-moe")
    sub = SubMoE(spec, all_experts(ad, spec), "news", 0, decoded).eval()
    batch, targets = sub.collate(TEXTS)
    assert targets.shape == batch["input_ids"].shape and int((targets == -100).sum()) > 0
    with torch.no_grad():
        ours = sub(batch)
        theirs = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    routers = [k for k in sub.trainable() if k.startswith("router.")]
    assert len(routers) == len(ad.moe_layers(spec)) * E


@pytest.mark.parametrize("tied", [True, False])
def test_backbone_held_int8_computes_what_its_dequantized_weights_compute(tmp_path, tied):
    """hf-moe holds the backbone in the shard format as the device loads it (ShardCache):
    the embedding table as a QuantEmbedding, attention linears and the output layer as
    QuantLinear (a tied output layer shares the embedding's stored table); logits and LoRA
    gradients equal those of the same model built from the dequantized fp32 shards."""
    from moe_model.budget import plan
    from moe_model.quant import QuantEmbedding, QuantLinear
    from moe_model.shards import ShardCache
    from protocol.codec import sha256_hex

    d = tmp_path / "ckpt"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(**BASE, num_experts=E, moe_intermediate_size=16, head_dim=8,
                                                    tie_word_embeddings=tied)).save_pretrained(d)
    _tokenizer().save_pretrained(d)
    spec = _spec(d)
    ad = get_adapter("hf-moe")
    experts = {x: [0, 2] for x in ad.moe_layers(spec)}
    skel = ad.build(spec, experts, 0, device="meta")
    cache, held, ref = ShardCache(tmp_path / "cache"), {}, {}
    for sid, t in ad.base_shards(spec, skel):
        blob = encode_shard(t, "int8")
        cache.put(sha256_hex(blob), blob)
        held[sid] = cache.load(sha256_hex(blob), keep_quantized=True)
        ref[sid] = decode_shard(blob)
    sub, full = SubMoE(spec, experts, "news", 0, held), SubMoE(spec, experts, "news", 0, ref)
    lm = sub.model.lm
    assert isinstance(lm.get_input_embeddings(), QuantEmbedding)
    assert isinstance(lm.get_output_embeddings(), QuantLinear)
    assert isinstance(lm.model.layers[0].self_attn.q_proj.base_layer, QuantLinear)
    shared = lm.get_output_embeddings().qweight_data.data_ptr() == lm.get_input_embeddings().q.qweight_data.data_ptr()
    assert shared == tied
    state = {k: torch.randn_like(v) * 0.1 for k, v in full.adapter_state().items()}
    sub.load_adapter_state(state)
    full.load_adapter_state(state)
    batch, targets = sub.collate(TEXTS)
    y, y2 = sub(batch), full(batch)
    assert torch.allclose(y, y2, atol=1e-4), (y - y2).abs().max()
    y.sum().backward()
    y2.sum().backward()
    for k, p in sub.trainable().items():
        assert torch.allclose(p.grad, full.trainable()[k].grad, atol=1e-3), k
    assert sub.num_base_bytes() < full.num_base_bytes()
    assert plan(spec, 2, "int8").weights < plan(spec, 2, "fp32").weights


def test_sub_moe_trains_one_lora_step_and_keys_are_per_expert(checkpoint):
    family, d, _ = checkpoint
    spec = _spec(d)
    _, decoded = _shards(spec, "int8")
    ad = get_adapter("hf-moe")
    held = {layer: [0, 3] for layer in ad.moe_layers(spec)}
    sub = SubMoE(spec, held, "news", 0, {s: decoded[s] for s in shards_for(held)})
    state = sub.trainable()
    experts = {(keys.parse(k).layer, keys.parse(k).expert) for k in state if k.startswith("expert.")}
    assert experts == {(layer, e) for layer in held for e in (0, 3)}
    assert any(k.endswith("gate_proj.lora_B") for k in state) and not any(k.startswith("head.") for k in state)
    before = {k: p.detach().clone() for k, p in state.items()}
    res = train_local(sub, TEXTS, TrainConfig(local_epochs=2, batch_size=3, lr=1e-2))
    assert res.steps == 2 and res.loss > 0
    changed = [k for k, p in state.items() if not torch.equal(p, before[k])]
    assert any(".lora_B" in k and k.startswith("expert.") for k in changed)
    ev = evaluate(sub, TEXTS)
    assert ev.tokens > 0 and ev.perplexity > 1.0


def test_a_bf16_checkpoint_builds_in_fp32_and_trains(tmp_path):
    """Published MoE checkpoints are bf16 (config ``dtype: bfloat16``), and transformers 5
    builds ``from_config`` in the config's dtype: the backbone must still be fp32 like the
    shards, or the first matmul fails with a dtype mismatch."""
    torch.manual_seed(0)
    d = tmp_path / "bf16"
    AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"]()).to(torch.bfloat16).save_pretrained(d)
    _tokenizer().save_pretrained(d)
    spec = _spec(d)
    _, decoded = _shards(spec, "int8")
    held = {layer: [1, 2] for layer in get_adapter("hf-moe").moe_layers(spec)}
    sub = SubMoE(spec, held, "news", 0, {s: decoded[s] for s in shards_for(held)})
    assert {p.dtype for p in sub.model.parameters() if p.is_floating_point()} == {torch.float32}
    assert train_local(sub, TEXTS, TrainConfig(local_epochs=1, batch_size=3, lr=1e-2)).steps == 1


def test_gradient_checkpointing_gives_the_same_gradients_in_less_planned_memory(checkpoint):
    _, d, _ = checkpoint
    grads = []
    for ckpt in (False, True):
        spec = _spec(d, gradient_checkpointing=ckpt)
        _, decoded = _shards(spec)
        held = {layer: [1, 2] for layer in get_adapter("hf-moe").moe_layers(spec)}
        sub = SubMoE(spec, held, "news", 0, {s: decoded[s] for s in shards_for(held)}).train()
        batch, targets = sub.collate(TEXTS)
        sample_loss("causal-lm", sub(batch), targets).mean().backward()
        grads.append({k: p.grad.clone() for k, p in sub.trainable().items() if p.grad is not None})
        assert any(k.startswith("router.") for k in grads[-1]) and any(".lora_B" in k for k in grads[-1])
        if ckpt:
            assert any(getattr(m, "gradient_checkpointing", False) for m in sub.modules())
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], atol=1e-6), k
    big = get_adapter("hf-moe").activation_bytes(_spec(d, max_seq_len=64), 8)
    small = get_adapter("hf-moe").activation_bytes(_spec(d, max_seq_len=64, gradient_checkpointing=True), 8)
    assert small < big


def test_gradient_checkpointing_on_a_family_without_it_fails_with_the_reason():
    spec = ModelSpec(family="conv-moe", base=None, tokenizer=None, num_experts=4, top_k=2,
                     config={"channels": [4, 8], "hidden": 16, "ffn": 32}, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        SubMoE(spec, {0: [0, 1]}, "img", 3, None)


def test_classification_objective_uses_a_task_head(checkpoint):
    _, d, _ = checkpoint
    spec = _spec(d, objective="classification")
    _, decoded = _shards(spec)
    ad = get_adapter("hf-moe")
    sub = SubMoE(spec, all_experts(ad, spec), "news", 2, decoded)
    batch, labels = sub.collate(TEXTS)
    assert sub(batch).shape == (3, 2) and labels.tolist() == [0, 1, 0]
    assert any(k.startswith("head.news.") for k in sub.trainable())


def test_bad_checkpoints_fail_with_the_reason(tmp_path, checkpoint):
    _, d, _ = checkpoint
    ad = get_adapter("hf-moe")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ad.moe_layers(_spec(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="experts per MoE layer"):
        ad.moe_layers(_spec(d).model_copy(update={"num_experts": 8}))


def test_cli_model_option_names_a_missing_checkpoint(tmp_path, capsys):
    from fedmoe.cli import main

    assert main(["simulate", "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "does not exist" in err


def _mixtral_checkpoint(d):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES["mixtral"]())
    model.save_pretrained(d)
    _tokenizer().save_pretrained(d)
    return d


def test_the_clouds_lm_evaluation_gives_each_labels_perplexity_and_their_token_weighted_mean(tmp_path):
    from cloud.global_model import GlobalModel
    from cloud.strategies import get_strategy
    from cloud.strategy import Setup

    spec = _spec(_mixtral_checkpoint(tmp_path / "ckpt"))
    model = GlobalModel(spec, {"t": ["x", "y"]}, "fp32")
    items = [("the bank rate market growth shares", 0), ("film music award", 1), ("a team match goal", 1),
             ("vote minister the bank", 0), ("player award film", 1)]
    strategy = get_strategy("composed")(Setup(model.layers, E, 0, TrainConfig(), {"t": ["x", "y"]}))
    got = strategy.evaluate(1, model, {"t": items})["per_task"]["t"]
    whole = model.evaluate("t", items)  # one evaluation of every item
    assert got["loss"] == pytest.approx(whole.loss, rel=1e-5) and got["tokens"] == whole.tokens
    assert got["accuracy"] == pytest.approx(whole.accuracy, rel=1e-5) and got["samples"] == 5
    for y in (0, 1):
        part = model.evaluate("t", [i for i in items if i[1] == y])
        assert got["per_label"][str(y)]["perplexity"] == pytest.approx(part.perplexity, rel=1e-5)
        assert got["per_label"][str(y)]["tokens"] == part.tokens
    one_label = strategy.evaluate(1, model, {"t": [i for i in items if i[1] == 0]})["per_task"]["t"]
    assert "per_label" not in one_label


@pytest.mark.slow
def test_causal_lm_federation_on_btx_domains_over_mqtt_lowers_perplexity(tmp_path):
    """``fedmoe simulate --model DIR --objective causal-lm --tasks domains``: an aggregator and
    two device processes over the embedded broker, 2 rounds, on the domains and held-out split
    the checkpoint's ``btx.json`` records (written here for a random checkpoint); each device
    holds one domain, held-out perplexity is reported per domain and falls."""
    import json

    from edge_sdk.data import load_text_file
    from fedmoe.btx_domains import load_domains
    from fedmoe.cli import main

    ckpt = _mixtral_checkpoint(tmp_path / "ckpt")
    domains = ["bbc-sports", "bbc-tech"]
    _, held, record = load_domains(domains, seed=0)
    (ckpt / "btx.json").write_text(json.dumps({"domains": domains, **record}))
    out = tmp_path / "run"
    assert main(["simulate", "--model", str(ckpt), "--objective", "causal-lm", "--tasks", "domains",
                 "--partition", "classes:1", "--devices", "2", "--rounds", "2", "--max-samples-per-task", "60",
                 "--eval-max-samples", "8", "--lr", "1e-2", "--budget-range", "600MiB:700MiB",
                 "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    ppl = [report["initial_perplexity"]] + [r["perplexity"] for r in report["rounds"]]
    assert all(p is not None and p > 1 for p in ppl) and ppl[-1] < ppl[0], ppl
    assert all(len(r["devices"]) == 2 for r in report["rounds"])
    held_text = {name: "".join(texts) for name, texts in held.items()}
    test = load_text_file(out / "data" / "test-domains.jsonl").items
    assert sorted(y for _, y in test) == ["bbc-sports"] * 4 + ["bbc-tech"] * 4
    assert all(x in held_text[y] for x, y in test)  # the build's held-out documents
    for dev in ("dev-00", "dev-01"):  # classes:1: one domain per device
        assert len({y for _, y in load_text_file(out / "data" / f"{dev}.jsonl").items}) == 1
    per_label = report["rounds"][-1]["per_task"]["domains"]["per_label"]
    assert set(per_label) == {"0", "1"} and all(v["perplexity"] > 1 for v in per_label.values())
    assert (out / "perplexity.png").exists() and "ppl" in (out / "rounds.md").read_text()


def test_the_domains_task_needs_a_btx_checkpoint(tmp_path):
    from fedmoe.sim_config import SimulationConfig

    with pytest.raises(ValueError, match="no btx.json"):
        SimulationConfig(tasks=["domains"], model={"base": str(_mixtral_checkpoint(tmp_path / "ckpt"))})
    with pytest.raises(ValueError, match="or domains with a BTX checkpoint"):
        SimulationConfig(tasks=["news"])


@pytest.mark.parametrize("objective", ["causal-lm", "classification"])
def test_onnx_export_of_a_sub_moe_matches_torch(tmp_path, objective):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from edge_sdk.export import export_onnx, onnx_logits, onnx_session

    d = tmp_path / "mixtral"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(FAMILIES["mixtral"]()).save_pretrained(d)
    _tokenizer().save_pretrained(d)
    spec = _spec(d, objective=objective)
    _, decoded = _shards(spec)
    held = {layer: [0, 2, 3] for layer in get_adapter("hf-moe").moe_layers(spec)}
    sub = SubMoE(spec, held, "news", 2, {s: decoded[s] for s in shards_for(held)}).eval()
    texts = [t for t, _ in TEXTS]
    got = onnx_logits(onnx_session(export_onnx(sub, tmp_path / "m.onnx")), sub, texts)
    with torch.no_grad():
        want = sub(sub.collate(TEXTS)[0])
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4)
