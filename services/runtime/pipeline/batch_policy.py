"""When the model frees up with k compatible items waiting: run now, or wait for more?

A fixed fill window is wrong for every model and every load but one: it costs a lone client
its length on every call, and with closed-loop clients (each sends again as soon as it has
its answer) the requests that come back a few milliseconds after a batch started wait a
whole batch. This policy decides from what it knows instead:

- what a batch costs (the learned curve: ``seconds(b)``);
- what is coming: requests admitted and still decoding (each expected when a decode
  usually ends), and what usually arrives at this point after the model frees up (the
  arrivals that followed each of the recent model-free moments, by their offset, so both
  a steady stream and clients that come back right after their answer are seen);
- which arrivals can join: the share of recent items with the head's batching key.

It picks the wait w (0, or a moment when an arrival is expected) that minimises the
model time per item, ``(w + seconds(n(w))) / n(w)`` with n(w) the items expected by then,
and waits only when that beats running now by a margin. A model whose cost grows linearly
with the batch (a CPU model) can never gain and never waits; a full batch never waits; the
oldest item never waits past ``cap`` (``max_wait_ms`` when set, else one call's fixed
cost). Every input is an argument: tests replay scripted arrivals with their own clock.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

MARGIN = 0.03           # waiting must beat running now by this share of the per-item cost
HISTORY_ENDS = 48       # model-free moments remembered
HISTORY_S = 60.0        # and for at most this long
KEY_WINDOW = 64         # recent items that give the share of compatible arrivals
RECENCY = 0.85          # a cycle's weight against the next one's: a new load pattern counts within a few


@dataclass(frozen=True)
class Decision:
    wait_s: float                 # 0: run now
    expected_items: float         # items the chosen moment should bring (k included)
    reason: str


class ArrivalHistory:
    """Queue entries (items becoming ready to batch) and the moments the model freed up."""

    def __init__(self) -> None:
        self._ends: collections.deque[float] = collections.deque(maxlen=HISTORY_ENDS)
        self._sizes: collections.deque[int] = collections.deque(maxlen=HISTORY_ENDS)  # the call that ended
        self._times: list[float] = []      # sorted entry times
        self._counts: list[int] = []       # items per entry
        self._keys: collections.deque[Hashable] = collections.deque(maxlen=KEY_WINDOW)

    def model_freed(self, now: float, items: int = 1 << 30) -> None:
        """The model freed up after a call of `items` (whose clients may come back: closed loop)."""
        self._ends.append(now)
        self._sizes.append(items)
        self._forget(now)

    def arrived(self, now: float, items: int, key: Hashable) -> None:
        self._times.append(now)
        self._counts.append(items)
        for _ in range(min(items, KEY_WINDOW)):
            self._keys.append(key)

    def _forget(self, now: float) -> None:
        horizon = now - HISTORY_S
        oldest_end = self._ends[0] if self._ends else now
        cut = bisect.bisect_left(self._times, min(horizon, oldest_end))
        if cut:
            del self._times[:cut]
            del self._counts[:cut]

    def compatible_share(self, key: Hashable) -> float:
        if not self._keys:
            return 1.0
        return sum(1 for k in self._keys if k == key) / len(self._keys)

    def arrived_since_free(self) -> int:
        """Items that arrived since the model last freed up."""
        if not self._ends:
            return 0
        i = bisect.bisect_right(self._times, self._ends[-1])
        return sum(self._counts[i:])

    def cycles(self, now: float, until: float) -> list[tuple[float, int, list[float]]]:
        """For each recent model-free moment whose first `until` seconds are over: its weight
        (recent cycles count more), the size of the call that had just ended, and the offsets
        at which items arrived after it, one per item, in order."""
        ends = [(t, n) for t, n in zip(self._ends, self._sizes, strict=True) if t + until <= now]
        out = []
        for age, (start, size) in enumerate(reversed(ends)):
            i = bisect.bisect_right(self._times, start)
            j = bisect.bisect_right(self._times, start + until)
            offsets: list[float] = []
            for n in range(i, j):
                offsets.extend([self._times[n] - start] * min(self._counts[n], 64))
            out.append((RECENCY ** age, size, offsets))
        return out


class BatchPolicy:
    """The run-now-or-wait decision. `seconds(n)` is the learned batch time for n items
    (fractional n interpolates); None before the curve is known."""

    def __init__(self, max_batch: int, cap_s: float | None):
        self.max_batch = max_batch
        self.cap_s = cap_s
        self.history = ArrivalHistory()

    def cap(self, seconds: Callable[[float], float | None]) -> float:
        if self.cap_s is not None:
            return self.cap_s
        one = seconds(1)
        return one if one is not None else 0.0

    def decide(self, now: float, waiting: int, key: Hashable, since_free: float, waited: float,
               decoding_eta: list[float], seconds: Callable[[float], float | None]) -> Decision:
        """`waiting`: compatible items queued behind (and with) the head; `since_free`: how long
        the model has been free; `waited`: how long the head has waited for a batch already;
        `decoding_eta`: seconds from now at which each decoding request should be queued."""
        if waiting >= self.max_batch or waiting <= 0:
            return Decision(0.0, waiting, "full" if waiting else "empty")
        now_cost = seconds(waiting)
        if now_cost is None:
            return Decision(0.0, waiting, "no cost curve yet")
        left = self.cap(seconds) - waited
        if left <= 0:
            return Decision(0.0, waiting, "waited the cap")
        share = max(0.1, self.history.compatible_share(key))
        best = Decision(0.0, waiting, "running now is cheapest per item")
        best_cost = now_cost / waiting * (1 - MARGIN)
        # requests still decoding: each is queued when a decode usually ends (near certain)
        for j, eta in enumerate(sorted(e for e in decoding_eta if 0 <= e <= left), start=1):
            n = min(float(self.max_batch), waiting + j * share)
            cost = seconds(n) if n > waiting else None
            if cost is not None and (eta + cost) / n < best_cost:
                best_cost = (eta + cost) / n
                best = Decision(eta, n, f"waiting {eta * 1000:.1f} ms for {n - waiting:.2f} item(s) decoding")
        # what usually arrives now: given what has come since the model freed up, the chance
        # that j more compatible items come within w, from the recent cycles that ended a call
        # at least as large (closed-loop clients come back after their answers: a cycle after
        # a call of 7 tells nothing of an 8th)
        already = self.history.arrived_since_free()
        # long after the model freed up, "what followed a free moment" is whatever came next,
        # minutes later maybe: the cycles tell nothing then, only what is decoding does
        cycles = self.history.cycles(now, since_free + left) if since_free <= self.cap(seconds) else []
        for j in range(1, self.max_batch - waiting + 1):
            cost_more = seconds(waiting + j)
            if cost_more is None:
                break
            need = already + math.ceil(j / share)
            alike = [(weight, offsets) for weight, ended, offsets in cycles if ended >= need]
            times = sorted((offsets[need - 1], weight) for weight, offsets in alike if len(offsets) >= need)
            later = sum(weight for weight, _ in alike) - sum(w for t, w in times if t <= since_free)
            if later <= 0:
                continue
            reached = 0.0
            for t, weight in times:
                if t <= since_free:
                    continue
                reached += weight
                w = t - since_free
                p = reached / later  # the j-th comes by then, given it had not come by now
                per_item = p * (w + cost_more) / (waiting + j) + (1 - p) * (w + now_cost) / waiting
                if per_item < best_cost:
                    best_cost = per_item
                    best = Decision(w, waiting + j * p, f"waiting {w * 1000:.1f} ms for {j} more item(s) "
                                                        f"(p {p:.2f})")
        return best
