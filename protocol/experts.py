"""Expert assignments: MoE layer index -> the global expert ids held there.

In Python an assignment is keyed by ``int`` layer index; JSON object keys are strings,
so its JSON form (the store's ``previous_assignment`` and ``current_round.selected``,
strategy states, round records; :class:`protocol.messages.Assignment` on the wire) is
``{"1": [0, 3], "3": [2]}``. :class:`Experts` is the validated form with both
conversions; :func:`layers_to_json` / :func:`layers_from_json` convert the keys of any
other per-layer mapping (probabilities, token counts) and leave its values as they are.

Example::

    e = Experts({"1": [3, 0], 3: [2]})      # Experts({1: [0, 3], 3: [2]})
    e.to_json()                              # {"1": [0, 3], "3": [2]}
    Experts.from_json(e.to_json()) == e      # True; equal to the plain dict too
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn, TypeVar

V = TypeVar("V")

MAX_KEY_DIGITS = 9
"""Longest string layer key read (``"0"`` .. ``"999999999"``); int keys are bounded alike,
so every key :func:`layers_to_json` writes, :func:`layers_from_json` reads back."""


def layer_key(key: Any) -> int:
    """The layer index a mapping key names.

    Args:
        key: an int >= 0 (or an integer scalar such as ``numpy.int64``; not a bool), or
            its JSON form, a string of 1..:data:`MAX_KEY_DIGITS` ASCII digits (``"3"``).

    Returns:
        The layer index, an ``int`` in ``[0, 10**MAX_KEY_DIGITS)``.

    Raises:
        ValueError: anything else (``"a"``, ``"-1"``, ``" 1"``, ``-1``, ``True``, ``1.0``),
            naming the key.
    """
    if isinstance(key, str):
        if 0 < len(key) <= MAX_KEY_DIGITS and key.isascii() and key.isdigit():
            return int(key)
    elif not isinstance(key, bool):
        try:
            layer = operator.index(key)
        except TypeError:
            pass
        else:
            if 0 <= layer < 10**MAX_KEY_DIGITS:
                return layer
    raise ValueError(f"layer key {key!r} is not a layer index (an int in 0..{10**MAX_KEY_DIGITS - 1} or a "
                     f"string of 1-{MAX_KEY_DIGITS} ASCII digits)")


def _mapping(value: Any, what: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(value).__name__}")
    return value


def layers_from_json(d: Mapping[Any, V]) -> dict[int, V]:
    """A per-layer mapping with its keys read by :func:`layer_key` (``{"1": x}`` -> ``{1: x}``).

    Args:
        d: layer key (digit string or int) -> value; the values are kept as they are (the
            same objects), in the same order.

    Raises:
        ValueError: ``d`` is not a mapping, a key is not a layer index, or two keys name the
            same layer (``1`` and ``"1"``).
    """
    out: dict[int, V] = {}
    for key, value in _mapping(d, "a per-layer mapping").items():
        layer = layer_key(key)
        if layer in out:
            raise ValueError(f"layer {layer} is given twice")
        out[layer] = value
    return out


def layers_to_json(m: Mapping[int, V]) -> dict[str, V]:
    """A per-layer mapping with string keys, as JSON needs (``{1: x}`` -> ``{"1": x}``).

    Args:
        m: layer index -> value; the values are kept as they are (the same objects), in the
            same order.

    Raises:
        ValueError: as :func:`layers_from_json`.
    """
    return {str(layer): value for layer, value in layers_from_json(m).items()}


def _expert_ids(layer: int, ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
        raise ValueError(f"layer {layer}: expert ids must be a list of ints, got {type(ids).__name__}")
    out = []
    for e in ids:
        try:
            if isinstance(e, bool):
                raise TypeError
            e = operator.index(e)
        except TypeError:
            raise ValueError(f"layer {layer}: expert id {e!r} is not an int") from None
        if e < 0:
            raise ValueError(f"layer {layer}: expert id {e} is negative")
        out.append(e)
    out.sort()
    for a, b in zip(out, out[1:]):
        if a == b:
            raise ValueError(f"layer {layer}: expert {a} is listed twice")
    return out


def _read_only(self: Experts, *args: Any, **kwargs: Any) -> NoReturn:
    raise TypeError("an Experts is read-only; as_dict() gives a mutable copy")


class Experts(dict[int, list[int]]):
    """One device's assignment: MoE layer index -> its global expert ids there, sorted
    and distinct (``{1: [0, 3], 3: [2]}``).

    A ``dict`` (so it compares equal to the plain dict, serialises with ``json`` and
    validates as a pydantic ``dict[int, list[int]]`` field), but read-only: assigning,
    deleting or updating a layer raises TypeError. Treat the id lists as read-only too;
    :meth:`as_dict` gives a mutable copy. Layers keep the order they were given in; a
    layer may hold no expert (``[]``; :class:`protocol.messages.Assignment` refuses that).
    Where the code annotates ``Experts`` (the strategy API), a plain
    ``dict[int, list[int]]`` of the same shape is accepted too.

    Args:
        experts: layer key (an int >= 0 or its digit string, :func:`layer_key`) ->
            iterable of expert ids (ints >= 0, not bools; integer scalars such as
            ``numpy.int64`` are converted). None: no layer.

    Raises:
        ValueError: ``experts`` is not a mapping, a key is not a layer index or names a
            layer twice, ids are not an iterable of ints, or an id is negative, a bool or
            listed twice in one layer; the message names the layer and the id.
    """

    __slots__ = ()

    def __init__(self, experts: Mapping[Any, Iterable[int]] | None = None, /):
        layers = layers_from_json({} if experts is None else _mapping(experts, "experts"))
        super().__init__({layer: _expert_ids(layer, ids) for layer, ids in layers.items()})

    __setitem__ = __delitem__ = __ior__ = _read_only
    update = pop = popitem = clear = setdefault = _read_only

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.as_dict(),)

    def __repr__(self) -> str:
        return f"Experts({dict.__repr__(self)})"

    @classmethod
    def from_json(cls, d: Mapping[str, Iterable[int]]) -> Experts:
        """Read the JSON form ``{"1": [0, 3], ...}`` (int keys are accepted too).

        Raises:
            ValueError: as the constructor.
        """
        return cls(d)

    def to_json(self) -> dict[str, list[int]]:
        """The JSON form: ``{"<layer>": [sorted expert ids], ...}`` in this mapping's layer
        order (new lists)."""
        return {str(layer): list(ids) for layer, ids in self.items()}

    def as_dict(self) -> dict[int, list[int]]:
        """A plain, mutable ``dict[int, list[int]]`` copy (new lists)."""
        return {layer: list(ids) for layer, ids in self.items()}

    def counts(self) -> dict[int, int]:
        """Layer -> number of experts held there."""
        return {layer: len(ids) for layer, ids in self.items()}

    def total(self) -> int:
        """Number of experts held over all layers together."""
        return sum(len(ids) for ids in self.values())


def experts_by_device_from_json(d: Mapping[str, Mapping[str, Iterable[int]]]) -> dict[str, Experts]:
    """Read the JSON form of several devices' assignments,
    ``{device_id: {"<layer>": [ids]}}`` -> ``{device_id: Experts}`` (device order kept).

    Raises:
        ValueError: ``d`` is not a mapping, or as :class:`Experts` for one device (the
            message names the device).
    """
    out = {}
    for device_id, experts in _mapping(d, "assignments by device").items():
        try:
            out[device_id] = Experts.from_json(experts)
        except ValueError as e:
            raise ValueError(f"device {device_id}: {e}") from None
    return out


def experts_by_device_to_json(m: Mapping[str, Mapping[int, Iterable[int]]]) -> dict[str, dict[str, list[int]]]:
    """The JSON form of several devices' assignments: ``{device_id: {"<layer>": [sorted
    ids]}}`` (each validated as :class:`Experts`; device and layer order kept).

    Raises:
        ValueError: as :func:`experts_by_device_from_json`.
    """
    return {device_id: e.to_json() for device_id, e in experts_by_device_from_json(m).items()}
