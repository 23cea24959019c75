"""The embedded broker's handling of amqtt 0.12.1's known harmless errors (fedmoe.broker)."""

from __future__ import annotations

import logging

from fedmoe.broker import EmbeddedBroker


def test_a_connect_race_is_counted_and_kept_off_the_terminal_other_errors_are_not(caplog):
    broker = EmbeddedBroker()  # not started: only its loop exception handler is exercised
    race = RuntimeError("dictionary changed size during iteration")
    with caplog.at_level(logging.DEBUG):
        broker._on_task_error(None, {"exception": race, "message": "Unhandled exception in client_connected_cb"})
    assert broker.connect_races == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    other = RuntimeError("something else broke")
    with caplog.at_level(logging.DEBUG):
        broker._on_task_error(None, {"exception": other, "message": "Unhandled exception in client_connected_cb"})
    assert broker.connect_races == 1
    assert [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "amqtt"]
