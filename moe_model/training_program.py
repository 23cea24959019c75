"""A sub-MoE's training step as an ExecuTorch training program, for devices without Python.

A phone-class device cannot embed CPython and torch; ExecuTorch's C++ runtime runs a
training step captured ahead of time (``torch.export`` of forward + loss, then
``torch.export.experimental._export_forward_backward``: the loss is the first output and
the gradients of the trainable tensors follow; the optimizer runs outside the graph).
:func:`export_training_program` captures the step of one :class:`moe_model.submoe.SubMoE`
*shape* (model spec, task, experts held per MoE layer, batch size, sequence length, weight
format) so that one program serves every device of that shape:

- **Frozen weights are program inputs, not constants.** Every base weight (fp32, or the
  int8/nf4 data and scales of a quantized linear, dequantized inside the program) and the
  frozen LoRA ``A`` factors are inputs after the batch, in :attr:`TrainingProgram.frozen`
  order; the device passes the tensors it already holds from its base shards, so nothing
  is copied into the program and int8 weights stay int8 in memory.
- **Experts are named by slot.** The program is exported with experts ``0..n-1`` in each
  MoE layer; a device holding global experts ``e_0 < e_1 < ...`` puts expert ``e_j`` in slot
  ``j`` (:func:`slot_of`), for the frozen inputs and the adapter-state keys alike.
- **The trainable tensors are the program's parameters**: exactly the adapter state a
  Python device trains and sends (:meth:`SubMoE.trainable`: LoRA ``B``, router rows, task
  head), each mapped to its adapter-state key in :attr:`TrainingProgram.trainable`.
- **Static shapes**: with the project's operators (:data:`OPS` ``fedmoe``) every MoE block
  runs each held expert on exactly its routed tokens (:mod:`moe_model.grouped`), else in its
  dense-dispatch form (every held expert on every token, combined by the zero-padded top-k
  gates: the function of the sparse dispatch without data-dependent control flow); under a
  capacity factor, each held expert on its capacity of tokens of largest gate
  (``MoELayer.capacity``); attention in
  its eager form (the fused scaled-dot-product attention's backward is not in ExecuTorch's
  core ATen operator set),
  and the batch is ``(batch_size, seq_len)``; a device pads a short last batch.
- **Without dropout**: the step runs the model in evaluation mode, so a program's step is
  deterministic (ExecuTorch cannot reproduce torch's dropout draws) and a Python device
  training with dropout off computes the same update.
- **Dequantized weights are recomputed** for the backward pass instead of kept from the
  forward pass (:func:`_recompute_frozen_casts`), and the memory plan is ExecuTorch's greedy
  one computed in numpy (:mod:`moe_model.program_memory`).
- **The task loss only** (``moe_model.objectives.sample_loss`` averaged over the batch);
  the assignment's extra local terms (FedProx, FedAlign-MoE's) are not in the program.

ExecuTorch (``executorch`` 1.5, installed as docs/phone-devices.md says; ``make install``
does) marks its training API experimental; the program format is tied to the runtime version that reads it
(:data:`RUNTIME`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from protocol import keys
from protocol.experts import Experts, layers_to_json
from protocol.messages import ModelSpec

from .gemm import fold_transposes
from .quant import QuantEmbedding, QuantLinear
from .submoe import SubMoE

log = logging.getLogger(__name__)

RUNTIME = "executorch-1.5"
"""The runtime a program in ExecuTorch's own operators is exported for (``ops`` ``core``;
recorded in its manifest)."""
FEDMOE_RUNTIME = "executorch-1.5+fedmoe2"
"""The runtime a program with the project's operators is exported for (``ops`` ``fedmoe``):
ExecuTorch 1.5 with the second set of them registered, ``fedmoe::grouped_mm``,
``fedmoe::grouped_mm_int8``, ``fedmoe::grouped_mm_wgrad``, ``fedmoe::lm_head_loss`` and
``fedmoe::gemm`` (:mod:`moe_model.grouped`, :mod:`moe_model.lm_head_loss`,
:mod:`moe_model.gemm`; the native core's ``native/src/kernels.cpp``). The first set's name,
``executorch-1.5+fedmoe`` (without ``grouped_mm_int8`` and ``gemm``), is no longer served: a
device naming only it gets ``core`` programs."""
RUNTIMES = (FEDMOE_RUNTIME, RUNTIME)
"""The runtimes a cloud builds programs for, preferred first (``Hello.runtimes``)."""
PROGRAM_FORMAT = 6
"""The version of the export (part of a program's shape, so a program of another version is
never served from a cache): 1 = the method returns loss, logits, gradients; 2 = loss, logits,
per-sample loss and correctness, each MoE layer's routing (probabilities, top-k indices and
weights), gradients (:attr:`TrainingProgram.outputs`); 3 = as 2, linears with a bias computed
by ExecuTorch's optimized ``mm`` (:func:`_core_operator_rewrites`); 4 = as 3, dequantized
weights recomputed for the backward pass instead of kept from the forward pass
(:func:`_recompute_frozen_casts`), and the shape's ``capacity_factor``; 5 = as 4, the
shape's ``ops`` (:data:`OPS`; a causal LM's program with ``fedmoe`` operators returns no
logits), and inputs outside the memory plan (:func:`_backend_config`); 6 = as 5, a
``fedmoe`` program's int8 experts in ``fedmoe::grouped_mm_int8`` and its matrix products in
``fedmoe::gemm`` (:data:`FEDMOE_RUNTIME`)."""
OPS = ("core", "fedmoe")
"""The operators a program may use. ``core``: ExecuTorch's own only; every held expert runs on
every token, combined by the zero-padded top-k gates (dense dispatch; or, under a capacity
factor, each on its capacity of tokens), and a causal LM computes its whole logits.
``fedmoe``: also the project's, which the native core registers (``fedmoe.native.load_kernels``
loads them into ExecuTorch's Python runtime): each held expert runs on exactly its routed tokens
(:mod:`moe_model.grouped`: the routed pairs sorted by expert, one grouped matrix product per
linear layer; under a capacity factor, on its capacity of tokens as with ``core``), and a causal
LM's int8 output layer and loss run without holding the logits (:mod:`moe_model.lm_head_loss`)."""


