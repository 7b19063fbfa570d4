"""The cost model against a real memory cgroup: the service reads its limit, plans its budgets
from it, and a burst of big pictures stays within them (no OOM kill, every answer a 200 or
a clear 4xx/503), its memory coming back afterwards."""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import psutil
from PIL import Image

from tests.images import astronaut, encode
from tests.memory_cgroup import memory_cgroup
from tests.service_harness import ServiceProcess

IMG2IMG = "services.img2img.app:create_app"
GIB = 2**30


def test_a_burst_of_big_pictures_stays_within_the_budget_the_cgroup_gives(tmp_path):
    big = encode(np.asarray(Image.fromarray(astronaut()).resize((1024, 1024))), "JPEG", quality=90)
    with memory_cgroup(8 * GIB) as group:
        with ServiceProcess(IMG2IMG, {"backend": "style", "max_side": 1024, "warmup_runs": 1}, tmp_path,
                            threads=2, wrap=group.wrap) as svc:
            budgets = httpx.get(svc.url + "/info").json()["memory_budgets"]
            assert budgets["service_bytes"] == int(8 * GIB * 0.3)
            assert "of the memory limit 8192.0 MiB" in budgets["source"]
            rss_ready = psutil.Process(svc.proc.pid).memory_info().rss
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                rs = list(pool.map(lambda i: httpx.post(f"{svc.url}/api/v1/img2img?style=3", content=big,
                                                        headers={"content-type": "image/jpeg"}, timeout=300),
                                   range(12)))
            assert all(r.status_code in (200, 503) for r in rs), [r.text[:200] for r in rs if r.status_code >= 400]
            assert sum(r.status_code == 200 for r in rs) >= 6
            assert svc.proc.poll() is None and group.oom_kills() == 0
            peak = group.peak()
            assert peak is not None and peak <= budgets["service_bytes"] + 256 * 2**20  # the interpreter's own
            rss_after = psutil.Process(svc.proc.pid).memory_info().rss
            assert rss_after - rss_ready < (peak - rss_ready) / 2  # handed back, not kept at the peak
