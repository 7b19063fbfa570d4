"""A child's line that repeats the one before it is written once per window (log_repeats)."""

from __future__ import annotations

from supervisor.driver.log_repeats import RepeatedLines


def test_a_repeated_line_is_written_once_per_window_and_the_count_follows():
    clock = [0.0]
    repeats = RepeatedLines(lambda: clock[0], window_s=10.0)
    crc = "libpng error: IDAT: CRC error"
    assert repeats.filter([crc, crc, crc]) == [crc]
    assert repeats.filter([crc] * 100) == []
    clock[0] = 5.0
    assert repeats.filter(["INFO: a request", crc]) == [
        "(the line before was repeated 102 more times)", "INFO: a request", crc]
    assert repeats.filter([crc]) == []  # the same line again, within the window of its last copy
    clock[0] = 15.1
    assert repeats.filter([crc]) == ["(the line before was repeated 1 more times)", crc]
    assert repeats.filter(["a", "b", "a", "b"]) == ["a", "b", "a", "b"]  # only the line just before
    assert repeats.held_total == 103
