"""Helpers to run a tiny federation in-process against a real broker."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from cloud.service import Aggregator, AggregatorConfig, TaskConfig
from edge_sdk import EdgeClient
from moe_model.budget import estimate
from fedmoe.datasets import bbc_news
from fedmoe.inprocess import run_inprocess
from protocol.messages import TrainConfig
from tests.conftest import tiny_spec


def drain_downlink(tr, seconds: float, replies: list, assignments: list, until=None, device: str | None = None,
                   foreign: list | None = None) -> None:
    """Read a (rogue) client's downlink for up to ``seconds`` or until ``until()``: command
    reasons (but ``registered``) go to ``replies``, parsed assignments to ``assignments``; with ``device``,
    topics outside that device's subtree go to ``foreign`` instead (they must never arrive)."""
    from protocol.messages import Assignment, Command, parse_message

    end = time.time() + seconds
    while time.time() < end and not (until and until()):
        m = tr.get(0.2)
        if m is None:
            continue
        if device is not None and f"/dev/{device}/" not in m.topic:
            foreign.append(m.topic)
            continue
        kind = m.topic.rsplit("/", 1)[1]
        if kind == "command":
            cmd = parse_message(m.payload, Command)
            if cmd.command != "registered":  # the answer to every accepted hello (minor 10), not a reply
                replies.append(cmd.reason or "")
        elif kind == "assignment":
            assignments.append(parse_message(m.payload, Assignment))


@dataclass
class Federation:
    url: str
    tmp: str
    protocol: str = "auto"
    rounds: int = 2
    experts: tuple = (2, 4)
    """Experts per layer each device's budget holds (budgets computed from the memory plan)."""
    assignment: str = "random_kept"
    round_timeout_s: float = 60.0
    min_devices: int | None = None
    spec_kw: dict = field(default_factory=lambda: {"upcycle_noise": 0.01})
    secure: object = None
    """A ``fedmoe.provision.Provisioned``: TLS, credentials and signatures for everyone."""
    config_kw: dict = field(default_factory=dict)
    reserved: list | None = None
    """Cloud-only labelled items for the task (``Aggregator(reserved_data=...)``, D^r)."""
    client_hook: object = None
    """Called with each EdgeClient before its thread starts (fault injection)."""
    records: list = field(default_factory=list)
    clients: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    def __post_init__(self):
        self.federation = f"test-{uuid.uuid4().hex[:8]}"
        items, self.labels = bbc_news()
        self.test_items = items[::40][:48]
        self.train_items = items[1::7]
        cfg = AggregatorConfig(
            federation=self.federation, model=tiny_spec(**self.spec_kw), tasks={"bbc": TaskConfig(labels=self.labels)},
            rounds=self.rounds, min_devices=self.min_devices or len(self.experts), start_timeout_s=60,
            round_timeout_s=self.round_timeout_s, train=TrainConfig(max_steps=3, batch_size=8),
            store=f"sqlite:///{self.tmp}/agg.db", clear_retained_on_exit=True, protocol=self.protocol,
            assignment={"name": self.assignment},
        )
        if self.secure is not None:
            cfg = cfg.model_copy(update={"credentials": str(self.secure.aggregator_file),
                                         "device_keys": str(self.secure.device_keys_file)})
        if self.config_kw:
            cfg = cfg.model_copy(update=self.config_kw)
        self.aggregator = Aggregator(cfg, self.url, eval_data={"bbc": self.test_items},
                                     reserved_data={"bbc": self.reserved} if self.reserved else None)

    def client(self, i: int, experts: int) -> EdgeClient:
        spec = self.aggregator.cfg.model
        budget = estimate(spec, experts, 8, len(self.labels), runtime_bytes=0).total + 1
        kw = dict(federation=self.federation, budget_bytes=budget, task="bbc", cache_dir=f"{self.tmp}/cache{i}",
                  protocol=self.protocol, runtime_bytes=0)
        data = self.train_items[i * 40:(i + 1) * 40]
        if self.secure is not None:
            return EdgeClient.from_credentials(self.url, self.secure.device_file(f"dev{i}"), data, **kw)
        return EdgeClient(self.url, f"dev{i}", data, **kw)

    def run(self, extra=None, timeout: float = 180):
        """Run the aggregator and every client, call ``extra(self)`` once they started, and
        assert that the aggregator finished and no thread raised."""
        self.clients = [self.client(i, k) for i, k in enumerate(self.experts)]
        if self.client_hook is not None:
            for c in self.clients:
                self.client_hook(c)
        records, errors = run_inprocess(self.aggregator, self.clients, timeout,
                                        during=(lambda: extra(self)) if extra is not None else None)
        self.records.extend(records)
        self.errors.extend(errors)
        assert not self.errors, self.errors
        return self.records