def slot_of(held: dict[int, list[int]]) -> dict[int, dict[int, int]]:
    """Layer -> {global expert id: slot}: the ``j``-th smallest held id is slot ``j``.

    Raises:
        ValueError: ``held`` is not a valid expert assignment (:class:`protocol.experts.Experts`).
    """
    return {layer: {e: j for j, e in enumerate(ids)} for layer, ids in Experts(held).items()}


def slot_shape(held: dict[int, list[int]]) -> dict[int, list[int]]:
    """The expert set a program for ``held``'s shape is exported with: ``{layer: [0..n-1]}``."""
    return {layer: list(range(len(ids))) for layer, ids in Experts(held).items()}


def to_slots(state: dict[str, torch.Tensor], held: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """Adapter-state keys of held global experts renamed to their slots (backbone and head
    keys unchanged).

    Raises:
        KeyError: a key names an expert that ``held`` does not hold.
    """
    slots = slot_of(held)
    return {_rekey(k, lambda layer, e: slots[layer][e]): t for k, t in state.items()}


def from_slots(state: dict[str, torch.Tensor], held: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_slots`: slot keys back to the held global experts' keys.

    Raises:
        KeyError: a slot beyond the experts ``held`` holds in that layer.
    """
    ids = {layer: list(e) for layer, e in Experts(held).items()}
    return {_rekey(k, lambda layer, j: ids[layer][j]): t for k, t in state.items()}


def _rekey(key: str, f) -> str:
    k = keys.parse(key)
    if k.group == "expert":
        return keys.expert_key(k.layer, f(k.layer, k.expert), k.path)
    if k.group == "router":
        return keys.router_key(k.layer, f(k.layer, k.expert))
    return key


@dataclass
class TrainingProgram:
    """One exported training step (:func:`export_training_program`).

    Attributes:
        pte: the ExecuTorch program (bytes). Method ``forward(*batch, *frozen)`` returns the
            :attr:`outputs` in order (``loss`` first: fp32 scalar, mean over the batch, nats),
            then the gradients of the trainable tensors.
        batch: the batch inputs in order, ``{"name", "shape", "dtype"}`` each
            (``bert-upcycled``/``hf-moe``: ``input_ids``, ``attention_mask`` int64
            ``(B, T)``, then ``labels`` int64 ``(B,)``, or ``(B, T)`` for causal LM).
        frozen: the frozen inputs after the batch, in order, ``{"name", "shape",
            "dtype"}`` each, and ``"source"`` (:func:`frozen_sources`) when exported with the
            stored shards; ``name`` is the module path with experts by slot.
        trainable: program parameter name -> adapter-state key with experts by slot, in the
            order of the gradient outputs.
        shape: what the program serves (model spec, task, labels, experts per layer, batch,
            sequence length, weight format, :data:`PROGRAM_FORMAT`); :attr:`key` is its digest.
        outputs: the method's outputs before the gradients, ``{"name", "shape", "dtype"}``
            each, in order: ``loss`` ``()``; ``logits`` ``(B, C)`` or ``(B, T, V)`` (absent from
            a causal LM's program with ``fedmoe`` operators, :func:`fused_head`);
            ``sample_loss`` ``(B,)`` (nats, :func:`moe_model.objectives.sample_loss`);
            ``sample_correct`` ``(B,)`` (in [0, 1], :func:`~moe_model.objectives.sample_correct`);
            then per MoE layer ``l`` ascending ``router.{l}.probs`` ``(B·T, n)`` fp32 (routing
            probabilities over the ``n`` held experts by slot), ``router.{l}.topk_idx``
            ``(B·T, k)`` int64 (the slots each token is sent to, best first) and
            ``router.{l}.topk_weight`` ``(B·T, k)`` fp32 (their gate weights): what a device
            needs for its statistics (:mod:`moe_model.stats`).
        planned_bytes: bytes of the memory ExecuTorch plans for one step's intermediate
            tensors (activations, gradients; the runtime allocates them once per method).
        trainable_bytes: bytes of the trainable tensors in fp32 (a device's AdamW keeps two
            moments of each).
    """

    pte: bytes
    batch: list[dict[str, Any]]
    frozen: list[dict[str, Any]]
    trainable: dict[str, str]
    shape: dict[str, Any] = field(default_factory=dict)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    planned_bytes: int = 0
    trainable_bytes: int = 0

    @property
    def key(self) -> str:
        """sha256 (hex) of the canonical JSON of :attr:`shape`: the cache key of the program."""
        return shape_key(self.shape)

    @property
    def sha256(self) -> str:
        """sha256 (hex) of :attr:`pte`."""
        return hashlib.sha256(self.pte).hexdigest()

    def manifest(self) -> dict[str, Any]:
        """Everything but the program bytes, JSON-able (what a device reads beside the ``.pte``)."""
        runtime = FEDMOE_RUNTIME if self.shape.get("ops") == "fedmoe" else RUNTIME
        return {"runtime": runtime, "key": self.key, "sha256": self.sha256, "bytes": len(self.pte),
                "planned_bytes": self.planned_bytes, "trainable_bytes": self.trainable_bytes, "shape": self.shape,
                "batch": self.batch, "outputs": self.outputs, "frozen": self.frozen, "trainable": self.trainable}


def program_shape(spec: ModelSpec, task: str, num_labels: int, held: dict[int, list[int]], batch_size: int,
                  seq_len: int, weight_format: str, capacity_factor: float | None = None,
                  ops: str = "core") -> dict[str, Any]:
    """The shape of a training step (what :class:`TrainingProgram.shape` holds): the model
    spec, task, classes, experts per MoE layer of ``held``, batch size, sequence length, weight
    format, the experts' capacity factor (None: every routed token), the operators
    (:data:`OPS`) and :data:`PROGRAM_FORMAT`.

    Raises:
        ValueError: a capacity factor that is not a positive finite number, unknown ``ops``."""
    if capacity_factor is not None and not (0 < capacity_factor < math.inf):
        raise ValueError(f"capacity_factor must be a positive number or None, got {capacity_factor}")
    if ops not in OPS:
        raise ValueError(f"ops must be one of {OPS}, got {ops!r}")
    return {"format": PROGRAM_FORMAT, "spec": spec.model_dump(mode="json"), "task": task,
            "num_labels": int(num_labels),
            "experts_per_layer": layers_to_json({layer: len(ids) for layer, ids in Experts(held).items()}),
            "batch_size": int(batch_size), "seq_len": int(seq_len), "weight_format": weight_format,
            "capacity_factor": None if capacity_factor is None else float(capacity_factor), "ops": ops}


def shape_key(shape: dict[str, Any]) -> str:
    """sha256 (hex) of a program shape's canonical JSON."""
    return hashlib.sha256(json.dumps(shape, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def frozen_tensors(model: SubMoE) -> dict[str, torch.Tensor]:
    """Module path -> tensor of every frozen weight of ``model``: parameters that do not
    train (base weights, frozen LoRA ``A``) and the stored data and scales of quantized
    linears and embeddings. Architecture constants (position-id buffers) are not weights."""
    trainable = {id(p) for p in model.trainable().values()}
    out = {n: p for n, p in model.named_parameters() if id(p) not in trainable}
    for path, mod in model.named_modules():
        if isinstance(mod, (QuantLinear, QuantEmbedding)):
            out.update({f"{path}.{n}": b for n, b in mod.named_buffers(recurse=False) if b is not None})
    return out


def frozen_sources(model: SubMoE, stored: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """Where a device finds each frozen input (:func:`frozen_tensors`) among what it holds.

    Args:
        model: a sub-MoE with experts by slot, built from ``stored`` (each shard's tensors as
            stored, ``protocol.codec.decode_tensors(..., dequantize=False)``, held with
            ``moe_model.shards.held_tensors(..., keep_quantized=True)``), so that every base
            weight *is* a stored tensor.
        stored: shard id (``backbone``, ``L{layer}.E{slot}``) -> stored tensors.

    Returns:
        Frozen input name -> ``{"shard": "backbone", "tensor": stored name}``, ``{"layer": l,
        "slot": j, "tensor": stored name}`` (the expert in slot ``j`` of MoE layer ``l``: the
        device's ``j``-th smallest held id there), or ``{"lora_a": adapter-state key with the
        expert by slot}`` (a frozen LoRA ``A``, drawn from the shared seed by torch: it has to
        reach a device that cannot run torch as data).

    Raises:
        ValueError: a frozen input is none of these (e.g. a dequantized copy of a stored
            tensor: a weight format whose tensors the program cannot take as stored).
    """
    from .shards import BACKBONE, block_paths, parse_shard_id

    index = {}
    for sid, tensors in stored.items():
        for name, t in tensors.items():
            index[(t.data_ptr(), tuple(t.shape), t.dtype)] = (sid, name)
    paths = block_paths(model.model)
    out: dict[str, dict[str, Any]] = {}
    for name, t in frozen_tensors(model).items():
        hit = index.get((t.data_ptr(), tuple(t.shape), t.dtype))
        if hit is not None:
            sid, tensor = hit
            if sid == BACKBONE:
                out[name] = {"shard": sid, "tensor": tensor}
            else:
                layer, slot = parse_shard_id(sid)
                out[name] = {"layer": layer, "slot": slot, "tensor": tensor}
        elif ".lora_A." in name:
            out[name] = {"lora_a": model._canonical(name.removeprefix("model."), paths)}
        else:
            raise ValueError(f"frozen input {name} is not a stored shard tensor (dequantized or copied)")
    return out


def fused_head(model: SubMoE) -> str | None:
    """The module path (in ``model``) of a causal LM's output layer that
    :func:`moe_model.lm_head_loss.lm_head_loss` can take (an int8 :class:`QuantLinear` without
    a bias, as a quantized tied output embedding is held), or None (another objective, family or
    weight format: the program computes the whole logits)."""
    lm = getattr(model.model, "lm", None)
    if model.objective != "causal-lm" or lm is None or not hasattr(lm, "get_output_embeddings"):
        return None
    out = lm.get_output_embeddings()
    if not isinstance(out, QuantLinear) or out.fmt != "int8" or out.bias is not None:
        return None
    return next(path for path, m in model.named_modules() if m is out)


class _Step(nn.Module):
    """``forward(*batch, *frozen) -> (loss, logits, sample_loss, sample_correct, then per MoE
    layer probs, topk_idx, topk_weight)`` (:attr:`TrainingProgram.outputs`) over ``model`` with
    its frozen weights taken from the inputs (``torch.func.functional_call``). With ``head`` (the
    path of the output layer, :func:`fused_head`), the output layer and loss are one operator
    (:func:`moe_model.lm_head_loss.lm_head_loss`) and no logits are returned."""

    def __init__(self, model: SubMoE, batch_names: list[str], frozen_names: list[str], head: str | None = None):
        super().__init__()
        self.model = model
        self.batch_names = batch_names
        self.frozen_names = frozen_names
        self.head = head

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from . import objectives

        nb = len(self.batch_names)
        batch = dict(zip(self.batch_names[:-1], args[:nb - 1]))
        labels = args[nb - 1]
        weights = dict(zip(self.frozen_names, args[nb:]))
        if self.head is not None:
            out = list(self._fused_loss(batch, labels, weights))
        else:
            logits = torch.func.functional_call(self.model, weights, (batch,), strict=False)
            per_sample = objectives.sample_loss(self.model.objective, logits, labels)
            out = [per_sample.mean(), logits.detach(), per_sample.detach(),
                   _sample_correct(self.model.objective, logits.detach(), labels)]
        for _, block in sorted(self.model.model.moe_blocks().items()):
            rec = block.last
            out += [rec.probs.detach().float(), rec.topk_idx, rec.topk_weight.detach().float()]
        return tuple(out)

    def _fused_loss(self, batch, labels, weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, sample_loss, sample_correct)`` of a causal LM through the fused output
        layer and loss (``moe_model.objectives.sample_loss`` and ``sample_correct``'s values)."""
        from .lm_head_loss import lm_head_loss
        from .objectives import IGNORE

        hf = self.model.model
        hf.hidden_only = True
        try:
            hidden = torch.func.functional_call(self.model, weights, (batch,), strict=False)
        finally:
            hf.hidden_only = False
        b, t, h = hidden.shape
        targets = labels[:, 1:]
        tok_loss, correct = lm_head_loss(hidden[:, :-1].reshape(-1, h), weights[f"{self.head}.qweight_data"],
                                         weights[f"{self.head}.qweight_scale"], targets.reshape(-1))
        count = (targets != IGNORE).sum(1).clamp_min(1).float()
        per_sample = tok_loss.reshape(b, t - 1).sum(1) / count
        return per_sample.mean(), per_sample.detach(), correct.detach().reshape(b, t - 1).sum(1) / count


def _sample_correct(objective: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`moe_model.objectives.sample_correct` without its ``no_grad`` region (which the
    joint forward-backward graph cannot hold); ``logits`` detached."""
    from .objectives import IGNORE

    if objective == "causal-lm":
        shifted = labels[:, 1:]
        valid = shifted != IGNORE
        hit = (logits[:, :-1].argmax(-1) == shifted) & valid
        return hit.sum(1).float() / valid.sum(1).clamp_min(1).float()
    return (logits.argmax(-1) == labels).float()


@contextlib.contextmanager
def exportable(model: SubMoE, capacity_factor: float | None = None, grouped: bool = False) -> Iterator[None]:
    """``model`` in evaluation mode, with eager attention and static-shape expert dispatch
    (dense; ``grouped``: each expert on exactly its routed tokens, :mod:`moe_model.grouped`;
    under ``capacity_factor``: each expert on its capacity of tokens,
    ``moe_model.models.moe.MoELayer.capacity``); restored after."""
    from transformers import PreTrainedModel

    blocks = list(model.model.moe_blocks().values())
    before = [(b.dense_dispatch, b.grouped_dispatch, b.capacity_factor) for b in blocks]
    hf = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    attn = [m.config._attn_implementation for m in hf]
    was_training = model.training
    model.eval()
    for b in blocks:
        b.dense_dispatch, b.grouped_dispatch, b.capacity_factor = True, grouped, capacity_factor
    for m in hf:
        m.set_attn_implementation("eager")
    try:
        yield
    finally:
        for b, (d, g, c) in zip(blocks, before):
            b.dense_dispatch, b.grouped_dispatch, b.capacity_factor = d, g, c
        for m, a in zip(hf, attn):
            m.set_attn_implementation(a)
        model.train(was_training)


@contextlib.contextmanager
def _hollow_buffers(model: nn.Module, names: list[str]) -> Iterator[None]:
    """The module's buffers among ``names`` replaced by empty tensors of their dtype while
    the step is exported: ``torch.export`` lifts every buffer a module owns into the program
    (as its state) even when ``functional_call`` supplies the value as an input; restored after."""
    saved = []
    for name in names:
        path, _, attr = name.rpartition(".")
        mod = model.get_submodule(path) if path else model
        if attr in mod._buffers and mod._buffers[attr] is not None:
            saved.append((mod, attr, mod._buffers[attr]))
            mod._buffers[attr] = torch.empty(0, dtype=mod._buffers[attr].dtype)
    try:
        yield
    finally:
        for mod, attr, t in saved:
            mod._buffers[attr] = t


def _contiguous_strides(size: list[int]) -> list[int]:
    """Row-major strides of a tensor of ``size`` (elements)."""
    out, step = [], 1
    for n in reversed(size):
        out.append(step)
        step *= max(int(n), 1)
    return out[::-1]


def _core_operator_rewrites(ep) -> None:
    """Rewrite ``aten.addmm(bias, x, w)`` as ``aten.add(aten.mm(x, w), bias)`` (ExecuTorch's
    optimized kernels compute ``mm`` with a BLAS; its ``addmm`` is the portable loop); and
    ``aten.empty_permuted(size, layout)`` (which autograd puts in some backward
    graphs, e.g. a Hugging Face MoE's, and which is outside ExecuTorch's core operator set) as
    ``aten.permute(aten.empty(size in layout order), inverse layout)``: the same shape and
    strides; and ``aten.new_empty_strided(self, size, stride)`` (also outside it) with
    contiguous strides as ``aten.empty(size)`` in ``self``'s dtype. In place on the exported
    program's graph.

    Raises:
        ValueError: a ``new_empty_strided`` with other strides."""
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if node.target is torch.ops.aten.addmm.default and not node.kwargs:
            # addmm(bias, x, w) = mm(x, w) + bias: ExecuTorch's optimized kernels have mm, not addmm (whose
            # portable loop made a demo-model step 25x slower than torch's)
            bias, x, w = node.args[:3]
            with graph.inserting_before(node):
                mm = graph.call_function(torch.ops.aten.mm.default, (x, w))
                mm.meta = dict(node.meta)
                new = graph.call_function(torch.ops.aten.add.Tensor, (mm, bias))
                new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            continue
        if node.target is torch.ops.aten.new_empty_strided.default:
            # new_empty_strided(self, size, stride) with contiguous strides: empty(size) in self's
            # dtype (a Qwen3-MoE with tied embeddings has it in its backward; ExecuTorch's
            # runtime has no empty_strided kernel)
            size, stride = list(node.args[1]), list(node.args[2])
            if stride != _contiguous_strides(size):
                raise ValueError(f"new_empty_strided with non-contiguous strides {stride} for {size}: not exportable")
            kwargs = {"dtype": node.args[0].meta["val"].dtype, **{k: v for k, v in node.kwargs.items() if v is not None}}
            with graph.inserting_before(node):
                new = graph.call_function(torch.ops.aten.empty.memory_format, (size,), kwargs)
                new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            continue
        if node.target is not torch.ops.aten.empty_permuted.default:
            continue
        size, layout = node.args[0], node.args[1]
        inverse = [0] * len(layout)
        for i, d in enumerate(layout):
            inverse[d] = i
        with graph.inserting_before(node):
            empty = graph.call_function(torch.ops.aten.empty.memory_format, ([size[d] for d in layout],),
                                        dict(node.kwargs))
            empty.meta = dict(node.meta)
            new = empty
            if list(layout) != list(range(len(layout))):
                new = graph.call_function(torch.ops.aten.permute.default, (empty, inverse))
                new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    ep.graph_module.recompile()


def computed_from(graph: torch.fx.Graph, frozen: set[str]) -> set[torch.fx.Node]:
    """The nodes of ``graph`` computed from the placeholders named in ``frozen`` alone (those
    placeholders included): what :func:`_recompute_frozen_casts` recomputes before each use."""
    derived = {n for n in graph.nodes if n.op == "placeholder" and n.name in frozen}
    for n in graph.nodes:
        if n.op == "call_function" and n.all_input_nodes and all(a in derived for a in n.all_input_nodes):
            derived.add(n)
    return derived


def _recompute_frozen_casts(ep, frozen: set[str]) -> int:
    """Every value computed from frozen inputs alone (a quantized weight's dequantization,
    a transpose of a weight) recomputed right before each operator that uses it, instead of
    computed once and kept: autograd keeps a linear's fp32 weight from the forward pass until
    the backward pass needs it for the input's gradient, so every dequantized weight of the
    step would be alive at once (37 MiB of the demo model's 137 MiB plan; the eager
    ``moe_model.quant._DequantLinear`` recomputes it the same way). Costs one more
    dequantization per weight and step. In place on the exported program's graph.

    Args:
        ep: the exported joint forward-backward program.
        frozen: the names of its frozen-weight placeholders.

    Returns:
        The number of operators added (the recomputations; the originals they replace are
        removed once unused).
    """
    from torch.fx.node import map_arg

    graph = ep.graph_module.graph
    derived = computed_from(graph, frozen)
    made = 0
    for user in list(graph.nodes):
        if user in derived or user.op not in ("call_function", "output"):
            continue
        copies: dict[Any, Any] = {}

        def copy(node):
            nonlocal made
            if node.op == "placeholder":
                return node
            if node not in copies:
                args = map_arg(node.args, lambda a: copy(a) if a in derived else a)
                kwargs = map_arg(node.kwargs, lambda a: copy(a) if a in derived else a)
                with graph.inserting_before(user):
                    copies[node] = graph.call_function(node.target, args, kwargs)
                copies[node].meta = dict(node.meta)
                made += 1
            return copies[node]

        for a in list(user.all_input_nodes):
            if a in derived and a.op != "placeholder":
                user.replace_input_with(a, copy(a))
    graph.eliminate_dead_code()
    ep.graph_module.recompile()
    return made


def _backend_config(algo=None):
    """ExecuTorch's lowering configuration: its defaults, with its greedy memory plan computed
    by ``algo`` (default :func:`moe_model.program_memory.greedy`: the same plan, in numpy:
    ExecuTorch's takes time quadratic in the program's tensors in Python), and the user inputs
    not planned (:func:`moe_model.program_memory.without_user_inputs`): the runtime uses the
    caller's tensors in place (ExecuTorch copies a planned input into the arena, which would
    hold a second copy of every frozen weight, 67 MiB of a 165 MiB plan for a Qwen3-MoE device
    holding 16 experts per layer)."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.memory_planning import MemoryPlanningAlgorithmSuite
    from executorch.exir.passes import MemoryPlanningPass

    from .program_memory import greedy, without_user_inputs

    return ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(
        memory_planning_algo=MemoryPlanningAlgorithmSuite(algo_list=[without_user_inputs(algo or greedy)]),
        alloc_graph_input=False))


def example_batch(model: SubMoE, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """A batch of the program's shape: ``input_ids`` (token 0...), ``attention_mask`` (ones),
    ``labels`` (zeros; ``(B,)`` for classification, ``(B, T)`` for causal LM), int64."""
    if model.spec.family == "conv-moe":
        raise ValueError("conv-moe has no training program (its devices run the Python SDK)")
    ids = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    labels = torch.zeros((batch_size, seq_len) if model.objective == "causal-lm" else (batch_size,), dtype=torch.int64)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def pad_batch(batch: dict[str, torch.Tensor], labels: torch.Tensor, seq_len: int) -> dict[str, torch.Tensor]:
    """A collated batch (``SubMoE.collate``) padded on the right to the program's sequence
    length: ``input_ids`` with 0, ``attention_mask`` with 0, causal-LM ``labels`` ``(B, T)``
    with ``moe_model.objectives.IGNORE`` (classification labels ``(B,)`` as they are); int64.

    Raises:
        ValueError: the batch is longer than ``seq_len``.
    """
    from .objectives import IGNORE

    b, n = batch["input_ids"].shape
    if n > seq_len:
        raise ValueError(f"a batch of {n} tokens does not fit a program of {seq_len}")
    out = {"input_ids": torch.zeros(b, seq_len, dtype=torch.int64),
           "attention_mask": torch.zeros(b, seq_len, dtype=torch.int64),
           "labels": torch.full((b, seq_len), IGNORE, dtype=torch.int64) if labels.dim() == 2 else labels}
    out["input_ids"][:, :n], out["attention_mask"][:, :n] = batch["input_ids"], batch["attention_mask"]
    if labels.dim() == 2:
        out["labels"][:, :n] = labels
    return out


def export_training_program(model: SubMoE, batch_size: int, seq_len: int, weight_format: str = "fp32",
                            stored: dict[str, dict[str, torch.Tensor]] | None = None,
                            capacity_factor: float | None = None, ops: str = "core") -> TrainingProgram:
    """Capture ``model``'s training step for its shape (module docstring).

    Args:
        model: a sub-MoE exported with experts ``0..n-1`` per MoE layer (:func:`slot_shape`);
            its weights' values are not stored in the program, only their shapes.
        batch_size: samples per step (B).
        seq_len: tokens per sample (T).
        weight_format: the base shards' format (``fp32``, ``int8``, ``nf4``), recorded in
            the shape.
        stored: the stored shard tensors ``model`` was built from; each frozen input then
            records its ``source`` (:func:`frozen_sources`).
        capacity_factor: None: every held expert runs on every token (dense dispatch, the
            function of the Python device's sparse dispatch). A factor ``c``: each runs on its
            ``ceil(c · B·T · k / n)`` tokens of largest gate (``MoELayer.capacity``): activations
            and expert compute ``c · k / n`` of the dense dispatch's, and routed tokens beyond
            an expert's capacity skip it (equal to a Python sub-MoE with the same factor).
        ops: :data:`OPS`; ``fedmoe`` runs each held expert on exactly its routed tokens (the
            Python device's function, with activations and expert compute ``k / n`` of the
            dense dispatch's) and a causal LM's int8 output layer and loss without its logits.

    Returns:
        The :class:`TrainingProgram`.

    Raises:
        ImportError: ExecuTorch missing (docs/phone-devices.md says how to install it).
        ValueError: ``model`` holds experts other than its slots, a ``conv-moe`` model, a
            full fine-tuning family (its every weight trains: nothing is frozen), or a
            frozen input that ``stored`` does not hold (:func:`frozen_sources`), a capacity
            factor that is not a positive number, unknown ``ops``.
    """
    from executorch.exir import to_edge
    from torch.export import export
    from torch.export.experimental import _export_forward_backward

    if dict(model.experts.items()) != slot_shape(dict(model.experts.items())):
        raise ValueError(f"export the program with experts by slot {slot_shape(dict(model.experts.items()))}, "
                         f"not {dict(model.experts.items())}")
    if model.full:
        raise ValueError(f"{model.spec.family} trains every weight: no frozen base for a shape-generic program")
    example = example_batch(model, batch_size, seq_len)
    frozen = frozen_tensors(model)
    sources = frozen_sources(model, stored) if stored is not None else {}
    names = list(example)
    head = fused_head(model) if ops == "fedmoe" else None
    step = _Step(model, names, list(frozen), head)
    params = {id(p): k for k, p in model.trainable().items()}
    shape = program_shape(model.spec, model.task, model.num_labels, model.experts, batch_size, seq_len, weight_format,
                          capacity_factor, ops)
    with exportable(model, capacity_factor, ops == "fedmoe"), _hollow_buffers(model, list(frozen)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = export(step, (*example.values(), *frozen.values()), strict=False)
        ep = _export_forward_backward(ep)
        _recompute_frozen_casts(ep, set(list(ep.graph_signature.user_inputs)[len(names):]))
        _core_operator_rewrites(ep)
        if ops == "fedmoe":
            fold_transposes(ep.graph_module.graph)
            ep.graph_module.recompile()
        program = to_edge(ep).to_executorch(config=_backend_config())
    fqn = dict(step.named_parameters())
    grads = [s.target for s in ep.graph_signature.output_specs if s.kind.name == "GRADIENT_TO_PARAMETER"]
    trainable = {name: params[id(fqn[name])] for name in grads}
    if sorted(trainable.values()) != sorted(params.values()):
        raise RuntimeError("the exported program's gradients do not cover the adapter state")
    describe = lambda n, t: {"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}  # noqa
    values = [n.meta["val"] for n in ep.graph.output_node().args[0]]
    kinds = [s.kind.name for s in ep.graph_signature.output_specs]
    user = [v for v, k in zip(values, kinds) if k in ("LOSS_OUTPUT", "USER_OUTPUT")]
    out_names = ["loss", *([] if head is not None else ["logits"]), "sample_loss", "sample_correct"] + [
        f"router.{layer}.{what}" for layer in sorted(model.experts) for what in ("probs", "topk_idx", "topk_weight")]
    if len(user) != len(out_names):
        raise RuntimeError(f"the exported program returns {len(user)} outputs before its gradients, expected "
                           f"{len(out_names)}")
    plan = program.executorch_program.execution_plan[0]
    out = TrainingProgram(pte=program.buffer, batch=[describe(n, t) for n, t in example.items()],
                          frozen=[{**describe(n, t), **({"source": sources[n]} if n in sources else {})}
                                  for n, t in frozen.items()], trainable=trainable, shape=shape,
                          outputs=[describe(n, t) for n, t in zip(out_names, user)],
                          planned_bytes=int(sum(plan.non_const_buffer_sizes[1:])),
                          trainable_bytes=sum(4 * p.numel() for p in model.trainable().values()))
    log.info("exported the training program %s: %d frozen inputs, %d trainable tensors, %.1f KiB",
             out.key[:12], len(out.frozen), len(trainable), len(out.pte) / 1024)
    return out
