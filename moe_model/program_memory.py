"""ExecuTorch's greedy memory plan for a training program, computed with numpy.

``executorch.exir.memory_planning.greedy`` places a program's intermediate tensors, largest
first, into shared objects of one arena: the first object holding no tensor whose lifetime
overlaps, else the first object with room above the overlapping tensors, else a new object.
It scans every placed tensor in Python for each tensor it places, so its time grows with the
square of the tensors: about 7 minutes for the training step of a Qwen3-MoE device holding 16
experts in each of 8 layers, and more than 40 for 32 (2026-12-07, 2 cores). :func:`greedy`
makes the same decisions, with each scan one vectorised pass over numpy arrays of the placed
tensors' lifetimes, objects and offsets.

It builds ExecuTorch's own ``SharedObject``/``AllocationSpec`` records and finishes with
ExecuTorch's helpers (views onto a storage base, the objects' offsets), so the result is what
``greedy`` returns; ``tests/test_training_program.py`` checks that both give the same plan.
Tied to ``executorch`` 1.5 (those helpers are private), which ``make install`` pins.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np


def greedy(alignment: int, specs: set, graph_module: Any, graph_signature: Any, extra_padding: int = 0):
    """ExecuTorch's ``greedy`` memory planning algorithm (overlapping allocations allowed), the
    same decisions in numpy; a ``MemoryPlanningAlgorithmSuite`` algorithm.

    Args:
        alignment: bytes each tensor's allocation is aligned to.
        specs: the program's ``TensorSpec`` s with their lifetimes (node indices, inclusive).
        graph_module, graph_signature: the program's graph (for the arena's input sizes).
        extra_padding: bytes added to each arena.

    Returns:
        ``MemoryAlgoResult``: each spec's arena, object and offset; each arena's size in bytes.
    """
    from executorch.exir.memory_planning import (AllocationSpec, MemoryAlgoResult, SharedObject, SpecAllocResult,
                                                 _compute_total_sizes, _resolve_storage_base_specs)

    result = MemoryAlgoResult({}, [])
    spec2obj: dict = {}
    objects: dict[int, list] = defaultdict(list)
    placed: dict[int, _Placed] = defaultdict(lambda: _Placed(len(specs)))
    deferred = []
    for spec in reversed(sorted(specs, key=lambda s: s.allocated_memory)):  # greedy's order, ties included
        alloc = result.spec_dict.get(spec, SpecAllocResult(0, 0, 0))
        alloc.mem_id = 1 if spec.mem_id is None else spec.mem_id
        result.spec_dict[spec] = alloc
        spec.realign(alignment)
        if spec.storage_base is not None:
            deferred.append(spec)
            continue
        pool, index = objects[alloc.mem_id], placed[alloc.mem_id]
        start, end, size = spec.lifetime[0], spec.lifetime[1], spec.allocated_memory
        obj, offset = index.pick(start, end, size)
        if obj is None:
            obj = index.new_object(size)
            pool.append(SharedObject(obj, -1, size, start, end))
        sobj = pool[obj]
        sobj.first_used_index = min(sobj.first_used_index, start)
        sobj.last_used_index = max(sobj.last_used_index, end)
        sobj.allocations.append(AllocationSpec(offset, spec))
        index.add(start, end, obj, offset + size)
        spec2obj[spec] = sobj
    _resolve_storage_base_specs(deferred, spec2obj, result)
    result.bufsizes = _compute_total_sizes(objects, graph_module, extra_padding, result, len(spec2obj))
    return result


def without_user_inputs(algo):
    """The memory planning algorithm ``algo`` (:func:`greedy`'s signature) for a
    ``MemoryPlanningPass(alloc_graph_input=False)``: that pass leaves every placeholder
    unplanned, the user inputs (batch, frozen weights: ExecuTorch's runtime then uses the
    caller's tensors in place instead of copying each into the arena) but also a training
    program's parameters, which would then stay in the program's constant data, where equal
    initial values share one buffer. This plans the parameters that train and the buffers (the
    placeholders that are not user inputs, nor constants without a gradient) as
    ``alloc_graph_input=True`` would."""

    def plan(alignment: int, specs: set, graph_module: Any, graph_signature: Any, extra_padding: int = 0):
        users, planned = set(graph_signature.user_inputs), {id(s) for s in specs}
        placeholders = []  # first, in graph order, as alloc_graph_input=True collects them (ties keep that order)
        for n in graph_module.graph.nodes:
            spec = n.meta.get("spec")
            if n.op == "placeholder" and n.name not in users and spec is not None and not isinstance(spec, (list, tuple)) \
                    and (not spec.const or n.meta.get("weight_has_gradient", False)) and id(spec) not in planned:
                placeholders.append(spec)
        return algo(alignment, [*placeholders, *specs], graph_module, graph_signature, extra_padding)

    plan.__name__ = f"{getattr(algo, '__name__', 'algo')}_without_user_inputs"
    return plan


class _Placed:
    """The placed tensors of one arena (lifetime, object and top = offset + size each) and
    the sizes of its shared objects."""

    def __init__(self, capacity: int):
        self.start = np.empty(capacity, np.int64)
        self.end = np.empty(capacity, np.int64)
        self.obj = np.empty(capacity, np.int64)
        self.top = np.empty(capacity, np.int64)
        self.sizes = np.empty(capacity, np.int64)
        self.n = self.objects = 0

    def new_object(self, size: int) -> int:
        self.sizes[self.objects] = size
        self.objects += 1
        return self.objects - 1

    def add(self, start: int, end: int, obj: int, top: int) -> None:
        i = self.n
        self.start[i], self.end[i], self.obj[i], self.top[i] = start, end, obj, top
        self.n += 1

    def pick(self, start: int, end: int, size: int) -> tuple[int | None, int]:
        """``(object, offset)`` for a tensor living ``[start, end]`` of ``size`` bytes, as
        ``executorch.exir.memory_planning.pick_shared_obj`` chooses; ``(None, 0)``: a new object."""
        if not self.objects:
            return None, 0
        n, m = self.n, self.objects
        overlap = (self.start[:n] <= end) & (self.end[:n] >= start)
        hit = self.obj[:n][overlap]
        free = np.flatnonzero(np.bincount(hit, minlength=m) == 0)
        if free.size:
            return int(free[0]), 0
        top = np.zeros(m, np.int64)
        np.maximum.at(top, hit, self.top[:n][overlap])
        room = np.flatnonzero((top > 0) & (top + size <= self.sizes[:m]))
        if room.size:
            return int(room[0]), int(top[room[0]])
        return None, 0
