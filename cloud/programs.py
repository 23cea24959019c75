"""Training programs for native devices, built by the cloud on demand and cached by shape.

A native (phone-class) device trains with an ExecuTorch training program
(:mod:`moe_model.training_program`) instead of the Python SDK. One program serves every
device of a *shape* (task, experts held per MoE layer, batch size, sequence length, the
global model's spec and weight format), so the cloud builds each shape once, the first time
a device of that shape needs it, and keeps it in ``directory`` as ``{key}.pte`` and
``{key}.json`` (the manifest; ``key`` = sha256 of the shape), where a restarted aggregator
finds it again. :meth:`ProgramCache.lora_a` gives the frozen LoRA ``A`` factors a device of
a given expert set needs as data (drawn by torch from the shared seed, which a device
without torch cannot reproduce).

:class:`ProgramPublisher` serves them (protocol minor 12, ``Assignment.program``): the
program, its manifest and the device's frozen ``A`` factors become content-addressed files
``{sha256}.pte``, ``{sha256}.json`` and ``{sha256}.safetensors`` in the aggregator's
``shard_dir``, which a web server serves at ``shard_url`` beside the base shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from moe_model.shards import held_tensors, shards_for, stored_tensors
from moe_model.submoe import SubMoE, lora_a_init
from moe_model.training_program import FEDMOE_RUNTIME, RUNTIMES, TrainingProgram, export_training_program, from_slots, \
    program_shape, shape_key, slot_shape
from protocol.codec import encode_tensors
from protocol.experts import Experts
from protocol.messages import FileRef, ProgramRef

from .global_model import GlobalModel

log = logging.getLogger(__name__)


class ProgramCache:
    """Training programs of one global model by shape (module docstring).

    Args:
        model: the global model (its spec, tasks and primary-format base shards).
        directory: where programs are kept (created).

    Attributes:
        built: programs exported by this instance (a cached one is not counted).
    """

    def __init__(self, model: GlobalModel, directory: str | Path):
        self.model = model
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.built = 0

    def model_for(self, task: str, experts: dict[int, list[int]]) -> tuple[SubMoE, dict[str, dict[str, torch.Tensor]]]:
        """The sub-MoE holding ``experts`` (layer -> global ids) for ``task``, built as a
        device builds it from the primary-format base shards (quantized weights kept as
        stored), and those stored shard tensors by shard id (what
        ``moe_model.training_program.frozen_sources``
        finds the frozen inputs in).

        Raises:
            KeyError: unknown task or expert.
        """
        gm = self.model
        raw = {sid: stored_tensors(gm.shard_bytes[sid]) for sid in shards_for(experts)}
        shards = {sid: held_tensors(t, meta, True) for sid, (t, meta) in raw.items()}
        return SubMoE(gm.spec, experts, task, len(gm.tasks[task]), shards), {sid: t for sid, (t, _) in raw.items()}

    def get(self, task: str, held: dict[int, list[int]], batch_size: int, seq_len: int,
            capacity_factor: float | None = None, ops: str = "fedmoe") -> dict:
        """The manifest of the program for a device holding ``held`` (layer -> global expert
        ids) for ``task`` at ``batch_size`` x ``seq_len`` with the operators ``ops``
        (``moe_model.training_program.OPS``), each expert on at most its capacity of tokens
        under ``capacity_factor`` (``export_training_program``); built and stored the first
        time. The program's bytes are :meth:`path` ``(manifest["key"])``.

        Raises:
            KeyError: unknown task. ValueError: ``held`` is not a valid expert set of the
            model, or the model cannot have a program (``moe_model.training_program``).
            ImportError: ExecuTorch missing.
        """
        held = Experts(held)
        if any(layer not in self.model.all_experts or len(ids) > len(self.model.all_experts[layer])
               for layer, ids in held.items()):
            raise ValueError(f"experts {dict(held)} are not a sub-MoE of the model's {dict(self.model.all_experts)}")
        if task not in self.model.tasks:
            raise KeyError(f"unknown task {task!r}; the model has {sorted(self.model.tasks)}")
        key = shape_key(program_shape(self.model.spec, task, len(self.model.tasks[task]), held, batch_size, seq_len,
                                      self.model.weight_format, capacity_factor, ops))
        manifest_path = self.directory / f"{key}.json"
        if manifest_path.exists() and self.path(key).exists():
            return json.loads(manifest_path.read_text())
        model, stored = self.model_for(task, slot_shape(held))
        t0 = time.perf_counter()
        log.info("building the training program for %s, experts per layer %s, batch %d x %d, %s operators, capacity "
                 "factor %s (once per shape)", task, {layer: len(ids) for layer, ids in held.items()}, batch_size,
                 seq_len, ops, capacity_factor)
        program: TrainingProgram = export_training_program(model, batch_size, seq_len, self.model.weight_format,
                                                           stored=stored, capacity_factor=capacity_factor,
                                                           ops=ops)
        self.path(key).write_bytes(program.pte)
        manifest_path.write_text(json.dumps(program.manifest(), indent=1))
        self.built += 1
        log.info("training program %s built in %.1f s (%.0f KiB)", key[:12], time.perf_counter() - t0,
                 len(program.pte) / 1024)
        return program.manifest()

    def path(self, key: str) -> Path:
        """The ``.pte`` file of the program with this key."""
        return self.directory / f"{key}.pte"

    def lora_a(self, manifest: dict, held: dict[int, list[int]]) -> dict[str, torch.Tensor]:
        """The frozen LoRA ``A`` factors a device holding ``held`` passes to the program of
        ``manifest``, keyed as the manifest's sources name them (experts by slot): fp32
        ``(rank, in_features)`` each (``moe_model.submoe.lora_a_init`` of the held global
        expert's key).

        Raises:
            KeyError: ``held`` does not fill a slot the program has.
        """
        seed = self.model.spec.lora.seed
        out = {}
        for f in manifest["frozen"]:
            key = f.get("source", {}).get("lora_a")
            if key is not None:
                (global_key,) = from_slots({key: None}, held)
                out[key] = lora_a_init(seed, global_key, tuple(f["shape"]))
        return out


class ProgramPublisher:
    """Training programs served to devices that train with one (protocol minor 12).

    Args:
        model: the global model.
        shard_dir: the directory a web server serves at ``shard_url`` (the base shards'
            ``AggregatorConfig.shard_dir``); programs are cached in ``{shard_dir}/programs``.
        shard_url: the base URL of ``shard_dir``.
        capacity_factor: the experts' capacity factor of every program
            (``AggregatorConfig.program_capacity_factor``; None: every routed token).
        ops: the operators programs use for devices whose runtime has them
            (``AggregatorConfig.program_ops``, ``moe_model.training_program.OPS``).

    A program is exported the first time a device of its shape is assigned, before the round
    opens (``RoundEngine._prepare_programs``: its deadline starts after the export, which
    takes 30 s for the demo model on 2 idle cores and about 100 s on a loaded machine, while
    the aggregator handles no messages); later devices of that shape, and a restarted
    aggregator, reuse it. A failed export is not tried again for that shape.
    """

    def __init__(self, model: GlobalModel, shard_dir: str | Path, shard_url: str,
                 capacity_factor: float | None = None, ops: str = "fedmoe"):
        self.cache = ProgramCache(model, Path(shard_dir) / "programs")
        self.capacity_factor = capacity_factor
        """Every program's experts' capacity factor (``AggregatorConfig.program_capacity_factor``)."""
        self.ops = ops
        """The operators of programs for devices whose runtime has them (``AggregatorConfig.program_ops``)."""
        self.directory, self.url = Path(shard_dir), shard_url.rstrip("/")
        self._refs: dict[tuple, ProgramRef] = {}
        self._failed: dict[tuple, str] = {}

    @staticmethod
    def refuses(runtimes: list[str]) -> str | None:
        """Why a device training with one of ``runtimes`` cannot get a program here, or None."""
        if any(r in runtimes for r in RUNTIMES):
            return None
        return f"trains with {', '.join(runtimes)}; this aggregator builds programs for {', '.join(RUNTIMES)}"

    def ops_for(self, runtimes: list[str]) -> str:
        """The operators of the programs a device training with ``runtimes`` gets: ``fedmoe``
        where configured and the device names :data:`FEDMOE_RUNTIME` (its runtime has the
        project's operators), else ``core``."""
        return "fedmoe" if self.ops == "fedmoe" and FEDMOE_RUNTIME in runtimes else "core"

    def ref_for(self, task: str, held: dict[int, list[int]], batch_size: int, seq_len: int,
                runtimes: list[str] = RUNTIMES) -> ProgramRef:
        """The :class:`ProgramRef` of a device holding ``held`` (layer -> global expert ids)
        for ``task``, training on batches of ``batch_size`` x ``seq_len`` tokens in one of
        ``runtimes`` (:meth:`ops_for`); exports the program and writes its files the first
        time.

        Raises:
            KeyError, ValueError, ImportError: as :meth:`ProgramCache.get`. OSError: a file
            could not be written. RuntimeError: an earlier attempt for the same device shape
            failed (not tried again: an export can take minutes).
        """
        held = Experts(held)
        ops = self.ops_for(runtimes)
        key = (task, tuple((layer, tuple(ids)) for layer, ids in sorted(held.items())), batch_size, seq_len, ops)
        if key in self._failed:
            raise RuntimeError(f"an earlier export failed: {self._failed[key]}")
        ref = self._refs.get(key)
        if ref is None:
            try:
                manifest = self.cache.get(task, held, batch_size, seq_len, self.capacity_factor, ops)
                lora_a = self.cache.lora_a(manifest, held)
                ref = ProgramRef(runtime=manifest["runtime"], key=manifest["key"],
                                 program=self._put(self.cache.path(manifest["key"]).read_bytes(), ".pte"),
                                 manifest=self._put(json.dumps(manifest, sort_keys=True).encode(), ".json"),
                                 lora_a=self._put(encode_tensors(lora_a, "fp32"), ".safetensors") if lora_a else None)
            except Exception as e:
                self._failed[key] = f"{type(e).__name__}: {e}"[:500]
                raise
            self._refs[key] = ref
        return ref

    def _put(self, data: bytes, suffix: str) -> FileRef:
        """``data`` as the file ``{sha256}{suffix}`` of the served directory (written once,
        atomically) and its reference."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.directory / f"{digest}{suffix}"
        if not path.exists():
            tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return FileRef(url=f"{self.url}/{digest}{suffix}", bytes=len(data), sha256=digest)
