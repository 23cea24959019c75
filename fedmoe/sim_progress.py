"""What ``fedmoe simulate`` shows on the terminal while a federation runs, until the aggregator exits.

:class:`Narrator` turns the aggregator's progress events (``{root}/cloud/progress``:
``waiting``, ``round_start``, ``report``, ``round_end``) and the devices' hello messages
(``{root}/dev/+/up/hello``: a device is online, with its memory budget) into log lines,
and says what the run is waiting for whenever nothing was shown for ``quiet_s`` seconds
(the aggregator's start, which builds the global MoE and evaluates it before round 1,
takes minutes on a small machine and sends no event).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from protocol.messages import Hello, Progress, parse_message
from protocol.topics import Topics

from .supervisor import Processes

if TYPE_CHECKING:
    from protocol.transport import Transport

log = logging.getLogger("fedmoe.simulate")


class Narrator:
    """Progress lines of one simulated federation.

    Args:
        topics: the federation's topics.
        rounds: rounds configured.
        devices: how many device processes were started.
        small: ids of the devices started below one expert per layer (``--small-devices``).
        quiet_s: seconds without a line after which :meth:`idle` says what is awaited.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, topics: Topics, rounds: int, devices: int, small: set[str] = frozenset(),
                 quiet_s: float = 20.0, clock: Callable[[], float] = time.monotonic):
        self.topics, self.rounds, self.devices, self.small = topics, rounds, devices, set(small)
        self.quiet_s, self.clock = quiet_s, clock
        self.online: set[str] = set()
        self.round = 0
        """The round in progress (0: before round 1)."""
        self.selected = 0
        self.reported = 0
        self.waiting_seen = False
        self.t0 = self.phase_start = self.last_line = clock()

    def subscriptions(self) -> list[str]:
        """The topic filters to subscribe to (QoS 1)."""
        return [self.topics.progress(), f"{self.topics.root}/dev/+/up/hello"]

    def _say(self, level: int, text: str, *args) -> None:
        log.log(level, text, *args)
        self.last_line = self.clock()

    def on_message(self, topic: str, payload: bytes) -> None:
        """Log what a progress event or hello says (malformed messages are ignored)."""
        try:
            if topic.endswith("/up/hello"):
                self._hello(parse_message(payload, Hello))
            else:
                self._event(parse_message(payload, Progress))
        except ValueError:
            return

    def _hello(self, h: Hello) -> None:
        if h.device_id in self.online:
            return
        self.online.add(h.device_id)
        note = " (small: below one expert per layer)" if h.device_id in self.small else ""
        self._say(logging.INFO, "%s online: memory budget %.0f MiB%s, %d samples (%d/%d devices)", h.device_id,
                  h.budget_bytes / 2**20, note, h.num_samples, len(self.online), self.devices)

    def _event(self, ev: Progress) -> None:
        d, rounds = ev.detail, self.rounds
        if ev.event == "waiting":
            self.waiting_seen = True
            self._say(logging.INFO, "the aggregator evaluated the untrained global MoE; devices registered: %s/%s",
                      d.get("online"), d.get("needed"))
        elif ev.event == "round_start":
            self.round, self.selected, self.reported, self.phase_start = ev.round, len(d.get("devices", [])), 0, \
                self.clock()
            self._say(logging.INFO, "round %d/%d: %d devices training", ev.round, rounds, self.selected)
            for dev, why in sorted((d.get("excluded") or {}).items()):
                self._say(logging.WARNING, "round %d/%d: %s left out: %s", ev.round, rounds, dev, why)
        elif ev.event == "report":
            self.reported += 1
            self._say(logging.INFO, "round %d/%d: %s reported (%s/%s), local val acc %.3f", ev.round, rounds,
                      d.get("device"), d.get("reported"), d.get("selected"), d.get("val_accuracy") or 0.0)
        elif ev.event == "round_end":
            acc = d.get("accuracy")
            self.selected = self.reported = 0
            self.phase_start = self.clock()
            self._say(logging.INFO, "round %d/%d done in %.0f s: global accuracy %s (%s)", ev.round, rounds,
                      d.get("seconds", 0), f"{acc:.4f}" if acc is not None else "n/a", d.get("status"))

    def idle(self) -> None:
        """Say what is awaited if nothing was said for ``quiet_s`` seconds."""
        now = self.clock()
        if now - self.last_line < self.quiet_s:
            return
        since = now - self.phase_start
        if self.round == 0 and self.waiting_seen:
            self._say(logging.INFO, "starting (%.0f s): waiting for the devices to join; %d/%d online", since,
                      len(self.online), self.devices)
        elif self.round == 0:
            self._say(logging.INFO, "starting (%.0f s): the aggregator builds the global MoE, publishes its base "
                      "shards and evaluates it before round 1; %d/%d devices online", since, len(self.online),
                      self.devices)
        elif not self.selected:
            self._say(logging.INFO, "round %d/%d done %.0f s ago: the aggregator plans the next step", self.round,
                      self.rounds, since)
        elif self.reported < self.selected:
            self._say(logging.INFO, "round %d/%d (%.0f s): %d/%d devices reported, the rest are training",
                      self.round, self.rounds, since, self.reported, self.selected)
        else:
            self._say(logging.INFO, "round %d/%d (%.0f s): every device reported; the aggregator aggregates and "
                      "evaluates", self.round, self.rounds, since)


def watch(watcher: Transport, procs: Processes, narrator: Narrator) -> None:
    """Show progress (``narrator``: the messages ``watcher`` receives on
    :meth:`Narrator.subscriptions`) and device processes of ``procs`` that die, with the
    tail of their log, until the aggregator exits.

    Raises:
        RuntimeError: every device process exited with an error (e.g. its budget below its
            own baseline) while the aggregator still ran.
    """
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
                if len(dead) == len(procs.procs) - 1:  # the aggregator would wait for them until start_timeout_s
                    raise RuntimeError(f"every device process exited before the federation ended; the last one "
                                       f"({name}) said:\n{procs.tail(name, 5)}")
        if m is None:
            narrator.idle()
        else:
            narrator.on_message(m.topic, m.payload)
