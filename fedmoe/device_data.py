"""``fedmoe data split``: per-device data files for a real deployment, and the held-out
test split kept apart.

A source (a user's CSV/JSONL with ``text,label``, or a built-in data set ``builtin:NAME``
of :mod:`fedmoe.datasets`) is split into a test part and a training part; the training
part is partitioned across the devices (:func:`fedmoe.partition.partition`: IID,
Dirichlet(alpha) label skew, or K classes per device). Written to the output directory::

    {device_id}.jsonl   one device's samples (the ``data`` of its ``fedmoe device``)
    test.jsonl          the held-out test split (the aggregator's ``eval_data``)
    manifest.json       source, method, seed, counts per device and label

For ``builtin:NAME`` the test split is exactly the one the aggregator evaluates on when a
task's ``eval_data`` is ``builtin:NAME`` (:func:`fedmoe.simulate.builtin_test_set`:
20 %, seed 0), whatever ``seed`` partitions the devices. A training sample whose text
also occurs in the test split (the packaged sets hold duplicate texts) goes to no
device: no test text is ever in a device file. Deterministic for a seed.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

BUILTIN = "builtin:"
BUILTIN_TEST_FRACTION = 0.2
"""The test fraction of a built-in set's split (``fedmoe.simulate.split_task``'s default,
what ``eval_data: builtin:NAME`` evaluates on)."""


def load_source(source: str, test_fraction: float | None, seed: int
                ) -> tuple[list[tuple[str, Any]], list[str], list[int], list[int]]:
    """(items ``(text, label)``, sorted label names, train indices, test indices) of ``source``.

    ``builtin:NAME``: :func:`fedmoe.simulate.split_task` with its defaults (the aggregator's
    ``builtin:NAME`` test split), its training part as split, with the texts of test items
    still in it (:func:`split_devices` drops them and counts them); ``test_fraction`` must be
    None or 0.2. A file: read by
    :func:`edge_sdk.data.load_text_file`, split by :func:`fedmoe.partition.split_train_test`
    with ``test_fraction`` (default 0.2; 0: no test split) and ``seed``.

    Raises:
        ValueError: unknown built-in set, another test fraction for a built-in set, a
            fraction outside [0, 1), an unreadable or empty file, missing columns.
        FileNotFoundError: no such file.
    """
    from .datasets import TASKS
    from .partition import split_train_test

    if source.startswith(BUILTIN):
        from .simulate import split_task

        name = source[len(BUILTIN):]
        if name not in TASKS:
            raise ValueError(f"--from {source}: unknown built-in data set (built-in: "
                             f"{', '.join(BUILTIN + t for t in sorted(TASKS))})")
        if test_fraction not in (None, BUILTIN_TEST_FRACTION):
            raise ValueError(f"--test-fraction {test_fraction}: the test split of {source} is fixed (20%, seed 0) "
                             f"to be the one the aggregator evaluates on as eval_data: {source}")
        items, labels, train_idx, test_idx = split_task(name, dedup=False)  # split_devices drops and counts
        return items, labels, train_idx, sorted(test_idx)
    from edge_sdk.data import load_text_file

    fraction = BUILTIN_TEST_FRACTION if test_fraction is None else test_fraction
    if not 0 <= fraction < 1:
        raise ValueError(f"--test-fraction {fraction}: must be in [0, 1)")
    if Path(source).is_file() and Path(source).stat().st_size == 0:
        raise ValueError(f"{source}: empty file, no samples")
    items = [(str(x), y) for x, y in load_text_file(source).items]
    if not items:
        raise ValueError(f"{source}: no samples (a CSV with a text,label header, or JSONL objects with text and label)")
    labels = sorted({str(y) for _, y in items})
    train_idx, test_idx = split_train_test(len(items), fraction, seed)
    return items, labels, train_idx, test_idx


def _per_label(items: Sequence[tuple[str, Any]], idx: Sequence[int], labels: Sequence[str]) -> dict[str, int]:
    counts = Counter(str(items[i][1]) for i in idx)
    return {y: counts.get(y, 0) for y in labels}


def split_devices(source: str, device_ids: Sequence[str], out: str | Path, partition: str = "iid", seed: int = 0,
                  test_fraction: float | None = None) -> dict[str, Any]:
    """Write ``{out}/{device_id}.jsonl`` for every device, ``{out}/test.jsonl`` and
    ``{out}/manifest.json`` (see the module docstring); returns the manifest.

    Args:
        source: ``builtin:NAME`` or a ``.csv``/``.jsonl`` file with ``text`` and ``label``.
        device_ids: the devices, in order (partition ``k`` goes to ``device_ids[k]``).
        out: output directory (created; files of an earlier split there, as its
            manifest lists them, are removed first).
        partition: ``iid``, ``dirichlet:ALPHA`` (ALPHA > 0) or ``classes:K``
            (:func:`fedmoe.partition.parse_partition`).
        seed: seed of the partition (and of a file's test split).
        test_fraction: see :func:`load_source`.

    Returns:
        The manifest: ``source``, ``method``, ``seed``, ``labels``, ``test`` (file, samples,
        per-label counts, ``eval_data``: what the aggregator config names), ``dropped``
        (training samples whose text is in the test split), ``devices`` (id -> file,
        samples, per-label counts).

    Raises:
        ValueError: bad source or parameters (see :func:`load_source`), no devices, a
            repeated device id, more devices than training samples, an impossible
            partition (e.g. ``classes:K`` above the class count).
        FileNotFoundError: no such source file.
    """
    from edge_sdk.data import write_jsonl
    from protocol.topics import check_id

    from .partition import drop_test_texts, parse_partition
    from .partition import partition as partition_indices

    ids = [check_id(d, "device id") for d in device_ids]
    if not ids:
        raise ValueError("no devices: give --count N (with --prefix) or --devices ID,ID,...")
    if len(set(ids)) != len(ids):
        raise ValueError(f"device ids repeat: {sorted(d for d, n in Counter(ids).items() if n > 1)}")
    try:
        parse_partition(partition)
    except ValueError as e:
        raise ValueError(f"--partition: {e}") from None
    items, labels, train_idx, test_idx = load_source(source, test_fraction, seed)
    kept = drop_test_texts(items, train_idx, test_idx)
    dropped = len(train_idx) - len(kept)
    if len(ids) > len(kept):
        raise ValueError(f"{len(ids)} devices but only {len(kept)} training samples in {source}")
    parts = partition_indices([labels.index(str(items[i][1])) for i in kept], len(ids), partition, seed)
    if any(not p for p in parts):
        raise ValueError(f"--partition {partition} left {sum(not p for p in parts)} of {len(ids)} devices without "
                         "samples: use fewer devices or a larger alpha")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _remove_previous(out)
    manifest: dict[str, Any] = {"source": source, "method": partition, "seed": seed, "labels": labels,
                                "test": None, "dropped": dropped, "devices": {}}
    if test_idx:
        write_jsonl(out / "test.jsonl", [items[i] for i in test_idx])
        manifest["test"] = {"file": "test.jsonl", "samples": len(test_idx),
                            "per_label": _per_label(items, test_idx, labels),
                            "eval_data": source if source.startswith(BUILTIN) else str((out / "test.jsonl").resolve())}
    for device_id, part in zip(ids, parts):
        idx = [kept[j] for j in part]
        random.Random(f"{seed}/{device_id}").shuffle(idx)  # not sorted by label, as the packaged sets are
        write_jsonl(out / f"{device_id}.jsonl", [items[i] for i in idx])
        manifest["devices"][device_id] = {"file": f"{device_id}.jsonl", "samples": len(idx),
                                          "per_label": _per_label(items, idx, labels)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log.info("split %s (%s, seed %d) into %d device files and %s in %s%s", source, partition, seed, len(ids),
             f"a test split of {len(test_idx)} samples" if test_idx else "no test split", out,
             f"; {dropped} training samples dropped: their text is in the test split" if dropped else "")
    return manifest


def _remove_previous(out: Path) -> None:
    """Remove the files an earlier split's ``manifest.json`` in ``out`` lists (no stale
    device files when the device count shrinks); nothing else."""
    path = out / "manifest.json"
    try:
        old = json.loads(path.read_text())
        files = [d["file"] for d in old["devices"].values()] + ([old["test"]["file"]] if old.get("test") else [])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    for f in files:
        if Path(f).name == f:  # a bare file name, as this module writes
            (out / f).unlink(missing_ok=True)


def summary(manifest: dict[str, Any]) -> str:
    """The manifest as a table for the terminal: one line per device (samples, count per
    label), then the test split and what the aggregator config names as ``eval_data``."""
    labels = manifest["labels"]
    width = max([len("device"), *map(len, manifest["devices"])])
    cols = [max(6, len(y)) for y in labels]
    head = f"{'device':<{width}} {'samples':>7}  " + " ".join(f"{y:>{w}}" for y, w in zip(labels, cols))
    rows = [f"{d:<{width}} {i['samples']:>7}  " + " ".join(f"{i['per_label'][y]:>{w}}" for y, w in zip(labels, cols))
            for d, i in manifest["devices"].items()]
    test = manifest["test"]
    tail = (f"test split: {test['file']} ({test['samples']} samples); aggregator config: "
            f"tasks.<task>.eval_data: {test['eval_data']}" if test else "no test split (--test-fraction 0)")
    if manifest["dropped"]:
        tail += f"\n{manifest['dropped']} training samples went to no device: their text is in the test split"
    return "\n".join([head, *rows, tail]) + "\n"
