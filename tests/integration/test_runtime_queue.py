"""The model side of the runtime in a real uvicorn process: admission (503 beyond max_queue,
a burst cannot pass together), deadlines (504, never run), clients that leave while queued,
batches (oldest first, compatible items, several items per request), an item's failure,
retries item by item, out of memory, cancellation. The scripted backend records every id
the model sees, so each test checks what reached the model, not only what came back."""

from __future__ import annotations

import concurrent.futures
import socket
import time

import httpx
import pytest

from tests.images import small_png
from tests.scripted_service import APP, hold_model, parallel, post, seen, wait_for
from tests.service_harness import ServiceProcess


def test_queue_limit_gives_503_with_retry_after(tmp_path):
    with ServiceProcess(APP, {"max_queue": 2, "max_batch_size": 1}, tmp_path) as svc:
        blocker = hold_model(svc, 4)  # longer than the burst takes to arrive on a loaded machine
        rs = parallel([lambda i=i: post(svc, f"?id={i}") for i in range(8)])
        codes = sorted(r.status_code for r in rs)
        assert codes == [200, 200] + [503] * 6, codes
        r503 = next(r for r in rs if r.status_code == 503)
        assert r503.headers["retry-after"] == "1" and r503.json()["error"]["code"] == "overloaded"
        assert blocker.result().status_code == 200
        assert post(svc, "?id=after").status_code == 200  # still serving


def test_a_burst_cannot_pass_admission_together(tmp_path):
    """Admission counts a request the moment it arrives, before its body or decode: a
    burst of 40 against max_queue 4 admits at most max_queue plus what the model takes."""
    with ServiceProcess(APP, {"max_queue": 4, "max_batch_size": 1, "cpu_workers": 1}, tmp_path) as svc:
        hold_model(svc, 6)  # longer than the burst takes to arrive on a loaded machine
        rs = parallel([lambda i=i: post(svc, f"?id=x{i}&decode_sleep=0.05") for i in range(40)])
        ok = sum(r.status_code == 200 for r in rs)
        assert sum(r.status_code == 503 for r in rs) + ok == 40
        assert 1 <= ok <= 4, ok
        assert len([i for i in seen(svc)["seen"] if i.startswith("x")]) == ok


@pytest.mark.parametrize("batching", [False, True])
def test_deadline_gives_504_and_the_work_is_never_started(tmp_path, batching):
    settings = {"request_timeout_s": 0.8, "batching": batching, "max_batch_size": 4 if batching else 1}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        blocker = hold_model(svc, 1.5, "slow")
        late = post(svc, "?id=late")
        assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded"
        assert blocker.result().status_code == 200
        time.sleep(0.2)
        assert "late" not in seen(svc)["seen"]
        assert httpx.get(svc.url + "/stats").json()["queue_depth"] == 0


def _quit_while_queued(svc, rid: str) -> None:
    body = small_png()
    s = socket.create_connection(("127.0.0.1", svc.port))
    s.sendall(f"POST /api/v1/echo?id={rid} HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n".encode()
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: httpx.get(svc.url + "/stats").json()["items_pending"] >= 1, what=f"{rid} queued")
    s.close()


@pytest.mark.parametrize("batching", [False, True])
def test_client_disconnecting_while_queued_never_reaches_the_model(tmp_path, batching):
    settings = {"batching": batching, "max_batch_size": 4 if batching else 1}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        blocker = hold_model(svc, 4)
        _quit_while_queued(svc, "quitter")
        wait_for(lambda: httpx.get(svc.url + "/stats").json()["queue_depth"] == 0, what="the quitter dropped")
        assert blocker.result().status_code == 200
        assert post(svc, "?id=next").status_code == 200
        assert seen(svc)["seen"] == ["blocker", "next"]
        metrics = httpx.get(svc.url + "/metrics").text
        assert 'onecard_dropped_total{reason="client_gone"} 1.0' in metrics


def test_a_dropped_request_behind_others_frees_its_slot_at_once(tmp_path):
    """Dropping a queued request with others ahead of it (numpy payloads compare badly by
    value) must take it out of the queue now, not when the batch loop reaches it."""
    with ServiceProcess(APP, {"max_queue": 3, "max_batch_size": 1}, tmp_path) as svc:
        blocker = hold_model(svc, 60)  # released once the newcomer is in
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            ahead = [pool.submit(post, svc, f"?id=ahead{i}") for i in range(2)]
            wait_for(lambda: httpx.get(svc.url + "/stats").json()["items_pending"] == 2, what="two queued")
            _quit_while_queued(svc, "quitter")
            wait_for(lambda: httpx.get(svc.url + "/stats").json()["queue_depth"] == 2, what="slot freed")
            assert httpx.get(svc.url + "/stats").json()["items_pending"] == 2  # out of the queue too
            # the freed slot admits a newcomer (else: a spurious 503)
            newcomer = pool.submit(post, svc, "?id=newcomer")
            wait_for(lambda: httpx.get(svc.url + "/stats").json()["items_pending"] == 3, what="the newcomer queued")
            blocker.release()
            assert [f.result().status_code for f in ahead] == [200, 200]
            assert newcomer.result().status_code == 200
        assert blocker.result().status_code == 200
        assert "quitter" not in seen(svc)["seen"]


