"""A child's line that only repeats the one before it is written once per window.

C libraries inside a service print to its stderr themselves, one line per bad input
(libpng's ``libpng error: IDAT: CRC error`` for each PNG whose checksum fails): a hostile
client sending such files made its flood a flood of the unit's log, about 50 bytes a
request. A line identical to the previous line of the same child is written again only
after LOG_REPEAT_S; how many were held back is said with the next line that differs, or
with the next copy written. Other lines pass as they are, in their order.
"""

from __future__ import annotations

from collections.abc import Callable

from supervisor.driver.port import LOG_REPEAT_S


class RepeatedLines:
    def __init__(self, now: Callable[[], float], window_s: float = LOG_REPEAT_S):
        self.now, self.window_s = now, window_s
        self._last: str | None = None
        self._written_at = 0.0
        self._held = 0
        self.held_total = 0  # lines held back since start

    def filter(self, texts: list[str]) -> list[str]:
        """What of ``texts`` (a child's lines, in order) goes to the log."""
        out: list[str] = []
        now = self.now()
        for text in texts:
            if text == self._last and now - self._written_at < self.window_s:
                self._held += 1
                self.held_total += 1
                continue
            if self._held:
                out.append(f"(the line before was repeated {self._held} more times)")
                self._held = 0
            self._last, self._written_at = text, now
            out.append(text)
        return out
