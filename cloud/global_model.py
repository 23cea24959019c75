"""The global MoE the cloud keeps: immutable base shards + the global adapter state.

The base weights are upcycled/pretrained once per model version, split into a
backbone shard and one shard per (layer, expert), and encoded in the federation's
weight format; devices fetch them by sha256. What changes each round is the global
adapter state (LoRA B factors, router rows, task heads; docs/methods/index.md).

For evaluation the cloud builds the full MoE from the *decoded* shards, exactly the
weights a device computes with, plus the global adapter state.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Sequence

import torch

from moe_model.models import all_experts, get_adapter
from moe_model.shards import decode_shard, encode_shard, shards_for
from moe_model.submoe import SubMoE
from moe_model.train import EvalResult, evaluate
from protocol import keys
from protocol.codec import extra_tensor_problem, sha256_hex
from protocol.messages import ModelSpec, ShardManifest
from protocol.topics import Topics

log = logging.getLogger(__name__)
_OWNED_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class GlobalModel:
    """Base shards and global adapter state of one model version.

    Args:
        spec: the model spec.
        tasks: task name -> class labels.
        weight_format: the primary format of the base shards (``int8``, ``fp32``...); the
            cloud evaluates with exactly these (dequantized) weights.
        version: model version (part of the shard topics).
        formats: further formats the base shards are served in (a device gets the first
            of its own ``hello`` preferences that is served, :meth:`format_for`).
    """

    def __init__(self, spec: ModelSpec, tasks: dict[str, list[str]], weight_format: str, version: int = 0,
                 formats: Sequence[str] = ()):
        self.spec = spec
        self.tasks = {t: list(labels) for t, labels in tasks.items()}
        self.weight_format = weight_format
        self.formats = list(dict.fromkeys([weight_format, *formats]))
        self.version = version
        adapter = get_adapter(spec.family)
        self.layers = adapter.moe_layers(spec)
        self.all_experts = all_experts(adapter, spec)
        skeleton = adapter.build(spec, self.all_experts, 2, device="meta")
        self.encoded: dict[str, dict[str, bytes]] = {fmt: {} for fmt in self.formats}
        for sid, tensors in adapter.base_shards(spec, skeleton):  # one shard in memory at a time
            for fmt in self.formats:
                self.encoded[fmt][sid] = encode_shard(tensors, fmt)
        self.sha: dict[str, dict[str, str]] = {
            fmt: {sid: sha256_hex(b) for sid, b in enc.items()} for fmt, enc in self.encoded.items()}
        self.shard_bytes: dict[str, bytes] = self.encoded[weight_format]
        self.shard_sha = self.sha[weight_format]
        decoded = {sid: decode_shard(b) for sid, b in self.shard_bytes.items()}
        self.models: dict[str, SubMoE] = {
            task: SubMoE(spec, self.all_experts, task, len(labels), decoded) for task, labels in self.tasks.items()
        }
        self.state: dict[str, torch.Tensor] = {}
        for m in self.models.values():
            self.state.update(m.adapter_state())
        self._shapes = {k: (tuple(v.shape), v.dtype) for k, v in self.state.items()}
        self._sub_models: dict[tuple, SubMoE] = {}
        self.owned: dict[str, torch.Tensor] = {}
        """The strategy's own tensors (a gate, a routing distribution...; name -> tensor),
        kept and persisted with the adapter state (:meth:`set_owned`)."""
        log.info("global model v%d: %d MoE layers x %d experts, base shards %.1f MiB (%s), adapter state %.2f MiB",
                 version, len(self.layers), spec.num_experts, sum(map(len, self.shard_bytes.values())) / 2**20,
                 weight_format, sum(v.numel() * 4 for v in self.state.values()) / 2**20)

    def format_for(self, preferences: Sequence[str]) -> str | None:
        """The first of a device's preferred formats that is served (None: none is)."""
        return next((f for f in preferences if f in self.formats), None)

    def manifests(self, experts: dict[int, list[int]], topics: Topics, chunk_payload: int,
                  fmt: str | None = None, url: str | None = None) -> list[ShardManifest]:
        """Manifests of the base shards a device holding ``experts`` needs, in ``fmt``
        (default: the primary format); topics carry the format level; with ``url`` (a base
        URL) each names its content-addressed file ``{url}/{sha256}.safetensors``."""
        from protocol.chunking import chunk_data_bytes

        fmt = fmt or self.weight_format
        enc, sha = self.encoded[fmt], self.sha[fmt]
        step = chunk_data_bytes(chunk_payload)
        return [
            ShardManifest(
                shard_id=sid, topic=topics.shard_prefix(self.version, sid, fmt), bytes=len(enc[sid]),
                sha256=sha[sid], format=fmt, chunks=max(1, -(-len(enc[sid]) // step)),
                url=f"{url.rstrip('/')}/{sha[sid]}.safetensors" if url else None,
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

    def set_owned(self, owned: dict[str, torch.Tensor]) -> None:
        """Replace the strategy's own tensors.

        Raises:
            ValueError: a name that is not ``[A-Za-z0-9_.-]{1,128}``, a tensor that is not
                float32 or int64, or a non-finite value.
        """
        for name, t in owned.items():
            problem = extra_tensor_problem(t)
            if problem:
                raise ValueError(f"owned tensor {name!r} {problem}")
            if not _OWNED_NAME.fullmatch(name):
                raise ValueError(f"owned tensor name {name!r} must match {_OWNED_NAME.pattern}")
        self.owned = {k: v.detach().clone() for k, v in owned.items()}

    @torch.no_grad()
    def evaluate(self, task: str, items: Sequence[tuple[Any, int]], batch_size: int = 32,
                 experts: dict[int, list[int]] | None = None) -> EvalResult:
        """Loss and accuracy of the global model on ``items`` of ``task``.

        Args:
            experts: layer -> expert ids: evaluate the sub-MoE of only these experts (what
                every device of a ``fixed`` assignment holds); None: all experts.
        """
        experts = self.all_experts if experts is None else experts
        model = self.sub_model(task, experts)
        model.load_adapter_state(keys.select(self.state, experts, task))
        return evaluate(model, items, batch_size)

    def sub_model(self, task: str, experts: dict[int, list[int]]) -> SubMoE:
        """The sub-MoE of ``experts`` (layer -> ids) for ``task`` on the decoded base shards,
        built once per expert set (the full MoE is :attr:`models`); callers load the adapter
        state they need before each use."""
        if experts == self.all_experts:
            return self.models[task]
        key = (task, tuple((layer, tuple(ids)) for layer, ids in sorted(experts.items())))
        if key not in self._sub_models:
            shards = {sid: decode_shard(self.shard_bytes[sid]) for sid in shards_for(experts)}
            self._sub_models[key] = SubMoE(self.spec, experts, task, len(self.tasks[task]), shards)
        return self._sub_models[key]
