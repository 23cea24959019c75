"""Local data on the device: reading ``text,label`` files and splitting train/validation.

Raw samples never leave the device; only the sub-MoE's adapter update and aggregate
statistics are published.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any, Sequence

from torch.utils.data import Dataset


class LabeledDataset(Dataset):
    """In-memory dataset of ``(input, label)`` pairs (label: class name or id)."""

    def __init__(self, items: Sequence[tuple[Any, Any]]):
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.items[i]


def load_text_file(path: str | Path) -> LabeledDataset:
    """Read a CSV (header with ``text`` and ``label`` columns) or JSONL file (objects
    with ``text`` and ``label``) into a :class:`LabeledDataset`.

    Raises:
        ValueError: unknown extension, missing columns, or a line that is not valid JSON
            (the message names the line).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    items: list[tuple[str, Any]] = []
    if path.suffix.lower() in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    items.append((str(obj["text"]), obj["label"]))
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: need a JSON object with text and label ({e})") from None
    elif path.suffix.lower() == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or not {"text", "label"} <= set(reader.fieldnames):
                raise ValueError(f"{path}: CSV header must contain text and label, got {reader.fieldnames}")
            items = [(row["text"], row["label"]) for row in reader]
    else:
        raise ValueError(f"{path}: unsupported data file type (use .csv or .jsonl)")
    return LabeledDataset(items)


def write_jsonl(path: str | Path, items: Sequence[tuple[str, Any]]) -> None:
    """Write ``(text, label)`` pairs as JSONL (the format :func:`load_text_file` reads)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for text, label in items:
            f.write(json.dumps({"text": text, "label": label}) + "\n")


def encode_labels(items: Sequence[tuple[Any, Any]], labels: Sequence[str]) -> list[tuple[Any, int]]:
    """Map labels (class names or integer ids) to ids ``0..len(labels)-1``.

    Raises:
        ValueError: a label that is neither a known class name nor a valid id.
    """
    index = {str(name): i for i, name in enumerate(labels)}
    out = []
    for x, y in items:
        if isinstance(y, str) and y in index:
            out.append((x, index[y]))
        elif isinstance(y, int) or (isinstance(y, str) and y.isdigit()):
            i = int(y)
            if not 0 <= i < len(labels):
                raise ValueError(f"label id {i} out of range for {len(labels)} classes")
            out.append((x, i))
        else:
            raise ValueError(f"unknown label {y!r}; expected one of {list(labels)}")
    return out


def train_val_split(items: Sequence, val_fraction: float, seed: int) -> tuple[list, list]:
    """Shuffle with ``seed`` and split off ``val_fraction`` for validation (>= 1 sample
    each when there are at least 2)."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = int(round(len(items) * val_fraction))
    if len(items) >= 2:
        n_val = min(max(n_val, 1), len(items) - 1)
    val = [items[i] for i in order[:n_val]]
    train = [items[i] for i in order[n_val:]]
    return train, val
