"""The aggregator's global model, or one device's last sub-MoE, rebuilt from its store
(for ``fedmoe export``; the ONNX export itself is :mod:`edge_sdk.export`)."""

from __future__ import annotations

from typing import Any

from moe_model.shards import decode_shard
from moe_model.submoe import SubMoE
from protocol import keys
from protocol.codec import decode_tensors
from protocol.experts import Experts

from .global_model import GlobalModel
from .store import Store


def model_from_store(config: Any, store_url: str, task: str, device_id: str | None = None) -> SubMoE:
    """The global MoE (or, with ``device_id``, that device's last assigned sub-MoE) with
    the aggregator's latest global adapter state, from its config and store.

    Raises:
        KeyError: unknown task, or no assignment recorded for ``device_id``.
    """
    tasks = {name: t.labels for name, t in config.tasks.items()}
    if task not in tasks:
        raise KeyError(f"unknown task {task!r}; the config has {sorted(tasks)}")
    gm = GlobalModel(config.model, tasks, config.weight_format)
    store = Store(store_url)
    try:
        blob = store.get_blob("global_state")
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
    shards = {sid: decode_shard(gm.shard_bytes[sid]) for sid in ["backbone"] + [
        f"L{layer}.E{e}" for layer, ids in experts.items() for e in ids]}
    model = SubMoE(config.model, experts, task, len(tasks[task]), shards)
    model.load_adapter_state(keys.select(gm.state, experts, task))
    return model.eval()


