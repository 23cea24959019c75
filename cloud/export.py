"""The aggregator's global model, or one device's last sub-MoE, rebuilt from its store
(for ``fedmoe export``; the ONNX export itself is :mod:`edge_sdk.export`)."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from moe_model.shards import decode_shard
from moe_model.submoe import SubMoE
from protocol import keys
from protocol.codec import decode_tensors
from protocol.experts import Experts

from .global_model import GlobalModel
from .store import Store

log = logging.getLogger(__name__)


class StoredModel(NamedTuple):
    """What :func:`model_from_store` rebuilt."""

    model: SubMoE
    """The (sub-)MoE in eval mode, adapter state loaded."""
    labels: list[str]
    """The task's class names, by logit index."""
    round: int | None
    """The last completed round whose global state it holds (None: no round completed,
    the initial model)."""


def model_from_store(config: Any, store_url: str, task: str, device_id: str | None = None) -> StoredModel:
    """The global MoE (or, with ``device_id``, that device's last assigned sub-MoE) with
    the aggregator's latest global adapter state, from its config and store.

    Raises:
        KeyError: unknown task, or no assignment recorded for ``device_id``.
    """
    tasks = {name: t.labels for name, t in config.tasks.items()}
    if task not in tasks:
        raise KeyError(f"unknown task {task!r}; the config has {sorted(tasks)}")
    built = logging.getLogger(GlobalModel.__module__)
    level = built.level
    built.setLevel(logging.WARNING)  # its "global model v0" line names the shard version, not the state's round
    try:
        gm = GlobalModel(config.model, tasks, config.weight_format)
    finally:
        built.setLevel(level)
    store = Store(store_url)
    try:
        blob = store.get_blob("global_state")
        rnd = store.get_json("last_round") if blob is not None else None
        if blob is not None:
            gm.set_state(decode_tensors(blob, 2**34, {k: (tuple(v.shape), v.dtype) for k, v in gm.state.items()}))
        experts = gm.all_experts
        if device_id is not None:
            prev = store.get_json("previous_assignment", {})
            if device_id not in prev:
                raise KeyError(f"no assignment recorded for device {device_id!r}")
            experts = Experts.from_json(prev[device_id])
    finally:
        store.close()
    if blob is None:
        log.warning("%s holds no global state: exporting the initial, untrained global model", store_url)
    else:
        log.info("global model after round %s from %s", rnd, store_url)
    shards = {sid: decode_shard(gm.shard_bytes[sid]) for sid in ["backbone"] + [
        f"L{layer}.E{e}" for layer, ids in experts.items() for e in ids]}
    model = SubMoE(config.model, experts, task, len(tasks[task]), shards)
    model.load_adapter_state(keys.select(gm.state, experts, task))
    return StoredModel(model.eval(), list(tasks[task]), rnd)
