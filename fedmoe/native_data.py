"""``fedmoe data tokens``: a device's data file as the token ids the native device trains on.

A phone application tokenises with its platform's tokenizer; the native device
(``native/``, ``fedmoe-device``) takes token ids, not text. This writes them from a CSV or
JSONL data file (what ``fedmoe device --data`` reads) with the federation model's tokenizer,
exactly as the Python device tokenises (the model family's ``collate``: truncated to
``max_seq_len``), as one safetensors file:

- ``input_ids``, ``attention_mask``: int64 ``(N, T)``, right-padded with 0 (``T`` the longest
  sample, at most ``max_seq_len``);
- metadata ``fedmoe.labels``: the JSON list of the N labels as strings (class names or ids; the
  device maps them by the assignment's labels, as ``edge_sdk.data.encode_labels`` does),
  ``fedmoe.tokenizer`` and ``fedmoe.max_seq_len``.

The native device orders, splits and batches the samples as the Python device does with the
same seed, so both train on the same batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from protocol.messages import ModelSpec


def write_token_file(items: Sequence[tuple[str, Any]], spec: ModelSpec, path: str | Path) -> Path:
    """Tokenise ``items`` (``(text, label)``) for ``spec``'s model into ``path`` (module docstring).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: no items, or a family without a text tokenizer (``conv-moe``).
    """
    from safetensors.torch import save_file

    from moe_model.models.base import get_adapter

    if not items:
        raise ValueError("no samples to write")
    if spec.family == "conv-moe":
        raise ValueError("conv-moe has no tokenizer (its devices run the Python SDK)")
    batch, _ = get_adapter(spec.family).collate(spec, [(str(x), 0) for x, _ in items])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": batch["input_ids"].contiguous(), "attention_mask": batch["attention_mask"].contiguous()},
              str(path), metadata={"fedmoe.labels": json.dumps([str(y) for _, y in items]),
                                   "fedmoe.tokenizer": str(spec.tokenizer or spec.base),
                                   "fedmoe.max_seq_len": str(spec.max_seq_len)})
    return path
