"""Names of adapter-state tensors, independent of the model architecture.

The adapter state (what trains and moves each round; docs/methods/index.md) is a flat
dict with four kinds of keys:

- ``expert.{layer}.{expert}.{path}``: a tensor of expert ``expert`` in MoE layer
  ``layer`` (e.g. ``expert.1.3.fc1.lora_B``), ``expert`` a *global* index;
- ``router.{layer}.{expert}``: the router row of that expert, shape ``(hidden,)``;
- ``head.{task}.{path}``: the classification head of one task;
- ``backbone.{path}``: everything else (e.g. attention LoRA factors).

A device's update holds exactly the keys of the experts it was assigned, the
backbone, and its own task's head; :func:`select` computes that set.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Mapping, TypeVar

_EXPERT = re.compile(r"^expert\.(\d+)\.(\d+)\.(.+)$")
_ROUTER = re.compile(r"^router\.(\d+)\.(\d+)$")
_HEAD = re.compile(r"^head\.([A-Za-z0-9_-]+)\.(.+)$")
_BACKBONE = re.compile(r"^backbone\.(.+)$")

T = TypeVar("T")


@dataclass(frozen=True)
class Key:
    """A parsed adapter-state key."""

    group: str
    """``expert``, ``router``, ``head`` or ``backbone``."""
    layer: int | None = None
    expert: int | None = None
    task: str | None = None
    path: str = ""

    @property
    def module(self) -> tuple:
        """The aggregation unit: (``expert``, l, e) for expert tensors *and* router rows,
        (``head``, task), or (``backbone``,)."""
        if self.group in ("expert", "router"):
            return ("expert", self.layer, self.expert)
        if self.group == "head":
            return ("head", self.task)
        return ("backbone",)


def expert_key(layer: int, expert: int, path: str) -> str:
    """``expert.{layer}.{expert}.{path}`` (``expert`` a global id; ``path`` e.g. ``fc1.lora_B``)."""
    return f"expert.{int(layer)}.{int(expert)}.{path}"


def router_key(layer: int, expert: int) -> str:
    """``router.{layer}.{expert}``: the router row ``(hidden,)`` of a global expert id."""
    return f"router.{int(layer)}.{int(expert)}"


def head_key(task: str, path: str) -> str:
    """``head.{task}.{path}`` (not validated; :func:`parse` accepts tasks of ``[A-Za-z0-9_-]``)."""
    return f"head.{task}.{path}"


def backbone_key(path: str) -> str:
    """``backbone.{path}``."""
    return f"backbone.{path}"


@functools.lru_cache(maxsize=1 << 16)  # Key is frozen; every update names the same keys (an aggregator parsed
def parse(key: str) -> Key:  # each of a 1 MiB update's ~130 names several times)
    """Parse an adapter-state key. Raises ValueError for anything else."""
    if m := _EXPERT.match(key):
        return Key("expert", int(m.group(1)), int(m.group(2)), path=m.group(3))
    if m := _ROUTER.match(key):
        return Key("router", int(m.group(1)), int(m.group(2)))
    if m := _HEAD.match(key):
        return Key("head", task=m.group(1), path=m.group(2))
    if m := _BACKBONE.match(key):
        return Key("backbone", path=m.group(1))
    raise ValueError(f"not an adapter-state key: {key!r}")


def units(names) -> dict[tuple, list[str]]:
    """Adapter-state key names grouped by aggregation unit (:attr:`Key.module`), in the
    order given. Raises ValueError for a name that is no adapter-state key."""
    out: dict[tuple, list[str]] = {}
    for name in names:
        out.setdefault(parse(name).module, []).append(name)
    return out


def held_by(key: str | Key, experts: Mapping[int, list[int]], task: str) -> bool:
    """Whether a device holding ``experts`` (layer -> expert ids) for ``task`` has ``key``."""
    k = parse(key) if isinstance(key, str) else key
    if k.group in ("expert", "router"):
        return k.expert in experts.get(k.layer, ())
    if k.group == "head":
        return k.task == task
    return True


def select(state: Mapping[str, T], experts: Mapping[int, list[int]], task: str) -> dict[str, T]:
    """The part of a (global) adapter state a device holding ``experts`` for ``task`` gets."""
    return {k: v for k, v in state.items() if held_by(k, experts, task)}
