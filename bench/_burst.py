import sys, httpx, time, concurrent.futures, numpy as np, io
sys.path.insert(0, ".")
from bench.common import service
from tests.images import astronaut, encode
from PIL import Image
import psutil
big = encode(np.asarray(Image.fromarray(astronaut()).resize((1024, 1024))), "JPEG", quality=90)
settings = {"backend": "style", "max_side": 1024, "memory_budget_bytes": int(sys.argv[1]) if len(sys.argv) > 1 else None}
with service("services.img2img.app:create_app", settings, threads=2) as svc:
    info = httpx.get(svc.url + "/info").json()
    print("budgets", info["memory_budgets"])
    st = httpx.get(svc.url + "/stats").json()["batching"]["cost"]
    print("memory model", st["memory"], "time", st["time"]["ms_by_batch_size"])
    proc = psutil.Process(svc.proc.pid)
    print("rss start MB", proc.memory_info().rss // 2**20)
    t = time.time()
    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        rs = list(pool.map(lambda _: httpx.post(svc.url + "/api/v1/img2img?style=3", content=big, headers={"content-type": "image/jpeg"}, timeout=300), range(17)))
    print("statuses", [r.status_code for r in rs], "in", round(time.time() - t, 1))
    print([r.json()["error"]["message"][:150] for r in rs if r.status_code != 200][:2])
    hwm = [l for l in open(f"/proc/{svc.proc.pid}/status") if l.startswith("VmHWM")]
    print("rss end MB", proc.memory_info().rss // 2**20, hwm)
    st = httpx.get(svc.url + "/stats").json()["batching"]
    print("batches", st["batches"], st["mean_batch_size"], st["cost"]["held_peak_bytes"])
