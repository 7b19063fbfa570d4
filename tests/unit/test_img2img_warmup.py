"""What SD's warm-up runs, without loading a model: the batch curve and the memory fit are
taken on these items, so each must run real denoising steps on the device."""

from __future__ import annotations

import pytest

from services.img2img.progress import Progress
from services.img2img.sd import DiffusersBackend
from services.img2img.settings import Img2ImgSettings


def items(device: str, **settings):
    backend = DiffusersBackend(Img2ImgSettings(backend="diffusers", model_path="/unused", **settings), Progress())
    backend.device = device
    return backend.warmup_items()


@pytest.mark.parametrize("default_steps", [1, 2, 20])
def test_the_cuda_warm_up_item_runs_the_model_whatever_the_default_steps(default_steps):
    """default_steps 1 at strength 0.75 is no denoising step: the item went round the model
    (kind "identity"), the curve measured a copy, and the first request compiled the kernels."""
    (item,) = items("cuda", default_steps=default_steps)
    assert item.key[0] == "img2img" and int(item.steps * item.strength) >= 1
    assert item.key[1] == (512, 512) and item.steps >= default_steps


def test_the_cuda_warm_up_item_is_at_most_max_side_and_the_cpu_one_small():
    (item,) = items("cuda", max_side=200)
    assert item.key[1] == (200, 200)
    (item,) = items("cpu", default_steps=1)
    assert item.key[0] == "img2img" and item.key[1] == (64, 64)
