"""What encoding an answer holds is charged before the work starts (cost.check).

A 2000x2000 picture of noise encoded as WebP at quality 100 held 31.8 bytes a pixel (OpenCV's
BGR copy and libwebp's token buffers) where 3 were charged (the answer's raw size): four
such answers encoding at once in the CPU pool held 2 GB that no budget knew of.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.runtime.codecs.encoder_limits import working_bytes
from services.runtime.pipeline.budgets import Charge, HeldMemory
from services.runtime.pipeline.cost import BYTES_PER_PIXEL, RequestCost, output_bytes_for
from tests.harness import ROOT

SLACK = 4 * 2**20  # the allocator's pages and an encoder's first-call tables: in the baseline


def _held_by_encoding(tmp_path, fmt: str, side: int, quality: int) -> tuple[int, int]:
    """Peak RSS growth of a fresh process encoding side x side noise as a service does
    (encode_image), after a warm-up on a small picture, and the answer's length."""
    script = ("import sys, numpy as np\n"
              "from services.runtime.codecs.images import encode_image\n"
              "def kib(name):\n"
              "    return next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith(name))\n"
              "fmt, side, quality = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
              "rgb = np.random.default_rng(1).integers(0, 256, (side, side, 3), dtype=np.uint8)\n"
              "encode_image(rgb[:64, :64].copy(), fmt, quality)\n"
              "open('/proc/self/clear_refs', 'w').write('5')\n"
              "before = kib('VmRSS:')\n"
              "data, _ = encode_image(rgb, fmt, quality)\n"
              "print((kib('VmHWM:') - before) * 1024, len(data))\n")
    out = subprocess.run([sys.executable, "-c", script, fmt, str(side), str(quality)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    held, length = map(int, out.stdout.split())
    return held, length


@pytest.mark.parametrize("fmt, side", [("png", 2000), ("jpeg", 2000), ("webp", 2000)])
def test_an_answers_encoding_is_charged_what_the_encoder_holds(tmp_path, fmt, side):
    pixels = side * side
    held, length = _held_by_encoding(tmp_path, fmt, side, 100)
    charged = output_bytes_for(pixels) + working_bytes(pixels, fmt)
    assert length <= output_bytes_for(pixels)          # the answer is within its own charge
    assert held <= charged + SLACK, (held, charged)
    if fmt == "webp":
        assert held > 2.5 * BYTES_PER_PIXEL * pixels, held  # more than the answer's charge: the gap was real


def test_the_request_holds_the_encoder_of_its_format_for_its_largest_picture():
    def held(**said) -> int:
        return RequestCost(None, Charge(HeldMemory(2**34))).check(items=4, output_pixels=4 * 10**6, **said).held_bytes

    png = held()
    assert png == held(answer_format="png") == (BYTES_PER_PIXEL * 4 * 10**6 + output_bytes_for(4 * 10**6)
                                                 + working_bytes(10**6, "png"))
    assert held(answer_format="webp") - png == working_bytes(10**6, "webp") - working_bytes(10**6, "png")
    assert held(answer_format="webp", encoded_pixels=3 * 10**6) - png == (working_bytes(3 * 10**6, "webp")
                                                                          - working_bytes(10**6, "png"))
    assert RequestCost(None, Charge(HeldMemory(2**34))).check(items=1, output_bytes=5000).held_bytes == 5000
