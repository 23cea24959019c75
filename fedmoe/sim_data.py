"""The data of a simulation: each built-in task split into the aggregator's test set, an
optional cloud-only reserved set, and non-IID shards, one per device, written as JSONL
files (:func:`prepare_data`). No text of the test set is in any device's or the
reserved data (:func:`split_task`)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

from . import btx_domains
from .datasets import load_task
from .partition import drop_test_texts, partition, reserve, split_train_test
from .sim_budgets import auto_budget_range, device_budgets
from .sim_config import SimulationConfig

log = logging.getLogger(__name__)


def split_task(task: str, seed: int = 0, test_fraction: float = 0.2, max_samples: int | None = None,
               dedup: bool = True) -> tuple[list[tuple[str, str]], list[str], list[int], list[int]]:
    """A built-in task split as ``fedmoe simulate`` splits it: (items, labels, train
    indices, test indices). ``max_samples``: a seeded random subset first. The test
    indices are shuffled (seeded): the packaged data sets are sorted by label, and
    ``eval_max_samples`` keeps a prefix. With ``dedup`` (default) a training item whose
    text is also a test item's is dropped (:func:`fedmoe.partition.drop_test_texts`;
    logged with the count), so no test text is trained on; the test part is the same
    either way. Deterministic for a seed.

    Raises:
        KeyError: unknown task.
    """
    items, labels = load_task(task)
    if max_samples and len(items) > max_samples:
        keep = random.Random(f"{seed}/{task}").sample(range(len(items)), max_samples)
        items = [items[i] for i in sorted(keep)]
    train_idx, test_idx = split_train_test(len(items), test_fraction, seed)
    random.Random(f"{seed}/{task}/test").shuffle(test_idx)
    if dedup:
        kept = drop_test_texts(items, train_idx, test_idx)
        if len(kept) < len(train_idx):
            log.info("%s: %d of %d training items dropped: their text is in the test split", task,
                     len(train_idx) - len(kept), len(train_idx))
        train_idx = kept
    return items, labels, train_idx, test_idx


def builtin_test_set(task: str, seed: int = 0, test_fraction: float = 0.2) -> tuple[list[tuple[str, str]], list[str]]:
    """The held-out test items of a built-in task that ``fedmoe simulate`` evaluates on
    (defaults: its default split), and the task's labels; what an aggregator config's
    ``eval_data: builtin:TASK`` means. Raises KeyError for an unknown task."""
    items, labels, _, test_idx = split_task(task, seed, test_fraction, dedup=False)  # the same test part
    return [items[i] for i in test_idx], labels


DOMAIN_SAMPLES, DOMAIN_EVAL_SAMPLES = 280, 35
"""Items of the ``domains`` task without ``max_samples_per_task`` / ``eval_max_samples``:
40 training and 5 test pieces for each of a 7-domain build's domains (a 300M-parameter
BTX model evaluates 35 pieces in about a minute on 2 CPU cores)."""


def split_domains(cfg: SimulationConfig) -> tuple[list[tuple[str, str]], list[str], list[int], list[int]]:
    """The ``domains`` task of ``cfg`` in :func:`split_task`'s shape: the BTX checkpoint
    ``cfg.model.base``'s domains and held-out split (:func:`fedmoe.btx_domains.domain_items`),
    documents cut into pieces of about ``model.max_seq_len`` tokens (5 characters each);
    ``max_samples_per_task`` training and ``eval_max_samples`` test pieces (defaults
    :data:`DOMAIN_SAMPLES`, :data:`DOMAIN_EVAL_SAMPLES`), the same number from every domain.

    Raises:
        FileNotFoundError: ``model.base`` is not a BTX build. ValueError: its split cannot
            be rebuilt (:func:`fedmoe.btx_domains.split_from_record`).
    """
    train, test, labels = btx_domains.domain_items(
        cfg.model.base, cfg.seed, cfg.max_samples_per_task or DOMAIN_SAMPLES,
        cfg.eval_max_samples or DOMAIN_EVAL_SAMPLES, chunk_chars=5 * cfg.model.max_seq_len)
    return train + test, labels, list(range(len(train))), list(range(len(train), len(train) + len(test)))


def prepare_data(cfg: SimulationConfig, data_dir: Path) -> tuple[list[dict], dict[str, dict]]:
    """Write per-device train files and per-task test files; return device specs and task configs."""
    from cloud.strategies import get_strategy
    from edge_sdk.data import write_jsonl

    data_dir.mkdir(parents=True, exist_ok=True)
    tasks: dict[str, dict] = {}
    devices: list[dict] = []
    per_task = [cfg.devices // len(cfg.tasks) + (1 if i < cfg.devices % len(cfg.tasks) else 0)
                for i in range(len(cfg.tasks))]
    if not cfg.budgets and cfg.budget_range is None:
        cfg.budget_range = auto_budget_range(cfg)
    budgets = device_budgets(cfg)
    reserve_fraction = get_strategy(cfg.strategy.name).reserve_fraction_of(cfg.strategy.params)
    for t, (task, n_dev) in enumerate(zip(cfg.tasks, per_task)):
        items, labels, train_idx, test_idx = (
            split_domains(cfg) if task == btx_domains.TASK
            else split_task(task, cfg.seed, cfg.test_fraction, cfg.max_samples_per_task))
        test_file = data_dir / f"test-{task}.jsonl"
        write_jsonl(test_file, [items[i] for i in test_idx])
        tasks[task] = {"labels": labels, "eval_data": str(test_file)}
        if reserve_fraction > 0:  # the cloud-only set (e.g. Fed-MoE's D^r): disjoint from every device's data
            train_idx, kept = reserve(train_idx, reserve_fraction, cfg.seed + t)
            reserved_file = data_dir / f"reserved-{task}.jsonl"
            write_jsonl(reserved_file, [items[i] for i in kept])
            tasks[task]["reserved_data"] = str(reserved_file)
        label_ids = [labels.index(items[i][1]) for i in train_idx]
        parts = partition(label_ids, n_dev, cfg.partition, cfg.seed + t)
        for k, part in enumerate(parts):
            device_id = f"dev-{len(devices):02d}"
            path = data_dir / f"{device_id}.jsonl"
            write_jsonl(path, [items[train_idx[j]] for j in part])
            devices.append({"device_id": device_id, "task": task, "data": str(path), "samples": len(part),
                            "budget_bytes": budgets[len(devices)]})
    return devices, tasks
