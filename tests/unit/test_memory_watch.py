"""The resident memory watch: over the budget it warns (once a minute at most), sets its gauge
and says so in /stats; back under, it clears. (The real process: test_sdk_service.)"""

from __future__ import annotations

import logging

from services.runtime.shell.memory_watch import MemoryWatch

MIB = 2**20


class Gauge:
    value = None

    def set(self, v):
        self.value = v


def test_over_the_budget_it_warns_once_a_minute_and_clears_when_back(caplog):
    gauge = Gauge()
    watch = MemoryWatch("svc", lambda: 600 * MIB, gauge)
    caplog.set_level(logging.WARNING, "onecard.service")
    watch.look(500 * MIB, now=0.0)
    assert (gauge.value, watch.snapshot()) == (0, {"resident_bytes": 500 * MIB, "over_budget": False})
    watch.look(1285 * MIB, now=1.0)
    watch.look(1300 * MIB, now=30.0)
    assert gauge.value == 1 and watch.snapshot()["over_budget"] is True
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "1285 MiB is over this service's budget of 600 MiB (by 685 MiB)" in warnings[0]
    watch.look(1300 * MIB, now=61.5)
    assert len(caplog.records) == 2
    watch.look(400 * MIB, now=62.0)
    assert gauge.value == 0 and watch.snapshot()["over_budget"] is False


def test_without_a_budget_or_a_reading_nothing_is_over():
    gauge = Gauge()
    MemoryWatch("svc", lambda: None, gauge).look(10**12, now=0.0)
    assert gauge.value == 0
    MemoryWatch("svc", lambda: MIB, gauge).look(None, now=0.0)
    assert gauge.value == 0
