"""How many groups of Huffman tables libwebp builds for a lossless stream, read from the stream.

A lossless picture's entropy image names the group of codes each block uses; libwebp builds
the tables of every group up to the highest named, or, past 1 000 (or past the picture's
pixel count), of the distinct ones only. An ordinary photo names a few hundred, a crafted
stream up to 65 536 (1.3 GB of tables): charging every picture the most its size allows
refused every lossless photo of a megapixel or more (helper-50). The entropy image comes
after the transforms' sub-images, which are decoded here only as far as reading past them
needs (codes and lengths, not pixels); the entropy image's new values are its literals (a
back reference or a colour cache entry repeats an earlier pixel), so its groups are the red
and green of its literal pixels. Bounded work: past MAX_SYMBOLS symbols, or on anything
unexpected, the caller charges the most the picture may name; and the reading shares
ParseBudget, 3 % of a core: it holds the GIL (a flood of 65 536-group bombs, each read
through in 50 ms, kept detect's /healthz p99 at 83 ms), so past its share a picture is
charged the most it may name without reading (a lossless photo may then be refused, never a
probe delayed).
"""

from __future__ import annotations

import threading
import time

MAX_SYMBOLS = 100_000        # pixels read before the entropy image is through (a 40 MP photo: 12 000)
# libwebp's encoder names at most this many groups (its histogram image's limit): past it, a
# stream is crafted, and the most it may name is charged without reading on
MAX_ENCODER_GROUPS = 2600
ALL_GROUPS_UNDER = 1000      # libwebp builds every group up to the highest one named, below this
CODE_LENGTH_ORDER = (17, 18, 0, 1, 2, 3, 4, 5, 16, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
NUM_LITERALS, NUM_LENGTHS, NUM_DISTANCES = 256, 24, 40


class ParseBudget:
    """CPU seconds of reading, refilled at `share` of a core up to `burst`: taken before a
    read, paid after with what it cost (the thread's own CPU time)."""

    def __init__(self, share: float = 0.03, burst: float = 0.02, clock=time.monotonic):
        self.share, self.burst, self.clock = share, burst, clock
        self.left, self.at = burst, clock()
        self.skipped = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self.clock()
            self.left = min(self.burst, self.left + (now - self.at) * self.share)
            self.at = now
            if self.left <= 0:
                self.skipped += 1
                return False
            return True

    def pay(self, seconds: float) -> None:
        with self._lock:
            self.left -= seconds


PARSE_BUDGET = ParseBudget()


class StreamError(ValueError):
    """Not a stream this reader follows (the caller charges the most it may name)."""


class _Bits:
    def __init__(self, data: bytes, start: int, end: int):
        self.data, self.pos, self.end = data, start * 8, end * 8

    def read(self, n: int) -> int:
        if n == 0:
            return 0
        if self.pos + n > self.end:
            raise StreamError("the stream ends early")
        at = self.pos >> 3
        value = (int.from_bytes(self.data[at:at + 4], "little") >> (self.pos & 7)) & ((1 << n) - 1)
        self.pos += n
        return value

    def peek(self, n: int) -> int:
        at = self.pos >> 3
        return (int.from_bytes(self.data[at:at + 3], "little") >> (self.pos & 7)) & ((1 << n) - 1)


class _Code:
    """A canonical prefix code read LSB first, decoded by one table lookup of its longest length."""

    def __init__(self, lengths: list[int]):
        used = [(n, s) for s, n in enumerate(lengths) if n]
        if not used:
            raise StreamError("an empty code")
        if len(used) == 1:  # one symbol: libwebp reads no bits for it
            self.bits, self.table = 0, [(used[0][1], 0)]
            return
        self.bits = max(n for n, _ in used)
        size = 1 << self.bits
        table: list[tuple[int, int] | None] = [None] * size
        code, prev = 0, 0
        for n, symbol in sorted(used):
            code <<= n - prev
            prev = n
            if code >= 1 << n:
                raise StreamError("an over-full code")
            reverse = int(f"{code:0{n}b}"[::-1], 2)
            for i in range(reverse, size, 1 << n):
                table[i] = (symbol, n)
            code += 1
        if code != 1 << prev:
            raise StreamError("an incomplete code")
        self.table = table

    def read(self, bits: _Bits) -> int:
        if not self.bits:
            return self.table[0][0]
        symbol, n = self.table[bits.peek(self.bits)]
        if bits.pos + n > bits.end:
            raise StreamError("the stream ends early")
        bits.pos += n
        return symbol


class _Reader:
    def __init__(self, data: bytes, start: int, end: int):
        self.bits = _Bits(data, start, end)
        self.symbols = 0

    def code(self, alphabet: int) -> _Code:
        b = self.bits
        lengths = [0] * alphabet
        if b.read(1):  # a simple code: one or two symbols
            count = b.read(1) + 1
            first = b.read(8 if b.read(1) else 1)
            symbols = [first] + ([b.read(8)] if count == 2 else [])
            if max(symbols) >= alphabet:
                raise StreamError("a symbol past the alphabet")
            for s in symbols:
                lengths[s] = 1
            return _Code(lengths)
        meta = [0] * 19
        for i in range(b.read(4) + 4):
            meta[CODE_LENGTH_ORDER[i]] = b.read(3)
        lengths_code = _Code(meta)
        limit = alphabet
        if b.read(1):
            limit = 2 + b.read(2 + 2 * b.read(3))
            if limit > alphabet:
                raise StreamError("more lengths than symbols")
        symbol, prev = 0, 8
        while symbol < alphabet and limit > 0:
            limit -= 1
            n = lengths_code.read(b)
            if n < 16:
                lengths[symbol] = n
                symbol += 1
                prev = n or prev
                continue
            extra, offset = ((2, 3), (3, 3), (7, 11))[n - 16]
            repeat = b.read(extra) + offset
            if symbol + repeat > alphabet:
                raise StreamError("a repeat past the alphabet")
            value = prev if n == 16 else 0
            lengths[symbol:symbol + repeat] = [value] * repeat
            symbol += repeat
        return _Code(lengths)

    def image(self, width: int, height: int, values: bool) -> set[int]:
        """Read a sub-image through; with `values`, the red-green of its literal pixels."""
        b = self.bits
        cache = _cache_bits(b)  # (a sub-image has no entropy image of its own: no bit for one)
        green = self.code(NUM_LITERALS + NUM_LENGTHS + ((1 << cache) if cache else 0))
        red, blue, alpha = self.code(NUM_LITERALS), self.code(NUM_LITERALS), self.code(NUM_LITERALS)
        distance = self.code(NUM_DISTANCES)
        found: set[int] = set()
        left = width * height
        # (the loop holds the GIL: codes of one symbol, which read no bits, are not called)
        read_green = green.read
        red_symbol = None if red.bits else red.table[0][0]
        others = [c.read for c in (blue, alpha) if c.bits]
        budget, count = MAX_SYMBOLS - self.symbols, 0
        while left > 0:
            count += 1
            if count > budget:
                raise StreamError("too long to follow")
            g = read_green(b)
            if g < NUM_LITERALS:
                r = red.read(b) if red_symbol is None else red_symbol
                for read in others:
                    read(b)
                if values:
                    found.add(r << 8 | g)
                    if len(found) > MAX_ENCODER_GROUPS:
                        raise StreamError("more groups than an encoder names")
                left -= 1
            elif g < NUM_LITERALS + NUM_LENGTHS:
                left -= _prefixed(b, g - NUM_LITERALS)
                _prefixed(b, distance.read(b))
            else:
                left -= 1  # a colour cache entry: an earlier pixel
        self.symbols += count
        return found


def _cache_bits(bits: _Bits) -> int:
    if not bits.read(1):
        return 0
    cache = bits.read(4)
    if not 1 <= cache <= 11:
        raise StreamError("a colour cache past 11 bits")
    return cache


def _prefixed(bits: _Bits, symbol: int) -> int:
    if symbol < 4:
        return symbol + 1
    extra = (symbol - 2) >> 1
    return ((2 + (symbol & 1)) << extra) + bits.read(extra) + 1


def _sub(size: int, bits: int) -> int:
    return (size + (1 << bits) - 1) >> bits


def built_groups(data: bytes, start: int, end: int, width: int, height: int) -> int:
    """The groups libwebp builds tables for, for the image stream at data[start:end] (after a
    VP8L chunk's 5-byte header, or an ALPH chunk's first byte) of a width x height picture."""
    reader = _Reader(data, start, end)
    b = reader.bits
    xsize, seen = width, set()
    while b.read(1):
        kind = b.read(2)
        if kind in seen:
            raise StreamError("a transform twice")
        seen.add(kind)
        if kind in (0, 1):  # predictor, cross-colour: a sub-image of their blocks
            size = b.read(3) + 2
            reader.image(_sub(xsize, size), _sub(height, size), False)
        elif kind == 3:  # colour indexing: the palette, then packed pixels
            colors = b.read(8) + 1
            reader.image(colors, 1, False)
            xsize = _sub(xsize, 0 if colors > 16 else 1 if colors > 4 else 2 if colors > 2 else 3)
    _cache_bits(b)
    if not b.read(1):
        return 1  # no entropy image: one group
    precision = b.read(3) + 2
    groups = reader.image(_sub(xsize, precision), _sub(height, precision), True)
    if not groups:
        raise StreamError("an entropy image without a literal")
    named = max(groups) + 1
    return len(groups) if named > ALL_GROUPS_UNDER or named > xsize * height else named


def vp8l_groups(data: bytes, body: int, end: int) -> tuple[int, int, int]:
    """(groups, width, height) of a VP8L chunk's stream starting at `body`."""
    if end - body < 5 or data[body] != 0x2F:
        raise StreamError("not a VP8L stream")
    bits = int.from_bytes(data[body + 1:body + 5], "little")
    width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if bits >> 29:
        raise StreamError("an unknown VP8L version")
    return built_groups(data, body + 5, end, width, height), width, height
