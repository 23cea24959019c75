"""Device registry: who has joined, what they declared, whether they are online."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from protocol.messages import MIN_MINOR_FOR_PROGRAMS, PROTOCOL_MINOR, PROTOCOL_VERSION, Hello, Stats

from .store import Store

log = logging.getLogger(__name__)


@dataclass
class Device:
    """A registered device (from its ``hello``) and its liveness."""

    device_id: str
    task: str
    budget_bytes: int
    num_samples: int
    weight_formats: list[str]
    runtime_bytes: int | None = None
    online: bool = True
    last_seen: float = field(default_factory=time.time)
    rounds: int = 0
    """Rounds whose update was accepted."""
    protocol_minor: int = 0
    """The protocol minor version its ``hello`` announced (same major, or it was refused)."""
    runtimes: list[str] = field(default_factory=list)
    """The training runtimes it trains with (``Hello.runtimes``, minor 12); empty: it trains
    the model itself."""


class Registry:
    """Registered devices, persisted in the store so a restart keeps them."""

    def __init__(self, store: Store):
        self.store = store
        self.devices: dict[str, Device] = {}
        self.last_stats: dict[str, Stats] = {}
        self.reload()

    def reload(self) -> None:
        """Read the registered devices from the store again (an aggregator worker follows
        what the coordinator registered). Raises StoreError."""
        self.devices = {d: Device(**info) for d, info in self.store.devices().items()}

    def register(self, hello: Hello) -> Device:
        """Add or update a device from its ``hello`` (idempotent)."""
        prev = self.devices.get(hello.device_id)
        dev = Device(
            device_id=hello.device_id, task=hello.task, budget_bytes=hello.budget_bytes,
            num_samples=hello.num_samples, weight_formats=list(hello.weight_formats),
            runtime_bytes=hello.runtime_bytes, online=True, rounds=prev.rounds if prev else 0,
            protocol_minor=hello.protocol_minor,
            runtimes=list(hello.runtimes) if hello.protocol_minor >= MIN_MINOR_FOR_PROGRAMS else [],
        )
        if dev.protocol_minor != PROTOCOL_MINOR and (prev is None or prev.protocol_minor != dev.protocol_minor):
            log.info("device %s speaks protocol %d.%d (this aggregator %d.%d): %s", dev.device_id, PROTOCOL_VERSION,
                     dev.protocol_minor, PROTOCOL_VERSION, PROTOCOL_MINOR,
                     "what it adds is ignored" if dev.protocol_minor > PROTOCOL_MINOR
                     else "it ignores what this version adds")
        if prev is None:
            log.info("registered %s (task %s, budget %.2f GiB, %d samples)", dev.device_id, dev.task,
                     dev.budget_bytes / 1024**3, dev.num_samples)
        self.devices[dev.device_id] = dev
        self._save(dev)
        return dev

    def set_online(self, device_id: str, online: bool) -> None:
        """Record a liveness change (status message or Last Will). Unknown ids are ignored."""
        dev = self.devices.get(device_id)
        if dev is None or dev.online == online:
            return
        dev.online = online
        dev.last_seen = time.time()
        log.info("%s is %s", device_id, "online" if online else "offline")
        self._save(dev)

    def accepted(self, device_id: str, stats: Stats) -> None:
        """Count an accepted update: ``rounds += 1``, refresh ``last_seen``, keep ``stats``, persist.
        Raises KeyError for an unregistered device."""
        dev = self.devices[device_id]
        dev.rounds += 1
        dev.last_seen = time.time()
        self.last_stats[device_id] = stats
        self._save(dev)

    def update_memory(self, device_id: str, budget_bytes: int | None, runtime_bytes: int | None) -> None:
        """Record a device's new budget / measured baseline (from a refusal, or the
        ``baseline_rss_bytes`` of its stats). Unknown ids are ignored."""
        dev = self.devices.get(device_id)
        if dev is None:
            return
        if budget_bytes is not None:
            dev.budget_bytes = int(budget_bytes)
        if runtime_bytes is not None:
            dev.runtime_bytes = int(runtime_bytes)
        self._save(dev)

    def online(self) -> list[Device]:
        """The devices currently online, in registration order."""
        return [d for d in self.devices.values() if d.online]

    def offline(self) -> list[Device]:
        """The registered devices currently offline, in registration order (``last_seen``:
        when they went offline, Unix seconds)."""
        return [d for d in self.devices.values() if not d.online]

    def get(self, device_id: str) -> Device | None:
        """The registered device, or None."""
        return self.devices.get(device_id)

    def _save(self, dev: Device) -> None:
        self.store.save_device(dev.device_id, asdict(dev))
