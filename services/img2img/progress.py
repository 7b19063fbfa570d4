"""The running generation, in the shape of the AUTOMATIC1111 webui's shared state.

Written by the model thread (begin, advance, end), read by /sdapi/v1/progress on the
event loop, told to stop by /sdapi/v1/interrupt and /skip; a lock keeps each snapshot
consistent. A webui request announces itself (``expect``: how many images, in batches of
how many) so that progress, ``job_no`` and ``job_count`` describe the whole request even
when its images run in several model calls.

As in the webui, ``skip`` ends the running model call (its images come back as far as
they got) and the request goes on with its next batch; ``interrupt`` ends the running
call too, and the images of its requests (or, between two calls, of the requests that
have begun) that have not started are not generated at all. Requests still waiting
start clean. Previews (``current_image``) are the cheap linear projection
of the first image's latents, kept only as often as ``show_progress_every_n_steps`` asks.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_REMEMBERED = 512

# latent channels -> RGB for Stable Diffusion 1.x/2.x latents (the usual "cheap approximation")
_LATENT_RGB = ((0.298, 0.207, 0.208), (0.187, 0.286, 0.173), (-0.158, 0.189, 0.264), (-0.184, -0.271, -0.473))


@dataclass
class _Plan:
    label: str        # "img2img" or "txt2img"
    images: int
    batch_size: int
    done: int = 0
    started: float | None = None
    timestamp: str = field(default_factory=lambda: time.strftime("%Y%m%d%H%M%S"))


class LatentPreview:
    """A picture at `size` from latents (1 x 4 x h x w), made when a client asks, off the model thread."""

    def __init__(self, latents: Any, size: tuple[int, int]):
        self.latents, self.size = latents, size

    def __call__(self):
        import numpy as np
        from PIL import Image
        lat = self.latents[0].float().cpu().numpy()          # 4 x h x w
        rgb = np.einsum("chw,cr->hwr", lat[:4], np.asarray(_LATENT_RGB, dtype=np.float32))
        img = Image.fromarray((np.clip((rgb + 1) / 2, 0, 1) * 255).astype(np.uint8))
        return img.resize(self.size, Image.BILINEAR)


class Progress:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: collections.OrderedDict[str, _Plan] = collections.OrderedDict()
        self._stopped: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.preview_every = 10           # webui's show_progress_every_n_steps (-1: none until the end, 0: none)
        self.previews = True              # webui's live_previews_enable
        self.job = ""
        self.job_count = 0
        self.job_no = 0
        self.job_timestamp = "0"
        self.sampling_step = 0
        self.sampling_steps = 0
        self.interrupted = False
        self.skipped = False
        self.textinfo: str | None = None
        self.preview: Callable | None = None
        self.running = False
        self._jobs: list[str] = []
        self._plan: _Plan | None = None
        self._share = 1                   # this call's images of the plan it reports on

    # ---- webui requests ----------------------------------------------------------------
    def expect(self, job: str, label: str, images: int, batch_size: int) -> None:
        """A webui request of `images` images in batches of `batch_size` is on its way (decode hook)."""
        with self._lock:
            self._plans[job] = _Plan(label, images, max(1, batch_size))
            while len(self._plans) > MAX_REMEMBERED:
                self._plans.popitem(last=False)

    def stopped(self, job: str) -> bool:
        """An interrupt reached this request while part of it ran: the rest is not generated."""
        with self._lock:
            return job in self._stopped

    # ---- the model thread -------------------------------------------------------------
    def begin(self, jobs: list[str], steps: int, textinfo: str | None = None) -> None:
        with self._lock:
            self.running = True
            self._jobs = list(jobs)
            first = jobs[0] if jobs else ""
            plan = self._plans.get(first)
            if plan is None:  # not a webui request: this call is the whole job
                plan = _Plan("img2img", max(1, len(jobs)), max(1, len(jobs)))
            if plan.started is None:
                plan.started = time.time()
            self._plan = plan
            self._share = max(1, sum(1 for j in jobs if j == first))
            self.job_count = max(1, -(-plan.images // plan.batch_size))
            self.job_no = min(plan.done // plan.batch_size, self.job_count - 1)
            self.job = f"Batch {self.job_no + 1} out of {self.job_count}" if self.job_count > 1 else \
                f"scripts_{plan.label}"
            self.job_timestamp = plan.timestamp
            self.sampling_step = 0
            self.sampling_steps = steps
            self.interrupted = False
            self.skipped = False
            self.textinfo = textinfo
            self.preview = None

    def wants_preview(self, step: int) -> bool:
        every = self.preview_every
        return self.previews and every > 0 and step % every == 0

    def advance(self, step: int, preview: Callable | None = None, steps: int | None = None) -> None:
        with self._lock:
            self.sampling_step = step
            if steps:
                self.sampling_steps = steps
            if preview is not None:
                self.preview = preview

    def end(self) -> None:
        with self._lock:
            for job in self._jobs:
                plan = self._plans.get(job)
                if plan is not None:
                    plan.done += 1
                    if plan.done >= plan.images:
                        del self._plans[job]
            self.running = False
            self._jobs = []
            self._plan = None
            self.job = ""
            self.job_count = 0
            self.sampling_step = 0
            self.sampling_steps = 0
            self.preview = None

    def should_stop(self) -> bool:
        return self.interrupted or self.skipped

    # ---- the API ----------------------------------------------------------------------
    def interrupt(self) -> None:
        with self._lock:
            self.interrupted = True
            # the running call's requests; between two calls, the requests that have begun
            jobs = self._jobs if self.running else [j for j, plan in self._plans.items() if plan.done > 0]
            for job in jobs:
                self._stopped[job] = None
                while len(self._stopped) > MAX_REMEMBERED:
                    self._stopped.popitem(last=False)

    def skip(self) -> None:
        with self._lock:
            self.skipped = True

    def state(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "interrupted": self.interrupted, "stopping_generation": False,
                "job": self.job, "job_count": self.job_count, "job_timestamp": self.job_timestamp,
                "job_no": self.job_no, "sampling_step": self.sampling_step, "sampling_steps": self.sampling_steps}

    def snapshot(self) -> tuple[dict[str, Any], Callable | None]:
        """webui's ProgressResponse fields, and the preview callable (rendered off the loop)."""
        with self._lock:
            state = self.state()
            plan = self._plan
            if not self.running or plan is None:
                return {"progress": 0.0, "eta_relative": 0.0, "state": state, "current_image": None,
                        "textinfo": self.textinfo}, None
            fraction = self.sampling_step / self.sampling_steps if self.sampling_steps > 0 else 0.0
            progress = min(1.0, 0.01 + (plan.done + self._share * min(fraction, 1.0)) / plan.images)
            elapsed = max(0.0, time.time() - (plan.started or time.time()))
            eta = elapsed / progress - elapsed
            return {"progress": round(progress, 4), "eta_relative": round(max(eta, 0.0), 3), "state": state,
                    "current_image": None, "textinfo": self.textinfo}, self.preview
