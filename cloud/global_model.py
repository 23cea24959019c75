"""The global MoE the cloud keeps: immutable base shards + the global adapter state.

The base weights are upcycled/pretrained once per model version, split into a
backbone shard and one shard per (layer, expert), and encoded in the federation's
weight format; devices fetch them by sha256. What changes each round is the global
adapter state (LoRA B factors, router rows, task heads; ALGORITHMS.md §0).

For evaluation the cloud builds the full MoE from the *decoded* shards, exactly the
weights a device computes with, plus the global adapter state.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from edge_sdk.models import all_experts, get_adapter
from edge_sdk.shards import decode_shard, encode_shard, shards_for, split_base
from edge_sdk.submoe import SubMoE
from edge_sdk.train import EvalResult, evaluate
from protocol import keys
from protocol.codec import sha256_hex
from protocol.messages import ModelSpec, ShardManifest
from protocol.topics import Topics

log = logging.getLogger(__name__)


class GlobalModel:
    """Base shards and global adapter state of one model version.

    Args:
        spec: the model spec.
        tasks: task name -> class labels.
        weight_format: format the base shards are published in (``int8``, ``fp32``...).
        version: model version (part of the shard topics).
    """

    def __init__(self, spec: ModelSpec, tasks: dict[str, list[str]], weight_format: str, version: int = 0):
        self.spec = spec
        self.tasks = {t: list(labels) for t, labels in tasks.items()}
        self.weight_format = weight_format
        self.version = version
        adapter = get_adapter(spec.family)
        self.layers = adapter.moe_layers(spec)
        self.all_experts = all_experts(adapter, spec)
        skeleton = adapter.build(spec, self.all_experts, 2, device="meta")
        shards = split_base(adapter.base_state(spec), skeleton)
        self.shard_bytes: dict[str, bytes] = {sid: encode_shard(t, weight_format) for sid, t in shards.items()}
        self.shard_sha = {sid: sha256_hex(b) for sid, b in self.shard_bytes.items()}
        del shards
        decoded = {sid: decode_shard(b) for sid, b in self.shard_bytes.items()}
        self.models: dict[str, SubMoE] = {
            task: SubMoE(spec, self.all_experts, task, len(labels), decoded) for task, labels in self.tasks.items()
        }
        self.state: dict[str, torch.Tensor] = {}
        for m in self.models.values():
            self.state.update(m.adapter_state())
        self._shapes = {k: (tuple(v.shape), v.dtype) for k, v in self.state.items()}
        log.info("global model v%d: %d MoE layers x %d experts, base shards %.1f MiB (%s), adapter state %.2f MiB",
                 version, len(self.layers), spec.num_experts, sum(map(len, self.shard_bytes.values())) / 2**20,
                 weight_format, sum(v.numel() * 4 for v in self.state.values()) / 2**20)

    def manifests(self, experts: dict[int, list[int]], topics: Topics, chunk_payload: int) -> list[ShardManifest]:
        """Manifests of the base shards a device holding ``experts`` needs."""
        from protocol.chunking import chunk_data_bytes

        step = chunk_data_bytes(chunk_payload)
        return [
            ShardManifest(
                shard_id=sid, topic=topics.shard_prefix(self.version, sid), bytes=len(self.shard_bytes[sid]),
                sha256=self.shard_sha[sid], format=self.weight_format,
                chunks=max(1, -(-len(self.shard_bytes[sid]) // step)),
            )
            for sid in shards_for(experts)
        ]

    def state_for(self, experts: dict[int, list[int]], task: str) -> dict[str, torch.Tensor]:
        """The part of the global adapter state a device holding ``experts`` for ``task`` gets."""
        return keys.select(self.state, experts, task)

    def expected_for(self, experts: dict[int, list[int]], task: str) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Exact names, shapes and dtypes an update from such a device must have."""
        return keys.select(self._shapes, experts, task)

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the global adapter state (same keys and shapes).

        Raises:
            ValueError: keys or shapes differ from the model's.
        """
        if set(state) != set(self._shapes) or any(tuple(state[k].shape) != s for k, (s, _) in self._shapes.items()):
            raise ValueError("new global state does not match the model's adapter state layout")
        self.state = dict(state)

    @torch.no_grad()
    def evaluate(self, task: str, items: Sequence[tuple[Any, int]], batch_size: int = 32) -> EvalResult:
        """Loss and accuracy of the global model (all experts) on ``items`` of ``task``."""
        model = self.models[task]
        model.load_adapter_state(keys.select(self.state, self.all_experts, task))
        return evaluate(model, items, batch_size)
