"""MQTT topic names of protocol v1 (docs/architecture.md, "Protocol (v1)").

Layout under the root ``fl/v1/{federation}``:

- ``dev/{device_id}/up/{kind}``: the device publishes (hello, stats, update, ack, status).
- ``dev/{device_id}/up/{kind}/{partition}``: where a device publishes its update and stats
  when its assignment names an uplink partition (protocol minor 9: the aggregator worker
  that takes them, :mod:`cloud.workers`); still below the device's own ``up/`` subtree.
- ``dev/{device_id}/down/{kind}``: the cloud publishes (assignment, state, command).
- ``shards/{model_version}/{format}/{layer}/{expert}/{chunk}``: retained expert base
  shards in weight format ``format`` (fp32, bf16, int8, nf4; one level more than
  docs/architecture.md's layout, so a cloud can serve several formats side by side).
- ``shards/{model_version}/{format}/backbone/{chunk}``: retained backbone base shard.
- ``cloud/progress``: round progress events for operators and the simulator.

A broker ACL can confine a device to its own subtree by username = device id
(``pattern write fl/v1/+/dev/%u/up/#``, ``pattern read fl/v1/+/dev/%u/down/#``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "fl/v1"
UP_KINDS = ("hello", "stats", "update", "ack", "status")
PARTITIONED_KINDS = ("update", "stats")
"""The up kinds a device publishes to its assignment's uplink partition (minor 9)."""
DOWN_KINDS = ("assignment", "state", "command")
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a valid topic level (1-64 of ``[A-Za-z0-9_.-]``).

    Raises:
        ValueError: the value is empty, too long, or holds MQTT wildcards/separators.
    """
    if not isinstance(value, str) or not _ID.match(value):
        raise ValueError(f"invalid {what} {value!r}: need 1-64 characters of [A-Za-z0-9_.-]")
    return value


@dataclass(frozen=True)
class Topics:
    """Topic builder and parser for one federation."""

    federation: str

    def __post_init__(self) -> None:
        check_id(self.federation, "federation")

    @property
    def root(self) -> str:
        """``fl/v1/{federation}``."""
        return f"{ROOT}/{self.federation}"

    # device-scoped
    def up(self, device_id: str, kind: str, partition: str | None = None) -> str:
        """``{root}/dev/{device_id}/up/{kind}``, or ``.../up/{kind}/{partition}`` for an update
        or stats sent to an uplink partition (``Assignment.uplink``). Raises ValueError for a
        kind not in ``UP_KINDS`` (``PARTITIONED_KINDS`` with a partition), an invalid device id
        or partition."""
        if kind not in UP_KINDS:
            raise ValueError(f"unknown up kind {kind!r}")
        topic = f"{self.root}/dev/{check_id(device_id, 'device id')}/up/{kind}"
        if partition is None:
            return topic
        if kind not in PARTITIONED_KINDS:
            raise ValueError(f"{kind} is not sent to an uplink partition")
        return f"{topic}/{check_id(partition, 'uplink partition')}"

    def partition_filters(self, partition: str) -> list[str]:
        """The filters an aggregator worker subscribes to for its uplink partition:
        ``{root}/dev/+/up/{kind}/{partition}`` for each of ``PARTITIONED_KINDS``."""
        check_id(partition, "uplink partition")
        return [f"{self.root}/dev/+/up/{kind}/{partition}" for kind in PARTITIONED_KINDS]

    def down(self, device_id: str, kind: str) -> str:
        """``{root}/dev/{device_id}/down/{kind}``. Raises ValueError for a kind not in ``DOWN_KINDS``
        or an invalid device id."""
        if kind not in DOWN_KINDS:
            raise ValueError(f"unknown down kind {kind!r}")
        return f"{self.root}/dev/{check_id(device_id, 'device id')}/down/{kind}"

    def all_up(self) -> str:
        """Wildcard the aggregator subscribes to."""
        return f"{self.root}/dev/+/up/#"

    def device_down(self, device_id: str) -> str:
        """Wildcard a device subscribes to."""
        return f"{self.root}/dev/{check_id(device_id, 'device id')}/down/#"

    # shards
    def shard_prefix(self, model_version: int, shard_id: str, fmt: str | None = None) -> str:
        """Prefix of a shard's chunk topics; ``shard_id`` is ``backbone`` or ``L{l}.E{e}``,
        ``fmt`` the weight format level (``None``: no format level)."""
        base = f"{self.root}/shards/{int(model_version)}"
        if fmt is not None:
            base = f"{base}/{check_id(fmt, 'weight format')}"
        if shard_id == "backbone":
            return f"{base}/backbone"
        layer, expert = parse_shard_id(shard_id)
        return f"{base}/{layer}/{expert}"

    def shard_chunk(self, model_version: int, shard_id: str, seq: int, fmt: str | None = None) -> str:
        """Topic of chunk ``seq`` of a shard: ``{shard_prefix}/{seq}``. Raises ValueError for an
        invalid shard id or format."""
        return f"{self.shard_prefix(model_version, shard_id, fmt)}/{int(seq)}"

    def shard_wildcard(self, model_version: int, shard_id: str, fmt: str | None = None) -> str:
        """Wildcard over all chunks of a shard: ``{shard_prefix}/#``. Raises ValueError as
        :meth:`shard_chunk`."""
        return f"{self.shard_prefix(model_version, shard_id, fmt)}/#"

    def progress(self) -> str:
        """``{root}/cloud/progress``: round progress events."""
        return f"{self.root}/cloud/progress"

    def parse_device_topic(self, topic: str) -> tuple[str, str, str]:
        """Split ``.../dev/{id}/{up|down}/{kind}`` (or ``.../up/{kind}/{partition}`` for an
        update or stats sent to an uplink partition) into (device_id, direction, kind).

        Raises:
            ValueError: the topic is not a device topic of this federation.
        """
        prefix = f"{self.root}/dev/"
        if not topic.startswith(prefix):
            raise ValueError(f"not a device topic of {self.federation}: {topic!r}")
        parts = topic[len(prefix):].split("/")
        if len(parts) == 4 and parts[1] == "up" and parts[2] in PARTITIONED_KINDS:
            check_id(parts.pop(), "uplink partition")
        if len(parts) != 3 or parts[1] not in ("up", "down"):
            raise ValueError(f"malformed device topic {topic!r}")
        device_id, direction, kind = parts
        check_id(device_id, "device id")
        kinds = UP_KINDS if direction == "up" else DOWN_KINDS
        if kind not in kinds:
            raise ValueError(f"unknown {direction} kind {kind!r}")
        return device_id, direction, kind


def shard_id(layer: int, expert: int) -> str:
    """Shard id of expert ``expert`` in MoE layer ``layer``: ``L{layer}.E{expert}``."""
    return f"L{int(layer)}.E{int(expert)}"


def parse_shard_id(value: str) -> tuple[int, int]:
    """Inverse of :func:`shard_id`. Raises ValueError on anything else."""
    m = re.fullmatch(r"L(\d{1,4})\.E(\d{1,5})", value)
    if not m:
        raise ValueError(f"invalid expert shard id {value!r}")
    return int(m.group(1)), int(m.group(2))
