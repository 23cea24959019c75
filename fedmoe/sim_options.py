"""The ``fedmoe simulate`` options: each ``--NAME`` and the field of
:class:`fedmoe.sim_config.SimulationConfig` it sets (:data:`OPTIONS`), the flat keywords
the config accepts for nested fields (:data:`ALIASES`), and a field path or error location
named as the option that sets it."""

from __future__ import annotations

from typing import Any

import yaml

from .options import Option, comma_list, flag


def _key_values(text: str) -> dict[str, Any]:
    """``a=1,b=x`` -> {"a": 1, "b": "x"} (YAML-typed values)."""
    out = {}
    for part in filter(None, text.split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = yaml.safe_load(v)
    return out


def _lo_hi(text: str) -> tuple[str, str]:
    """``"LO:HI"`` -> (LO, HI); ``"X"`` -> (X, X)."""
    lo, _, hi = text.partition(":")
    return lo, hi or lo


OPTIONS: dict[str, Option] = {
    "out": Option("out", "output directory (default runs/demo)"),
    "devices": Option("devices"),
    "rounds": Option("rounds"),
    "tasks": Option("tasks", "comma-separated built-in tasks: bbc, tweets; or domains: the text domains and held-out "
                    "split of a BTX --model (fedmoe upcycle --method btx)", comma_list),
    "partition": Option("partition", "iid | dirichlet:ALPHA | classes:K"),
    "strategy": Option("strategy.name", "federated method (composed: --assignment + --aggregation; default)"),
    "strategy_params": Option("strategy.params", "k=v,... method parameters", _key_values),
    "assignment": Option("assignment.name", "assignment strategy (random_kept, full, fedmoe, flex, ...)"),
    "assignment_params": Option("assignment.params", "k=v,... strategy parameters", _key_values),
    "aggregation": Option("aggregation.name", "aggregation strategy (modular, ...)"),
    "aggregation_params": Option("aggregation.params", "k=v,... strategy parameters", _key_values),
    "budgets": Option("budgets", "per-device memory budgets, e.g. 700MiB,1GiB (device i gets the i-th, cycling; "
                                 "devices numbered task by task); overrides --budget-range", comma_list),
    "budget_range": Option("budget_range", "device memory budgets LO:HI, e.g. 0.7GiB:0.75GiB (default: from 2 to "
                                           "all experts per layer by the memory plan, on top of a device "
                                           "process's baseline measured on this machine)", _lo_hi),
    "small_devices": Option("small_devices", "the last N devices get a budget below one expert per layer at the "
                                             "batch size (they train only under fusion/fusion_hybrid)"),
    "native_devices": Option("native_devices", "the first N devices run the native device (fedmoe-device: C++ on "
                                               "ExecuTorch's runtime) instead of the Python SDK"),
    "broker": Option("broker", "use this broker instead of the embedded one"),
    "seed": Option("seed"),
    "num_experts": Option("model.num_experts"),
    "top_k": Option("model.top_k"),
    "max_seq_len": Option("model.max_seq_len"),
    "objective": Option("model.objective", "classification (task head) or causal-lm (next-token loss, perplexity)"),
    "local_epochs": Option("train.local_epochs"),
    "max_steps": Option("train.max_steps"),
    "batch_size": Option("train.batch_size"),
    "lr": Option("train.lr"),
    "prox_mu": Option("train.prox_mu"),
    "lora_rank": Option("model.lora.rank"),
    "min_lora_rank": Option("min_lora_rank", "heterogeneous LoRA ranks: a device may train a rank halved down to "
                                             "this, so a small budget holds more experts (default: every device "
                                             "trains --lora-rank)"),
    "lora_train_a": Option("model.lora.train_a", "train LoRA A as well as B (default: FFA-LoRA, A frozen from a "
                                                 "seed, B only: exact averaging, fewer bytes)", switch=True),
    "weight_format": Option("weight_format"),
    "full_finetune": Option("model.full_finetune", "train and ship every weight, no LoRA (full-model FedAvg "
                                                   "baseline; needs --weight-format fp32)", switch=True),
    "gradient_checkpointing": Option("model.gradient_checkpointing", "recompute each layer's activations in "
                                     "backward (less memory, about one more forward pass)", switch=True),
    "eval_max_samples": Option("eval_max_samples"),
    "max_samples_per_task": Option("max_samples_per_task", "seeded random subset of each task's data"),
    "allocator": Option("device.allocator", "mmap (default: lower peak, slower steps) or default (glibc's "
                                            "own: faster steps, higher peak); see results/allocator"),
    "update_precision": Option("device.update_precision"),
    "update_delta": Option("device.update_delta", switch=True),
    "update_error_feedback": Option("device.update_error_feedback", switch=True),
    "state_precision": Option("state_precision", "precision the cloud sends each device's adapter state in "
                                                 "(fp16/bf16 halve the download, int8 quarters it, nf4 ~7x)"),
    "update_compression": Option("device.update_compression", "zlib-compress each update payload (an nf4 LoRA "
                                                               "update shrinks by about a seventh)", switch=True),
    "state_compression": Option("state_compression", "zlib-compress the adapter state sent down", switch=True),
    "device_memory_limit": Option("device_memory_limit", "run each device in a memory cgroup whose hard limit is "
                                                         "its budget; the report counts OOM kills", switch=True),
    "dashboard": Option("dashboard", "HOST:PORT of the aggregator's live dashboard (e.g. "
                                                      "127.0.0.1:8080; cloud.dashboard)"),
    "metrics": Option("metrics", "HOST:PORT of the aggregator's Prometheus /metrics, /healthz, "
                                                  "/readyz"),
}
"""The ``fedmoe simulate`` options: ``--NAME`` (``_`` as ``-``) sets the field at the
option's path; ``SimulationConfig(NAME=...)`` does the same (:data:`ALIASES`)."""

ALIASES: dict[str, str] = {
    **{name: o.path for name, o in OPTIONS.items() if o.path.split(".")[0] != name},  # not --strategy: a str
    "base": "model.base", "model_config": "model.config", "aggregator_threads": "threads",
    "family": "model.family", "tokenizer": "model.tokenizer",
    "device_threads": "device.threads", "val_fraction": "device.val_fraction",
}
"""Flat keyword -> field path: ``SimulationConfig(lr=0.01, lora_rank=4)`` is
``SimulationConfig(train={"lr": 0.01}, model={"lora": {"rank": 4}})`` (the option names,
and the flat fields the config had before it reused the aggregator's sections)."""

_FLAGS = {o.path: flag(name) for name, o in OPTIONS.items()}


def option_name(path: str) -> str:
    """The command-line option of a field path, or the path where it has none."""
    return _FLAGS.get(path, path)


def error_name(loc: tuple) -> str:
    """An error location as the option that sets it (``--lora-rank (model.lora.rank)``),
    or its dotted path; list indices are dropped (``budgets.1`` is ``--budgets``)."""
    parts = [str(p) for p in loc if isinstance(p, str)]
    for n in range(len(parts), 0, -1):
        path = ".".join(parts[:n])
        if path in _FLAGS:
            name = _FLAGS[path]
            return name if name[2:].replace("-", "_") == path else f"{name} ({'.'.join(parts)})"
    return ".".join(parts)
