"""Run an aggregator and its devices as threads of one process (tests, benchmarks).

The federation still talks through a real MQTT broker; only the processes are shared.
Every thread is a daemon and every client is stopped once the aggregator returns, so a
device that never receives a ``stop`` command (the aggregator failed, or the command
was lost) cannot keep the interpreter alive.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)


def run_inprocess(aggregator: Any, clients: Sequence[Any], timeout_s: float, client_join_s: float = 30.0,
                  during: Callable[[], None] | None = None) -> tuple[list[dict], list[BaseException]]:
    """Run ``aggregator.run()`` and every ``client.run()`` in daemon threads.

    Args:
        aggregator: a ``cloud.service.Aggregator`` (its ``run()`` returns the round records).
        clients: ``edge_sdk.EdgeClient`` objects, started after the aggregator.
        timeout_s: seconds to wait for the aggregator to return.
        client_join_s: seconds to wait for each client after the aggregator returned
            (or timed out) and every client was asked to stop.
        during: called in the calling thread once every thread started and the
            aggregator subscribed (``aggregator.ready``; fault injection, a rogue client);
            ``timeout_s`` counts from its return. What it raises is re-raised after the
            aggregator and every client were asked to stop.

    Returns:
        ``(records, errors)``: the aggregator's round records (possibly partial) and every
        exception raised in any thread (a ``TimeoutError`` is appended when the aggregator
        did not return within ``timeout_s``; it is then asked to stop).
    """
    records: list[dict] = []
    errors: list[BaseException] = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # returned to the caller
                log.debug("in-process thread failed: %r", e)
                errors.append(e)
        return run

    agg = threading.Thread(target=guard(lambda: records.extend(aggregator.run())), name="aggregator", daemon=True)
    agg.start()
    threads = [threading.Thread(target=guard(c.run), name=f"client-{c.device_id}", daemon=True) for c in clients]
    for t in threads:
        t.start()
    try:
        if during is not None:
            if not aggregator.ready.wait(timeout_s):
                raise TimeoutError(f"the aggregator did not subscribe within {timeout_s:.0f} s")
            during()
        agg.join(timeout_s)
    except BaseException:
        aggregator.stop()
        for c in clients:
            c.stop()
        raise
    if agg.is_alive():
        errors.append(TimeoutError(f"the aggregator did not finish within {timeout_s:.0f} s"))
        aggregator.stop()
    for c in clients:
        c.stop()
    for t in threads:
        t.join(client_join_s)
    agg.join(client_join_s)
    return records, errors
