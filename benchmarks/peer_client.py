"""The peer a practitioner picks instead of us, one device-round per process: FlowerTune-style
peft LoRA on the *whole* Hugging Face MoE (A and B trained, every expert), base weights in
fp32 or 4-bit nf4 through bitsandbytes, optional gradient checkpointing.

Variants (``VARIANTS``), as a user would write them with transformers 5 + peft + bitsandbytes:

- ``fp32``: ``from_pretrained(dtype=float32)``.
- ``nf4``: the FlowerTune LLM template: ``BitsAndBytesConfig(load_in_4bit=True, nf4)``,
  ``dtype=bfloat16``, then ``peft.prepare_model_for_kbit_training``. bitsandbytes quantizes
  ``nn.Linear`` modules only; transformers 5's MoE experts are fused 3-D parameters
  (``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``), so they load in bf16 and
  ``prepare_model_for_kbit_training`` then casts every non-4-bit parameter to fp32.
- ``nf4+gc``: the same with gradient checkpointing (``use_gradient_checkpointing=True``).
- ``nf4+bf16+gc``: the strongest peer we could build: nf4 ``nn.Linear`` s, the experts kept
  in bf16 (no fp32 cast), gradient checkpointing.

LoRA targets are ours (the experts' projections through peft's ``target_parameters``, the
routers trained whole through ``modules_to_save``), same rank and alpha, AdamW at the same
learning rate, the same number of steps and batch size, the same tokenisation
(right-padded, truncated to T, loss on real tokens).

    python -m benchmarks.peer_client JOB.json    # reads the job, writes its result JSON

The job names the checkpoint, variant, data file (JSONL ``{"text", "label"}``), training
settings, the global adapter (``.npz``, absent in round 1) and where to write the updated
adapter (``.npz``) and the result: train loss, steps, seconds, peak RSS (bytes, ``VmHWM``),
the RSS after imports (baseline) and the trainable parameter names.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path


VARIANTS = ("fp32", "nf4", "nf4+gc", "nf4+bf16+gc")
"""Peer variants, weakest memory saving first (see the module docstring)."""


def build(checkpoint: str, variant: str, rank: int, alpha: float):
    """The peft model of ``variant`` on ``checkpoint``: ``(model, tokenizer)``; trainable
    parameters are the LoRA A/B of every expert projection and the routers.

    Raises:
        ValueError: unknown variant.
    """
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from moe_model.models.hf_moe import tokenizer

    if variant not in VARIANTS:
        raise ValueError(f"unknown peer variant {variant!r}; known: {VARIANTS}")
    gc = variant.endswith("+gc")
    if variant == "fp32":
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    else:
        # a zero-width shared expert (a BTX build's Qwen2-MoE) stays unquantized: bitsandbytes' CPU
        # inference kernel cannot reshape a 4-bit layer of 0 inputs (it trains through it, evaluates not)
        config = AutoConfig.from_pretrained(checkpoint)
        skip = ["lm_head"] + ([r".*\.shared_expert"] if getattr(config, "shared_expert_intermediate_size", None) == 0
                              else [])
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               llm_int8_skip_modules=skip)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=q, dtype=torch.bfloat16)
        if variant == "nf4+bf16+gc":
            for p in model.parameters():
                p.requires_grad_(False)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        else:
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=gc, gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=[],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                     modules_to_save=["mlp.gate"])  # the router; not Qwen2-MoE's mlp.shared_expert_gate
    return get_peft_model(model, cfg), tokenizer(checkpoint)  # ours: pad = eos if none, right-padded


def trainable_state(model) -> dict:
    """The trainable tensors by name (fp32 CPU copies)."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_state(model, state: dict) -> None:
    """Copy ``state`` into the trainable parameters. Raises KeyError on a missing name."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t.to(params[n].dtype))


def batch(tok, texts: list[str], max_len: int):
    """input_ids/attention_mask (B, T) and labels (B, T) with ``objectives.IGNORE`` (-100,
    transformers' ignore index too) at padding (the causal-LM shift happens inside the loss)."""
    from moe_model.objectives import IGNORE

    enc = tok(texts, truncation=True, max_length=max_len, padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, IGNORE)
    return enc["input_ids"], enc["attention_mask"], labels


def loss_sums(model, tok, texts: list[str], max_len: int, batch_size: int = 16) -> tuple[float, float]:
    """(summed next-token loss in nats, target tokens) over ``texts``, computed by
    ``moe_model.objectives`` as our cloud computes it (``moe_model.train.evaluate``)."""
    import torch

    from moe_model import objectives

    model.eval()
    loss_sum, n = 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            ids, mask, labels = batch(tok, texts[i:i + batch_size], max_len)
            logits = model(input_ids=ids, attention_mask=mask).logits
            w = objectives.sample_weight("causal-lm", labels)
            loss_sum += float((objectives.sample_loss("causal-lm", logits, labels) * w).sum())
            n += float(w.sum())
    model.train()
    return loss_sum, n


def perplexity_by_label(model, tok, items: list[tuple[str, object]], max_len: int) -> tuple[float, dict[str, float]]:
    """The perplexity (``exp`` of the token-level mean next-token loss, :func:`loss_sums`) over
    ``items`` ``(text, label)`` and, where they carry more than one label, each label's (one
    evaluation: each label's texts apart, the whole as their token-weighted mean, as the
    cloud's ``per_label``); ``{}`` for one label."""
    from moe_model import objectives

    groups: dict[str, list[str]] = {}
    for x, y in items:
        groups.setdefault(str(y), []).append(str(x))
    sums = {y: loss_sums(model, tok, texts, max_len) for y, texts in sorted(groups.items())}
    whole = sum(ls for ls, _ in sums.values()) / max(sum(n for _, n in sums.values()), 1.0)
    per_label = {y: objectives.perplexity(ls / max(n, 1.0)) for y, (ls, n) in sums.items()} if len(sums) > 1 else {}
    return objectives.perplexity(whole), per_label


def run(job: dict) -> dict:
    """Train one device-round (see the module docstring); returns the result dict."""
    import numpy as np
    import torch

    from edge_sdk.data import load_text_file, train_val_split
    from moe_model.budget import PeakMeter, current_footprint_bytes, current_rss_bytes

    torch.set_num_threads(int(job.get("threads", 1)))
    torch.manual_seed(int(job["seed"]))
    baseline, baseline_footprint = current_rss_bytes(), current_footprint_bytes()
    meter = PeakMeter().start()  # as EdgeClient measures: RSS, and the footprint a budget is held against
    t0 = time.time()
    model, tok = build(job["checkpoint"], job["variant"], int(job["rank"]), float(job["alpha"]))
    if job.get("adapter_in"):
        with np.load(job["adapter_in"]) as z:
            load_state(model, {k: torch.from_numpy(z[k]) for k in z.files})
    load_s = time.time() - t0
    items = load_text_file(job["data"]).items
    train, _ = train_val_split(items, 0.2, int(job["split_seed"]))
    texts = [str(x) for x, _ in train]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=float(job["lr"]), weight_decay=float(job.get("weight_decay", 0.0)))
    rng = random.Random(int(job["seed"]))
    steps, bs, loss_sum, t1 = int(job["steps"]), int(job["batch_size"]), 0.0, time.time()
    model.train()
    order: list[int] = []
    for _ in range(steps):
        if len(order) < bs:
            order += rng.sample(range(len(texts)), len(texts))
        chunk, order = order[:bs], order[bs:]
        ids, mask, labels = batch(tok, [texts[i] for i in chunk], int(job["max_seq_len"]))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.item()
        meter.mark()
    train_s = time.time() - t1
    state = trainable_state(model)
    np.savez(job["adapter_out"], **{k: v.numpy() for k, v in state.items()})
    peak, footprint = meter.peaks()
    return {"train_loss": loss_sum / max(steps, 1), "steps": steps, "samples": len(texts), "load_seconds": load_s,
            "train_seconds": train_s, "peak_rss_bytes": peak, "baseline_rss_bytes": baseline,
            "peak_footprint_bytes": footprint, "baseline_footprint_bytes": baseline_footprint,
            "trainable": sorted(state), "trainable_numel": sum(v.numel() for v in state.values())}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: peer_client.py JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(job)
    Path(job["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
