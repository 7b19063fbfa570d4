"""The webui's progress state over a request's model calls, and the picture geometry of
webui inpainting: plain code, driven directly."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from services.img2img import webui_images as wi
from services.img2img.progress import Progress


def test_progress_spans_a_request_of_several_calls():
    p = Progress()
    p.expect("a", "img2img", images=4, batch_size=2)
    p.begin(["a", "a"], steps=10)
    p.advance(5)
    doc, _ = p.snapshot()
    assert (doc["state"]["job"], doc["state"]["job_count"], doc["state"]["job_no"]) == ("Batch 1 out of 2", 2, 0)
    assert doc["progress"] == pytest.approx(0.01 + (0 + 2 * 0.5) / 4)
    p.end()
    assert p.snapshot()[0]["state"]["job_count"] == 0  # idle between calls
    p.begin(["a", "a"], steps=10)
    p.advance(10)
    doc, _ = p.snapshot()
    assert (doc["state"]["job"], doc["state"]["job_no"], doc["progress"]) == ("Batch 2 out of 2", 1, 1.0)
    p.end()
    p.begin(["b"], steps=3)  # not announced (the native route): one call, one job
    assert p.snapshot()[0]["state"]["job"] == "scripts_img2img"
    p.end()


def test_interrupt_stops_the_running_requests_and_skip_only_the_call():
    p = Progress()
    for job in ("run", "begun", "waiting"):
        p.expect(job, "txt2img", images=4, batch_size=1)
    p.begin(["begun"], steps=2)
    p.end()                      # "begun" has one image of four done
    p.begin(["run", "run"], steps=5)
    p.skip()
    assert p.should_stop() and not p.stopped("run")
    p.end()
    p.begin(["run"], steps=5)    # a new call starts clean
    assert not p.should_stop()
    p.interrupt()
    assert p.should_stop() and p.stopped("run") and not p.stopped("begun") and not p.stopped("waiting")
    p.end()
    p.interrupt()                # between calls: the requests that have begun
    assert p.stopped("begun") and not p.stopped("waiting")
    assert p.snapshot()[0]["state"]["interrupted"] is True
    p.begin(["waiting"], steps=5)
    assert p.snapshot()[0]["state"]["interrupted"] is False


def test_previews_follow_the_options():
    p = Progress()
    p.preview_every = 3
    assert [s for s in range(1, 10) if p.wants_preview(s)] == [3, 6, 9]
    p.previews = False
    assert not any(p.wants_preview(s) for s in range(1, 10))


@pytest.mark.parametrize("box,size,expected", [
    ((40, 20, 50, 30), (64, 32), (35, 20, 55, 30)),      # widened to 2:1, centred
    ((0, 0, 10, 10), (64, 32), (0, 0, 20, 10)),          # shifted back inside at the left
    ((90, 0, 100, 10), (64, 32), (80, 0, 100, 10)),      # and at the right
    ((10, 5, 90, 15), (32, 32), (10, 0, 90, 50)),        # taller than the picture: clipped to it
])
def test_crop_region_keeps_the_generation_aspect_inside_the_picture(box, size, expected):
    mask = Image.new("L", (100, 50), 0)
    mask.paste(255, box)
    assert wi.crop_region(mask, 0, size) == expected


def test_crop_region_padding_and_empty_mask():
    mask = Image.new("L", (100, 100), 0)
    assert wi.crop_region(mask, 8, (64, 64)) is None
    mask.paste(255, (40, 40, 50, 50))
    assert wi.crop_region(mask, 8, (64, 64)) == (32, 32, 58, 58)


def test_resize_and_fill_stretches_the_edges_into_the_bars():
    img = np.zeros((10, 20, 3), dtype=np.uint8)
    img[0], img[-1] = (255, 0, 0), (0, 0, 255)   # red top row, blue bottom row
    out = np.asarray(wi.resize_image(Image.fromarray(img), (20, 20), 2))
    assert out.shape == (20, 20, 3)
    assert (out[:5] == (255, 0, 0)).all() and (out[-5:] == (0, 0, 255)).all()


def test_overlay_keeps_the_base_outside_the_mask_exactly():
    rng = np.random.default_rng(0)
    base = Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))
    new = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    mask = Image.new("L", (60, 40), 0)
    mask.paste(255, (20, 10, 30, 20))
    out = np.asarray(wi.Overlay(base, mask, box=(16, 6, 34, 24)).apply(new))
    keep = np.asarray(mask) == 0
    assert np.array_equal(out[keep], np.asarray(base)[keep])
    assert not np.array_equal(out[~keep], np.asarray(base)[~keep])


def test_fill_takes_the_colours_around_the_mask():
    img = Image.new("RGB", (64, 64), (200, 40, 10))
    img.paste((0, 0, 0), (24, 24, 40, 40))        # what is under the mask must not show through
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (20, 20, 44, 44))
    filled = np.asarray(wi.fill_masked(img, mask, wi.FILL)).astype(int)
    assert np.abs(filled[24:40, 24:40] - (200, 40, 10)).max() <= 6  # 8-bit premultiplied rounding
    assert np.array_equal(np.asarray(wi.fill_masked(img, mask, wi.ORIGINAL)), np.asarray(img))
    grey = np.asarray(wi.fill_masked(img, mask, wi.LATENT_NOTHING))
    assert (grey[24:40, 24:40] == 128).all() and np.array_equal(grey[:20], np.asarray(img)[:20])
