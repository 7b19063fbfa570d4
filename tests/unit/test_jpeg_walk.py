"""The JPEG marker walk on hand-built byte strings: what counts as a segment and a scan,
where the walk stops, and the exact limits (docs/mutation-testing.md lists the mutants
these were written against). Real encoder output is in test_picture_codec.py."""

from __future__ import annotations

import pytest

from services.runtime.codecs.jpeg import JpegLimitError, JpegShape, walk

SOI, EOI = b"\xff\xd8", b"\xff\xd9"


def seg(marker: int, payload: bytes = b"") -> bytes:
    """A header segment: 0xFF, the marker, a big-endian length that counts itself."""
    return bytes((0xFF, marker)) + (len(payload) + 2).to_bytes(2, "big") + payload


COM = seg(0xFE, b"ab")                       # a comment: 6 bytes
SOS = seg(0xDA, b"\x01\x01\x00\x00\x3f\x00")  # a scan header
# Entropy-coded data: a stuffed 0xFF00 and a restart marker are not markers.
ENTROPY = b"\x12\x34\xff\x00\x56\xff\xd0\x78\x9a"


def shape(data: bytes, max_scans: int = 100, max_markers: int = 100) -> JpegShape:
    return walk(data, max_scans, max_markers)


@pytest.mark.parametrize("data", [b"", b"\xff", SOI, SOI + b"\xff", b"\x89PNG\r\n\x1a\n" + COM * 3,
                                  b"\x00\xd8" + COM * 3 + EOI, b"\xff\x00" + COM * 3 + EOI])
def test_anything_without_a_start_of_image_is_not_walked(data):
    assert shape(data) == JpegShape(0, 0, False)


def test_segments_and_scans_are_counted_exactly():
    data = SOI + COM + seg(0xC0, b"\x08" * 9) + SOS + ENTROPY + SOS + ENTROPY + EOI
    assert shape(data) == JpegShape(2, 4, False)


@pytest.mark.parametrize("marker,progressive", [(0xC0, False), (0xC1, False), (0xC2, True), (0xC3, False),
                                                (0xC6, True), (0xCA, True), (0xCE, True)])
def test_progressive_is_any_progressive_start_of_frame(marker, progressive):
    assert shape(SOI + seg(marker, b"\x08" * 9) + SOS + ENTROPY + EOI).progressive is progressive


def test_the_walk_stops_at_the_end_of_image():
    """Whatever follows EOI (a second image, trailing junk) is not this image's structure."""
    data = SOI + COM + EOI + COM * 5 + SOS + ENTROPY + EOI
    assert shape(data) == JpegShape(0, 1, False)


def test_fill_bytes_before_a_marker_are_skipped():
    data = SOI + b"\xff\xff\xff" + COM + b"\xff" + SOS + ENTROPY + EOI
    assert shape(data) == JpegShape(1, 2, False)


def test_standalone_markers_have_no_length_and_the_walk_goes_on():
    data = SOI + b"\xff\x01" + b"\xff\xd3" + COM + SOS + ENTROPY + EOI
    assert shape(data) == JpegShape(1, 4, False)


def test_a_segment_length_is_two_big_endian_bytes():
    long_comment = seg(0xFE, bytes(300))  # length 0x012E: the high byte matters
    assert shape(SOI + long_comment + COM + EOI) == JpegShape(0, 2, False)


def test_a_segment_is_read_when_it_ends_exactly_at_the_end_of_the_data():
    assert shape(SOI + COM + seg(0xFE)) == JpegShape(0, 2, False)   # the last one: 4 bytes, no payload
    assert shape(SOI + COM + b"\xff\xfe\x00") == JpegShape(0, 1, False)  # too short to be one


def test_an_empty_segment_is_valid_and_a_length_below_two_ends_the_walk():
    assert shape(SOI + seg(0xFE) + COM + EOI) == JpegShape(0, 2, False)
    assert shape(SOI + COM + b"\xff\xfe\x00\x01" + COM * 3 + EOI) == JpegShape(0, 2, False)


def test_junk_between_segments_is_skipped_as_libjpeg_skips_it():
    """libjpeg decodes past extraneous bytes before a marker (0xFF00 among them): so is the
    walk, or they would hide the scans after them from the limits."""
    assert shape(SOI + COM + b"\x00\x00\x00\x00" + COM * 3) == JpegShape(0, 4, False)
    assert shape(SOI + COM + b"\xff\x00\x12" + b"\xff\xff" + COM + SOS + ENTROPY + EOI) == JpegShape(1, 3, False)


def test_malformed_structure_ends_the_walk_with_what_was_counted():
    assert shape(SOI + COM + b"\x00\x00\x00\x00" + b"\x12" * 8) == JpegShape(0, 1, False)  # no marker after
    truncated = SOI + COM + SOS + b"\x12\x34\xff\x00\x56"  # entropy data with no marker after it
    assert shape(truncated) == JpegShape(1, 2, False)


def test_limits_are_inclusive_and_the_error_says_what_and_how_many():
    data = SOI + COM * 4 + SOS + ENTROPY + SOS + ENTROPY + EOI  # 6 segments, 2 scans
    assert shape(data, max_scans=2, max_markers=6) == JpegShape(2, 6, False)
    with pytest.raises(JpegLimitError) as err:
        shape(data, max_scans=100, max_markers=5)
    assert (err.value.what, err.value.count, err.value.limit) == ("JPEG segments", 6, 5)
    assert str(err.value) == "JPEG segments: 6 is over the limit of 5"
    with pytest.raises(JpegLimitError) as err:
        shape(data, max_scans=1, max_markers=100)
    assert (err.value.what, err.value.count, err.value.limit) == ("JPEG scans", 2, 1)
    assert str(err.value) == "JPEG scans: 2 is over the limit of 1"