def test_batches_start_with_the_oldest_and_take_compatible_items_in_order(tmp_path):
    settings = {"batching": True, "max_batch_size": 3}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        # seven requests queued one by one took over 4 s on a loaded machine: held until all are in
        blocker = hold_model(svc, 60)
        order = ["a1", "b1", "a2", "a3", "b2", "a4", "b3"]
        with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
            futs = []
            for rid in order:
                futs.append(pool.submit(post, svc, f"?id={rid}&key={rid[0]}"))
                n = len(futs)
                wait_for(lambda n=n: httpx.get(svc.url + "/stats").json()["items_pending"] == n,
                         what=f"{rid} queued")
            blocker.release()
            assert all(f.result().status_code == 200 for f in futs)
        assert blocker.result().status_code == 200
        batches = seen(svc)["batches"][1:]
        # the oldest (a1) heads the first batch with the a's behind it; then b1 (now oldest)
        assert batches == [["a1", "a2", "a3"], ["b1", "b2", "b3"], ["a4"]]


def test_batching_groups_requests_and_each_caller_gets_its_own_result(tmp_path):
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 4, "max_wait_ms": 50}, tmp_path) as svc:
        rs = parallel([lambda i=i: post(svc, f"?id=r{i}&sleep=0.2") for i in range(12)])
        assert all(r.status_code == 200 for r in rs)
        assert [r.json()["id"] for r in rs] == [f"r{i}" for i in range(12)]
        batches = seen(svc)["batches"]
        assert max(len(b) for b in batches) == 4 and len(batches) < 12
        assert 'onecard_batch_size_bucket{le="4.0"}' in httpx.get(svc.url + "/metrics").text


def test_a_request_with_several_items_gets_them_all_in_order(tmp_path):
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 3}, tmp_path) as svc:
        r = post(svc, "?id=m&items=5")
        assert r.status_code == 200 and r.json()["id"] == [f"m.{n}" for n in range(5)]
        assert seen(svc)["batches"] == [["m.0", "m.1", "m.2"], ["m.3", "m.4"]]


def test_a_bad_item_fails_alone_in_its_batch(tmp_path):
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 4, "max_wait_ms": 100}, tmp_path) as svc:
        rs = parallel([lambda i=i: post(svc, f"?id=r{i}&mode={'bad' if i == 1 else ''}") for i in range(4)])
        assert [r.status_code for r in rs] == [200, 422, 200, 200]
        assert rs[1].json()["error"]["message"] == "item r1 is bad"


def test_a_batch_whose_model_call_raises_is_retried_item_by_item(tmp_path):
    """The OOM item makes the whole batch call raise; the others still succeed alone."""
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 4}, tmp_path) as svc:
        blocker = hold_model(svc, 3)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futs = [pool.submit(post, svc, f"?id=r{i}&mode={'oom' if i == 1 else ''}") for i in range(3)]
            codes = [f.result().status_code for f in futs]
        assert blocker.result().status_code == 200
        assert codes == [200, 503, 200]
        batches = seen(svc)["batches"][1:]
        assert sorted(batches[0]) == ["r0", "r1", "r2"]  # one call for all three, which raised
        assert sorted(batches[1:]) == [["r0"], ["r1"], ["r2"]]  # then each alone


def test_out_of_memory_gives_503_and_the_service_carries_on(tmp_path):
    with ServiceProcess(APP, {"max_batch_size": 1}, tmp_path) as svc:
        r = post(svc, "?id=big&mode=oom")
        assert r.status_code == 503 and r.json()["error"]["code"] == "out_of_memory"
        assert "retry-after" in r.headers
        assert post(svc, "?id=next").status_code == 200
        assert seen(svc)["freed"] == 1
        assert httpx.get(svc.url + "/healthz").status_code == 200


def test_a_cancelled_item_stops_only_when_its_whole_batch_is_cancelled(tmp_path):
    """Two cancellable items share a batch: one client leaves, the other's result still
    comes; when the last one leaves, the model call stops between 'steps'."""
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 2}, tmp_path) as svc:
        blocker = hold_model(svc, 3)
        body = small_png()

        def raw_request(rid):
            s = socket.create_connection(("127.0.0.1", svc.port))
            s.sendall(f"POST /api/v1/echo?id={rid}&sleep=1.5&cancellable=1 HTTP/1.1\r\nHost: x\r\n"
                      f"Content-Type: image/png\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            return s

        leaver = raw_request("leaver")
        wait_for(lambda: httpx.get(svc.url + "/stats").json()["items_pending"] == 1, what="leaver queued")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stayer = pool.submit(post, svc, "?id=stayer&sleep=1.5&cancellable=1")
            wait_for(lambda: ["leaver", "stayer"] in seen(svc)["batches"], what="the shared batch")
            leaver.close()
            r = stayer.result()
        assert r.status_code == 200 and r.json()["stopped"] is False
        assert blocker.result().status_code == 200
        blocker = hold_model(svc, 0.6, "blocker2")
        both = [raw_request("x1")]
        wait_for(lambda: httpx.get(svc.url + "/stats").json()["items_pending"] == 1, what="x1 queued")
        both.append(raw_request("x2"))
        wait_for(lambda: ["x1", "x2"] in seen(svc)["batches"], what="the second batch")
        for s in both:
            s.close()
        wait_for(lambda: "x1" in seen(svc)["stopped"], timeout=1.4, what="the call stopped between steps")
        assert blocker.result().status_code == 200


def test_max_queue_zero_serves_one_at_a_time_and_refuses_waiters(tmp_path):
    with ServiceProcess(APP, {"max_queue": 0, "max_batch_size": 1}, tmp_path) as svc:
        assert post(svc, "?id=alone").status_code == 200  # nothing to wait for: served
        blocker = hold_model(svc, 0.6, "first")
        assert post(svc, "?id=second").status_code == 503
        assert blocker.result().status_code == 200
