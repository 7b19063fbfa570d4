"""A running diffusers generation seen and steered through the webui API by its real
clients: /sdapi/v1/progress in the webui's shape (steps advancing, current_image,
textinfo), interrupt and skip between steps with the webui's answers, sd-backend-client's
cancellable handles, and a request's images run as batches."""

from __future__ import annotations

import base64
import io
import re

import httpx
import pytest
import webuiapi
from PIL import Image
from sd_backend_client.api.a1111_webservice import A1111Webservice
from sd_backend_client.api.shared_data.generation_handle import GenerationStatus
from sd_backend_client.api.webui.diffusion_request_body import DiffusionRequestBody
from sd_backend_client.errors import GenerationError

from tests.models import shared_tiny_sd
from tests.service_harness import ServiceProcess
from tests.webui_helpers import (
    APP,
    InThread,
    ProgressWatcher,
    diffusers_settings,
    picture,
    progress,
    style_settings,
    wait_for,
)


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    model = shared_tiny_sd(tmp_path_factory)
    with ServiceProcess(APP, diffusers_settings(model), tmp_path_factory.mktemp("svc")) as service:
        yield service


def client(svc) -> webuiapi.WebUIApi:
    return webuiapi.WebUIApi(baseurl=svc.url + "/sdapi/v1")


def img2img(api: webuiapi.WebUIApi, steps: int, **kw):
    return api.img2img(images=[picture(64, 64)], width=64, height=64, denoising_strength=1.0, steps=steps, **kw)


def batch_metrics(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    count = float(re.search(r"^onecard_batch_size_count (\S+)$", text, re.M).group(1))
    total = float(re.search(r"^onecard_batch_size_sum (\S+)$", text, re.M).group(1))
    return count, total


def test_progress_during_a_generation(sd):
    api = client(sd)
    job = InThread(lambda: img2img(api, 400, batch_size=2, seed=1))
    try:
        wait_for(lambda: progress(sd.url)["state"]["sampling_step"] >= 11, "11 steps")  # previews every 10 steps
        doc = progress(sd.url)
        state = doc["state"]
        assert (state["job"], state["job_count"], state["job_no"], state["sampling_steps"]) == \
            ("scripts_img2img", 1, 0, 400)
        assert state["interrupted"] is False and state["skipped"] is False and re.fullmatch(r"\d{14}",
                                                                                           state["job_timestamp"])
        assert 0.01 < doc["progress"] < 1 and doc["eta_relative"] > 0
        assert doc["textinfo"] == "img2img: 2 image(s) at 64x64"
        preview = Image.open(io.BytesIO(base64.b64decode(doc["current_image"])))
        assert preview.format == "PNG" and preview.size == (64, 64)
        assert progress(sd.url, skip_current_image="true")["current_image"] is None
        wait_for(lambda: progress(sd.url)["state"]["sampling_step"] > state["sampling_step"], "the next step")
        body = A1111Webservice(sd.url).progress_check()  # the client's own validation, mid-generation
        assert body.current_image and body.state.sampling_step > state["sampling_step"]
        assert body.state.job_count == 1 and body.textinfo == doc["textinfo"]
    finally:
        api.interrupt()
    assert len(job.result().images) == 2
    assert progress(sd.url)["state"]["job_count"] == 0


def test_interrupt_answers_with_what_ran_and_starts_nothing_more(sd):
    api = client(sd)
    watcher = ProgressWatcher(sd.url)
    job = InThread(lambda: img2img(api, 999, batch_size=2, n_iter=2, seed=20))
    try:
        wait_for(lambda: progress(sd.url)["state"]["sampling_step"] >= 3, "3 steps")
        assert api.interrupt() == {}
        r = job.result()
    finally:
        watcher.stop()
    assert len(r.images) == 2  # the first batch as far as it got; the second never started
    assert r.info["all_seeds"] == [20, 21, 22, 23]  # the webui reports the seeds it was asked for
    first, second = watcher.steps_seen(0), watcher.steps_seen(1)
    assert first and max(first) < 500 and second == []
    state = progress(sd.url)["state"]
    assert state["interrupted"] is True and state["job_count"] == 0
    after = img2img(api, 3, seed=1)  # the next request starts clean
    assert len(after.images) == 1 and progress(sd.url)["state"]["interrupted"] is False


def test_skip_ends_the_running_batch_and_goes_on(sd):
    api = client(sd)
    watcher = ProgressWatcher(sd.url)
    job = InThread(lambda: img2img(api, 200, batch_size=2, n_iter=2, seed=30))
    try:
        wait_for(lambda: progress(sd.url)["state"]["sampling_step"] >= 3, "3 steps")
        assert api.skip() is None
        r = job.result()
    finally:
        watcher.stop()
    assert len(r.images) == 4 and r.info["all_seeds"] == [30, 31, 32, 33]
    first, second = watcher.steps_seen(0), watcher.steps_seen(1)
    assert first and max(first) < 100  # skipped early
    assert second and max(second) > 100  # the next batch ran on
    assert {s["job"] for s in watcher.seen if s["job_count"]} == {"Batch 1 out of 2", "Batch 2 out of 2"}


def test_sd_backend_client_cancels_a_running_job(sd):
    ws = A1111Webservice(sd.url)
    handle = ws.submit_txt2img(DiffusionRequestBody(prompt="x", steps=999, width=64, height=64, seed=5))
    wait_for(lambda: progress(sd.url)["state"]["sampling_step"] >= 3, "3 steps")
    assert handle.poll().status is GenerationStatus.ACTIVE
    assert handle.cancel() is True  # maps to /sdapi/v1/interrupt
    with pytest.raises(GenerationError) as err:
        handle.wait(timeout=60)
    assert err.value.status is GenerationStatus.CANCELLED
    state = progress(sd.url)["state"]
    assert state["interrupted"] is True and state["job_count"] == 0
    done = ws.submit_txt2img(DiffusionRequestBody(prompt="x", steps=2, width=64, height=64, seed=5)).wait(timeout=60)
    assert len(done.images) == 1 and done.seeds == [5]


def test_a_request_runs_as_batches(sd):
    count, total = batch_metrics(sd.url)
    r = img2img(client(sd), 2, batch_size=2, n_iter=2, seed=40)
    assert len(r.images) == 4
    assert batch_metrics(sd.url) == (count + 2, total + 4)  # two model calls of two images (max_batch_size 2)


def test_interrupt_stops_a_style_request_between_its_batches(tmp_path):
    """The style backend runs a request's images as separate calls: an interrupt ends the
    request there, as the webui ends an n_iter run; nothing more of it is run."""
    settings = {**style_settings(), "max_side": 512, "max_images": 64, "max_batch_size": 1}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        api = client(svc)
        job = InThread(lambda: api.img2img(images=[picture(512, 512)], width=512, height=512,
                                           denoising_strength=1.0, batch_size=1, n_iter=64, seed=3))
        wait_for(lambda: progress(svc.url)["state"]["job_no"] >= 1, "the second batch")
        assert api.interrupt() == {}
        r = job.result()
        assert 1 <= len(r.images) < 64, len(r.images)
        assert progress(svc.url)["state"]["job_count"] == 0
        after = api.img2img(images=[picture(64, 64)], width=64, height=64, denoising_strength=1.0, n_iter=2)
        assert len(after.images) == 2  # the next request runs in full
