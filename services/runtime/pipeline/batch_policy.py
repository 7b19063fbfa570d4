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
from collections.abc import Callable, Hashable
from dataclasses import dataclass

MARGIN = 0.03           # waiting must beat running now by this share of the per-item cost
HISTORY_ENDS = 48       # model-free moments remembered
HISTORY_S = 60.0        # and for at most this long
KEY_WINDOW = 64         # recent items that give the share of compatible arrivals
RECENCY = 0.85          # a cycle's weight against the next one's: a new load pattern counts within a few
GRID_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


@dataclass(frozen=True)
class Decision:
    wait_s: float                 # 0: run now
    expected_items: float         # items the chosen moment should bring (k included)
    reason: str


class ArrivalHistory:
    """Queue entries (items becoming ready to batch) and the moments the model freed up."""

    def __init__(self) -> None:
        self._ends: collections.deque[float] = collections.deque(maxlen=HISTORY_ENDS)
        self._times: list[float] = []      # sorted entry times
        self._counts: list[int] = []       # items per entry
        self._keys: collections.deque[Hashable] = collections.deque(maxlen=KEY_WINDOW)

    def model_freed(self, now: float) -> None:
        self._ends.append(now)
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

    def expected(self, now: float, since_free: float, horizon: float) -> tuple[list[float], list[float]]:
        """What usually arrives after the model frees up, up to `since_free + horizon`: the
        offsets (from the model-free moment) of past cycles' arrivals, each weighted so that
        the weights of one cycle sum to that cycle's share (recent cycles count more). The
        caller compares the running sum with what has arrived in this cycle already."""
        windows = [t for t in self._ends if t + since_free + horizon <= now]
        if not windows:
            return [], []
        shares = [RECENCY ** age for age in range(len(windows) - 1, -1, -1)]
        total = sum(shares)
        pairs: list[tuple[float, float]] = []
        for start, share in zip(windows, shares, strict=False):
            i = bisect.bisect_right(self._times, start)
            j = bisect.bisect_right(self._times, start + since_free + horizon)
            for n in range(i, j):
                pairs.append((self._times[n] - start, share / total * min(self._counts[n], 64)))
        pairs.sort()
        return [p for p, _ in pairs], [w for _, w in pairs]


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
        share = self.history.compatible_share(key)
        offsets, weights = self.history.expected(now, since_free, left)
        already = self.history.arrived_since_free()
        dec = sorted(e for e in decoding_eta if 0 <= e <= left)
        candidates = sorted({c for c in (*dec, *(o - since_free for o in offsets), *(g for g in GRID_S if g <= left))
                             if 0 < c <= left})
        best = Decision(0.0, waiting, "running now is cheapest per item")
        best_cost = now_cost / waiting * (1 - MARGIN)
        hist_i = dec_i = 0
        usual = 0.0  # items that usually arrived by this point after the model freed up
        for w in candidates:
            while hist_i < len(offsets) and offsets[hist_i] <= since_free + w:
                usual += weights[hist_i]
                hist_i += 1
            while dec_i < len(dec) and dec[dec_i] <= w:
                dec_i += 1
            coming = max(usual - already, float(dec_i), 0.0) * share
            n = min(float(self.max_batch), waiting + coming)
            if n <= waiting:
                continue
            cost = seconds(n)
            if cost is None:
                continue
            per_item = (w + cost) / n
            if per_item < best_cost:
                best_cost = per_item
                best = Decision(w, n, f"waiting {w * 1000:.1f} ms for {n - waiting:.2f} more item(s)")
        return best
