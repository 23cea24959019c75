"""Progress of a running simulation as the operator sees it: the aggregator's progress
events (``Progress`` on the federation's progress topic) logged as they come, and device
processes that die, with the tail of their log, until the aggregator exits."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from protocol.messages import Progress, parse_message

from .supervisor import Processes

if TYPE_CHECKING:
    from protocol.transport import Transport

log = logging.getLogger(__name__)


def watch(watcher: Transport, procs: Processes, rounds: int) -> None:
    """Log the progress events ``watcher`` (subscribed to the federation's progress topic)
    receives, and device processes of ``procs`` that die, until the aggregator exits;
    ``rounds``: how many the simulation runs (``round i/N``)."""
    agg = procs.procs["aggregator"]
    dead: set[str] = set()
    while agg.poll() is None:
        m = watcher.get(1.0)
        for name, p in procs.procs.items():
            if name != "aggregator" and name not in dead and p.poll() not in (None, 0):
                dead.add(name)
                log.warning("device process %s exited with %s%s:\n%s", name, p.returncode,
                            " (SIGKILL: the OOM killer, if it ran in a memory cgroup)" if p.returncode == -9 else "",
                            procs.tail(name, 10))
        if m is None:
            continue
        try:
            ev = parse_message(m.payload, Progress)
        except ValueError:
            continue
        d = ev.detail
        if ev.event == "waiting":
            log.info("waiting for devices: %s/%s online", d.get("online"), d.get("needed"))
        elif ev.event == "round_start":
            log.info("round %d/%d: %d devices training", ev.round, rounds, len(d.get("devices", [])))
            for dev, why in sorted((d.get("excluded") or {}).items()):
                log.warning("round %d/%d: %s left out: %s", ev.round, rounds, dev, why)
        elif ev.event == "report":
            log.info("round %d/%d: %s reported (%s/%s), local val acc %.3f", ev.round, rounds, d.get("device"),
                     d.get("reported"), d.get("selected"), d.get("val_accuracy") or 0.0)
        elif ev.event == "round_end":
            acc = d.get("accuracy")
            log.info("round %d/%d done in %.0f s: global accuracy %s (%s)", ev.round, rounds, d.get("seconds", 0),
                     f"{acc:.4f}" if acc is not None else "n/a", d.get("status"))
