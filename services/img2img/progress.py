"""The running generation, in the shape of the AUTOMATIC1111 webui's shared state.

Written by the model thread (begin, advance, end), read by /sdapi/v1/progress on the
event loop, and told to stop by /sdapi/v1/interrupt and /skip: a lock keeps the
snapshot consistent. An interrupt applies to the generation running when it arrives;
the next one starts clean, as in the webui.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class Progress:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.job = ""
        self.job_count = 0
        self.job_no = 0
        self.job_timestamp = "0"
        self.sampling_step = 0
        self.sampling_steps = 0
        self.started = 0.0
        self.interrupted = False
        self.skipped = False
        self.textinfo: str | None = None
        self.preview: Any = None          # a callable giving the current image (PIL), or None
        self.running = False

    # ---- the model thread -------------------------------------------------------------
    def begin(self, jobs: list[str], steps: int, textinfo: str | None = None) -> None:
        with self._lock:
            self.running = True
            self.job = jobs[0] if jobs else ""
            self.job_count = max(1, len(jobs))
            self.job_no = 0
            self.job_timestamp = time.strftime("%Y%m%d%H%M%S")
            self.sampling_step = 0
            self.sampling_steps = steps
            self.started = time.time()
            self.interrupted = False
            self.skipped = False
            self.textinfo = textinfo
            self.preview = None

    def advance(self, step: int, preview: Any = None) -> None:
        with self._lock:
            self.sampling_step = step
            if preview is not None:
                self.preview = preview

    def end(self) -> None:
        with self._lock:
            self.running = False
            self.job = ""
            self.job_count = 0
            self.job_no = 0
            self.sampling_step = 0
            self.sampling_steps = 0
            self.preview = None
            self.textinfo = None

    def should_stop(self) -> bool:
        return self.interrupted or self.skipped

    # ---- the API ----------------------------------------------------------------------
    def interrupt(self) -> None:
        with self._lock:
            if self.running:
                self.interrupted = True

    def skip(self) -> None:
        with self._lock:
            if self.running:
                self.skipped = True

    def state(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "interrupted": self.interrupted, "stopping_generation": False,
                "job": self.job, "job_count": self.job_count, "job_timestamp": self.job_timestamp,
                "job_no": self.job_no, "sampling_step": self.sampling_step, "sampling_steps": self.sampling_steps}

    def snapshot(self) -> tuple[dict[str, Any], Any]:
        """webui's ProgressResponse fields, and the preview callable (rendered off the loop)."""
        with self._lock:
            state = self.state()
            if self.job_count == 0:
                return {"progress": 0.0, "eta_relative": 0.0, "state": state, "current_image": None,
                        "textinfo": self.textinfo}, None
            progress = 0.01 + self.job_no / self.job_count
            if self.sampling_steps > 0:
                progress += self.sampling_step / self.sampling_steps / self.job_count
            elapsed = max(0.0, time.time() - self.started)
            eta = elapsed / progress - elapsed if progress > 0 else 0.0
            return {"progress": round(min(progress, 1.0), 4), "eta_relative": round(max(eta, 0.0), 3),
                    "state": state, "current_image": None, "textinfo": self.textinfo}, self.preview
